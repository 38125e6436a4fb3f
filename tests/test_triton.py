"""Triton exact-attention kernels (nt_kernels.backends.triton) vs the loop reference.

The kernels are the CUDA implementation of ``softmax_fwd_into`` /
``softmax_bwd_into``.  Without a GPU they run on CPU tensors under
TRITON_INTERPRET=1 (set in conftest.py), called through the backend functions,
so every case is tiny; with a GPU the same cases run compiled on CUDA through
the public op (the dispatcher picks the Triton kernels), plus the CUDA-only
checks at the end (opcheck, torch.compile, bigger graphs, determinism).

Launch configs come from the config table (configs.py): the default cases run
the shipped table's configs (its entries, else the heuristic); the variant
cases install a table that sends every key to one packed kernel variant (the
whole-row "heads" kernel with tensor-core dots, with CUDA-core product sums,
one tile per work item, or the per-head kernel) and check every size-class
boundary, empty, one-row and multi-tile segments and the exact-path threshold
+- 1 under it.
"""
import math

import pytest
import torch

pytest.importorskip("triton", reason="the optional dependency triton (nt-kernels[triton]) is not installed")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import nt_kernels  # noqa: E402
import nt_kernels.backends.triton.register as ntt  # noqa: E402
from nt_kernels.backends.triton import configs  # noqa: E402
from nt_kernels.backends.triton.common import device_arch, round_tf32  # noqa: E402
from nt_kernels.backends.triton.packed_heads import _bwd_heads_kernel, _fwd_heads_kernel  # noqa: E402
from nt_kernels.backends.triton.plan import (  # noqa: E402
    PLAN_BLOCK, SM90_SHARED_MEMORY, build_plan, describe_plan, max_packed_tile, plan_length)
from nt_kernels.backends.triton.softmax_bwd import _bwd_packed_kernel, bwd_spec  # noqa: E402
from nt_kernels.backends.triton.softmax_fwd import _fwd_packed_kernel, fwd_spec  # noqa: E402
from helpers import assert_close, assert_low_precision, max_error, packed, rowptr_of  # noqa: E402
from nt_reference.ops import segment_softmax_attention as reference  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")

# Every scheduling branch: empty and one-row segments, packed tiles holding
# several segments (sizes 1-5, 9, 12), single-segment tiles (20, 64) and
# multi-tile segments (65, 130 rows = 3 blocks with a 2-row tail).
MIXED_SIZES = [0, 1, 3, 3, 3, 5, 1, 0, 9, 12, 2, 20, 64, 65, 4, 130, 0]
SMALL_SIZES = [2, 1, 5, 0, 3, 7, 9, 1, 16]
# Every size-class boundary +- 1 of the plan (tile height 16: n <= 8 and 12-16; 32: 9, 10 and
# 24-32; 64: 11, 17-23 and 33-64; multi-tile above 64), empty and one-row segments.
BOUNDARY_SIZES = [0, 1, 2, 8, 9, 10, 11, 12, 16, 17, 23, 24, 32, 33, 3, 64, 65, 1, 0, 2]


def make_rowptr(sizes):
    return rowptr_of(sizes, device=DEVICE)


def make_qkv(num_rows, heads, dim, dtype, seed=0, requires_grad=False):
    return packed(num_rows, heads, dim, dtype=dtype, seed=seed, device=DEVICE, requires_grad=requires_grad)


def reference_grads(q, k, v, rowptr, grad_o, dtype, scale=None):
    """Loop reference output and (dq, dk, dv), computed in ``dtype``."""
    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    o = reference(*leaves, rowptr, scale=scale)
    o.backward(grad_o.to(dtype))
    return [o.detach()] + [x.grad for x in leaves]


def assert_matches_reference(ours, q, k, v, rowptr, grad_o, scale=None):
    """float32: close to the float64 reference.  Half types: the accuracy rule of tests/helpers.py
    (error at most 2x that of the same loop reference run in the half type, plus the floor)."""
    exact = reference_grads(q, k, v, rowptr, grad_o, torch.float64, scale)
    names = ("o", "dq", "dk", "dv")
    if q.dtype == torch.float32:
        for name, a, b in zip(names, ours, exact):
            assert_close(a, b, msg=name)
        return
    same_dtype = reference_grads(q, k, v, rowptr, grad_o, q.dtype, scale)
    float32 = reference_grads(q, k, v, rowptr, grad_o, torch.float32, scale)  # on q's values: also the mixed run
    for name, a, b, c, d in zip(names, ours, exact, same_dtype, float32):
        assert a.dtype == q.dtype, name
        assert_low_precision(a, b, c, d, msg=name, torch_mixed=d.to(q.dtype))


