"""Receiver-side aggregation of NT messages (DESIGN §6 step 4).

Messages arrive in centre-packed order (the rows of a :class:`NeighbourhoodCSR`).
They are regrouped by receiver through a second, receiver-ordered CSR (built
once per graph and cached on the centre CSR's plan cache) and reduced with
``torch.segment_reduce`` over contiguous segments: no scatter, so the result
is deterministic on every device, and empty segments (nodes nobody sends to)
give zeros.
"""
from __future__ import annotations

import math

import torch

from nt_kernels.csr import NeighbourhoodCSR, receiver_csr, reversed_csr

__all__ = ["AGGREGATORS", "GATED_AGGREGATORS", "GATE_GROUPS", "aggregate", "receiver_csr", "reversed_csr",
           "segment_max", "segment_softmax"]

AGGREGATORS = ("sum", "mean", "max", "weighted_mean", "gated_sum")
GATED_AGGREGATORS = ("weighted_mean", "gated_sum")
GATE_GROUPS = ("receiver", "centre")


def segment_softmax(scores: torch.Tensor, csr: NeighbourhoodCSR) -> torch.Tensor:
    """Softmax of (E, ...) ``scores`` over the rows of each segment of ``csr`` (rows in its packed order)."""
    segment = csr.centre
    peak = torch.segment_reduce(scores.detach(), "max", offsets=csr.rowptr)
    exp = torch.exp(scores - peak.index_select(0, segment))
    total = torch.segment_reduce(exp, "sum", offsets=csr.rowptr)
    return exp / total.index_select(0, segment)


def segment_max(rows: torch.Tensor, csr: NeighbourhoodCSR, keys: torch.Tensor | None = None) -> torch.Tensor:
    """Max of (E, C) ``rows`` over each segment of ``csr``; the gradient is split evenly among ties.

    A tie is decided on ``keys`` (E, C), by default ``rows`` itself (torch.amax's rule): the
    rows whose key equals the largest key among the rows attaining the maximum share its
    gradient.  The NT layer passes the messages' pre-activations as keys, so that ties do not
    depend on how torch's vectorised GELU rounded each position (docs/design.md §9, "Max ties").
    Reductions over contiguous segments only (no scatter), so deterministic.
    Empty segments give 0; a NaN in a segment gives NaN.
    """
    keys = rows.detach() if keys is None else keys.detach()
    peak = torch.segment_reduce(rows.detach(), "max", offsets=csr.rowptr)
    at_peak = rows.detach() == peak.index_select(0, csr.centre)
    winner = torch.segment_reduce(torch.where(at_peak, keys, torch.full_like(keys, -math.inf)), "max",
                                  offsets=csr.rowptr)
    tied = keys == winner.index_select(0, csr.centre)
    count = torch.segment_reduce(tied.to(rows.dtype), "sum", offsets=csr.rowptr)
    total = torch.segment_reduce(torch.where(tied, rows, torch.zeros_like(rows)), "sum", offsets=csr.rowptr)
    out = peak + (total - total.detach()) / count.clamp(min=1)  # the value of peak, the gradient of the ties
    empty = (csr.degree == 0).unsqueeze(-1)
    return torch.where(empty, torch.zeros_like(out), out)


def _gate(messages: torch.Tensor, csr: NeighbourhoodCSR, rcsr: NeighbourhoodCSR, aggr: str, heads: int,
          gate_group: str) -> torch.Tensor:
    """Gated messages in receiver order: value half weighted by the normalised mean of the gate half."""
    rows = messages.shape[0]
    split = messages.view(rows, heads, 2, messages.shape[1] // (2 * heads))
    gate = split[:, :, 0].mean(dim=-1)
    value = split[:, :, 1]
    if aggr == "gated_sum":
        weight = torch.sigmoid(gate).index_select(0, rcsr.perm)
    elif gate_group == "receiver":
        weight = segment_softmax(gate.index_select(0, rcsr.perm), rcsr)
    else:
        weight = segment_softmax(gate, csr).index_select(0, rcsr.perm)
    return (value.index_select(0, rcsr.perm) * weight.unsqueeze(-1)).reshape(rows, heads * value.shape[-1])


def aggregate(messages: torch.Tensor, csr: NeighbourhoodCSR, aggr: str, *, num_nodes: int, heads: int = 1,
              gate_group: str = "receiver", keys: torch.Tensor | None = None) -> torch.Tensor:
    """Reduce centre-packed (E, C) messages at their receivers into (num_nodes, C').

    ``sum``, ``mean`` and ``max`` reduce the C channels directly (empty -> 0);
    ``max`` splits its gradient evenly among tied messages, ties decided on ``keys`` (E, C) when
    given, else on the messages (:func:`segment_max`).
    ``weighted_mean`` and ``gated_sum`` read C = 2 C' as ``heads`` blocks of
    [gate half | value half]; the gate of a message and head is the mean of its
    gate half, normalised by a softmax over the messages arriving at the same
    receiver (``gate_group="receiver"``, the paper) or sent by the same centre
    (``gate_group="centre"``, the released code), or by a sigmoid for
    ``gated_sum``; the weighted value halves are summed.
    """
    if aggr not in AGGREGATORS:
        raise ValueError(f"aggregate: aggr must be one of {AGGREGATORS}, got {aggr!r}")
    if gate_group not in GATE_GROUPS:
        raise ValueError(f"aggregate: gate_group must be one of {GATE_GROUPS}, got {gate_group!r}")
    if messages.dim() != 2 or messages.shape[0] != csr.num_edges:
        raise ValueError(f"aggregate: messages must have shape (E={csr.num_edges}, C), got {tuple(messages.shape)}")
    if aggr in GATED_AGGREGATORS and messages.shape[1] % (2 * heads):
        raise ValueError(f"aggregate: {aggr} needs C divisible by 2 * heads = {2 * heads}, got C = {messages.shape[1]}")
    rcsr = receiver_csr(csr, num_nodes)
    if aggr in GATED_AGGREGATORS:
        received = _gate(messages, csr, rcsr, aggr, heads, gate_group)
    else:
        received = messages.index_select(0, rcsr.perm)
    if aggr == "max":
        if keys is not None and keys.shape != messages.shape:
            raise ValueError(f"aggregate: keys must have the messages' shape {tuple(messages.shape)}, "
                             f"got {tuple(keys.shape)}")
        return segment_max(received, rcsr, None if keys is None else keys.index_select(0, rcsr.perm))
    total = torch.segment_reduce(received, "sum", offsets=rcsr.rowptr)
    if aggr == "mean":
        return total / rcsr.degree.clamp(min=1).unsqueeze(-1).to(total.dtype)
    return total
