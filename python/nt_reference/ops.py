"""Per-segment loop reference for the segment attention ops.

These loops *define* the semantics of DESIGN §4; every kernel is checked
against them.  They are written for clarity, not speed, work in any dtype
(float64 for tight comparisons) and are differentiable by plain autograd.
"""
from __future__ import annotations

import math

import torch

__all__ = [
    "default_threshold",
    "neighbourhood_attention",
    "performer_features",
    "segment_performer_attention",
    "segment_softmax_attention",
    "softmax_attention",
    "performer_attention",
]


def default_threshold(m: int, head_dim: int) -> float:
    """n* = p + sqrt(p^2 + h p) with p = m features and h = head dim (paper §4.1)."""
    return m + math.sqrt(m * m + head_dim * m)


def softmax_attention(q, k, v, scale):
    """Exact attention for one segment; q, k, v are (n, H, D)."""
    scores = torch.einsum("ihd,jhd->hij", q, k) * scale
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hij,jhd->ihd", probs, v)


def performer_features(x, projection, *, is_query: bool, eps: float):
    """FAVOR+ positive features phi(x) for one segment; x is (n, H, D), returns (n, H, m).

    The stabiliser is the max of u = c x P^T over the m features of each query
    row, or over all rows and features of the segment (per head) for keys.  It
    is a constant for autograd (detached), as in performer-pytorch.
    """
    m, d = projection.shape
    c = d ** -0.25
    u = c * torch.einsum("nhd,md->nhm", x, projection)
    diag = 0.5 * c * c * (x * x).sum(-1, keepdim=True)
    if is_query:
        stab = u.amax(dim=-1, keepdim=True)
    else:
        stab = u.amax(dim=(0, 2), keepdim=True)
    return m ** -0.5 * (torch.exp(u - diag - stab.detach()) + eps)


def performer_attention(q, k, v, projection, eps):
    """Performer linear attention for one segment; q, k, v are (n, H, D)."""
    phi_q = performer_features(q, projection, is_query=True, eps=eps)
    phi_k = performer_features(k, projection, is_query=False, eps=eps)
    s = torch.einsum("nhm,nhd->hmd", phi_k, v)
    z = phi_k.sum(0)
    num = torch.einsum("nhm,hmd->nhd", phi_q, s)
    den = torch.einsum("nhm,hm->nh", phi_q, z)
    return num / den.unsqueeze(-1)


def _per_segment(q, k, v, rowptr, attend):
    """Concatenate ``attend(q_s, k_s, v_s)`` over the non-empty segments s.

    Inputs are cut with ``split`` and outputs joined with ``cat`` (not slicing
    and slice assignment), so the backward costs O(E), not O(segments x E).
    """
    sizes = torch.diff(rowptr).tolist()
    parts = [attend(qs, ks, vs) for qs, ks, vs in zip(q.split(sizes), k.split(sizes), v.split(sizes))
             if qs.shape[0] > 0]
    return torch.cat(parts) if parts else torch.zeros_like(v)


def segment_softmax_attention(q, k, v, rowptr, *, scale=None):
    """Exact softmax attention inside every CSR segment of packed (E, H, D) tensors."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _per_segment(q, k, v, rowptr, lambda qs, ks, vs: softmax_attention(qs, ks, vs, scale))


def segment_performer_attention(q, k, v, rowptr, projection, *, eps=1e-4):
    """Performer (FAVOR+) attention inside every CSR segment of packed (E, H, D) tensors."""
    return _per_segment(
        q, k, v, rowptr, lambda qs, ks, vs: performer_attention(qs, ks, vs, projection, eps))


def neighbourhood_attention(
    q, k, v, rowptr, *, projection=None, threshold=None, scale=None, eps=1e-4
):
    """Switchable attention: exact for segments of size <= threshold, Performer above.

    ``threshold=None`` means the paper's n* for m = projection rows and D = head dim;
    without a projection every segment takes the exact path.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if projection is None:
        threshold = math.inf
    elif threshold is None:
        threshold = default_threshold(projection.shape[0], q.shape[-1])

    def attend(qs, ks, vs):
        if qs.shape[0] <= threshold:
            return softmax_attention(qs, ks, vs, scale)
        return performer_attention(qs, ks, vs, projection, eps)

    return _per_segment(q, k, v, rowptr, attend)
