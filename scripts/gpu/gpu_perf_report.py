"""perf.json and the printed table of scripts/gpu/gpu_perf.sh, from the JSON its stages wrote so far.

    python scripts/gpu/gpu_perf_report.py WORK OUT_JSON     (env STAGES="name=status=seconds ...", TOTAL)

Called after every stage, so a run stopped at any point still leaves perf.json with what finished.
"""
from __future__ import annotations

import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_triton  # noqa: E402


def load(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def op_summary(doc) -> dict | None:
    if not doc:
        return None
    rows = {r["backend"]: {k: r.get(k) for k in ("status", "forward_ms", "forward_backward_ms", "peak_memory_bytes",
                                                  "max_abs_error")} for r in doc["results"]}
    g = doc["graph"]
    return {"command": doc["command"], "graph": {k: g.get(k) for k in ("name", "num_nodes", "num_edges", "segments")},
            "settings": {k: doc["settings"].get(k) for k in ("heads", "head_dim", "dtype", "subset")}, "backends": rows}


def collect(work: str) -> dict:
    stages = {}
    for item in os.environ.get("STAGES", "").split():
        name, status, seconds = item.split("=")
        stages[name] = {"status": status, "seconds": int(seconds)}
    powerlaw = [load(p) for p in sorted(glob.glob(f"{work}/json/perf-powerlaw/*.json"))]
    records = gpu_triton.read_log([f"{work}/logs/triton.jsonl"])
    return {"total_seconds": int(os.environ.get("TOTAL", 0)), "stages": stages,
            "layer": load(f"{work}/json/perf-layer.json"),
            **{f"layer_{os.path.basename(p)[11:-5]}": load(p) for p in sorted(glob.glob(f"{work}/json/perf-layer-*.json"))},
            "op_exact": op_summary(load(f"{work}/json/perf-op-exact.json")),
            "op_exact_blocks": op_summary(load(f"{work}/json/perf-op-exact-blocks.json")),
            "op_performer": op_summary(load(f"{work}/json/perf-op-performer.json")),
            **{f"op_performer_{os.path.basename(p)[18:-5]}": op_summary(load(p))
               for p in sorted(glob.glob(f"{work}/json/perf-op-performer-*.json"))},
            "roofline": load(f"{work}/json/perf-roofline.json"),
            "roofline_blocks": load(f"{work}/json/perf-roofline-blocks.json"),
            "steps": load(f"{work}/json/perf-steps.json"),
            "tune": load(f"{work}/json/perf-tune.json"),
            "powerlaw": powerlaw[0] if powerlaw else None,
            "triton": {name: gpu_triton.counts(records, name) for name in stages}}


def fmt(value, spec=".2f", unit="") -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"


def mib(value):
    return None if value is None else value / 2**20


def host_share(entry: dict):
    """The profiled step's time that no kernel covers (step - summed kernel time), or None."""
    if entry.get("profiled_step_ms") is None or entry.get("profiled_kernel_ms") is None:
        return None
    return entry["profiled_step_ms"] - entry["profiled_kernel_ms"]


def table(doc: dict) -> str:
    lines = ["", "== gpu_perf summary " + " ".join(f"{k}={v['status']}({v['seconds']} s)"
                                                   for k, v in doc["stages"].items())]
    for layer in [doc[k] for k in doc if k == "layer" or k.startswith("layer_")]:
        if not layer:
            continue
        for e in layer["variants"]:
            top = e.get("top_kernels", [])[:3]
            peak = fmt(mib(e.get("peak_memory_bytes")), ",.0f", " MiB")
            lines.append(f"layer {layer['graph']} {layer['dtype']} {e['variant']:18s} step "
                         f"{fmt(e.get('step_ms'), '.1f', ' ms')} ({fmt(e.get('speedup_vs_unfused'), '.2f', 'x')} "
                         f"unfused), peak {peak} [{e.get('status')}]; profiled step "
                         f"{fmt(e.get('profiled_step_ms'), '.1f', ' ms')} = kernels "
                         f"{fmt(e.get('profiled_kernel_ms'), '.1f', ' ms')} + host "
                         f"{fmt(host_share(e), '.1f', ' ms')}; top: "
                         + "; ".join(f"{t['name'][:40]} {t['ms']:.1f} ms" for t in top))
        if "fused_speedup" in layer:
            lines.append(f"layer {layer['graph']}: fused {layer['fused_speedup']:.2f}x faster per step than unfused")
    steps = doc.get("steps")
    if steps:
        lines.append("steps: " + "; ".join(f"{k} {json.dumps(steps.get(k))[:160]}"
                                           for k in ("compiles", "syncs", "cuda_graph")))
    for key in [k for k in doc if k.startswith("op_")]:
        op = doc[key]
        if op:
            cells = [f"{name} {fmt(r.get('forward_backward_ms'), '.2f')}/{fmt(r.get('forward_ms'), '.2f')} ms"
                     + ("" if r["status"] == "ok" else f" [{r['status'][:30]}]") for name, r in op["backends"].items()]
            s = op["settings"]
            label = key[3:].replace("_", " ")  # exact, exact blocks, performer, performer float32
            lines.append(f"op {label:16s} H={s['heads']} D={s['head_dim']} {s['dtype']} (fwd+bwd/fwd): "
                         + ", ".join(cells))
    for label, roof in (("roofline", doc["roofline"]), ("roofline (row blocks)", doc.get("roofline_blocks"))):
        if not roof:
            continue
        lines.append(f"{label} E={roof['num_edges']:,} {roof['dtype']}: fwd {roof['forward_ms']:.2f} ms = "
                     f"{roof['forward_gb_per_s']:.0f} GB/s = {100 * roof['fraction_of_copy_bandwidth']:.0f}% of copy "
                     f"{roof['copy_gb_per_s']:.0f} GB/s; fwd+bwd {roof['forward_backward_ms']:.2f} ms"
                     + (f" = {100 * roof['forward_backward_fraction_of_copy_bandwidth']:.0f}% of copy"
                        if "forward_backward_fraction_of_copy_bandwidth" in roof else ""))
    tune = doc.get("tune")
    for row in tune["keys"] if tune else []:  # nt-kernels tune --timings: the fastest candidate per key
        lines.append(f"tune {row['key']:24s} best {fmt(row.get('best_ms'), '.3f', ' ms')} (first "
                     f"{fmt(row.get('first_ms'), '.3f', ' ms')}), {fmt(row.get('fraction_of_copy'), '.0%')} of copy: "
                     f"{json.dumps(row.get('best'))}")
    pl = doc["powerlaw"]
    if pl:
        for e in pl["results"]:
            messages = pl["graph"].get("num_messages")
            lines.append(f"powerlaw {fmt(messages, ',d')} messages {e['variant']}: step "
                         f"{fmt(e.get('step_ms'), ',.0f', ' ms')} (timed {e.get('step_ms_runs')}, warm-up "
                         f"{e.get('warmup_ms_runs')}), peak {fmt(mib(e.get('peak_memory_bytes')), ',.0f', ' MiB')} "
                         f"[{e['status']}]")
    for name, c in doc["triton"].items():
        if c["loads"]:
            lines.append(f"triton {name}: {c['loads']} loads, {c['hits']} cache hits, {c['compiled']} compiled "
                         f"({c['compile_seconds']} s)")
    return "\n".join(lines)


def main() -> int:
    work, out = sys.argv[1:3]
    doc = collect(work)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    print(table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
