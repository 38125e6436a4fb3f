"""Polynormer's two-stage schedule for NT* (:class:`~nt_kernels.nn.NTStar`) in the training loop.

Epochs ``0 .. local_epochs - 1`` train the local stage (``model.stage =
"local"``); at epoch ``local_epochs`` the model and optimizer go back to
their state at the best local-stage validation score and the global stage
starts (``model.stage = "global"``), as the released Polynormer script does
(it saves the best model and reloads it at the switch).  The best score and
its test score carry over: the reported test score is the one at the best
validation epoch of the whole run.  Early stopping waits ``patience`` epochs
from the later of the best epoch and the start of the global stage, and
never stops the local stage.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

__all__ = ["SingleStage", "TwoStages"]


class SingleStage:
    """The schedule of a one-stage model (NT): nothing to switch, patience from the best epoch."""

    def begin_epoch(self, epoch: int) -> None:
        """Called before epoch ``epoch`` trains."""

    def new_best(self) -> None:
        """Called after the model reached a new best validation score."""

    def should_stop(self, epoch: int, best_epoch: int, patience: int) -> bool:
        return epoch - best_epoch >= patience

    def stage_of(self, epoch: int) -> str:
        return "all"


class TwoStages(SingleStage):
    """The local-then-global schedule of a model with a ``stage`` attribute (``"local"`` / ``"global"``).

    ``first_epoch`` is where training starts (after ``--resume``: the epoch
    after the checkpoint, whose weights are the best so far).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, local_epochs: int, first_epoch: int = 0):
        if isinstance(local_epochs, bool) or not isinstance(local_epochs, int) or local_epochs < 0:
            raise ValueError(f"train: local_epochs (--local-epochs) must be an int >= 0, got {local_epochs!r}")
        self.model, self.optimizer, self.local_epochs = model, optimizer, local_epochs
        self.best_state = None
        model.stage = "global" if first_epoch > local_epochs else "local"
        if 0 < first_epoch <= local_epochs:
            self.new_best()

    def begin_epoch(self, epoch: int) -> None:
        if epoch != self.local_epochs:
            return
        if self.best_state is not None:
            model_state, optimizer_state = self.best_state
            self.model.load_state_dict(model_state)
            self.optimizer.load_state_dict(optimizer_state)
        self.best_state = None
        self.model.stage = "global"

    def new_best(self) -> None:
        if self.model.stage == "local":
            self.best_state = copy.deepcopy((self.model.state_dict(), self.optimizer.state_dict()))

    def should_stop(self, epoch: int, best_epoch: int, patience: int) -> bool:
        return epoch >= self.local_epochs and epoch - max(best_epoch, self.local_epochs - 1) >= patience

    def stage_of(self, epoch: int) -> str:
        return "local" if epoch < self.local_epochs else "global"
