"""Public segment-attention ops: checks, defaults and plans over the torch.library ops.

All three public functions run through one op pair, ``nt_kernels::attention_fwd``
and ``nt_kernels::attention_bwd`` (schemas in csrc/ops/segment_attention.cpp),
which take the exact and the Performer segment lists and write both into one
output.  This module gives that pair its fake (meta) kernels and autograd.
The public functions pass ``rows_covered=True``: their two lists partition the
non-empty segments of a checked row pointer, so every packed row is written and
the op allocates its outputs without a zero fill.
"""
from __future__ import annotations

import math

import torch

from nt_kernels._extension import extension
from nt_kernels import backends
from nt_kernels.backends import performer_gemm
from nt_kernels.csr import NeighbourhoodCSR, split_segments
from nt_kernels.ops import _checks
from nt_kernels.performer import switch_threshold

extension()  # the op schemas live in the compiled extension

__all__ = ["neighbourhood_attention", "segment_performer_attention", "segment_softmax_attention"]

DEFAULT_EPS = 1e-4
_OPS = torch.ops.nt_kernels


# --------------------------------------------------------------- fake kernels
@torch.library.register_fake("nt_kernels::attention_fwd")
def _attention_fwd_fake(q, k, v, rowptr, exact_segments, performer_segments, exact_plan,
                        projection, scale, eps, *, rows_covered=False):
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.register_fake("nt_kernels::attention_bwd")
def _attention_bwd_fake(grad_o, q, k, v, o, lse, rowptr, exact_segments, performer_segments,
                        exact_plan, projection, scale, eps, *, rows_covered=False):
    return torch.empty_like(q), torch.empty_like(q), torch.empty_like(q)


def _into_fake(*args, **kwargs):
    return None


for _name in ("softmax_fwd_into", "softmax_bwd_into", "performer_fwd_into", "performer_bwd_into"):
    torch.library.register_fake(f"nt_kernels::{_name}")(_into_fake)


# ------------------------------------------------------------------- autograd
def _setup_context(ctx, inputs, keyword_only_inputs, output):
    q, k, v, rowptr, exact_segments, performer_segments, exact_plan, projection, scale, eps = inputs
    o, lse = output
    # Every tensor goes through save_for_backward, the projection and the plan
    # included: an in-place change before backward then raises instead of
    # giving gradients of the wrong function.
    ctx.save_for_backward(q, k, v, o, lse, rowptr, exact_segments, performer_segments, exact_plan, projection)
    ctx.scale = scale
    ctx.eps = eps
    ctx.rows_covered = keyword_only_inputs.get("rows_covered", False)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_o, grad_lse):
    needed = ctx.needs_input_grad[:3]
    if not any(needed):
        return (None,) * 10
    q, k, v, o, lse, rowptr, exact_segments, performer_segments, exact_plan, projection = ctx.saved_tensors
    grads = _OPS.attention_bwd(grad_o, q, k, v, o, lse, rowptr, exact_segments, performer_segments,
                               exact_plan, projection, ctx.scale, ctx.eps, rows_covered=ctx.rows_covered)
    return (*(g if need else None for g, need in zip(grads, needed)), *(None,) * 7)


torch.library.register_autograd("nt_kernels::attention_fwd", _backward, setup_context=_setup_context)


# --------------------------------------------------------------------- public
def _rowptr_of(op: str, csr_or_rowptr, q: torch.Tensor):
    """(rowptr, csr or None) from a NeighbourhoodCSR or a raw rowptr tensor."""
    if isinstance(csr_or_rowptr, NeighbourhoodCSR):
        _checks.check_csr(op, csr_or_rowptr, q)
        return csr_or_rowptr.rowptr, csr_or_rowptr
    return _checks.check_rowptr(op, csr_or_rowptr, q), None


def _autocast_dtype(device_type: str):
    """The autocast dtype when ``torch.autocast`` is on for this device type, else None."""
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know, e.g. meta
        return None
    return torch.get_autocast_dtype(device_type) if enabled else None


def _autocast(q, k, v):
    """Under ``torch.autocast`` on q's device, float32 q, k, v run in the autocast dtype.

    This is PyTorch's rule for attention (``scaled_dot_product_attention`` is
    on autocast's lower-precision list); other dtypes are left alone.  The
    Performer projection then follows q's dtype (:func:`_projection_for`).
    """
    dtype = _autocast_dtype(q.device.type) if isinstance(q, torch.Tensor) else None
    if dtype is None:
        return q, k, v
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t
                 for t in (q, k, v))


def _projection_for(op: str, projection, q: torch.Tensor) -> torch.Tensor:
    """The checked projection; under autocast a floating projection is cast to q's dtype."""
    if (isinstance(projection, torch.Tensor) and projection.is_floating_point() and projection.dtype != q.dtype
            and _autocast_dtype(q.device.type) is not None):
        projection = projection.to(q.dtype)
    return _checks.check_projection(op, projection, q)


