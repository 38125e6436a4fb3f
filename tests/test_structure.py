"""Package structure (docs/design.md §0): one-way imports, no cycles, an independent reference,
the pure-Python parts without the compiled extension, and the package without triton."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "nt_kernels"

# Layers of docs/design.md §0, lowest first: a module may import its own
# sub-package and any lower layer, never a higher one.  nt_reference is below
# all of them and imports nothing from nt_kernels.
LAYERS = [
    ("nt_kernels._extension", "nt_kernels.csr", "nt_kernels.performer"),
    ("nt_kernels.baselines", "nt_kernels.data"),
    ("nt_kernels.backends",),
    ("nt_kernels.ops",),
    ("nt_kernels",),  # the package root: public re-exports of the layers above
    ("nt_kernels.nn",),
    ("nt_kernels.train",),  # training helpers over any model: CUDA graph capture, host-read checks, metrics
    ("nt_kernels.bench",),
    ("nt_kernels.apps",),
    ("nt_kernels.cli",),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer(name: str) -> tuple[int, str]:
    """(rank, layer prefix) of a module: the longest matching prefix of LAYERS."""
    best = None
    for rank, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if name == prefix or name.startswith(prefix + "."):
                if best is None or len(prefix) > len(best[1]):
                    best = (rank, prefix)
    assert best is not None, f"{name} is in no layer of LAYERS (add it to docs/design.md §0 and here)"
    return best


def imports(path: Path, module_level_only: bool) -> set[str]:
    """nt_kernels / nt_reference modules imported by a file (``from pkg import sub`` resolves to pkg.sub)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    if module_level_only:  # module level includes try/if blocks, not function bodies
        nodes = [n for top in tree.body for n in ast.walk(top)
                 if not isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in MODULES else base)
    return {m for m in found if m.split(".")[0] in ("nt_kernels", "nt_reference")}


def test_every_import_points_down_the_layers():
    wrong = []
    for name, path in MODULES.items():
        rank, prefix = layer(name)
        for target in imports(path, module_level_only=False):
            if target.startswith("nt_reference"):
                continue
            target_rank, target_prefix = layer(target)
            if target_prefix != prefix and target_rank >= rank:
                wrong.append(f"{name} -> {target}")
    assert not wrong, "imports against the arrows of docs/design.md §0: " + ", ".join(wrong)


def import_cycle(module_level_only: bool) -> list[str] | None:
    """The first import cycle among the modules (imports in functions too unless module_level_only);
    None when there is none."""
    graph = {name: {t for t in imports(path, module_level_only) if t in MODULES and t != name}
             for name, path in MODULES.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycle_among_the_modules():
    cycle = import_cycle(module_level_only=True)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_through_imports_in_functions():
    cycle = import_cycle(module_level_only=False)
    assert cycle is None, "import cycle (imports in functions included): " + " -> ".join(cycle)


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_reference_imports_nothing_from_nt_kernels():
    proc = run_python(
        "import sys\n"
        "import nt_reference, nt_reference.nn, nt_reference.ops, nt_reference.dropout\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('nt_kernels'))\n"
        "assert not loaded, loaded\n")
    assert proc.returncode == 0, proc.stderr
    for path in (ROOT / "python" / "nt_reference").rglob("*.py"):
        assert "nt_kernels" not in {n.split(".")[0] for n in imports_any(path)}, path


def imports_any(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


BLOCKER = """
import sys


class Block:
    def find_spec(self, name, path=None, target=None):
        if name == {blocked!r} or name.startswith({blocked!r} + "."):
            raise ImportError(f"No module named {{name!r}} (blocked by the test)")
        return None


sys.meta_path.insert(0, Block())
for name in [m for m in sys.modules if m == {blocked!r} or m.startswith({blocked!r} + ".")]:
    del sys.modules[name]
"""


def test_pure_python_parts_import_without_the_extension():
    proc = run_python(BLOCKER.format(blocked="nt_kernels._C") + """
import torch
import nt_kernels
from nt_kernels import NeighbourhoodCSR, orthogonal_random_features, partition_by_area, switch_threshold
from nt_kernels.baselines import partitioned
from nt_kernels.data import powerlaw_graph
csr = NeighbourhoodCSR.from_edge_index(powerlaw_graph(20, 30, seed=1))
assert partition_by_area(*csr.size_hist, threshold=switch_threshold(4, 4))
try:
    nt_kernels.segment_softmax_attention
except ImportError as exc:
    assert "nt_kernels._C" in str(exc) and "make install" in str(exc), exc
else:
    raise AssertionError("an op without the extension must raise ImportError")
""")
    assert proc.returncode == 0, proc.stderr


def test_package_works_without_triton():
    proc = run_python(BLOCKER.format(blocked="triton") + """
import torch
import nt_kernels
from nt_kernels import backends
from nt_kernels.nn import NTConv
assert not backends.has_triton() and not backends.triton_registered()
x = torch.randn(6, 4)
edge_index = torch.tensor([[0, 0, 1, 2, 3, 3, 3], [1, 2, 0, 3, 4, 5, 0]])
out = NTConv(4, 4, heads=2, nb_features=2, threshold=2)(x, edge_index)
out.sum().backward()
assert "triton" not in sys.modules
""")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_is_in_a_layer(name):
    layer(name)
