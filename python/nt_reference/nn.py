"""Reference NT layer and model (DESIGN §6), written for clarity, not speed.

Plain PyTorch plus the loop ops of :mod:`nt_reference.ops`; nothing from
nt_kernels.  The combiner multiplies the explicit concatenation
[x_j | x_k | e_jk], the aggregators are dense (N x E) masked reductions (max a scatter), so
only small graphs fit.  Parameter and buffer names equal those of
``nt_kernels.nn``, so ``reference.load_state_dict(fused.state_dict())``
gives both the same weights.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from nt_reference.dropout import counter_dropout_mask
from nt_reference.ops import default_threshold, neighbourhood_attention

__all__ = ["DirNT", "NT", "NTConv", "aggregate_dense", "ntconv_messages"]

GATED = ("weighted_mean", "gated_sum")


def _orthogonal_features(m: int, d: int) -> torch.Tensor:
    """Blocks of d orthogonal rows scaled by chi-distributed norms (FAVOR+)."""
    blocks = [torch.linalg.qr(torch.randn(d, d, dtype=torch.float64))[0].T for _ in range(-(-m // d))]
    basis = torch.cat(blocks)[:m]
    return (torch.randn(m, d, dtype=torch.float64).norm(dim=1, keepdim=True) * basis).to(torch.get_default_dtype())


def _masked_softmax(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax of (E, H) ``scores`` within each group of the (G, E) ``mask``; returns (G, E, H), 0 outside.

    Masked entries get the lowest finite value, not -inf, so an empty group
    gives no NaN (which would leak into the gradient).
    """
    masked = scores.unsqueeze(0).masked_fill(~mask.unsqueeze(-1), torch.finfo(scores.dtype).min)
    probs = torch.softmax(masked, dim=1)
    return torch.where(mask.unsqueeze(-1), probs, torch.zeros_like(probs))


def _max_at_receivers(messages, keys, receiver, num_nodes):
    """Per receiver and channel the largest message, 0 without messages, NaN if a message is NaN.

    The gradient is split evenly among the tied messages, where a tie is decided on ``keys``:
    the messages whose key equals the largest key among the messages attaining the maximum
    (docs/design.md §9, "Max ties": with keys = the pre-activations, a tie does not depend on how torch's
    vectorised GELU rounded each position).  Scatters, not a dense (N, E, C) spread, which would
    not fit for thousands of rows.
    """
    index = receiver.unsqueeze(1).expand_as(messages)
    keys = keys.detach()

    def scatter_max(values):
        return values.new_full((num_nodes, values.shape[1]), -math.inf).scatter_reduce(
            0, index, values, "amax", include_self=False)

    peak = scatter_max(messages.detach())
    at_peak = messages.detach() == peak.gather(0, index)
    winner = scatter_max(torch.where(at_peak, keys, torch.full_like(keys, -math.inf)))
    tied = keys == winner.gather(0, index)
    count = torch.zeros_like(peak).scatter_add(0, index, tied.to(messages.dtype))
    total = torch.zeros_like(peak).scatter_add(0, index, torch.where(tied, messages, torch.zeros_like(messages)))
    out = peak + (total - total.detach()) / count.clamp(min=1)  # the value of peak, the gradient of the ties
    has_message = torch.bincount(receiver, minlength=num_nodes).unsqueeze(1) > 0
    return torch.where(has_message, out, torch.zeros_like(out))


