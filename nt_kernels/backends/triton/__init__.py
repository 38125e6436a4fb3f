"""Triton kernels: exact softmax attention over CSR segments (flash-style, varlen).

Importing this package registers the CUDA kernels of
``nt_kernels::softmax_fwd_into`` / ``softmax_bwd_into`` and the standalone
``nt_kernels::triton_segment_softmax`` triton_op.  On a machine without a GPU
set ``TRITON_INTERPRET=1`` before triton is first imported to run the kernels
on CPU tensors.
"""
from nt_kernels.triton.ops import segment_softmax, softmax_bwd_into, softmax_fwd_into
from nt_kernels.triton.schedule import PLAN_BLOCK, TILE_HEIGHTS, build_plan, describe_plan, max_packed_tile

__all__ = [
    "PLAN_BLOCK",
    "TILE_HEIGHTS",
    "build_plan",
    "describe_plan",
    "max_packed_tile",
    "segment_softmax",
    "softmax_bwd_into",
    "softmax_fwd_into",
]
