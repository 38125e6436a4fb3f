"""The streaming design of the fused NT layer's backward (issue 40, NT_KERNELS_NTCONV_RECOMPUTE=stream).

Under TRITON_INTERPRET=1 (conftest.py) on CPU tensors, through ntconv_op directly, on the graphs and runners of
tests/test_ntconv_triton.py: ntconv_stream's kernels (the forward's projection from o, the message gradient
from o storing dy, the input gradients storing z) with the split-K weight gradients.  float32 runs (the kernels
forced onto fp32 operands: they are dtype-generic, the op takes them for 16-bit parameters only) match the
float64 definition and the CPU fused op; bfloat16 runs keep the accuracy rule of tests/helpers.py.
"""
import pytest
import torch

from helpers import assert_close

pytest.importorskip("triton")

from nt_kernels.backends.triton import ntconv_op, ntconv_stream  # noqa: E402
from nt_kernels.backends.triton.ntconv_grad import (GRAD_CENTRE_B, GRAD_GATED_SUM, GRAD_MAX, GRAD_MEAN,  # noqa: E402
                                                    GRAD_SOFTMAX, GRAD_SUM)
from test_ntconv_triton import (AGGRS, THRESHOLD, Case, assert_matches_reference_and_cpu_op,  # noqa: E402
                                assert_nan_confined, make_graph, run_triton)
from test_ntconv_triton_bytes import WEIGHTS, low_precision_case, run_low_precision, run_triton_chunked  # noqa: E402

STREAM_KERNELS = ("project_stream", "dy_stream", "du_stream")
STREAMED = [AGGRS[0], AGGRS[1], AGGRS[5]]  # sum, mean, gated_sum: the message gradient's STREAM_MODES


def _spy(monkeypatch):
    """Record which of the op's per-row launchers run (the stream ones and the stored ones)."""
    calls = []
    for name in (*STREAM_KERNELS, "message_grad", "du_and_centre", "message_grad_split", "input_grad_split"):
        real = getattr(ntconv_op, name)
        monkeypatch.setattr(ntconv_op, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name)
                            or _real(*a, **kw))
    return calls


def _force_stream(monkeypatch):
    """The streaming design wherever its kernels apply to the layer, whatever the parameters' dtype (the op
    takes it for 16-bit parameters only: fp32 operands spill on the GPU, not under the interpreter)."""
    monkeypatch.setenv("NT_KERNELS_NTCONV_RECOMPUTE", "stream")
    monkeypatch.setattr(ntconv_op, "stream_width", lambda h, d, mode, size: ntconv_stream.stream_width(h, d, mode, 2))
    monkeypatch.setattr(ntconv_op, "du_stream_ok", lambda c, size, f: ntconv_stream.du_stream_ok(c, 2, f))


def test_where_the_stream_design_applies():
    """The message gradient and the projection: sum, mean and gated_sum (not max's tie keys, the centre
    softmax's two passes, or weighted_mean over receivers, whose kernel missed the register gate) up to 64
    padded channels, 16-bit parameters; the input gradients: C <= 64, 16-bit, no edge features."""
    width = ntconv_stream.stream_width
    assert width(2, 30, GRAD_GATED_SUM, 2) == width(2, 30, GRAD_SUM, 2) == width(4, 16, GRAD_MEAN, 2) == 64
    assert width(2, 4, GRAD_SUM, 2) == 16
    assert not any(width(2, 30, mode, 2) for mode in (GRAD_MAX, GRAD_SOFTMAX, GRAD_CENTRE_B))
    assert not width(2, 30, GRAD_GATED_SUM, 4) and not width(8, 16, GRAD_SUM, 2) and not width(1, 130, GRAD_SUM, 2)
    ok = ntconv_stream.du_stream_ok
    assert ok(60, 2, 0) and ok(64, 2, 0)
    assert not ok(65, 2, 0) and not ok(60, 4, 0) and not ok(60, 2, 3)
    assert ntconv_stream.stream_tiles(30) == (16, 32) and ntconv_stream.stream_tiles(4) == (16, 16)


