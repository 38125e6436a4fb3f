"""Loading the compiled extension ``nt_kernels._C`` with an error that says how to build it."""
from __future__ import annotations

import importlib
from types import ModuleType

import torch

__all__ = ["cpu_paths", "extension"]


def extension() -> ModuleType:
    """The compiled module ``nt_kernels._C`` (its import registers the C++ op schemas and kernels)."""
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
