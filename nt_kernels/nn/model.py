"""The paper's NT network (GAT-sep backbone, DESIGN §6) built from :class:`NTConv` or :class:`DirNT` layers."""
from __future__ import annotations

import functools

import torch
from torch import nn

from nt_kernels.csr import NeighbourhoodCSR
from nt_kernels.nn.checkpoint import activation_bytes, check_checkpoint, checkpointed, decide, run_blocks
from nt_kernels.nn.conv import (DirNT, NTConv, _check_backend, _check_dropout, _check_fused, _check_in_channels,
                                _check_int, _check_x, _format, _GraphCache)

__all__ = ["ConvStack", "NT"]


class ConvStack(nn.Module):
    """Base of the networks built from a list of NT layers ``self.convs``: their ``backend`` and ``fused``
    settings, read from the first layer and set on all of them."""

    convs: nn.ModuleList

    @property
    def backend(self) -> str:
        """The ``backend`` of every layer (see :class:`NTConv`); settable."""
        return self.convs[0].backend if len(self.convs) else "kernels"

    @backend.setter
    def backend(self, value: str) -> None:
        value = _check_backend(f"{type(self).__name__}: backend", value)
        for conv in self.convs:
            conv.backend = value

    @property
    def fused(self) -> bool | None:
        """The ``fused`` setting of every layer (see :class:`NTConv`); settable."""
        return self.convs[0].fused if len(self.convs) else None

    @fused.setter
    def fused(self, value: bool | None) -> None:
        _check_fused(type(self).__name__, value)
        for conv in self.convs:
            conv.fused = value

    @property
    def checkpoint(self) -> bool | None:
        """Activation checkpointing of the node-level blocks (:mod:`nt_kernels.nn.checkpoint`): ``None`` where the
        memory model says it pays (``checkpoint_saving`` >= 1 GiB), ``True``, ``False``; settable."""
        return self._checkpoint

    @checkpoint.setter
    def checkpoint(self, value: bool | None) -> None:
        check_checkpoint(type(self).__name__, value)
        self._checkpoint = value

    def uses_checkpoint(self, x: torch.Tensor) -> bool:
        """Whether this forward checkpoints its node-level blocks (:func:`nt_kernels.nn.checkpoint.decide`)."""
        def saving() -> int:
            parameter = next(self.parameters()).dtype
            return self.checkpoint_saving(x.shape[0], activation=activation_bytes(x, parameter),
                                          parameter=parameter.itemsize)
        return decide(self._checkpoint, self, saving)

    def prepare(self, edge_index, num_nodes: int) -> NeighbourhoodCSR:
        """The CSR of ``edge_index`` with every plan of every layer built (call before ``torch.compile``)."""
        csr = self._graphs(f"{type(self).__name__}.prepare", edge_index, num_nodes)
        for conv in self.convs:
            conv.prepare(csr, num_nodes)
        return csr

    def _conv_options(self) -> list[str]:
        """The layers' options for the repr, less ``heads`` (the model's own argument); none without layers."""
        if not len(self.convs):
            return []
        return [part for part in self.convs[0]._repr_options() if not part.startswith("heads=")]


