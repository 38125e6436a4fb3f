"""Results that do not depend on which vector kernels ran (issue 23).

torch's CPU GELU evaluates a vectorised body (Sleef) and a scalar tail (libm)
that round differently, and which elements fall in the tail depends on the
tensor's length, the thread split and the ISA torch picked (AVX2: 8 doubles
per loop step, AVX-512: 16).  Equal pre-activations can therefore give
messages that differ in the last bit, and a max aggregator that decided its
ties on the messages split its gradient differently per machine.  Every
backend now decides max ties on the pre-activations (docs/design.md §9, "Max ties").

* ties built at many layouts (odd lengths, odd channel counts, duplicated
  edges, zeroed output rows, strided inputs) give the same forward and
  gradients in the fused CPU op, the composition and the reference;
* the numerics-sensitive tests rerun in subprocesses under every
  ``NT_KERNELS_CPU_ISA`` path (base, avx2, avx512: issue 31) and every
  ``ATEN_CPU_CAPABILITY`` this CPU has, and so do the CPU kernels' float32 and
  half-precision numerics tests on every path but the default (widest) one,
  which the parent process runs; a path the machine lacks is a skip naming why;
* a seeded training run gives the same losses on every ISA path within
  ``ISA_LOSS_RTOL``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import nt_reference.nn as ref
from helpers import assert_close
from nt_kernels._extension import cpu_paths, extension
from nt_kernels.csr import NeighbourhoodCSR
from nt_kernels.nn import NTConv
from nt_kernels.nn.aggregate import aggregate

REPO = Path(__file__).resolve().parents[1]
CHILD = "NT_KERNELS_ISA_CHILD"  # set in the subprocesses, which must not spawn again
ISA_LOSS_RTOL = 1e-5  # docs/design.md §9, "Max ties": float32 losses on every ISA path


def tie_graph(num_centres: int, repeats: int, seed: int) -> tuple[torch.Tensor, int]:
    """Each centre sends to 1-4 receivers, each edge repeated ``repeats`` times (a multigraph:
    identical messages at one receiver), columns shuffled so that copies sit far apart."""
    gen = torch.Generator().manual_seed(seed)
    num_nodes = num_centres + 3
    parts = []
    for j in range(num_centres):
        receivers = torch.randperm(num_nodes, generator=gen)[: 1 + j % 4]
        parts.append(torch.stack([torch.full_like(receivers, j), receivers]).repeat(1, repeats))
    edge_index = torch.cat(parts, dim=1)
    return edge_index[:, torch.randperm(edge_index.shape[1], generator=gen)], num_nodes


def strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as a non-contiguous view (every other column of a wider tensor)."""
    wide = torch.zeros(t.shape[0], 2 * t.shape[1], dtype=t.dtype)
    wide[:, ::2] = t
    return wide[:, ::2]


# (centres, heads, head dim, edge repeats, strided inputs): odd message counts and channel
# counts put tied values in the vector body and the scalar tail of torch's GELU.
LAYOUTS = [
    pytest.param(7, 1, 3, 2, False, id="E-odd-C3-twice"),
    pytest.param(11, 1, 5, 3, True, id="C5-thrice-strided"),
    pytest.param(13, 3, 3, 2, False, id="C9-heads3"),
    pytest.param(17, 1, 7, 1, True, id="C7-strided"),
    pytest.param(29, 2, 5, 2, False, id="C10-twice"),
    pytest.param(31, 1, 11, 3, True, id="C11-thrice-strided"),
]
ATTENTIONS = [pytest.param(dict(attention="softmax"), id="softmax"),
              pytest.param(dict(attention="switch", nb_features=4, threshold=3), id="switch-t3")]


