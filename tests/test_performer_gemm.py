"""``performer-gemm`` (nt_kernels/backends/performer_gemm.py): the Performer in library GEMMs, the
yardstick of the CUDA Performer kernels (issue 39), against the loop reference on CPU.

Both of its modes run here: ``bmm`` over padded chunks (every dtype, float64 included) and
``grouped`` (``torch._grouped_mm``, float32 / bfloat16 / float16; not taken by make_plan: torch runs it
with float32 output as a host loop over the groups).  Forward and all three gradients: float64 and float32 to their rounding, bfloat16
and float16 under the project's accuracy rule (tests/test_performer_cuda.py)."""
import math

import pytest
import torch

from nt_kernels.bench import backends as bb
from nt_kernels.bench.context import Backend, Context
from nt_kernels.backends.performer_gemm import GemmPlan, performer_gemm, pow2_scale
from nt_kernels.csr import NeighbourhoodCSR
from test_performer_cuda import CPU_SIZES, DTYPES, EPS, assert_within_twice_baseline, cast, make_case, \
    reference_fwd_bwd

MODES = {"float64": ["bmm"], "float32": ["bmm", "grouped"], "bfloat16": ["bmm", "grouped"],
         "float16": ["bmm", "grouped"]}
CASES = [(dtype, mode) for dtype, modes in MODES.items() for mode in modes]


def gemm_fwd_bwd(mode):
    def run(q, k, v, rowptr, projection, grad_o):
        plan = GemmPlan(rowptr, q.shape[1], mode=mode)
        q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
        o = performer_gemm(q, k, v, plan, projection, EPS)
        return (o.detach(), *torch.autograd.grad(o, (q, k, v), grad_o))
    return run


@pytest.mark.parametrize("dim, m", [(1, 1), (8, 16), (9, 19), (30, 102)])
@pytest.mark.parametrize("dtype, mode", CASES, ids=[f"{d}-{m}" for d, m in CASES])
def test_forward_and_gradients_match_the_reference(dtype, mode, dim, m):
    """Segments of 0, 1, ..., 257 and 513 rows (chunk edges), two heads."""
    case = make_case(CPU_SIZES, dim, m=m, device="cpu")
    if dtype in ("float64", "float32"):
        got = gemm_fwd_bwd(mode)(*cast(case, DTYPES.get(dtype, torch.float64)))
        want = reference_fwd_bwd(*case)
        tol = 1e-12 if dtype == "float64" else 2e-5
        for name, a, b in zip(["o", "dq", "dk", "dv"], got, want):
            scale = max(b.abs().max().item(), 1e-300)
            err = (a.double() - b).abs().max().item()
            if name == "dq" and m == 1:  # identically zero: rounding noise against the other results
                scale = max(t.abs().max().item() for t in want)
            assert err <= tol * scale, f"{name} ({dtype}, {mode}): {err:.3e} > {tol:.0e} x {scale:.3e}"
        return
    assert_within_twice_baseline(case, DTYPES[dtype], f"performer-gemm {mode}, D={dim}, m={m}",
                                 run=gemm_fwd_bwd(mode))


@pytest.mark.parametrize("mode", ["bmm", "grouped"])
def test_large_gradients_stay_finite_in_float16(mode):
    """grad_o x 4096 puts G' past float16's range unless scaled per row, as the kernels do."""
    case = make_case(CPU_SIZES, 23, m=72, device="cpu")
    case[5] = case[5] * 2.0 ** 12
    assert_within_twice_baseline(case, torch.float16, f"performer-gemm {mode}, grad x 4096", run=gemm_fwd_bwd(mode))


@pytest.mark.parametrize("mode", ["bmm", "grouped"])
def test_deterministic_and_nan_stays_in_its_segment_head(mode):
    q, k, v, rowptr, projection, grad_o = cast(make_case(CPU_SIZES, 8, device="cpu"), torch.float32)
    first = gemm_fwd_bwd(mode)(q, k, v, rowptr, projection, grad_o)
    second = gemm_fwd_bwd(mode)(q, k, v, rowptr, projection, grad_o)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    seg = CPU_SIZES.index(513)
    start, end = int(rowptr[seg]), int(rowptr[seg + 1])
    k_nan = k.clone()
    k_nan[start + 300, 1, 2] = math.nan
    o = gemm_fwd_bwd(mode)(q, k_nan, v, rowptr, projection, grad_o)[0]
    assert torch.isnan(o[start:end, 1]).all()
    assert torch.equal(o[start:end, 0], first[0][start:end, 0])
    outside = torch.ones(q.shape[0], dtype=torch.bool)
    outside[start:end] = False
    assert torch.equal(o[outside], first[0][outside])


