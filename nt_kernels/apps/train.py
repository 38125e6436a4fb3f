"""Full-batch node classification with NT: the paper's protocol, its presets, the ``train`` CLI and the demo.

Protocol (paper §5): Adam with learning rate 1e-3, at most ``epochs`` epochs,
early stopping after ``patience`` epochs without a better validation score;
the reported test score is the one at the best validation epoch; runs go over
the dataset's fixed splits and report mean ± std.  The score is ROC-AUC for
two classes, accuracy otherwise.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from nt_kernels.data.datasets import DATASETS, SELF_LOOPS, load_dataset, monophily_graph
from nt_kernels.nn import ATTENTIONS, BACKENDS, NT

__all__ = ["PRESETS", "TrainConfig", "add_parser", "demo_training", "preset", "roc_auc", "run", "score",
           "train_split"]

DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass(frozen=True)
class TrainConfig:
    """Hyperparameters of one run; ``head_dim * heads`` is the hidden width."""

    aggr: str = "weighted_mean"
    head_dim: int = 8
    heads: int = 4
    num_layers: int = 2
    dropout: float = 0.2
    directed: bool = False
    sep: bool = False
    attention: str = "switch"
    gate_group: str = "receiver"
    lr: float = 1e-3
    epochs: int = 2500
    patience: int = 500


def _paper(aggr, head_dim, heads, num_layers, dropout, directed=False):
    return TrainConfig(aggr, head_dim, heads, num_layers, dropout, directed)


# Appendix table "Hyperparameters of NT on 10 graphs": aggregator, dimensions per head, heads, layers, dropout.
PRESETS = {
    "roman-empire": _paper("sum", 32, 6, 5, 0.4),
    "amazon-ratings": _paper("mean", 40, 8, 1, 0.3),
    "minesweeper": _paper("sum", 53, 1, 5, 0.2),
    "tolokers": _paper("gated_sum", 30, 2, 5, 0.1),
    "questions": _paper("sum", 32, 4, 1, 0.2),
    "roman-empire-directed": _paper("max", 36, 5, 5, 0.4, True),
    "amazon-ratings-directed": _paper("max", 23, 7, 4, 0.4, True),
    "minesweeper-directed": _paper("sum", 15, 2, 5, 0.1, True),
    "tolokers-directed": _paper("gated_sum", 9, 4, 4, 0.2, True),
    "questions-directed": _paper("gated_sum", 27, 7, 1, 0.3, True),
    "amazon-computers": _paper("sum", 17, 4, 5, 0.4),
    "amazon-photo": _paper("mean", 18, 7, 4, 0.6),
    "coauthor-cs": _paper("weighted_mean", 41, 8, 2, 0.3),
    "coauthor-physics": _paper("weighted_mean", 16, 2, 2, 0.1),
    "wikics": _paper("mean", 38, 1, 3, 0.2),
}


def preset(dataset: str, directed: bool = False) -> TrainConfig:
    """The paper's hyperparameters for ``dataset`` (its directed variant when ``directed``)."""
    key = f"{dataset}-directed" if directed else dataset
    if key not in PRESETS:
        raise ValueError(f"preset: no paper preset for {key!r}; choose from {sorted(PRESETS)}")
    return PRESETS[key]


def roc_auc(labels: torch.Tensor, scores: torch.Tensor) -> float:
    """Area under the ROC curve of binary ``labels`` for ``scores`` (ties count one half)."""
    labels = labels.bool().flatten()
    positives, negatives = int(labels.sum()), int((~labels).sum())
    if positives == 0 or negatives == 0:
        return math.nan
    values, inverse, counts = torch.unique(scores.double().flatten(), return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    mean_rank = ends - (counts.double() - 1) / 2
    rank_sum = mean_rank[inverse][labels].sum().item()
    return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives)


