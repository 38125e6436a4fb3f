"""``nt-kernels bench --layer``: the synthetic graphs, the JSON document, OOM as a status, the summary,
the results.md block and the command line.  No timing is asserted."""
from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from nt_kernels.apps.presets import preset
from nt_kernels.bench import cli as bench
from nt_kernels.bench import layer, layer_graphs, layer_report

TINY = ["--graph", "powerlaw", "--messages", "3000", "--device", "cpu", "--threads", "1"]
SMALL_MESSAGES = 20_000


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="nt-kernels")
    bench.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def _run(tmp_path: Path, *argv: str) -> dict:
    """Run ``bench --layer`` (which sets torch's thread count from --threads) and read its JSON."""
    out = tmp_path / "doc.json"
    args = _parse("--layer", *argv, "--out", str(out))
    threads = torch.get_num_threads()
    try:
        assert args.func(args) == 0
    finally:
        torch.set_num_threads(threads)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def tiny_doc(tmp_path_factory) -> dict:
    """Both variants, each in its subprocess, on a 20,000-message power-law graph: 2 timed steps after 1 warm-up."""
    return _run(tmp_path_factory.mktemp("layer"), "--graph", "powerlaw", "--messages", str(SMALL_MESSAGES),
                "--device", "cpu", "--threads", "1", "--repeats", "2", "--warmup", "1")


# ------------------------------------------------------------------ graphs
def test_degree_sequence_graph_gives_every_node_its_degree_as_centre_and_receiver():
    degrees = torch.tensor([3, 0, 1, 7, 2])
    edge_index = layer_graphs.degree_sequence_graph(degrees, seed=4)
    assert edge_index.shape == (2, 13)
    assert torch.equal(torch.bincount(edge_index[0], minlength=5), degrees)
    assert torch.equal(torch.bincount(edge_index[1], minlength=5), degrees)
    assert torch.equal(edge_index, layer_graphs.degree_sequence_graph(degrees, seed=4))
    assert not torch.equal(edge_index, layer_graphs.degree_sequence_graph(degrees, seed=5))


def test_tiled_degrees_is_the_profile_k_times_or_a_trimmed_prefix():
    profile = torch.tensor([5, 1, 0, 9, 2])
    tiled = layer_graphs.tiled_degrees(profile, 3 * 17, seed=0)
    assert torch.equal(tiled.sort().values, profile.repeat(3).sort().values)
    cut = layer_graphs.tiled_degrees(profile, 40, seed=1)
    assert int(cut.sum()) == 40
    assert all(int(d) in profile.tolist() for d in cut[:-1])
    assert 0 <= int(cut[-1]) <= int(profile.max())
    with pytest.raises(ValueError, match="messages"):
        layer_graphs.tiled_degrees(profile, 0, seed=0)


def test_powerlaw_degrees_sum_exactly_and_have_a_hub():
    degrees = layer_graphs.powerlaw_degrees(200_000, 10_000, seed=0)
    assert int(degrees.sum()) == 200_000 and int(degrees.min()) >= 1
    # w_1 / sum(w) with exponent 2.5: the hub takes far more than the mean degree of 20
    assert int(degrees.max()) > 100 * 20
    with pytest.raises(ValueError, match="too few"):
        layer_graphs.powerlaw_degrees(10, 100, seed=0)


def test_synthetic_graph_tiles_tolokers_degree_sequence():
    from nt_kernels.data import load_dataset

    tolokers = load_dataset("tolokers", directed=False, self_loops="keep")
    profile = torch.bincount(tolokers.edge_index[0], minlength=tolokers.num_nodes)
    graph = layer_graphs.build_graph("synthetic", messages=5000, seed=0)
    degrees = torch.bincount(graph.edge_index[0], minlength=graph.x.shape[0])
    assert graph.edge_index.shape[1] == 5000 and graph.x.shape == (degrees.numel(), tolokers.x.shape[1])
    assert set(degrees[:-1].tolist()) <= set(profile.tolist())
    assert graph.loss_nodes is None and "tiled" in graph.description


