"""Test configuration.

Without a GPU, Triton kernels run under the interpreter: TRITON_INTERPRET must
be set before triton is first imported, so it is set here, before any test
module imports nt_kernels.
"""
import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
