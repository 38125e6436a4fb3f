"""Test configuration.

Without a GPU, Triton kernels run under the interpreter: TRITON_INTERPRET must
be set before triton is first imported, so it is set here, before any test
module imports nt_kernels.  The real graphs are found through $NT_KERNELS_DATA
(set here to ../shared/data/heterophilous next to the checkout when unset).
"""
import os
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Real graphs: $NT_KERNELS_DATA, else the shared data folder next to the checkout.
os.environ.setdefault("NT_KERNELS_DATA", str(Path(__file__).resolve().parents[2] / "shared" / "data" / "heterophilous"))


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
