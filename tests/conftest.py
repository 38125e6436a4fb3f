"""Test configuration.

Without a GPU, Triton kernels run under the interpreter: TRITON_INTERPRET must
be set before triton is first imported, so it is set here, before any test
module imports nt_kernels.  The real graphs are found through $NT_KERNELS_DATA
(set here to ../shared/data/heterophilous next to the checkout when unset).

torch's Inductor reuses CPU kernels it cached under another
ATEN_CPU_CAPABILITY (seen with torch 2.13 on an AVX-512 CPU: FlexAttention
compiled under the default capability gave wrong results and then a
segmentation fault when the suite reran under ATEN_CPU_CAPABILITY=avx2), so,
unless TORCHINDUCTOR_CACHE_DIR is set, the tests keep one Inductor cache per
capability (docs/design.md §9, "Max ties").

Under pytest-xdist (``make test``) the workers share the cores: each takes cores / workers intra-op
threads (one on the 2-core machine), and its subprocesses inherit that through OMP_NUM_THREADS
unless they set their own.  With torch's default (every core per process) two workers' OpenMP
threads spun against each other: the flash model's tests, which run thousands of small products,
took 20-70 s each instead of 1 s.  Tests of the threaded paths set their thread counts themselves
(tests/test_cpu_kernels.py).
"""
import getpass
import os
import tempfile
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    _THREADS = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))
    torch.set_num_threads(_THREADS)
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{torch.backends.cpu.get_cpu_capability().lower()}"))
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


def pytest_terminal_summary(terminalreporter):
    """The count of the mutation harness (tests/test_mutants.py): faults injected and caught."""
    caught = injected = 0
    seconds = 0.0
    for report in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", []):
        props = dict(getattr(report, "user_properties", ()))
        if getattr(report, "when", "") == "call" and "mutants_injected" in props:
            caught += props["mutants_caught"]
            injected += props["mutants_injected"]
            seconds += props["mutants_seconds"]
    if injected:
        terminalreporter.write_line(f"mutation harness (tests/test_mutants.py): {caught} of {injected} injected faults "
                                    f"caught, {seconds:.0f} s")
