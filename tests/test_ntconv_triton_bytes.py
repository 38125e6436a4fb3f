"""Bytes of the fused NT layer on CUDA (issue 27): per-row intermediates in the parameters' dtype, do fused
into the message gradient, the 4-warp prologue and the split-K weight gradient with one tile per q, k, v part.

Under TRITON_INTERPRET=1 (conftest.py) on CPU tensors, through ntconv_op directly (as tests/test_ntconv_triton.py,
whose graphs and runners these tests reuse): the Triton stages run in the interpreter, the Performer stage on the
CPU C++ kernel.  Low precision follows the accuracy rule of tests/helpers.py against the float64 definition;
float32 runs match the float64 definition and the CPU fused op.
"""
import pytest
import torch

from helpers import assert_close

pytest.importorskip("triton")

from nt_kernels import NeighbourhoodCSR  # noqa: E402
from nt_kernels.backends.triton import ntconv_op  # noqa: E402
from nt_kernels.backends.triton.common import device_arch  # noqa: E402
from nt_kernels.backends.triton.ntconv_grad import SPLIT_MIN_ARCH, grad_tiles  # noqa: E402
from nt_kernels.backends.triton.ntconv_plan import prologue_tiles, weight_grad_tiles  # noqa: E402
from nt_kernels.csr import reversed_csr  # noqa: E402
from nt_kernels.nn.aggregate import receiver_csr  # noqa: E402
from test_ntconv_triton import (AGGRS, DEVICE, GRAD_NAMES, NODE_TENSORS, SIZES, THRESHOLD, Case,  # noqa: E402
                                _run_weight_grad, _weight_grad_case, assert_low_precision_result,
                                assert_matches_reference_and_cpu_op, make_graph, op_args,
                                reference, run_triton)

WEIGHTS = ("w_edge", "w_qkv", "b_qkv", "w_out", "b_out")
# The small graph three times over (Performer neighbourhoods of 6 and 14 rows above THRESHOLD, 48-row
# chunks: several per graph, the 14-row neighbourhoods in chunks of their own neighbours).
CHUNK_ROWS = 48


def low_precision_case(aggr, *, autocast, edge_index=None, num_nodes=None, csr=None):
    """A case whose inputs are exact in bfloat16: all of them (``autocast`` False) or the parameters only
    (``autocast``: float32 node terms and edge features, as the op gets them under torch.autocast)."""
    if edge_index is None:  # max: a receiver per message (near-ties would decide PyTorch's own error)
        edge_index, num_nodes = make_graph(SIZES * 3, receivers=None if aggr == "max" else 24)
    case = Case(edge_index, num_nodes, aggr)
    if csr is not None:
        case.csr, case.rcsr = csr, receiver_csr(csr, num_nodes)
    case.tensors = {n: None if t is None else t if autocast and n in NODE_TENSORS else t.to(torch.bfloat16).double()
                    for n, t in case.tensors.items()}
    case.projection = case.projection.to(torch.bfloat16).double()
    return case


def run_triton_chunked(case, *, dtype=torch.float32, param_dtype=None, chunk_rows=CHUNK_ROWS, **kw):
    """run_triton's (out, lse, stats, grads by name) with the plan built at ``chunk_rows`` rows per chunk on
    CUDA too.  run_triton passes chunk_rows only under the interpreter: on CUDA it calls the dispatcher, whose
    schema has no chunk_rows, so the op plans default_chunk_rows(C) (at least 1,024) rows per chunk, one chunk
    for the small graphs here.  This calls the op's implementation, the very functions the dispatcher runs on
    CUDA (ntconv_op.register), with its tests-only chunk_rows on every device."""
    args = op_args(case, dtype=dtype, param_dtype=param_dtype, **kw)
    out, lse, stats = ntconv_op.ntconv_fwd(*args, chunk_rows=chunk_rows)
    grads = ntconv_op.ntconv_bwd(case.grad_out.to(DEVICE, out.dtype), out, lse, stats, *args, [True, True, True],
                                 chunk_rows=chunk_rows)
    return out, lse, stats, {n: g for n, g in zip(GRAD_NAMES, grads) if case.tensors[n] is not None}