def _default_scale(q: torch.Tensor, scale):
    return q.shape[-1] ** -0.5 if scale is None else float(scale)


def _attention(q, k, v, rowptr, csr, key, exact, performer, exact_plan, projection, scale, eps):
    """o of the public ops: the op pair over both lists (every row covered); or, under
    ``NT_KERNELS_PERFORMER=gemm``, the exact list through the op pair (which leaves the other rows 0)
    and the Performer list through ``performer-gemm``, its rows copied into o.  The Performer rows and
    their plan are cached on ``csr`` under ``key`` (without a CSR they are rebuilt, with host reads)."""
    if not performer_gemm.selected() or performer.numel() == 0:
        o, _ = _OPS.attention_fwd(q, k, v, rowptr, exact, performer, exact_plan, projection, scale, eps,
                                  rows_covered=True)
        return o
    o, _ = _OPS.attention_fwd(q, k, v, rowptr, exact, _no_segments(rowptr), exact_plan, None, scale, eps,
                              rows_covered=False)

    def build():
        return performer_gemm.SegmentRows(rowptr, performer, q.shape[1], q.dtype)

    rows = build() if csr is None else csr.plan(("performer-gemm", key, q.shape[1], q.dtype), build)
    return o.index_copy(0, rows.rows, performer_gemm.forward_rows(q, k, v, rows, projection, eps))


def _all_segments(rowptr: torch.Tensor) -> torch.Tensor:
    return torch.arange(rowptr.numel() - 1, device=rowptr.device)


def _no_segments(rowptr: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.long, device=rowptr.device)


def segment_softmax_attention(q, k, v, rowptr, *, scale=None) -> torch.Tensor:
    """Exact softmax attention inside every CSR segment of packed (E, H, D) q, k, v.

    ``rowptr`` is an (S+1,) int32/int64 row pointer or a :class:`NeighbourhoodCSR`;
    ``scale`` defaults to D^-1/2.  Returns o of q's shape and dtype.
    """
    op = "segment_softmax_attention"
    q, k, v = _checks.check_qkv(op, *_autocast(q, k, v))
    rowptr, csr = _rowptr_of(op, rowptr, q)
    exact = _all_segments(rowptr) if csr is None else csr.segment_split(math.inf)[0]
    o, _ = _OPS.attention_fwd(q, k, v, rowptr, exact, _no_segments(rowptr),
                              backends.exact_plan(csr, math.inf, exact, q), None, _default_scale(q, scale),
                              DEFAULT_EPS, rows_covered=True)
    return o


def segment_performer_attention(q, k, v, rowptr, projection, *, eps=DEFAULT_EPS) -> torch.Tensor:
    """Performer (FAVOR+) linear attention inside every CSR segment (DESIGN §4).

    ``projection`` is the (m, D) random feature matrix from
    :func:`orthogonal_random_features`; it receives no gradient.
    """
    op = "segment_performer_attention"
    q, k, v = _checks.check_qkv(op, *_autocast(q, k, v))
    rowptr, csr = _rowptr_of(op, rowptr, q)
    projection = _projection_for(op, projection, q)
    return _attention(q, k, v, rowptr, csr, "all", _no_segments(rowptr), _all_segments(rowptr), None,
                      projection, _default_scale(q, None), float(eps))


def neighbourhood_attention(q, k, v, csr_or_rowptr, *, projection=None, threshold=None, scale=None,
                            eps=DEFAULT_EPS) -> torch.Tensor:
    """Switchable attention: exact for segments of size <= threshold, Performer above.

    ``threshold`` defaults to the paper's n* = m + sqrt(m^2 + D m) for the
    projection's m; ``math.inf`` forces the exact path and ``0`` Performer.
    Without a projection every segment takes the exact path (a finite
    threshold then is an error).  With a :class:`NeighbourhoodCSR` the segment
    split is cached on it, so repeated calls make no host sync.
    """
    op = "neighbourhood_attention"
    q, k, v = _checks.check_qkv(op, *_autocast(q, k, v))
    rowptr, csr = _rowptr_of(op, csr_or_rowptr, q)
    threshold = _checks.check_threshold(op, threshold, projection)
    if projection is not None:
        projection = _projection_for(op, projection, q)
        if threshold is None:
            threshold = switch_threshold(projection.shape[0], q.shape[2])
    if csr is not None:
        exact, performer = csr.segment_split(threshold)
    else:
        exact, performer = split_segments(rowptr, threshold)
    return _attention(q, k, v, rowptr, csr, float(threshold), exact, performer,
                      backends.exact_plan(csr, threshold, exact, q), projection, _default_scale(q, scale), float(eps))
