"""The graphs and presets of ``nt-kernels bench --layer`` (:mod:`nt_kernels.bench.layer`).

Graphs: ``tolokers`` and ``minesweeper`` with their released presets (the
real data from ``--data-root`` / ``$NT_KERNELS_DATA``), ``synthetic``
(tolokers' degree sequence tiled to ``--messages`` rows, the tolokers preset)
and ``powerlaw`` (issue 14's scale graph: power-law degrees, H = 4, D = 16,
3 layers).  Both synthetic graphs come from one generator,
:func:`degree_sequence_graph`; :func:`build_graph` builds any of them on a device and
:func:`graph_stats` counts its segments and messages on each attention path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SYNTHETIC_COPIES = 10  # default --messages of 'synthetic': tolokers' messages x 10
POWERLAW_MESSAGES = 100_000_000
POWERLAW_AVG_DEGREE = 20
POWERLAW_EXPONENT = 2.5
POWERLAW_FEATURES = 16
DRY_RUN_NODES = 1000
DRY_RUN_MESSAGES = 20_000


@dataclass(frozen=True)
class LayerPreset:
    """The NT model of one bench graph (hidden width = heads x head_dim)."""

    aggr: str
    head_dim: int
    heads: int
    num_layers: int
    dropout: float
    sep: bool
    self_loops: str
    source: str


# The released presets (nt_kernels.apps.presets.PAPER_PRESETS, undirected). The bench layer may not
# import apps (docs/design.md §0); tests/test_bench_layer.py checks that these agree with them.
PRESETS = {
    "tolokers": LayerPreset("gated_sum", 30, 2, 5, 0.1, True, "keep", "released preset of tolokers"),
    "minesweeper": LayerPreset("sum", 53, 1, 5, 0.2, True, "remove", "released preset of minesweeper"),
    "powerlaw": LayerPreset("weighted_mean", 16, 4, 3, 0.1, True, "keep", "issue 14 scale run: H=4, D=16, 3 layers"),
}
PRESETS["synthetic"] = PRESETS["tolokers"]



def degree_sequence_graph(degrees: torch.Tensor, *, seed: int, device=None) -> torch.Tensor:
    """(2, sum(degrees)) edge_index in which node j is the centre of exactly ``degrees[j]`` rows.

    Row 0 (centres) lists node j ``degrees[j]`` times; row 1 (receivers) is the
    same list in a seeded random order, so node j also receives exactly
    ``degrees[j]`` messages.  Self-loops and repeated pairs can occur, as in a
    configuration model; they are messages like any other.  Drawn on ``device``.
    """
    degrees = degrees.to(device=device, dtype=torch.long)
    gen = torch.Generator(device=degrees.device).manual_seed(seed)
    centre = torch.repeat_interleave(torch.arange(degrees.numel(), device=degrees.device), degrees)
    receiver = centre[torch.randperm(centre.numel(), generator=gen, device=degrees.device)]
    return torch.stack([centre, receiver])


def tiled_degrees(profile: torch.Tensor, messages: int, *, seed: int) -> torch.Tensor:
    """``profile`` repeated until it holds ``messages`` rows, nodes in a seeded random order.

    ``ceil(messages / sum(profile))`` copies are shuffled together; the
    shortest prefix reaching ``messages`` is kept and its last degree trimmed
    to make the total exact (so ``messages = k * sum(profile)`` is the profile
    tiled exactly k times).
    """
    total = int(profile.sum())
    if messages < 1 or total < 1:
        raise ValueError(f"tiled_degrees: need messages >= 1 and a non-empty profile, got {messages=}, {total=}")
    copies = -(-messages // total)
    gen = torch.Generator().manual_seed(seed)
    tiled = profile.long().repeat(copies)
    tiled = tiled[torch.randperm(tiled.numel(), generator=gen)]
    cumulative = torch.cumsum(tiled, 0)
    last = int(torch.searchsorted(cumulative, messages))
    kept = tiled[:last + 1].clone()
    kept[-1] -= int(cumulative[last]) - messages
    return kept


def powerlaw_degrees(messages: int, num_nodes: int, *, exponent: float = POWERLAW_EXPONENT,
                     seed: int) -> torch.Tensor:
    """Degrees ~ messages * w_i / sum(w), w_i = (i + 1)^(-1/(exponent - 1)), at least 1, shuffled.

    The largest degree absorbs the rounding so the total is exactly ``messages``.
    """
    weights = torch.arange(1, num_nodes + 1, dtype=torch.float64) ** (-1.0 / (exponent - 1.0))
    degrees = torch.clamp(torch.round(messages * weights / weights.sum()), min=1).long()
    degrees[0] += messages - int(degrees.sum())
    if int(degrees[0]) < 1:
        raise ValueError(f"powerlaw_degrees: {messages} messages are too few for {num_nodes} nodes")
    return degrees[torch.randperm(num_nodes, generator=torch.Generator().manual_seed(seed))]


@dataclass
class LayerGraph:
    """A bench graph on its device: features, labels, the nodes the loss reads, edges and how it was built."""

    name: str
    x: torch.Tensor
    y: torch.Tensor
    loss_nodes: torch.Tensor | None  # indices of the nodes the loss reads (None: every node)
    edge_index: torch.Tensor
    source: str
    description: str


def _real_graph(name: str, data_root, dry_run: bool, device) -> LayerGraph:
    from nt_kernels.data import load_dataset

    data = load_dataset(name, data_root, directed=False, self_loops=PRESETS[name].self_loops)
    x, y, edge_index, mask = data.x, data.y, data.edge_index, data.train_mask[0]
    how = f"load_dataset({name!r}, undirected, self_loops={PRESETS[name].self_loops!r}); loss on split 0's train nodes"
    if dry_run:
        keep = (edge_index < DRY_RUN_NODES).all(0)
        x, y, mask, edge_index = x[:DRY_RUN_NODES], y[:DRY_RUN_NODES], mask[:DRY_RUN_NODES], edge_index[:, keep]
        how = f"dry run: the subgraph induced by the first {DRY_RUN_NODES} nodes of " + how
    # The loss nodes as indices, not a mask: indexing with a boolean mask syncs with the host at every step
    # (it counts the mask's true entries), which the first H200 run's sync check caught.
    nodes = mask.nonzero().flatten()
    return LayerGraph(name, x.to(device), y.to(device), nodes.to(device), edge_index.to(device), "real", how)


def _random_features(num_nodes: int, features: int, classes: int, seed: int, device):
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(num_nodes, features, generator=gen)
    y = torch.randint(0, classes, (num_nodes,), generator=gen)
    return x.to(device), y.to(device)


def build_graph(name: str, *, messages: int | None, seed: int, data_root=None, dry_run: bool = False,
                device=None) -> LayerGraph:
    """The bench graph ``name`` (see the module docstring) on ``device``."""
    if name in ("tolokers", "minesweeper"):
        return _real_graph(name, data_root, dry_run, device)
    if name == "synthetic":
        from nt_kernels.data import load_dataset

        tolokers = load_dataset("tolokers", data_root, directed=False, self_loops=PRESETS["tolokers"].self_loops)
        profile = torch.bincount(tolokers.edge_index[0], minlength=tolokers.num_nodes)
        messages = messages or SYNTHETIC_COPIES * int(profile.sum())
        degrees = tiled_degrees(profile, messages, seed=seed)
        how = (f"tolokers' degree sequence (undirected, self-loops kept: {int(profile.sum()):,} messages on "
               f"{profile.numel():,} nodes) tiled to {messages:,} messages in a seeded random node order "
               "(last degree trimmed), receivers a seeded shuffle of the centre list; random features "
               f"({tolokers.x.shape[1]}) and labels (2 classes); loss on all nodes")
        features, classes = tolokers.x.shape[1], int(tolokers.y.max()) + 1
    else:
        messages = messages or POWERLAW_MESSAGES
        num_nodes = max(2, messages // POWERLAW_AVG_DEGREE)
        degrees = powerlaw_degrees(messages, num_nodes, seed=seed)
        how = (f"power-law degrees on {num_nodes:,} nodes (messages / {POWERLAW_AVG_DEGREE}): "
               f"round(messages * w_i / sum w), w_i = (i+1)^(-1/({POWERLAW_EXPONENT:g}-1)), at least 1, "
               "rounding into the largest, shuffled; receivers a seeded shuffle of the centre list; random "
               f"features ({POWERLAW_FEATURES}) and labels (2 classes); loss on all nodes")
        features, classes = POWERLAW_FEATURES, 2
    edge_index = degree_sequence_graph(degrees, seed=seed, device=device)
    x, y = _random_features(degrees.numel(), features, classes, seed, device)
    return LayerGraph(name, x, y, None, edge_index, "synthetic", how)


def graph_stats(csr, threshold: float) -> dict:
    """Nodes, messages, max degree, and segments / messages on each path of the switch at ``threshold``."""
    sizes, counts = (t.tolist() for t in csr.size_hist)
    segments = {"exact": 0, "performer": 0, "empty": 0}
    rows = {"exact": 0, "performer": 0}
    for n, c in zip(sizes, counts):
        path = "empty" if n == 0 else "performer" if n > threshold else "exact"
        segments[path] += c
        if n:
            rows[path] += n * c
    return {"num_nodes": csr.num_nodes, "num_messages": csr.num_edges, "max_degree": csr.max_degree,
            "threshold": threshold, "segments": segments, "messages": rows}