def run_exact(q, k, v, rowptr, grad_o, scale=None):
    """o, dq, dk, dv from the Triton kernels: through the public op on CUDA (forward and autograd),
    through the backend functions on every segment on CPU (interpreter), into NaN-filled outputs."""
    if HAS_CUDA:
        q, k, v = [x.detach().requires_grad_() for x in (q, k, v)]
        o = nt_kernels.segment_softmax_attention(q, k, v, rowptr, scale=scale)
        o.backward(grad_o)
        return [o.detach(), q.grad, k.grad, v.grad]
    q, k, v = (x.detach().contiguous() for x in (q, k, v))
    rowptr = rowptr.long()
    segments = torch.arange(rowptr.numel() - 1, device=DEVICE)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    # NaN-filled outputs: the public ops allocate them without a fill on CUDA (rows_covered),
    # so a row the kernels leave unwritten must fail the comparison.
    o, dq, dk, dv = (torch.full_like(q, math.nan) for _ in range(4))
    lse = torch.full(q.shape[:2], math.nan, device=DEVICE)
    ntt.softmax_fwd_into(o, lse, q, k, v, rowptr, segments, None, scale)
    ntt.softmax_bwd_into(dq, dk, dv, grad_o.contiguous(), q, k, v, o, lse, rowptr, segments, None, scale)
    return [o, dq, dk, dv]


# ---------------------------------------------------------------- plan builder

def check_plan(sizes, segments, max_tile=PLAN_BLOCK):
    rowptr = make_rowptr(sizes)
    seg_t = torch.tensor(segments, dtype=torch.int64, device=DEVICE)
    plan = build_plan(rowptr, seg_t, int(rowptr[-1]), max_tile=max_tile)
    desc = describe_plan(plan)
    starts = rowptr.tolist()
    seg_of_start = {starts[s]: s for s in segments if sizes[s] > 0}
    covered = []
    for height, n, tile_starts in desc["packed"]:
        assert 1 <= n <= max_tile and height <= max_tile and len(tile_starts) * n <= height
        for start in tile_starts:
            seg = seg_of_start[start]
            assert sizes[seg] == n, "a packed tile holds a whole segment"
            covered += range(start, start + n)
    blocks = {}
    for start, n, block in desc["multi"]:
        seg = seg_of_start[start]
        assert sizes[seg] == n > max_tile, "only segments larger than the tallest tile go multi-tile"
        blocks.setdefault(seg, []).append(block)
        first = start + block * PLAN_BLOCK
        covered += range(first, min(start + n, first + PLAN_BLOCK))
    for seg, got in blocks.items():
        assert sorted(got) == list(range(math.ceil(sizes[seg] / PLAN_BLOCK)))
    expected = [r for s in segments for r in range(starts[s], starts[s + 1])]
    assert sorted(covered) == sorted(expected), "every row of the given segments exactly once"
    return desc


def test_plan_covers_given_segments_once():
    desc = check_plan(MIXED_SIZES, list(range(len(MIXED_SIZES))))
    heights = {h for h, _, _ in desc["packed"]}
    assert heights == {16, 32, 64}
    assert any(len(starts) > 1 for _, _, starts in desc["packed"]), "packs several segments"


def test_plan_subset_and_order():
    check_plan(MIXED_SIZES, [15, 2, 0, 7, 12, 3])
    check_plan(MIXED_SIZES, [13])


def test_plan_random_sizes():
    gen = torch.Generator().manual_seed(3)
    sizes = torch.randint(0, 80, (300,), generator=gen).tolist()
    subset = torch.randperm(300, generator=gen)[:170].tolist()
    check_plan(sizes, subset)
    desc = check_plan(sizes, list(range(300)))
    assert max(len(s) for _, _, s in desc["packed"]) >= 5