def planned_chunks(case, *, dtype, param_dtype, chunk_rows=CHUNK_ROWS, **kw) -> int:
    """How many chunks the op plans for ``case`` at ``chunk_rows`` rows per chunk."""
    args = op_args(case, dtype=dtype, param_dtype=param_dtype, **kw)
    return len(ntconv_op.problem("test", dict(zip(ntconv_op.ARG_NAMES, args), chunk_rows=chunk_rows)).plan.chunks)


def run_low_precision(case, *, autocast, run=run_triton, **kw):
    """The Triton op in bfloat16 (parameters; node terms too unless ``autocast``) and the accuracy rule
    for the output and every gradient; returns the op's result.  ``run``: run_triton (CHUNK_ROWS under the
    interpreter, the op's default chunks on CUDA) or run_triton_chunked (CHUNK_ROWS on every device)."""
    node_dtype = torch.float32 if autocast else torch.bfloat16
    result = run(case, dtype=node_dtype, param_dtype=torch.bfloat16, chunk_rows=CHUNK_ROWS, **kw)
    out, _, _, grads = result
    assert out.dtype == torch.bfloat16
    assert_low_precision_result(case, out, grads, torch.bfloat16, kw, autocast=autocast)
    return result


# ------------------------------------------------------------- tiles
def test_tiles_of_the_tolokers_layer():
    """C = 60, C_out = 120, H = 2, D = 30: the prologue takes 32 rows x 64 channels on 4 warps; the weight
    gradient one 64 x 64 tile per q, k, v part (no tile spans two parts) and two for w_out's 120 rows,
    4 warps; the message gradient fuses do (2 heads x 32 padded dims, 16 rows)."""
    t = prologue_tiles(60, 0)
    assert (t.block_r, t.block_c, t.block_n, t.num_warps) == (32, 64, 64, 4)
    w = weight_grad_tiles(1_038_000, 60, 60)
    assert (w.block_m, w.block_n, w.num_warps, w.splits) == (64, 64, 4, 507)
    assert weight_grad_tiles(1_038_000, 120, 60).block_m == 64
    g = grad_tiles(2, 30)
    assert g.fuse_do and (g.block_e, g.block_h, g.block_d, g.num_warps) == (16, 2, 32, 8)
    assert not grad_tiles(1, 130).fuse_do


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_weight_grad_of_three_parts_at_the_tolokers_width(dtype):
    """dW_qkv += [dq | dk | dv]ᵀ z at C = 60 (one 64-row tile per part, rows of 120 B in bf16) over 300
    rows = 5 split-K blocks: against the float64 product of the rounded operands, bitwise on a rerun."""
    args, w0, b0, (want_w, want_b) = _weight_grad_case("w_qkv", dtype, rows=300, channels=60)
    got_w, got_b = _run_weight_grad(args, w0, b0, "w_qkv", dtype)
    assert_close(got_w, want_w, "dW")
    assert_close(got_b, want_b, "db")
    again_w, again_b = _run_weight_grad(args, w0, b0, "w_qkv", dtype)
    assert torch.equal(got_w, again_w) and torch.equal(got_b, again_b)


def test_weight_grad_rejects_parts_that_are_not_row_blocks():
    from nt_kernels.backends.triton.ntconv_wgrad import weight_grad

    a, b = torch.zeros(3, 10, 4), torch.zeros(10, 4)
    with pytest.raises(ValueError, match="a_part"):
        weight_grad(torch.zeros(12, 4), None, a, b, rows=10, m=12, n=4, a_split=4, a_part=7, a_row=4, b_row=4,
                    dtype=torch.float32, dot_prec="ieee", bf16_emu=False)


