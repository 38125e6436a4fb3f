"""``NT_KERNELS_PERFORMER=gemm`` (issue 39): the Performer segments of the public attention ops and of the
fused layer's CUDA path run through ``performer-gemm`` (nt_kernels/backends/performer_gemm.py), the
library-GEMM yardstick, so that a GPU run A/Bs the hand-written kernels against it at op and layer level.

Every test spies on ``performer_gemm`` (the switch is seen to route there) and checks the forward and
every gradient against the reference or the default path, so a zeroed or misplaced Performer output
fails.  The fused layer's Triton path runs under the interpreter here (tests/test_ntconv_triton.py)."""
import pytest
import torch

import nt_kernels as nk
import nt_kernels.backends.performer_gemm as pg
from nt_kernels import NeighbourhoodCSR
from test_performer_cuda import CPU_SIZES, EPS, assert_within_twice_baseline, make_case, reference_fwd_bwd


@pytest.fixture
def gemm_calls(monkeypatch):
    """NT_KERNELS_PERFORMER=gemm, and the rows of every forward of performer-gemm run under it."""
    calls, real = [], pg._forward

    def spy(q, *args, **kwargs):
        calls.append(q.shape[0])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(pg, "_forward", spy)
    monkeypatch.setenv("NT_KERNELS_PERFORMER", "gemm")
    return calls


def public_fwd_bwd(q, k, v, rowptr, projection, grad_o):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = nk.segment_performer_attention(q, k, v, rowptr, projection, eps=EPS)
    return (o.detach(), *torch.autograd.grad(o, (q, k, v), grad_o))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp64", "fp32", "bf16", "fp16"])
def test_public_performer_op_runs_the_gemm_composition(dtype, gemm_calls):
    """segment_performer_attention on a raw row pointer (segments of 0 to 513 rows): forward and all three
    gradients against the loop reference (float64 / float32 to rounding, 16-bit under the accuracy rule)."""
    case = make_case(CPU_SIZES, 9, m=19, device="cpu")
    if dtype in (torch.float64, torch.float32):
        got = public_fwd_bwd(*[t.to(dtype) if t.is_floating_point() else t for t in case])
        tol = 1e-12 if dtype == torch.float64 else 2e-5
        for name, a, b in zip(["o", "dq", "dk", "dv"], got, reference_fwd_bwd(*case)):
            assert a.dtype == dtype
            assert (a.double() - b).abs().max() <= tol * b.abs().max(), name
    else:
        assert_within_twice_baseline(case, dtype, "NT_KERNELS_PERFORMER=gemm", run=public_fwd_bwd)
    assert gemm_calls and all(rows == sum(CPU_SIZES) for rows in gemm_calls)


def _mixed_case():
    """A graph whose segments straddle the threshold (exact and Performer), float64, with its CSR."""
    sizes = [0, 1, 3, 4, 5, 9, 2, 17, 0, 6, 40]
    centre = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    csr = NeighbourhoodCSR.from_edge_index(torch.stack([centre, torch.zeros_like(centre)]), len(sizes))
    q, k, v, _, projection, grad_o = make_case(sizes, 6, m=8, device="cpu")
    return csr, (q, k, v), projection, grad_o


def _neighbourhood(csr, qkv, projection, grad_o):
    q, k, v = (t.detach().clone().requires_grad_() for t in qkv)
    o = nk.neighbourhood_attention(q, k, v, csr, projection=projection, threshold=5, eps=EPS)
    return (o.detach(), *torch.autograd.grad(o, (q, k, v), grad_o))


def test_neighbourhood_attention_keeps_the_exact_path_and_caches_the_rows(gemm_calls, monkeypatch):
    """Exact segments (<= 5 rows) through the op, Performer ones through performer-gemm: everything equals
    the default path (the C++ kernels) in float64; the Performer rows are built once per CSR."""
    csr, qkv, projection, grad_o = _mixed_case()
    got = _neighbourhood(csr, qkv, projection, grad_o)
    again = _neighbourhood(csr, qkv, projection, grad_o)
    assert gemm_calls == [9 + 17 + 6 + 40] * 2
    assert sum(key[0] == "performer-gemm" for key in csr._plans) == 1
    monkeypatch.delenv("NT_KERNELS_PERFORMER")
    want = _neighbourhood(csr, qkv, projection, grad_o)
    assert len(gemm_calls) == 2
    for name, a, b, c in zip(["o", "dq", "dk", "dv"], got, again, want):
        assert torch.equal(a, b), name
        assert (a - c).abs().max() <= 1e-12 * c.abs().max(), name


def test_without_performer_segments_nothing_routes(gemm_calls):
    csr, (q, k, v), _, _ = _mixed_case()
    o = nk.neighbourhood_attention(q, k, v, csr)
    assert not gemm_calls and torch.isfinite(o).all()


def test_fused_layer_triton_path_runs_the_gemm_composition(gemm_calls):
    """The fused layer's CUDA implementation (Triton kernels, the interpreter here): the Performer rows of
    every chunk through performer-gemm in its forward and in the backward's recompute; output and all
    eight gradients against the float64 definition."""
    ntt = pytest.importorskip("test_ntconv_triton")
    case = ntt.Case(*ntt.make_graph(), "gated_sum")
    ntt.assert_float32_matches(case, aggr="gated_sum", gate_group="receiver", threshold=ntt.THRESHOLD,
                               dropout=0.3, seed=11)
    performer_rows = sum(n for n in ntt.SIZES if n > ntt.THRESHOLD)
    # the forward, then the backward's recompute, whose kept state the Performer backward uses
    assert gemm_calls and sum(gemm_calls) == 2 * performer_rows


def test_segment_rows_pack_the_listed_segments_in_list_order():
    rowptr = torch.tensor([0, 2, 2, 5, 9])
    rows = pg.SegmentRows(rowptr, torch.tensor([3, 1, 0]), heads=2, dtype=torch.bfloat16)
    assert rows.rows.tolist() == [5, 6, 7, 8, 0, 1]
    assert rows.plan.rows == 6 and rows.plan.heads == 2
    assert rows.plan.mode == "bmm"  # make_plan: cuBLAS batched GEMMs on every device (grouped: a host loop)


def test_backward_rows_recomputes_without_a_kept_state():
    """backward_rows with the forward's kept state and without it (recomputed) write the same gradients, at
    the listed rows only; the rows equal the composition's own autograd."""
    q, k, v, rowptr, projection, grad_o = make_case([3, 0, 7, 5], 4, m=6, device="cpu")
    rows = pg.SegmentRows(rowptr, torch.tensor([2, 0]), heads=q.shape[1], dtype=q.dtype)
    out, state = pg.recorded_rows(q, k, v, rows, projection, EPS, keep=True)
    kept, again = [[torch.full_like(q, 7.0) for _ in range(3)] for _ in range(2)]
    pg.backward_rows(*kept, grad_o, q, k, v, rows, projection, EPS, state)
    pg.backward_rows(*again, grad_o, q, k, v, rows, projection, EPS)
    leaves = [t[rows.rows].clone().requires_grad_() for t in (q, k, v)]
    o = pg.performer_gemm(*leaves, rows.plan, projection, EPS)
    want = torch.autograd.grad(o, leaves, grad_o[rows.rows])
    assert torch.equal(out, o.detach())
    others = torch.ones(q.shape[0], dtype=torch.bool)
    others[rows.rows] = False
    for a, b, w in zip(kept, again, want):
        assert torch.equal(a, b) and torch.equal(a[rows.rows], w) and (a[others] == 7.0).all()