def test_presets_are_the_released_ones():
    for name in ("tolokers", "minesweeper"):
        released = preset(name)
        ours = layer_graphs.PRESETS[name]
        assert (ours.aggr, ours.head_dim, ours.heads, ours.num_layers, ours.dropout, ours.sep, ours.self_loops) == \
            (released.aggr, released.head_dim, released.heads, released.num_layers, released.dropout, released.sep,
             released.self_loops)
        assert not released.directed and released.attention == "switch"
    assert layer_graphs.PRESETS["synthetic"] == layer_graphs.PRESETS["tolokers"]
    power = layer_graphs.PRESETS["powerlaw"]
    assert (power.heads, power.head_dim, power.num_layers) == (4, 16, 3)


# -------------------------------------------------------------- document
RESULT_KEYS = {"variant": str, "fused": bool, "status": str, "setup_s": float, "step_ms": float,
               "step_ms_runs": list, "warmup_steps": int, "warmup_ms_runs": list, "memory_pass_ms": float,
               "peak_memory_bytes": int, "baseline_bytes": int, "peak_memory_absolute_bytes": int,
               "memory_method": str, "loss_first": float, "loss_last": float, "checkpointed": bool,
               "checkpoint_saving_bytes": int, "host_share": dict, "captured": dict}


@pytest.mark.xdist_group("tiny_doc")  # the module fixture tiny_doc once, on one worker
def test_document_schema(tiny_doc):
    doc = tiny_doc
    assert doc["schema_version"] == layer.SCHEMA_VERSION and doc["kind"] == "layer"
    assert doc["command"].startswith("nt-kernels bench --layer --graph powerlaw")
    assert f"--messages {SMALL_MESSAGES}" in doc["command"] and "--in-process" not in doc["command"]
    assert doc["device"]["type"] == "cpu" and doc["device"]["threads"] == 1
    assert set(doc["versions"]) == {"python", "torch", "triton", "nt_kernels"}
    assert {"name": "powerlaw", **asdict(layer_graphs.PRESETS["powerlaw"])} == doc["preset"]
    s = doc["settings"]
    assert (s["dtype"], s["autocast"], s["threads"], s["repeats"], s["warmup"]) == ("float32", None, 1, 2, 1)
    assert s["variants"] == ["fused", "unfused"] and s["isolation"] == "subprocess"
    assert s["memory_cap_gb"] == bench.DEFAULT_CAP_GB and s["dry_run"] is False
    assert (s["checkpoint"], s["optimizer"]) == ("auto", "Adam(lr=0.001)")
    assert [e["variant"] for e in doc["results"]] == ["fused", "unfused"]
    for entry in doc["results"]:
        assert entry["status"] == "ok", entry
        for key, kind in RESULT_KEYS.items():
            assert isinstance(entry[key], kind), (key, entry[key])
        assert len(entry["step_ms_runs"]) == 2
        assert entry["warmup_steps"] == 1 and len(entry["warmup_ms_runs"]) == 1
        assert entry["step_ms"] == pytest.approx(statistics.median(entry["step_ms_runs"]))
        assert entry["fused"] == (entry["variant"] == "fused")
        assert entry["peak_memory_absolute_bytes"] == entry["peak_memory_bytes"] + entry["baseline_bytes"]
        assert entry["checkpointed"] is False and entry["checkpoint_saving_bytes"] > 0  # far below 1 GiB
        # On the CPU neither the captured step nor the host share exists: the entries say why.
        assert entry["captured"] == {"status": "skipped: CUDA graphs need a CUDA device (the step ran on cpu)"}
        assert entry["host_share"] == {"status": "not available: the host share (step time minus summed kernel "
                                                 "time) needs a GPU's kernel times; on the cpu the host runs the "
                                                 "kernels itself"}
    assert set(doc["load_average"]) == {"start", "end"} and "capture_speedup" not in doc["summary"]


