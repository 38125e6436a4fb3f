"""FAVOR+ random features and the switch threshold of the paper (§4.1)."""
from __future__ import annotations

import math

import torch

__all__ = ["default_nb_features", "orthogonal_random_features", "switch_threshold"]


def default_nb_features(head_dim: int) -> int:
    """m = int(D ln D), at least 1 (Performer's recommendation)."""
    if head_dim < 1:
        raise ValueError(f"default_nb_features: head_dim must be >= 1, got {head_dim}")
    return max(1, int(head_dim * math.log(head_dim)))


def switch_threshold(m: int, head_dim: int) -> float:
    """Largest segment size that still takes exact attention: n* = m + sqrt(m^2 + D m).

    It solves n^2 = 2 n m + D m, the size above which Performer's feature maps
    take less memory than the n x n score matrix (paper §4.1).
    """
    if m < 1:
        raise ValueError(f"switch_threshold: m (number of features) must be >= 1, got {m}")
    if head_dim < 1:
        raise ValueError(f"switch_threshold: head_dim must be >= 1, got {head_dim}")
    return m + math.sqrt(m * m + head_dim * m)


def orthogonal_random_features(
    m: int,
    head_dim: int,
    *,
    generator: torch.Generator | None = None,
    device=None,
    dtype=None,
) -> torch.Tensor:
    """Gaussian-orthogonal projection P of shape (m, head_dim), as in FAVOR+.

    Rows come in blocks of ``head_dim`` mutually orthogonal unit vectors (QR of a
    Gaussian matrix), then each row is rescaled by the norm of an independent
    Gaussian vector so that row lengths follow the chi distribution of i.i.d.
    Gaussian rows.  Drawn on the CPU with ``generator`` (deterministic for a
    seeded generator), then moved to ``device`` / ``dtype``.
    """
    if m < 1:
        raise ValueError(f"orthogonal_random_features: m must be >= 1, got {m}")
    if head_dim < 1:
        raise ValueError(f"orthogonal_random_features: head_dim must be >= 1, got {head_dim}")
    blocks = []
    rows = 0
    while rows < m:
        gaussian = torch.randn(head_dim, head_dim, generator=generator, dtype=torch.float64)
        q, _ = torch.linalg.qr(gaussian)
        blocks.append(q.T[: m - rows])
        rows += blocks[-1].shape[0]
    basis = torch.cat(blocks, dim=0)
    norms = torch.randn(m, head_dim, generator=generator, dtype=torch.float64).norm(dim=1)
    projection = norms.unsqueeze(1) * basis
    return projection.to(device=device, dtype=dtype or torch.get_default_dtype())
