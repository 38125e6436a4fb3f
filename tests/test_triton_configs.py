"""The Triton config table (nt_kernels/backends/triton/configs.py) and ``nt-kernels tune`` without a GPU.

The table's lookup and heuristic fallback, its validation, writing and reading,
the candidate lists, and the tuner's selection and table merge driven by a fake
timer.  The kernels themselves run under these configs in tests/test_triton.py;
scripts/triton_check.py compiles every table entry for its architecture.
"""
import math

import pytest
import torch

from nt_kernels import cli
from nt_kernels.apps import tune
from nt_kernels.backends.triton import configs


@pytest.fixture
def table_file(tmp_path, monkeypatch):
    """Install a table file through NT_KERNELS_TRITON_CONFIGS for one test (caches cleared around it)."""
    def install(table):
        path = tmp_path / "table.py"
        configs.write_table(table, path, header="test table")
        monkeypatch.setenv("NT_KERNELS_TRITON_CONFIGS", str(path))
        configs.clear_cache()
        return path
    yield install
    monkeypatch.delenv("NT_KERNELS_TRITON_CONFIGS", raising=False)
    configs.clear_cache()


def one_entry_table(key: str, config: dict, arch: str = "sm_90") -> dict:
    return {"version": configs.TABLE_VERSION, "archs": {arch: {"source": "test", "entries": {key: config}}}}


HEAD = {"kernel": "head", "num_warps": 8, "num_stages": 2}
PER_HEAD = {"kernel": "head", "num_warps": 4, "num_stages": 1}


def test_shipped_table_is_valid_and_versioned():
    table = configs.read_table(configs.TABLE_PATH)
    assert configs.validate_table(table) == []
    assert table["version"] == configs.TABLE_VERSION
    assert {"sm_80", "sm_89", "sm_90"} <= set(table["archs"])
    for section in table["archs"].values():
        assert section["source"] and section["entries"]


def test_missing_entry_falls_back_to_the_heuristic(table_file):
    table_file(one_entry_table("fwd_packed/fp32/d8/t16", HEAD))
    config, source = configs.lookup("fwd_packed", "fp32", 8, "t16", 90)
    assert (config, source) == (HEAD, "table")
    for key in [("fwd_packed", "fp32", 8, "t32", 90), ("fwd_packed", "bf16", 8, "t16", 90),
                ("fwd_packed", "fp32", 16, "t16", 90), ("fwd_packed", "fp32", 8, "t16", 80)]:
        config, source = configs.lookup(*key)
        assert source == "heuristic", key
        assert config == configs.heuristic(*key)
    # choose() (what the launchers call) gives the same: the entry, else the heuristic.
    assert configs.choose("fwd_packed", torch.float32, 7, 16, 90) == HEAD
    assert configs.choose("fwd_packed", torch.float32, 7, 32, 90) == configs.heuristic("fwd_packed", "fp32", 8,
                                                                                         "t32", 90)


def test_empty_table_gives_the_heuristic_everywhere(monkeypatch):
    monkeypatch.setenv("NT_KERNELS_TRITON_CONFIGS", "none")
    configs.clear_cache()
    try:
        assert configs.lookup("bwd_dq", "bf16", 32, "multi", 90) == (
            configs.heuristic("bwd_dq", "bf16", 32, "multi", 90), "heuristic")
    finally:
        monkeypatch.delenv("NT_KERNELS_TRITON_CONFIGS")
        configs.clear_cache()