@pytest.mark.xdist_group("tiny_doc")  # the module fixture tiny_doc once, on one worker
def test_graph_statistics(tiny_doc):
    g = tiny_doc["graph"]
    num_nodes = SMALL_MESSAGES // layer_graphs.POWERLAW_AVG_DEGREE
    degrees = layer_graphs.powerlaw_degrees(SMALL_MESSAGES, num_nodes, seed=0)
    assert (g["name"], g["source"]) == ("powerlaw", "synthetic")
    assert (g["num_nodes"], g["num_messages"], g["max_degree"]) == (num_nodes, SMALL_MESSAGES, int(degrees.max()))
    from nt_kernels.performer import default_nb_features, switch_threshold

    assert g["nb_features"] == default_nb_features(16)
    assert g["threshold"] == pytest.approx(switch_threshold(g["nb_features"], 16))
    performer = degrees > g["threshold"]
    assert g["messages"] == {"exact": int(degrees[~performer].sum()), "performer": int(degrees[performer].sum())}
    assert g["segments"] == {"exact": int((~performer).sum()), "performer": int(performer.sum()), "empty": 0}


@pytest.mark.xdist_group("tiny_doc")  # the module fixture tiny_doc once, on one worker
def test_summary_ratios_come_from_the_numbers(tiny_doc):
    fused, unfused = tiny_doc["results"]
    sm = tiny_doc["summary"]
    assert (sm["fused"], sm["unfused"]) == ("ok", "ok")
    assert sm["speedup"] == pytest.approx(unfused["step_ms"] / fused["step_ms"])
    assert sm["memory_ratio"] == pytest.approx(fused["peak_memory_bytes"] / unfused["peak_memory_bytes"])
    total = {e["variant"]: e["peak_memory_bytes"] + e["baseline_bytes"] for e in (fused, unfused)}
    assert sm["memory_ratio_total"] == pytest.approx(total["fused"] / total["unfused"])


def test_summary_without_two_ok_variants_has_no_ratio():
    ok = {"variant": "fused", "status": "ok", "step_ms": 2.0, "peak_memory_bytes": 10, "baseline_bytes": 5}
    assert layer.summarize([ok, {"variant": "unfused", "status": "OOM"}]) == {"fused": "ok", "unfused": "OOM"}
    assert layer.summarize([ok]) == {"fused": "ok", "unfused": "not run"}
    both = layer.summarize([ok, {**ok, "variant": "unfused", "step_ms": 8.0, "peak_memory_bytes": 40}])
    assert (both["speedup"], both["memory_ratio"], both["memory_ratio_total"]) == (4.0, 0.25, 15 / 45)


def test_oom_under_a_tiny_memory_cap_is_a_status(tmp_path):
    """A subprocess worker under a 1 MB address-space cap: the first step's allocations fail."""
    doc = _run(tmp_path, *TINY, "--variants", "unfused", "--repeats", "1", "--warmup", "0", "--memory-cap-gb", "0.001")
    (entry,) = doc["results"]
    assert entry["status"] == "OOM", entry
    assert "allocate" in entry["detail"].lower()
    assert "step_ms" not in entry and "peak_memory_bytes" not in entry
    assert doc["summary"] == {"fused": "not run", "unfused": "OOM"}
    assert doc["settings"]["isolation"] == "subprocess" and doc["settings"]["memory_cap_gb"] == 0.001
    assert doc["graph"]["num_messages"] == 3000  # built (and reported) before the cap
    assert "--memory-cap-gb 0.001" in doc["command"] and "--variants unfused" in doc["command"]


def test_in_process_run(tmp_path):
    """--in-process: no subprocess, no address-space cap (CPU peak memory is then a lower bound)."""
    doc = _run(tmp_path, *TINY, "--variants", "fused", "--repeats", "1", "--warmup", "0", "--in-process")
    (entry,) = doc["results"]
    assert entry["status"] == "ok" and len(entry["step_ms_runs"]) == 1 and entry["warmup_ms_runs"] == []
    assert doc["settings"]["isolation"] == "in-process" and doc["settings"]["memory_cap_gb"] is None
    assert doc["summary"] == {"fused": "ok", "unfused": "not run"} and "--in-process" in doc["command"]