# ------------------------------------------- intermediates in the parameters' dtype
def test_per_row_intermediates_are_in_the_autocast_dtype(monkeypatch):
    """Under autocast's dtypes (float32 node terms, bfloat16 parameters) every per-row buffer the backward
    writes is bfloat16, and on sm_90 (and the interpreter) it writes only do and du: the message gradient
    recomputes y from o and sums dW_out itself (no y, no dy), the input gradients recompute z and dz/du and
    sum dW_qkv with du and d_centre (no z, no dz/du), and the forward's y comes from the same tiles as the
    message gradient's (no row GEMM); elsewhere z, dz/du, y and dy are stored in bfloat16, do comes from the
    message gradient and du from the du kernel.  No row GEMM reads dy or dqkv, and the result keeps the
    accuracy rule.  Several chunks (CHUNK_ROWS) on every device, CUDA included (run_triton_chunked), so that
    one prologue per chunk and direction is what is counted."""
    monkeypatch.setenv("NT_KERNELS_NTCONV_RECOMPUTE", "1")
    seen = {}
    real = {name: getattr(ntconv_op, name) for name in ("prologue", "rows_gemm", "message_grad", "du_and_centre",
                                                          "message_grad_split", "input_grad_split")}
    c, c_out = case_channels = (8, 16)  # HEADS x DIM of the small graph; gated_sum: C_out = 2C
    products = {(c, c_out): "y", (3 * c, c): "du", (c_out, c): "do", (c, 3): "d_edge"}

    def prologue(qkv, z, jac, *args):
        seen.setdefault("prologue", []).append(None if jac is None else (z.dtype, jac.dtype))
        return real["prologue"](qkv, z, jac, *args)

    def rows_gemm(out, a, w, **kw):
        seen.setdefault("gemm", set()).add((products[kw["k"], kw["n"]], out.dtype))
        return real["rows_gemm"](out, a, w, **kw)

    def du_and_centre(du, *args):
        seen.setdefault("du_and_centre", set()).add(du.dtype)
        return real["du_and_centre"](du, *args)

    def input_grad_split(du, *args):
        seen.setdefault("input_grad_split", set()).add(du.dtype)
        return real["input_grad_split"](du, *args)

    def message_grad(dy, y, mode, p, *args, do=None, **kw):
        assert (p.channels, p.out_channels) == case_channels
        seen.setdefault("message_grad", set()).add((dy.dtype, y.dtype, None if do is None else do.dtype))
        return real["message_grad"](dy, y, mode, p, *args, do=do, **kw)

    def message_grad_split(do, o, *args):
        seen.setdefault("message_grad_split", set()).add((do.dtype, o.dtype))
        return real["message_grad_split"](do, o, *args)

    case = low_precision_case("gated_sum", autocast=True)
    kw = dict(aggr="gated_sum", gate_group="receiver", threshold=THRESHOLD, dropout=0.2, seed=6)
    chunks = planned_chunks(case, dtype=torch.float32, param_dtype=torch.bfloat16, **kw)
    assert chunks > 1
    for name, spy in [("prologue", prologue), ("rows_gemm", rows_gemm), ("message_grad", message_grad),
                      ("du_and_centre", du_and_centre), ("message_grad_split", message_grad_split),
                      ("input_grad_split", input_grad_split)]:
        monkeypatch.setattr(ntconv_op, name, spy)
    run_low_precision(case, autocast=True, run=run_triton_chunked, **kw)
    bf16 = torch.bfloat16
    # no row GEMM for do or du (on sm_90 none for y either: the forward's projection shares the message
    # gradient's tiles); d_edge in the edge features' float32
    # one prologue per chunk in the forward and one in the backward
    assert len(seen["prologue"]) == 2 * chunks
    if device_arch(DEVICE) >= SPLIT_MIN_ARCH:
        assert seen["gemm"] == {("d_edge", torch.float32)}
        assert "message_grad" not in seen and seen["message_grad_split"] == {(bf16, bf16)}
        assert seen["prologue"] == [None] * (2 * chunks)
        assert "du_and_centre" not in seen and seen["input_grad_split"] == {bf16}
    else:
        assert seen["gemm"] == {("y", bf16), ("d_edge", torch.float32)}
        assert "message_grad_split" not in seen and seen["message_grad"] == {(bf16, bf16, bf16)}
        assert seen["prologue"] == [None] * chunks + [(bf16, bf16)] * chunks
        assert "input_grad_split" not in seen and seen["du_and_centre"] == {bf16}


# --------------------------------------------------- bf16 against the accuracy rule
@pytest.mark.parametrize("recompute", ["0", "1"], ids=["stored", "recompute"])
@pytest.mark.parametrize("aggr, gate_group", AGGRS)
def test_bf16_every_aggregator_with_performer_neighbourhoods_and_chunks(aggr, gate_group, recompute, monkeypatch):
    """bfloat16 throughout (intermediates included), edge features, dropout, Performer neighbourhoods,
    several chunks, on the stored and the (opt-in) recompute paths: output and all eight gradients within
    the bfloat16 accuracy rule."""
    monkeypatch.setenv("NT_KERNELS_NTCONV_RECOMPUTE", recompute)
    case = low_precision_case(aggr, autocast=False)
    run_low_precision(case, autocast=False, run=run_triton_chunked, aggr=aggr, gate_group=gate_group,
                      threshold=THRESHOLD, dropout=0.2, seed=6)