@pytest.mark.parametrize("kernel", sorted(configs.KERNELS))
def test_heuristic_is_documented_first_candidate(kernel):
    size = "multi" if configs.KERNELS[kernel][0] == "multi" else "t16"
    for dim_class in (1, 8, 32, 64, 256):
        cands = configs.candidates(kernel, "bf16", dim_class, size)
        assert cands[0] == configs.heuristic(kernel, "bf16", dim_class, size, 90)
        assert len(cands) == len({repr(c) for c in cands}), "no duplicates"
        table = one_entry_table(configs.table_key(kernel, "bf16", dim_class, size), cands[-1])
        assert configs.validate_table(table) == []
    if size == "multi":
        inner = "BLOCK_M" if kernel == "bwd_dkdv" else "BLOCK_N"
        assert configs.heuristic(kernel, "fp32", 64, size, 90) == {inner: 32, "num_warps": 4, "num_stages": 1}
    else:  # the per-head kernel for every head dim; the whole-row kernel only as a candidate the tuner times
        for dim_class in (1, 8, 32, 64):
            assert configs.heuristic(kernel, "fp32", dim_class, size, 90)["kernel"] == "head"
            assert any(c["kernel"] == "heads" for c in configs.candidates(kernel, "fp32", dim_class, size))


def test_candidates_offer_cuda_cores_only_for_small_head_dims():
    small = configs.candidates("fwd_packed", "bf16", 4, "t16")
    large = configs.candidates("fwd_packed", "bf16", 8, "t16")
    assert {c.get("dot") for c in small if c["kernel"] == "heads"} == {0, 1}
    assert {c.get("dot") for c in large if c["kernel"] == "heads"} == {1}


@pytest.mark.parametrize("heads, dim_class, tile, elems, tiles", [
    (4, 8, 16, 4096, 4),     # 4 heads x 16 rows x max(16 rows, D padded to 16 for tl.dot) = 1024 per tile
    (3, 8, 16, 4096, 4),     # H padded to 4
    (1, 1, 16, 1024, 4),     # head dim 1 padded to 16 for tl.dot
    (4, 32, 32, 4096, 1),    # 4 x 32 x max(32, 32)
    (4, 32, 64, 4096, 0),    # the 64 x 64 scores of 4 heads need 16384: the per-head kernel runs
    (16, 8, 16, 8192, 2)])
def test_heads_tiles_fill_the_budget(heads, dim_class, tile, elems, tiles):
    config = {"kernel": "heads", "tile_elems": elems, "dot": 1, "num_warps": 4, "num_stages": 1}
    assert configs.heads_tiles(config, heads, dim_class, tile) == tiles
    # Without tl.dot D is padded only to a power of two; the tile's scores then set the size.
    cuda_cores = dict(config, dot=0)
    assert configs.heads_tiles(cuda_cores, 1, 64, 16) == elems // (16 * 64)
    assert configs.heads_tiles(cuda_cores, 1, 1, 16) == configs.heads_tiles(config, 1, 1, 16)


@pytest.mark.parametrize("table, message", [
    ({"version": 0, "archs": {}}, "table version must be 1"),
    ({"version": 1}, "no 'archs' dict"),
    (one_entry_table("fwd_packed/fp32/d8/t16", HEAD, arch="gfx90"), "not of the form sm_<cc>"),
    (one_entry_table("fwd_packed/fp32/d8/t16", HEAD, arch="sm_75"), "unknown architecture"),
    (one_entry_table("fwd_packed/fp32/d8", HEAD), "malformed key"),
    (one_entry_table("fwd_paced/fp32/d8/t16", HEAD), "unknown kernel"),
    (one_entry_table("fwd_packed/fp64/d8/t16", HEAD), "unknown dtype"),
    (one_entry_table("fwd_packed/fp32/d12/t16", HEAD), "not a power of two"),
    (one_entry_table("fwd_packed/fp32/d8/multi", HEAD), "size class 'multi'"),
    (one_entry_table("fwd_multi/fp32/d8/multi", {"BLOCK_N": 48, "num_warps": 4, "num_stages": 1}),
     "BLOCK_N = 48 not in"),
    (one_entry_table("fwd_multi/fp32/d8/multi", {"num_warps": 4, "num_stages": 1}), "missing BLOCK_N"),
    (one_entry_table("fwd_packed/fp32/d8/t16", {"kernel": "heads", "num_warps": 4, "num_stages": 1}),
     "missing dot"),
    (one_entry_table("fwd_packed/fp32/d8/t16", dict(HEAD, BLOCK_X=1)), "unknown parameter BLOCK_X")],
    ids=["version", "no-archs", "arch-name", "arch-unknown", "key-parts", "kernel", "dtype", "dim-class",
         "size", "value", "missing", "missing-heads-param", "unknown-param"])
