"""What ``nt-kernels bench --layer`` prints and publishes: the table of one run and the layer
block of the docs (docs/runs/cpu-2026-11-26-layer.md), from the JSON documents of
:mod:`nt_kernels.bench.layer`, and from the GPU runs' ``perf-layer*.json`` (``scripts/gpu/gpu_profile.py``'s
documents: more variants, no load average), which :func:`normalise` reads into the same form."""
from __future__ import annotations

import json
from pathlib import Path


def is_profile_run(doc: dict) -> bool:
    """A training-step document of ``scripts/gpu/gpu_profile.py`` (``gpu_perf.sh``'s layer stage)."""
    return isinstance(doc.get("variants"), list) and isinstance(doc.get("graph"), str)


def normalise(doc: dict) -> dict:
    """A layer document in the form of :mod:`nt_kernels.bench.layer`'s: its own documents as they are,
    ``gpu_profile.py``'s with their variants as ``results`` (``fused``, ``fused:tc``, ``unfused``, ...) and
    the speed-up and memory ratio of ``fused`` against ``unfused`` as the summary."""
    if not is_profile_run(doc):
        return doc
    results = [{key: entry.get(key) for key in ("variant", "status", "step_ms", "peak_memory_bytes", "step_ms_runs",
                                                 "warmup_ms_runs")} for entry in doc["variants"]]
    by_variant = {e["variant"]: e for e in results}
    fused, unfused = by_variant.get("fused", {}), by_variant.get("unfused", {})
    summary = {"fused": fused.get("status", "not run"), "unfused": unfused.get("status", "not run")}
    if summary["fused"] == summary["unfused"] == "ok":
        summary["speedup"] = unfused["step_ms"] / fused["step_ms"]
        summary["memory_ratio"] = fused["peak_memory_bytes"] / unfused["peak_memory_bytes"]
    preset = {"name": doc["graph"], **doc["preset"]}
    return {"kind": "layer", "source": "gpu_profile", "device": {"name": doc["device_name"], "type": doc["device"]},
            "versions": {"torch": doc["torch"]}, "graph": {"name": doc["graph"]}, "preset": preset,
            "settings": {"dtype": doc["dtype"], "dry_run": False, "warmup": doc["warmup"], "repeats": doc["repeats"]},
            "results": results, "summary": summary}


def _mib(value) -> str:
    return "–" if value is None else f"{value / 2**20:,.1f}"


def _ms(value) -> str:
    return f"{value:,.1f}"


def _graph_text(g: dict) -> str:
    if "num_messages" not in g:
        return f"{g['name']}: {g.get('status', 'graph not recorded')}"
    return (f"{g['name']}: N={g['num_nodes']:,}, {g['num_messages']:,} messages, max degree {g['max_degree']:,}; "
            f"threshold {g['threshold']:.1f}: exact {g['messages']['exact']:,} messages in "
            f"{g['segments']['exact']:,} segments, Performer {g['messages']['performer']:,} in "
            f"{g['segments']['performer']:,}")


def _preset_text(doc: dict) -> str:
    p = doc["preset"]
    return (f"{p['name']} preset: {p['aggr']}, {p['head_dim']} x {p['heads']} heads, {p['num_layers']} layers, "
            f"dropout {p['dropout']:g}{', sep' if p['sep'] else ''}")


def _ratio_text(summary: dict) -> str:
    if "speedup" not in summary:
        return f"no ratio (fused: {summary['fused']}; unfused: {summary['unfused']})"
    memory = summary["memory_ratio"]
    total = summary.get("memory_ratio_total")
    return (f"fused is {summary['speedup']:.2f}x faster per step, "
            + (f"{memory:.3f}x" if memory is not None else "n/a (unfused peak 0) x")
            + " the step's peak memory of fused=False"
            + (f" ({total:.3f}x with the baseline)" if total is not None else ""))


def _absolute(e: dict):
    """The absolute peak: the field, or (older documents) peak above the baseline plus the baseline."""
    if "peak_memory_absolute_bytes" in e:
        return e["peak_memory_absolute_bytes"]
    if e.get("peak_memory_bytes") is None or e.get("baseline_bytes") is None:
        return None
    return e["peak_memory_bytes"] + e["baseline_bytes"]


def _optional_ms(part: dict | None, key: str) -> str:
    return f"{part[key]:,.1f}" if part and part.get("status") == "ok" and part.get(key) is not None else "-"


def _notes(e: dict) -> list[str]:
    """Why the captured step and the host share were not measured (one line each), when they were not."""
    notes = []
    for key, what in (("captured", "captured step"), ("host_share", "host share")):
        part = e.get(key)
        if part and part.get("status") != "ok":
            notes.append(f"  {e['variant']} {what}: {part['status']}")
    return notes


