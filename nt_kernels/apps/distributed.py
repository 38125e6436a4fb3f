"""Data-parallel training with ``torch.distributed`` and ``DistributedDataParallel``, launched by ``torchrun``.

``torchrun --nproc-per-node N -m nt_kernels.cli train ...`` starts N
processes with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and the rendezvous
address in their environment; :func:`init_from_env` joins that process group
(gloo on CPU, NCCL on CUDA).  Every rank builds the same model (same seed;
DDP also broadcasts rank 0's parameters and buffers when it wraps the model),
takes its own shard of the training seeds each epoch (:func:`shard_sampler`,
``DistributedSampler``) and DDP averages the gradients in ``backward``.  There
is no communication code of our own.
"""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data.distributed import DistributedSampler

__all__ = ["World", "current", "init_from_env", "launched_by_torchrun", "shard_sampler", "shutdown", "wrap"]

_DDP_PARAMETERS = inspect.signature(DistributedDataParallel.__init__).parameters


@dataclass(frozen=True)
class World:
    """This process's place among the data-parallel ranks (a world of one without torch.distributed)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    backend: str | None = None

    @property
    def is_main(self) -> bool:
        """Rank 0: the only one that logs and writes results and checkpoints."""
        return self.rank == 0


def launched_by_torchrun() -> bool:
    """Whether the environment describes a process group (``torchrun`` sets ``RANK`` and ``WORLD_SIZE``)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def current() -> World:
    """The initialised process group as a :class:`World`, else a world of one."""
    if not (dist.is_available() and dist.is_initialized()):
        return World()
    return World(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", dist.get_rank())),
                 dist.get_backend())


def init_from_env(device: str) -> World:
    """Join the process group ``torchrun`` describes: gloo for ``device`` cpu, NCCL for cuda.

    Without ``torchrun`` (or with a world size of 1) nothing is initialised.
    On CUDA every rank uses ``cuda:LOCAL_RANK``.
    """
    if dist.is_available() and dist.is_initialized():
        return current()
    if not launched_by_torchrun() or int(os.environ["WORLD_SIZE"]) == 1:
        return World()
    kind = torch.device(device).type
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"init_from_env: device must be cpu or cuda for data-parallel training, got {device!r}")
    if kind == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if kind == "cuda" else "gloo")
    return current()


def shutdown() -> None:
    """Leave the process group if one was joined."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def wrap(model: nn.Module, world: World) -> nn.Module:
    """``model`` in ``DistributedDataParallel`` when the world has several ranks, else unchanged.

    No buffer broadcast before every forward: NT's only buffers are the
    Performer projections, fixed after construction and equal on every rank
    (same seed, and DDP broadcasts rank 0's module state at wrap time), so
    re-broadcasting them would be wasted communication.
    ``find_unused_parameters=False``: every parameter of NT takes part in every
    forward, so DDP need not walk the autograd graph looking for unused ones.
    (torch 2.13 names the flag ``forward_sync_buffers`` and still broadcasts
    the buffers once at wrap time; older torch calls it ``broadcast_buffers``.)
    """
    if world.size == 1:
        return model
    no_forward_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in _DDP_PARAMETERS
                       else {"broadcast_buffers": False})
    return DistributedDataParallel(model, device_ids=None, find_unused_parameters=False, **no_forward_sync)


def shard_sampler(num_seeds: int, world: World, seed: int) -> DistributedSampler:
    """This rank's shard of positions ``0..num_seeds-1``: a seeded permutation per epoch (``set_epoch``).

    Every rank draws the same permutation (seeded with ``seed + epoch``) and
    takes every ``world.size``-th entry from its rank on, so the shards are
    disjoint; when ``num_seeds`` is not a multiple of the world size the
    first seeds of the permutation are repeated to give every rank the same
    number of batches (``DistributedSampler``'s padding).
    """
    if num_seeds < world.size:
        raise ValueError(f"shard_sampler: {world.size} processes need at least as many training nodes, "
                         f"got {num_seeds}")
    return DistributedSampler(range(num_seeds), num_replicas=world.size, rank=world.rank, shuffle=True, seed=seed,
                              drop_last=False)
