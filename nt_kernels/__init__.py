"""nt-kernels: padding-free kernels for Neighbourhood Transformers."""
import torch  # noqa: F401  (loads libtorch before the extension)

from nt_kernels import _C  # noqa: F401  (loads the torch.ops.nt_kernels registrations)
