"""NT layers in PyTorch Geometric style (DESIGN §6): :class:`NTConv` and :class:`DirNT`.

``forward(x, edge_index, edge_attr=None)`` as PyG's convolutions: ``edge_index``
is anything PyG's ``Adj`` allows, a (2, E) tensor (row 0 = centre j, row 1 =
receiver k; PyG's source and target) or a sparse adjacency in PyG's ``adj_t``
convention (row = receiver k, column = centre j; :mod:`nt_kernels.nn.adjacency`),
or a prebuilt :class:`NeighbourhoodCSR`.  Everything derived
from a graph (the centre CSR, the receiver CSR used for aggregation, the
reversed CSR of DirNT, the exact/Performer segment split) is built once:

* for a ``NeighbourhoodCSR``, in that object's own plan cache (``csr.plan``);
* for an ``edge_index``, each module keeps a one-entry cache on itself holding
  the last graph it saw, reused when the next ``edge_index`` has equal
  *content* (``torch.equal``, one host sync per call).  Nothing is keyed by
  tensor identity and nothing lives in module-level globals.

``torch.compile(fullgraph=True)`` needs a prebuilt CSR whose plans are cached:
``csr = model.prepare(edge_index, num_nodes)`` builds all of them.
"""
from __future__ import annotations

import math

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

import nt_reference.ops as reference_ops
from nt_kernels.backends import has_fused_kernel
from nt_kernels.csr import NeighbourhoodCSR
from nt_kernels.nn.adjacency import adjacency_edge_index, is_adjacency
from nt_kernels.nn.aggregate import (AGGREGATORS, GATE_GROUPS, GATED_AGGREGATORS, aggregate, receiver_csr,
                                     reversed_csr)
from nt_kernels.ops import neighbourhood_attention, ntconv, segment_performer_attention, segment_softmax_attention
from nt_kernels.performer import default_nb_features, orthogonal_random_features, switch_threshold

__all__ = ["ATTENTIONS", "BACKENDS", "FUSED_FASTER", "DirNT", "NTConv", "fused_by_default"]

ATTENTIONS = ("switch", "softmax", "performer")
BACKENDS = ("kernels", "reference")
# The attention backend's former name, still accepted: "fused" meant nt_kernels' attention ops.
_BACKEND_ALIASES = {"fused": "kernels"}
_SEED_HIGH = 2 ** 62  # dropout seeds are drawn from [0, 2**62) (the global CPU generator; on the device in a capture)

# What fused=None runs, per device type: True where the fused op measured faster per training step than
# the composition (docs/nn.md, "Fused layer"; `bench --layer`, docs/results.md).  CPU: fused 3.50x faster
# on tolokers, 1.81x on minesweeper.  CUDA (one H100, bf16 autocast, 2026-11-26): fused 387 ms vs 131 ms
# on tolokers, so the composition there until a GPU run measures the fused op faster.  Device types not
# listed run the composition.
FUSED_FASTER = {"cpu": True, "cuda": False}


def fused_by_default(device_type: str) -> bool:
    """Whether ``fused=None`` runs the fused op on ``device_type``: where it measured faster
    (:data:`FUSED_FASTER`) and the device has a kernel for it."""
    return FUSED_FASTER.get(device_type, False) and has_fused_kernel(device_type)


def _check_backend(name: str, value) -> str:
    value = _BACKEND_ALIASES.get(value, value)
    _check_choice(name, value, BACKENDS)
    return value


def _check_fused(name: str, value) -> None:
    if value not in (None, True, False):
        raise ValueError(f"{name}: fused must be None (the path measured faster on the device), "
                         f"True or False, got {value!r}")


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def _draw_seed(dropout: float, device: torch.device) -> torch.Tensor | None:
    """The fused op's dropout seed for one call: drawn from the global CPU generator (so ``torch.manual_seed``
    reproduces a run), or, inside a CUDA graph capture, from ``device``'s generator (a host value would be
    recorded once and every replay would reuse one mask; a device draw is replayed afresh)."""
    if dropout <= 0:
        return None
    # (Under torch.compile the host draw stays: Inductor runs no CUDA graph over a graph with CPU ops.)
    if device.type == "cuda" and not torch.compiler.is_compiling() and torch.cuda.is_current_stream_capturing():
        return torch.randint(_SEED_HIGH, (), dtype=torch.int64, device=device)
    return torch.randint(_SEED_HIGH, (), dtype=torch.int64)


def _check_dropout(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name}: dropout must be a number in [0, 1), got {value!r}")


