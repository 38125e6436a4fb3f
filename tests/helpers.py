"""Helpers shared by the test modules: input factories, dtype tolerances, the low-precision rule.

Import with ``from helpers import ...`` (tests/ is on pytest's path).

Input factories (values drawn in float64 from a seeded CPU generator, then
cast and moved, so a seed gives the same numbers on every device and dtype):

* ``rowptr_of(sizes, device="cpu")`` -> the (S+1,) int64 row pointer of segment sizes;
* ``csr_of_sizes(sizes, device="cpu")`` -> a :class:`NeighbourhoodCSR` whose centre j has sizes[j] rows;
* ``packed(num_rows, heads, dim, *, count=3, dtype=torch.float64, seed=0, device="cpu",
  requires_grad=False)`` -> a list of ``count`` (E, H, D) tensors (q, k, v, and e.g. grad_o);
* ``projection(m, dim, *, dtype=torch.float64, seed=0, device="cpu")`` -> an (m, D) FAVOR+ projection;
* ``write_npz(path, num_nodes=30, num_classes=3, splits=2, seed=0)`` writes a tiny graph in the
  HeterophilousGraphDataset npz layout (a ring, random masks);
* ``directed_graph(seed=0)`` -> the (2, E) ``edge_index`` of a 24-node directed graph (no edge in both
  directions, a hub of degree 7, isolated nodes, random edge order);
* ``adj_t_forms(edge_index, num_nodes)`` -> {name: (adjacency, order)}: the graph in every sparse form of
  PyG's ``Adj`` in its ``adj_t`` convention (row = receiver), with the permutation from ``edge_index``'s
  edge order to the form's stored order (``SparseTensor`` only when torch_sparse imports).

Tolerances against a float64 reference (``TOLERANCE[dtype]`` as rtol and atol;
for float32 the atol scales with the reference's largest magnitude, at least 1):

* ``assert_close(got, want, msg="")``: ``got`` in float64 or float32 vs the float64 ``want``.

The low-precision rule (bfloat16, float16; also a float32 result of an autocast run):
``nt_kernels/apps/tolerance.py``, the rule of ``nt-kernels check`` (docs/design.md §4): our
error against the float64 reference is at most twice that of PyTorch in the same dtype (the
``nt_reference`` code run in that dtype, never this project's kernels) plus the dtype's floor,
with the float32 baseline x eps ratio where PyTorch's run is not finite or far coarser, and the
bound never above 10 % of max |reference| (where it would be, PyTorch in float32 on the rounded
inputs is the better-conditioned baseline):

* ``max_error(got, want)``: max |got - want| in float64 (inf if not finite);
* ``assert_low_precision(got, want, torch_same_dtype, torch_float32, msg="", dtype=None, torch_mixed=None,
  row_scale=None)``; ``row_scale`` (the largest max |reference| of the outputs and gradients compared
  together) is the scale of a ``want`` that is zero up to float64 rounding (tolerance.ZERO_REFERENCE),
  as ``nt-kernels check`` measures it: the 10 % cap and the floor are then taken of that scale, so the
  kernel's value must be small against the other results, not against rounding noise.

With ``$NT_KERNELS_BOUND_LOG`` set, every low-precision comparison appends one JSON line
(test, tensor, dtype, bound, max |reference|, error, baseline) to that file:
``scripts/bound_table.py`` turns it into the table of docs/runs/cpu-2026-11-27-bounds.md.
"""
from __future__ import annotations

import json
import os

import numpy as np
import torch

from nt_kernels.apps.tolerance import low_precision_bound, max_error
from nt_kernels.csr import NeighbourhoodCSR
from nt_kernels.performer import orthogonal_random_features

__all__ = ["DIRECTED_GRAPH_NODES", "TOLERANCE", "adj_t_forms", "assert_close", "assert_low_precision", "csr_of_sizes",
           "directed_graph", "max_error", "packed", "projection", "rowptr_of", "write_npz"]

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def rowptr_of(sizes, device="cpu") -> torch.Tensor:
    """(S+1,) int64 row pointer of segments with the given sizes."""
    sizes = torch.as_tensor(sizes, dtype=torch.int64)
    return torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)]).to(device)


def csr_of_sizes(sizes, device="cpu") -> NeighbourhoodCSR:
    """The CSR of a graph whose centre j has sizes[j] messages (all sent to node 0)."""
    centre = torch.repeat_interleave(torch.arange(len(sizes)), torch.as_tensor(sizes, dtype=torch.int64))
    edge_index = torch.stack([centre, torch.zeros_like(centre)]).to(device)
    return NeighbourhoodCSR.from_edge_index(edge_index, len(sizes))


def packed(num_rows: int, heads: int, dim: int, *, count: int = 3, dtype=torch.float64, seed: int = 0,
           device="cpu", requires_grad: bool = False) -> list[torch.Tensor]:
    """``count`` packed (E, H, D) tensors from one seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(num_rows, heads, dim, generator=gen, dtype=torch.float64).to(device, dtype)
            .requires_grad_(requires_grad) for _ in range(count)]


def projection(m: int, dim: int, *, dtype=torch.float64, seed: int = 0, device="cpu") -> torch.Tensor:
    """An (m, D) FAVOR+ projection from a seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    return orthogonal_random_features(m, dim, generator=gen, dtype=dtype, device=device)