def score(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """ROC-AUC of class 1 for two classes, accuracy otherwise."""
    if logits.shape[1] == 2:
        return roc_auc(labels, torch.softmax(logits.double(), dim=1)[:, 1])
    return (logits.argmax(1) == labels).double().mean().item() if labels.numel() else math.nan


def train_split(data, split: int, config: TrainConfig, *, device="cpu", dtype=torch.float32, backend="fused",
                seed: int = 0, progress: bool = False, model: nn.Module | None = None) -> dict:
    """Train one model on split ``split`` of ``data``; returns scores at the best validation epoch and the losses.

    ``model`` replaces the NT of ``config`` (it is called as ``model(x, csr)``).  The NT is
    initialised, and the training run (dropout) seeded, with ``seed + split``.
    """
    from tqdm.auto import tqdm

    torch.manual_seed(seed + split)
    data = data.to(device)
    x = data.x.to(dtype)
    train, val, test = data.train_mask[split], data.val_mask[split], data.test_mask[split]
    num_classes = int(data.y.max()) + 1
    if model is None:
        model = NT(x.shape[1], num_classes, config.head_dim * config.heads, config.num_layers, heads=config.heads,
                   dropout=config.dropout, directed=config.directed, sep=config.sep, aggr=config.aggr,
                   attention=config.attention, gate_group=config.gate_group, backend=backend)
    model = model.to(device=device, dtype=dtype)
    torch.manual_seed(seed + split)
    graph = model.prepare(data.edge_index, data.num_nodes) if hasattr(model, "prepare") else data.edge_index
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    best = {"epoch": -1, "val": -math.inf, "test": math.nan}
    losses = []
    start = time.perf_counter()
    bar = tqdm(range(config.epochs), desc=f"{data.name} split {split}", disable=not progress, leave=False)
    for epoch in bar:
        model.train()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x, graph)[train], data.y[train])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        model.eval()
        with torch.no_grad():
            logits = model(x, graph)
        val_score = score(logits[val], data.y[val])
        if val_score > best["val"]:
            best = {"epoch": epoch, "val": val_score, "test": score(logits[test], data.y[test])}
        bar.set_postfix(loss=f"{losses[-1]:.4f}", val=f"{val_score:.4f}", best_test=f"{best['test']:.4f}")
        if epoch - best["epoch"] >= config.patience:
            break
    seconds = time.perf_counter() - start
    return {"split": split, "best_epoch": best["epoch"], "val": best["val"], "test": best["test"],
            "epochs": len(losses), "seconds_per_epoch": seconds / max(1, len(losses)), "losses": losses}