def test_plan_chunks_cover_every_row_once():
    rowptr = torch.tensor([0] + CPU_SIZES).cumsum(0)
    plan = GemmPlan(rowptr, 3, mode="bmm", chunk=64)
    rows = plan.chunk_rows.flatten()
    real = rows[rows < plan.heads * plan.rows]
    assert torch.equal(real.sort().values, torch.arange(plan.heads * plan.rows))
    assert plan.max_chunks == -(-max(CPU_SIZES) // 64)
    grouped = GemmPlan(rowptr, 3, mode="grouped")
    assert sum(g1 - g0 for g0, g1, *_ in grouped.calls) == 3 * len(CPU_SIZES)
    assert all(int(offs[-1]) == r1 - r0 for _, _, r0, r1, offs in grouped.calls)


def test_plan_splits_calls_at_the_group_limit(monkeypatch):
    import nt_kernels.backends.performer_gemm as pg

    monkeypatch.setattr(pg, "MAX_GROUPS", 4)
    case = make_case(CPU_SIZES, 8, device="cpu")
    plan = GemmPlan(case[3], 2, mode="grouped")
    assert [g1 - g0 for g0, g1, *_ in plan.calls] == [4, 4, 4, 4, 4]
    got = gemm_fwd_bwd("grouped")(*cast(case, torch.float32))
    want = reference_fwd_bwd(*case)
    for a, b in zip(got, want):
        assert (a.double() - b).abs().max() <= 2e-5 * b.abs().max()


def test_pow2_scale():
    x = torch.tensor([1.0, 0.75, 3.0, 0.0, -2.0, math.inf, math.nan])
    assert torch.equal(pow2_scale(x), torch.tensor([0.5, 1.0, 0.25, 1.0, 1.0, 1.0, 1.0]))


def test_bad_mode_and_shapes_are_rejected():
    rowptr = torch.tensor([0, 3])
    with pytest.raises(ValueError, match="performer-gemm: mode must be 'grouped' or 'bmm', got 'dense'"):
        GemmPlan(rowptr, 1, mode="dense")
    plan = GemmPlan(rowptr, 2, mode="grouped")
    q = torch.zeros(3, 2, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="grouped mode takes"):
        performer_gemm(q, q, q, plan, torch.zeros(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"q has \(3, 1\) rows and heads, the plan \(3, 2\)"):
        performer_gemm(q[:, :1].float(), q[:, :1].float(), q[:, :1].float(), plan, torch.zeros(2, 4))


def _context(sizes, dtype=torch.float32, threshold=10.0):
    rowptr = torch.tensor([0] + sizes).cumsum(0)
    perm = torch.arange(int(rowptr[-1]))
    receiver = torch.zeros_like(perm)
    csr = NeighbourhoodCSR(rowptr, perm, receiver, len(sizes), max(sizes))
    projection = make_case([1], 8, device="cpu")[4].to(dtype)
    return Context(csr=csr, projection=projection, threshold=threshold, heads=2, head_dim=8, dtype=dtype,
                   device=torch.device("cpu"), reference_max_edges=10**6, memory_cap_bytes=10**12)


def test_bench_backend_matches_the_reference_and_says_where_it_cannot_run():
    backend = bb.select_backends("performer-gemm")[0]
    assert backend == Backend("performer-gemm", "performer-gemm") and backend.semantics == "switch"
    ctx = _context([0, 40, 300, 13])
    assert bb.skip_reason(backend, ctx) is None
    fn = bb.prepare(backend, ctx)
    q, k, v = (torch.randn(353, 2, 8) for _ in range(3))
    want = reference_fwd_bwd(q.double(), k.double(), v.double(), ctx.csr.rowptr, ctx.projection.double(),
                             torch.ones(353, 2, 8, dtype=torch.float64))[0]
    assert (fn(q, k, v).double() - want).abs().max() <= 1e-5 * want.abs().max()
    assert bb.skip_reason(backend, _context([0, 4, 300])).startswith("n/a: graph has exact-path segments")
    exact = _context([40, 300], threshold=math.inf)
    assert bb.skip_reason(backend, exact) == "n/a: exact mode (Performer-only backend)"
    for name in ("performer-simt", "performer-tc", "performer-flash"):
        assert bb.skip_reason(bb.select_backends(name)[0], ctx).startswith("n/a: the CUDA Performer kernels")
