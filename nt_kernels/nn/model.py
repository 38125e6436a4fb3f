"""The paper's NT network (GAT-sep backbone, DESIGN §6) built from :class:`NTConv` or :class:`DirNT` layers."""
from __future__ import annotations

import torch
from torch import nn

from nt_kernels.csr import NeighbourhoodCSR
from nt_kernels.nn.conv import (DirNT, NTConv, _check_backend, _check_dropout, _check_fused, _check_int, _check_x,
                                _GraphCache)

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

    def prepare(self, graph, num_nodes: int) -> NeighbourhoodCSR:
        """The CSR of ``graph`` with every plan of every layer built (call before ``torch.compile``)."""
        csr = self._graphs(f"{type(self).__name__}.prepare", graph, num_nodes)
        for conv in self.convs:
            conv.prepare(csr, num_nodes)
        return csr


class NT(ConvStack):
    """The paper's NT network (GAT-sep backbone, DESIGN §6).

    ``Linear -> Dropout -> GELU`` encoder to ``hidden`` channels; ``num_layers``
    residual blocks ``x = x + FFN(h)`` with ``nx = LayerNorm(x)``,
    ``h = conv(nx)`` (an NTConv, or a DirNT when ``directed``), ``h = [nx | h]``
    when ``sep``, ``FFN = Linear -> Dropout -> GELU -> Linear -> Dropout``;
    ``LayerNorm -> Linear`` predictor.  ``hidden`` is the total width
    (heads x head dim); ``dropout`` applies to the encoder and the FFNs, the
    remaining keyword arguments go to every NTConv.
    """

    def __init__(self, in_channels: int, out_channels: int, hidden: int, num_layers: int, heads: int = 1,
                 dropout: float = 0.0, directed: bool = False, sep: bool = False, **conv_kwargs):
        super().__init__()
        for name, value, low in (("in_channels", in_channels, 1), ("out_channels", out_channels, 1),
                                 ("hidden", hidden, 1), ("num_layers", num_layers, 0), ("heads", heads, 1)):
            _check_int(f"NT: {name}", value, low)
        _check_dropout("NT", dropout)
        self.in_channels, self.out_channels, self.hidden = in_channels, out_channels, hidden
        self.num_layers, self.heads, self.dropout = num_layers, heads, float(dropout)
        self.directed, self.sep = bool(directed), bool(sep)
        conv_cls = DirNT if directed else NTConv
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
        for block in (self.encoder, self.norms, *self.ffns, self.predictor, self.convs):
            for module in block:
                if hasattr(module, "reset_parameters"):
                    module.reset_parameters()

    def forward(self, x: torch.Tensor, graph, edge_attr: torch.Tensor | None = None) -> torch.Tensor:
        _check_x("NT", x, self.in_channels)
        csr = self._graphs("NT", graph, x.shape[0])
        x = self.encoder(x)
        for index in range(self.num_layers):
            x = self.block(index, x, csr, edge_attr)
        return self.predictor(x)

    def block(self, index: int, x: torch.Tensor, graph, edge_attr: torch.Tensor | None = None) -> torch.Tensor:
        """Residual block ``index`` on hidden features ``x`` (N, hidden): ``x + FFN([LayerNorm(x) |] conv(...))``.

        ``forward`` is ``predictor(block(L-1, ... block(0, encoder(x)) ...))``;
        layer-wise inference (``nt_kernels.apps.minibatch.layerwise_logits``)
        calls the blocks one at a time on node batches.
        """
        nx = self.norms[index](x)
        h = self.convs[index](nx, graph, edge_attr)
        if self.sep:
            h = torch.cat([nx, h], dim=-1)
        return x + self.ffns[index](h)

    def extra_repr(self) -> str:
        return (f"directed={self.directed}, sep={self.sep}, hidden={self.hidden}, "
                f"num_layers={self.num_layers}, dropout={self.dropout}")
