"""Argument checks at the public boundary (DESIGN §5): clear errors naming the op and argument."""
from __future__ import annotations

import math
import numbers

import torch

from nt_kernels._extension import extension
from nt_kernels.csr import NeighbourhoodCSR, check_rowptr_values

MAX_HEAD_DIM = extension().MAX_HEAD_DIM  # defined once, in csrc/ops/checks.h
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_qkv(op: str, q, k, v) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v must be (E, H, D) tensors of one float dtype on one device; returns contiguous copies."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{op}: {name} must have shape (E, H, D), got {tuple(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{op}: {name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.shape != q.shape:
            raise ValueError(f"{op}: {name} must have q's shape {tuple(q.shape)}, got {tuple(t.shape)}")
        if t.dtype != q.dtype:
            raise ValueError(f"{op}: {name} dtype {t.dtype} does not match q's {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{op}: {name} is on {t.device} but q is on {q.device}")
    if not 1 <= q.shape[2] <= MAX_HEAD_DIM:
        raise ValueError(f"{op}: head dim D must be in 1..{MAX_HEAD_DIM}, got {q.shape[2]}")
    if q.shape[1] < 1:
        raise ValueError(f"{op}: number of heads H must be >= 1, got {q.shape[1]}")
    return q.contiguous(), k.contiguous(), v.contiguous()


def check_rowptr(op: str, rowptr, q: torch.Tensor) -> torch.Tensor:
    """A raw CSR row pointer: 1-D int32/int64 on q's device; values checked with one host sync."""
    if not isinstance(rowptr, torch.Tensor):
        raise TypeError(f"{op}: rowptr must be a torch.Tensor or NeighbourhoodCSR, got {type(rowptr).__name__}")
    if rowptr.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: rowptr must be int32 or int64, got {rowptr.dtype}")
    if rowptr.dim() != 1 or rowptr.numel() < 1:
        raise ValueError(f"{op}: rowptr must be 1-D with S + 1 >= 1 entries, got shape {tuple(rowptr.shape)}")
    if rowptr.device != q.device:
        raise ValueError(f"{op}: rowptr is on {rowptr.device} but q is on {q.device}")
    rowptr = rowptr.long()
    if not torch.compiler.is_compiling() and rowptr.device.type != "meta":
        check_rowptr_values(op, rowptr, q.shape[0])
    return rowptr


def check_csr(op: str, csr: NeighbourhoodCSR, q: torch.Tensor) -> None:
    if csr.device != q.device:
        raise ValueError(f"{op}: csr is on {csr.device} but q is on {q.device}")
    if csr.num_edges != q.shape[0]:
        raise ValueError(f"{op}: csr has E = {csr.num_edges} packed rows but q has {q.shape[0]}")


def check_projection(op: str, projection, q: torch.Tensor) -> torch.Tensor:
    """projection must be (m, D) in q's dtype and device, and a constant for autograd."""
    if not isinstance(projection, torch.Tensor):
        raise TypeError(f"{op}: projection must be a torch.Tensor, got {type(projection).__name__}")
    if projection.dim() != 2 or projection.shape[0] < 1 or projection.shape[1] != q.shape[2]:
        raise ValueError(f"{op}: projection must have shape (m, D) with m >= 1 and D = {q.shape[2]}, "
                         f"got {tuple(projection.shape)}")
    if projection.dtype != q.dtype:
        raise ValueError(f"{op}: projection dtype {projection.dtype} does not match q's {q.dtype}")
    if projection.device != q.device:
        raise ValueError(f"{op}: projection is on {projection.device} but q is on {q.device}")
    if projection.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{op}: projection must not require grad: it is a fixed random feature matrix "
                         "(draw it with orthogonal_random_features and keep it as a buffer)")
    return projection.contiguous()


def check_threshold(op: str, threshold, projection):
    """The switch threshold: a non-negative real number or None.  Without a
    projection only None or inf is allowed and inf is returned (every segment
    takes the exact path); with one, the value as given (None: the caller's
    default)."""
    if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, numbers.Real)
                                  or math.isnan(threshold) or threshold < 0):
        raise ValueError(f"{op}: threshold must be a non-negative number or None, got {threshold!r}")
    if projection is None:
        if threshold is not None and not math.isinf(threshold):
            raise ValueError(f"{op}: a finite threshold ({threshold}) needs a projection for the Performer "
                             "path; pass projection= or threshold=None")
        return math.inf
    return threshold