@pytest.mark.parametrize("design", [None, "0", "1", "stream"], ids=["default", "stored", "recompute", "stream"])
def test_each_backward_design_runs_its_kernels(design, monkeypatch):
    """By default (as NT_KERNELS_NTCONV_RECOMPUTE=stream) the streaming kernels (gated_sum in bf16 without edge
    features: all three); =0 the stored path; =1 the one-pass kernels; each within the accuracy rule."""
    calls = _spy(monkeypatch)
    if design is None:
        monkeypatch.delenv("NT_KERNELS_NTCONV_RECOMPUTE", raising=False)
    else:
        monkeypatch.setenv("NT_KERNELS_NTCONV_RECOMPUTE", design)
    case = low_precision_case("gated_sum", autocast=False)
    case.tensors["edge_attr"] = case.tensors["w_edge"] = None
    run_low_precision(case, autocast=False, aggr="gated_sum", gate_group="receiver", threshold=THRESHOLD,
                      dropout=0.2, seed=6)
    assert set(calls) == {"0": {"message_grad", "du_and_centre"}, "1": {"message_grad_split", "input_grad_split"},
                          "stream": set(STREAM_KERNELS), None: set(STREAM_KERNELS)}[design]


def test_an_unknown_design_is_an_error(monkeypatch):
    monkeypatch.setenv("NT_KERNELS_NTCONV_RECOMPUTE", "fast")
    case = Case(*make_graph(), "sum")
    with pytest.raises(ValueError, match="NT_KERNELS_NTCONV_RECOMPUTE"):
        run_triton(case, aggr="sum", gate_group="receiver", threshold=THRESHOLD, dropout=0.0, seed=0)


def stream_float32_accuracy(aggr, gate_group, edges, monkeypatch):
    """The streaming kernels on fp32 operands (forced), dropout, Performer neighbourhoods, 12-row chunks (a
    14-row neighbourhood across chunks): output and all eight gradients against the float64 definition and the
    CPU op, weight gradients bitwise equal on a rerun; returns the per-row launchers that ran (also the mutation
    harness's accuracy test of the design, tests/test_mutants.py)."""
    _force_stream(monkeypatch)
    calls = _spy(monkeypatch)
    case = Case(*make_graph(), aggr, edge_attr=edges)
    kw = dict(aggr=aggr, gate_group=gate_group, threshold=THRESHOLD, dropout=0.3, seed=5)
    result = run_triton(case, **kw)
    ran = set(calls)
    assert_matches_reference_and_cpu_op(case, result, **kw)
    again = run_triton(case, **kw)[3]
    for name in WEIGHTS:
        if name in result[3]:
            assert torch.equal(result[3][name], again[name]), name
    return ran


@pytest.mark.parametrize("edges", [False, True], ids=["no-edge-features", "edge-features"])
@pytest.mark.parametrize("aggr, gate_group", [*STREAMED, AGGRS[3]])
def test_stream_kernels_float32_match_reference_and_cpu_op(aggr, gate_group, edges, monkeypatch):
    """stream_float32_accuracy; weighted_mean over receivers keeps the stored message gradient, edge features
    the stored input gradients, the other kernels of the design run."""
    want = {"du_stream"} if not edges else {"du_and_centre"}
    want |= {"message_grad"} if aggr == "weighted_mean" else {"project_stream", "dy_stream"}
    assert stream_float32_accuracy(aggr, gate_group, edges, monkeypatch) == want


def test_stream_message_gradient_of_weighted_mean_over_receivers(monkeypatch):
    """weighted_mean over receivers is out of STREAM_MODES (its kernel took 126 registers: ptxas spills under
    the cap of 96), but the kernel serves it: forced in, float32 against the float64 definition and the CPU op."""
    monkeypatch.setattr(ntconv_stream, "STREAM_MODES", (*ntconv_stream.STREAM_MODES, GRAD_SOFTMAX))
    ran = stream_float32_accuracy("weighted_mean", "receiver", False, monkeypatch)
    assert ran == set(STREAM_KERNELS)


