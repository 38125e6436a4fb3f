"""Node classification with NT: the paper's protocol, the training loop, the ``train`` CLI and the demo.

Protocol (paper §5): Adam with learning rate 1e-3, at most ``epochs`` epochs,
early stopping after ``patience`` epochs without a better validation score;
the reported test score is the one at the best validation epoch; runs go over
the dataset's fixed splits and report mean ± std.  The score is ROC-AUC for
two classes, accuracy otherwise.

``--model nt-star`` trains NT* (:class:`~nt_kernels.nn.NTStar`) in two
stages, local then global (:mod:`nt_kernels.apps.stages`).

Full batch by default; ``--batch-size`` trains on NeighborLoader mini-batches
of seed nodes, and under ``torchrun --nproc-per-node N -m nt_kernels.cli train``
every process trains on its own shard of the seeds through DDP (only rank 0
prints and writes files); ``--save`` / ``--resume`` keep the best-validation
checkpoint (docs/training.md, "Mini-batches and data parallel").

On CUDA the full-batch training step (forward, loss, backward, fused Adam)
and the evaluation forward are captured in CUDA graphs and replayed every
epoch (``--cuda-graph auto``, the default; :mod:`nt_kernels.apps.fullbatch`);
an epoch reads the host once.  ``--dtype bfloat16-autocast`` trains float32
parameters with the forward under ``torch.autocast`` to bfloat16.
"""
from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import time
from dataclasses import asdict

import torch
from torch import nn

from nt_kernels.apps import presets
from nt_kernels.apps import minibatch
from nt_kernels.apps.distributed import World, current, init_from_env, shutdown, wrap
from nt_kernels.apps.fullbatch import (CUDA_GRAPH_CHOICES, DTYPES, EpochClock, FullBatch, capture_decision,
                                       make_optimizer, read_epoch)
from nt_kernels.apps.minibatch import (MiniBatchEpoch, batch_options, eval_loader, load_checkpoint,
                                       pyg_data, save_checkpoint, split_path)
from nt_kernels.apps.sampling import check_num_neighbors
from nt_kernels.apps.presets import PRESETS, StarConfig, TrainConfig, preset
from nt_kernels.apps.stages import SingleStage, TwoStages
from nt_kernels.data.datasets import DATASETS, load_dataset, monophily_graph
from nt_kernels.nn import BACKENDS, NT, NTStar
from nt_kernels.train import roc_auc_tensor, score_tensor

__all__ = ["PRESETS", "StarConfig", "TrainConfig", "add_parser", "build_model", "demo_training", "preset", "roc_auc",
           "run", "score", "train_split"]

FUSED_CHOICES = {"auto": None, "on": True, "off": False}


def roc_auc(labels: torch.Tensor, scores: torch.Tensor) -> float:
    """Area under the ROC curve of binary ``labels`` for ``scores`` (ties count one half; NaN without both
    classes): :func:`nt_kernels.train.roc_auc_tensor` read as a float."""
    return float(roc_auc_tensor(labels, scores))