class _GraphCache:
    """One-entry, content-keyed cache of the CSR built from an ``edge_index`` (a sparse adjacency is read as its
    ``edge_index`` first, :func:`~nt_kernels.nn.adjacency.adjacency_edge_index`, O(E) per call)."""

    def __init__(self):
        self.edge_index = None
        self.num_nodes = None
        self.csr = None

    def __call__(self, owner: str, edge_index, num_nodes: int) -> NeighbourhoodCSR:
        if isinstance(edge_index, NeighbourhoodCSR):
            return edge_index
        if is_adjacency(edge_index):
            edge_index = adjacency_edge_index(owner, edge_index, num_nodes)
        if not isinstance(edge_index, torch.Tensor):
            raise ValueError(f"{owner}: edge_index must be a (2, E) tensor, a sparse adjacency adj_t "
                             f"(torch.sparse COO / CSR / CSC or torch_sparse.SparseTensor, row = receiver) or a "
                             f"NeighbourhoodCSR, got {type(edge_index).__name__}")
        cached = self.edge_index
        if (cached is not None and self.num_nodes == num_nodes and cached.shape == edge_index.shape
                and cached.device == edge_index.device and torch.equal(cached, edge_index.to(cached.dtype))):
            return self.csr
        csr = NeighbourhoodCSR.from_edge_index(edge_index, num_nodes)
        self.edge_index, self.num_nodes, self.csr = edge_index.detach().long().clone(), num_nodes, csr
        return csr


_BIPARTITE = ("NT layers do not support bipartite input (x_source, x_target), so they cannot run on the edge "
              "types between two node types of a heterogeneous graph (torch_geometric.nn.to_hetero)")


def _check_in_channels(owner: str, value) -> None:
    if isinstance(value, (tuple, list)):
        raise ValueError(f"{owner}: in_channels must be an int, got {value!r}; {_BIPARTITE}")
    _check_int(f"{owner}: in_channels", value, 1)


def _check_x(owner: str, x, in_channels: int) -> None:
    if isinstance(x, torch.fx.Proxy):
        raise ValueError(f"{owner}: x is a torch.fx Proxy, but NT modules cannot be traced symbolically (as "
                         f"torch_geometric.nn.to_hetero traces the model it converts): they read edge_index's "
                         f"values to build their CSR; {_BIPARTITE}")
    if isinstance(x, (tuple, list)):
        raise ValueError(f"{owner}: x must be one (N, in_channels={in_channels}) tensor, got a "
                         f"{type(x).__name__}; {_BIPARTITE}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != in_channels:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{owner}: x must have shape (N, in_channels={in_channels}), got {shape}")


def _check_csr_fits(owner: str, csr: NeighbourhoodCSR, num_nodes: int) -> None:
    if csr.num_nodes > num_nodes:
        raise ValueError(f"{owner}: edge_index is a NeighbourhoodCSR of {csr.num_nodes} centre nodes but x has "
                         f"only {num_nodes} rows")