@pytest.mark.parametrize("aggr, gate_group", [AGGRS[1], AGGRS[5]])
def test_stream_over_several_programs_and_tiles(aggr, gate_group, monkeypatch):
    """One 150-row chunk over programs of 32 rows (STREAM_ROWS patched: five programs, two 16-row tiles each,
    the last one ragged; segments of 40 and 50 rows across programs): float32 against the float64 definition and
    the CPU op, and against the stored path within the float32 tolerance."""
    case = Case(*make_graph([40, 3, 30, 1, 0, 50, 2, 24], receivers=6, seed=4), aggr, edge_attr=False)
    kw = dict(aggr=aggr, gate_group=gate_group, threshold=64, dropout=0.1, seed=8)
    monkeypatch.setattr(ntconv_stream, "STREAM_ROWS", 32)
    _force_stream(monkeypatch)
    calls = _spy(monkeypatch)
    stream = run_triton(case, chunk_rows=4096, **kw)
    assert set(calls) == set(STREAM_KERNELS)
    assert_matches_reference_and_cpu_op(case, stream, **kw)
    monkeypatch.setenv("NT_KERNELS_NTCONV_RECOMPUTE", "0")
    stored = run_triton(case, chunk_rows=4096, **kw)
    assert_close(stream[0], stored[0], "output: stream against stored")
    for name, grad in stream[3].items():
        assert_close(grad, stored[3][name], f"{name}: stream against stored")


@pytest.mark.parametrize("edges", [False, True], ids=["no-edge-features", "edge-features"])
@pytest.mark.parametrize("aggr, gate_group", AGGRS)
def test_stream_design_bf16_every_aggregator(aggr, gate_group, edges, monkeypatch):
    """bfloat16 throughout, dropout, Performer neighbourhoods, 48-row chunks, NT_KERNELS_NTCONV_RECOMPUTE=stream:
    output and every gradient within the accuracy rule (the modes without a streaming kernel on the stored one)."""
    monkeypatch.setenv("NT_KERNELS_NTCONV_RECOMPUTE", "stream")
    case = low_precision_case(aggr, autocast=False)
    if not edges:
        case.tensors["edge_attr"] = case.tensors["w_edge"] = None
    run_low_precision(case, autocast=False, run=run_triton_chunked, aggr=aggr, gate_group=gate_group,
                      threshold=THRESHOLD, dropout=0.2, seed=6)


