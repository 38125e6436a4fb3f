"""Mini-batch pieces of the training loop: one epoch over seed batches, layer-wise evaluation, checkpoints.

:func:`nt_kernels.apps.train.train_split` runs the epochs; this module holds
what changes when the training nodes come in batches from
:func:`nt_kernels.apps.sampling.nt_loader` (on one process or one shard per
rank, :mod:`nt_kernels.apps.distributed`).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.data import Data

from nt_kernels.apps.distributed import World, shard_sampler
from nt_kernels.apps.sampling import nt_loader
from nt_kernels.train import autocast_context

__all__ = ["MiniBatchEpoch", "add_arguments", "batch_options", "eval_loader", "layerwise_logits", "load_checkpoint",
           "parse_num_neighbors", "pyg_data", "save_checkpoint", "split_path"]


def pyg_data(edge_index: torch.Tensor, num_nodes: int, x: torch.Tensor | None = None,
             y: torch.Tensor | None = None) -> Data:
    """A CPU ``torch_geometric.data.Data`` for the loaders (sampling runs on the CPU; batches move to the device)."""
    data = Data(edge_index=edge_index.cpu(), num_nodes=num_nodes)
    if x is not None:
        data.x = x.cpu()
    if y is not None:
        data.y = y.cpu()
    return data


class MiniBatchEpoch:
    """One epoch of optimizer steps over this rank's seed batches (``--batch-size``, ``--num-neighbors``).

    The seeds (global node ids) are sharded over the ranks with a seeded
    ``DistributedSampler`` (a world of one shuffles them all); each batch is a
    NeighborLoader subgraph, the loss is the cross entropy on its
    ``batch.batch_size`` seed rows.  ``model`` may be DDP-wrapped, which
    averages the gradients of the ranks in ``backward``.  ``autocast``: the dtype
    of ``torch.autocast`` around forward and loss, or None.  The steps are eager
    (every batch has another shape: no CUDA graph).
    """

    def __init__(self, data: Data, seeds: torch.Tensor, num_neighbors, batch_size: int, world: World, seed: int,
                 device, *, autocast: torch.dtype | None = None):
        self.sampler = shard_sampler(seeds.numel(), world, seed)
        self.loader = nt_loader(data, num_neighbors, batch_size=batch_size, input_nodes=seeds.cpu(),
                                sampler=self.sampler)
        self.device, self.autocast = torch.device(device), autocast

    def __len__(self) -> int:
        return len(self.loader)

    def __call__(self, model: nn.Module, optimizer: torch.optim.Optimizer, epoch: int) -> float:
        """Train on every batch of epoch ``epoch``; returns the seed-weighted mean loss of this rank."""
        self.sampler.set_epoch(epoch)
        total, count = 0.0, 0
        for batch in self.loader:
            batch = batch.to(self.device)
            optimizer.zero_grad()
            with autocast_context(self.device.type, self.autocast):
                logits = model(batch.x, batch.edge_index)[:batch.batch_size]
                loss = F.cross_entropy(logits, batch.y[:batch.batch_size])
            loss.backward()
            optimizer.step()
            total = total + loss.detach() * batch.batch_size
            count += batch.batch_size
        return float(total / count)


def eval_loader(edge_index: torch.Tensor, num_nodes: int, batch_size: int):
    """Every node in batches of ``batch_size``, each with its whole-neighbourhood two-hop subgraph (one layer)."""
    return nt_loader(pyg_data(edge_index, num_nodes), [-1], batch_size=batch_size)


@torch.no_grad()
def layerwise_logits(model: nn.Module, x: torch.Tensor, loader) -> torch.Tensor:
    """Eval-mode logits of an :class:`~nt_kernels.nn.NT`, one layer at a time over the node batches of ``loader``.

    ``loader`` is an :func:`eval_loader`.  Each block runs on the
    whole-neighbourhood subgraph of a node batch, reading the previous layer's
    features of every node; so the result equals the full-graph forward while
    only one batch's subgraph is in memory at a time.
    """
    if not hasattr(model, "block"):
        raise ValueError(f"layerwise_logits: needs an NT (with encoder, block and predictor), "
                         f"got {type(model).__name__}")
    h = model.encoder(x)
    for index in range(model.num_layers):
        out = torch.empty_like(h)
        for batch in loader:
            n_id = batch.n_id.to(h.device)
            rows = model.block(index, h[n_id], batch.edge_index.to(h.device))
            out[n_id[:batch.batch_size]] = rows[:batch.batch_size]
        h = out
    return model.predictor(h)


def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, *, config: dict,
                    split: int, epoch: int, val: float, test: float, losses: list[float]) -> None:
    """Write the model (state_dict), optimizer, configuration, epoch and scores; atomically (temp file + rename)."""
    path = Path(path)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "config": config, "split": split,
             "epoch": epoch, "val": val, "test": test, "losses": list(losses)}
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


# Settings a resumed run may change: how long it trains.
RESUMABLE = ("epochs", "patience")


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, *, config: dict,
                    split: int) -> dict:
    """Load a :func:`save_checkpoint` file into ``model`` and ``optimizer``; returns its epoch, scores and losses.

    The checkpoint must come from the same configuration (``epochs`` and
    ``patience`` may differ) and split, else ``ValueError``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--resume: checkpoint {path} not found")
    state = torch.load(path, map_location="cpu", weights_only=True)
    differ = sorted(key for key in set(config) | set(state["config"])
                    if key not in RESUMABLE and config.get(key) != state["config"].get(key))
    if differ:
        raise ValueError(f"--resume: {path} was trained with other settings: "
                         + ", ".join(f"{key} {state['config'].get(key)!r} (now {config.get(key)!r})"
                                     for key in differ))
    if state["split"] != split:
        raise ValueError(f"--resume: {path} holds split {state['split']}, this run trains split {split}")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return {key: state[key] for key in ("epoch", "val", "test", "losses")}