@pytest.mark.parametrize("warmup, repeats", [(0, 1), (2, 3)])
def test_warmup_and_repeats_are_honoured_on_the_powerlaw_graph(tmp_path, warmup, repeats):
    """Every step is recorded: ``warmup`` untimed ones, the memory pass, ``repeats`` timed ones; step_ms is
    the median of the timed ones only."""
    doc = _run(tmp_path, *TINY, "--variants", "fused", "--repeats", str(repeats), "--warmup", str(warmup),
               "--in-process")
    (entry,) = doc["results"]
    assert (doc["settings"]["warmup"], doc["settings"]["repeats"]) == (warmup, repeats)
    assert entry["status"] == "ok" and entry["warmup_steps"] == warmup
    assert len(entry["warmup_ms_runs"]) == warmup and len(entry["step_ms_runs"]) == repeats
    assert entry["step_ms"] == pytest.approx(statistics.median(entry["step_ms_runs"]))
    assert f"--warmup {warmup}" in doc["command"] and f"--repeats {repeats}" in doc["command"]


def test_checkpoint_on_is_recorded_in_the_entry_the_command_and_the_file_name(tmp_path):
    args = _parse("--layer", *TINY, "--variants", "fused", "--repeats", "1", "--warmup", "0", "--in-process",
                  "--checkpoint", "on", "--out", str(tmp_path))
    threads = torch.get_num_threads()
    try:
        assert args.func(args) == 0
    finally:
        torch.set_num_threads(threads)
    (path,) = tmp_path.glob("*.json")
    doc = json.loads(path.read_text())
    assert path.name.endswith("-layer-powerlaw-float32-m3000-checkpoint-on.json")
    assert doc["settings"]["checkpoint"] == "on" and "--checkpoint on" in doc["command"]
    (entry,) = doc["results"]
    assert entry["status"] == "ok" and entry["checkpointed"] is True
    assert "checkpoint on" in layer_report.format_table(doc)


def test_captured_results_and_host_share_in_the_table_and_the_summary():
    """What a CUDA run reports (the fields of nt_kernels.bench.layer_capture), printed and summarised."""
    entry = {"variant": "fused", "fused": True, "status": "ok", "step_ms": 24.0, "peak_memory_bytes": 2 ** 20,
             "baseline_bytes": 2 ** 21, "peak_memory_absolute_bytes": 3 * 2 ** 20,
             "host_share": {"status": "ok", "kernel_ms": 7.0, "host_ms": 17.0, "host_share": 17 / 24},
             "captured": {"status": "ok", "step_ms": 8.0, "step_ms_runs": [8.0], "kernel_ms": 7.0, "host_ms": 1.0}}
    failed = {**entry, "variant": "unfused", "fused": False,
              "captured": {"status": "error: ValueError: CapturedStep: reads a device value on the host"}}
    summary = layer.summarize([entry, failed])
    assert summary["capture_speedup"] == {"fused": 3.0}
    doc = {"graph": {"name": "g", "status": "x"}, "preset": {"name": "p", "aggr": "sum", "head_dim": 4, "heads": 1,
           "num_layers": 1, "dropout": 0.0, "sep": False}, "settings": {"dtype": "bfloat16-autocast", "threads": 16},
           "device": {"name": "GPU"}, "load_average": {"start": [0.0], "end": [0.0]}, "results": [entry, failed],
           "summary": summary}
    table = layer_report.format_table(doc)
    row = next(line for line in table.splitlines() if line.startswith("fused "))
    assert row.split()[1:6] == ["24.0", "8.0", "17.0", "7.0", "1.0"] and "3.0" in row
    assert "unfused captured step: error: ValueError: CapturedStep: reads a device value on the host" in table


