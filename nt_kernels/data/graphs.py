"""Graphs for tests, benchmarks and the demo: real npz files and seeded synthetic graphs.

* :func:`load_npz` reads PyG ``HeterophilousGraphDataset`` npz files (keys
  ``node_features``, ``node_labels``, ``edges`` (E, 2), ``train_masks`` ...).
* :func:`powerlaw_graph` draws a Chung-Lu graph with power-law expected
  degrees, deterministic for a seed and generated on any device.
* :data:`PAPER_GRAPHS` holds degree-matched presets (node and edge counts from
  the paper's tables) for :func:`synthetic_graph`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = ["GraphData", "PAPER_GRAPHS", "SyntheticPreset", "default_data_root", "load_npz",
           "powerlaw_graph", "synthetic_graph", "to_undirected"]

DATA_ROOT_ENV = "NT_KERNELS_DATA"
MAX_DRAW_ROUNDS = 8


@dataclass
class GraphData:
    """A node-classification graph; masks are (num_splits, N) bool or None."""

    name: str
    edge_index: torch.Tensor
    num_nodes: int
    x: torch.Tensor | None = None
    y: torch.Tensor | None = None
    train_mask: torch.Tensor | None = None
    val_mask: torch.Tensor | None = None
    test_mask: torch.Tensor | None = None

    @property
    def num_edges(self) -> int:
        return self.edge_index.shape[1]

    def to(self, device) -> "GraphData":
        def move(t):
            return None if t is None else t.to(device)
        return GraphData(self.name, move(self.edge_index), self.num_nodes, move(self.x), move(self.y),
                         move(self.train_mask), move(self.val_mask), move(self.test_mask))


def default_data_root() -> Path:
    """The data root named by ``$NT_KERNELS_DATA``.

    There is no fallback computed from where the package is installed: without
    the variable (and without an explicit ``root`` / ``data_root`` /
    ``--data-root``) this raises FileNotFoundError saying how to set it.
    """
    value = os.environ.get(DATA_ROOT_ENV)
    if not value:
        raise FileNotFoundError(
            f"no data root: pass root= / data_root= (--data-root on the command line) or set ${DATA_ROOT_ENV} "
            f"to the folder holding the npz files, e.g. export {DATA_ROOT_ENV}=/path/to/data/heterophilous")
    return Path(value)


def to_undirected(edge_index: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """Add every reversed edge and drop duplicates (sorted by source, then target)."""
    from torch_geometric.utils import to_undirected as pyg_to_undirected

    return pyg_to_undirected(edge_index, num_nodes=num_nodes)


def load_npz(name_or_path: str | os.PathLike, root: str | os.PathLike | None = None, *,
             undirected: bool = False) -> GraphData:
    """Load a heterophilous-benchmark npz file (``minesweeper``, ``tolokers`` ... or a path).

    A missing file raises FileNotFoundError naming the path and what to put there;
    nothing is ever downloaded.
    """
    path = Path(name_or_path)
    if path.suffix != ".npz":
        path = Path(root if root is not None else default_data_root()) / f"{name_or_path}.npz"
    if not path.is_file():
        raise FileNotFoundError(
            f"load_npz: {path} not found; put the PyG HeterophilousGraphDataset file "
            f"'{path.name}' there (or pass root= / set ${DATA_ROOT_ENV}); nothing is downloaded")
    with np.load(path) as raw:
        x = torch.from_numpy(raw["node_features"]).float()
        y = torch.from_numpy(raw["node_labels"]).long()
        edge_index = torch.from_numpy(raw["edges"]).long().t().contiguous()
        masks = [torch.from_numpy(raw[key]) for key in ("train_masks", "val_masks", "test_masks")]
    num_nodes = x.shape[0]
    if undirected:
        edge_index = to_undirected(edge_index, num_nodes)
    return GraphData(path.stem, edge_index, num_nodes, x, y, *masks)


def powerlaw_graph(num_nodes: int, num_edges: int, *, exponent: float = 2.5, seed: int = 0,
                   device=None, undirected: bool = True) -> torch.Tensor:
    """Chung-Lu graph with ``num_edges`` distinct edges and power-law expected degrees.

    Endpoint pairs are drawn with probability proportional to w_i w_j,
    w_i = (i + 1)^(-1 / (exponent - 1)) over shuffled node ids; self-loops and
    duplicates (unordered pairs when ``undirected``) are dropped and more pairs
    are drawn until ``num_edges`` distinct ones exist (or the node count makes
    that impossible).  With ``undirected`` every edge is stored both ways, so the
    result has 2 * num_edges columns.  The same seed gives the same graph on
    every device (drawn with a CPU generator, then moved).
    """
    if num_nodes < 1:
        raise ValueError(f"powerlaw_graph: num_nodes must be >= 1, got {num_nodes}")
    if num_edges < 0:
        raise ValueError(f"powerlaw_graph: num_edges must be >= 0, got {num_edges}")
    if exponent <= 1:
        raise ValueError(f"powerlaw_graph: exponent must be > 1, got {exponent}")
    gen = torch.Generator().manual_seed(seed)
    weights = torch.arange(1, num_nodes + 1, dtype=torch.float64) ** (-1.0 / (exponent - 1.0))
    weights = weights[torch.randperm(num_nodes, generator=gen)]
    keys = torch.empty(0, dtype=torch.long)
    for _ in range(MAX_DRAW_ROUNDS):
        missing = num_edges - keys.numel()
        if missing <= 0:
            break
        ends = torch.multinomial(weights, 2 * (missing + missing // 4 + 16), replacement=True,
                                 generator=gen).view(2, -1)
        ends = ends[:, ends[0] != ends[1]]
        if undirected:
            ends = torch.sort(ends, dim=0).values
        keys = torch.unique(torch.cat([keys, ends[0] * num_nodes + ends[1]]))
    if keys.numel() > num_edges:
        keys = keys[torch.randperm(keys.numel(), generator=gen)[:num_edges]].sort().values
    edge_index = torch.stack([keys // num_nodes, keys % num_nodes])
    if undirected:
        edge_index = torch.cat([edge_index, edge_index.flip(0)], dim=1)
    return edge_index.to(device)


@dataclass(frozen=True)
class SyntheticPreset:
    """Node and (undirected) edge counts of one of the paper's datasets."""

    num_nodes: int
    num_edges: int
    exponent: float = 2.5


