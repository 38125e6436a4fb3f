"""Pieces shared by the suites of ``nt-kernels check`` (check.py, check_ntconv.py): the table row,
the run's settings and reference cache, graphs, inputs, and the verdict of the accuracy rule
(nt_kernels/apps/tolerance.py) over a row's outputs and gradients."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from nt_kernels import NeighbourhoodCSR, orthogonal_random_features
from nt_kernels.apps.tolerance import low_precision_bound, max_error, reference_scale

__all__ = ["DTYPES", "Graph", "Row", "Settings", "cached_reference", "differing_elements", "forward_backward",
           "make_graph", "make_inputs", "verdict"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass
class Row:
    """One line of the table."""

    path: str
    case: str
    dtype: str
    dim: int | None
    worst: str = ""
    error: float = 0.0
    tolerance: float = 0.0
    status: str = "pass"   # pass, FAIL or skip
    note: str = ""
    baseline: str = ""     # of the tolerance: the dtype, "float32 x <eps ratio>" or "float32 on <dtype> inputs"
    seconds: float = 0.0   # wall time of the row (inputs, compiles, references, kernel)
    bound_ratio: float = 0.0  # the largest bound / max|reference| over the row's tensors (the cap is 0.10)
    bound_worst: str = ""     # the tensor of that largest ratio
    bound_baseline: str = ""  # and the baseline of its bound


@dataclass(frozen=True)
class Graph:
    sizes: tuple[int, ...]
    rowptr: torch.Tensor
    csr: NeighbourhoodCSR


@dataclass
class Settings:
    device: torch.device
    dims: tuple[int, ...]
    dtypes: tuple[str, ...]
    data_root: str | None
    seed: int = 0
    kernels_only: bool = False
    # The reference outputs of the last ``cached_cases`` cases, by dtype: the dtypes of a case share them.
    cached_cases: int = 1
    references: dict = field(default_factory=dict)


def cached_reference(s: Settings, key: tuple, dtype, compute: Callable) -> list:
    """``compute(dtype)`` (a reference run; ``dtype`` may be any key of the run, e.g. ("mixed", dtype)),
    kept while ``key`` is among the last ``s.cached_cases`` cases asked for."""
    if key not in s.references:
        while len(s.references) >= s.cached_cases:
            s.references.pop(next(iter(s.references)))  # free the oldest case's tensors first
        s.references[key] = {}
    case = s.references.pop(key)
    s.references[key] = case  # the most recent last
    if dtype not in case:
        case[dtype] = compute(dtype)
    return case[dtype]


def make_graph(sizes, device) -> Graph:
    """A CSR whose segment s (centre node s) has sizes[s] rows."""
    sizes = torch.tensor(list(sizes), dtype=torch.long)
    centre = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
    edge_index = torch.stack([centre, torch.zeros_like(centre)]).to(device)
    csr = NeighbourhoodCSR.from_edge_index(edge_index, num_nodes=len(sizes))
    return Graph(tuple(sizes.tolist()), csr.rowptr, csr)


def make_inputs(rows: int, heads: int, dim: int, m: int | None, device, seed: int):
    """float64 q, k, v, grad_o on the device and a projection (or None)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(rows, heads, dim, generator=gen, dtype=torch.float64).to(device) for _ in range(4)]
    projection = None
    if m is not None:
        projection = orthogonal_random_features(m, dim, generator=gen, dtype=torch.float64).to(device)
    return tensors, projection


def forward_backward(fn: Callable, q, k, v, grad_o) -> list[torch.Tensor]:
    """[o, dq, dk, dv] of ``fn(q, k, v)`` for the cotangent grad_o."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o = fn(*leaves)
    o.backward(grad_o)
    return [o.detach()] + [t.grad for t in leaves]


def differing_elements(first, second) -> int:
    """Elements that differ between two lists of tensors (NaN equals NaN)."""
    return sum(int((a != b).sum()) - int((a.isnan() & b.isnan()).sum()) for a, b in zip(first, second))


def verdict(row: Row, names, ours, torch_low, exact, dtype: torch.dtype, torch_float32=None,
            torch_mixed: Callable[[], list] | None = None) -> Row:
    """Fill ``row`` from the accuracy rule (nt_kernels/apps/tolerance.py) over every named tensor.

    ``torch_low`` / ``torch_float32``: the PyTorch baseline's outputs in ``dtype`` and in float32
    (the latter for float16 and bfloat16 only); ``torch_mixed()``: its outputs computed in float32
    on the ``dtype``-rounded inputs and rounded to ``dtype`` (called only where a bound needs it);
    ``exact``: the float64 reference.  An output of the wrong shape or dtype has an infinite error.
    The row shows the tensor of the worst error / bound (its tolerance and baseline) and, separately,
    the largest bound / max|reference| (its tensor and baseline); a bound above the cap fails the row."""
    worst_ratio, notes, mixed = -1.0, [], []
    row_scale = max((reference_scale(want) for want in exact), default=0.0)

    def mixed_error(i):
        if not mixed:
            mixed.append(torch_mixed())
        return max_error(mixed[0][i], exact[i])
    for i, (name, got, base, want) in enumerate(zip(names, ours, torch_low, exact)):
        f32 = max_error(torch_float32[i], want) if dtype in LOW_PRECISION else None
        bound = low_precision_bound(dtype, want, max_error(base, want), f32,
                                    None if torch_mixed is None else lambda: mixed_error(i), row_scale)
        err = max_error(got, want) if got.dtype == dtype else math.inf
        if bound.ratio > row.bound_ratio or not row.bound_worst:
            row.bound_ratio, row.bound_worst, row.bound_baseline = bound.ratio, name, bound.baseline
        failure = bound.failure(err)
        if failure:
            notes.append(f"{name}: {failure}")
        ratio = err / bound.value if bound.value > 0 else (0.0 if err == 0 else math.inf)
        if ratio > worst_ratio:
            worst_ratio, row.worst, row.error, row.tolerance, row.baseline = ratio, name, err, bound.value, \
                bound.baseline
    row.status = "FAIL" if notes else "pass"
    row.note = "; ".join(notes)
    return row