@pytest.mark.parametrize("aggr, gate_group", [AGGRS[3], AGGRS[5]])
def test_autocast_dirnt_reversed_graph(aggr, gate_group):
    """DirNT's second direction (the reversed CSR: edge_attr gathered through a non-trivial perm) under
    autocast's dtypes, within the accuracy rule; weight gradients bitwise equal on a rerun.  (``max`` on this
    graph exceeds the rule with fp32 intermediates as well, issue 19's code: 0.145 vs PyTorch's 0.062 on
    d_centre, from near-ties decided differently; bf16 ``max`` is checked on the undirected graph.)"""
    edge_index, n = make_graph(SIZES * 3, receivers=24, seed=5)
    csr = reversed_csr(NeighbourhoodCSR.from_edge_index(edge_index, n), n)
    case = low_precision_case(aggr, autocast=True, edge_index=edge_index.flip(0), num_nodes=n, csr=csr)
    kw = dict(aggr=aggr, gate_group=gate_group, threshold=THRESHOLD, dropout=0.3, seed=8)
    first = run_low_precision(case, autocast=True, run=run_triton_chunked, **kw)[3]
    again = run_triton_chunked(case, dtype=torch.float32, param_dtype=torch.bfloat16, **kw)[3]
    for name in WEIGHTS:
        assert torch.equal(first[name], again[name]), name


# ------------------------------------------------ float32 paths the change added
@pytest.mark.parametrize("aggr, gate_group", [AGGRS[1], AGGRS[4]])
def test_wide_heads_store_dy_and_take_the_row_gemm(aggr, gate_group):
    """One head of 130 dims (256 padded columns > FUSED_DO_WIDTH): dy is stored and do comes from the row
    GEMM; float32 output and all eight gradients against the float64 definition and the CPU op."""
    case = Case(*make_graph([3, 1, 6, 2, 0, 4], receivers=4, seed=3), aggr, heads=1, dim=130)
    kw = dict(aggr=aggr, gate_group=gate_group, threshold=THRESHOLD, dropout=0.2, seed=9)
    assert_matches_reference_and_cpu_op(case, run_triton(case, chunk_rows=8, **kw), **kw)


@pytest.mark.parametrize("aggr, gate_group", AGGRS)
def test_float32_every_aggregator_matches_cpu_op_and_reruns_bitwise(aggr, gate_group):
    """float32 (intermediates float32), edge features, Performer neighbourhoods, 12-row chunks: against the
    float64 definition and the CPU fused op; the five weight gradients bitwise equal on a rerun."""
    case = Case(*make_graph(), aggr)
    kw = dict(aggr=aggr, gate_group=gate_group, threshold=THRESHOLD, dropout=0.3, seed=2 ** 33 + 1)
    result = run_triton(case, **kw)
    assert_matches_reference_and_cpu_op(case, result, **kw)
    again = run_triton(case, **kw)[3]
    for name in WEIGHTS:
        assert torch.equal(result[3][name], again[name]), name


# ------------------------------------------------ the message gradient from o (no y, no dy stored)
SPLIT_AGGRS = [AGGRS[0], AGGRS[1], AGGRS[3], AGGRS[5]]  # sum, mean, weighted_mean-receiver, gated_sum


def _force_split(monkeypatch, on=True):
    """Take the sm_90 paths wherever they apply to the layer and mode (``on``), whatever the dtype and
    device: the message gradient from o and the one-pass input gradients; or never (``on`` False: y, dy,
    z and dz/du stored, the path of fp32 and of sm_80 / sm_89)."""
    from nt_kernels.backends.triton import ntconv_grad, ntconv_igrad

    monkeypatch.setenv("NT_KERNELS_NTCONV_RECOMPUTE", "1" if on else "0")

    def width(heads, dim, mode, size, arch):
        return ntconv_grad.split_width(heads, dim, mode, 2, 90) if on else 0
    monkeypatch.setattr(ntconv_op, "split_width", width)
    monkeypatch.setattr(ntconv_op, "input_split_ok", lambda c, size, arch: on and ntconv_igrad.input_split_ok(c, 2, 90))


