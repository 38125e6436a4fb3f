"""``nt-kernels bench --layer --profile`` (issue 31): the fused layer's CPU stage clocks, the FLOP
and byte model, the peak estimate and the interleaved per-ISA run.  No timing is asserted."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from nt_kernels._extension import cpu_paths, extension
from nt_kernels.bench import cli as bench
from nt_kernels.bench import layer_profile as lp
from nt_kernels.csr import NeighbourhoodCSR
from nt_kernels.nn import NT

SHAPE = {"layers": 2, "E": 1000, "N": 100, "C": 8, "H": 2, "D": 4, "m": 6, "C_out": 16, "F": 0,
         "aggr": "gated_sum", "dropout": True, "threshold": 10.0, "exact_rows": 400, "exact_sq": 3000,
         "performer_rows": 600, "items": 20.0}


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="nt-kernels")
    bench.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


# ------------------------------------------------------------------ stage clocks
def _train_step(model, x, csr):
    model(x, csr).sum().backward()


def test_stage_clocks_charge_both_attention_paths_and_stay_off_by_default():
    degrees = torch.tensor([1, 3, 40, 5, 2, 60])  # exact and Performer segments (threshold 13.4 at D = 4)
    centre = torch.repeat_interleave(torch.arange(6), degrees)
    csr = NeighbourhoodCSR.from_edge_index(torch.stack([centre, centre.flip(0)]), 6)
    torch.manual_seed(0)
    model = NT(3, 8, 2, 2, heads=2, aggr="gated_sum", fused=True)
    x = torch.randn(6, 3)
    ext = extension()
    ext.cpu_stage_profile(False)
    _train_step(model, x, csr)
    off = ext.cpu_stage_times()
    assert off["forward_calls"] == off["backward_calls"] == 0 and not any(off["thread_s"].values())
    ext.cpu_stage_profile(True)
    try:
        _train_step(model, x, csr)
        on = ext.cpu_stage_times()
    finally:
        ext.cpu_stage_profile(False)
    assert on["forward_calls"] == on["backward_calls"] == 2  # two layers
    assert list(on["thread_s"]) == list(lp.STAGES)
    worked = [name for name in lp.STAGES if name not in ("bwd_inputs", "bwd_reduce", "bwd_weight_sum")]
    assert all(on["thread_s"][name] > 0 for name in worked), on["thread_s"]
    # the stages run inside the kernels: with one thread their sum cannot exceed the kernels' wall time
    threads = torch.get_num_threads()
    walls = on["forward_wall_s"] + on["backward_wall_s"]
    assert sum(on["thread_s"].values()) <= threads * walls * 1.05 + 1e-4


# ------------------------------------------------------------------ cost model
def test_costs_scale_with_layers_and_vanish_without_segments():
    costs = lp.stage_costs(SHAPE)
    assert list(costs) == list(lp.STAGES)
    double = lp.stage_costs({**SHAPE, "layers": 4})
    assert all(double[k]["flops"] == 2 * costs[k]["flops"] for k in costs)
    none = lp.stage_costs({**SHAPE, "exact_rows": 0, "exact_sq": 0, "performer_rows": 0})
    for name in ("fwd_exact", "fwd_performer", "bwd_recompute_exact", "bwd_recompute_performer", "bwd_exact",
                 "bwd_performer"):
        assert costs[name]["flops"] > 0 and none[name]["flops"] == 0 and none[name]["bytes"] == 0


def test_gemm_flops_of_the_projections():
    """q/k/v: 2 E C 3C per layer; its backward 4x that (weight and input gradients of three GEMMs)."""
    s = {**SHAPE, "dropout": False}
    costs = lp.stage_costs(s)
    E, C, L = s["E"], s["C"], s["layers"]
    assert costs["fwd_prologue"]["flops"] == L * (E * C * (1 + lp.GELU_FLOPS) + 6 * E * C * C)
    assert costs["bwd_qkv"]["flops"] == L * (12 * E * C * C + 4 * E * C)
    exact = s["H"] * s["exact_sq"] * (4 * s["D"] + lp.EXP_FLOPS + 4)
    assert costs["fwd_exact"]["flops"] == L * exact


def test_peak_estimate_follows_the_isa_and_the_cpu():
    assert lp.fma_flops_per_cycle("base", "AuthenticAMD", 25)[0] == 16
    assert lp.fma_flops_per_cycle("avx2", "GenuineIntel", 6)[0] == 32
    assert lp.fma_flops_per_cycle("avx512", "AuthenticAMD", 25)[0] == 32  # Zen 4: 256-bit datapath
    assert lp.fma_flops_per_cycle("avx512", "GenuineIntel", 6)[0] == 64
    peak = lp.cpu_peak("avx2", 2, (3.0, "--clock-ghz"))
    assert peak["gflops"] == 2 * 3.0 * 32 and peak["clock_source"] == "--clock-ghz"


def test_measured_clock_is_plausible():
    clock = lp.measured_clock_ghz()
    if not clock:
        pytest.skip("the clock is measured on x86 only")
    assert 0.3 < clock < 7.0


# ------------------------------------------------------------------ the command
@pytest.fixture(scope="module")
def profile_doc(tmp_path_factory) -> tuple[dict, Path]:
    """Every ISA path this CPU runs, interleaved, on a 3,000-message power-law graph: one timed step each."""
    out = tmp_path_factory.mktemp("profile") / "doc.json"
    args = _parse("--layer", "--profile", "--graph", "powerlaw", "--messages", "3000", "--device", "cpu",
                  "--threads", "1", "--repeats", "1", "--warmup", "0", "--isa", "all", "--clock-ghz", "3",
                  "--out", str(out))
    threads = torch.get_num_threads()
    try:
        assert args.func(args) == 0
    finally:
        torch.set_num_threads(threads)
    return json.loads(out.read_text()), out


@pytest.mark.xdist_group("profile_doc")  # the module fixture profile_doc once, on one worker
def test_profile_document(profile_doc):
    doc, _ = profile_doc
    assert doc["kind"] == "layer-profile" and doc["graph"] == "powerlaw"
    assert list(doc["paths"]) == cpu_paths()["nt_kernels_isa_paths"]
    assert doc["shape"]["exact_rows"] > 0 and doc["shape"]["performer_rows"] > 0
    for isa, entry in doc["paths"].items():
        assert entry["peak"]["isa"] == isa and entry["peak"]["gflops"] == pytest.approx(
            3.0 * lp.fma_flops_per_cycle(isa, entry["peak"]["vendor"], entry["peak"]["family"])[0])
        assert len(entry["steps"]) == 1 and entry["steps"][0]["forward_calls"] == doc["shape"]["layers"]
        assert entry["thread_s"]["fwd_performer"] > 0 and entry["thread_s"]["bwd_exact"] > 0
        assert entry["forward_wall_s"] + entry["backward_wall_s"] < entry["step_s"]
    assert "--isa " + ",".join(doc["paths"]) in doc["command"]


@pytest.mark.xdist_group("profile_doc")  # the module fixture profile_doc once, on one worker
def test_profile_table_and_results_block(profile_doc, tmp_path, capsys):
    doc, path = profile_doc
    table = lp.format_table(doc)
    assert all(name in table for name in lp.STAGES) and "peak estimate" in table
    (tmp_path / "results.md").write_text("# Results\n")
    args = _parse("--profile", "--from-json", str(path), "--plot", "--docs-dir", str(tmp_path))
    assert args.func(args) == 0
    text = (tmp_path / "results.md").read_text()
    assert "<!-- bench:layer-profile-powerlaw -->" in text and "bwd_performer" in text
    assert "fwd_prologue" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--profile", "--graph", "powerlaw"], "apply with --layer"),
    (["--layer", "--profile", "--isa", "avx9"], "--isa must be 'all' or a comma list"),
    (["--layer", "--profile", "--dtype", "bfloat16-autocast"], "profiled in float32"),
    (["--layer", "--profile", "--heads", "3"], "--heads does not apply with --layer"),
])
def test_profile_rejects_bad_options(argv, message, capsys):
    args = _parse(*argv, "--device", "cpu")
    with pytest.raises(SystemExit, match=message):
        args.func(args)
