"""The paper's neighbourhood processing strategies as autograd-capable baselines.

All three take the packed inputs of the loop reference (q, k, v of shape
(E, H, D), rows packed by segment, ``rowptr`` (S+1,)) and return the same
(E, H, D) output as :func:`nt_reference.ops.neighbourhood_attention`: exact
softmax attention for segments of size <= threshold, Performer above it.
They differ only in how segments are grouped into batched calls:

* :func:`padded` — one call per path (exact / Performer), every segment
  padded to the path's max size.  ``projection=None`` (or ``threshold=inf``)
  is the paper's "parallel processing"; with a finite threshold it is the
  paper's "partitioning by size".
* :func:`sequential` — one call per distinct segment size, no padding.
* :func:`partitioned` — the size split plus Algorithm 1's area groups
  (:func:`nt_kernels.baselines.partition.partition_by_area`), each group padded to its
  own max size and processed in turn.

A group of G segments of max size L is gathered into a padded (G, L, H, D)
layout and scattered back with boolean indexing and one ``index_copy``, all
differentiable and with no Python loop over segments.  The padded inputs of
all groups are gathered by one ``index_select`` per tensor (they are kept for
the backward anyway); the attention calls run group by group.  Exact
attention runs through ``torch.nn.functional.scaled_dot_product_attention``
with a boolean key mask (padded keys masked out, padded query rows
discarded).  Performer reuses the reference's
:func:`nt_reference.ops.performer_features` on a (L, G*H, D) view, so that
its per-"head" key stabiliser is per segment and head; padded positions hold
a copy of the segment's first row, which leaves that max unchanged, and
their key features are zeroed before entering S and z.
Empty segments belong to no group; their output rows are 0 as in the loop
reference.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from nt_kernels.baselines.partition import partition_by_area
from nt_kernels.performer import switch_threshold
from nt_reference.ops import performer_features

__all__ = ["padded", "padded_layout", "partitioned", "sequential"]


def padded_layout(rowptr: torch.Tensor, segments: torch.Tensor):
    """Index and mask of the padded (G, L) layout of ``segments`` (G ids into rowptr).

    L is the largest size among the segments (one host sync).  ``index[g, l]``
    is the packed row of position l of segment g; past the segment's end it
    repeats the segment's first row (empty segments must not be passed).
    ``mask[g, l]`` is True on real rows.
    """
    segments = segments.to(device=rowptr.device, dtype=torch.long)
    rowptr = rowptr.to(torch.long)
    start = rowptr[segments]
    size = rowptr[segments + 1] - start
    length = int(size.max()) if segments.numel() else 0
    pos = torch.arange(length, device=rowptr.device)
    mask = pos < size.unsqueeze(1)
    index = start.unsqueeze(1) + torch.where(mask, pos, 0)
    return index, mask


def _exact(q, k, v, mask, scale):
    """Masked SDPA on (G, L, H, D) tensors; returns (G, L, H, D)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    attn_mask = mask[:, None, None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
    return out.transpose(1, 2)


def _performer(q, k, v, mask, projection, eps):
    """FAVOR+ attention per segment on (G, L, H, D) tensors, padded keys excluded."""
    g, length, h, d = q.shape

    def fold(x):  # (G, L, H, X) -> (L, G*H, X): segments x heads become the "head" axis
        return x.transpose(0, 1).reshape(length, g * h, x.shape[-1])

    phi_q = performer_features(fold(q), projection, is_query=True, eps=eps)
    phi_k = performer_features(fold(k), projection, is_query=False, eps=eps)
    key_mask = mask.transpose(0, 1).repeat_interleave(h, dim=1).unsqueeze(-1)
    phi_k = torch.where(key_mask, phi_k, 0.0)
    s = torch.einsum("nbm,nbd->bmd", phi_k, fold(v))
    z = phi_k.sum(0)
    num = torch.einsum("nbm,bmd->nbd", phi_q, s)
    den = torch.einsum("nbm,bm->nb", phi_q, z)
    out = num / den.unsqueeze(-1)
    return out.view(length, g, h, d).transpose(0, 1)


def _resolve(q, projection, threshold, scale):
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if projection is None:
        threshold = math.inf
    elif threshold is None:
        threshold = switch_threshold(projection.shape[0], q.shape[-1])
    return scale, threshold


def _run(q, k, v, rowptr, groups, *, projection, scale, eps):
    """Process ``groups`` [(segment ids, performer flag), ...] in turn and assemble o.

    The padded inputs of all groups are gathered by one ``index_select`` per
    tensor and split per group: a gather per group would make the backward
    materialise one dense (E, H, D) gradient per group, O(groups x E).  The
    attention calls themselves run group by group.
    """
    layouts = [
        (padded_layout(rowptr, segments), performer)
        for segments, performer in groups
        if segments.numel()
    ]
    out = torch.zeros_like(v)
    if not layouts:
        return out
    flat = torch.cat([index.reshape(-1) for (index, _), _ in layouts])
    numels = [index.numel() for (index, _), _ in layouts]
    padded_qkv = [t.index_select(0, flat).split(numels) for t in (q, k, v)]
    rows, outs = [], []
    for ((index, mask), performer), qp, kp, vp in zip(layouts, *padded_qkv):
        qp, kp, vp = (t.view(*index.shape, *q.shape[1:]) for t in (qp, kp, vp))
        if performer:
            op = _performer(qp, kp, vp, mask, projection, eps)
        else:
            op = _exact(qp, kp, vp, mask, scale)
        rows.append(index[mask])
        outs.append(op[mask])
    return out.index_copy(0, torch.cat(rows), torch.cat(outs))


def _sizes(rowptr):
    return rowptr[1:] - rowptr[:-1]


def _select(keep):
    return torch.nonzero(keep).flatten()


def padded(q, k, v, rowptr, *, projection=None, threshold=None, scale=None, eps=1e-4):
    """One masked call per path: sizes in [1, threshold] exact, > threshold Performer.

    Each path pads its segments to the path's own max size.
    """
    scale, threshold = _resolve(q, projection, threshold, scale)
    sizes = _sizes(rowptr)
    groups = [
        (_select(sizes > threshold), True),
        (_select((sizes >= 1) & (sizes <= threshold)), False),
    ]
    return _run(q, k, v, rowptr, groups, projection=projection, scale=scale, eps=eps)


def sequential(q, k, v, rowptr, *, projection=None, threshold=None, scale=None, eps=1e-4):
    """One batched call per distinct non-zero segment size (no padding at all)."""
    scale, threshold = _resolve(q, projection, threshold, scale)
    sizes = _sizes(rowptr)
    groups = [
        (_select(sizes == n), n > threshold) for n in torch.unique(sizes).tolist() if n > 0
    ]
    return _run(q, k, v, rowptr, groups, projection=projection, scale=scale, eps=eps)


def partitioned(
    q, k, v, rowptr, *, projection=None, threshold=None, scale=None, eps=1e-4, alpha=0.4
):
    """Size split at the threshold, then Algorithm 1 groups; each group padded to its max.

    Groups come from ``partition_by_area(sizes, counts, alpha, threshold)`` on
    the segment-size histogram and are processed in turn, largest sizes first.
    """
    scale, threshold = _resolve(q, projection, threshold, scale)
    sizes = _sizes(rowptr)
    hist_sizes, hist_counts = torch.unique(sizes, return_counts=True)
    plan = partition_by_area(hist_sizes, hist_counts, alpha=alpha, threshold=threshold)
    groups = [
        (_select((sizes >= g.lo) & (sizes <= g.hi)), g.performer) for g in plan
    ]
    return _run(q, k, v, rowptr, groups, projection=projection, scale=scale, eps=eps)