def test_invalid_tables_are_rejected(table, message, tmp_path):
    errors = configs.validate_table(table)
    assert any(message in e for e in errors), errors
    with pytest.raises(ValueError, match="refusing to write an invalid config table"):
        configs.write_table(table, tmp_path / "bad.py")


def test_invalid_table_file_is_rejected_on_load(tmp_path, monkeypatch):
    path = tmp_path / "bad.py"
    path.write_text('TABLE = {"version": 1, "archs": {"sm_90": {"entries": {"fwd_multi/fp32/d8/multi": {}}}}}\n')
    monkeypatch.setenv("NT_KERNELS_TRITON_CONFIGS", str(path))
    configs.clear_cache()
    try:
        with pytest.raises(ValueError, match="(?s)is invalid:.*missing BLOCK_N"):
            configs.load_table()
    finally:
        monkeypatch.delenv("NT_KERNELS_TRITON_CONFIGS")
        configs.clear_cache()
    path.write_text("import os\n")
    with pytest.raises(ValueError, match="no 'TABLE = {...}' assignment"):
        configs.read_table(path)


def test_table_file_is_read_without_executing_it(tmp_path):
    path = tmp_path / "table.py"
    path.write_text('TABLE = {"version": __import__("os").getpid()}\n')
    with pytest.raises(ValueError):
        configs.read_table(path)


# ----------------------------------------------------------------- nt-kernels tune

def test_tune_keys_collapse_head_dims_and_skip_foreign_sizes():
    keys = tune.tune_keys(["fp32"], [7, 8, 32], ["fwd_packed", "bwd_dq"], ["t16", "multi"])
    assert keys == [("fwd_packed", "fp32", 8, "t16"), ("bwd_dq", "fp32", 8, "multi"),
                    ("fwd_packed", "fp32", 32, "t16"), ("bwd_dq", "fp32", 32, "multi")]


def test_tune_picks_the_fastest_and_writes_a_table_the_launchers_read(table_file, tmp_path):
    keys = tune.tune_keys(["bf16"], [8], ["fwd_packed", "fwd_multi"], ["t16", "t32", "multi"])
    wanted = {configs.table_key(*key): configs.candidates(*key)[-1] for key in keys}
    broken = configs.candidates(*keys[0])[1]

    def fake_time(key, config):
        """The last candidate is fastest; one candidate fails to launch (out of resources, say)."""
        if key == keys[0] and config == broken:
            raise RuntimeError("out of resources")
        return 1.0 if config == wanted[configs.table_key(*key)] else 2.0

    entries, log = tune.tune_entries(keys, lambda key: configs.candidates(*key), fake_time)
    assert entries == wanted
    first = log[0]
    assert first["best_ms"] == 1.0 and first["first_ms"] == 2.0
    assert any(c["error"].startswith("RuntimeError: out of resources") and math.isinf(c["ms"])
               for c in first["candidates"])

    base = configs.read_table(configs.TABLE_PATH)
    table = tune.merge_table(base, 90, entries, "fake timer")
    assert table["archs"]["sm_80"] == base["archs"]["sm_80"], "other architectures are kept"
    assert table["archs"]["sm_90"]["source"] == "fake timer"
    path = table_file(table)
    assert configs.read_table(path) == table
    for key in keys:
        kernel, dtype, dim_class, size = key
        tile = None if size == "multi" else int(size[1:])
        assert configs.lookup(*key, 90) == (wanted[configs.table_key(*key)], "table")
        assert configs.choose(kernel, torch.bfloat16, dim_class, tile, 90) == wanted[configs.table_key(*key)]


def test_tune_leaves_a_key_without_a_working_candidate_to_the_heuristic():
    key = ("bwd_dkdv", "fp32", 8, "multi")
    entries, log = tune.tune_entries([key], lambda k: configs.candidates(*k),
                                     lambda k, c: (_ for _ in ()).throw(RuntimeError("no")))
    assert entries == {} and log[0]["best"] is None


