"""What a backend of ``nt-kernels bench`` is and what it runs on: :class:`Backend` (name, family,
alpha), :class:`Context` (the packed graph on the bench device and the attention settings) and
the family names.  Shared by :mod:`nt_kernels.bench.backends` and :mod:`nt_kernels.bench.peers`,
which both build on it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

ALPHAS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
STRATEGY_FAMILIES = ("parallel", "by-size", "partitioned", "sequential")
# The peers (nt_kernels.bench.peers): exact attention on every segment, or performer-pytorch's FAVOR+.
EXACT_PEERS = ("pyg-pairs", "nested", "flex", "varlen")
PEER_FAMILIES = (*EXACT_PEERS, "performer-pytorch")


@dataclass
class Context:
    """What a backend needs: the packed graph on the bench device and the attention settings."""

    csr: object                      # NeighbourhoodCSR on the bench device
    projection: torch.Tensor | None  # (m, D) in the bench dtype, None in exact mode
    threshold: float                 # math.inf in exact mode
    heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    reference_max_edges: int
    memory_cap_bytes: int
    hist: tuple[list[int], list[int]] = field(default=None)

    def __post_init__(self):
        if self.hist is None:
            sizes, counts = self.csr.size_hist
            self.hist = (sizes.tolist(), counts.tolist())

    @property
    def num_edges(self) -> int:
        return self.csr.num_edges

    @property
    def nb_features(self) -> int:
        return 0 if self.projection is None else self.projection.shape[0]

    @property
    def has_performer_segments(self) -> bool:
        return any(n > self.threshold for n in self.hist[0])


@dataclass(frozen=True)
class Backend:
    name: str
    family: str
    alpha: float | None = None

    @property
    def semantics(self) -> str:
        """``exact`` for backends that run exact attention everywhere, else ``switch``."""
        return "exact" if self.family == "parallel" or self.family in EXACT_PEERS else "switch"

    @property
    def is_peer(self) -> bool:
        return self.family in PEER_FAMILIES
