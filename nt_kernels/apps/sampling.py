"""Mini-batches of seed nodes for NT through PyG's ``NeighborLoader``.

What one NT layer reads.  The output at receiver k sums the messages of every
centre j with an edge (j, k) (row 0 = centre, row 1 = receiver), and the
message of (j, k) is an attention over the *whole* neighbourhood of j: all of
j's edges (j, k').  So a layer reaches two hops: the centres sending to k, then
those centres' neighbourhoods.  ``NeighborLoader`` walks edges backwards (PyG's
default ``sample_direction="forward"``: for a node v it samples edges u -> v,
i.e. in-edges, and ``batch.edge_index`` keeps them as u -> v = centre u,
receiver v).  With its plain one-hop-per-layer, ``directional`` subgraph, a
sampled centre's segment holds only the receivers that sampled it, so even
``-1`` cuts the neighbourhoods of the outer centres.

:func:`nt_loader` therefore asks the loader for two hops per NT layer with the
layer's fan-out (:func:`loader_hops`) and for a ``bidirectional`` subgraph
(every sampled edge u -> v also as v -> u).  On a symmetric graph (what NT
trains on: every edge stored both ways) a centre's segment in the batch is
then the set of its sampled neighbours: those it sampled and those that sampled
it.  With ``-1`` every node the loader expands keeps its whole neighbourhood
and the outputs at the seeds equal the full-graph ones.

PyG samples with ``pyg-lib`` or ``torch-sparse``.  Neither has a wheel on PyPI
for torch 2.13 (pyg-lib is published only on PyG's own wheel index,
torch-sparse only as a source package), and PyG has no pure-PyTorch fallback:
its ``NeighborSampler`` raises ``ImportError``.  :func:`neighbor_sampler` then
returns :class:`TorchNeighborSampler`, PyG's sampler with the sampling step
written in PyTorch (uniform, without replacement); the loader, relabelling,
batching and feature gathering stay PyG's.
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
import torch_geometric.typing
from torch_geometric.data import Data
from torch_geometric.loader import NeighborLoader
from torch_geometric.sampler import NeighborSampler, SamplerOutput

__all__ = ["TorchNeighborSampler", "check_num_neighbors", "loader_hops", "neighbor_sampler", "nt_loader"]


def check_num_neighbors(num_neighbors, num_layers: int, owner: str = "num_neighbors") -> tuple[int, ...]:
    """``num_neighbors`` as a tuple of ints, one per layer, each -1 (all) or >= 1."""
    values = tuple(num_neighbors)
    if len(values) != num_layers:
        raise ValueError(f"{owner}: need one count per layer ({num_layers} layers), got {len(values)}: "
                         f"{list(values)}")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
            raise ValueError(f"{owner}: each count must be an int >= 1 or -1 (whole neighbourhoods), got {value!r}")
    return values


def loader_hops(num_neighbors: Sequence[int]) -> list[int]:
    """NeighborLoader's per-hop fan-outs for NT: each layer's count twice (PyG's order, seeds' layer first)."""
    return [count for count in num_neighbors for _ in range(2)]


def _sample_positions(start: torch.Tensor, degree: torch.Tensor, fanout: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``fanout`` uniformly drawn in-edges per node (all for -1 or small degrees): (node index, CSC position)."""
    take = degree if fanout < 0 else degree.clamp(max=fanout)
    owner = torch.repeat_interleave(torch.arange(degree.numel()), degree)
    offset = torch.arange(owner.numel()) - torch.repeat_interleave(torch.cumsum(degree, 0) - degree, degree)
    if bool((take < degree).any()):
        # Random keys, sorted within each node's run of candidates: the first `take` are a uniform subset.
        order = torch.argsort(torch.rand(owner.numel()), stable=True)
        order = order[torch.argsort(owner[order], stable=True)]
        kept = torch.sort(order[offset < take[owner]]).values
        owner, offset = owner[kept], offset[kept]
    return owner, start[owner] + offset


