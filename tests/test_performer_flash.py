"""The FlashAttention-2-style CUDA Performer kernels (issue 39; NT_KERNELS_PERFORMER=flash, opt-in).

Without a GPU (every CI run): ``flash_model`` (tests/flash_model.py), a CPU model of the kernels'
arithmetic (their tiles, stabilisers, order of sums and roundings), meets the accuracy rule of
tests/test_performer_cuda.py against the float64 loop reference in bfloat16, float16 and float32
(3xTF32) for head dims 1 to 256 on segments of 0, 1, 218, 219, 700 and 3,000 rows; every fault of
``MUTANTS`` makes it fail; NaN stays in its segment and head; the model's tile constants are the
kernels'.  With a GPU: the kernels against their model on the same rounded inputs, and the state
the fused layer keeps from its recomputed forward (the backward without the keys pass) against the
plain backward.  The accuracy, determinism, NaN and switch tests of the kernels themselves are in
tests/test_performer_cuda.py (``flash`` next to ``simt`` and ``tc``).
"""
import math
import re
from pathlib import Path

import pytest
import torch

from flash_model import CHUNK, FRAG, FWD_BLOCK, MUTANTS, ROUNDED_GO, TILE, WARP_ROWS, flash_model, row_groups
from test_performer_cuda import DTYPES, EPS, assert_kernels_match_model, assert_within_twice_baseline, cast, \
    cuda_test, make_case

ROOT = Path(__file__).resolve().parents[1]
SIZES = [0, 1, 218, 219, 700, 3000]
# (D, m): the issue's head dims with the CUDA tests' feature counts (tests/test_performer_cuda.py)
MODEL_DIMS = [(1, 1), (8, 16), (30, 102), (53, 210), (64, 192), (128, 112), (256, 48)]
# Known misses of the rule: none.  bfloat16 at D = 256 missed the float32-on-bfloat16-inputs baseline by
# 13 % in dq until -g.o left the rounded operand of dp (H200 2026-11-28c, "dq's cancellation" in
# docs/kernels-performer-cuda.md); the tensor-core kernels' model (tests/test_performer_cuda.py), which
# still rounds it, misses it by that amount.
KNOWN_MISSES = set()


def model_case(dtype, dim, m):
    marks = [pytest.mark.slow] if dim >= 128 else []
    if (dtype, dim) in KNOWN_MISSES:
        marks.append(pytest.mark.xfail(strict=True, reason="bfloat16 operands at D = 256 (see KNOWN_MISSES)"))
    return pytest.param(dtype, dim, m, marks=marks, id=f"{dtype}-D{dim}-m{m}")


@pytest.mark.parametrize("dtype, dim, m", [model_case(t, d, m) for t in DTYPES for d, m in MODEL_DIMS])
def test_flash_model_within_bound(dtype, dim, m):
    case = make_case(SIZES, dim, m=m, device="cpu")
    assert_within_twice_baseline(case, DTYPES[dtype], f"flash model, D={dim}, m={m}, {dtype}", run=flash_model)


def test_flash_model_large_gradients_in_float16():
    """grad_o x 4096: h and t leave float16's range unless scaled per row, as the kernels do."""
    case = make_case(SIZES, 23, m=72, device="cpu")
    case[5] = case[5] * 2.0 ** 12
    assert_within_twice_baseline(case, torch.float16, "flash model, grad x 4096", run=flash_model)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_flash_model_dq_with_one_feature_is_zero(dtype):
    """With one feature the Performer's output does not depend on q (o = S / z), so dq is 0: the query
    backward's g.W'_f and (g.o) W'_f[D] cancel.  With -g.o rounded to the dtype (the kernels until the H200
    run of 2026-11-28c) the rounding was left in dq: 3.83e-3 against a bound of 2.49e-3 on that run's check
    row (D = 1, segments of n* +- 1 = 1, 2, 3 rows).  Kept in float32 it leaves 1e-5 of max |g| here: o' adds
    eps times the column sums of sigma W before its rounding to W', so o is not exactly W'[:D] / W'[D]."""
    case = make_case([2, 3, 5, 9, 40], 1, m=1, device="cpu")
    q, k, v, rowptr, projection, grad_o = cast(case, DTYPES[dtype])
    dq = flash_model(q, k, v, rowptr, projection, grad_o)[1].double()
    old = flash_model(q, k, v, rowptr, projection, grad_o, mutant=ROUNDED_GO)[1].double()
    scale = grad_o.double().abs().max().item()
    assert dq.abs().max().item() <= 5e-5 * scale, dq.abs().max().item()
    assert old.abs().max().item() >= 2e-4 * scale, old.abs().max().item()


@pytest.mark.parametrize("mutant", MUTANTS)
def test_flash_model_mutants_fail_the_rule(mutant):
    """Each fault of the model (a step of the kernels' arithmetic broken) fails the rule in float32."""
    case = make_case(SIZES, 30, m=102, device="cpu")

    def broken(*args):
        return flash_model(*args, mutant=mutant)

    with pytest.raises(AssertionError, match=r"error .* > bound"):
        assert_within_twice_baseline(case, torch.float32, f"flash model, {mutant}", run=broken)


def test_flash_model_nan_stays_in_its_segment_and_head():
    q, k, v, rowptr, projection, grad_o = cast(make_case([5, 300, 0, 40], 8, device="cpu"), torch.bfloat16)
    clean = flash_model(q, k, v, rowptr, projection, grad_o)
    k = k.clone()
    k[5 + 17, 1, 3] = math.nan
    dirty = flash_model(q, k, v, rowptr, projection, grad_o)
    seg = slice(5, 305)
    assert torch.isnan(dirty[0][seg, 1]).all()
    assert torch.equal(dirty[0][seg, 0], clean[0][seg, 0])
    outside = torch.ones(q.shape[0], dtype=torch.bool)
    outside[seg] = False
    for a, b in zip(dirty, clean):
        assert torch.equal(a[outside], b[outside])