def format_table(doc: dict) -> str:
    doc = normalise(doc)
    s = doc["settings"]
    where = doc["device"]["name"] + (f", {s['threads']} threads" if "threads" in s else "")
    if "load_average" in doc:
        where += f", load average {doc['load_average']['start'][0]:.1f} -> {doc['load_average']['end'][0]:.1f}"
    lines = [_graph_text(doc["graph"]),
             f"{_preset_text(doc)} | {s['dtype']} | checkpoint {s.get('checkpoint', 'auto')} | {where}",
             f"{'variant':18s} {'step ms':>10s} {'captured':>10s} {'host ms':>9s} {'kernel ms':>10s} "
             f"{'peak MiB':>10s} {'abs peak':>10s} {'baseline MiB':>13s}  status"]
    notes = []
    for e in doc["results"]:
        step = f"{e['step_ms']:10.1f}" if e.get("step_ms") is not None else f"{'-':>10s}"
        lines.append(f"{e['variant']:18s} {step} {_optional_ms(e.get('captured'), 'step_ms'):>10s} "
                     f"{_optional_ms(e.get('host_share'), 'host_ms'):>9s} "
                     f"{_optional_ms(e.get('host_share'), 'kernel_ms'):>10s} "
                     f"{_mib(e.get('peak_memory_bytes')):>10s} {_mib(_absolute(e)):>10s} "
                     f"{_mib(e.get('baseline_bytes')):>13s}  {e['status']}")
        notes += _notes(e)
    lines.append(_ratio_text(doc["summary"]))
    return "\n".join(lines + notes)


def layer_block(results_dir: Path) -> str:
    """The markdown table of every layer result file in ``results_dir`` (the layer block of the docs)."""
    lines = ["| device | graph | preset | dtype | fused step ms | fused=False step ms | speed-up | fused peak MiB "
             "above baseline / absolute | fused=False peak MiB above baseline / absolute | memory ratio | raw |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    commands = []
    for path in sorted(results_dir.glob("*.json")):
        doc = json.loads(path.read_text())
        if doc.get("kind") != "layer":
            continue
        by_variant, sm = {e["variant"]: e for e in doc["results"]}, doc["summary"]

        def cell(variant: str, key: str, fmt) -> str:
            entry = by_variant.get(variant)
            if entry is None:
                return "not run"
            return fmt(entry[key]) if entry["status"] == "ok" else entry["status"]

        def step(variant: str) -> str:
            text = cell(variant, "step_ms", _ms)
            captured = by_variant.get(variant, {}).get("captured") or {}
            return text + (f" (captured {_ms(captured['step_ms'])})" if captured.get("status") == "ok" else "")

        def peaks(variant: str) -> str:
            entry = by_variant.get(variant)
            if entry is None or entry["status"] != "ok":
                return cell(variant, "peak_memory_bytes", _mib)
            return f"{_mib(entry['peak_memory_bytes'])} / {_mib(_absolute(entry))}"

        ratio, speedup = sm.get("memory_ratio"), sm.get("speedup")
        checkpoint = doc["settings"].get("checkpoint", "auto")
        graph = (_graph_text(doc["graph"]) + (" (dry run)" if doc["settings"]["dry_run"] else "")
                 + ("" if checkpoint == "auto" else f" (checkpoint {checkpoint})"))
        cells = [doc["device"]["name"], graph, _preset_text(doc), doc["settings"]["dtype"],
                 step("fused"), step("unfused"),
                 "–" if speedup is None else f"{speedup:.2f}×",
                 peaks("fused"), peaks("unfused"),
                 "–" if ratio is None else f"{ratio:.3f}", f"`{path.name}`"]
        lines.append("| " + " | ".join(cells) + " |")
        load = doc["load_average"]
        commands.append(f"* `{doc['command']}` — {doc['created']}, 1-min load {load['start'][0]:.1f} → "
                        f"{load['end'][0]:.1f}, torch {doc['versions']['torch']}")
    if not commands:
        return "(no layer run yet)"
    return "\n".join(lines + ["", "Commands:", ""] + commands)


def publish(docs: list[tuple[dict, Path]], docs_dir: Path) -> Path:
    """Write the layer block from the result files next to the first document, on the page of ``docs_dir``
    that holds it (results.md when none does); the headline tables are ``nt-kernels results``'s."""
    from nt_kernels.bench.plot import write_block

    return write_block(docs_dir, "layer", layer_block(docs[0][1].parent))
