"""Kernel backends and their registration with the dispatcher.

* C++ kernels (CPU exact and Performer, CUDA Performer) register when the
  compiled extension ``nt_kernels._C`` loads (``TORCH_LIBRARY_IMPL`` blocks).
* Triton kernels (the CUDA exact kernels of ``nt_kernels::softmax_fwd_into`` /
  ``softmax_bwd_into``) register through :func:`nt_kernels.backends.triton.register.register`,
  called only from :func:`register_backends` and only when triton is importable.

``import nt_kernels`` calls :func:`register_backends` once; importing a backend
module registers nothing by itself.
"""
from __future__ import annotations

import importlib

import torch

__all__ = ["exact_plan", "has_fused_kernel", "has_triton", "ntconv_plan", "register_backends", "triton_registered"]

_registered = {"done": False, "triton": False, "fused": {}}
_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}


def has_triton() -> bool:
    """Whether the optional dependency triton imports (``pip install nt-kernels[triton]``)."""
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def triton_registered() -> bool:
    """Whether the Triton kernels serve the exact path on CUDA in this process."""
    return _registered["triton"]


def register_backends() -> None:
    """Register every available kernel implementation with the dispatcher (idempotent)."""
    if _registered["done"]:
        return
    from nt_kernels._extension import extension

    extension()  # C++ kernels: registered by loading the library
    if has_triton():
        from nt_kernels.backends.triton.register import register

        register()
        _registered["triton"] = True
    _registered["fused"] = {
        device: all(torch._C._dispatch_has_kernel_for_dispatch_key(f"nt_kernels::{op}", key)
                    for op in ("ntconv_fwd", "ntconv_bwd"))
        for device, key in _DISPATCH_KEYS.items()}
    _registered["done"] = True


def has_fused_kernel(device_type: str) -> bool:
    """Whether the fused NT layer op (``nt_kernels::ntconv_fwd`` / ``ntconv_bwd``) has a kernel for
    ``device_type`` ("cpu", "cuda", ...): read from the dispatcher once, at registration."""
    return _registered["fused"].get(device_type, False)


def exact_plan(csr, threshold: float, segments: torch.Tensor, q: torch.Tensor) -> torch.Tensor | None:
    """The exact kernel's work list for ``segments`` (``csr``'s exact split at ``threshold``), cached on ``csr``.

    Only the Triton kernels (CUDA) read a plan; on other devices, or without a
    CSR (the kernel then builds its own), this is None.
    """
    if csr is None or q.device.type != "cuda" or not _registered["triton"]:
        return None
    from nt_kernels.backends.triton.plan import blocks_requested, build_plan, max_packed_tile, shared_memory_per_block

    max_tile = max_packed_tile(q.dtype, q.shape[2], shared_memory_per_block(q.device))
    blocks = blocks_requested(max_tile)
    return csr.plan(("exact-plan", float(threshold), max_tile, blocks),
                    lambda: build_plan(csr.rowptr, segments, num_rows=csr.num_edges, max_tile=max_tile, blocks=blocks))


def ntconv_plan(csr, rcsr, threshold: float, centre: torch.Tensor, heads: int) -> torch.Tensor | None:
    """The fused layer's work plan on CUDA (nt_kernels/backends/triton/ntconv_plan.py) for ``csr``,
    its receiver CSR ``rcsr``, the split at ``threshold`` and the layer's (dtype, C, heads), cached
    on ``csr``: what ``nt_kernels::ntconv_fwd`` / ``ntconv_bwd`` take as ``exact_plan`` there.

    None off CUDA or without the Triton kernels (the CPU kernel plans for itself).
    """
    if centre.device.type != "cuda" or not _registered["triton"]:
        return None
    from nt_kernels.backends.triton.ntconv_plan import cached_plan

    return cached_plan(csr, rcsr, threshold, centre.dtype, centre.shape[1], heads)