def _mean_std(values):
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``train`` on an argparse subparsers object (handler: :func:`run`)."""
    parser = subparsers.add_parser("train", help="train NT on a node-classification dataset (paper protocol)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", required=True, choices=DATASETS)
    parser.add_argument("--data-root", default=None, help="folder with the dataset files (default: $NT_KERNELS_DATA "
                        "or ../shared/data/heterophilous)")
    parser.add_argument("--preset", choices=("paper", "none"), default="paper",
                        help="paper: the appendix hyperparameters of the dataset; none: TrainConfig defaults")
    parser.add_argument("--directed", action="store_true", help="keep edge directions and use Dir-NT")
    parser.add_argument("--splits", default=None, help="comma-separated split ids (default: the first 10)")
    parser.add_argument("--epochs", type=int, default=None, help="maximum epochs (paper: 2500)")
    parser.add_argument("--patience", type=int, default=None, help="early-stopping patience (paper: 500)")
    for flag, kind in (("--aggr", str), ("--head-dim", int), ("--heads", int), ("--layers", int),
                       ("--dropout", float), ("--lr", float)):
        parser.add_argument(flag, type=kind, default=None, help="override the preset")
    parser.add_argument("--attention", choices=ATTENTIONS, default=None)
    parser.add_argument("--sep", action="store_true", help="concatenate ego- and neighbour-embeddings")
    parser.add_argument("--self-loops", choices=SELF_LOOPS, default="keep")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--backend", choices=BACKENDS, default="fused")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the results as JSON to this file")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.set_defaults(func=run)
    return parser


def _config_from_args(args) -> TrainConfig:
    if args.preset == "paper":
        config = preset(args.dataset, args.directed)
    else:
        config = replace(TrainConfig(), directed=args.directed)
    overrides = {"aggr": args.aggr, "head_dim": args.head_dim, "heads": args.heads, "num_layers": args.layers,
                 "dropout": args.dropout, "lr": args.lr, "attention": args.attention, "epochs": args.epochs,
                 "patience": args.patience}
    overrides = {key: value for key, value in overrides.items() if value is not None}
    return replace(config, sep=args.sep or config.sep, **overrides)


def run(args) -> int:
    """Handler of ``nt-kernels train``: runs the splits, prints mean ± std, writes the JSON."""
    config = _config_from_args(args)
    data = load_dataset(args.dataset, args.data_root, directed=config.directed, self_loops=args.self_loops)
    available = data.train_mask.shape[0]
    splits = (list(range(min(10, available))) if args.splits is None
              else [int(s) for s in args.splits.split(",") if s.strip()])
    if not splits or any(not 0 <= s < available for s in splits):
        raise ValueError(f"train: --splits must name split ids in 0..{available - 1}, got {args.splits!r}")
    metric = "roc_auc" if int(data.y.max()) + 1 == 2 else "accuracy"
    runs = []
    for split in splits:
        result = train_split(data, split, config, device=args.device, dtype=DTYPES[args.dtype],
                             backend=args.backend, seed=args.seed, progress=not args.no_progress)
        runs.append({key: value for key, value in result.items() if key != "losses"})
        print(f"{args.dataset} split {split}: val {result['val']:.4f} test {result['test']:.4f} "
              f"(best epoch {result['best_epoch']}, {result['epochs']} epochs, "
              f"{1e3 * result['seconds_per_epoch']:.1f} ms/epoch)")
    test_mean, test_std = _mean_std([r["test"] for r in runs])
    val_mean, val_std = _mean_std([r["val"] for r in runs])
    summary = {"dataset": args.dataset, "directed": config.directed, "preset": args.preset, "config": asdict(config),
               "self_loops": args.self_loops, "metric": metric, "device": str(args.device), "dtype": args.dtype,
               "backend": args.backend, "seed": args.seed, "splits": runs, "test_mean": test_mean,
               "test_std": test_std, "val_mean": val_mean, "val_std": val_std,
               "seconds_per_epoch": statistics.fmean(r["seconds_per_epoch"] for r in runs)}
    print(f"{args.dataset}: test {metric} {100 * test_mean:.2f} ± {100 * test_std:.2f} over {len(runs)} split(s)")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(summary, handle, indent=2)
    return 0


class _MLP(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, hidden: int, num_layers: int):
        super().__init__()
        layers = [nn.Linear(in_channels, hidden), nn.GELU()]
        for _ in range(num_layers):
            layers += [nn.Linear(hidden, hidden), nn.GELU()]
        self.net = nn.Sequential(*layers, nn.Linear(hidden, out_channels))

    def forward(self, x, graph=None):
        return self.net(x)


def demo_training(*, epochs: int = 60, hidden: int = 16, heads: int = 2, num_layers: int = 2, seed: int = 0,
                  backend: str = "fused", num_threads: int | None = 1) -> dict:
    """Train NT and an MLP of the same width on :func:`monophily_graph`; returns both validation accuracies.

    The graph is tiny, so by default it runs on ``num_threads=1`` intra-op
    thread (restored afterwards): on a busy machine, thread hand-offs would
    cost more than the work.  ``None`` keeps the current setting.
    """
    data = monophily_graph(seed=seed)
    config = TrainConfig(aggr="weighted_mean", head_dim=hidden // heads, heads=heads, num_layers=num_layers,
                         dropout=0.0, lr=1e-2, epochs=epochs, patience=epochs)
    threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        nt = train_split(data, 0, config, backend=backend, seed=seed)
        mlp = train_split(data, 0, config, seed=seed, model=_MLP(data.x.shape[1], int(data.y.max()) + 1, hidden,
                                                                 num_layers))
    finally:
        torch.set_num_threads(threads)
    return {"graph": f"monophily ({data.num_nodes} nodes, {data.num_edges} edges)", "epochs": epochs,
            "metric": "accuracy", "nt_val": nt["val"], "mlp_val": mlp["val"], "nt_test": nt["test"],
            "mlp_test": mlp["test"]}

