"""NT layers and model (DESIGN §6, docs/nn.md).

* :mod:`nt_kernels.nn.conv`: :class:`NTConv` and :class:`DirNT`;
* :mod:`nt_kernels.nn.model`: the :class:`NT` network;
* :mod:`nt_kernels.nn.aggregate`: receiver-side aggregation and the receiver / reversed CSRs.
"""
from nt_kernels.nn.aggregate import AGGREGATORS, GATE_GROUPS, GATED_AGGREGATORS
from nt_kernels.nn.conv import ATTENTIONS, BACKENDS, DirNT, NTConv
from nt_kernels.nn.model import NT

__all__ = ["AGGREGATORS", "ATTENTIONS", "BACKENDS", "GATED_AGGREGATORS", "GATE_GROUPS", "DirNT", "NT", "NTConv"]