@pytest.mark.parametrize("max_tile", [16, 32])
def test_plan_capped_tile_height(max_tile):
    """Capped plans (float32 with head dims > 128 use 32) send larger segments to multi-tile items."""
    gen = torch.Generator().manual_seed(5)
    sizes = torch.randint(0, 80, (200,), generator=gen).tolist() + [max_tile, max_tile + 1, PLAN_BLOCK]
    desc = check_plan(sizes, list(range(len(sizes))), max_tile=max_tile)
    assert max(h for h, _, _ in desc["packed"]) == max_tile
    assert {n for _, n, _ in desc["multi"]} >= {max_tile + 1, PLAN_BLOCK}


SM80_SHARED_MEMORY, SM86_SHARED_MEMORY = 166_912, 101_376


def test_max_packed_tile():
    assert max_packed_tile(torch.float32, 128) == PLAN_BLOCK
    assert max_packed_tile(torch.float32, 129) == 32
    assert max_packed_tile(torch.bfloat16, 256) == PLAN_BLOCK


@pytest.mark.parametrize("dtype, head_dim, tiles", [
    (torch.float32, 64, (64, 64, 64)), (torch.float32, 128, (32, 64, 64)), (torch.float32, 256, (16, 32, 32)),
    (torch.bfloat16, 128, (64, 64, 64)), (torch.bfloat16, 256, (32, 64, 64)), (torch.float16, 200, (32, 64, 64))])
def test_max_packed_tile_follows_shared_memory(dtype, head_dim, tiles):
    """Four TILE x BLOCK_D operands of the packed backward must fit the block's shared memory:
    sm_86/sm_89 (99 KiB), sm_80 (163 KiB), sm_90 (227 KiB)."""
    limits = (SM86_SHARED_MEMORY, SM80_SHARED_MEMORY, SM90_SHARED_MEMORY)
    assert tuple(max_packed_tile(dtype, head_dim, limit) for limit in limits) == tiles
    with pytest.raises(ValueError, match="max_tile must be one of"):
        build_plan(make_rowptr([3]), torch.arange(1, device=DEVICE), max_tile=48)


def test_plan_empty():
    desc = check_plan([0, 0, 3], [])
    assert desc == {"packed": [], "multi": []}
    plan = build_plan(make_rowptr([0, 0]), torch.arange(2, device=DEVICE))
    assert describe_plan(plan) == {"packed": [], "multi": []}


def test_plan_with_and_without_num_rows_agree():
    rowptr = make_rowptr(MIXED_SIZES)
    segs = torch.arange(len(MIXED_SIZES), device=DEVICE)
    assert torch.equal(build_plan(rowptr, segs), build_plan(rowptr, segs, int(rowptr[-1])))


# ------------------------------------------------------- forward and gradients