def test_split_message_grad_applies_to_the_tolokers_layer_on_sm90_in_16_bits():
    """gated_sum at H = 2, D = 30 in bf16 / fp16 on sm_90: BLOCK_C = 64; not for fp32, sm_80 / sm_89,
    max (tie keys equal the forward's stored y), the centre softmax (two passes) or wide heads."""
    from nt_kernels.backends.triton.ntconv_grad import (GRAD_CENTRE_B, GRAD_GATED_SUM, GRAD_MAX, GRAD_SUM,
                                                        split_width)

    assert split_width(2, 30, GRAD_GATED_SUM, 2, 90) == 64
    assert split_width(2, 30, GRAD_SUM, 2, 90) == 64
    assert split_width(2, 30, GRAD_GATED_SUM, 4, 90) == split_width(2, 30, GRAD_GATED_SUM, 2, 89) == 0
    assert split_width(2, 30, GRAD_MAX, 2, 90) == split_width(2, 30, GRAD_CENTRE_B, 2, 90) == 0
    assert split_width(16, 32, GRAD_SUM, 2, 90) == split_width(1, 130, GRAD_SUM, 2, 90) == 0


@pytest.mark.parametrize("aggr, gate_group", SPLIT_AGGRS)
def test_split_message_grad_float32_matches_reference_and_cpu_op(aggr, gate_group, monkeypatch):
    """The sm_90 paths (message gradient from o, one-pass input gradients) run on float32 operands (the
    kernels are dtype-generic): edge features, dropout, Performer neighbourhoods, 12-row chunks; output and
    all eight gradients against the float64 definition and the CPU op; weight gradients bitwise equal on a
    rerun."""
    calls = []
    real, real_input = ntconv_op.message_grad_split, ntconv_op.input_grad_split
    _force_split(monkeypatch)
    monkeypatch.setattr(ntconv_op, "message_grad_split", lambda *a: calls.append("message") or real(*a))
    monkeypatch.setattr(ntconv_op, "input_grad_split", lambda *a: calls.append("input") or real_input(*a))
    case = Case(*make_graph(), aggr)
    kw = dict(aggr=aggr, gate_group=gate_group, threshold=THRESHOLD, dropout=0.3, seed=5)
    result = run_triton(case, **kw)
    assert {"message", "input"} <= set(calls), "the sm_90 paths did not run"
    assert_matches_reference_and_cpu_op(case, result, **kw)
    again = run_triton(case, **kw)[3]
    for name in WEIGHTS:
        assert torch.equal(result[3][name], again[name]), name


@pytest.mark.parametrize("aggr, gate_group", [AGGRS[1], AGGRS[5]])
def test_split_message_grad_over_several_row_blocks(aggr, gate_group, monkeypatch):
    """One chunk of 150 rows (split-K blocks of 64 = two 32-row tiles of the input gradients, the last block
    ragged; segments of 40 and 50 rows crossing tiles and blocks): float32 against the float64 definition and
    the CPU op, and against the stored y, z and dz/du path within the float32 tolerance."""
    case = Case(*make_graph([40, 3, 30, 1, 0, 50, 2, 24], receivers=6, seed=4), aggr)
    kw = dict(aggr=aggr, gate_group=gate_group, threshold=64, dropout=0.1, seed=8)
    _force_split(monkeypatch)
    split = run_triton(case, chunk_rows=4096, **kw)
    assert_matches_reference_and_cpu_op(case, split, **kw)
    _force_split(monkeypatch, on=False)
    stored = run_triton(case, chunk_rows=4096, **kw)
    for name in WEIGHTS:
        if split[3][name] is not None:
            assert_close(split[3][name], stored[3][name], f"{name}: split against stored y")
    for name in ("centre", "receiver_term"):
        assert_close(split[3][name], stored[3][name], f"{name}: one pass against stored z")