def test_on_line_autotuning_is_opt_in(monkeypatch):
    """NT_KERNELS_TRITON_AUTOTUNE=1 times every candidate on the first call of a key; otherwise the table."""
    timed = []

    def fake_time(config):
        """The per-head kernel at 4 warps is fastest; the 8-warp one fails to launch (skipped)."""
        timed.append(config)
        if config == dict(PER_HEAD, num_warps=8):
            raise RuntimeError("out of resources")
        return 0.5 if config == PER_HEAD else 1.0

    configs.clear_cache()
    monkeypatch.delenv("NT_KERNELS_TRITON_AUTOTUNE", raising=False)
    assert configs.choose("fwd_packed", torch.float16, 16, 16, 90, time_config=fake_time) == configs.heuristic(
        "fwd_packed", "fp16", 16, "t16", 90)
    assert timed == []
    monkeypatch.setenv("NT_KERNELS_TRITON_AUTOTUNE", "1")
    configs.clear_cache()
    try:
        assert configs.choose("fwd_packed", torch.float16, 16, 16, 90, time_config=fake_time) == PER_HEAD
        assert len(timed) == len(configs.candidates("fwd_packed", "fp16", 16, "t16"))
        configs.choose("fwd_packed", torch.float16, 16, 16, 90, time_config=fake_time)
        assert len(timed) == len(configs.candidates("fwd_packed", "fp16", 16, "t16")), "timed once per key"
    finally:
        configs.clear_cache()


def test_minimum_bytes_and_roofline_row():
    # (E, H, D) = (10, 2, 4) float32: one tensor 320 B, the lse 80 B.
    assert tune.minimum_bytes("fwd_packed", 10, 2, 4, 4) == 4 * 320 + 80
    row = tune.roofline_row({"key": "fwd_packed/fp32/d4/t16", "best_ms": 1e-3}, {("fp32", 4, "t16"): 10}, 2, 0.5)
    assert row["min_bytes"] == 4 * 320 + 80 and math.isclose(row["gb_per_s"], 1.36)
    assert math.isclose(row["fraction_of_copy"], 1.36 / 0.5)
    assert "min_bytes" not in tune.roofline_row({"key": "fwd_packed/fp32/d4/t16", "best_ms": None}, {}, 2, 0.5)
    assert tune.minimum_bytes("bwd_packed", 10, 2, 4, 4) == 7 * 320 + 80
    assert tune.minimum_bytes("bwd_dq", 10, 2, 4, 4) == 6 * 320 + 2 * 80   # q, k, v, o, dO in; dq, delta out


def test_tune_class_sizes_follow_the_plan():
    assert tune.class_sizes("t16", 64) == [1, 2, 3, 4, 5, 6, 7, 8, 12, 13, 14, 15, 16]
    assert tune.class_sizes("t32", 64) == [9, 10, 24, 25, 26, 27, 28, 29, 30, 31, 32]
    assert tune.class_sizes("t64", 64)[:3] == [11, 17, 18] and tune.class_sizes("t64", 64)[-1] == 64
    assert tune.class_sizes("multi", 64)[0] == 65


def test_tune_cli_needs_a_gpu(tmp_path, capsys):
    assert cli.main(["tune", "--device", "cpu", "--out", str(tmp_path / "t.py")]) == 2
    assert "tune: needs a CUDA device" in capsys.readouterr().out
    assert not (tmp_path / "t.py").exists()


def test_tune_compile_only_refuses_the_interpreter_and_times_nothing(monkeypatch, tmp_path, capsys):
    """--compile-only compiles for the active Triton target (the bundle's compile-only sm_90 one,
    tests/test_gpu_scripts.py's perf dry run); under TRITON_INTERPRET=1 it would run the kernels instead, so it
    refuses; without it the tuner needs --out."""
    from nt_kernels.backends.triton import common

    monkeypatch.setattr(common, "INTERPRET", True)
    assert cli.main(["tune", "--compile-only", "--dtypes", "bf16", "--head-dims", "32", "--sizes", "t16"]) == 2
    assert "TRITON_INTERPRET=1 would run the kernels" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--out is required"):
        cli.main(["tune", "--device", "cpu"])


