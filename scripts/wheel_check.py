"""Is a wheel of nt-kernels complete?  Three subcommands (scripts/wheel_smoke.sh runs them):

* ``find DIST``: the newest wheel in DIST for this interpreter (its CPython tag) and its torch
  (the local tag's ``pt<major><minor>``); exits 1 when there is none.
* ``contents WHEEL`` (in the checkout): every file of the package (nt_kernels/ as in the tree:
  modules, the Triton config table, any data file), the compiled ``_C`` and ``_build_info``,
  ``nt_reference`` as far as the package imports it and no further, nothing else at the top level,
  and one version everywhere (file name, METADATA, ``_build_info``) whose local tag names the
  torch and CUDA that ``_build_info`` records.
* ``installed --checkout DIR`` (with the Python of the venv the wheel went into, run outside the
  checkout): nt_kernels and nt_reference import from that venv, not from DIR; the version is the
  wheel's and fits this torch; every module imports (those needing an optional package that is
  absent are listed as skipped); the Triton config table is read from the installed package.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import os
import pkgutil
import re
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = {"triton", "matplotlib", "performer_pytorch"}  # extras: a module needing one may be skipped


def fail(message: str) -> None:
    sys.exit(f"wheel_check: FAIL: {message}")


def python_tag() -> str:
    return f"cp{sys.version_info.major}{sys.version_info.minor}"


def torch_prefix() -> str:
    import torch

    major, minor = re.match(r"(\d+)\.(\d+)", torch.__version__).groups()
    return f"pt{major}{minor}"


def find(dist: Path) -> Path:
    pattern = f"nt_kernels-*+{torch_prefix()}*-{python_tag()}-{python_tag()}-*.whl"
    wheels = sorted(dist.glob(pattern), key=lambda p: p.stat().st_mtime)
    if not wheels:
        sys.exit(f"wheel_check: no wheel {pattern} in {dist} (make wheel builds it)")
    return wheels[-1]


# ---------------------------------------------------------------------------------- contents
def reference_modules_needed() -> set[str]:
    """The nt_reference modules that nt_kernels imports anywhere (module level or in functions)."""
    needed = {"__init__"}
    for path in (ROOT / "nt_kernels").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "nt_reference":
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] == "nt_reference" and len(parts) > 1 and \
                        (ROOT / "python" / "nt_reference" / f"{parts[1]}.py").is_file():
                    needed.add(parts[1])
    return needed


def package_files() -> set[str]:
    """The files of nt_kernels/ in the tree, as wheel paths (no caches, no compiled module built in place)."""
    files = set()
    for path in (ROOT / "nt_kernels").rglob("*"):
        if path.is_file() and "__pycache__" not in path.parts and not path.name.startswith("_C."):
            files.add(path.relative_to(ROOT).as_posix())
    return files


def read_build_info(wheel: zipfile.ZipFile) -> dict:
    info: dict = {}
    exec(wheel.read("nt_kernels/_build_info.py").decode(), info)  # noqa: S102  (the file the build wrote)
    return info


def contents(path: Path) -> None:
    wheel = zipfile.ZipFile(path)
    names = set(wheel.namelist())
    missing = sorted(package_files() - names)
    if missing:
        fail(f"{len(missing)} files of nt_kernels/ are not in the wheel: {missing[:10]}")
    compiled = [n for n in names if re.fullmatch(r"nt_kernels/_C\.[^/]+\.so", n)]
    if len(compiled) != 1 or "nt_kernels/_build_info.py" not in names:
        fail(f"the wheel needs one nt_kernels/_C.*.so and nt_kernels/_build_info.py; has {compiled}")
    reference = {n[len("nt_reference/"):-3] for n in names if n.startswith("nt_reference/") and n.endswith(".py")}
    needed = reference_modules_needed()
    if reference != needed:
        fail(f"nt_reference in the wheel {sorted(reference)} is not what nt_kernels imports {sorted(needed)}")
    dist_info = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
    top = {n.split("/")[0] for n in names} - {"nt_kernels", "nt_reference"} - dist_info
    if top or len(dist_info) != 1:
        fail(f"unexpected top-level entries {sorted(top)} / dist-info {sorted(dist_info)}")
    info = read_build_info(wheel)
    metadata = wheel.read(f"{dist_info.pop()}/METADATA").decode()
    version = re.search(r"^Version: (\S+)$", metadata, re.M).group(1)
    in_name = path.name.split("-")[1]
    from wheel_version import local_tag  # this folder's

    tag = local_tag(info["TORCH"], info["CUDA"])
    if not (version == in_name == info["VERSION"] and version.endswith("+" + tag)):
        fail(f"versions: file name {in_name}, METADATA {version}, _build_info {info['VERSION']}, "
             f"expected the tag +{tag} of torch {info['TORCH']} / CUDA {info['CUDA']}")
    size = path.stat().st_size / 2**20
    print(f"wheel_check: {path.name}: {size:.1f} MiB, {len(names)} files; version {version}; built for torch "
          f"{info['TORCH']}, CUDA {info['CUDA'] or 'none'}{' (architectures ' + info['CUDA_ARCHS'] + ')' if info['CUDA'] else ''}; "
          f"nt_reference modules {sorted(reference)}: ok")


# --------------------------------------------------------------------------------- installed
def installed(checkout: Path) -> None:
    import torch

    import nt_kernels
    import nt_reference
    from nt_kernels._extension import build_info, local_tag

    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    for module in (nt_kernels, nt_reference):
        where = Path(module.__file__).resolve()
        if checkout.resolve() in where.parents or site not in where.parents:
            fail(f"{module.__name__} imports from {where}, not from this venv's {site}")
    from importlib.metadata import version

    tag = local_tag(torch.__version__, torch.version.cuda if build_info().CUDA else None)
    if version("nt-kernels") != nt_kernels.__version__ or not nt_kernels.__version__.endswith("+" + tag):
        fail(f"installed version {version('nt-kernels')}, nt_kernels.__version__ {nt_kernels.__version__}, "
             f"torch {torch.__version__}: expected the tag +{tag}")
    skipped = []
    for module in pkgutil.walk_packages(nt_kernels.__path__, "nt_kernels."):
        try:
            importlib.import_module(module.name)
        except ModuleNotFoundError as exc:
            if exc.name not in OPTIONAL:
                raise
            skipped.append((exc.name, module.name))
    from nt_kernels.backends.triton import configs

    table = configs.load_table()
    entries = sum(len(section["entries"]) for section in table["archs"].values())
    if site not in configs.TABLE_PATH.resolve().parents or not entries or os.environ.get("NT_KERNELS_TRITON_CONFIGS"):
        fail(f"the Triton config table {configs.TABLE_PATH} ({entries} entries) is not the installed one")
    missing = sorted({name for name, _ in skipped})
    unimported = "; ".join(f"without {name}: " + ", ".join(m for n, m in skipped if n == name) for name in missing)
    print(f"wheel_check: nt_kernels {nt_kernels.__version__} from {Path(nt_kernels.__file__).parent}; every module "
          f"imports{' (' + unimported + ')' if skipped else ''}; Triton config table: {entries} entries "
          f"for {', '.join(sorted(table['archs']))} from the installed package: ok")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("find").add_argument("dist", type=Path)
    sub.add_parser("contents").add_argument("wheel", type=Path)
    inst = sub.add_parser("installed")
    inst.add_argument("--checkout", type=Path, required=True)
    args = parser.parse_args()
    if args.command == "find":
        print(find(args.dist))
    elif args.command == "contents":
        contents(args.wheel)
    else:
        installed(args.checkout)


if __name__ == "__main__":
    main()
