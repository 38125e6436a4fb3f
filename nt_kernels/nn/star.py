"""NT*: Polynormer with NT layers as its local module (the paper's appendix "Comparing With Graph Transformers")."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.nn.attention import PolynormerAttention

from nt_kernels.nn.checkpoint import checkpointed
from nt_kernels.nn.conv import (DirNT, NTConv, _check_dropout, _check_in_channels, _check_int, _check_x, _format,
                                _GraphCache)
from nt_kernels.nn.model import ConvStack

__all__ = ["NTStar"]

STAGES = ("local", "global")


def _check_beta(name: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not 0.0 <= value <= 1.0):
        raise ValueError(f"NTStar: {name} must be None or a number in [0, 1], got {value!r}")


class NTStar(ConvStack):
    r"""NT*, the paper's "GT-augmented NT": Polynormer whose local message passing is done by NT layers.

    **Signature.** PyG's :class:`~torch_geometric.nn.models.Polynormer` names and
    order, ``NTStar(in_channels, hidden_channels, out_channels, local_layers=7,
    global_layers=2, *, in_dropout, dropout, global_dropout, heads, beta, ...)``,
    the options after ``global_layers`` keyword-only; ``forward(x, edge_index,
    edge_attr=None)`` as :class:`NTConv`'s.

    **Structure (from Polynormer, arXiv 2403.01232, and its released code).**
    Input ``x -> Dropout(in_dropout) -> Linear -> Dropout(dropout)`` to ``hidden_channels``
    channels; then ``local_layers`` local blocks, each (ReLU, LayerNorm, all
    ``hidden_channels`` wide)

    .. math::
        h = \mathrm{ReLU}(W_h x), \quad
        y = \mathrm{Dropout}(\mathrm{ReLU}(\mathrm{conv}(x) + W x)), \quad
        x \leftarrow (1 - \beta) \,\mathrm{LayerNorm}(h \odot y) + \beta\, y,

    whose outputs are summed, :math:`x_{local} = \sum_i x_i`.  *Local stage*:
    ``pred_local(x_local)``.  *Global stage*: ``LayerNorm(x_local)``, then
    ``global_layers`` PyG :class:`~torch_geometric.nn.attention.PolynormerAttention`
    layers over all N nodes as one set (linear attention, sigmoid keys shared
    with the queries), then ``pred_global``.  Training runs the two stages one
    after the other (``model.stage = "local"`` / ``"global"``; the global stage
    starts from the best local-stage weights, :func:`nt_kernels.apps.train.train_split`).

    **From NT.** ``conv`` is an :class:`NTConv` (a :class:`DirNT` when
    ``directed``) in place of Polynormer's GATConv, built with ``heads`` and
    ``conv_kwargs`` (aggregator, attention, ...): NT's settings for the
    dataset.  ``hidden_channels = heads * head_dim`` as in :class:`NT`.

    **Where the paper is silent, and what this class does.** The paper gives
    no NT* hyperparameters or code; it says only that Polynormer's MPNN part
    was replaced by an NT layer.

    * *Widths.* Polynormer runs both stages at ``heads * hidden_channels``
      with the same heads; here both run at ``hidden_channels`` (NT's total
      width), and the global attention uses NT's heads and head width
      (``hidden_channels // heads``), so its output has the local width as in Polynormer.
    * *Layer count and dropout.* The presets (:mod:`nt_kernels.apps.presets`)
      set ``local_layers`` and ``dropout`` to NT's (the released NT recipe: 5
      layers, 0.2 on minesweeper), not Polynormer's (10 layers of 8 x 64
      channels), which would cost ~20x NT's per-epoch time.
    * *Ego path.* Polynormer's ``W x`` term plays the role of NT's ``sep``
      (ego and neighbour embeddings kept apart), so there is no ``sep``.
    * *beta.* ``beta=None``: learned per layer and channel as
      :math:`\sigma(\theta)`, :math:`\theta` initialised to 0 (the released code
      learns it; it initialises :math:`\theta` with a small Xavier draw, 0 is its
      mean and makes the run independent of that draw); a number fixes it
      (PyG's :class:`~torch_geometric.nn.models.Polynormer` fixes it).
      PolynormerAttention takes a fixed ``beta``: ``global_beta``, by default
      ``beta`` when fixed, else 0.5, the learned beta's initial value.
    * *Global attention.* ``qkv_bias=True`` (the released GlobalAttn's key and
      value projections have biases; PyG's default is False), queries shared
      with keys (released default), dropout ``global_dropout``.
    * *One graph.* The global attention runs over all rows of ``x`` as one
      set (no ``batch`` vector); node batches would restrict it to the batch.
    * *Defaults.* ``local_layers=7`` and ``global_layers=2`` are Polynormer's;
      the dropouts (0) and ``beta`` (None: learned) stay this class's own
      (Polynormer: 0.15, 0.5, 0.5 and a fixed 0.9).  Polynormer's ``qk_shared``
      (here always True), ``pre_ln``, ``post_bn`` and ``local_attn`` are not offered.

    Args:
        in_channels, out_channels: input feature width and number of classes.
        hidden_channels: width of both stages (NT's heads x head dim).
        local_layers: NT layers of the local stage.
        global_layers: PolynormerAttention layers.
        in_dropout, dropout, global_dropout: on the input features, after
            each local block's ReLU (and after the input projection), and on
            each global layer's output.
        heads: heads of the NT layers and of the global attention; divides ``hidden_channels``.
        beta, global_beta: see above.
        directed: DirNT layers (edges and reversed edges) instead of NTConv.
        checkpoint: activation checkpointing of the node-level blocks (the input
            projection and each local block's gating tail around its NT layer;
            :mod:`nt_kernels.nn.checkpoint`): ``None`` (default) where the memory
            model says it pays (:meth:`checkpoint_saving` >= 1 GiB), ``True`` /
            ``False``.  The loss and gradients are bitwise those without it.
        **conv_kwargs: the NT layers' other arguments (``aggr``, ``attention``,
            ``gate_group``, ``edge_dim``, ``backend``, ``fused``, ...).
    """

    def __init__(self, in_channels: int, hidden_channels: int, out_channels: int, local_layers: int = 7,
                 global_layers: int = 2, *, in_dropout: float = 0.0, dropout: float = 0.0, global_dropout: float = 0.0,
                 heads: int = 1, beta: float | None = None, global_beta: float | None = None, directed: bool = False,
                 checkpoint: bool | None = None, **conv_kwargs):
        super().__init__()
        self.checkpoint = checkpoint
        _check_in_channels("NTStar", in_channels)
        for name, value, low in (("hidden_channels", hidden_channels, 1), ("out_channels", out_channels, 1),
                                 ("local_layers", local_layers, 1), ("global_layers", global_layers, 0),
                                 ("heads", heads, 1)):
            _check_int(f"NTStar: {name}", value, low)
        if hidden_channels % heads:
            raise ValueError(f"NTStar: hidden_channels ({hidden_channels}) must be divisible by heads ({heads})")
        for name, value in (("in_dropout", in_dropout), ("dropout", dropout), ("global_dropout", global_dropout)):
            _check_dropout(f"NTStar: {name}", value)
        _check_beta("beta", beta)
        _check_beta("global_beta", global_beta)
        self.in_channels, self.hidden_channels, self.out_channels = in_channels, hidden_channels, out_channels
        self.local_layers, self.global_layers, self.heads = local_layers, global_layers, heads
        self.directed = bool(directed)
        self.in_dropout, self.dropout, self.global_dropout = float(in_dropout), float(dropout), float(global_dropout)
        self.beta = None if beta is None else float(beta)
        self.global_beta = float(global_beta if global_beta is not None else 0.5 if beta is None else beta)
        hidden = hidden_channels
        conv_cls = DirNT if directed else NTConv
        self.lin_in = nn.Linear(in_channels, hidden)
        self.h_lins = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(local_layers))
        self.convs = nn.ModuleList(conv_cls(hidden, hidden, heads=heads, **conv_kwargs) for _ in range(local_layers))
        self.lins = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(local_layers))
        self.lns = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(local_layers))
        self.betas = nn.Parameter(torch.zeros(local_layers, hidden)) if beta is None else None
        self.ln = nn.LayerNorm(hidden)
        self.global_attn = nn.ModuleList(
            PolynormerAttention(hidden, heads, head_channels=hidden // heads, beta=self.global_beta, qkv_bias=True,
                                qk_shared=True, dropout=global_dropout)
            for _ in range(global_layers))
        self.pred_local = nn.Linear(hidden, out_channels)
        self.pred_global = nn.Linear(hidden, out_channels)
        self._graphs = _GraphCache()
        self.stage = "local"

    @property
    def stage(self) -> str:
        """``"local"`` (local blocks -> ``pred_local``) or ``"global"`` (-> global attention -> ``pred_global``).

        Setting it also sets ``requires_grad`` of the parameters the stage does
        not use to False (the global attention, ``ln`` and ``pred_global`` in the
        local stage; ``pred_local`` in the global one) and back to True for the
        others, so that DistributedDataParallel sees only the parameters in use.
        """
        return self._stage

    @stage.setter
    def stage(self, value: str) -> None:
        if value not in STAGES:
            raise ValueError(f"NTStar: stage must be one of {STAGES}, got {value!r}")
        self._stage = value
        for module, used in ((self.global_attn, value == "global"), (self.ln, value == "global"),
                             (self.pred_global, value == "global"), (self.pred_local, value == "local")):
            module.requires_grad_(used)

    def reset_parameters(self) -> None:
        """Re-initialise every parameter (and the NT layers' Performer projections) from the global RNG, in the
        constructor's order: a reset after ``torch.manual_seed(s)`` gives the model built after it."""
        for module in (self.lin_in, *self.h_lins, *self.convs, *self.lins, *self.lns, self.ln, *self.global_attn,
                       self.pred_local, self.pred_global):
            module.reset_parameters()
        if self.betas is not None:
            nn.init.zeros_(self.betas)

    def local_beta(self, index: int):
        """beta of local block ``index``: sigmoid of its learned row, or the fixed number."""
        return self.beta if self.betas is None else torch.sigmoid(self.betas[index])

    def forward(self, x: torch.Tensor, edge_index, edge_attr: torch.Tensor | None = None) -> torch.Tensor:
        _check_x("NTStar", x, self.in_channels)
        csr = self._graphs("NTStar", edge_index, x.shape[0])
        ckpt = self.uses_checkpoint(x)
        x = checkpointed(self._input, x) if ckpt else self._input(self._dropout, x)
        x_local = 0
        for index, conv in enumerate(self.convs):
            c = conv(x, csr, edge_attr)
            x = (checkpointed(functools.partial(self._local_tail, index), x, c) if ckpt
                 else self._local_tail(index, self._dropout, x, c))
            x_local = x_local + x
        if self._stage == "local":
            return self.pred_local(x_local)
        z = self.ln(x_local).unsqueeze(0)
        for attention in self.global_attn:
            z = attention(z)
        return self.pred_global(z.squeeze(0))

    def _dropout(self, y: torch.Tensor, p: float) -> torch.Tensor:
        return F.dropout(y, p, self.training)

    def _input(self, dropout, x: torch.Tensor) -> torch.Tensor:
        """``Dropout(in_dropout) -> lin_in -> Dropout(dropout)``, the dropouts applied by ``dropout(y, p)``."""
        p_in, p = (self.in_dropout, self.dropout) if self.training else (0.0, 0.0)
        return dropout(self.lin_in(dropout(x, p_in)), p)

    def _local_tail(self, index: int, dropout, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """Local block ``index`` around its NT layer's output ``c``: ``h = ReLU(h_lins(x))``,
        ``y = Dropout(ReLU(c + lins(x)))``, ``(1 - beta) LayerNorm(h * y) + beta y``."""
        h = F.relu(self.h_lins[index](x))
        y = dropout(F.relu(c + self.lins[index](x)), self.dropout if self.training else 0.0)
        beta = self.local_beta(index)
        return (1 - beta) * self.lns[index](h * y) + beta * y

    def checkpoint_saving(self, num_nodes: int, *, activation: int = 4, parameter: int = 4) -> int:
        """The memory model (as :meth:`NT.checkpoint_saving`): bytes the input projection and the local blocks'
        tails keep for backward in a training forward of ``num_nodes`` nodes and checkpointing frees.  Per node
        and block: the ReLU outputs, the gated product and ``y`` (3C values at ``activation`` bytes), the
        LayerNorm's input and output (2C at ``parameter`` bytes, as autocast runs LayerNorm in float32); the
        input projection its linear's input."""
        c = self.hidden_channels
        block = 3 * c * activation + 2 * c * parameter
        return num_nodes * (self.local_layers * block + self.in_channels * activation)

    def __repr__(self) -> str:
        parts = [str(self.in_channels), str(self.hidden_channels), str(self.out_channels),
                 f"local_layers={self.local_layers}", f"global_layers={self.global_layers}"]
        for name in ("in_dropout", "dropout", "global_dropout"):
            if getattr(self, name):
                parts.append(f"{name}={_format(getattr(self, name))}")
        parts += [f"heads={self.heads}", f"beta={'learned' if self.beta is None else _format(self.beta)}"]
        if self.global_beta != (0.5 if self.beta is None else self.beta):
            parts.append(f"global_beta={_format(self.global_beta)}")
        if self.directed:
            parts.append("directed=True")
        if self.checkpoint is not None:
            parts.append(f"checkpoint={self.checkpoint}")
        parts.append(f"stage={self._stage}")
        return f"{type(self).__name__}({', '.join(parts + self._conv_options())})"
