"""Test configuration.

Without a GPU, Triton kernels run under the interpreter: TRITON_INTERPRET must
be set before triton is first imported, so it is set here, before any test
module imports nt_kernels.
"""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def single_thread():
    """One intra-op thread for a test.

    The reference loops and the paper's strategies run thousands of tiny ops;
    on a loaded 2-core machine OpenMP hand-offs dominate them.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