def _format(value) -> str:
    """A value in a PyG-style repr: strings unquoted (``aggr=sum``), floats in short form."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


class NTConv(nn.Module):
    r"""Neighbourhood Transformer layer (paper §3-4, DESIGN §6).

    For every edge (j, k), the message :math:`Z_{jk} = \mathrm{GELU}(x_j W_j + x_k W_k + e_{jk} W_e + b)`
    is built without materialising the concatenation; self-attention runs
    among the messages of each centre's neighbourhood with ``heads`` heads of
    width ``D = out_channels // heads`` (``out_channels`` must be divisible by
    ``heads``); :math:`M = \mathrm{GELU}(W_o\,\mathrm{attention}(q, k, v) + b_o)`
    is aggregated at the receivers.  For ``weighted_mean`` / ``gated_sum``,
    ``W_o`` has ``2 * out_channels`` outputs, read per head as [gate | value].

    ``forward(x, edge_index, edge_attr=None)``: ``x`` (N, in_channels), one node
    set (no bipartite ``(x_source, x_target)``); ``edge_index`` a (2, E) tensor,
    a sparse ``adj_t`` or a :class:`NeighbourhoodCSR` (module docstring);
    ``edge_attr`` (E, edge_dim) in ``edge_index``'s edge order.  Returns (N, out_channels).

    Args:
        in_channels, out_channels: node feature widths (ints: no bipartite pair, no lazy -1).
        heads: attention heads H.
        edge_dim: width of ``edge_attr``; ``None`` means the layer takes no edge features.
        aggr: ``sum``, ``mean``, ``max``, ``weighted_mean`` or ``gated_sum``.
        dropout: dropout on the combined messages Z (before q, k, v).
        attention: ``switch`` (exact up to the threshold, Performer above),
            ``softmax`` (exact everywhere) or ``performer``.
        nb_features: Performer features m; default ``int(D ln D)``.
        threshold: switch threshold; default the paper's n* for (m, D).
        gate_group: normalise the weighted_mean gate over messages arriving at
            the same ``receiver`` (paper) or sent by the same ``centre`` (released code).
        backend: the attention ops of the composition: ``kernels`` (nt_kernels ops;
            ``"fused"``, its former name, is accepted) or ``reference`` (nt_reference loops);
            settable later as ``conv.backend``.
        fused: run the whole message pipeline as one fused op (``nt_kernels.ntconv``,
            no per-message activation kept for backward): ``None`` (default) the path
            measured faster on the input's device type (:func:`fused_by_default`: the
            fused op on CPU, the composition on CUDA for now), ``True`` always (an error
            where the device has no fused kernel), ``False`` never (the composition of
            Linear, GELU, dropout, attention op and aggregation: the comparison point).
            Settable later as ``conv.fused``.
            The fused op draws its dropout mask from a counter generator seeded from
            the global CPU generator (inside a CUDA graph capture, from the device's, so
            that each replay draws a new mask), the composition uses ``F.dropout``: the
            two give different masks for the same global seed, each reproducible.
    """

    def __init__(self, in_channels: int, out_channels: int, heads: int = 1, edge_dim: int | None = None,
                 aggr: str = "weighted_mean", dropout: float = 0.0, attention: str = "switch",
                 nb_features: int | None = None, threshold: float | None = None, gate_group: str = "receiver",
                 backend: str = "kernels", fused: bool | None = None):
        super().__init__()
        _check_in_channels("NTConv", in_channels)
        _check_int("NTConv: out_channels", out_channels, 1)
        _check_int("NTConv: heads", heads, 1)
        if out_channels % heads:
            raise ValueError(f"NTConv: out_channels ({out_channels}) must be divisible by heads ({heads})")
        if edge_dim is not None:
            _check_int("NTConv: edge_dim", edge_dim, 1)
        _check_choice("NTConv: aggr", aggr, AGGREGATORS)
        _check_dropout("NTConv", dropout)
        _check_choice("NTConv: attention", attention, ATTENTIONS)
        if nb_features is not None:
            _check_int("NTConv: nb_features", nb_features, 1)
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                                      or math.isnan(threshold) or threshold < 0):
            raise ValueError(f"NTConv: threshold must be a non-negative number or None, got {threshold!r}")
        if threshold is not None and attention != "switch":
            raise ValueError(f"NTConv: threshold only applies to attention='switch', got attention={attention!r}")
        _check_choice("NTConv: gate_group", gate_group, GATE_GROUPS)
        self.in_channels, self.out_channels, self.heads = in_channels, out_channels, heads
        self.head_dim = out_channels // heads
        self.edge_dim, self.aggr, self.dropout, self.attention = edge_dim, aggr, float(dropout), attention
        self.gate_group = gate_group
        self.backend = backend
        self.fused = fused
        self.lin_centre = nn.Linear(in_channels, out_channels)
        self.lin_receiver = nn.Linear(in_channels, out_channels, bias=False)
        self.lin_edge = nn.Linear(edge_dim, out_channels, bias=False) if edge_dim is not None else None
        self.lin_qkv = nn.Linear(out_channels, 3 * out_channels)
        out_width = 2 * out_channels if aggr in GATED_AGGREGATORS else out_channels
        self.lin_out = nn.Linear(out_channels, out_width)
        if attention == "softmax":
            self.nb_features = None
            self.register_buffer("projection", None)
            self.threshold = math.inf
        else:
            self.nb_features = nb_features or default_nb_features(self.head_dim)
            self.register_buffer("projection", orthogonal_random_features(self.nb_features, self.head_dim))
            default = switch_threshold(self.nb_features, self.head_dim)
            self.threshold = 0.0 if attention == "performer" else float(default if threshold is None else threshold)
        self._graphs = _GraphCache()

    @property
    def backend(self) -> str:
        return self._backend

    @backend.setter
    def backend(self, value: str) -> None:
        self._backend = _check_backend("NTConv: backend", value)

    @property
    def fused(self) -> bool | None:
        return self._fused

    @fused.setter
    def fused(self, value: bool | None) -> None:
        _check_fused("NTConv", value)
        self._fused = value

    def uses_fused(self, device: torch.device) -> bool:
        """Whether ``forward`` on ``device`` runs the fused op (raises where ``fused=True`` cannot be honoured)."""
        if self._fused is False:
            return False
        if self._backend == "reference":
            if self._fused:
                raise ValueError("NTConv: fused=True runs nt_kernels' fused op; backend='reference' needs fused=False "
                                 "or None")
            return False
        if self._fused is None:
            return fused_by_default(device.type)
        if not has_fused_kernel(device.type):
            raise ValueError(f"NTConv: fused=True but the fused NT layer op has no kernel for device "
                             f"{device.type!r}; use fused=None (falls back to the composition) or fused=False")
        return True

    def reset_parameters(self) -> None:
        """Re-initialise every weight and redraw the Performer projection from the global RNG, in the
        constructor's order (so a reset after ``torch.manual_seed(s)`` gives the initialisation of a layer
        built after ``torch.manual_seed(s)``)."""
        for lin in (self.lin_centre, self.lin_receiver, self.lin_edge, self.lin_qkv, self.lin_out):
            if lin is not None:
                lin.reset_parameters()
        if self.projection is not None:
            fresh = orthogonal_random_features(self.nb_features, self.head_dim)
            self.projection.copy_(fresh.to(self.projection))

    def prepare(self, edge_index, num_nodes: int) -> NeighbourhoodCSR:
        """The CSR of ``edge_index`` with every plan this layer needs built (call before ``torch.compile``)."""
        csr = self._graphs("NTConv.prepare", edge_index, num_nodes)
        csr.segment_split(self.threshold)
        _ = receiver_csr(csr, num_nodes).centre
        return csr

    def forward(self, x: torch.Tensor, edge_index, edge_attr: torch.Tensor | None = None) -> torch.Tensor:
        _check_x("NTConv", x, self.in_channels)
        csr = self._graphs("NTConv", edge_index, x.shape[0])
        _check_csr_fits("NTConv", csr, x.shape[0])
        self._check_edge_attr(csr, edge_attr)
        if self.uses_fused(x.device):
            return self._forward_fused(x, csr, edge_attr)
        z = (self.lin_centre(x).index_select(0, csr.centre)
             + self.lin_receiver(x).index_select(0, csr.receiver))
        if self.edge_dim is not None:
            z = z + self.lin_edge(csr.pack(edge_attr))
        z = F.dropout(F.gelu(z), self.dropout, self.training)
        q, k, v = self.lin_qkv(z).view(z.shape[0], 3, self.heads, self.head_dim).unbind(1)
        o = self._attend(q, k, v, csr)
        pre = self.lin_out(o.reshape(o.shape[0], self.out_channels))
        return aggregate(F.gelu(pre), csr, self.aggr, num_nodes=x.shape[0], heads=self.heads,
                         gate_group=self.gate_group, keys=pre)

    def _check_edge_attr(self, csr: NeighbourhoodCSR, edge_attr) -> None:
        if self.edge_dim is None:
            if edge_attr is not None:
                raise ValueError("NTConv: edge_attr given but the layer was built with edge_dim=None")
            return
        if edge_attr is None:
            raise ValueError(f"NTConv: edge_attr of shape (E, edge_dim={self.edge_dim}) is required")
        if edge_attr.dim() != 2 or edge_attr.shape != (csr.num_edges, self.edge_dim):
            raise ValueError(f"NTConv: edge_attr must have shape (E={csr.num_edges}, edge_dim={self.edge_dim}), "
                             f"got {tuple(edge_attr.shape)}")

    def _forward_fused(self, x: torch.Tensor, csr: NeighbourhoodCSR, edge_attr) -> torch.Tensor:
        """Steps 1-4 of DESIGN §6 as one fused op from the two node terms (docs/design.md §9)."""
        dropout = self.dropout if self.training else 0.0
        seed = _draw_seed(dropout, x.device)
        threshold = None if self.attention == "softmax" else self.threshold
        return ntconv(self.lin_centre(x), self.lin_receiver(x), csr, self.lin_qkv.weight, self.lin_qkv.bias,
                      self.lin_out.weight, self.lin_out.bias, heads=self.heads, aggr=self.aggr,
                      gate_group=self.gate_group, edge_attr=edge_attr,
                      w_edge=None if self.lin_edge is None else self.lin_edge.weight, projection=self.projection,
                      threshold=threshold, dropout=dropout, seed=seed, num_nodes=x.shape[0])

    def _attend(self, q, k, v, csr: NeighbourhoodCSR) -> torch.Tensor:
        if self.backend == "reference":
            if self.attention == "softmax":
                return reference_ops.segment_softmax_attention(q, k, v, csr.rowptr)
            if self.attention == "performer":
                return reference_ops.segment_performer_attention(q, k, v, csr.rowptr, self.projection)
            return reference_ops.neighbourhood_attention(q, k, v, csr.rowptr, projection=self.projection,
                                                         threshold=self.threshold)
        if self.attention == "softmax":
            return segment_softmax_attention(q, k, v, csr)
        if self.attention == "performer":
            return segment_performer_attention(q, k, v, csr, self.projection)
        return neighbourhood_attention(q, k, v, csr, projection=self.projection, threshold=self.threshold)

    def _repr_options(self) -> list[str]:
        """``heads`` and ``aggr``, then every other constructor option that differs from its default, as
        ``name=value`` (PyG's repr style: strings unquoted); ``nb_features`` and ``threshold`` when they differ
        from the values derived from the head width."""
        parts = [f"heads={self.heads}", f"aggr={self.aggr}"]
        if self.edge_dim is not None:
            parts.append(f"edge_dim={self.edge_dim}")
        if self.dropout:
            parts.append(f"dropout={_format(self.dropout)}")
        if self.attention != "switch":
            parts.append(f"attention={self.attention}")
        if self.projection is not None and self.nb_features != default_nb_features(self.head_dim):
            parts.append(f"nb_features={self.nb_features}")
        if self.attention == "switch" and self.threshold != switch_threshold(self.nb_features, self.head_dim):
            parts.append(f"threshold={_format(self.threshold)}")
        if self.gate_group != "receiver":
            parts.append(f"gate_group={self.gate_group}")
        if self.backend != "kernels":
            parts.append(f"backend={self.backend}")
        if self.fused is not None:
            parts.append(f"fused={self.fused}")
        return parts

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.in_channels}, {self.out_channels}, {', '.join(self._repr_options())})"


class DirNT(nn.Module):
    """Dir-NT (paper §4): one NTConv on the edges plus one on the reversed edges, summed.

    Takes NTConv's arguments; both convolutions get the same ones (their own weights).
    """

    def __init__(self, in_channels: int, out_channels: int, **kwargs):
        super().__init__()
        _check_in_channels("DirNT", in_channels)
        self.conv = NTConv(in_channels, out_channels, **kwargs)
        self.conv_reversed = NTConv(in_channels, out_channels, **kwargs)
        self._graphs = _GraphCache()

    @property
    def backend(self) -> str:
        return self.conv.backend

    @backend.setter
    def backend(self, value: str) -> None:
        self.conv.backend = value
        self.conv_reversed.backend = value

    @property
    def fused(self) -> bool | None:
        return self.conv.fused

    @fused.setter
    def fused(self, value: bool | None) -> None:
        self.conv.fused = value
        self.conv_reversed.fused = value

    @property
    def in_channels(self) -> int:
        return self.conv.in_channels

    @property
    def out_channels(self) -> int:
        return self.conv.out_channels

    def reset_parameters(self) -> None:
        """Re-initialise both directions' layers (:meth:`NTConv.reset_parameters`), in the constructor's order."""
        self.conv.reset_parameters()
        self.conv_reversed.reset_parameters()

    def _repr_options(self) -> list[str]:
        """The options of both layers (:meth:`NTConv._repr_options`)."""
        return self.conv._repr_options()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.in_channels}, {self.out_channels}, {', '.join(self._repr_options())})"

    def prepare(self, edge_index, num_nodes: int) -> NeighbourhoodCSR:
        """The CSR of ``edge_index`` with every plan of both directions built (call before ``torch.compile``)."""
        csr = self.conv.prepare(self._graphs("DirNT.prepare", edge_index, num_nodes), num_nodes)
        self.conv_reversed.prepare(reversed_csr(csr, num_nodes), num_nodes)
        return csr

    def forward(self, x: torch.Tensor, edge_index, edge_attr: torch.Tensor | None = None) -> torch.Tensor:
        _check_x("DirNT", x, self.conv.in_channels)
        csr = self._graphs("DirNT", edge_index, x.shape[0])
        _check_csr_fits("DirNT", csr, x.shape[0])
        return self.conv(x, csr, edge_attr) + self.conv_reversed(x, reversed_csr(csr, x.shape[0]), edge_attr)
