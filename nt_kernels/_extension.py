"""Loading the compiled extension ``nt_kernels._C`` with an error that says how to build it.

``nt_kernels._build_info`` (written by the build next to ``_C``) says which torch and CUDA the
extension was compiled against; a C++ extension runs only under that torch, so
:func:`extension` compares it with the running torch first and raises
:class:`TorchVersionError`, naming both and the wheel to use, instead of letting the loader fail
on an undefined symbol.
"""
from __future__ import annotations

import importlib
import re
from types import ModuleType

import torch

__all__ = ["TorchVersionError", "build_info", "check_torch", "cpu_paths", "extension", "local_tag",
           "torch_mismatch"]


class TorchVersionError(ImportError):
    """The extension was built for another torch (or CUDA) than the one running."""


def build_info() -> ModuleType | None:
    """``nt_kernels._build_info`` (VERSION, TORCH, CUDA, CUDA_ARCHS), or None in a tree never built."""
    try:
        return importlib.import_module("nt_kernels._build_info")
    except ModuleNotFoundError:
        return None


def _release(version: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


def local_tag(torch_version: str, cuda: str | None) -> str:
    """The local version tag of a build for this torch and CUDA (None: CPU kernels only):
    ``pt<major><minor>`` and ``cu<major><minor>`` or ``cpu``, e.g. ``pt211cu130``, ``pt213cpu``
    (also the wheel's, through scripts/wheel_version.py)."""
    major, minor = _release(torch_version)
    return f"pt{major}{minor}" + ("cu" + "".join(cuda.split(".")[:2]) if cuda else "cpu")


def torch_mismatch(built_torch: str, built_cuda: str | None, torch_version: str, torch_cuda: str | None) -> str | None:
    """Why an extension built for (``built_torch``, ``built_cuda``) cannot load under (``torch_version``,
    ``torch_cuda``), or None when it can: the same torch major.minor (torch's C++ ABI changes between
    minor releases) and, for CUDA kernels, a CUDA torch of the same CUDA major and at least the minor
    built for (the CUDA runtime's compatibility rule)."""
    if _release(built_torch) != _release(torch_version):
        return "another torch release"
    if built_cuda is None:
        return None
    if torch_cuda is None:
        return "CUDA kernels under a torch without CUDA"
    (built_major, built_minor), (major, minor) = _release(built_cuda), _release(torch_cuda)
    if major != built_major or minor < built_minor:
        return f"CUDA {built_cuda} kernels under a torch for CUDA {torch_cuda}"
    return None


def check_torch(info, running: tuple[str, str | None] | None = None) -> None:
    """Raise :class:`TorchVersionError` when the build ``info`` does not fit the running torch
    (``running``: its version and CUDA, by default ``torch.__version__`` and ``torch.version.cuda``)."""
    torch_version, torch_cuda = running or (str(torch.__version__), torch.version.cuda)
    why = torch_mismatch(info.TORCH, info.CUDA, torch_version, torch_cuda)
    if why is None:
        return
    raise TorchVersionError(
        f"nt_kernels {info.VERSION} was built for torch {info.TORCH}"
        + (f" with CUDA {info.CUDA} kernels" if info.CUDA else " (CPU kernels)")
        + f", but this is torch {torch_version} (CUDA {torch_cuda or 'none'}): {why}. Install the nt-kernels "
        f"wheel built for this torch, whose version ends in +{local_tag(torch_version, torch_cuda)} (`make "
        f"wheel` builds it with this torch; in a checkout, `make install` rebuilds the extension), or "
        f"install torch {info.TORCH}")


def extension() -> ModuleType:
    """The compiled module ``nt_kernels._C`` (its import registers the C++ op schemas and kernels)."""
    info = build_info()
    if info is not None:
        check_torch(info)
    try:
        return importlib.import_module("nt_kernels._C")
    except ImportError as exc:
        raise ImportError(
            f"nt_kernels: the compiled extension nt_kernels._C is not available ({exc}); the ops need it. "
            "Build it with `make install` (or `pip install --no-build-isolation -e .`) in the repository"
        ) from exc


def cpu_paths() -> dict:
    """Which vector kernels run on this CPU, for logs and reproducibility reports.

    ``torch_capability``: the kernels torch picked (``ATEN_CPU_CAPABILITY`` lowers it);
    ``nt_kernels_isa``: this package's CPU kernel path (``NT_KERNELS_CPU_ISA=base|avx2|avx512``
    forces one; by default the widest this CPU has); ``torch_capabilities`` and
    ``nt_kernels_isa_paths``: every value of each that this CPU (and, for the latter,
    this build) can run, narrowest first.
    """
    features = extension().cpu_features()
    capabilities = ["default"] + (["avx2"] if features["avx2_fma"] else []) + (["avx512"] if features["avx512"] else [])
    return {"torch_capability": torch.backends.cpu.get_cpu_capability().lower(),
            "torch_capabilities": capabilities, "nt_kernels_isa": extension().cpu_isa(),
            "nt_kernels_isa_paths": list(extension().cpu_isa_paths())}
