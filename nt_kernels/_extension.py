"""Loading the compiled extension ``nt_kernels._C`` with an error that says how to build it."""
from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["extension"]


def extension() -> ModuleType:
    """The compiled module ``nt_kernels._C`` (its import registers the C++ op schemas and kernels)."""
    try:
        return importlib.import_module("nt_kernels._C")
    except ImportError as exc:
        raise ImportError(
            f"nt_kernels: the compiled extension nt_kernels._C is not available ({exc}); the ops need it. "
            "Build it with `make install` (or `pip install --no-build-isolation -e .`) in the repository"
        ) from exc