def test_a_stopped_worker_reports_the_steps_it_finished():
    """The worker saves its entry after every step; on a timeout the parent reports those steps."""
    saved = {"variant": "fused", "fused": True, "graph": {"name": "powerlaw"}, "setup_s": 1.5, "warmup_steps": 2,
             "warmup_ms_runs": [31000.0, 900.0], "memory_pass_ms": 850.0, "peak_memory_bytes": 10,
             "baseline_bytes": 5, "memory_method": "m", "step_ms_runs": [800.0, 820.0, 790.0]}
    stopped = {"variant": "fused", "fused": True, "status": "timeout: > 95 s"}
    entry = layer.partial_result(stopped, saved)
    assert entry["status"] == "timeout: > 95 s" and entry["step_ms"] == 800.0
    assert entry["warmup_ms_runs"] == [31000.0, 900.0] and entry["graph"] == {"name": "powerlaw"}
    assert entry["detail"] == "stopped after 2 of 2 warm-up steps, the memory pass and 3 timed steps"
    early = layer.partial_result(stopped, {**saved, "warmup_ms_runs": [31000.0], "step_ms_runs": []})
    assert "step_ms" not in early and early["detail"].startswith("stopped after 1 of 2 warm-up steps")
    assert layer.summarize([entry]) == {"fused": "timeout: > 95 s", "unfused": "not run"}


def test_dry_run_cuts_a_real_graph_and_names_the_file(tmp_path):
    args = _parse("--layer", "--graph", "minesweeper", "--device", "cpu", "--threads", "1", "--variants", "fused",
                  "--repeats", "1", "--warmup", "0", "--in-process", "--dry-run", "--out", str(tmp_path))
    threads = torch.get_num_threads()
    try:
        assert args.func(args) == 0
    finally:
        torch.set_num_threads(threads)
    (path,) = tmp_path.glob("*.json")
    doc = json.loads(path.read_text())
    assert path.name.endswith("-layer-minesweeper-float32-dry-run.json") and doc["settings"]["dry_run"] is True
    g = doc["graph"]
    assert (g["source"], g["num_nodes"], g["max_degree"]) == ("real", layer_graphs.DRY_RUN_NODES, 8)
    assert g["description"].startswith("dry run") and g["messages"]["performer"] == 0
    assert doc["results"][0]["status"] == "ok" and "--dry-run" in doc["command"]


# ------------------------------------------------------------ text output
@pytest.mark.xdist_group("tiny_doc")  # the module fixture tiny_doc once, on one worker
def test_table_and_results_block(tiny_doc, tmp_path):
    table = layer_report.format_table(tiny_doc)
    assert f"powerlaw: N=1,000, {SMALL_MESSAGES:,} messages" in table and "faster per step" in table
    results = tmp_path / "results"
    results.mkdir()
    (results / "op-bench.json").write_text(json.dumps({"results": []}))  # not a layer document: left out
    path = results / "cpu-layer-powerlaw.json"
    path.write_text(json.dumps(tiny_doc))
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "results.md").write_text("# Results\n\ntext\n\n<!-- bench:layer -->\nold\n<!-- /bench:layer -->\n\nend\n")
    layer_report.publish([(tiny_doc, path)], docs)
    text = (docs / "results.md").read_text()
    assert text.startswith("# Results\n\ntext\n") and text.rstrip().endswith("end") and "\nold\n" not in text
    block = text[text.index("<!-- bench:layer -->"):text.index("<!-- /bench:layer -->")]
    rows = [line for line in block.splitlines() if line.startswith("| ") and "`" in line]
    assert len(rows) == 1 and "`cpu-layer-powerlaw.json`" in rows[0] and "(dry run)" not in rows[0]
    assert f"{tiny_doc['summary']['speedup']:.2f}×" in rows[0]
    assert f"{tiny_doc['summary']['memory_ratio']:.3f}" in rows[0]
    fused = tiny_doc["results"][0]
    both = f"{fused['peak_memory_bytes'] / 2**20:,.1f} / {fused['peak_memory_absolute_bytes'] / 2**20:,.1f}"
    assert both in rows[0] and "above baseline / absolute" in block
    assert f"`{tiny_doc['command']}`" in block