def write_npz(path, num_nodes=30, num_classes=3, splits=2, seed=0) -> None:
    """A tiny graph (a ring) with random masks in the HeterophilousGraphDataset npz layout."""
    rng = np.random.default_rng(seed)
    masks = rng.integers(0, 3, size=(splits, num_nodes))
    np.savez(path, node_features=rng.standard_normal((num_nodes, 5)).astype(np.float32),
             node_labels=np.arange(num_nodes) % num_classes,
             edges=np.stack([np.arange(num_nodes), (np.arange(num_nodes) + 1) % num_nodes], axis=1),
             train_masks=masks == 0, val_masks=masks == 1, test_masks=masks == 2)


DIRECTED_GRAPH_NODES = 24


def directed_graph(seed: int = 0) -> torch.Tensor:
    """A directed graph on 24 nodes (no edge in both directions, so a transposed reading changes an NT layer's
    output), with a hub of degree 7 and isolated nodes, in a random edge order."""
    gen = torch.Generator().manual_seed(seed)
    hub = torch.stack([torch.zeros(7, dtype=torch.long), torch.arange(1, 8)])
    ring = torch.stack([torch.arange(8, 20), torch.arange(9, 21)])
    edges = torch.cat([hub, ring, torch.tensor([[3, 5, 12], [15, 18, 2]])], dim=1)
    return edges[:, torch.randperm(edges.shape[1], generator=gen)]


def adj_t_forms(edge_index: torch.Tensor, num_nodes: int) -> dict:
    """Every sparse form of the graph in PyG's adj_t convention (entry (k, j) for the edge j -> k), each with
    the permutation that takes edge_index's edge order to the form's stored order."""
    from torch_geometric.utils import to_torch_coo_tensor, to_torch_csc_tensor, to_torch_csr_tensor

    row, col = edge_index[1], edge_index[0]
    order = torch.argsort(row * num_nodes + col)          # row-major: receiver, then centre
    by_centre = torch.argsort(col * num_nodes + row)      # column-major
    size = (num_nodes, num_nodes)
    forms = {
        "coo": (to_torch_coo_tensor(torch.stack([row, col]), size=size), order),
        "csr": (to_torch_csr_tensor(torch.stack([row, col]), size=size), order),
        "csc": (to_torch_csc_tensor(torch.stack([row, col]), size=size), by_centre),
        "coo-uncoalesced": (torch.sparse_coo_tensor(torch.stack([row, col]), torch.ones(row.numel()), size),
                            torch.arange(row.numel())),
    }
    try:
        from torch_sparse import SparseTensor
    except ImportError:
        pass
    else:
        forms["SparseTensor"] = (SparseTensor(row=row, col=col, sparse_sizes=size), order)
    return forms


def assert_close(got: torch.Tensor, want: torch.Tensor, msg: str = "") -> None:
    """``got`` (float64 or float32) against the float64 reference ``want`` with TOLERANCE[got.dtype]
    as rtol and atol; for float32 the atol scales with the reference's largest magnitude (at least 1)."""
    tol = TOLERANCE[got.dtype]
    atol = tol * max(1.0, want.abs().max().item()) if got.dtype == torch.float32 and want.numel() else tol
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=atol, msg=msg or None)


def assert_low_precision(got: torch.Tensor, want: torch.Tensor, torch_same_dtype: torch.Tensor,
                         torch_float32: torch.Tensor | None, msg: str = "", dtype: torch.dtype | None = None,
                         torch_mixed=None, row_scale: float | None = None) -> None:
    """``got`` against the float64 ``want`` under the accuracy rule for ``dtype`` (default got's):
    ``torch_same_dtype`` / ``torch_float32`` are PyTorch's results in that dtype and in float32;
    ``torch_mixed`` (a tensor, or a function giving it; used only where the other bounds exceed the
    cap) PyTorch's result in float32 on the inputs rounded to ``dtype``, rounded to ``dtype``;
    ``row_scale``: the largest max |reference| of the results compared together, the scale of a
    ``want`` that vanishes up to rounding (``low_precision_bound``'s argument; None: no such row)."""
    dtype = got.dtype if dtype is None else dtype
    f32 = None if torch_float32 is None else max_error(torch_float32, want)
    mixed = None if torch_mixed is None else (
        lambda: max_error(torch_mixed() if callable(torch_mixed) else torch_mixed, want))
    bound = low_precision_bound(dtype, want, max_error(torch_same_dtype, want), f32, mixed, row_scale)
    error = max_error(got, want)
    _log_bound(msg, dtype, bound, error)
    failure = bound.failure(error)
    assert not failure, f"{msg}: {failure}"


def _log_bound(name, dtype, bound, error) -> None:
    path = os.environ.get("NT_KERNELS_BOUND_LOG")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
        with open(path, "a") as f:
            f.write(json.dumps(dict(test=test, tensor=name, dtype=str(dtype).replace("torch.", ""),
                                    bound=bound.value, scale=bound.scale, ratio=bound.ratio, error=error,
                                    baseline=bound.baseline, low_error=bound.low_error,
                                    float32_scaled=bound.float32_scaled)) + "\n")
