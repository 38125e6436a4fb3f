"""The JSON written by ``nt-kernels bench``: a schema, and a tiny in-process bench validated against it.

The schema is a JSON-Schema-style dict checked by the small validator below
(plain Python: ``jsonschema`` is not a dependency).  No timing is asserted.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from nt_kernels.bench import cli as bench
from nt_kernels.bench import headline
from nt_kernels.bench import plot as bench_plot

NUMBER = {"type": "number"}
INT = {"type": "integer", "minimum": 0}
STR = {"type": "string"}
OPT_NUMBER = {"type": ["number", "null"]}

RESULT = {
    "type": "object",
    "required": ["backend", "family", "alpha", "status"],
    "properties": {
        "backend": STR,
        "family": {"enum": ["fused", "performer-simt", "performer-tc", "performer-flash", "performer-gemm", "reference", "parallel", "by-size", "partitioned", "sequential", "pyg-pairs",
                            "nested", "flex", "performer-pytorch"]},
        "alpha": OPT_NUMBER,
        "status": STR,
        "forward_ms": NUMBER, "forward_backward_ms": NUMBER,
        "forward_ms_runs": {"type": "array", "items": NUMBER},
        "forward_backward_ms_runs": {"type": "array", "items": NUMBER},
        "peak_memory_bytes": INT, "memory_method": STR,
        "max_abs_error": NUMBER, "rel_error": NUMBER, "error_vs": STR,
        "padded_estimate_bytes": INT, "padded_calls": INT,
        "pairs": INT, "pairs_estimate_bytes": INT, "memory_estimate_bytes": INT, "forward_only": STR,
    },
}
OK_RESULT_REQUIRED = ["forward_ms", "forward_backward_ms", "forward_ms_runs", "forward_backward_ms_runs",
                      "peak_memory_bytes", "memory_method", "max_abs_error", "rel_error", "error_vs"]
FORWARD_ONLY_REQUIRED = ["forward_ms", "forward_ms_runs", "peak_memory_bytes", "memory_method", "max_abs_error",
                         "rel_error", "error_vs", "forward_only"]

SCHEMA = {
    "type": "object",
    "required": ["schema_version", "created", "command", "device", "versions", "graph", "settings", "results",
                 "summary"],
    "properties": {
        "schema_version": {"enum": [1]},
        "created": STR,
        "command": {"type": "string", "pattern_prefix": "nt-kernels bench"},
        "device": {"type": "object", "required": ["name", "type", "threads"],
                   "properties": {"name": STR, "type": {"enum": ["cpu", "cuda"]}, "threads": INT}},
        "versions": {"type": "object", "required": ["python", "torch", "triton", "nt_kernels"],
                     "properties": {"python": STR, "torch": STR, "triton": {"type": ["string", "null"]},
                                    "nt_kernels": STR}},
        "graph": {"type": "object",
                  "required": ["name", "source", "scale", "num_nodes", "num_edges", "max_degree",
                               "distinct_sizes", "segments"],
                  "properties": {"name": STR, "source": {"enum": ["real", "synthetic"]}, "scale": OPT_NUMBER,
                                 "num_nodes": INT, "num_edges": INT, "max_degree": INT, "distinct_sizes": INT,
                                 "segments": {"type": "object", "required": ["exact", "performer", "empty"],
                                              "properties": {"exact": INT, "performer": INT, "empty": INT}}}},
        "settings": {"type": "object",
                     "required": ["heads", "head_dim", "dtype", "device", "threads", "seed", "repeats", "warmup",
                                  "input_sets", "nb_features", "threshold", "subset", "isolation",
                                  "memory_cap_gb", "reference_max_edges"],
                     "properties": {"heads": INT, "head_dim": INT,
                                    "dtype": {"enum": ["float16", "bfloat16", "float32", "float64"]},
                                    "device": STR, "threads": INT, "seed": INT, "repeats": INT, "warmup": INT,
                                    "input_sets": INT, "nb_features": INT,
                                    "threshold": {"type": ["number", "string"]},
                                    "subset": {"enum": ["all", "exact", "performer"]},
                                    "isolation": {"enum": ["subprocess", "in-process"]},
                                    "memory_cap_gb": NUMBER, "reference_max_edges": INT}},
        "results": {"type": "array", "items": RESULT},
        "summary": {"type": "object", "required": ["fused"]},
        "load_average": {"type": "object", "required": ["start", "end"],
                         "properties": {"start": {"type": "array", "items": NUMBER},
                                        "end": {"type": "array", "items": NUMBER}}},
    },
}

_TYPES = {"object": dict, "array": list, "string": str, "null": type(None), "boolean": bool}


def _is(value, type_name: str) -> bool:
    if type_name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if type_name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, _TYPES[type_name])


def validate(value, schema: dict, path: str = "$") -> list[str]:
    """Errors of ``value`` against the schema subset used here (type, enum, required, properties, items)."""
    errors = []
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        if not any(_is(value, t) for t in types):
            return [f"{path}: expected {types}, got {type(value).__name__} {value!r}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} not in {schema['enum']}")
    if "minimum" in schema and value < schema["minimum"]:
        errors.append(f"{path}: {value} < {schema['minimum']}")
    if "pattern_prefix" in schema and not value.startswith(schema["pattern_prefix"]):
        errors.append(f"{path}: does not start with {schema['pattern_prefix']!r}")
    if isinstance(value, dict):
        errors += [f"{path}: missing {key!r}" for key in schema.get("required", []) if key not in value]
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                errors += validate(value[key], sub, f"{path}.{key}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += validate(item, schema["items"], f"{path}[{i}]")
    return errors


def check_document(doc: dict) -> list[str]:
    errors = validate(doc, SCHEMA)
    for i, entry in enumerate(doc.get("results", [])):
        if entry.get("status") == "ok":
            errors += [f"$.results[{i}]: ok result missing {key!r}" for key in OK_RESULT_REQUIRED
                       if key not in entry]
        if entry.get("status") == "ok (forward only)":
            errors += [f"$.results[{i}]: forward-only result missing {key!r}" for key in FORWARD_ONLY_REQUIRED
                       if key not in entry]
            errors += [f"$.results[{i}]: forward-only result has {key!r}" for key in
                       ("forward_backward_ms", "forward_backward_ms_runs") if key in entry]
    return errors


def _args(tmp_path, *extra) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", "--graph", "synthetic-minesweeper", "--scale", "0.01", "--repeats", "2",
                              "--warmup", "0", "--in-process", "--out", str(tmp_path / "run.json"), *extra])


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[1] / "bench" / "results").glob("*.json")),
                         ids=lambda p: p.name)
def test_committed_results_validate(path):
    assert check_document(json.loads(path.read_text())) == []


def test_validator_rejects_bad_documents():
    assert validate({"a": 1}, {"type": "object", "required": ["b"]}) == ["$: missing 'b'"]
    assert validate(True, INT)
    assert validate(math.nan, NUMBER)
    assert validate(-1, INT)
    assert validate("x", {"enum": ["y"]})


def test_tiny_bench_writes_valid_json(tmp_path, capsys):
    args = _args(tmp_path, "--backends", "fused,by-size,partitioned-0.4,sequential")
    assert args.func(args) == 0
    doc = json.loads((tmp_path / "run.json").read_text())
    assert check_document(doc) == []
    by_name = {e["backend"]: e for e in doc["results"]}
    assert list(by_name) == ["fused", "by-size", "partitioned-0.4", "sequential"]
    for name in ("by-size", "partitioned-0.4", "sequential"):
        entry = by_name[name]
        assert entry["status"] == "ok", entry
        assert len(entry["forward_backward_ms_runs"]) == 2
        assert entry["max_abs_error"] < 1e-4
        assert entry["error_vs"].startswith("loop reference")
        assert entry["padded_calls"] >= 1
    fused = by_name["fused"]
    assert fused["status"] == "ok" or fused["status"].startswith("error: fused op unavailable")
    if fused["status"] == "ok":
        assert fused["max_abs_error"] < 1e-4
    out = capsys.readouterr().out
    assert "partitioned-0.4" in out and "run.json" in out


def test_a_run_stopped_midway_keeps_the_backends_measured(tmp_path, monkeypatch):
    """--out FILE.json is rewritten after every backend but the last, marked partial, so that a run stopped by
    a time limit (the GPU scripts' stages) keeps what it measured; the finished run overwrites it."""
    from nt_kernels.bench import measure as bm

    real, calls = bm.measure_backend, []

    def stop_at_the_second(backend, *a, **kw):
        calls.append(backend.name)
        if len(calls) == 2:
            raise KeyboardInterrupt("the stage's time limit")
        return real(backend, *a, **kw)

    monkeypatch.setattr(bm, "measure_backend", stop_at_the_second)
    args = _args(tmp_path, "--backends", "by-size,sequential,parallel")
    with pytest.raises(KeyboardInterrupt):
        args.func(args)
    doc = json.loads((tmp_path / "run.json").read_text())
    assert doc["partial"] == "1 of 3 backends" and [e["backend"] for e in doc["results"]] == ["by-size"]
    assert doc["results"][0]["status"] == "ok"
    monkeypatch.setattr(bm, "measure_backend", real)
    assert args.func(args) == 0
    doc = json.loads((tmp_path / "run.json").read_text())
    assert "partial" not in doc and len(doc["results"]) == 3 and check_document(doc) == []


def test_peers_in_the_bench_json(tmp_path, capsys):
    """Every peer appears in the JSON with a valid entry: the exact peers measured against the exact
    reference (flex forward only where the build has no CPU backward), the Performer peers n/a on a graph
    with exact-path segments, and a summary naming the fastest peer."""
    args = _args(tmp_path, "--backends", "fused,pyg-pairs,nested,flex,performer-pytorch")
    assert args.func(args) == 0
    doc = json.loads((tmp_path / "run.json").read_text())
    assert check_document(doc) == []
    by_name = {e["backend"]: e for e in doc["results"]}
    assert list(by_name) == ["fused", "pyg-pairs", "nested", "flex", "performer-pytorch", "performer-pytorch-sizes"]
    assert by_name["pyg-pairs"]["pairs"] > 0 and by_name["pyg-pairs"]["pairs_estimate_bytes"] > 0
    assert by_name["nested"]["memory_estimate_bytes"] > 0 and by_name["flex"]["memory_estimate_bytes"] > 0
    for name in ("pyg-pairs", "nested", "flex"):
        entry = by_name[name]
        if entry["status"].startswith("unsupported:"):
            continue
        assert entry["status"] in ("ok", "ok (forward only)"), entry
        assert entry["max_abs_error"] < 1e-5 and entry["error_vs"].startswith("loop reference (exact)")
    if doc["device"]["type"] == "cpu" and by_name["flex"]["status"] == "ok (forward only)":
        assert "backward" in by_name["flex"]["forward_only"]
    for name in ("performer-pytorch", "performer-pytorch-sizes"):
        assert by_name[name]["status"].startswith(("n/a: graph has exact-path segments", "skipped: performer-pytorch"))
    assert doc["graph"]["segments"]["performer"] > 0        # so the exact peers do not count for the ratios
    assert "fastest_peer" not in doc["summary"]
    assert "pyg-pairs" in capsys.readouterr().out


def test_performer_subset_and_its_peers(tmp_path):
    pytest.importorskip("performer_pytorch", reason="performer-pytorch not installed (pip install 'nt-kernels[peers]')")
    args = _args(tmp_path, "--subset", "performer", "--backends", "fused,performer-pytorch")
    assert args.func(args) == 0
    doc = json.loads((tmp_path / "run.json").read_text())
    assert check_document(doc) == []
    assert doc["graph"]["segments"]["exact"] == 0 and doc["graph"]["full_graph"]["segments"]["exact"] > 0
    by_name = {e["backend"]: e for e in doc["results"]}
    assert by_name["performer-pytorch-sizes"]["status"] == "ok"
    assert by_name["performer-pytorch-sizes"]["max_abs_error"] < 1e-5          # no padding, no leak
    assert by_name["performer-pytorch"]["status"] == "ok"
    assert by_name["performer-pytorch"]["padded_calls"] >= 1
    assert doc["summary"]["fastest_peer"] in ("performer-pytorch", "performer-pytorch-sizes")
    table = headline.op_table(tmp_path, "cpu", tmp_path, tmp_path)                 # header, rule, one row
    assert table.count("\n") == 2 and f"| [{doc['summary']['fastest_peer']}: " in table


def test_memory_cap_skips_padded_strategies(tmp_path):
    args = _args(tmp_path, "--backends", "parallel,sequential", "--memory-cap-gb", "1e-9")
    assert args.func(args) == 0
    doc = json.loads((tmp_path / "run.json").read_text())
    assert check_document(doc) == []
    for entry in doc["results"]:
        assert entry["status"].startswith("skipped: est."), entry
        assert entry["padded_estimate_bytes"] > 0


def test_results_markdown_and_plot(tmp_path):
    """--plot draws the figure and writes the result file's block once (a new one in results.md); a block
    that a run page under runs/ holds is rewritten there, with the figure linked from there."""
    pytest.importorskip("matplotlib")
    args = _args(tmp_path, "--backends", "partitioned-0.4,sequential")
    assert args.func(args) == 0
    docs_dir = tmp_path / "docs"
    doc = json.loads((tmp_path / "run.json").read_text())
    for _ in range(2):
        written = bench_plot.publish([(doc, tmp_path / "run.json")], docs_dir)
    text = (docs_dir / "results.md").read_text()
    assert text.count("<!-- bench:run -->") == 1 and "](efficiency-run.png)" in text
    assert "| partitioned-0.4 |" in text
    assert (docs_dir / "efficiency-run.png").stat().st_size > 0
    assert docs_dir / "results.md" in written
    docs_dir = tmp_path / "docs-with-runs"
    (docs_dir / "runs").mkdir(parents=True)
    (docs_dir / "runs" / "cpu-run.md").write_text("# A run\n\n<!-- bench:run -->\nold\n<!-- /bench:run -->\n")
    written = bench_plot.publish([(doc, tmp_path / "run.json")], docs_dir)
    page = (docs_dir / "runs" / "cpu-run.md").read_text()
    assert docs_dir / "runs" / "cpu-run.md" in written and "\nold\n" not in page
    assert not (docs_dir / "results.md").exists()
    assert "| partitioned-0.4 |" in page and "](../efficiency-run.png)" in page


def test_outputs_default_to_the_current_directory(tmp_path, monkeypatch):
    """The installed package never writes into the repository: without --out / --docs-dir the JSON,
    the figure and results.md land in the current directory."""
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--graph", "synthetic-minesweeper", "--scale", "0.01", "--repeats", "1",
                              "--warmup", "0", "--in-process", "--backends", "sequential", "--plot"])
    assert args.func(args) == 0
    written = sorted(p.name for p in tmp_path.iterdir())
    assert len([n for n in written if n.endswith(".json")]) == 1
    assert "results.md" in written and any(n.startswith("efficiency-") and n.endswith(".png") for n in written)


def test_replace_block_keeps_other_text():
    text = "# Results\n\nintro\n"
    once = bench_plot.replace_block(text, "k", "one")
    twice = bench_plot.replace_block(once + "\nmore\n", "k", "two")
    assert "intro" in twice and "more" in twice and "two" in twice and "one" not in twice