def test_stream_design_under_autocast_dtypes(monkeypatch):
    """float32 node terms with bfloat16 parameters (what autocast passes), gated_sum without edge features: the
    three streaming kernels run, the result keeps the accuracy rule and the weight gradients rerun bitwise."""
    monkeypatch.setenv("NT_KERNELS_NTCONV_RECOMPUTE", "stream")
    calls = _spy(monkeypatch)
    case = low_precision_case("gated_sum", autocast=True)
    case.tensors["edge_attr"] = case.tensors["w_edge"] = None
    kw = dict(aggr="gated_sum", gate_group="receiver", threshold=THRESHOLD, dropout=0.3, seed=8)
    first = run_low_precision(case, autocast=True, run=run_triton_chunked, **kw)[3]
    assert set(calls) == set(STREAM_KERNELS)
    again = run_triton_chunked(case, dtype=torch.float32, param_dtype=torch.bfloat16, **kw)[3]
    for name in first:
        if name in WEIGHTS:
            assert torch.equal(first[name], again[name]), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_stream_nan_gradient_stays_in_its_neighbourhood(dtype, monkeypatch):
    """A NaN in centre 6's node term (a 6-row Performer neighbourhood) makes d_centre[6] NaN and leaves d_centre
    of every other centre, and d_receiver_term of every receiver outside that neighbourhood, as in the clean
    run (the streaming input gradients, then the segment and receiver reductions of du)."""
    _force_stream(monkeypatch)
    case = Case(*make_graph(), "gated_sum", edge_attr=False)
    kw = dict(aggr="gated_sum", gate_group="receiver", threshold=THRESHOLD, dropout=0.0, seed=0, dtype=dtype)
    clean = run_triton(case, **kw)[3]
    case.tensors["centre"] = case.tensors["centre"].clone()
    case.tensors["centre"][6, 1] = float("nan")
    assert_nan_confined(case, run_triton(case, **kw)[3], clean, 6, whole_row=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_stream_same_seed_is_bitwise_reproducible(dtype, monkeypatch):
    """The streaming design (forced in fp32) reruns bitwise and another seed differs."""
    _force_stream(monkeypatch)
    case = Case(*make_graph(), "gated_sum", edge_attr=False)
    kw = dict(aggr="gated_sum", gate_group="receiver", threshold=THRESHOLD, dropout=0.3, dtype=dtype)
    a = run_triton(case, seed=3, **kw)
    b = run_triton(case, seed=3, **kw)
    assert torch.equal(a[0], b[0]) and all(torch.equal(a[3][n], b[3][n]) for n in a[3])
    assert not torch.equal(run_triton(case, seed=4, backward=False, **kw)[0], a[0])


# ---------------------------------------------------------------- occupancy gates of the compile checks
@pytest.mark.parametrize("registers, shared_kb, warps, ctas, limit", [
    (255, 58.4, 8, 1, "registers"),  # _input_grad_split_kernel
    (101, 41.1, 16, 1, "registers"),  # _message_grad_split_kernel
    (72, 16.4, 4, 7, "registers"),  # _prologue_kernel
    (116, 33.3, 8, 2, "registers"),  # nt_kernels::row_kernel
    (152, 8.2, 4, 3, "registers"),  # _fwd_multi_kernel
    (119, 12.3, 4, 4, "registers"),  # _bwd_dq_kernel
    (94, 8.2, 8, 2, "registers"),  # _reduce_kernel
    (40, 10.2, 8, 6, "registers"),  # _message_grad_kernel
    (255, 12.3, 4, 2, "registers"),  # _du_kernel
    (168, 188.6, 12, 1, "registers"),  # cuBLAS's nvjet GEMM (its shared memory allows 1 as well)
])
def test_occupancy_matches_the_h200_profile(registers, shared_kb, warps, ctas, limit):
    """nt_kernels.backends.triton.occupancy gives the CTAs per SM, and the limiting resource, that ncu reported
    for the kernels of the first H200 profile (docs/runs/h200-2026-11-27b-ncu.md, "limit: registers")."""
    from nt_kernels.backends.triton.occupancy import occupancy

    occ = occupancy(90, registers, int(shared_kb * 1024), warps)
    assert (occ.ctas, occ.warps) == (ctas, ctas * warps)
    assert occ.limit == limit or occ.ctas == 1


def test_occupancy_gates():
    """sm_90 only: spills fail; fewer than 8 resident warps fail a kernel with tl.dot, fewer than 16 one without;
    a streaming kernel fails above 96 registers or under 4 CTAs of 4 warps."""
    from nt_kernels.backends.triton.occupancy import gate

    assert gate(90, 255, 0, 58 * 1024, 8, True) == []  # 1 CTA of 8 warps with tl.dot: 8 warps
    assert gate(90, 255, 0, 1024, 8, False)  # ... without: under 16
    assert gate(90, 96, 0, 34 * 1024, 4, True, streaming=True) == []  # 5 CTAs of 4 warps
    assert any("registers" in g for g in gate(90, 97, 0, 34 * 1024, 4, True, streaming=True))
    assert gate(90, 64, 0, 1024, 8, True, streaming=True)  # CTAs of 8 warps
    assert gate(90, 64, 40, 1024, 4, True) and gate(89, 255, 40, 1024, 8, False) == []
