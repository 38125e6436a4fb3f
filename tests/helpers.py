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
  HeterophilousGraphDataset npz layout (a ring, random masks).

Tolerances against a float64 reference (``TOLERANCE[dtype]`` as rtol and atol;
for float32 the atol scales with the reference's largest magnitude, at least 1):

* ``assert_close(got, want, msg="")``: ``got`` in float64 or float32 vs the float64 ``want``.

The low-precision rule (bfloat16, float16): our error against the float64
reference is at most twice that of PyTorch in the same dtype, plus
``LOW_PRECISION_FLOOR`` x the reference's largest magnitude:

* ``max_error(got, want)``: max |got - want| in float64;
* ``assert_within_twice_torch_error(got, torch_same_dtype, want, msg="")``.
"""
from __future__ import annotations

import numpy as np
import torch

from nt_kernels.csr import NeighbourhoodCSR
from nt_kernels.performer import orthogonal_random_features

__all__ = ["LOW_PRECISION_FLOOR", "TOLERANCE", "assert_close", "assert_within_twice_torch_error", "csr_of_sizes",
           "max_error", "packed", "projection", "rowptr_of", "write_npz"]

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
LOW_PRECISION_FLOOR = 1e-3


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


def assert_close(got: torch.Tensor, want: torch.Tensor, msg: str = "") -> None:
    """``got`` (float64 or float32) against the float64 reference ``want`` with TOLERANCE[got.dtype]
    as rtol and atol; for float32 the atol scales with the reference's largest magnitude (at least 1)."""
    tol = TOLERANCE[got.dtype]
    atol = tol * max(1.0, want.abs().max().item()) if got.dtype == torch.float32 and want.numel() else tol
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=atol, msg=msg or None)


def max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.double() - want.double()).abs().max().item() if want.numel() else 0.0


def assert_within_twice_torch_error(got: torch.Tensor, torch_same_dtype: torch.Tensor, want: torch.Tensor,
                                    msg: str = "") -> None:
    """Error of ``got`` vs float64 ``want`` <= 2 x that of PyTorch in the same dtype (+ a magnitude floor)."""
    floor = LOW_PRECISION_FLOOR * want.abs().max().item() if want.numel() else 0.0
    ours, theirs = max_error(got, want), max_error(torch_same_dtype, want)
    assert ours <= 2 * theirs + floor, f"{msg}: error {ours:.3g} vs PyTorch's {theirs:.3g} in {got.dtype}"