def aggregate_dense(messages, centre, receiver, num_nodes, aggr, heads, gate_group="receiver", keys=None):
    """Aggregate (E, C) messages of edges (centre -> receiver) at the receivers with dense masks.

    ``keys`` (E, C), for ``max`` only: the values that decide ties (the messages' pre-activations
    in the NT layer); by default the messages themselves, which is torch.amax's rule.
    """
    nodes = torch.arange(num_nodes, device=messages.device)
    at_receiver = nodes.unsqueeze(1) == receiver.unsqueeze(0)
    incidence = at_receiver.to(messages.dtype)
    if aggr in GATED:
        split = messages.view(messages.shape[0], heads, 2, messages.shape[1] // (2 * heads))
        gate, value = split[:, :, 0].mean(-1), split[:, :, 1]
        if aggr == "gated_sum":
            weight = torch.sigmoid(gate)
        elif gate_group == "receiver":
            weight = _masked_softmax(gate, at_receiver).sum(0)
        else:
            weight = _masked_softmax(gate, nodes.unsqueeze(1) == centre.unsqueeze(0)).sum(0)
        return incidence @ (value * weight.unsqueeze(-1)).flatten(1)
    if aggr == "max":
        return _max_at_receivers(messages, messages if keys is None else keys, receiver, num_nodes)
    total = incidence @ messages
    if aggr == "mean":
        return total / incidence.sum(1, keepdim=True).clamp(min=1)
    return total


class NTConv(nn.Module):
    """Reference NT layer; same arguments and parameters as ``nt_kernels.nn.NTConv``."""

    def __init__(self, in_channels, out_channels, heads=1, edge_dim=None, aggr="weighted_mean", dropout=0.0,
                 attention="switch", nb_features=None, threshold=None, gate_group="receiver"):
        super().__init__()
        self.in_channels, self.out_channels, self.heads = in_channels, out_channels, heads
        self.head_dim = out_channels // heads
        self.edge_dim, self.aggr, self.dropout, self.attention = edge_dim, aggr, dropout, attention
        self.gate_group = gate_group
        self.lin_centre = nn.Linear(in_channels, out_channels)
        self.lin_receiver = nn.Linear(in_channels, out_channels, bias=False)
        self.lin_edge = nn.Linear(edge_dim, out_channels, bias=False) if edge_dim is not None else None
        self.lin_qkv = nn.Linear(out_channels, 3 * out_channels)
        self.lin_out = nn.Linear(out_channels, (2 if aggr in GATED else 1) * out_channels)
        if attention == "softmax":
            self.register_buffer("projection", None)
            self.threshold = math.inf
        else:
            d = self.head_dim
            m = nb_features or max(1, int(d * math.log(d)))
            self.register_buffer("projection", _orthogonal_features(m, d))
            self.threshold = 0.0 if attention == "performer" else (
                default_threshold(m, d) if threshold is None else threshold)

    def forward(self, x, edge_index, edge_attr=None, *, dropout_seed=None):
        """``dropout_seed``: draw the dropout mask from the fused layer's counter generator
        (nt_reference.dropout) with this seed instead of ``F.dropout``."""
        centre, receiver = edge_index[0], edge_index[1]
        weights = [self.lin_centre.weight, self.lin_receiver.weight]
        pairs = [x[centre], x[receiver]]
        if self.lin_edge is not None:
            weights.append(self.lin_edge.weight)
            pairs.append(edge_attr)
        z = torch.cat(pairs, dim=1) @ torch.cat(weights, dim=1).T + self.lin_centre.bias
        return _messages_and_aggregate(
            z, edge_index, x.shape[0], self.lin_qkv.weight, self.lin_qkv.bias, self.lin_out.weight,
            self.lin_out.bias, heads=self.heads, aggr=self.aggr, gate_group=self.gate_group,
            projection=self.projection, threshold=self.threshold, dropout=self.dropout if self.training else 0.0,
            seed=dropout_seed)


def _packed_order(centre: torch.Tensor, num_nodes: int):
    """(order, rowptr): the stable sort of the edges by centre, and the centre CSR row pointer."""
    order = torch.sort(centre, stable=True).indices
    rowptr = torch.zeros(num_nodes + 1, dtype=torch.long, device=centre.device)
    rowptr[1:] = torch.cumsum(torch.bincount(centre, minlength=num_nodes), 0)
    return order, rowptr


def _messages_and_aggregate(u, edge_index, num_nodes, w_qkv, b_qkv, w_out, b_out, *, heads, aggr, gate_group,
                            projection, threshold, dropout, seed, scale=None, eps=1e-4):
    """Steps 1b-4 of DESIGN §6 from the pre-activation u (E, C) in original edge order."""
    centre, receiver = edge_index[0], edge_index[1]
    channels = u.shape[1]
    head_dim = channels // heads
    order, rowptr = _packed_order(centre, num_nodes)
    z = F.gelu(u)
    if dropout > 0.0:
        if seed is None:
            z = F.dropout(z, dropout, True)
        else:
            packed_mask = counter_dropout_mask(seed, u.shape[0], channels, dropout, device=u.device, dtype=u.dtype)
            z = z * packed_mask[torch.argsort(order)]
    q, k, v = F.linear(z, w_qkv, b_qkv).view(-1, 3, heads, head_dim).unbind(1)
    packed = neighbourhood_attention(q[order], k[order], v[order], rowptr, projection=projection,
                                     threshold=threshold, scale=scale, eps=eps)
    o = torch.zeros_like(packed).index_copy(0, order, packed)
    pre = F.linear(o.flatten(1), w_out, b_out)
    return aggregate_dense(F.gelu(pre), centre, receiver, num_nodes, aggr, heads, gate_group, keys=pre)


def ntconv_messages(centre_term, receiver_term, edge_index, w_qkv, b_qkv, w_out, b_out, *, heads,
                    aggr="weighted_mean", gate_group="receiver", edge_attr=None, w_edge=None, projection=None,
                    threshold=None, dropout=0.0, seed=0, scale=None, eps=1e-4):
    """The fused NT layer op (DESIGN §10) by plain composition, for checking kernels.

    ``centre_term`` = x W_c + b and ``receiver_term`` = x W_r are (N, C); the
    message pre-activation of edge (j, k) is ``centre_term[j] + receiver_term[k]
    (+ edge_attr[e] @ w_edge.T)``; weights in ``nn.Linear`` layout (out, in).
    Dropout (p = ``dropout``) uses the counter generator with ``seed``, keyed by
    packed row (the stable sort of the edges by centre).  Without a projection
    every neighbourhood takes exact attention; with one, ``threshold=None``
    means the paper's n*.  Returns the (N, C) aggregated output.
    """
    centre, receiver = edge_index[0], edge_index[1]
    u = centre_term[centre] + receiver_term[receiver]
    if edge_attr is not None:
        u = u + edge_attr @ w_edge.T
    return _messages_and_aggregate(u, edge_index, centre_term.shape[0], w_qkv, b_qkv, w_out, b_out, heads=heads,
                                   aggr=aggr, gate_group=gate_group, projection=projection, threshold=threshold,
                                   dropout=dropout, seed=seed, scale=scale, eps=eps)


class DirNT(nn.Module):
    """Reference Dir-NT: NTConv on the edges plus NTConv on the reversed edges."""

    def __init__(self, in_channels, out_channels, **kwargs):
        super().__init__()
        self.conv = NTConv(in_channels, out_channels, **kwargs)
        self.conv_reversed = NTConv(in_channels, out_channels, **kwargs)

    def forward(self, x, edge_index, edge_attr=None):
        return self.conv(x, edge_index, edge_attr) + self.conv_reversed(x, edge_index.flip(0), edge_attr)


class NT(nn.Module):
    """Reference NT network; same structure and parameter names as ``nt_kernels.nn.NT``."""

    def __init__(self, in_channels, hidden_channels, num_layers, out_channels=None, *, heads=1, dropout=0.0,
                 directed=False, sep=False, **conv_kwargs):
        super().__init__()
        hidden = hidden_channels
        out_channels = hidden if out_channels is None else out_channels
        self.sep = sep
        conv_cls = DirNT if directed else NTConv
        self.encoder = nn.Sequential(nn.Linear(in_channels, hidden), nn.Dropout(dropout), nn.GELU())
        self.norms = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(num_layers))
        self.convs = nn.ModuleList(conv_cls(hidden, hidden, heads=heads, **conv_kwargs) for _ in range(num_layers))
        self.ffns = nn.ModuleList(
            nn.Sequential(nn.Linear((2 if sep else 1) * hidden, hidden), nn.Dropout(dropout), nn.GELU(),
                          nn.Linear(hidden, hidden), nn.Dropout(dropout))
            for _ in range(num_layers))
        self.predictor = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, out_channels))

    def forward(self, x, edge_index, edge_attr=None):
        x = self.encoder(x)
        for norm, conv, ffn in zip(self.norms, self.convs, self.ffns):
            nx = norm(x)
            h = conv(nx, edge_index, edge_attr)
            x = x + ffn(torch.cat([nx, h], dim=-1) if self.sep else h)
        return self.predictor(x)
