"""The paper's baselines, importable by benchmarks and users alike.

* :mod:`nt_kernels.baselines.partition`: Algorithm 1 (partition by size, then
  by area; plain Python on the size histogram) and its :class:`Group`;
* :mod:`nt_kernels.baselines.strategies`: the padded, sequential and
  partitioned neighbourhood-processing strategies, autograd-capable, built on
  the reference feature maps of :mod:`nt_reference.ops`.

Nothing here needs the compiled extension.
"""
from nt_kernels.baselines.partition import Group, partition_by_area
from nt_kernels.baselines.strategies import padded, padded_layout, partitioned, sequential

__all__ = ["Group", "padded", "padded_layout", "partition_by_area", "partitioned", "sequential"]
