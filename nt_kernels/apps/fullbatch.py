"""The epoch of ``nt-kernels train`` without the host: full-batch steps in CUDA graphs, scores on the device.

Per epoch the loop makes one host read: loss, validation and test score,
stacked into one tensor and read together (:func:`read_epoch`).  Everything
before it stays on the device: the training step (:class:`FullBatch`, eager or
a :class:`~nt_kernels.train.CapturedStep`), the evaluation forward and its
metric (:func:`~nt_kernels.train.score_tensor` on index tensors, a
:class:`~nt_kernels.train.CapturedCall` when captured) and the step's clock
(CUDA events, read after the epoch's read).

``--cuda-graph`` (:func:`capture_decision`): ``auto`` captures where it can
(full batch on a CUDA device) and says why where it cannot; ``on`` is an error
where it cannot; ``off`` trains eagerly.  NeighborLoader mini-batches (a new
shape every batch) and data parallel (DDP's all-reduce runs from Python hooks)
stay eager.  A capture that fails under ``auto`` (:class:`~nt_kernels.train.CapturedStep`
refuses the step, naming the reason) falls back to the eager step; under
``on`` it is an error.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from nt_kernels.apps.minibatch import layerwise_logits
from nt_kernels.train import CapturedCall, CapturedStep, autocast_context, score_tensor

__all__ = ["CUDA_GRAPH_CHOICES", "DTYPES", "EpochClock", "FullBatch", "capture_decision", "make_optimizer",
           "read_epoch"]

CUDA_GRAPH_CHOICES = {"auto": None, "on": True, "off": False}
# --dtype: (parameter and feature dtype, autocast dtype or None)
DTYPES = {"float32": (torch.float32, None), "float64": (torch.float64, None),
          "bfloat16-autocast": (torch.float32, torch.bfloat16)}


def capture_decision(cuda_graph: bool | None, device, *, minibatch: bool, world_size: int) -> tuple[bool, str]:
    """(capture?, why) for ``--cuda-graph`` (``None`` = auto) on ``device``; ``True`` where capture is impossible
    is a ``ValueError`` naming the reason."""
    if cuda_graph is False:
        return False, "off (--cuda-graph off), eager steps"
    reason = None
    if torch.device(device).type != "cuda":
        reason = f"CUDA graphs need a CUDA device, the run is on {device}"
    elif world_size > 1:
        reason = ("data-parallel ranks (torchrun) all-reduce gradients from DDP's Python hooks during backward, "
                  "which a graph cannot replay")
    elif minibatch:
        reason = "NeighborLoader mini-batches (--batch-size) give every batch another shape"
    if reason is None:
        return True, "the training step and the evaluation forward are captured and replayed"
    if cuda_graph:
        raise ValueError(f"train: --cuda-graph on, but {reason}; use --cuda-graph auto or off")
    return False, f"not used, eager steps: {reason}"


def make_optimizer(model: nn.Module, lr: float, device, capture: bool) -> torch.optim.Optimizer:
    """Adam: on CUDA fused (and capturable when the step is captured), elsewhere torch's default."""
    if torch.device(device).type == "cuda":
        return torch.optim.Adam(model.parameters(), lr=lr, fused=True, capturable=capture)
    return torch.optim.Adam(model.parameters(), lr=lr)


def read_epoch(loss, val: torch.Tensor, test: torch.Tensor) -> tuple[float, float, float]:
    """The epoch's one host read: the loss (a tensor, or a float from mini-batches) and both scores together."""
    values = [val.double(), test.double()]
    if isinstance(loss, torch.Tensor):
        values.insert(0, loss.double().reshape(()).to(val.device))
        return tuple(torch.stack(values).tolist())
    return (float(loss), *torch.stack(values).tolist())


class EpochClock:
    """Wall time of the training step of each epoch without a sync of its own: CUDA events on CUDA (read after
    the epoch's host read has waited for them), ``perf_counter`` elsewhere."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self._start = self._end = None

    def start(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self._end = torch.cuda.Event(enable_timing=True)
            self._end.record()
        else:
            self._end = time.perf_counter()

    def seconds(self) -> float:
        """The last step's seconds (call after the epoch's host read)."""
        if self.cuda:
            self._end.synchronize()
            return self._start.elapsed_time(self._end) / 1e3
        return self._end - self._start


class FullBatch:
    """Full-batch training and evaluation of one split, with no host read.

    ``train(trained, optimizer, epoch)`` runs one step and returns the loss (a
    device tensor); ``evaluate()`` returns the (validation, test) scores
    (device tensors).  With ``capture`` both are CUDA graphs, recaptured when
    the model's ``stage`` changes (NT*'s switch to the global stage, which also
    reloads the optimizer's state); a capture that fails falls back to eager
    steps when ``required`` is false (``note`` says why).  ``autocast``: the
    dtype of ``torch.autocast`` around forward and loss, or None.  ``eval_nodes``
    (an ``eval_loader``) evaluates layer-wise, eagerly.
    """

    def __init__(self, model: nn.Module, x: torch.Tensor, graph, y: torch.Tensor, nodes: dict, *,
                 autocast: torch.dtype | None, capture: bool, required: bool, note: str, eval_nodes=None):
        self.model, self.x, self.graph, self.y, self.autocast = model, x, graph, y, autocast
        self.train_idx, self.val_idx, self.test_idx = nodes["train"], nodes["val"], nodes["test"]
        self.train_y = y.index_select(0, self.train_idx)
        self.capture, self.required, self.note, self.eval_nodes = capture, required, note, eval_nodes
        self._step = self._eval = None
        self._stage = None

    def __len__(self) -> int:
        return 1

    @property
    def captured(self) -> bool:
        return self._step is not None and self._step.captured

    def _loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.index_select(0, self.train_idx), target)

    def _autocast(self):
        return autocast_context(self.x.device.type, self.autocast)

    def _scores(self, x, graph) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad(), self._autocast():
            logits = self.model(x, graph) if self.eval_nodes is None else layerwise_logits(self.model, x,
                                                                                            self.eval_nodes)
            return (score_tensor(logits.index_select(0, self.val_idx), self.y.index_select(0, self.val_idx)),
                    score_tensor(logits.index_select(0, self.test_idx), self.y.index_select(0, self.test_idx)))

    def __call__(self, trained: nn.Module, optimizer: torch.optim.Optimizer, epoch: int) -> torch.Tensor:
        """One training step (the loop's step protocol, as :class:`~nt_kernels.apps.minibatch.MiniBatchEpoch`)."""
        stage = getattr(self.model, "stage", None)
        if self.capture and (self._step is None or stage != self._stage or self._step.optimizer is not optimizer):
            self._stage = stage
            self._step = CapturedStep(trained, optimizer, self._loss, autocast=self.autocast)
            self._eval = None
            try:
                return self._step(self.x, self.graph, target=self.train_y)
            except ValueError as exc:
                if self.required:
                    raise
                self.capture, self._step = False, None
                self.note = f"not used, eager steps: the capture was refused: {exc}"
        if self._step is not None:
            return self._step(self.x, self.graph, target=self.train_y)
        optimizer.zero_grad()
        with self._autocast():
            loss = self._loss(trained(self.x, self.graph), self.train_y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    def evaluate(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(validation, test) score tensors of an eval-mode forward (captured with the step when it is)."""
        self.model.eval()
        if not self.captured or self.eval_nodes is not None:
            return self._scores(self.x, self.graph)
        if self._eval is None:
            self._eval = CapturedCall(self._scores, pool=self._step.pool)
        return self._eval(self.x, self.graph)

