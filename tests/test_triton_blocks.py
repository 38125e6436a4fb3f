"""Row blocks of the Triton exact kernels (opt-in, NT_KERNELS_EXACT_BLOCKS=1; plan.py, issue 40).

Segments of at most BLOCK_SMALL rows are taken in place, as contiguous runs of packed rows (windows of
BLOCK_WINDOW start rows, at most 64 rows a tile), with a per-row segment key as the mask.  The plan must
name every listed row exactly once across packed tiles, multi-tile items and row blocks, and keep whole
segments in a block; the kernels (every packed-kernel variant of the config table) must match the loop
reference, write only the listed rows, and keep a NaN in its segment.  Without a GPU they run under
TRITON_INTERPRET=1, as in test_triton.py, whose helpers they share.
"""
import pytest
import torch

pytest.importorskip("triton", reason="the optional dependency triton (nt-kernels[triton]) is not installed")

from nt_kernels.backends.triton.plan import (  # noqa: E402
    BLOCK_SMALL, BLOCK_WINDOW, BLOCKS_ENV, PLAN_BLOCK, build_plan, check_plan, describe_plan, has_blocks, plan_length)
from test_triton import (  # noqa: E402,F401  (variant: the config-table fixture)
    BOUNDARY_SIZES, DEVICE, MIXED_SIZES, assert_matches_reference, check_only_given_segments, make_qkv,
    make_rowptr, run_exact, test_nan_stays_in_its_segment, variant)

# Small segments (1-16 rows) around larger ones (17, 20, 40, 64 and 130 rows), so that windows hold several
# small segments, start after a larger one, or end before one; BLOCK_SMALL and BLOCK_SMALL + 1 both occur.
BLOCK_SIZES = [1, 3, 16, 17, 2, 5, 0, 1, 40, 4, 4, 9, 12, 64, 1, 15, 16, 130, 2, 2, 20, 7, 1, 1, 0, 3]


