"""Counter-based dropout of the fused NT layer, in plain PyTorch (DESIGN §10).

The fused layer never stores a dropout mask: forward and the backward's
recompute regenerate it from (seed, packed row, channel).  Every kernel (C++
on CPU, Triton on CUDA) implements exactly these integer steps, so for the same
seed all devices draw the same mask; this module is the definition they are
checked against.

All arithmetic is on unsigned 32-bit words.  ``mix32`` is Wellons' "lowbias32"
integer hash.  With ``seed = seed_hi * 2**32 + seed_lo`` and packed row
``r = row_hi * 2**32 + row_lo``::

    s        = mix32(mix32(seed_lo) ^ seed_hi)                       # per call
    row_key  = mix32(s ^ mix32(row_lo ^ mix32(row_hi ^ 0x9E3779B9)))  # per row
    bits     = mix32(row_key ^ (channel * 0x9E3779B9 mod 2**32))      # per element
    keep     = (bits >> 8) >= floor(p * 2**24)

and kept elements are multiplied by 1 / (1 - p).  The kept fraction is
1 - floor(p * 2**24) / 2**24, within 2**-24 of 1 - p.
"""
from __future__ import annotations

import torch

__all__ = ["GOLDEN", "MASK32", "counter_dropout_mask", "drop_threshold", "mix32", "row_keys", "seed_key"]

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9


def mix32(x):
    """lowbias32 on unsigned 32-bit words held in int64 tensors (or Python ints)."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def seed_key(seed):
    """The per-call word s of a 64-bit seed: an int, or an int64 tensor (computed where it is, element-wise)."""
    if not isinstance(seed, torch.Tensor):
        seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    return mix32(mix32(seed & MASK32) ^ ((seed >> 32) & MASK32))


def row_keys(seed: int, rows: torch.Tensor) -> torch.Tensor:
    """The per-row word of packed rows ``rows`` (int64 tensor of row indices >= 0)."""
    rows = rows.long()
    return mix32(seed_key(seed) ^ mix32((rows & MASK32) ^ mix32((rows >> 32) ^ GOLDEN)))


def drop_threshold(p: float) -> int:
    """floor(p * 2**24): an element is dropped when its top 24 bits fall below it."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"drop_threshold: p must be in [0, 1), got {p!r}")
    return int(p * 16777216.0)


def counter_dropout_mask(seed: int, num_rows: int, channels: int, p: float, *, row_offset: int = 0,
                         device=None, dtype=torch.float32) -> torch.Tensor:
    """(num_rows, channels) dropout multipliers: 0 where dropped, 1 / (1 - p) where kept.

    Row i of the result is packed row ``row_offset + i``.
    """
    threshold = drop_threshold(p)
    rows = torch.arange(row_offset, row_offset + num_rows, dtype=torch.int64, device=device)
    channel_words = (torch.arange(channels, dtype=torch.int64, device=device) * GOLDEN) & MASK32
    bits = mix32(row_keys(seed, rows).unsqueeze(1) ^ channel_words.unsqueeze(0))
    keep = (bits >> 8) >= threshold
    return keep.to(dtype) * (1.0 / (1.0 - p))