@pytest.mark.parametrize("dim", [1, 9, 16, 23, 53, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_segment_softmax_matches_reference(dim, dtype):
    rowptr = make_rowptr(MIXED_SIZES)
    q, k, v = make_qkv(int(rowptr[-1]), 2, dim, dtype, seed=dim)
    grad_o = make_qkv(int(rowptr[-1]), 2, dim, dtype, seed=100 + dim)[0]
    ours = run_exact(q, k, v, rowptr, grad_o)
    assert_matches_reference(ours, q, k, v, rowptr, grad_o)


def test_custom_scale_int32_rowptr_noncontiguous():
    rowptr = make_rowptr(SMALL_SIZES)
    num_rows = int(rowptr[-1])
    q, k, v = make_qkv(num_rows, 3, 8, torch.float32, seed=7)
    q = torch.randn(3, num_rows, 8, device=DEVICE).transpose(0, 1)  # non-contiguous
    grad_o = make_qkv(num_rows, 3, 8, torch.float32, seed=8)[0]
    ours = run_exact(q, k, v, rowptr.to(torch.int32), grad_o, scale=0.7)
    assert_matches_reference(ours, q, k, v, rowptr, grad_o, scale=0.7)


def test_empty_graph():
    q, k, v = make_qkv(0, 2, 5, torch.float32)
    o, dq, dk, dv = run_exact(q, k, v, make_rowptr([0, 0]), torch.zeros_like(q))
    assert o.shape == dq.shape == dk.shape == dv.shape == (0, 2, 5)


def test_plan_of_another_segment_list_is_rejected():
    """A plan must be the one built for the segment list it comes with: a mismatch is an error,
    not rows silently left unwritten."""
    rowptr = make_rowptr(MIXED_SIZES)
    num_rows = int(rowptr[-1])
    segments = torch.tensor([15, 3, 0, 8], device=DEVICE)
    q, k, v = make_qkv(num_rows, 2, 8, torch.float32, seed=13)
    o, lse = torch.zeros_like(q), torch.zeros(num_rows, 2, device=DEVICE)
    other = build_plan(rowptr, segments[:2], num_rows)
    assert other.numel() == plan_length(2, num_rows, PLAN_BLOCK)
    with pytest.raises(ValueError, match="softmax_fwd_into: plan does not match the segment list"):
        ntt.softmax_fwd_into(o, lse, q, k, v, rowptr, segments, other, 0.5)
    # float32 with head dim 200 runs packed tiles of at most 32 rows: a 64-row plan would leave rows unwritten.
    wide = make_qkv(num_rows, 2, 200, torch.float32, seed=14)
    tall = build_plan(rowptr, segments, num_rows, max_tile=PLAN_BLOCK)
    with pytest.raises(ValueError, match="softmax_bwd_into: plan does not match the segment list"):
        ntt.softmax_bwd_into(*(torch.zeros_like(wide[0]) for _ in range(3)), wide[0], *wide, wide[0], lse,
                             rowptr, segments, tall, 0.5)
    with pytest.raises(ValueError, match="plan must be a 1-D int64 tensor"):
        ntt.softmax_fwd_into(o, lse, q, k, v, rowptr, segments, other.int(), 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_nan_stays_in_its_segment(dtype):
    """A NaN in v of segment 1 (packed in one tile with segments 0 and 2, of the same size) reaches
    segment 1's o, dq, dk and dv, and nothing of segments 0, 2 and 3, which equal the clean run.
    (Until 2026-11-28c the packed backward's dS = P (dP - delta) multiplied segment 1's NaN delta by
    the zero weights of the other segments' keys, and the NaN reached their dk.)"""
    sizes = [3, 3, 3, 70]
    rowptr = make_rowptr(sizes)
    q, k, v = make_qkv(int(rowptr[-1]), 1, 8, dtype, seed=5)
    grad_o = torch.ones_like(q)
    clean = run_exact(q, k, v, rowptr, grad_o)
    v[3, 0, 2] = float("nan")  # row 0 of segment 1
    dirty = run_exact(q, k, v, rowptr, grad_o)
    bounds = rowptr.tolist()
    for name, a, b in zip(("o", "dq", "dk", "dv"), clean, dirty):
        for s in range(len(sizes)):
            rows = slice(bounds[s], bounds[s + 1])
            if s == 1:
                assert torch.isnan(b[rows]).any(), f"{name}: segment 1 lost its NaN"
            else:
                assert torch.isfinite(b[rows]).all() and torch.equal(a[rows], b[rows]), \
                    f"{name}: the NaN reached segment {s}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_multi_tile_gradients_at_head_dim_1_within_twice_pytorchs_error(dtype, seed):
    """Multi-tile segments at D = 1 in half precision: dS = P (dP - delta) cancels, and a delta from O
    rounded to the dtype put dQ's error at up to 2x PyTorch's (the H200 check's failing row of 2026-11-27),
    so the dQ pass sums delta from P and dP there (softmax_bwd.delta_from_p).  Forward and all gradients
    against the float64 loop reference within the accuracy rule, on 65-125-row segments."""
    from nt_kernels.backends.triton.softmax_bwd import delta_from_p

    assert delta_from_p(dtype, 1) and not delta_from_p(dtype, 2) and not delta_from_p(torch.float32, 1)
    rowptr = make_rowptr([65 + 30 * (seed % 3), 3])
    q, k, v, grad_o = make_qkv(int(rowptr[-1]), 2, 1, torch.float64, seed=seed) + make_qkv(
        int(rowptr[-1]), 2, 1, torch.float64, seed=seed + 100)[:1]
    q, k, v = (2 * t for t in (q, k, v))
    want = reference_grads(q, k, v, rowptr, grad_o, torch.float64)
    same = reference_grads(q, k, v, rowptr, grad_o, dtype)
    f32 = reference_grads(q, k, v, rowptr, grad_o, torch.float32)
    mixed = reference_grads(*(t.to(dtype) for t in (q, k, v)), rowptr, grad_o.to(dtype), torch.float32)
    got = run_exact(*(t.to(dtype) for t in (q, k, v)), rowptr, grad_o.to(dtype))
    for name, g, w, t, t32, m in zip(("o", "dq", "dk", "dv"), got, want, same, f32, mixed):
        assert_low_precision(g, w, t, t32, msg=f"{name}, D = 1, seed {seed}", dtype=dtype, torch_mixed=m.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_reruns_are_bitwise_identical(dtype):
    """Two runs of the forward and backward kernels give the same bits (no atomics on the default path)."""
    rowptr = make_rowptr(SMALL_SIZES)
    q, k, v, grad_o = make_qkv(int(rowptr[-1]), 2, 8, dtype, seed=9) + make_qkv(int(rowptr[-1]), 2, 8, dtype,
                                                                                 seed=10)[:1]
    for name, a, b in zip(("o", "dq", "dk", "dv"), run_exact(q, k, v, rowptr, grad_o),
                          run_exact(q, k, v, rowptr, grad_o)):
        assert torch.equal(a, b), name


# ------------------------------------------------- config variants (table)

HEADS_DOT = {"kernel": "heads", "tile_elems": 4096, "dot": 1, "num_warps": 4, "num_stages": 1}
VARIANTS = {
    "heads-tensor-cores": (HEADS_DOT, 32),
    "heads-cuda-cores": (dict(HEADS_DOT, dot=0, tile_elems=2048), 64),
    "heads-one-tile": (dict(HEADS_DOT, tile_elems=1024), 32),
    "per-head": ({"kernel": "head", "num_warps": 8, "num_stages": 2}, 64),
}


@pytest.fixture(params=sorted(VARIANTS))
def variant(request, tmp_path, monkeypatch):
    """A table sending every packed key to one kernel variant and every multi-tile key to one inner block."""
    packed_config, inner = VARIANTS[request.param]
    entries = {}
    for dtype in ("fp32", "bf16", "fp16"):
        for dim_class in (1 << i for i in range(9)):
            for kernel, (kind, _) in configs.KERNELS.items():
                sizes = ("t16", "t32", "t64") if kind == "packed" else ("multi",)
                multi = {"BLOCK_M" if kernel == "bwd_dkdv" else "BLOCK_N": inner, "num_warps": 4, "num_stages": 1}
                for size in sizes:
                    entries[configs.table_key(kernel, dtype, dim_class, size)] = (
                        packed_config if kind == "packed" else multi)
    arch = device_arch(DEVICE)  # sm_90 under the interpreter
    if arch not in configs.ARCH_SHARED_MEMORY:
        pytest.skip(f"no config table section for sm_{arch}")
    path = tmp_path / "table.py"
    configs.write_table({"version": configs.TABLE_VERSION, "archs": {configs.arch_name(arch): {
        "source": request.param, "entries": entries}}}, path)
    monkeypatch.setenv("NT_KERNELS_TRITON_CONFIGS", str(path))
    configs.clear_cache()
    yield packed_config
    monkeypatch.delenv("NT_KERNELS_TRITON_CONFIGS")
    configs.clear_cache()


def expected_packed_kernels(config, heads, dim, dtype):
    """The forward / backward packed kernels the launchers run under ``config`` for the 16-row class."""
    fwd = fwd_spec("fwd_packed", config, dtype, heads, dim, 0, 16).fn
    bwd = bwd_spec("bwd_packed", config, dtype, heads, dim, 0, 16).fn
    return fwd, bwd


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_config_variants_match_reference(variant, dtype):
    heads, dim = 3, 3
    fwd, bwd = expected_packed_kernels(variant, heads, dim, dtype)
    heads_kernel = variant["kernel"] == "heads"
    assert (fwd, bwd) == ((_fwd_heads_kernel, _bwd_heads_kernel) if heads_kernel else
                          (_fwd_packed_kernel, _bwd_packed_kernel))
    rowptr = make_rowptr(BOUNDARY_SIZES)
    q, k, v = make_qkv(int(rowptr[-1]), heads, dim, dtype, seed=31)
    grad_o = make_qkv(int(rowptr[-1]), heads, dim, dtype, seed=32)[0]
    assert_matches_reference(run_exact(q, k, v, rowptr, grad_o), q, k, v, rowptr, grad_o)


def test_config_variants_keep_nan_in_its_segment(variant):
    test_nan_stays_in_its_segment(torch.float32)


@pytest.mark.parametrize("threshold", [8, 16, 32, 64])
def test_exact_threshold_plus_minus_one(threshold):
    """Only segments of size <= threshold are listed (the exact side of the switch): the
    threshold, threshold - 1 and threshold + 1 sized segments, with the shipped table's configs."""
    sizes = [threshold - 1, threshold + 1, threshold, 1, threshold + 1, threshold, 0, 2]
    rowptr = make_rowptr(sizes)
    num_rows, scale = int(rowptr[-1]), 0.3
    segments = torch.tensor([i for i, n in enumerate(sizes) if 0 < n <= threshold], device=DEVICE)
    q, k, v = make_qkv(num_rows, 2, 8, torch.float32, seed=threshold)
    grad_o = make_qkv(num_rows, 2, 8, torch.float32, seed=threshold + 1)[0]
    fwd_into, bwd_into = into_ops()
    o, dq, dk, dv = (torch.zeros_like(q) for _ in range(4))
    lse = torch.zeros(num_rows, 2, device=DEVICE)
    fwd_into(o, lse, q, k, v, rowptr, segments, None, scale)
    bwd_into(dq, dk, dv, grad_o, q, k, v, o, lse, rowptr, segments, None, scale)
    starts = rowptr.tolist()
    listed = torch.zeros(num_rows, dtype=torch.bool)
    for s in segments.tolist():
        listed[starts[s]:starts[s + 1]] = True
    listed = listed.to(DEVICE)
    exact = reference_grads(q, k, v, rowptr, grad_o, torch.float64, scale)
    for name, a, b in zip(("o", "dq", "dk", "dv"), (o, dq, dk, dv), exact):
        assert_close(a[listed], b[listed], msg=name)
        assert (a[~listed] == 0).all(), f"{name}: segments above the threshold stay untouched"


# -------------------------------------------- internal ops (segment subsets)

def into_ops():
    """The ops through the dispatcher on CUDA (Triton kernels), the backend functions on CPU."""
    if HAS_CUDA:
        return torch.ops.nt_kernels.softmax_fwd_into, torch.ops.nt_kernels.softmax_bwd_into
    return ntt.softmax_fwd_into, ntt.softmax_bwd_into


@pytest.mark.parametrize("prebuilt", [None, PLAN_BLOCK, 32], ids=["built-by-op", "prebuilt", "prebuilt-max-tile-32"])
def test_into_ops_touch_only_given_segments(prebuilt):
    rowptr = make_rowptr(MIXED_SIZES)
    segments = torch.tensor([15, 3, 0, 8, 12, 11, 6], device=DEVICE)  # unsorted, incl. empty and 64 rows
    plan = None if prebuilt is None else build_plan(rowptr, segments, int(rowptr[-1]), max_tile=prebuilt)
    check_only_given_segments(rowptr, segments, plan, dim=11, seed=11, scale=0.4)


def check_only_given_segments(rowptr, segments, plan, dim, seed, scale):
    """The internal ops on ``segments`` (with ``plan``, or their own): the given rows' o, lse and gradients
    match the float64 reference, and every other row stays zero."""
    num_rows = int(rowptr[-1])
    q, k, v = make_qkv(num_rows, 2, dim, torch.float32, seed=seed)
    grad_o = make_qkv(num_rows, 2, dim, torch.float32, seed=seed + 1)[0]
    fwd_into, bwd_into = into_ops()
    o, dq, dk, dv = (torch.zeros_like(q) for _ in range(4))
    lse = torch.zeros(num_rows, 2, device=DEVICE)
    fwd_into(o, lse, q, k, v, rowptr, segments, plan, scale)
    bwd_into(dq, dk, dv, grad_o, q, k, v, o, lse, rowptr, segments, plan, scale)

    starts = rowptr.tolist()
    given = torch.zeros(num_rows, dtype=torch.bool)
    for s in segments.tolist():
        given[starts[s]:starts[s + 1]] = True
    given = given.to(DEVICE)
    exact = reference_grads(q, k, v, rowptr, grad_o, torch.float64, scale)
    for name, a, b in zip(("o", "dq", "dk", "dv"), (o, dq, dk, dv), exact):
        assert_close(a[given], b[given], msg=name)
        assert (a[~given] == 0).all(), f"{name}: rows of other segments must stay zero"
    assert (lse[~given] == 0).all()
    scores = [torch.logsumexp(scale * torch.einsum("hd,jhd->hj", q[i].double(),
                                                   k[starts[s]:starts[s + 1]].double()), -1)
              for s in sorted(segments.tolist()) for i in range(starts[s], starts[s + 1])]
    assert_close(lse[given], torch.stack(scores), msg="lse")


# ----------------------------------------------------------------- CUDA only

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def random_graph(num_seg, max_size, seed):
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(0, max_size + 1, (num_seg,), generator=gen)
    sizes[:: max(num_seg // 4, 1)] = 300  # a few long segments
    return sizes.tolist()


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dim", [32, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_larger_graphs(dim, dtype):
    rowptr = make_rowptr(random_graph(200, 40, dim))
    q, k, v = make_qkv(int(rowptr[-1]), 4, dim, dtype, seed=dim)
    grad_o = make_qkv(int(rowptr[-1]), 4, dim, dtype, seed=dim + 1)[0]
    assert_matches_reference(run_exact(q, k, v, rowptr, grad_o), q, k, v, rowptr, grad_o)


@pytest.mark.cuda
@needs_cuda
def test_cuda_backward_is_deterministic():
    rowptr = make_rowptr(random_graph(300, 60, 1))
    q, k, v = make_qkv(int(rowptr[-1]), 4, 32, torch.float32, seed=2)
    grad_o = make_qkv(int(rowptr[-1]), 4, 32, torch.float32, seed=3)[0]
    first = run_exact(q, k, v, rowptr, grad_o)
    second = run_exact(q, k, v, rowptr, grad_o)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.cuda
@needs_cuda
def test_cuda_tf32_flag_follows_torch():
    """float32 follows torch's global TF32 matmul flag, as torch.matmul does (nt_kernels/backends/triton/
    register.py, common.dot_precision): with torch.backends.cuda.matmul.allow_tf32 off the kernels run in full
    precision and the float32 rule of tests/helpers.py holds; with it on they run plain TF32, and the output's
    error against the float64 reference is within the accuracy rule of tests/helpers.py (at most twice that of
    PyTorch plus the float32 floor) against the plain PyTorch composition (the loop reference: QKᵀ, softmax per
    segment, PV) run on the same device with the flag on, and strictly above the flag-off error: the kernels
    are deterministic, so a flag they ignored would give the flag-off output again."""
    rowptr = make_rowptr(random_graph(100, 40, 4))
    q, k, v = make_qkv(int(rowptr[-1]), 2, 32, torch.float32, seed=4)
    want = reference(q.double(), k.double(), v.double(), rowptr)
    previous = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        o_full, torch_full = nt_kernels.segment_softmax_attention(q, k, v, rowptr), reference(q, k, v, rowptr)
        torch.backends.cuda.matmul.allow_tf32 = True
        o_tf32, torch_tf32 = nt_kernels.segment_softmax_attention(q, k, v, rowptr), reference(q, k, v, rowptr)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    assert o_full.dtype == o_tf32.dtype == torch.float32
    assert_close(o_full, want, msg="o, allow_tf32 off")
    full, tf32, torch_error = max_error(o_full, want), max_error(o_tf32, want), max_error(torch_tf32, want)
    assert torch_error > max_error(torch_full, want), (
        f"PyTorch's own matmuls ignored allow_tf32 (error {torch_error:.3g} with it on): no TF32 baseline")
    assert_low_precision(o_tf32, want, torch_tf32, None, dtype=torch.float32,
                         msg="o, allow_tf32 on (baseline: PyTorch's QKᵀ, softmax, PV with allow_tf32 on)")
    assert tf32 > full, f"allow_tf32 ignored: error {tf32:.3g} with it on, {full:.3g} with it off"


@triton.jit
def _round_tf32_kernel(x_ptr, y_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(y_ptr + i, round_tf32(tl.load(x_ptr + i)))


def test_tf32_operands_round_to_nearest_ties_away():
    """common.round_tf32, what the TF32 dots feed the tensor cores: 10 mantissa bits, to nearest, ties away
    from zero (cuBLAS's conversion), not the truncation the tensor cores would apply to raw float32 bits."""
    ulp = 2.0 ** -10  # of TF32 at 1
    x = torch.tensor([1 + ulp / 2, 1 + ulp / 2 - 2 ** -23, 1 + ulp / 2 + 2 ** -23, -(1 + ulp / 2), 1 + 0.3 * ulp,
                      3.0, 0.0, -0.0, 1e-30, 6.0e4 + 7.0, 2.0 ** -126 * 1.5, 1 + 0.7 * ulp], device=DEVICE)
    x = torch.cat([x, torch.randn(4, device=DEVICE)])
    y = torch.empty_like(x)
    _round_tf32_kernel[(1,)](x, y, N=16)
    want = [1 + ulp, 1.0, 1 + ulp, -(1 + ulp), 1.0, 3.0, 0.0, -0.0, None, None, 2.0 ** -126 * 1.5, 1 + ulp]
    for i, w in enumerate(want):
        if w is not None:
            assert y[i].item() == w, (i, x[i].item(), y[i].item(), w)
    bits = y.cpu().view(torch.int32)
    assert torch.all(bits & 0x1FFF == 0)                                       # 13 low bits dropped
    assert torch.all((y - x).abs() <= x.abs() * 2.0 ** -11 * (1 + 2 ** -10))  # within half a TF32 ulp


@pytest.mark.skipif(HAS_CUDA, reason="the interpreter's shortcuts of tests/conftest.py apply without a GPU")
def test_interpreter_shortcuts_leave_the_kernels_results_bitwise_unchanged(monkeypatch):
    """The conftest's interpreter shortcuts (no re-patching inside a launch, a memoised dtype map) are
    installed, and with Triton's own functions put back the exact kernels give the same bits: packed and
    multi-tile segments, forward and backward, bf16 (its emulated dots and casts, the dtype map's widest use)."""
    import conftest

    assert {name for _, name, _ in conftest.INTERPRETER_ORIGINALS} == {"_patch_lang", "__call__", "_get_np_dtype"}
    rowptr = make_rowptr(MIXED_SIZES)
    q, k, v = make_qkv(int(rowptr[-1]), 2, 16, torch.bfloat16, seed=4)
    grad_o = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    fast = run_exact(q, k, v, rowptr, grad_o)
    assert all(torch.isfinite(x).all() and x.abs().amax() > 0 for x in fast)
    for owner, name, original in conftest.INTERPRETER_ORIGINALS:
        monkeypatch.setattr(owner, name, original)
    slow = run_exact(q, k, v, rowptr, grad_o)
    for name, a, b in zip(("o", "dq", "dk", "dv"), fast, slow):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), name


@pytest.mark.cuda
@needs_cuda
def test_cuda_opcheck():
    rowptr = make_rowptr(MIXED_SIZES)
    q, k, v = make_qkv(int(rowptr[-1]), 2, 16, torch.float32, seed=9, requires_grad=True)
    segments = torch.arange(len(MIXED_SIZES), device=DEVICE)
    plan = build_plan(rowptr, segments, int(rowptr[-1]))
    none = torch.empty(0, dtype=torch.long, device=DEVICE)
    torch.library.opcheck(torch.ops.nt_kernels.attention_fwd.default,
                          (q, k, v, rowptr, segments, none, plan, None, 0.25, 1e-4))


@pytest.mark.cuda
@needs_cuda
def test_cuda_compile_fullgraph():
    rowptr = make_rowptr(MIXED_SIZES)
    q, k, v = make_qkv(int(rowptr[-1]), 2, 16, torch.float32, seed=10)
    grad_o = make_qkv(int(rowptr[-1]), 2, 16, torch.float32, seed=11)[0]
    csr = nt_kernels.NeighbourhoodCSR.from_edge_index(
        torch.stack([torch.repeat_interleave(torch.arange(len(MIXED_SIZES)), torch.tensor(MIXED_SIZES)),
                     torch.zeros(int(rowptr[-1]), dtype=torch.long)]).to(DEVICE), len(MIXED_SIZES))
    nt_kernels.segment_softmax_attention(q, k, v, csr)  # builds the split and the plan outside the graph
    compiled = torch.compile(lambda q, k, v: nt_kernels.segment_softmax_attention(q, k, v, csr), fullgraph=True)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    o = compiled(*leaves)
    o.backward(grad_o)
    ours = [o.detach()] + [x.grad for x in leaves]
    assert_matches_reference(ours, q, k, v, rowptr, grad_o)