def run(module, x, edge_index, edge_attr, as_view: bool):
    """Output and the gradients of <output, g> for every parameter, x and edge_attr, by name;
    with ``as_view`` the module reads x and edge_attr as non-contiguous views."""
    x = x.detach().clone().requires_grad_()
    edge_attr = edge_attr.detach().clone().requires_grad_()
    module.zero_grad()
    out = module(strided(x) if as_view else x, edge_index, strided(edge_attr) if as_view else edge_attr)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(out.dtype)
    out.backward(g)
    grads = {name: p.grad for name, p in module.named_parameters()}
    grads.update(x=x.grad, edge_attr=edge_attr.grad)
    return out.detach(), grads


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("centres, heads, head_dim, repeats, as_view", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_max_ties_at_many_layouts_agree_across_backends(centres, heads, head_dim, repeats, as_view, attention,
                                                         dtype):
    """Fused CPU op, composition and reference: the same output and gradients, ties included.

    Half of W_out's rows are zero (every message ties in those channels at each receiver)
    and every edge is repeated (identical messages at one receiver in the other channels)."""
    edge_index, n = tie_graph(centres, repeats, seed=centres)
    channels = heads * head_dim
    kwargs = dict(heads=heads, edge_dim=2, aggr="max", **attention)
    torch.manual_seed(0)
    fused = NTConv(3, channels, fused=True, **kwargs).to(dtype)
    with torch.no_grad():
        fused.lin_out.weight[::2] = 0.0
    composed = NTConv(3, channels, fused=False, **kwargs).to(dtype)
    composed.load_state_dict(fused.state_dict())
    reference = ref.NTConv(3, channels, **kwargs).to(dtype)
    reference.load_state_dict(fused.state_dict())
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(-1, 2, (n, 3), generator=gen).to(dtype)  # discrete features, as minesweeper's
    edge_attr = torch.randn(edge_index.shape[1], 2, generator=gen, dtype=torch.float64).to(dtype)
    want_out, want = run(reference, x, edge_index, edge_attr, as_view)
    for name, module in (("fused", fused), ("composition", composed)):
        out, grads = run(module, x, edge_index, edge_attr, as_view)
        assert_close(out, want_out, msg=f"{name}: output")
        for key in want:
            assert_close(grads[key], want[key], msg=f"{name}: gradient of {key}")


@pytest.mark.parametrize("rows", [5, 17, 33, 67], ids=lambda r: f"E{r}")
@pytest.mark.parametrize("channels", [3, 8, 13], ids=lambda c: f"C{c}")
def test_max_ties_on_keys_survive_torch_gelu_rounding(rows, channels):
    """All rows of a receiver have one pre-activation; torch's GELU may round some positions
    differently, yet with the pre-activations as keys every row gets 1/E of the gradient, in
    the composition's segment_max and in the reference's scatter alike."""
    pre = torch.randn(channels, dtype=torch.float64).expand(rows, channels).contiguous()
    csr = NeighbourhoodCSR.from_edge_index(torch.stack([torch.arange(rows), torch.zeros(rows, dtype=torch.long)]))
    for name, aggregate_fn in (
            ("composition", lambda m: aggregate(m, csr, "max", num_nodes=rows, keys=pre)),
            ("reference", lambda m: ref.aggregate_dense(m, csr.centre, csr.receiver, rows, "max", 1, keys=pre))):
        messages = F.gelu(pre).requires_grad_()
        out = aggregate_fn(messages)
        out[0].sum().backward()
        assert out[0].eq(messages.detach().max(0).values).all(), name
        torch.testing.assert_close(messages.grad, torch.full_like(pre, 1.0 / rows), rtol=0, atol=0, msg=name)


# --------------------------------------------------- every ISA path, in subprocesses
# What each path must prove, chosen so that CI does not pay for the full cross product:
# * every NT_KERNELS_CPU_ISA path: our kernels' numerics, the float32 / half ones (float64 never
#   takes the vector GEMM), and the tie tests, with torch at its own choice;
# * every ATEN_CPU_CAPABILITY: the tie tests (torch's GELU rounding), with our widest path.
# The widest path's kernel tests run in the parent process already (it is the default).
PATHS = ("base", "avx2", "avx512")
NUMERICS_TESTS = ["tests/test_isa.py::test_max_ties_at_many_layouts_agree_across_backends",
                  "tests/test_isa.py::test_max_ties_on_keys_survive_torch_gelu_rounding",
                  "tests/test_ntconv_layer.py::test_max_ties_match_the_reference_layer",
                  "tests/test_ntconv.py::test_max_tie_gradient_is_split_evenly"]
KERNEL_TESTS = ["tests/test_cpu_kernels.py", "tests/test_ntconv_kernel.py"]
KERNEL_FILTER = "not float64 and not bad_input and not checked and not autocast"
# One child runs both lists on a path (one interpreter start and collection, not two): the kernel tests
# through KERNEL_FILTER, the tie tests (all named max_tie*, every parametrisation) whatever the filter says.
NUMERICS_AND_KERNEL_TESTS = [*NUMERICS_TESTS, *KERNEL_TESTS, "-k", f"max_tie or ({KERNEL_FILTER})"]
assert all("::test_max_tie" in test for test in NUMERICS_TESTS), "the -k above keeps the tie tests by name"


def missing_path_reason(isa: str) -> str | None:
    """Why this machine cannot run ``isa``, or None if it can."""
    if isa in cpu_paths()["nt_kernels_isa_paths"]:
        return None
    features = extension().cpu_features()
    if isa == "avx512" and features["avx512"]:
        return "this build has no AVX-512 kernels (its compiler lacks AVX-512 or the target is not x86)"
    return f"this CPU has no {'AVX-512 F+BW+DQ+VL' if isa == 'avx512' else 'AVX2 + FMA'}"


def widest_path() -> str:
    return cpu_paths()["nt_kernels_isa_paths"][-1]


def child_env(**extra) -> dict[str, str]:
    env = {**os.environ, CHILD: "1", **extra}
    env.pop("OMP_NUM_THREADS", None)
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # the child's conftest keys it by the child's capability
    return env


def run_child_tests(tests: list[str], **env) -> None:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                          cwd=REPO, env=child_env(**env), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{env}: {proc.stdout[-3000:]}{proc.stderr[-1000:]}"


@pytest.mark.skipif(os.environ.get(CHILD) == "1", reason="already a subprocess of this test")
@pytest.mark.parametrize("isa", PATHS)
def test_numerics_tests_pass_on_every_isa_path(isa):
    """Tie tests on every path; the kernels' float32 / half numerics tests on every path but the widest."""
    if missing_path_reason(isa):
        pytest.skip(missing_path_reason(isa))
    run_child_tests(NUMERICS_TESTS if isa == widest_path() else NUMERICS_AND_KERNEL_TESTS, NT_KERNELS_CPU_ISA=isa)


@pytest.mark.skipif(os.environ.get(CHILD) == "1", reason="already a subprocess of this test")
@pytest.mark.parametrize("cap", cpu_paths()["torch_capabilities"][:-1])  # the last, torch's default, ran above
def test_tie_tests_pass_under_every_torch_capability(cap):
    """torch's vector kernels round GELU differently per capability; ties must not care."""
    run_child_tests(NUMERICS_TESTS, NT_KERNELS_CPU_ISA=widest_path(), ATEN_CPU_CAPABILITY=cap)


def isa_environments() -> list[dict[str, str]]:
    """Every NT_KERNELS_CPU_ISA path with torch's default, every torch capability with our widest path."""
    paths = cpu_paths()
    return ([{"NT_KERNELS_CPU_ISA": isa} for isa in paths["nt_kernels_isa_paths"]]
            + [{"NT_KERNELS_CPU_ISA": widest_path(), "ATEN_CPU_CAPABILITY": cap} for cap in paths["torch_capabilities"]])


def test_forced_paths_are_the_ones_that_run():
    for extra in isa_environments():
        code = "import json, torch, nt_kernels._extension as e; print(json.dumps(e.cpu_paths()))"
        proc = subprocess.run([sys.executable, "-c", code], env=child_env(**extra), capture_output=True, text=True,
                              timeout=120, check=True)
        got = json.loads(proc.stdout)
        assert got["nt_kernels_isa"] == extra["NT_KERNELS_CPU_ISA"]
        if "ATEN_CPU_CAPABILITY" in extra:
            assert got["torch_capability"].lower() == extra["ATEN_CPU_CAPABILITY"].lower()


def test_auto_takes_the_widest_path():
    code = "import nt_kernels._extension as e; print(e.cpu_paths()['nt_kernels_isa'])"
    for value in ("auto", ""):
        proc = subprocess.run([sys.executable, "-c", code], env=child_env(NT_KERNELS_CPU_ISA=value),
                              capture_output=True, text=True, timeout=120, check=True)
        assert proc.stdout.strip() == widest_path()


ATTENTION_CALL = ("import torch, nt_kernels; from nt_kernels import segment_softmax_attention as f\n"
                  "q = torch.randn(3, 1, 2); f(q, q, q, torch.tensor([0, 3]))")


def test_unknown_isa_is_an_error_naming_the_variable():
    proc = subprocess.run([sys.executable, "-c", ATTENTION_CALL], env=child_env(NT_KERNELS_CPU_ISA="sse9"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "NT_KERNELS_CPU_ISA must be one of auto, base, avx2, avx512, got 'sse9'" in proc.stderr


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_forcing_a_path_the_cpu_lacks_is_an_error(isa):
    reason = missing_path_reason(isa)
    if reason is None:
        pytest.skip(f"this CPU and build run {isa}")
    proc = subprocess.run([sys.executable, "-c", ATTENTION_CALL], env=child_env(NT_KERNELS_CPU_ISA=isa),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert f"NT_KERNELS_CPU_ISA={isa}, but this" in proc.stderr


TRAIN = """
import json, torch
import torch.nn.functional as F
from nt_kernels.nn import NT
torch.manual_seed(0)
gen = torch.Generator().manual_seed(0)
n = 300
x = torch.randint(-1, 2, (n, 6), generator=gen).float()
edge_index = torch.randint(n, (2, 2400), generator=gen)
y = torch.randint(3, (n,), generator=gen)
model = NT(6, 16, 2, 3, heads=2, nb_features=6, aggr="max")
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
losses = []
for _ in range(8):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x, edge_index), y)
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
print(json.dumps(losses))
"""


@pytest.mark.skipif(len(cpu_paths()["nt_kernels_isa_paths"]) < 2, reason="this CPU has only the base path")
def test_seeded_training_gives_the_same_losses_on_every_isa_path():
    """float32 NT with the max aggregator, 8 Adam steps: losses equal within ISA_LOSS_RTOL."""
    losses = {}
    for isa in cpu_paths()["nt_kernels_isa_paths"]:
        proc = subprocess.run([sys.executable, "-c", TRAIN], env=child_env(NT_KERNELS_CPU_ISA=isa),
                              capture_output=True, text=True, timeout=300, check=True)
        losses[isa] = torch.tensor(json.loads(proc.stdout))
    for isa, values in losses.items():
        torch.testing.assert_close(values, losses["base"], rtol=ISA_LOSS_RTOL, atol=0, msg=isa)