@pytest.mark.parametrize("mask", [(False, True, True), (True, False, False)], ids=["no-d_centre", "d_centre-only"])
def test_one_pass_input_gradients_with_an_input_mask(mask, monkeypatch):
    """The one-pass input gradients without d_centre (no segment sums) and with d_centre alone: the asked-for
    gradients and every weight gradient against the float64 definition."""
    _force_split(monkeypatch)
    case = Case(*make_graph(), "gated_sum")
    kw = dict(aggr="gated_sum", gate_group="receiver", threshold=THRESHOLD, dropout=0.3, seed=4)
    grads = run_triton(case, input_mask=mask, **kw)[3]
    want = reference(case, **kw)[1]
    for name, asked in zip(("centre", "receiver_term", "edge_attr"), mask):
        assert (grads[name].numel() > 0) == asked, name
        if asked:
            assert_close(grads[name].cpu(), want[name], f"gradient of {name}")
    for name in WEIGHTS:
        assert_close(grads[name].cpu(), want[name], f"gradient of {name}")


def test_one_pass_input_gradients_apply_up_to_64_channels_in_16_bits_on_sm90():
    from nt_kernels.backends.triton.ntconv_igrad import input_split_ok

    assert input_split_ok(60, 2, 90) and input_split_ok(64, 2, 90)
    assert not input_split_ok(65, 2, 90) and not input_split_ok(60, 4, 90) and not input_split_ok(60, 2, 89)


@pytest.mark.parametrize("aggr, gate_group", [AGGRS[0], AGGRS[5]])
def test_stored_y_path_of_the_split_modes_in_bf16(aggr, gate_group, monkeypatch):
    """The path fp32 and sm_80 / sm_89 take for these modes (y and dy stored, dW_out by the split-K weight
    gradient), in bfloat16 within the accuracy rule."""
    _force_split(monkeypatch, on=False)
    case = low_precision_case(aggr, autocast=False)
    run_low_precision(case, autocast=False, run=run_triton_chunked, aggr=aggr, gate_group=gate_group,
                      threshold=THRESHOLD, dropout=0.2, seed=6)


# ------------------------------------------------ du and d_centre from one kernel
def _du_case(sizes, c, dtype, seed=0):
    """A chunk of segments with ``sizes`` rows (chunk-local rowptr, global segment ids from seg0 = 2) and
    du's operands in ``dtype`` on DEVICE (the kernel's); the float64 truth of du and of its per-segment sums,
    on the CPU."""
    from types import SimpleNamespace

    from nt_kernels.backends.triton.common import bf16_emulation

    gen = torch.Generator().manual_seed(seed)
    rowptr = torch.cat([torch.zeros(1, dtype=torch.int64), torch.tensor(sizes).cumsum(0)])
    rows, seg0 = int(rowptr[-1]), 2
    seg_of_row = torch.repeat_interleave(torch.arange(len(sizes)) + seg0, torch.tensor(sizes))
    dqkv, w_qkv = torch.randn(3, rows, c, generator=gen).to(dtype), torch.randn(3 * c, c, generator=gen).to(dtype)
    jac = torch.rand(rows, c, generator=gen).to(dtype)
    du = (dqkv.permute(1, 0, 2).reshape(rows, 3 * c).double() @ w_qkv.double()) * jac.double()
    centre = torch.stack([du[a:b].sum(0) for a, b in zip(rowptr[:-1], rowptr[1:])])
    p = SimpleNamespace(channels=c, w_qkv=w_qkv.to(DEVICE), dot_prec="ieee", bf16_emu=bf16_emulation(dtype))
    chunk = SimpleNamespace(rows=rows, rowptr=rowptr.to(DEVICE), seg0=seg0, seg1=seg0 + len(sizes))
    return p, chunk, seg_of_row.to(DEVICE), dqkv.to(DEVICE), jac.to(DEVICE), du, centre


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_du_kernel_sums_segments_across_tiles(dtype):
    """du = (dqkv · w_qkv) · dz/du and d_centre in one kernel over 32-row tiles: segments inside a tile,
    across two tiles, a hub over 70 tiles (two fix-up blocks of 64 tiles), empty and one-row segments.
    du within the float32 tolerance (bf16: within its rounding), d_centre within the float32 tolerance of
    the float64 sums (fp32 sums of unrounded du), bitwise equal on a rerun."""
    from nt_kernels.backends.triton.ntconv_gemm import du_and_centre

    sizes = [0, 5, 1, 40, 0, 3, 2240, 7, 30, 1, 0]
    p, chunk, seg_of_row, dqkv, jac, want_du, want_centre = _du_case(sizes, 6, dtype)
    runs = []
    for _ in range(2):
        du = torch.empty(chunk.rows, 6, dtype=dtype, device=DEVICE)
        centre = torch.full((len(sizes), 6), 0.5, device=DEVICE)  # the running accumulator the chunk adds to
        du_and_centre(du, dqkv, jac, p, chunk, seg_of_row, centre)
        runs.append((du.cpu(), centre.cpu()))
    du, centre = runs[0]
    if dtype == torch.float32:
        assert_close(du, want_du, "du")
    else:
        torch.testing.assert_close(du.double(), want_du, rtol=2 ** -8, atol=2 ** -8 * want_du.abs().max().item())
    assert_close(centre, want_centre + 0.5, "d_centre")
    assert torch.equal(runs[1][0], du) and torch.equal(runs[1][1], centre)


