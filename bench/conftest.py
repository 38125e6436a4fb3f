"""pytest-benchmark suites of the segment-attention backends (``pytest bench/ --benchmark-only``).

Not part of the default test run (``testpaths = ["tests"]``).  Choose what runs
with environment variables:

* ``NT_BENCH_GRAPHS``: comma list of ``minesweeper``, ``tolokers`` or
  ``synthetic-<paper dataset>@<scale>`` (default
  ``synthetic-minesweeper@0.25,synthetic-tolokers@0.05``);
* ``NT_BENCH_BACKENDS``: backend names or families, or ``all`` (default
  ``fused,by-size,partitioned-0.4,sequential,reference,pyg-pairs,flex,nested``);
* ``NT_BENCH_HEADS``, ``NT_BENCH_HEAD_DIM``, ``NT_BENCH_DTYPE``,
  ``NT_BENCH_DEVICE`` (default 4, 8, float32, cuda if available else cpu),
  ``NT_BENCH_ROUNDS`` (default 5);
* ``NT_BENCH_MEMORY_CAP_GB``: the memory cap (default: the CLI's
  ``--memory-cap-gb`` default, 10 GB, or half the bench device's memory, this
  machine's RAM on the CPU, if that is less).

The suites run in-process, so no address-space limit guards them as it guards
the CLI's workers: a backend whose memory estimate exceeds the cap (the
strategies' padded tensors, pyg-pairs' pairs, nested's padding to the longest
segment, flex's block mask; ``nt_kernels.bench.backends.skip_reason``) is
skipped with the estimate in the reason, as are backends that do not apply or
whose op is not built; a backend without a backward
on the device (``forward_only_reason``: FlexAttention on the CPU) runs its
forward on detached inputs and skips the forward+backward benchmark.
"""
from __future__ import annotations

import os
from functools import lru_cache

import pytest
import torch

from nt_kernels.bench import backends as bb
from nt_kernels.bench import measure as bm

DEFAULT_GRAPHS = "synthetic-minesweeper@0.25,synthetic-tolokers@0.05"
DEFAULT_BACKENDS = "fused,by-size,partitioned-0.4,sequential,reference,pyg-pairs,flex,nested"
INPUT_SETS = 3


def _env(name: str, default: str) -> str:
    return os.environ.get(name) or default


def default_memory_cap_gb(device: str) -> float:
    """The CLI's default cap, or half the device's memory (the machine's RAM on the CPU) if that is less."""
    from nt_kernels.bench.cli import DEFAULT_CAP_GB

    try:
        if torch.device(device).type == "cuda":
            total = torch.cuda.get_device_properties(torch.device(device)).total_memory
        else:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError, RuntimeError):  # no sysconf names here, no such device
        return DEFAULT_CAP_GB
    return min(DEFAULT_CAP_GB, total / 2e9)


def settings() -> dict:
    from nt_kernels.performer import default_nb_features, switch_threshold

    head_dim = int(_env("NT_BENCH_HEAD_DIM", "8"))
    m = default_nb_features(head_dim)
    device = _env("NT_BENCH_DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
    return {"heads": int(_env("NT_BENCH_HEADS", "4")), "head_dim": head_dim,
            "dtype": _env("NT_BENCH_DTYPE", "float32"), "device": device,
            "seed": 0, "nb_features": m, "threshold": switch_threshold(m, head_dim),
            "reference_max_edges": 20_000,
            "memory_cap_gb": float(_env("NT_BENCH_MEMORY_CAP_GB", str(default_memory_cap_gb(device))))}


@lru_cache(maxsize=None)
def context(graph: str) -> bb.Context:
    from nt_kernels.csr import NeighbourhoodCSR
    from nt_kernels.data import load_npz, synthetic_graph

    name, _, scale = graph.partition("@")
    if name.startswith("synthetic-"):
        data = synthetic_graph(name[len("synthetic-"):], scale=float(scale or 1.0))
    else:
        data = load_npz(name, undirected=True)
    csr = NeighbourhoodCSR.from_edge_index(data.edge_index, data.num_nodes)
    blob = {"rowptr": csr.rowptr, "perm": csr.perm, "receiver": csr.receiver, "num_nodes": csr.num_nodes,
            "max_degree": csr.max_degree}
    return bm.build_context(blob, settings())


@lru_cache(maxsize=None)
def input_sets(graph: str) -> list:
    ctx = context(graph)
    return [bm.make_inputs(ctx.num_edges, settings(), i) for i in range(INPUT_SETS)]


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        graphs = [g.strip() for g in _env("NT_BENCH_GRAPHS", DEFAULT_GRAPHS).split(",") if g.strip()]
        backends = bb.select_backends(_env("NT_BENCH_BACKENDS", DEFAULT_BACKENDS))
        cases = [(g, b) for g in graphs for b in backends]
        metafunc.parametrize("case", cases, indirect=True, ids=[f"{g}-{b.name}" for g, b in cases])


@pytest.fixture
def case(request):
    """(backend fn, context, rotating input sets) for one graph and backend, or a skip."""
    graph, backend = request.param
    ctx = context(graph)
    reason = bb.skip_reason(backend, ctx)
    if reason is None and backend.family == "fused":
        reason = bb.fused_unavailable(ctx.device)
    forward_only = bb.forward_only_reason(backend, ctx) if not reason else None
    if forward_only and request.function.__name__ == "test_forward_backward":
        reason = f"forward only: {forward_only}"
    if reason:
        pytest.skip(reason)
    fn = bb.prepare(backend, ctx)
    if forward_only:
        inner = fn

        def fn(q, k, v):
            return inner(q.detach(), k.detach(), v.detach())
    return fn, ctx, input_sets(graph)


@pytest.fixture
def rounds() -> int:
    return int(_env("NT_BENCH_ROUNDS", "5"))
