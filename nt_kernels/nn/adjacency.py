"""Sparse adjacency inputs of the NT modules, in PyG's ``adj_t`` convention.

PyG's layers take a graph in their ``edge_index`` argument (PyG's ``Adj``)
either as a (2, E) tensor, row 0 = source, row 1 = target, messages flowing
source -> target, or as a sparse ``adj_t`` (``T.ToSparseTensor()``): the *transposed* adjacency, whose entry
(i, j) is the edge j -> i, so **row = target, column = source**.  PyG's
``MessagePassing`` reads ``torch.sparse`` tensors the same way.

An NT edge (j, k) has centre j (row 0 of ``edge_index``, PyG's source) and
receiver k (row 1, PyG's target): the message of (j, k) is built from j's
neighbourhood and aggregated at k.  So in every sparse form the **row is
the receiver k and the column the centre j**, and the equivalent
``edge_index`` is ``[column; row]``.  Values are ignored: only the pattern
is read (an explicitly stored zero is an edge).

Edge order, which ``edge_attr`` follows: the adjacency's stored order, i.e.
row-major (by receiver) for ``torch.sparse_csr``, a coalesced COO tensor and
``torch_sparse.SparseTensor``; column-major for ``torch.sparse_csc``; the
stored order, duplicates kept, for an uncoalesced COO tensor.
"""
from __future__ import annotations

import torch

__all__ = ["SPARSE_LAYOUTS", "adjacency_edge_index", "is_adjacency"]

SPARSE_LAYOUTS = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc)


def _is_sparse_tensor(edge_index) -> bool:
    """A ``torch_sparse.SparseTensor`` (recognised without importing torch_sparse, which is optional)."""
    kind = type(edge_index)
    return kind.__name__ == "SparseTensor" and kind.__module__.split(".")[0] == "torch_sparse"


def is_adjacency(edge_index) -> bool:
    """Whether ``edge_index`` is a sparse adjacency (a ``torch.sparse`` COO / CSR / CSC tensor or a SparseTensor)."""
    return _is_sparse_tensor(edge_index) or (isinstance(edge_index, torch.Tensor)
                                             and edge_index.layout != torch.strided)


def _pointer_to_index(pointer: torch.Tensor, total: int) -> torch.Tensor:
    """The compressed dimension's index of each of the ``total`` stored entries (no host sync: the size is known)."""
    counts = torch.diff(pointer)
    return torch.repeat_interleave(torch.arange(counts.numel(), device=pointer.device), counts, output_size=total)


def _rows_and_columns(owner: str, adj) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    if _is_sparse_tensor(adj):
        row, col, _ = adj.coo()
        return row, col, tuple(adj.sparse_sizes())
    if adj.layout not in SPARSE_LAYOUTS:
        raise ValueError(f"{owner}: edge_index has layout {adj.layout}; a sparse adjacency must be torch.sparse_coo, "
                         f"torch.sparse_csr or torch.sparse_csc (or a torch_sparse.SparseTensor)")
    if adj.sparse_dim() != 2:
        raise ValueError(f"{owner}: edge_index must be a 2-D sparse adjacency (N, N), got {adj.sparse_dim()} sparse "
                         f"dimensions (size {tuple(adj.shape)})")
    size = tuple(adj.shape[:2])
    if adj.layout == torch.sparse_coo:
        row, col = adj.indices() if adj.is_coalesced() else adj._indices()
    elif adj.layout == torch.sparse_csr:
        col = adj.col_indices()
        row = _pointer_to_index(adj.crow_indices(), col.numel())
    else:
        row = adj.row_indices()
        col = _pointer_to_index(adj.ccol_indices(), row.numel())
    return row, col, size


def adjacency_edge_index(owner: str, adj, num_nodes: int) -> torch.Tensor:
    """The ``edge_index`` (2, E) (row 0 = centre, row 1 = receiver) of a sparse ``adj_t`` (row = receiver).

    ``adj`` must be square with ``num_nodes`` (the rows of x) on each side; a
    ``ValueError`` naming ``edge_index`` (the modules' argument) and ``x`` otherwise.
    """
    row, col, size = _rows_and_columns(owner, adj)
    if size[0] != size[1]:
        raise ValueError(f"{owner}: edge_index must be a square adjacency (N, N) with row = receiver, column = centre; "
                         f"got size {size[0]} x {size[1]}")
    if size[0] != num_nodes:
        raise ValueError(f"{owner}: edge_index is a {size[0]} x {size[1]} adjacency but x has {num_nodes} rows; "
                         f"the adjacency must be N x N with N = x.shape[0]")
    return torch.stack([col.long(), row.long()])
