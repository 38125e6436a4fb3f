"""Activation checkpointing of the node-level blocks of NT and NT* (``checkpoint=``; issue 41, docs/nn.md).

The blocks around the NT layers -- the encoder, the LayerNorm + FFN tail of
every residual block, the predictor (NT), the input projection and the local
blocks' gating tail (NT*) -- keep a few (N, C) activations each for backward.
On a large graph that is most of a step's memory besides the layers' own
(the first H200 run: about 4.3 KB per node on the 5M-node power-law graph).
Checkpointed, a block keeps only its inputs and recomputes the rest during
backward (``torch.utils.checkpoint``, non-reentrant).

* **Bitwise the same.** A checkpointed block runs the same ops in the same
  order as the plain one, so the autograd graph, the loss and every gradient
  are bitwise those of the run without checkpointing (tests/test_checkpoint.py).
  Dropout inside a block draws its noise in the forward exactly as
  ``F.dropout`` draws it on the CPU (``empty_like(y).bernoulli_(1 - p).div_(1 -
  p)``, then ``y * noise``) and the recompute reuses that noise
  (:class:`Dropouts`), so no RNG state is saved or restored
  (``preserve_rng_state=False``): that also works inside a CUDA graph capture,
  where the CUDA generator's state cannot be read.
* **When it pays** (``checkpoint=None``, the default): the model estimates the
  bytes the blocks would keep and checkpointing would free for a forward of N
  nodes (``checkpoint_saving``) and checkpoints when they reach
  :data:`CHECKPOINT_MIN_BYTES` (1 GiB).  Below that the memory is small next
  to any device's and the recompute's extra kernels cost time in
  launch-bound steps (minesweeper's released preset: 45 MiB in float32,
  tolokers': 16 MiB under bf16 autocast); the power-law step of 5M nodes frees
  about 5.0 GiB (bf16 autocast), for a recompute of the blocks' forward, a few
  percent of a step that size.  ``True`` / ``False`` force it.
  Only training forwards with autograd on are checkpointed.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

__all__ = ["CHECKPOINT_MIN_BYTES", "Dropouts", "activation_bytes", "check_checkpoint", "checkpointed", "decide",
           "run_blocks"]

CHECKPOINT_MIN_BYTES = 2 ** 30


def check_checkpoint(owner: str, value) -> None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{owner}: checkpoint must be None (a memory model decides), True or False, got {value!r}")


# Devices whose checkpointed dropout keeps F.dropout's float noise (the CPU: bitwise F.dropout); elsewhere a bool
# mask, as CUDA's native_dropout keeps (a byte per element instead of the activation's two or four).
FLOAT_NOISE_DEVICES = ("cpu",)


class Dropouts:
    """The dropout of one checkpointed block: draws each mask in the forward and hands the same tensors back to the
    recompute; ``p = 0`` is the identity.

    On the CPU the noise is drawn and applied exactly as ``F.dropout`` does there
    (``empty_like(y).bernoulli_(1 - p).div_(1 - p)``, then ``y * noise``), so a
    checkpointed block is bitwise the plain one.  On other devices the mask is a
    bool tensor (``rand_like(y) >= p``) applied by ``aten::native_dropout_backward``
    (``y * mask / (1 - p)``, whose autograd keeps only the mask), as CUDA's
    ``native_dropout`` keeps one byte per element: the same distribution, another
    draw than ``F.dropout``'s.
    """

    def __init__(self):
        self._noise: list[torch.Tensor] = []
        self._next = 0

    def rewind(self) -> None:
        self._next = 0

    def __call__(self, y: torch.Tensor, p: float) -> torch.Tensor:
        if p == 0:
            return y
        float_noise = y.device.type in FLOAT_NOISE_DEVICES
        if self._next == len(self._noise):
            self._noise.append(torch.empty_like(y).bernoulli_(1 - p).div_(1 - p) if float_noise
                               else torch.rand_like(y, dtype=torch.float32) >= p)
        noise = self._noise[self._next]
        self._next += 1
        return y * noise if float_noise else torch.ops.aten.native_dropout_backward(y, noise, 1 / (1 - p))


def checkpointed(fn, *args):
    """``fn(dropout, *args)`` checkpointed: ``dropout(y, p)`` is a :class:`Dropouts` whose noise the recompute
    reuses."""
    dropouts = Dropouts()

    def run(*inputs):
        dropouts.rewind()
        return fn(dropouts, *inputs)

    return torch_checkpoint(run, *args, use_reentrant=False, preserve_rng_state=False)


def run_blocks(modules, dropout, x: torch.Tensor) -> torch.Tensor:
    """``nn.Sequential(*modules)(x)`` with every ``nn.Dropout`` applied by ``dropout(y, p)`` (its ``p``; none in
    eval mode)."""
    for module in modules:
        if isinstance(module, nn.Dropout):
            x = dropout(x, module.p if module.training else 0.0)
        else:
            x = module(x)
    return x


def activation_bytes(x: torch.Tensor, parameter_dtype: torch.dtype) -> int:
    """Bytes per element of the activations autograd keeps: the autocast dtype's when autocast is on for ``x``'s
    device type, else the parameters'."""
    if torch.is_autocast_enabled(x.device.type) and parameter_dtype == torch.float32:
        return torch.get_autocast_dtype(x.device.type).itemsize
    return parameter_dtype.itemsize


def decide(setting: bool | None, module: nn.Module, saving) -> bool:
    """Whether a forward checkpoints its node-level blocks: never without autograd or in eval mode; ``setting``
    when given; else when ``saving()`` (bytes) reaches :data:`CHECKPOINT_MIN_BYTES`."""
    if not (module.training and torch.is_grad_enabled()) or setting is False:
        return False
    return True if setting else saving() >= CHECKPOINT_MIN_BYTES
