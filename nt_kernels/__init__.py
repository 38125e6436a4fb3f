"""nt-kernels: padding-free kernels for Neighbourhood Transformers.

Exact softmax and Performer (FAVOR+) attention over CSR-packed neighbourhoods,
as torch.library ops with autograd, on CPU (C++) and CUDA (Triton + CUDA).
The package layout and its one-way import arrows are in docs/design.md §0.

The pure-Python parts (``csr``, ``performer``, ``baselines``, ``data``) import
without the compiled extension ``nt_kernels._C``; the ops need it, and using
one without it raises an ImportError that says how to build it.  An extension
built for another torch raises :class:`TorchVersionError` here, at import,
naming both torch versions and the wheel to use.
"""
import torch  # noqa: F401  (loads libtorch before the extension)

from nt_kernels._extension import TorchVersionError, build_info
from nt_kernels.baselines.partition import Group, partition_by_area
from nt_kernels.csr import NeighbourhoodCSR
from nt_kernels.performer import default_nb_features, orthogonal_random_features, switch_threshold

__version__ = "0.1.0"  # the release; a build's version adds the tag of its torch and CUDA (below)
if build_info() is not None:
    __version__ = build_info().VERSION  # e.g. 0.1.0+pt213cpu (scripts/wheel_version.py)

_OPS = ("neighbourhood_attention", "ntconv", "segment_performer_attention", "segment_softmax_attention")

try:
    from nt_kernels.ops import neighbourhood_attention, ntconv, segment_performer_attention, segment_softmax_attention
except TorchVersionError:
    raise
except ImportError as _exc:
    if "nt_kernels._C" not in str(_exc):
        raise
    _EXTENSION_ERROR = _exc
else:
    _EXTENSION_ERROR = None
    from nt_kernels.backends import register_backends

    register_backends()


def __getattr__(name: str):
    if name in _OPS and _EXTENSION_ERROR is not None:
        raise ImportError(f"nt_kernels.{name}: {_EXTENSION_ERROR}") from _EXTENSION_ERROR
    raise AttributeError(f"module 'nt_kernels' has no attribute {name!r}")


__all__ = [
    "Group",
    "NeighbourhoodCSR",
    "TorchVersionError",
    "default_nb_features",
    "neighbourhood_attention",
    "ntconv",
    "orthogonal_random_features",
    "partition_by_area",
    "segment_performer_attention",
    "segment_softmax_attention",
    "switch_threshold",
]
