"""The Triton kernels as the CUDA implementation of the exact path.

:func:`softmax_fwd_into` and :func:`softmax_bwd_into` implement the internal
ops ``nt_kernels::softmax_fwd_into`` / ``softmax_bwd_into`` (schemas in
csrc/ops/segment_attention.cpp): they write only the rows of the given
segments.  :func:`register` makes them the ops' CUDA kernels; it is called
once, from :func:`nt_kernels.backends.register_backends`.  float32 runs in
full precision unless ``torch.backends.cuda.matmul.allow_tf32`` is set.

They are plain Python functions, so on CPU tensors under ``TRITON_INTERPRET=1``
the tests call them directly.  There is no ``triton_op`` / ``wrap_triton``
here: the public ops reach these kernels only through the composite op
``nt_kernels::attention_fwd`` / ``attention_bwd``, which ``torch.compile``
treats as opaque (its fake kernel gives the shapes), so compile never traces
into them (docs/design.md §1).
"""
from __future__ import annotations

import torch
from torch.library import register_kernel

from nt_kernels.backends.triton import ntconv_op
from nt_kernels.backends.triton.plan import (blocks_requested, build_plan, check_plan, has_blocks, max_packed_tile,
                                             shared_memory_per_block)
from nt_kernels.backends.triton.softmax_bwd import softmax_bwd
from nt_kernels.backends.triton.softmax_fwd import softmax_fwd

__all__ = ["register", "softmax_bwd_into", "softmax_fwd_into"]


def _plan(op: str, plan, rowptr: torch.Tensor, segments: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The given plan, checked against the segment list, or a fresh one for ``segments`` (with row blocks
    under NT_KERNELS_EXACT_BLOCKS=1); and whether it has row blocks."""
    max_tile = max_packed_tile(q.dtype, q.shape[2], shared_memory_per_block(q.device))
    if plan is None:
        blocks = blocks_requested(max_tile)
        return build_plan(rowptr, segments, q.shape[0], max_tile, blocks), blocks
    check_plan(op, plan, segments, q.shape[0], max_tile)
    return plan, has_blocks(plan, segments.numel(), q.shape[0])


def softmax_fwd_into(o, lse, q, k, v, rowptr, segments, plan, scale) -> None:
    """Triton implementation of ``nt_kernels::softmax_fwd_into`` (registered for CUDA)."""
    if segments.numel() == 0 or q.shape[0] == 0:
        return
    plan, blocks = _plan("softmax_fwd_into", plan, rowptr, segments, q)
    softmax_fwd(o, lse, q, k, v, plan, scale, torch.backends.cuda.matmul.allow_tf32, blocks=blocks)


def softmax_bwd_into(dq, dk, dv, grad_o, q, k, v, o, lse, rowptr, segments, plan, scale) -> None:
    """Triton implementation of ``nt_kernels::softmax_bwd_into`` (registered for CUDA)."""
    if segments.numel() == 0 or q.shape[0] == 0:
        return
    plan, blocks = _plan("softmax_bwd_into", plan, rowptr, segments, q)
    softmax_bwd(dq, dk, dv, grad_o, q, k, v, o, lse, plan, scale, torch.backends.cuda.matmul.allow_tf32,
                blocks=blocks)


def register() -> None:
    """Make these functions the CUDA kernels of ``softmax_fwd_into`` / ``softmax_bwd_into``, and the
    fused layer's Triton pipeline (ntconv_op.py) those of ``ntconv_fwd`` / ``ntconv_bwd``."""
    register_kernel("nt_kernels::softmax_fwd_into", "cuda", softmax_fwd_into)
    register_kernel("nt_kernels::softmax_bwd_into", "cuda", softmax_bwd_into)
    ntconv_op.register()