def parse_num_neighbors(text: str) -> tuple[int, ...]:
    """``--num-neighbors`` text ``"15,10"`` (``-1``: whole neighbourhoods) as a tuple of ints."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"train: --num-neighbors must be comma-separated ints (one per layer, -1 for all), "
                         f"got {text!r}") from None


def add_arguments(parser) -> None:
    """The mini-batch, data-parallel and checkpoint options of ``nt-kernels train``."""
    group = parser.add_argument_group(
        "mini-batches, data parallel, checkpoints",
        "Under `torchrun --nproc-per-node N -m nt_kernels.cli train ...` every process trains on its own\n"
        "shard of the training nodes (DDP; gloo on CPU, NCCL on CUDA); only rank 0 prints and writes files.")
    group.add_argument("--batch-size", type=int, default=None,
                       help="training seeds per batch and process; default: full batch (one process) or the "
                            "process's whole shard (torchrun)")
    group.add_argument("--num-neighbors", type=parse_num_neighbors, default=None,
                       help="fan-out per layer, seeds' layer first, e.g. 15,10; NeighborLoader samples two hops "
                            "per NT layer with it (write --num-neighbors=-1,-1 for whole neighbourhoods: the default)")
    group.add_argument("--eval-batch-size", type=int, default=None,
                       help="evaluate layer-wise over batches of this many nodes (default: full batch)")
    group.add_argument("--save", default=None,
                       help="checkpoint of the best-validation model; with several splits put {split} in the path")
    group.add_argument("--resume", default=None, help="continue from this checkpoint ({split} as for --save)")


def batch_options(args, splits: list[int]) -> dict:
    """Check the options of :func:`add_arguments`; returns the ``train_split`` keywords except save/resume."""
    for flag in ("batch_size", "eval_batch_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"train: --{flag.replace('_', '-')} must be >= 1, got {value}")
    for flag in ("save", "resume"):
        path = getattr(args, flag)
        if path is not None and len(splits) > 1 and "{split}" not in path:
            raise ValueError(f"train: --{flag} with {len(splits)} splits needs {{split}} in the path, got {path!r}")
    return {"batch_size": args.batch_size, "num_neighbors": args.num_neighbors,
            "eval_batch_size": args.eval_batch_size}


def split_path(path: str | None, split: int) -> str | None:
    """``--save`` / ``--resume`` path of one split (``{split}`` replaced)."""
    return None if path is None else path.replace("{split}", str(split))
