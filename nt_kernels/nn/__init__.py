"""NT layers and models (DESIGN §6, docs/nn.md).

* :mod:`nt_kernels.nn.conv`: :class:`NTConv` and :class:`DirNT`;
* :mod:`nt_kernels.nn.model`: the :class:`NT` network;
* :mod:`nt_kernels.nn.star`: :class:`NTStar` (NT*: Polynormer with NT layers as its local module);
* :mod:`nt_kernels.nn.aggregate`: receiver-side aggregation and the receiver / reversed CSRs;
* :mod:`nt_kernels.nn.adjacency`: sparse adjacency inputs (PyG's ``adj_t``: row = receiver).
"""
from nt_kernels.nn.aggregate import AGGREGATORS, GATE_GROUPS, GATED_AGGREGATORS
from nt_kernels.nn.conv import ATTENTIONS, BACKENDS, DirNT, NTConv
from nt_kernels.nn.model import NT
from nt_kernels.nn.star import NTStar

__all__ = ["AGGREGATORS", "ATTENTIONS", "BACKENDS", "GATED_AGGREGATORS", "GATE_GROUPS", "DirNT", "NT", "NTConv",
           "NTStar"]