def score(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """ROC-AUC of class 1 for two classes, accuracy otherwise (:func:`nt_kernels.train.score_tensor`, read)."""
    return float(score_tensor(logits, labels))


def build_model(config: TrainConfig, in_channels: int, out_channels: int, *, backend: str = "kernels",
                fused: bool | None = None) -> nn.Module:
    """The network of ``config``: :class:`NT`, or :class:`NTStar` for a :class:`StarConfig`."""
    conv = {"aggr": config.aggr, "attention": config.attention, "gate_group": config.gate_group,
            "backend": backend, "fused": fused}
    hidden = config.head_dim * config.heads
    if isinstance(config, StarConfig):
        if config.sep:
            raise ValueError("train: sep is NT's; NT*'s local blocks keep the ego path themselves")
        return NTStar(in_channels, hidden, out_channels, config.num_layers, config.global_layers,
                      in_dropout=config.in_dropout, dropout=config.dropout, global_dropout=config.global_dropout,
                      heads=config.heads, beta=config.beta, directed=config.directed, **conv)
    return NT(in_channels, hidden, config.num_layers, out_channels, heads=config.heads, dropout=config.dropout,
              directed=config.directed, sep=config.sep, **conv)


def train_split(data, split: int, config: TrainConfig, *, device="cpu", dtype=torch.float32,
                autocast: torch.dtype | None = None, cuda_graph: bool | None = None, backend="kernels",
                fused: bool | None = None, seed: int = 0, progress: bool = False, model: nn.Module | None = None,
                batch_size: int | None = None, num_neighbors=None, eval_batch_size: int | None = None, save=None,
                resume=None, log=None) -> dict:
    """Train one model on split ``split`` of ``data``; returns scores at the best validation epoch and the losses.

    ``model`` replaces the network of ``config`` (:func:`build_model`; it is
    called as ``model(x, edge_index)``, ``edge_index`` a (2, E) tensor or the
    CSR of ``model.prepare``).  A :class:`StarConfig` trains in two stages
    (:class:`~nt_kernels.apps.stages.TwoStages`; ``model`` must then have a
    ``stage`` attribute).
    ``backend`` and ``fused`` are NTConv's (the attention ops of the composition,
    and whether the fused layer op runs).  The NT is
    initialised, and the training run (dropout) seeded, with ``seed + split``.
    ``dtype`` is the parameters' and features' dtype; ``autocast`` a dtype
    (``torch.bfloat16``) for ``torch.autocast`` around forward and loss.

    Full batch by default.  ``cuda_graph`` (``None``: where possible): capture
    the full-batch training step and the evaluation forward in CUDA graphs
    (:mod:`nt_kernels.apps.fullbatch`; ``True`` raises where it cannot, naming
    the reason).  Every epoch reads the host once (loss, validation and test
    score together).  With ``batch_size`` (or under ``torchrun`` with
    several processes) every epoch takes one optimizer step per batch of
    training seeds, each batch a NeighborLoader subgraph with ``num_neighbors``
    (one fan-out per layer, default -1: whole neighbourhoods); ranks train on
    disjoint shards through DDP (:mod:`nt_kernels.apps.distributed`); these
    steps are eager.
    Evaluation is full-batch, or layer-wise over node batches of
    ``eval_batch_size``.  ``save``: checkpoint path written (by rank 0) at every
    new best validation score; ``resume``: checkpoint to continue from.
    ``log``: called with a line saying whether and why the steps are captured.
    """
    from tqdm.auto import tqdm

    world = current()
    torch.manual_seed(seed + split)
    data = data.to(device)
    x = data.x.to(dtype)
    nodes = {name: mask[split].nonzero().flatten()
             for name, mask in (("train", data.train_mask), ("val", data.val_mask), ("test", data.test_mask))}
    if model is None:
        model = build_model(config, x.shape[1], int(data.y.max()) + 1, backend=backend, fused=fused)
    if eval_batch_size is not None and not hasattr(model, "block"):
        raise ValueError(f"train: eval_batch_size (--eval-batch-size) evaluates NT's residual blocks layer-wise; "
                         f"{type(model).__name__} evaluates full batch")
    model = model.to(device=device, dtype=dtype)
    torch.manual_seed(seed + split + (world.rank << 32))
    edge_index = model.prepare(data.edge_index, data.num_nodes) if hasattr(model, "prepare") else data.edge_index
    minibatch = _minibatch_epoch(model, data, x, nodes["train"], split, config, world, seed, batch_size,
                                 num_neighbors, autocast)
    capture, note = capture_decision(cuda_graph, device, minibatch=minibatch is not None, world_size=world.size)
    full = FullBatch(model, x, edge_index, data.y, nodes, autocast=autocast, capture=capture,
                     required=cuda_graph is True, note=note,
                     eval_nodes=None if eval_batch_size is None else eval_loader(data.edge_index, data.num_nodes,
                                                                                 eval_batch_size))
    step = full if minibatch is None else minibatch
    optimizer = make_optimizer(model, config.lr, device, capture)
    best, losses, first = {"epoch": -1, "val": -math.inf, "test": math.nan}, [], 0
    if resume is not None:
        restored = load_checkpoint(resume, model, optimizer, config=asdict(config), split=split)
        best, losses = {key: restored[key] for key in ("epoch", "val", "test")}, restored["losses"]
        first = restored["epoch"] + 1
    staged = isinstance(config, StarConfig)
    stages = TwoStages(model, optimizer, config.local_epochs, first) if staged else SingleStage()
    trained = wrap(model, world)
    clock = EpochClock(device)
    start, start_cpu, train_seconds, epochs_run, stage_seconds = time.perf_counter(), time.process_time(), 0.0, 0, {}
    bar = tqdm(range(first, config.epochs), desc=f"{data.name} split {split}",
               disable=not (progress and world.is_main), leave=False)
    for epoch in bar:
        stages.begin_epoch(epoch)
        model.train()
        tick, tick_cpu = time.perf_counter(), time.process_time()
        clock.start()
        loss = step(trained, optimizer, epoch)
        clock.stop()
        loss, val_score, test_score = read_epoch(loss, *full.evaluate())  # the epoch's one host read
        if epoch == first and log is not None:
            log(f"{data.name} split {split} CUDA graph: {full.note}")
        losses.append(loss)
        train_seconds += clock.seconds()
        epochs_run += 1
        if val_score > best["val"]:
            best = {"epoch": epoch, "val": val_score, "test": test_score}
            stages.new_best()
            if save is not None and world.is_main:
                save_checkpoint(save, model, optimizer, config=asdict(config), split=split, losses=losses, **best)
        bar.set_postfix(loss=f"{losses[-1]:.4f}", val=f"{val_score:.4f}", best_test=f"{best['test']:.4f}")
        _add_time(stage_seconds, stages.stage_of(epoch), time.perf_counter() - tick, time.process_time() - tick_cpu)
        if stages.should_stop(epoch, best["epoch"], config.patience):
            break
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
    return {"split": split, "best_epoch": best["epoch"], "val": best["val"], "test": best["test"],
            "epochs": len(losses), "epochs_run": epochs_run, "seconds": seconds,
            "seconds_per_epoch": seconds / max(1, epochs_run),
            "epochs_per_second": epochs_run / seconds if seconds > 0 else math.nan,
            "train_seconds_per_epoch": train_seconds / max(1, epochs_run),
            "batches_per_epoch": len(step), "captured": full.captured, "cuda_graph": full.note,
            "cpu_seconds_per_epoch": cpu_seconds / max(1, epochs_run),
            "stages": {stage: {"epochs": count, "seconds_per_epoch": total / count,
                               "cpu_seconds_per_epoch": cpu / count}
                       for stage, (count, total, cpu) in stage_seconds.items()},
            "losses": losses}


def _add_time(totals: dict, stage: str, seconds: float, cpu_seconds: float) -> None:
    """Count one epoch of ``seconds`` wall and ``cpu_seconds`` process CPU time (training step and evaluation)
    for ``stage``."""
    count, total, cpu = totals.get(stage, (0, 0.0, 0.0))
    totals[stage] = (count + 1, total + seconds, cpu + cpu_seconds)


def _minibatch_epoch(model, data, x, train_nodes, split, config, world, seed, batch_size, num_neighbors, autocast):
    """The :class:`MiniBatchEpoch` over this rank's seed batches, or None for full-batch training."""
    if (isinstance(config, StarConfig) and config.has_global_stage
            and (batch_size is not None or num_neighbors is not None or world.size > 1)):
        raise ValueError("train: NT*'s global stage attends over every node of the graph: on a NeighborLoader batch "
                         "it would attend over the batch's nodes only (another model), and data-parallel ranks "
                         "would each need the whole graph's forward; --batch-size, --num-neighbors and torchrun "
                         "need a run without global stage (--epochs <= --local-epochs)")
    if batch_size is None and world.size == 1:
        if num_neighbors is not None:
            raise ValueError("train: num_neighbors (--num-neighbors) needs batch_size (--batch-size)")
        return None
    seeds = train_nodes
    if world.size > seeds.numel():
        raise ValueError(f"train: {world.size} processes (torchrun --nproc-per-node) but split {split} has only "
                         f"{seeds.numel()} training nodes; use at most that many processes")
    if batch_size is None:
        batch_size = -(-seeds.numel() // world.size)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"train: batch_size (--batch-size) must be an int >= 1, got {batch_size!r}")
    layers = len(model.convs) if hasattr(model, "convs") else config.num_layers  # NT's or NT*'s local layers
    counts = check_num_neighbors((-1,) * layers if num_neighbors is None else num_neighbors, layers,
                                 "train: num_neighbors (--num-neighbors)")
    pyg = pyg_data(data.edge_index, data.num_nodes, x, data.y)
    return MiniBatchEpoch(pyg, seeds, counts, batch_size, world, seed + split, x.device, autocast=autocast)


def _mean_std(values):
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``train`` on an argparse subparsers object (handler: :func:`run`)."""
    parser = subparsers.add_parser("train", help="train NT or NT* on a node-classification dataset (paper protocol)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", required=True, choices=DATASETS)
    parser.add_argument("--data-root", default=None, help="folder with the dataset files (default: $NT_KERNELS_DATA)")
    parser.add_argument("--splits", default=None, help="comma-separated split ids (default: the first 10)")
    presets.add_arguments(parser)
    minibatch.add_arguments(parser)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                        help="parameters and features in float32 or float64, or float32 parameters with the forward "
                             "and loss under torch.autocast to bfloat16 (bfloat16-autocast)")
    parser.add_argument("--cuda-graph", choices=tuple(CUDA_GRAPH_CHOICES), default="auto",
                        help="capture the full-batch training step (forward, loss, backward, fused Adam) and the "
                             "evaluation forward in CUDA graphs and replay them every epoch: auto (where possible; "
                             "the run says why not elsewhere: CPU, --batch-size, torchrun, a refused capture), on "
                             "(an error where not possible), off (eager steps)")
    parser.add_argument("--backend", choices=BACKENDS, default="kernels",
                        help="attention ops of the unfused composition: nt_kernels' kernels or the reference loops")
    parser.add_argument("--fused", choices=tuple(FUSED_CHOICES), default="auto",
                        help="fused NT layer op: auto (the path measured faster on the device: the fused op on "
                             "CPU, the composition on CUDA; docs/nn.md), on (error where no kernel), off (the "
                             "composition)")
    parser.add_argument("--seed", type=int, default=0,
                        help="split s is seeded with seed + s (default 0: the split index, as the released recipe)")
    parser.add_argument("--out", default=None, help="write the results as JSON to this file")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.set_defaults(func=run)
    return parser


def run(args) -> int:
    """Handler of ``nt-kernels train``: runs the splits, prints mean ± std, writes the JSON.

    Under ``torchrun`` every process runs it in a process group (gloo on CPU,
    NCCL on CUDA); only rank 0 prints and writes the JSON and checkpoints.
    """
    world = init_from_env(args.device)
    try:
        return _run(args, world)
    finally:
        shutdown()


def _run(args, world: World) -> int:
    log = print if world.is_main else _quiet
    device = f"cuda:{world.local_rank}" if world.size > 1 and torch.device(args.device).type == "cuda" else args.device
    config = presets.config_from_args(args)
    data = load_dataset(args.dataset, args.data_root, directed=config.directed, self_loops=config.self_loops)
    available = data.train_mask.shape[0]
    splits = (list(range(min(10, available))) if args.splits is None
              else [int(s) for s in args.splits.split(",") if s.strip()])
    if not splits or any(not 0 <= s < available for s in splits):
        raise ValueError(f"train: --splits must name split ids in 0..{available - 1}, got {args.splits!r}")
    options = batch_options(args, splits)
    metric = "roc_auc" if int(data.y.max()) + 1 == 2 else "accuracy"
    runs = []
    for split in splits:
        dtype, autocast = DTYPES[args.dtype]
        result = train_split(data, split, config, device=device, dtype=dtype, autocast=autocast,
                             cuda_graph=CUDA_GRAPH_CHOICES[args.cuda_graph], backend=args.backend,
                             fused=FUSED_CHOICES[args.fused], seed=args.seed, progress=not args.no_progress,
                             save=split_path(args.save, split),
                             resume=split_path(args.resume, split), log=log, **options)
        runs.append({key: value for key, value in result.items() if key != "losses"})
        log(f"{args.dataset} split {split}: val {result['val']:.4f} test {result['test']:.4f} "
            f"(best epoch {result['best_epoch']}, {result['epochs']} epochs, "
            f"{1e3 * result['seconds_per_epoch']:.1f} ms/epoch, {result['epochs_per_second']:.3g} epochs/s)")
    test_mean, test_std = _mean_std([r["test"] for r in runs])
    val_mean, val_std = _mean_std([r["val"] for r in runs])
    summary = {"dataset": args.dataset, "model": config_model(config), "directed": config.directed,
               "preset": args.preset, "config": asdict(config),
               "self_loops": config.self_loops, "metric": metric, "device": str(args.device), "dtype": args.dtype,
               "backend": args.backend, "fused": args.fused, "cuda_graph": args.cuda_graph, "seed": args.seed,
               "splits": runs, "test_mean": test_mean,
               "test_std": test_std, "val_mean": val_mean, "val_std": val_std,
               "seconds_per_epoch": statistics.fmean(r["seconds_per_epoch"] for r in runs),
               "epochs_per_second": statistics.fmean(r["epochs_per_second"] for r in runs),
               "world_size": world.size, "distributed_backend": world.backend, **options, **peak_memory(device)}
    log(f"{args.dataset}: test {metric} {100 * test_mean:.2f} ± {100 * test_std:.2f} over {len(runs)} split(s)")
    model = config_model(config)
    if args.preset == "paper" and presets.reported(args.dataset, config.directed, model):
        summary["reported"] = presets.reported(args.dataset, config.directed, model)
        source = "the paper's NT* table" if model == "nt-star" else "the released script"
        log(f"({source} reports {summary['reported'][0]:.2f} ± {summary['reported'][1]:.2f} over 10 "
            "splits at the full recipe)")
    if args.out and world.is_main:
        with open(args.out, "w") as handle:
            json.dump(summary, handle, indent=2)
    return 0


def config_model(config: TrainConfig) -> str:
    """``--model`` of a configuration: ``nt-star`` for a :class:`StarConfig`, else ``nt``."""
    return "nt-star" if isinstance(config, StarConfig) else "nt"


def peak_memory(device) -> dict:
    """Peak memory of this process so far: the maximum resident set (CPU, MiB) and, on CUDA, the peak of
    torch's allocator on ``device`` (MiB)."""
    peak = {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if torch.device(device).type == "cuda":
        peak["peak_cuda_mib"] = torch.cuda.max_memory_allocated(device) / 2 ** 20
    return peak


def _quiet(*args, **kwargs) -> None:
    """``print`` of the ranks other than 0."""


class _MLP(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, hidden: int, num_layers: int):
        super().__init__()
        layers = [nn.Linear(in_channels, hidden), nn.GELU()]
        for _ in range(num_layers):
            layers += [nn.Linear(hidden, hidden), nn.GELU()]
        self.net = nn.Sequential(*layers, nn.Linear(hidden, out_channels))

    def forward(self, x, edge_index=None):
        return self.net(x)


def demo_training(*, epochs: int = 60, hidden: int = 16, heads: int = 2, num_layers: int = 2, seed: int = 0,
                  backend: str = "kernels", num_threads: int | None = 1) -> dict:
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

