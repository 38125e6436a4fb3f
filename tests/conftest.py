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

Triton's interpreter re-patches ``triton.language`` at every call of a ``@triton.jit`` helper inside a
kernel (a scan of the language modules' members each time, about a fifth of an interpreter test), though
the launch has patched the same modules already (the kernel's, then each helper's the first time) and
nothing is unpatched until the launch returns.  :func:`_skip_repatching_inside_a_launch` leaves out those
repeats, and memoises its map from Triton to numpy dtypes (a pure function that rebuilds its table at
each of its hundreds of thousands of calls), so the interpreter computes exactly what it did; with a
Triton whose interpreter lacks the names it wraps, nothing changes.
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


INTERPRETER_ORIGINALS: list = []  # (owner, name, original) that _skip_repatching_inside_a_launch replaced


def _skip_repatching_inside_a_launch() -> None:
    import functools
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if patch_lang is None or scope_type is None or executor is None:
        return
    grid_call = executor.__call__
    patched = []  # per running launch: the language modules patched since it started
    seen = {}

    def languages(fn):
        if fn not in seen:
            seen[fn] = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        return seen[fn]

    def patch_once(fn):
        if patched and languages(fn) <= patched[-1]:
            return scope_type()  # every module fn sees is patched already, and stays so until the launch ends
        scope = patch_lang(fn)
        if patched:
            patched[-1] |= languages(fn)
        return scope

    def launch(self, *args, **kwargs):
        patched.append(set())
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            patched.pop()

    INTERPRETER_ORIGINALS.extend([(interpreter, "_patch_lang", patch_lang), (executor, "__call__", grid_call)])
    interpreter._patch_lang = patch_once
    executor.__call__ = launch

    np_dtype = getattr(interpreter, "_get_np_dtype", None)
    if np_dtype is not None:  # a pure map from Triton to numpy dtypes that rebuilds its table at each call
        element = functools.lru_cache(maxsize=None)(np_dtype)

        def np_dtype_of(tt_dtype):  # a block's numpy dtype is its element's
            base = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
            try:
                return element(base)
            except TypeError:  # not hashable
                return np_dtype(tt_dtype)

        INTERPRETER_ORIGINALS.append((interpreter, "_get_np_dtype", np_dtype))
        interpreter._get_np_dtype = np_dtype_of


if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        _skip_repatching_inside_a_launch()
    except ImportError:  # no triton: nothing is interpreted
        pass

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