# Node / edge counts from the paper's Tables 1 and 2.
PAPER_GRAPHS = {
    "roman-empire": SyntheticPreset(22_662, 32_927),
    "amazon-ratings": SyntheticPreset(24_492, 93_050),
    "minesweeper": SyntheticPreset(10_000, 39_402),
    "tolokers": SyntheticPreset(11_758, 519_000),
    "questions": SyntheticPreset(48_921, 153_540),
    "amazon-computers": SyntheticPreset(13_752, 245_861),
    "amazon-photo": SyntheticPreset(7_650, 119_081),
    "coauthor-cs": SyntheticPreset(18_333, 81_894),
    "coauthor-physics": SyntheticPreset(34_493, 247_962),
    "wikics": SyntheticPreset(11_701, 216_123),
}


def synthetic_graph(name: str, *, scale: float = 1.0, seed: int = 0, device=None) -> GraphData:
    """Degree-matched synthetic stand-in for one of the paper's ten datasets, ``scale`` times larger."""
    if name not in PAPER_GRAPHS:
        raise ValueError(f"synthetic_graph: unknown name {name!r}; choose from {sorted(PAPER_GRAPHS)}")
    if scale <= 0:
        raise ValueError(f"synthetic_graph: scale must be > 0, got {scale}")
    preset = PAPER_GRAPHS[name]
    num_nodes = max(2, round(preset.num_nodes * scale))
    num_edges = round(preset.num_edges * scale)
    edge_index = powerlaw_graph(num_nodes, num_edges, exponent=preset.exponent, seed=seed, device=device)
    return GraphData(f"synthetic-{name}", edge_index, num_nodes)