class TorchNeighborSampler(NeighborSampler):
    """PyG's :class:`NeighborSampler` with its sampling step in PyTorch, for installs without pyg-lib/torch-sparse.

    Homogeneous graphs, uniform sampling without replacement, ``directional``
    or ``bidirectional`` subgraphs; draws from torch's global generator.  Output
    as pyg-lib's: seeds first, new nodes in order of discovery, edges as local
    (source, target) with their CSC positions.
    """

    def __init__(self, data: Data, num_neighbors, subgraph_type: str = "directional", **kwargs):
        if subgraph_type not in ("directional", "bidirectional"):
            raise ValueError(f"TorchNeighborSampler: subgraph_type must be 'directional' or 'bidirectional', "
                             f"got {subgraph_type!r}")
        for name in ("replace", "disjoint"):
            if kwargs.get(name):
                raise ValueError(f"TorchNeighborSampler: {name}=True is not supported")
        for name in ("time_attr", "weight_attr"):
            if kwargs.get(name) is not None:
                raise ValueError(f"TorchNeighborSampler: {name} is not supported")
        if not isinstance(data, Data):
            raise ValueError(f"TorchNeighborSampler: data must be a torch_geometric Data, got {type(data).__name__}")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*pyg-lib.*")
            super().__init__(data, num_neighbors, subgraph_type=subgraph_type, **kwargs)

    def _sample(self, seed: torch.Tensor, seed_time=None, **kwargs) -> SamplerOutput:
        if isinstance(seed, dict) or seed_time is not None:
            raise ValueError("TorchNeighborSampler: only homogeneous, non-temporal sampling is supported")
        node = seed.long()
        local = torch.full((self.num_nodes,), -1, dtype=torch.long)
        local[node] = torch.arange(node.numel())
        if int((local >= 0).sum()) != node.numel():
            raise ValueError("TorchNeighborSampler: the seed nodes of a batch must be distinct")
        frontier, rows, cols, edges = node, [], [], []
        num_sampled_nodes, num_sampled_edges = [node.numel()], []
        for fanout in self.num_neighbors.get_mapped_values():
            start = self.colptr[frontier]
            receivers, positions = _sample_positions(start, self.colptr[frontier + 1] - start, fanout)
            sources = self.row[positions]
            unseen = sources[local[sources] < 0]
            fresh, inverse = torch.unique(unseen, return_inverse=True)
            first = torch.full((fresh.numel(),), unseen.numel(), dtype=torch.long)
            first = first.scatter_reduce(0, inverse, torch.arange(unseen.numel()), "amin")
            fresh = fresh[torch.argsort(first)]
            local[fresh] = torch.arange(node.numel(), node.numel() + fresh.numel())
            node = torch.cat([node, fresh])
            rows.append(local[sources])
            cols.append(local[frontier[receivers]])
            edges.append(positions)
            num_sampled_nodes.append(fresh.numel())
            num_sampled_edges.append(positions.numel())
            frontier = fresh
        return SamplerOutput(node=node, row=torch.cat(rows), col=torch.cat(cols), edge=torch.cat(edges),
                             batch=None, num_sampled_nodes=num_sampled_nodes, num_sampled_edges=num_sampled_edges)


def neighbor_sampler(data: Data, hops: Sequence[int], subgraph_type: str = "bidirectional") -> NeighborSampler:
    """PyG's NeighborSampler when pyg-lib or torch-sparse is installed, else :class:`TorchNeighborSampler`."""
    if torch_geometric.typing.WITH_PYG_LIB or torch_geometric.typing.WITH_TORCH_SPARSE:
        return NeighborSampler(data, list(hops), subgraph_type=subgraph_type)
    return TorchNeighborSampler(data, list(hops), subgraph_type=subgraph_type)


def _check_symmetric(edge_index: torch.Tensor, num_nodes: int) -> None:
    keys = torch.sort(edge_index[0] * num_nodes + edge_index[1]).values
    reversed_keys = torch.sort(edge_index[1] * num_nodes + edge_index[0]).values
    if not torch.equal(keys, reversed_keys):
        raise ValueError("nt_loader: the graph must be symmetric (every edge stored both ways): a centre's "
                         "neighbourhood is sampled through its in-edges (for a directed graph, train full-batch)")


class _TrueEdgeIds:
    """Gives every edge of a bidirectional batch its own CSC position (the loader reuses the sampled edge's id)."""

    def __init__(self, sampler: NeighborSampler):
        target = torch.repeat_interleave(torch.arange(sampler.num_nodes), torch.diff(sampler.colptr))
        self.num_nodes = sampler.num_nodes
        self.keys, self.order = torch.sort(target * sampler.num_nodes + sampler.row)

    def __call__(self, out: SamplerOutput) -> SamplerOutput:
        keys = out.node[out.col] * self.num_nodes + out.node[out.row]
        out.edge = self.order[torch.searchsorted(self.keys, keys)]
        return out


def nt_loader(data: Data, num_neighbors: Sequence[int], *, batch_size: int, input_nodes=None, sampler=None,
              shuffle: bool = False, **kwargs) -> NeighborLoader:
    """A ``NeighborLoader`` whose batches hold what an NT with ``len(num_neighbors)`` layers reads at the seeds.

    ``num_neighbors``: one fan-out per layer, PyG's order (the first entry
    samples for the layer next to the output); ``-1`` keeps every in-edge, and
    with all ``-1`` the model's outputs at the seeds (``batch.batch_size``
    first rows) are exact.  ``data.edge_index`` must be symmetric.  ``sampler``
    is a ``torch.utils.data.Sampler`` over positions in ``input_nodes``
    (e.g. a ``DistributedSampler``); other keywords go to ``NeighborLoader``.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"nt_loader: batch_size must be an int >= 1, got {batch_size!r}")
    counts = check_num_neighbors(num_neighbors, len(tuple(num_neighbors)), "nt_loader: num_neighbors")
    if not counts:
        raise ValueError("nt_loader: num_neighbors needs at least one layer")
    _check_symmetric(data.edge_index, data.num_nodes)
    hops = loader_hops(counts)
    node_sampler = neighbor_sampler(data, hops)
    fix = _TrueEdgeIds(node_sampler) if data.edge_attr is not None else None
    return NeighborLoader(data, hops, input_nodes=input_nodes, batch_size=batch_size, subgraph_type="bidirectional",
                          neighbor_sampler=node_sampler, sampler=sampler, shuffle=shuffle,
                          transform_sampler_output=fix, **kwargs)
