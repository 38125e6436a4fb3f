"""nt-kernels: padding-free kernels for Neighbourhood Transformers.

Exact softmax and Performer (FAVOR+) attention over CSR-packed neighbourhoods,
as torch.library ops with autograd, on CPU (C++) and CUDA (Triton + CUDA).
"""
import importlib.util

import torch  # noqa: F401  (loads libtorch before the extension)

HAS_TRITON = importlib.util.find_spec("triton") is not None

from nt_kernels import _C  # noqa: F401  (loads the torch.ops.nt_kernels registrations)
from nt_kernels.csr import NeighbourhoodCSR
from nt_kernels.ops import neighbourhood_attention, segment_performer_attention, segment_softmax_attention
from nt_kernels.performer import default_nb_features, orthogonal_random_features, switch_threshold

if HAS_TRITON:  # registers the Triton (CUDA) implementation of the exact kernel
    import nt_kernels.triton  # noqa: F401

__version__ = "0.1.0"

__all__ = [
    "NeighbourhoodCSR",
    "default_nb_features",
    "neighbourhood_attention",
    "orthogonal_random_features",
    "segment_performer_attention",
    "segment_softmax_attention",
    "switch_threshold",
]
