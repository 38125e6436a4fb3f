"""Registrations of the Triton exact-attention kernels.

1. CUDA kernels of the internal ops ``nt_kernels::softmax_fwd_into`` and
   ``nt_kernels::softmax_bwd_into`` (schemas in csrc/ops/segment_attention.cpp),
   which write only the rows of the given segments.  float32 runs in full
   precision unless ``torch.backends.cuda.matmul.allow_tf32`` is set.
2. A standalone ``torch.library.triton_op`` pair,
   ``nt_kernels::triton_segment_softmax`` and its backward, built on
   ``wrap_triton`` so ``torch.compile(fullgraph=True)`` traces into the kernels;
   exposed as :func:`segment_softmax`.  It also runs on CPU tensors under
   ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import torch
from torch.library import register_autograd, register_kernel, triton_op, wrap_triton

from nt_kernels._extension import extension
from nt_kernels.backends.triton.plan import build_plan, max_packed_tile
from nt_kernels.backends.triton.softmax_bwd import softmax_bwd
from nt_kernels.backends.triton.softmax_fwd import default_scale, softmax_fwd

__all__ = ["register", "segment_softmax", "softmax_bwd_into", "softmax_fwd_into"]

extension()  # defines the nt_kernels::* schemas


def _plan(plan, rowptr, segments, q):
    if plan is not None:
        return plan
    return build_plan(rowptr, segments, q.shape[0], max_packed_tile(q.dtype, q.shape[2]))


def softmax_fwd_into(o, lse, q, k, v, rowptr, segments, plan, scale) -> None:
    """Triton implementation of ``nt_kernels::softmax_fwd_into`` (registered for CUDA)."""
    if segments.numel() == 0 or q.shape[0] == 0:
        return
    plan = _plan(plan, rowptr, segments, q)
    softmax_fwd(o, lse, q, k, v, plan, scale, torch.backends.cuda.matmul.allow_tf32)


def softmax_bwd_into(dq, dk, dv, grad_o, q, k, v, o, lse, rowptr, segments, plan, scale) -> None:
    """Triton implementation of ``nt_kernels::softmax_bwd_into`` (registered for CUDA)."""
    if segments.numel() == 0 or q.shape[0] == 0:
        return
    plan = _plan(plan, rowptr, segments, q)
    softmax_bwd(dq, dk, dv, grad_o, q, k, v, o, lse, plan, scale,
                torch.backends.cuda.matmul.allow_tf32)


def register() -> None:
    """Make these functions the CUDA kernels of ``softmax_fwd_into`` / ``softmax_bwd_into``
    (called once, from :func:`nt_kernels.backends.register_backends`)."""
    register_kernel("nt_kernels::softmax_fwd_into", "cuda", softmax_fwd_into)
    register_kernel("nt_kernels::softmax_bwd_into", "cuda", softmax_bwd_into)


def _all_segments_plan(rowptr: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return _plan(None, rowptr, torch.arange(rowptr.shape[0] - 1, device=rowptr.device), q)


@triton_op("nt_kernels::triton_segment_softmax", mutates_args=())
def _triton_segment_softmax(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            rowptr: torch.Tensor, scale: float,
                            allow_tf32: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # Every row lies in exactly one segment, so every row of o and lse is written.
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    if q.shape[0] > 0:
        plan = _all_segments_plan(rowptr, q)
        softmax_fwd(o, lse, q, k, v, plan, scale, allow_tf32, wrap=wrap_triton)
    return o, lse


@triton_op("nt_kernels::triton_segment_softmax_backward", mutates_args=())
def _triton_segment_softmax_backward(
        grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        o: torch.Tensor, lse: torch.Tensor, rowptr: torch.Tensor, scale: float,
        allow_tf32: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if q.shape[0] > 0:
        plan = _all_segments_plan(rowptr, q)
        softmax_bwd(dq, dk, dv, grad_o, q, k, v, o, lse, plan, scale, allow_tf32,
                    wrap=wrap_triton)
    return dq, dk, dv


def _setup_context(ctx, inputs, output):
    q, k, v, rowptr, scale, allow_tf32 = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, rowptr)
    ctx.scale, ctx.allow_tf32 = scale, allow_tf32
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_o, _grad_lse):
    q, k, v, o, lse, rowptr = ctx.saved_tensors
    grad_o = grad_o.to(q.dtype).contiguous()
    dq, dk, dv = torch.ops.nt_kernels.triton_segment_softmax_backward(
        grad_o, q, k, v, o, lse, rowptr, ctx.scale, ctx.allow_tf32)
    return dq, dk, dv, None, None, None


register_autograd("nt_kernels::triton_segment_softmax", _backward, setup_context=_setup_context)


def segment_softmax(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rowptr: torch.Tensor,
                    scale: float | None = None, *, allow_tf32: bool = False) -> torch.Tensor:
    """Exact softmax attention inside every CSR segment of packed (E, H, D) tensors.

    ``rowptr`` is (S+1,) int32/int64 on q's device; ``scale`` defaults to D^-1/2.
    Differentiable in q, k, v.  ``allow_tf32`` lets float32 dots use TF32.
    """
    if q.dim() != 3 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"segment_softmax: q, k, v must share one (E, H, D) shape, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if rowptr.dim() != 1 or rowptr.dtype not in (torch.int32, torch.int64):
        raise ValueError("segment_softmax: rowptr must be a 1-D int32 or int64 tensor")
    o, _ = torch.ops.nt_kernels.triton_segment_softmax(
        q.contiguous(), k.contiguous(), v.contiguous(), rowptr.to(torch.int64),
        default_scale(q.shape[-1], scale), bool(allow_tf32))
    return o