class NT(ConvStack):
    """The paper's NT network (GAT-sep backbone, DESIGN §6), with PyG's ``BasicGNN`` signature.

    ``NT(in_channels, hidden_channels, num_layers, out_channels=None, *, ...)``:
    ``Linear -> Dropout -> GELU`` encoder to ``hidden_channels``; ``num_layers``
    residual blocks ``x = x + FFN(h)`` with ``nx = LayerNorm(x)``,
    ``h = conv(nx)`` (an NTConv, or a DirNT when ``directed``), ``h = [nx | h]``
    when ``sep``, ``FFN = Linear -> Dropout -> GELU -> Linear -> Dropout``;
    ``LayerNorm -> Linear`` predictor to ``out_channels`` (``None``: ``hidden_channels``,
    as in PyG's ``BasicGNN``).  ``hidden_channels`` is the total width (heads x head
    dim); ``dropout`` applies to the encoder and the FFNs, the remaining keyword
    arguments go to every NTConv.  ``forward(x, edge_index, edge_attr=None)``
    as :class:`NTConv`'s.

    ``checkpoint``: activation checkpointing of the node-level blocks (the
    encoder, each block's FFN with the ``sep`` concatenation, the predictor;
    :mod:`nt_kernels.nn.checkpoint`): ``None`` (default) where the memory model
    says it pays (:meth:`checkpoint_saving` >= 1 GiB for the forward's node
    count), ``True`` / ``False`` always / never.  The loss and every gradient are
    bitwise those of the run without it.
    """

    def __init__(self, in_channels: int, hidden_channels: int, num_layers: int, out_channels: int | None = None, *,
                 heads: int = 1, dropout: float = 0.0, directed: bool = False, sep: bool = False,
                 checkpoint: bool | None = None, **conv_kwargs):
        super().__init__()
        self.checkpoint = checkpoint
        _check_in_channels("NT", in_channels)
        out_channels = hidden_channels if out_channels is None else out_channels
        for name, value, low in (("hidden_channels", hidden_channels, 1), ("num_layers", num_layers, 0),
                                 ("out_channels", out_channels, 1), ("heads", heads, 1)):
            _check_int(f"NT: {name}", value, low)
        if hidden_channels % heads:
            raise ValueError(f"NT: hidden_channels ({hidden_channels}) must be divisible by heads ({heads})")
        _check_dropout("NT", dropout)
        self.in_channels, self.hidden_channels, self.out_channels = in_channels, hidden_channels, out_channels
        self.num_layers, self.heads, self.dropout = num_layers, heads, float(dropout)
        self.directed, self.sep = bool(directed), bool(sep)
        conv_cls = DirNT if directed else NTConv
        hidden = hidden_channels
        ffn_in = 2 * hidden if sep else hidden
        self.encoder = nn.Sequential(nn.Linear(in_channels, hidden), nn.Dropout(dropout), nn.GELU())
        self.norms = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(num_layers))
        self.convs = nn.ModuleList(conv_cls(hidden, hidden, heads=heads, **conv_kwargs) for _ in range(num_layers))
        self.ffns = nn.ModuleList(
            nn.Sequential(nn.Linear(ffn_in, hidden), nn.Dropout(dropout), nn.GELU(),
                          nn.Linear(hidden, hidden), nn.Dropout(dropout))
            for _ in range(num_layers))
        self.predictor = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, out_channels))
        self._graphs = _GraphCache()

    def reset_parameters(self) -> None:
        """Re-initialise every parameter (and the layers' Performer projections) from the global RNG, in the
        constructor's order: a reset after ``torch.manual_seed(s)`` gives the model built after it."""
        for block in (self.encoder, self.norms, self.convs, *self.ffns, self.predictor):
            for module in block:
                if hasattr(module, "reset_parameters"):
                    module.reset_parameters()

    def forward(self, x: torch.Tensor, edge_index, edge_attr: torch.Tensor | None = None) -> torch.Tensor:
        _check_x("NT", x, self.in_channels)
        csr = self._graphs("NT", edge_index, x.shape[0])
        ckpt = self.uses_checkpoint(x)
        x = checkpointed(functools.partial(run_blocks, self.encoder), x) if ckpt else self.encoder(x)
        for index in range(self.num_layers):
            x = self.block(index, x, csr, edge_attr, checkpoint=ckpt)
        return checkpointed(functools.partial(run_blocks, self.predictor), x) if ckpt else self.predictor(x)

    def block(self, index: int, x: torch.Tensor, edge_index, edge_attr: torch.Tensor | None = None, *,
              checkpoint: bool = False) -> torch.Tensor:
        """Residual block ``index`` on hidden features ``x`` (N, hidden_channels):
        ``x + FFN([LayerNorm(x) |] conv(...))``; with ``checkpoint`` the FFN (and the concatenation) is
        checkpointed.

        ``forward`` is ``predictor(block(L-1, ... block(0, encoder(x)) ...))``;
        layer-wise inference (``nt_kernels.apps.minibatch.layerwise_logits``)
        calls the blocks one at a time on node batches.
        """
        nx = self.norms[index](x)
        h = self.convs[index](nx, edge_index, edge_attr)
        inputs = (nx, h) if self.sep else (h,)
        if checkpoint:
            return x + checkpointed(functools.partial(self._tail, index), *inputs)
        return x + self.ffns[index](torch.cat(inputs, dim=-1) if self.sep else h)

    def _tail(self, index: int, dropout, *inputs: torch.Tensor) -> torch.Tensor:
        """The checkpointed part of block ``index``: ``FFN([nx |] h)``, its dropout applied by ``dropout``."""
        return run_blocks(self.ffns[index], dropout, torch.cat(inputs, dim=-1) if self.sep else inputs[0])

    def checkpoint_saving(self, num_nodes: int, *, activation: int = 4, parameter: int = 4) -> int:
        """The memory model: bytes of activations that the node-level blocks keep for backward in a training
        forward of ``num_nodes`` nodes and that checkpointing frees (an estimate, docs/nn.md).

        ``activation``: bytes per kept element (2 under bf16 / fp16 autocast, else the parameters'
        ``parameter`` bytes).  Per node: each block's FFN keeps its input (the ``sep`` concatenation), its
        GELU's input and its second linear's input, (F + 2C) values, less what the checkpointed block keeps as
        inputs that nothing else keeps (under autocast, the float32 LayerNorm output with ``sep``; the layer
        output is kept by the layer's backward either way); the encoder its GELU's input (and the autocast copy
        of the features), the predictor its linear's input and the LayerNorm's statistics.  Dropout's noise
        is kept either way.
        """
        c, f = self.hidden_channels, (2 if self.sep else 1) * self.hidden_channels
        autocast = activation < parameter
        block = (f + 2 * c) * activation - (parameter * c if autocast and self.sep else 0)
        encoder = c * activation + (self.in_channels * activation if autocast else 0)
        predictor = c * activation + 2 * parameter
        return num_nodes * (self.num_layers * block + encoder + predictor)

    def __repr__(self) -> str:
        parts = [str(self.in_channels), str(self.hidden_channels), f"num_layers={self.num_layers}"]
        if self.out_channels != self.hidden_channels:
            parts.append(f"out_channels={self.out_channels}")
        parts.append(f"heads={self.heads}")
        if self.dropout:
            parts.append(f"dropout={_format(self.dropout)}")
        parts += [f"{name}=True" for name in ("directed", "sep") if getattr(self, name)]
        if self.checkpoint is not None:
            parts.append(f"checkpoint={self.checkpoint}")
        return f"{type(self).__name__}({', '.join(parts + self._conv_options())})"