def covered_rows(desc, sizes, rowptr, segments):
    """Rows each part of a described plan names; asserts that a row block holds whole small segments only."""
    starts = rowptr.tolist()
    listed = set(segments)
    covered = []
    for _, n, tile_starts in desc["packed"]:
        assert n > BLOCK_SMALL, "small segments go to the row blocks"
        for start in tile_starts:
            covered += range(start, start + n)
    for start, n, block in desc["multi"]:
        first = start + block * PLAN_BLOCK
        covered += range(first, min(start + n, first + PLAN_BLOCK))
    for first, keys in desc["blocks"]:
        assert 0 < len(keys) <= PLAN_BLOCK
        for r, key in enumerate(keys, start=first):
            if key < 0:
                continue
            seg = next(s for s in range(len(sizes)) if starts[s] == key and sizes[s] > 0)
            assert seg in listed and 1 <= sizes[seg] <= BLOCK_SMALL and starts[seg] <= r < starts[seg + 1]
            assert first <= starts[seg] and starts[seg + 1] <= first + len(keys), "a block holds whole segments"
            covered.append(r)
        window = first // BLOCK_WINDOW
        assert all(key < 0 or key // BLOCK_WINDOW == window for key in keys), "one window's segments per block"
    return covered


@pytest.mark.parametrize("sizes, subset", [
    (BLOCK_SIZES, None), (BLOCK_SIZES, [20, 3, 0, 17, 9, 15, 1, 13]), (MIXED_SIZES, None), (BOUNDARY_SIZES, None),
    ("random", None), ("random", "half")], ids=["blocks", "blocks-subset", "mixed", "boundary", "random",
                                                "random-subset"])
def test_block_plan_names_every_listed_row_once(sizes, subset):
    if sizes == "random":
        gen = torch.Generator().manual_seed(11)
        sizes = torch.randint(0, 40, (400,), generator=gen).tolist()
        subset = torch.randperm(400, generator=gen)[:230].tolist() if subset == "half" else None
    segments = list(range(len(sizes))) if subset is None else subset
    rowptr = make_rowptr(sizes)
    num_rows = int(rowptr[-1])
    plan = build_plan(rowptr, torch.tensor(segments, device=DEVICE), num_rows, blocks=True)
    assert plan.numel() == plan_length(len(segments), num_rows, PLAN_BLOCK, True)
    assert has_blocks(plan, len(segments), num_rows)
    desc = describe_plan(plan)
    assert desc["blocks"], "small segments were given"
    covered = covered_rows(desc, sizes, rowptr.cpu(), segments)
    starts = rowptr.tolist()
    expected = [r for s in segments for r in range(starts[s], starts[s + 1])]
    assert sorted(covered) == sorted(expected), "every row of the given segments exactly once"


def test_block_plan_edges():
    rowptr = make_rowptr([0, 0, 3])
    empty = build_plan(rowptr, torch.zeros(0, dtype=torch.int64, device=DEVICE), 3, blocks=True)
    assert describe_plan(empty) == {"packed": [], "multi": [], "blocks": []}
    check_plan("op", empty, torch.zeros(0, dtype=torch.int64, device=DEVICE), 3, PLAN_BLOCK)
    one = build_plan(rowptr, torch.tensor([2], device=DEVICE), 3, blocks=True)
    assert describe_plan(one)["blocks"] == [(0, [0, 0, 0])]
    plain = build_plan(rowptr, torch.tensor([2], device=DEVICE), 3)
    assert not has_blocks(plain, 1, 3) and "blocks" not in describe_plan(plain)
    with pytest.raises(ValueError, match="blocks needs max_tile = 64"):
        build_plan(rowptr, torch.tensor([2], device=DEVICE), 3, max_tile=32, blocks=True)
    with pytest.raises(ValueError, match="plan does not match the segment list"):  # a 64-row plan at a 32 cap
        check_plan("op", one, torch.tensor([2], device=DEVICE), 3, 32)


# ------------------------------------------------------- forward and gradients

def assert_blocks_used(sizes):
    rowptr = make_rowptr(sizes)
    segments = torch.arange(len(sizes), device=DEVICE)
    assert describe_plan(build_plan(rowptr, segments, int(rowptr[-1]), blocks=True))["blocks"]


@pytest.mark.parametrize("dim", [1, 9, 32, 53])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_blocks_match_reference(dim, dtype, monkeypatch):
    monkeypatch.setenv(BLOCKS_ENV, "1")
    assert_blocks_used(BLOCK_SIZES)
    rowptr = make_rowptr(BLOCK_SIZES)
    q, k, v = make_qkv(int(rowptr[-1]), 2, dim, dtype, seed=dim)
    grad_o = make_qkv(int(rowptr[-1]), 2, dim, dtype, seed=50 + dim)[0]
    assert_matches_reference(run_exact(q, k, v, rowptr, grad_o), q, k, v, rowptr, grad_o)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_blocks_under_every_config_variant(variant, dtype, monkeypatch):
    monkeypatch.setenv(BLOCKS_ENV, "1")
    rowptr = make_rowptr(BOUNDARY_SIZES)
    q, k, v = make_qkv(int(rowptr[-1]), 3, 3, dtype, seed=41)
    grad_o = make_qkv(int(rowptr[-1]), 3, 3, dtype, seed=42)[0]
    assert_matches_reference(run_exact(q, k, v, rowptr, grad_o), q, k, v, rowptr, grad_o)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_blocks_keep_nan_in_its_segment(dtype, monkeypatch):
    monkeypatch.setenv(BLOCKS_ENV, "1")
    assert_blocks_used([3, 3, 3, 70])
    test_nan_stays_in_its_segment(dtype)


@pytest.mark.parametrize("prebuilt", [False, True], ids=["built-by-op", "prebuilt"])
def test_blocks_touch_only_given_segments(prebuilt, monkeypatch):
    """Listed small segments between unlisted ones (keys -1 inside a block): only the listed rows are written."""
    monkeypatch.setenv(BLOCKS_ENV, "1")
    rowptr = make_rowptr(BLOCK_SIZES)
    segments = torch.tensor([20, 3, 0, 17, 9, 15, 1, 13, 22], device=DEVICE)
    plan = build_plan(rowptr, segments, int(rowptr[-1]), blocks=True) if prebuilt else None
    assert describe_plan(build_plan(rowptr, segments, int(rowptr[-1]), blocks=True))["blocks"]
    check_only_given_segments(rowptr, segments, plan, dim=7, seed=61, scale=0.45)


def test_blocks_run_their_own_table_entry(tmp_path, monkeypatch):
    """A table entry of size "rows" configures the row blocks' launches only (here the whole-row kernel,
    while the 64-row packed tiles keep the per-head one), and the op still matches the reference."""
    from nt_kernels.backends.triton import configs
    from nt_kernels.backends.triton.common import device_arch
    from nt_kernels.backends.triton.plan import BLOCK_CLASS
    from nt_kernels.backends.triton.packed_heads import _bwd_heads_kernel, _fwd_heads_kernel
    from nt_kernels.backends.triton.softmax_bwd import _bwd_packed_kernel, bwd_launches
    from nt_kernels.backends.triton.softmax_fwd import _fwd_packed_kernel, fwd_launches

    arch = device_arch(DEVICE)
    if arch not in configs.ARCH_SHARED_MEMORY:
        pytest.skip(f"no config table section for sm_{arch}")
    heads_cfg = {"kernel": "heads", "tile_elems": 8192, "dot": 1, "num_warps": 4, "num_stages": 1}  # 1 tile at H 2
    per_head = {"kernel": "head", "num_warps": 8, "num_stages": 1}
    entries = {configs.table_key(kernel, dtype, 8, size): heads_cfg if size == "rows" else per_head
               for kernel in ("fwd_packed", "bwd_packed") for dtype in ("fp32", "bf16") for size in ("t64", "rows")}
    path = tmp_path / "table.py"
    configs.write_table({"version": configs.TABLE_VERSION, "archs": {configs.arch_name(arch): {
        "source": "rows test", "entries": entries}}}, path)
    monkeypatch.setenv("NT_KERNELS_TRITON_CONFIGS", str(path))
    monkeypatch.setenv(BLOCKS_ENV, "1")
    configs.clear_cache()
    try:
        rowptr = make_rowptr(BLOCK_SIZES)
        q, k, v = make_qkv(int(rowptr[-1]), 2, 8, torch.float32, seed=71)
        grad_o = make_qkv(int(rowptr[-1]), 2, 8, torch.float32, seed=72)[0]
        fwd = {spec.kwargs.get("CLASS"): spec.fn for _, spec, _ in fwd_launches(q, {}, blocks=True)}
        no_args = dict.fromkeys(("bwd_packed", "bwd_dq", "bwd_dkdv"), {})  # read only when autotuning
        bwd = {spec.kwargs.get("CLASS"): spec.fn for _, spec, _ in bwd_launches(q, no_args, blocks=True)}
        assert fwd[BLOCK_CLASS] is _fwd_heads_kernel and fwd[2] is _fwd_packed_kernel
        assert bwd[BLOCK_CLASS] is _bwd_heads_kernel and bwd[2] is _bwd_packed_kernel
        assert_matches_reference(run_exact(q, k, v, rowptr, grad_o), q, k, v, rowptr, grad_o)
    finally:
        configs.clear_cache()