@pytest.mark.xdist_group("tiny_doc")  # the module fixture tiny_doc once, on one worker
def test_from_json_reprints_and_publishes(tiny_doc, tmp_path, capsys):
    path = tmp_path / "layer.json"
    path.write_text(json.dumps(tiny_doc))
    args = _parse("--layer", "--from-json", str(path), "--plot", "--docs-dir", str(tmp_path / "docs"))
    assert args.func(args) == 0
    assert "faster per step" in capsys.readouterr().out
    assert "`layer.json`" in (tmp_path / "docs" / "results.md").read_text()


# -------------------------------------------------------------- the CLI
def test_cli_parses_the_layer_options():
    args = _parse("--layer", "--graph", "tolokers,synthetic", "--dtype", "bfloat16-autocast", "--device", "cpu",
                  "--repeats", "3", "--warmup", "1", "--variants", "fused", "--messages", "1000000",
                  "--memory-cap-gb", "16", "--threads", "2", "--dry-run")
    assert (args.layer, args.graph, args.dtype, args.repeats, args.warmup) == \
        (True, "tolokers,synthetic", "bfloat16-autocast", 3, 1)
    assert (args.variants, args.messages, args.memory_cap_gb, args.threads, args.dry_run) == \
        ("fused", 1_000_000, 16.0, 2, True)
    layer.check_mode(args)
    assert layer.graph_names("all") == ["tolokers", "minesweeper", "synthetic"]
    assert layer.graph_names("powerlaw") == ["powerlaw"]
    assert "--layer" in bench.add_parser(argparse.ArgumentParser().add_subparsers()).format_help()


@pytest.mark.parametrize("argv, message", [
    (["--layer", "--heads", "2"], "--heads does not apply with --layer"),
    (["--layer", "--dtype", "float16"], "--dtype must be one of"),
    (["--messages", "10"], "--messages does not apply without --layer"),
    (["--checkpoint", "on"], "--checkpoint does not apply without --layer"),
    (["--dtype", "bfloat16-autocast"], "is for --layer"),
])
def test_cli_rejects_options_of_the_other_mode(argv, message):
    with pytest.raises(SystemExit, match=message):
        layer.check_mode(_parse(*argv))


@pytest.mark.parametrize("argv, message", [
    (["--graph", "cora"], "unknown graph 'cora'"),
    (["--variants", "fused,fast"], "--variants must be"),
    (["--variants", "fused,fused"], "--variants must be"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--messages", "0"], "--messages must be >= 1"),
])
def test_cli_rejects_bad_layer_arguments(argv, message, tmp_path):
    args = _parse("--layer", *argv, "--out", str(tmp_path))
    with pytest.raises((SystemExit, ValueError), match=message):
        args.func(args)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("graph_name", ["tolokers", "powerlaw"])
def test_released_variant_attends_as_the_op_does(graph_name):
    """The "released" variant (the paper's released layer: Algorithm 1's padded groups, alpha = 0.4, masked)
    computes every NTConv's attention as our op does (exact and Performer segments), so that the step it
    times is the same model's; only where it is computed differs."""
    from nt_kernels.csr import NeighbourhoodCSR

    graph = layer_graphs.build_graph(graph_name, messages=None if graph_name == "tolokers" else 20_000, seed=0,
                                     dry_run=True, device=torch.device("cpu"))
    csr = NeighbourhoodCSR.from_edge_index(graph.edge_index, graph.x.shape[0])
    torch.manual_seed(0)
    model = layer._model(layer.PRESETS[graph_name], graph, fused=False, released=True).double()
    conv = model.convs[0]
    assert conv._attend.func is layer._released_attention
    rows, heads, dim = csr.num_edges, conv.heads, conv.head_dim
    q, k, v = (torch.randn(rows, heads, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
               for i in range(3))
    want = type(conv)._attend(conv, q, k, v, csr)
    torch.testing.assert_close(conv._attend(q, k, v, csr), want, rtol=1e-9, atol=1e-9)
    if graph_name == "powerlaw":
        assert (torch.diff(csr.rowptr) > conv.threshold).any()  # Performer segments were compared too