def _constant(text, name):
    return int(re.search(rf"constexpr int {name} = ([0-9]+);", text).group(1))


def test_model_constants_are_the_kernels():
    """The model's tiles are the kernels' (csrc/cuda/segment_performer_fl_layout.cuh)."""
    layout = (ROOT / "csrc/cuda/segment_performer_fl_layout.cuh").read_text()
    kernel = (ROOT / "csrc/cuda/segment_performer_kernel.cuh").read_text()
    warps, rows = _constant(layout, "FL_WARPS"), _constant(layout, "FL_WARP_ROWS")
    assert (rows, warps * rows, _constant(layout, "FL_FRAG")) == (WARP_ROWS, TILE, FRAG)
    assert _constant(layout, "FL_FWD_BLOCK") == FWD_BLOCK
    assert _constant(layout, "FL_BWD_BLOCK") == 1  # the model scales t per 16-feature tile
    assert _constant(kernel, "PERFORMER_CHUNK_ROWS") == CHUNK
    # fl_dims: mp = m + 1 rounded to 16 (row m of the keys' sums is B); row groups split a tile's
    # 16-row steps when fewer than four warps hold the feature tiles
    assert [row_groups(m) for m in (1, 15, 16, 31, 32, 47, 102, 127)] == [4, 4, 2, 2, 1, 1, 1, 1]


# ----------------------------------------------------------------- CUDA
# (D, m) the flash kernels run: D + 1 <= 48 (16-bit) or 32 (float32), m + 1 <= 128
FLASH_DIMS = {"bfloat16": [(8, 16), (23, 72), (30, 102), (32, 110), (47, 127)],
              "float16": [(8, 16), (23, 72), (30, 102), (32, 110)],
              "float32": [(8, 16), (23, 72), (30, 102)]}


@cuda_test
@pytest.mark.parametrize("dtype, dim, m", [(t, d, m) for t, dims in FLASH_DIMS.items() for d, m in dims])
def test_flash_kernels_match_their_model(dtype, dim, m, monkeypatch):
    """The kernels and ``flash_model`` on the same rounded inputs differ only in the order of float32
    sums inside a product and in exp2: every output agrees to one unit in the last place of the
    dtype at max |model| (float32, 3xTF32: 1e-5 of it)."""
    assert_kernels_match_model("flash", flash_model, SIZES, dim, m, dtype, monkeypatch)


@cuda_test
@pytest.mark.parametrize("impl", ["flash", "simt"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_kept_state_gives_the_plain_backward(impl, dtype, monkeypatch):
    """performer_fwd_state_table + performer_bwd_state_table_into (the fused layer's backward: no keys
    pass) give bitwise the results of performer_fwd_table_into + performer_bwd_table_into; the state
    is empty where the flash kernels do not run."""
    monkeypatch.setenv("NT_KERNELS_PERFORMER", impl)
    q, k, v, rowptr, projection, grad_o = cast(make_case(SIZES, 30, m=102), DTYPES[dtype])
    ops = torch.ops.nt_kernels
    segments = torch.arange(rowptr.numel() - 1, device=q.device)
    table = ops.performer_segment_table(rowptr, segments, q.shape[0])
    o_plain, o_kept = torch.zeros_like(q), torch.zeros_like(q)
    ops.performer_fwd_table_into(o_plain, q, k, v, rowptr, segments, table, projection, EPS)
    state = ops.performer_fwd_state_table(o_kept, q, k, v, rowptr, segments, table, projection, EPS)
    assert (state.numel() > 0) == (impl == "flash")
    plain, kept = ([torch.zeros_like(q) for _ in range(3)] for _ in range(2))
    ops.performer_bwd_table_into(*plain, grad_o, q, k, v, rowptr, segments, table, projection, EPS)
    ops.performer_bwd_state_table_into(*kept, grad_o, q, k, v, rowptr, segments, table, projection, EPS, state)
    assert torch.equal(o_plain, o_kept)
    for a, b in zip(plain, kept):
        assert torch.equal(a, b)


@cuda_test
def test_fused_layer_backward_skips_the_keys_pass(monkeypatch):
    """The fused NT layer (float32) under NT_KERNELS_PERFORMER=flash: output and every gradient match the
    SIMT run's to float32 accuracy, and per plan chunk the keys kernel runs twice (the forward, the
    backward's recomputed forward) while the key gradients run once: the Performer backward reuses the
    recomputed forward's state (the keys pass twice per layer instead of three times)."""
    import test_ntconv_triton as tt
    from helpers import assert_close

    case = tt.Case(*tt.make_graph(), "sum")
    kw = dict(aggr="sum", gate_group="receiver", threshold=tt.THRESHOLD, dropout=0.0, seed=0)
    monkeypatch.setenv("NT_KERNELS_PERFORMER", "simt")
    want = tt.run_triton(case, **kw)
    monkeypatch.setenv("NT_KERNELS_PERFORMER", "flash")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        got = tt.run_triton(case, **kw)
        torch.cuda.synchronize()
    assert_close(got[0].cpu(), want[0].cpu(), "output")
    for name, grad in got[3].items():
        assert_close(grad.cpu(), want[3][name].cpu(), f"gradient of {name}")
    names = [e.name for e in prof.events()]
    keys = sum("fl_keys_kernel" in n for n in names)
    grads = sum("fl_key_grad_kernel" in n for n in names)
    assert grads > 0 and keys == 2 * grads, (keys, grads)
