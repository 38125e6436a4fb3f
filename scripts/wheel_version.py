"""The version of a build of nt-kernels: the release (``__version__`` in nt_kernels/__init__.py)
and, for a wheel or an editable install, a local tag naming the torch and CUDA it is built for:
``0.1.0+pt213cpu`` (torch 2.13, CPU kernels only), ``0.1.0+pt211cu130`` (torch 2.11, CUDA 13.0
kernels).  An extension runs only under the torch it was compiled against, so the tag tells a user
which wheel fits their torch (nt_kernels._extension checks it at import).

The tag also decides whether the CUDA sources are built (``NT_KERNELS_CUDA``): ``AUTO`` (default)
when torch has CUDA and nvcc is found (``$CUDACXX``, else ``nvcc`` on PATH), ``ON`` always (an
error without them), ``OFF`` never.  CMakeLists.txt follows the tag of the version it is given.

Used by
* scikit-build-core ([[tool.dynamic-metadata]] in pyproject.toml): the version of the wheel; an
  sdist gets the release alone, since it builds against whichever torch installs it;
* CMakeLists.txt when CMake runs alone (scripts/gpu/build_extension.sh):
  ``python scripts/wheel_version.py --cuda ON|OFF`` prints the version for nt_kernels/_build_info.py.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INIT = ROOT / "nt_kernels" / "__init__.py"
_state = {"build": "wheel"}


def release() -> str:
    """The release version, ``__version__`` of nt_kernels/__init__.py."""
    match = re.search(r'^__version__ = "([^"]+)"', INIT.read_text(), re.M)
    if not match:
        raise RuntimeError(f"wheel_version: no __version__ = \"...\" line in {INIT}")
    return match.group(1)


def local_tag(torch_version: str, cuda: str | None) -> str:
    """nt_kernels._extension.local_tag, loaded from its file (the package itself is not importable
    while it is being built): ``pt<major><minor>`` and ``cu<major><minor>`` or ``cpu``."""
    spec = importlib.util.spec_from_file_location("nt_kernels_extension", ROOT / "nt_kernels" / "_extension.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.local_tag(torch_version, cuda)


def build_cuda(torch_cuda: str | None) -> bool:
    """Whether this build compiles the CUDA sources (see the module docstring)."""
    mode = os.environ.get("NT_KERNELS_CUDA", "AUTO").upper()
    if mode not in ("AUTO", "ON", "OFF"):
        raise RuntimeError(f"nt-kernels: NT_KERNELS_CUDA must be AUTO, ON or OFF, got {mode!r}")
    nvcc = os.environ.get("CUDACXX") or shutil.which("nvcc")
    if mode == "ON" and not (torch_cuda and nvcc):
        raise RuntimeError(f"nt-kernels: NT_KERNELS_CUDA=ON needs a CUDA torch and nvcc; torch's CUDA: "
                           f"{torch_cuda}, nvcc: {nvcc or 'not found ($CUDACXX unset, none on PATH)'}")
    return mode != "OFF" and bool(torch_cuda and nvcc)


def wheel_version() -> str:
    """The release plus the local tag of the torch that this build compiles against."""
    try:
        import torch
    except ImportError as exc:
        raise RuntimeError(
            "nt-kernels compiles against the torch it will run with, so the build must see it "
            f"({exc}): install torch first, then build without build isolation, e.g. "
            "`pip install --no-build-isolation .` or `make wheel`") from exc
    cuda = torch.version.cuda if build_cuda(torch.version.cuda) else None
    return f"{release()}+{local_tag(torch.__version__, cuda)}"


# ----------------------------------------------------- scikit-build-core's dynamic-metadata hooks
def build_state(state: str) -> None:
    _state["build"] = state


def dynamic_metadata(settings, project) -> dict:
    return {"version": release() if _state["build"] == "sdist" else wheel_version()}


def main() -> None:
    parser = argparse.ArgumentParser(description="print the version of a build for torch's CUDA or CPU")
    parser.add_argument("--cuda", required=True, help="ON / OFF: whether the CUDA sources are built")
    args = parser.parse_args()
    import torch

    cuda = torch.version.cuda if args.cuda.upper() in ("ON", "TRUE", "1") else None
    print(f"{release()}+{local_tag(torch.__version__, cuda)}", end="")


if __name__ == "__main__":
    main()
