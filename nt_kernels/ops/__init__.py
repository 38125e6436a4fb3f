"""Public ops of nt-kernels: checks, defaults and plans over the ``torch.ops.nt_kernels`` ops.

* :mod:`nt_kernels.ops.attention`: the segment-attention functions, with the
  fake kernels and autograd of ``nt_kernels::attention_fwd`` / ``attention_bwd``;
* :mod:`nt_kernels.ops.ntconv`: the fused NT layer op :func:`ntconv`, with the
  fake kernels and autograd of ``nt_kernels::ntconv_fwd`` / ``ntconv_bwd``;
* :mod:`nt_kernels.ops._checks`: argument checks at the public boundary.

Importing this package needs the compiled extension ``nt_kernels._C``.
"""
from nt_kernels.ops.attention import neighbourhood_attention, segment_performer_attention, segment_softmax_attention
from nt_kernels.ops.ntconv import ntconv

__all__ = ["neighbourhood_attention", "ntconv", "segment_performer_attention", "segment_softmax_attention"]