def test_tuner_launches_its_candidates_under_the_interpreter(monkeypatch):
    """The tuner's GPU part (tuning graph, lse / delta fill, launch of each candidate alone) run on
    CPU tensors under TRITON_INTERPRET=1 with do_bench replaced by one call: no launch error."""
    triton_testing = pytest.importorskip("triton.testing")
    launched = []
    monkeypatch.setattr(triton_testing, "do_bench", lambda fn, warmup, rep: (fn(), launched.append(1), 1.0)[-1])
    timer = tune.GpuTimer(torch.device("cpu"), heads=2, rows=120, warmup=1, rep=1, head_dims={8: 7})
    keys = [("fwd_packed", "fp32", 4, "t16"), ("bwd_packed", "fp32", 4, "t16"), ("fwd_multi", "bf16", 8, "multi"),
            ("bwd_dq", "bf16", 8, "multi"), ("bwd_dkdv", "bf16", 8, "multi")]
    entries, log = tune.tune_entries(keys, lambda key: configs.candidates(*key, heads=2)[:2], timer)
    assert all(c["error"] == "" for row in log for c in row["candidates"]), log
    assert len(entries) == len(keys) and len(launched) == 2 * len(keys)
    assert set(timer.row_counts) == {("fp32", 4, "t16"), ("bf16", 8, "multi")}, "one tuning graph per group"
    # class d8's tuning graph has D = 7 (--head-dims 7), and its bytes count 7 columns
    assert timer.current[1]["tensors"]["q_ptr"].shape[2] == 7 and timer.current[1]["head_dim"] == 7
    row = tune.roofline_row({"key": "bwd_dkdv/bf16/d8/multi", "best_ms": 1.0}, timer.row_counts, 2, 1.0, {8: 7})
    assert row["head_dim"] == 7 and row["min_bytes"] == tune.minimum_bytes("bwd_dkdv", row["rows"], 2, 7, 2)


def test_row_blocks_have_their_own_key_and_fall_back_to_the_64_row_tiles(table_file):
    """The opt-in row blocks (size "rows") take their own entry; without one the "t64" entry, then the
    heuristic of a 64-row tile; the validator, the candidates and the tuner's keys and graphs know them."""
    heads_cfg = {"kernel": "heads", "tile_elems": 4096, "dot": 1, "num_warps": 4, "num_stages": 1}
    assert configs.size_class("fwd_packed", configs.ROWS) == "rows" and configs.size_tile("rows") == 64
    assert configs.size_tile("t32") == 32 and configs.size_tile("multi") == 0
    table_file(one_entry_table("fwd_packed/bf16/d32/t64", HEAD))
    assert configs.lookup("fwd_packed", "bf16", 32, "rows", 90) == (HEAD, "table")
    assert configs.lookup("bwd_packed", "bf16", 32, "rows", 90) == (
        configs.heuristic("bwd_packed", "bf16", 32, "t64", 90), "heuristic")
    table = one_entry_table("fwd_packed/bf16/d32/t64", HEAD)
    table["archs"]["sm_90"]["entries"]["fwd_packed/bf16/d32/rows"] = heads_cfg
    assert configs.validate_table(table) == []
    table_file(table)
    assert configs.choose("fwd_packed", torch.bfloat16, 32, configs.ROWS, 90) == heads_cfg
    assert configs.choose("fwd_packed", torch.bfloat16, 32, 64, 90) == HEAD, "the packed tiles keep theirs"
    assert configs.candidates("fwd_packed", "bf16", 32, "rows") == configs.candidates("fwd_packed", "bf16", 32, "t64")
    assert "rows" in tune.ALL_SIZES and tune.class_sizes("rows", 64) == list(range(1, 17))
    assert ("fwd_packed", "bf16", 8, "rows") in tune.tune_keys(["bf16"], [8], ["fwd_packed"], ["rows"])