@pytest.mark.parametrize("design", [None, "0", "1"], ids=["default", "stored", "recompute"])
def test_the_recompute_paths_are_opt_in(design, monkeypatch):
    """The recompute paths were slower on the GPU, so they are opt-in (NT_KERNELS_NTCONV_RECOMPUTE=1) even where
    they apply (bf16 on the interpreter, which runs as sm_90).  By default the streaming message gradient (the
    design of 16-bit parameters since the H200 run of 2026-11-28c; with edge features the input gradients
    stay on the stored path's du kernel); =0 the stored path.  Each keeps the accuracy rule."""
    calls = []
    for name in ("message_grad", "message_grad_split", "input_grad_split", "du_and_centre", "dy_stream",
                 "project_stream", "du_stream"):
        real = getattr(ntconv_op, name)
        monkeypatch.setattr(ntconv_op, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name)
                            or _real(*a, **kw))
    if design is None:
        monkeypatch.delenv("NT_KERNELS_NTCONV_RECOMPUTE", raising=False)
    else:
        monkeypatch.setenv("NT_KERNELS_NTCONV_RECOMPUTE", design)
    case = low_precision_case("gated_sum", autocast=True)
    run_low_precision(case, autocast=True, aggr="gated_sum", gate_group="receiver", threshold=THRESHOLD,
                      dropout=0.2, seed=6)
    assert set(calls) == {None: {"project_stream", "dy_stream", "du_and_centre"},
                          "0": {"message_grad", "du_and_centre"},
                          "1": {"message_grad_split", "input_grad_split"}}[design]


# ------------------------------------------------- the seed read on the device (CUDA graph captures)
@pytest.mark.parametrize("recompute", ["0", "1"], ids=["stored", "recompute"])
def test_seed_read_on_the_device_draws_the_same_mask(recompute, monkeypatch):
    """A seed on the device (what NTConv draws inside a CUDA graph capture; under the interpreter the CPU seed's
    word is put in a device cell with the tests-only ``device_seed``) gives bitwise the output and gradients of
    the same seed passed as a scalar: the forward's prologue, the backward's prologue (stored path) or the
    one-pass input gradients (recompute path) draw the same mask; another seed draws another one."""
    monkeypatch.setenv("NT_KERNELS_NTCONV_RECOMPUTE", recompute)
    case = low_precision_case("gated_sum", autocast=True)
    kw = dict(aggr="gated_sum", gate_group="receiver", threshold=THRESHOLD, dropout=0.3)

    def run(seed, on_device, backward=True):
        args = list(op_args(case, dtype=torch.float32, param_dtype=torch.bfloat16, seed=seed, **kw))
        extra = dict(chunk_rows=CHUNK_ROWS)
        if on_device and DEVICE.type == "cuda":
            args[17] = args[17].to(DEVICE)  # the schema's seed
        elif on_device:
            extra["device_seed"] = True
        out, lse, stats = ntconv_op.ntconv_fwd(*args, **extra)
        if not backward:  # the other seed: only its output is compared
            return [out]
        grads = ntconv_op.ntconv_bwd(case.grad_out.to(DEVICE, out.dtype), out, lse, stats, *args,
                                     [True, True, True], **extra)
        return [out, *grads]

    host, device, other = run(2 ** 40 + 7, False), run(2 ** 40 + 7, True), run(11, True, backward=False)
    for name, a, b in zip(["out", *GRAD_NAMES], host, device):
        assert torch.equal(a, b), name
    assert not torch.equal(host[0], other[0])
