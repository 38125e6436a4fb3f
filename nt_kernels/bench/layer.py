"""``nt-kernels bench --layer``: NT training steps, fused vs ``fused=False`` (issues 13 and 14).

One run trains the NT network of a graph's preset for a few full-batch steps
(forward, cross-entropy, backward, Adam step) once per variant: ``fused``
(every NTConv with ``fused=True``: the fused NT layer op) and ``unfused``
(``fused=False``: the composition of Linear, GELU, dropout, attention op and
aggregation).  Both variants start from the same weights (same seed); their
dropout masks differ (docs/nn.md).  Each variant runs in a fresh subprocess
(``python -m nt_kernels.bench.layer SPEC.json``) that builds the graph itself.

Order of the steps in a worker, and what is counted (the same for every
graph, ``powerlaw`` included; ``step_ms`` is always a steady-state step, never
one that compiles):

* CPU: one forward+backward on a three-node graph (so thread pools and code
  pages are loaded), then the address-space cap (``--memory-cap-gb``: an
  allocation past it fails and is recorded as ``OOM``), then the memory pass
  (the first full step), then ``warmup`` untimed and ``repeats`` timed steps.
  Peak memory is the process's peak resident set during the memory pass above
  its resident size before it (:class:`nt_kernels.bench.measure.PeakMemory`):
  honest only as the first large step of a fresh process.
* CUDA: ``warmup`` warm-up steps (Triton compiles, plans are cached), the
  memory pass, then ``repeats`` timed steps; peak memory is
  ``torch.cuda.max_memory_allocated`` during the memory pass above the bytes
  allocated before it.  No cap: the device's memory is the limit.
* Every step's wall time is recorded: ``warmup_ms_runs`` (the ``warmup_steps``
  warm-up steps), ``memory_pass_ms`` and ``step_ms_runs`` (the timed ones).
  The worker rewrites its result file after every step, so a worker stopped
  by ``--timeout`` still reports the steps it finished (status ``timeout: ...``
  with the step times so far; ``step_ms`` only if a timed step finished).
* ``baseline_bytes`` is what was resident (CPU) / allocated (CUDA) before the
  memory pass: Python, torch, graph, plans, features, model;
  ``peak_memory_bytes`` + ``baseline_bytes`` is the absolute peak of the pass.
  ``step_ms`` is the median wall time of the timed steps (the device
  synchronised before each clock read), ``step_ms_runs`` every sample;
  ``setup_s`` the time to build the graph, its CSR and plans and the model.
* ``peak_memory_absolute_bytes`` is that sum, reported next to the peak
  above the baseline: every peak both ways (issue 41).
* ``--checkpoint auto|on|off`` sets NT's activation checkpointing of the
  node-level blocks (``checkpoint=None|True|False``); the entry records
  whether the step checkpointed (``checkpointed``) and the memory model's
  estimate of what it frees (``checkpoint_saving_bytes``).
* After the timed steps, on CUDA (:mod:`nt_kernels.bench.layer_capture`):
  ``host_share`` (the eager step's summed kernel time from one profiled
  step, and step time minus it) and ``captured`` (the whole step in a CUDA
  graph, ``repeats`` timed replays, and its host share).  Both variants use
  fused capturable Adam on CUDA.  On the CPU both entries say why they are
  not measured.
* An out-of-memory error is a result (``status: "OOM"``, the message in
  ``detail``), as is a worker killed by the kernel; other failures are
  ``error: ...``.  ``--in-process`` skips the subprocesses and the cap (CPU
  peaks are then lower bounds); ``--dry-run`` shrinks every graph (e.g. to
  check the GPU commands on a CPU).

Graphs and presets: :mod:`nt_kernels.bench.layer_graphs`; the printed table and the layer block of
the docs: :mod:`nt_kernels.bench.layer_report`; the headline tables: :mod:`nt_kernels.bench.headline`.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from nt_kernels.bench import measure as bm
from nt_kernels.bench.layer_capture import captured_step, eager_host_share, make_optimizer, optimizer_name
from nt_kernels.bench.layer_graphs import (DRY_RUN_MESSAGES, DRY_RUN_NODES, POWERLAW_MESSAGES, PRESETS,
                                           SYNTHETIC_COPIES, LayerGraph, LayerPreset, build_graph,
                                           degree_sequence_graph, graph_stats)
from nt_kernels.bench.layer_report import format_table, publish
from nt_kernels.csr import NeighbourhoodCSR

SCHEMA_VERSION = 1
VARIANTS = ("fused", "unfused", "released")
DEFAULT_VARIANTS = ("fused", "unfused")
RELEASED_ALPHA = 0.4  # the released code's partitioning (Algorithm 1)
DTYPES = ("float32", "bfloat16-autocast")
GRAPHS = ("tolokers", "minesweeper", "synthetic", "powerlaw")
CHECKPOINT = {"auto": None, "on": True, "off": False}
ALL_GRAPHS = ("tolokers", "minesweeper", "synthetic")  # 'all': the CPU set of issue 13
LEARNING_RATE = 1e-3


# ------------------------------------------------------------------ worker
def _model(preset: LayerPreset, graph: LayerGraph, fused: bool, checkpoint: bool | None = None,
           released: bool = False):
    """The preset's NT model; ``released``: unfused, every NTConv's attention computed as the paper's
    released layer does (size split, Algorithm 1 groups with alpha = 0.4, each padded to its longest)."""
    from nt_kernels.nn import NT

    model = NT(graph.x.shape[1], preset.head_dim * preset.heads, preset.num_layers, int(graph.y.max()) + 1,
               heads=preset.heads, dropout=preset.dropout, sep=preset.sep, aggr=preset.aggr,
               fused=fused and not released, checkpoint=checkpoint)
    if released:
        for conv in model.convs:
            conv._attend = functools.partial(_released_attention, conv)
    return model


def _released_attention(conv, q, k, v, csr) -> torch.Tensor:
    from nt_kernels.baselines.strategies import partitioned

    return partitioned(q, k, v, csr.rowptr, projection=conv.projection, threshold=conv.threshold,
                       alpha=RELEASED_ALPHA)


def _step(model, optimizer, x, y, nodes, csr, autocast: bool) -> torch.Tensor:
    """One training step: forward, cross-entropy (on ``nodes``), backward, Adam step; returns the loss."""
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(x, csr)
        loss = F.cross_entropy(logits if nodes is None else logits[nodes], y if nodes is None else y[nodes])
    loss.backward()
    optimizer.step()
    return loss.detach()


def _tiny_warmup(model, graph: LayerGraph, threshold: float, autocast: bool) -> None:
    """Forward+backward on three nodes of degrees 1, 4 and one past the threshold (both attention paths)."""
    degrees = torch.tensor([1, 4, 9 if math.isinf(threshold) else int(threshold) + 2])
    csr = NeighbourhoodCSR.from_edge_index(degree_sequence_graph(degrees, seed=0), 3)
    x = graph.x[:3].clone() if graph.x.shape[0] >= 3 else torch.randn(3, graph.x.shape[1])
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model(x, csr).float().sum().backward()
    model.zero_grad(set_to_none=True)


def _timed_step(run_step, device) -> tuple[float, float]:
    bm._sync(device)
    tick = time.perf_counter()
    loss = run_step()
    bm._sync(device)
    return time.perf_counter() - tick, float(loss)


def _setup(spec: dict, device: torch.device, entry: dict):
    """The graph, its CSR (plans built) and the variant's model; the graph statistics go into ``entry``."""
    s, preset = spec["settings"], LayerPreset(**spec["preset"])
    graph = build_graph(spec["graph"], messages=spec["messages"], seed=s["seed"], data_root=spec["data_root"],
                        dry_run=s["dry_run"], device=device)
    csr = NeighbourhoodCSR.from_edge_index(graph.edge_index, graph.x.shape[0])
    graph.edge_index = None  # the CSR holds the edges from here on
    torch.manual_seed(s["seed"])
    model = _model(preset, graph, fused=entry["fused"], checkpoint=CHECKPOINT[s.get("checkpoint", "auto")],
                   released=entry["variant"] == "released")
    model = model.to(device).train()
    threshold = model.convs[0].threshold if preset.num_layers else math.inf
    entry["graph"] = {"name": graph.name, "source": graph.source, "description": graph.description,
                      **graph_stats(csr, threshold),
                      "nb_features": model.convs[0].nb_features if preset.num_layers else None}
    model.prepare(csr, graph.x.shape[0])
    return graph, csr, model, threshold


def _no_progress(entry: dict) -> None:
    """Progress callback of an in-process run: nothing to save."""


def measure_variant(spec: dict, *, guard_memory: bool, progress=_no_progress) -> dict:
    """Build the graph and one variant's model, then measure (see the module docstring); never raises.
    ``progress(entry)`` is called with the entry so far after every step."""
    s, device = spec["settings"], torch.device(spec["settings"]["device"])
    autocast = s["dtype"] == "bfloat16-autocast"
    entry = {"variant": spec["variant"], "fused": spec["variant"] == "fused"}
    steps = []  # (seconds, loss) of every step in the order they ran
    try:
        tick = time.perf_counter()
        graph, csr, model, threshold = _setup(spec, device, entry)
        bm._sync(device)
        entry["setup_s"] = time.perf_counter() - tick
        optimizer = make_optimizer(model, LEARNING_RATE, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            entry["checkpointed"] = model.uses_checkpoint(graph.x)
            entry["checkpoint_saving_bytes"] = model.checkpoint_saving(
                graph.x.shape[0], activation=2 if autocast else 4)

        def one_step():
            return _step(model, optimizer, graph.x, graph.y, graph.loss_nodes, csr, autocast)

        def run(count: int, key: str) -> list[tuple[float, float]]:
            done = []
            for _ in range(count):
                done.append(_timed_step(one_step, device))
                steps.append(done[-1])
                entry.setdefault(key, []).append(done[-1][0] * 1e3)
                progress(entry)
            return done

        entry.update(warmup_steps=s["warmup"], warmup_ms_runs=[], step_ms_runs=[])
        if device.type == "cpu":  # the memory pass must be the first large step of the process
            _tiny_warmup(model, graph, threshold, autocast)
            if guard_memory:
                bm.limit_address_space(int(s["memory_cap_gb"] * 1e9))
        else:
            run(s["warmup"], "warmup_ms_runs")
        memory = bm.PeakMemory(device)
        run(1, "memory_pass_runs")
        peak = memory.peak()
        entry.update(peak_memory_bytes=peak, baseline_bytes=memory.baseline,
                     peak_memory_absolute_bytes=peak + memory.baseline, memory_method=memory.method,
                     memory_pass_ms=entry.pop("memory_pass_runs")[0])
        if device.type == "cpu":
            run(s["warmup"], "warmup_ms_runs")
        timed = run(s["repeats"], "step_ms_runs")
        entry["host_share"] = eager_host_share(one_step, statistics.median(t for t, _ in timed) * 1e3, device)
        entry["captured"] = captured_step(model, optimizer, graph.x, graph.y, graph.loss_nodes, csr, autocast,
                                          device, s["repeats"])
        progress(entry)
    except Exception as exc:  # noqa: BLE001  (every failure is recorded in the results)
        if bm.is_oom(exc):
            entry.update(status="OOM", detail=f"{type(exc).__name__}: {str(exc).strip()[:200]}")
        else:
            entry["status"] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
        return entry
    finite = all(math.isfinite(loss) for _, loss in steps)
    entry.update(status="ok" if finite else "error: non-finite loss",
                 step_ms=statistics.median(seconds for seconds, _ in timed) * 1e3,
                 loss_first=steps[0][1], loss_last=steps[-1][1])
    return entry


def partial_result(entry: dict, partial: dict) -> dict:
    """The result of a worker stopped by the timeout (``entry``, its status) from the last state it
    saved (``partial``): the steps it finished, ``step_ms`` the median of the timed ones if any."""
    done = {key: partial[key] for key in ("graph", "setup_s", "warmup_steps", "warmup_ms_runs", "memory_pass_ms",
                                          "peak_memory_bytes", "baseline_bytes", "peak_memory_absolute_bytes",
                                          "memory_method", "checkpointed", "checkpoint_saving_bytes", "step_ms_runs",
                                          "host_share", "captured")
            if key in partial}
    timed = done.get("step_ms_runs", [])
    detail = (f"stopped after {len(done.get('warmup_ms_runs', []))} of {done.get('warmup_steps', 0)} warm-up "
              f"steps, {'the' if 'memory_pass_ms' in done else 'no'} memory pass and {len(timed)} timed steps")
    result = {**entry, **done, "detail": detail}
    if timed:
        result["step_ms"] = statistics.median(timed)
    return result


def _write_json(path: Path, doc: dict) -> None:
    """Write ``doc`` to ``path`` atomically (a reader never sees half a file)."""
    part = path.with_suffix(".part")
    part.write_text(json.dumps(doc))
    os.replace(part, path)


def worker_main(spec_path: str) -> int:
    """Subprocess entry: measure the variant of a spec JSON and write its result JSON (the partial
    result after every step to ``progress_file``, the final one to ``result_file``)."""
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["settings"]["threads"])
    progress = Path(spec["progress_file"])
    entry = measure_variant(spec, guard_memory=True, progress=lambda partial: _write_json(progress, partial))
    _write_json(Path(spec["result_file"]), entry)
    return 0


def _run_worker(spec: dict, tmp: Path, timeout: float) -> dict:
    entry = {"variant": spec["variant"], "fused": spec["variant"] == "fused"}
    spec_file, result = tmp / f"spec-{spec['variant']}.json", tmp / f"result-{spec['variant']}.json"
    progress = tmp / f"progress-{spec['variant']}.json"
    spec_file.write_text(json.dumps({**spec, "result_file": str(result), "progress_file": str(progress)}))
    entry = bm.run_worker("nt_kernels.bench.layer", spec_file, result, timeout, entry)
    if entry["status"].startswith("timeout") and progress.is_file():
        entry = partial_result(entry, json.loads(progress.read_text()))
    return entry


# ------------------------------------------------------------------- runs
def _settings(args, device: torch.device) -> dict:
    return {"device": str(device), "dtype": args.dtype,
            "autocast": "bfloat16" if args.dtype == "bfloat16-autocast" else None,
            "threads": torch.get_num_threads(), "seed": args.seed, "repeats": args.repeats, "warmup": args.warmup,
            "variants": list(_variants(args.variants)), "dry_run": args.dry_run,
            "isolation": "in-process" if args.in_process else "subprocess",
            "memory_cap_gb": args.memory_cap_gb if device.type == "cpu" and not args.in_process else None,
            "checkpoint": args.checkpoint, "optimizer": optimizer_name(LEARNING_RATE, device),
            "loss": "cross-entropy (split 0's training nodes on real graphs, all nodes on synthetic ones)"}


def _messages(name: str, args) -> int | None:
    if name in ("tolokers", "minesweeper"):
        return None
    return DRY_RUN_MESSAGES if args.dry_run else args.messages


def _merge_graph(name: str, results: list[dict]) -> dict:
    """The graph statistics reported by the workers (all must agree), removed from their entries."""
    seen = [entry.pop("graph") for entry in results if "graph" in entry]
    if not seen:
        return {"name": name, "status": "not built: every worker failed before building it"}
    if any(graph != seen[0] for graph in seen[1:]):
        raise RuntimeError(f"bench --layer: the workers built different {name} graphs: {seen}")
    return seen[0]


def run_graph(name: str, args) -> dict:
    """Measure every selected variant on one graph; returns the JSON document."""
    device = torch.device(args.device)
    load_start = os.getloadavg()
    settings = _settings(args, device)
    preset = PRESETS[name]
    spec = {"graph": name, "messages": _messages(name, args), "data_root": args.data_root,
            "preset": asdict(preset), "settings": settings}
    results = []
    with tempfile.TemporaryDirectory(prefix="nt-bench-layer-") as tmp:
        for variant in settings["variants"]:
            started = time.perf_counter()
            if args.in_process:
                entry = measure_variant({**spec, "variant": variant}, guard_memory=False)
            else:
                entry = _run_worker({**spec, "variant": variant}, Path(tmp), args.timeout)
            results.append(entry)
            print(f"  {name}: {variant:8s} {entry['status'][:70]:70s} ({time.perf_counter() - started:.1f} s)",
                  file=sys.stderr, flush=True)
    doc = {"schema_version": SCHEMA_VERSION, "kind": "layer", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "command": command_line(name, args),
           "device": {"name": bm.device_name(device), "type": device.type, "threads": torch.get_num_threads()},
           "versions": bm.versions(), "graph": _merge_graph(name, results),
           "preset": {"name": "tolokers" if name == "synthetic" else name, **asdict(preset)},
           "settings": settings, "results": results,
           "load_average": {"start": list(load_start), "end": list(os.getloadavg())}}
    doc["summary"] = summarize(results)
    return doc


def summarize(results: list[dict]) -> dict:
    """Fused vs unfused: speed-up (unfused median step / fused), memory ratios (fused / unfused)."""
    by_variant = {entry["variant"]: entry for entry in results}
    summary = {v: by_variant[v]["status"] if v in by_variant else "not run" for v in DEFAULT_VARIANTS}
    fused, unfused = by_variant.get("fused"), by_variant.get("unfused")
    if summary["fused"] == summary["unfused"] == "ok":
        summary["speedup"] = unfused["step_ms"] / fused["step_ms"]
        summary["memory_ratio"] = (fused["peak_memory_bytes"] / unfused["peak_memory_bytes"]
                                   if unfused["peak_memory_bytes"] else None)
        summary["memory_ratio_total"] = ((fused["peak_memory_bytes"] + fused["baseline_bytes"])
                                         / (unfused["peak_memory_bytes"] + unfused["baseline_bytes"]))
    captured = {v: by_variant[v]["step_ms"] / by_variant[v]["captured"]["step_ms"] for v in VARIANTS
                if v in by_variant and by_variant[v]["status"] == "ok"
                and by_variant[v].get("captured", {}).get("status") == "ok"}
    if captured:
        summary["capture_speedup"] = captured
    return summary


def command_line(name: str, args) -> str:
    """The command that reproduces this graph's run (options at their default left out)."""
    parts = ["nt-kernels bench --layer", f"--graph {name}", f"--dtype {args.dtype}", f"--device {args.device}",
             f"--repeats {args.repeats}", f"--warmup {args.warmup}", f"--threads {torch.get_num_threads()}"]
    if _variants(args.variants) != DEFAULT_VARIANTS:
        parts.append(f"--variants {args.variants}")
    if args.messages is not None and _messages(name, args) is not None:
        parts.append(f"--messages {args.messages}")
    if args.memory_cap_gb != args.layer_defaults["memory_cap_gb"]:
        parts.append(f"--memory-cap-gb {args.memory_cap_gb:g}")
    if args.seed:
        parts.append(f"--seed {args.seed}")
    if args.checkpoint != "auto":
        parts.append(f"--checkpoint {args.checkpoint}")
    parts += [flag for flag, on in (("--dry-run", args.dry_run), ("--in-process", args.in_process)) if on]
    return " ".join(parts)


def default_out(doc: dict, results_dir: Path) -> Path:
    s, g = doc["settings"], doc["graph"]
    parts = [bm.slug(doc["device"]["name"]), "layer", g["name"], s["dtype"]]
    if g.get("source") == "synthetic" and "num_messages" in g:
        parts.append(f"m{g['num_messages']}")
    if s.get("checkpoint", "auto") != "auto":
        parts.append(f"checkpoint-{s['checkpoint']}")
    if s["dry_run"]:
        parts.append("dry-run")
    return results_dir / f"{'-'.join(parts)}.json"


# -------------------------------------------------------------------- CLI
# Options of the op bench that do not apply to --layer (the model comes from the graph's preset).
OP_ONLY = ("heads", "head_dim", "scale", "input_sets", "nb_features", "threshold", "subset", "backends", "alphas",
           "reference_max_edges")
LAYER_ONLY = ("variants", "messages", "dry_run", "checkpoint")


def _variants(text: str) -> tuple[str, ...]:
    names = tuple(v.strip() for v in text.split(",") if v.strip())
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names or len(set(names)) != len(names):
        raise SystemExit(f"bench --layer: --variants must be a comma list of distinct {VARIANTS}, got {text!r}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The --layer options of ``nt-kernels bench`` (call after the op bench's options)."""
    group = parser.add_argument_group(
        "layer level (--layer)", "a training step of NT (forward, backward, Adam), fused=True vs fused=False, "
        "each in its own subprocess; graphs tolokers, minesweeper (released presets), synthetic (tolokers' "
        "degree sequence tiled to --messages, tolokers preset), powerlaw (H=4, D=16, 3 layers), a comma list or "
        "'all' (the first three); --dtype float32 or bfloat16-autocast; on every graph --warmup N untimed "
        "warm-up steps come first (on CUDA before the memory pass, so compiles are never timed; on CPU after "
        "it, which must be the process's first large step), then --repeats timed steps (median reported); the "
        "JSON records every step's time, and a worker stopped by --timeout (seconds per variant) reports the "
        "steps it finished; on CUDA the step is also captured in a CUDA graph and timed, and the host share "
        "(step minus summed kernel time) reported; every peak above the baseline and absolute; --checkpoint "
        "sets NT's activation checkpointing; --device, --threads, --seed, --memory-cap-gb (CPU workers' "
        "address-space cap), --in-process, --data-root, --out, --from-json and --plot (the layer block of "
        "the docs) apply")
    group.add_argument("--layer", action="store_true", help="measure NT training steps instead of the op")
    group.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                       help="comma list of fused, unfused and released (unfused with the paper's released "
                            "attention: Algorithm 1's padded groups, alpha = 0.4)")
    group.add_argument("--messages", type=int, default=None,
                       help=f"rows of the synthetic graphs (default: synthetic {SYNTHETIC_COPIES} x tolokers' "
                            f"messages, powerlaw {POWERLAW_MESSAGES:,})")
    group.add_argument("--checkpoint", choices=tuple(CHECKPOINT), default="auto",
                       help="activation checkpointing of NT's node-level blocks (NT(checkpoint=...)): auto (where "
                            "the memory model says it pays), on, off")
    group.add_argument("--dry-run", action="store_true",
                       help=f"tiny graphs (real ones cut to their first {DRY_RUN_NODES} nodes, synthetic ones "
                            f"{DRY_RUN_MESSAGES:,} messages) to check the code path, e.g. on the CPU")
    parser.set_defaults(layer_defaults={dest: parser.get_default(dest) for dest in (*OP_ONLY, *LAYER_ONLY,
                                                                                     "memory_cap_gb")})


def check_mode(args) -> None:
    """Reject options of the other mode (op bench vs --layer) instead of ignoring them."""
    defaults = args.layer_defaults
    foreign = OP_ONLY if args.layer else LAYER_ONLY
    given = [dest for dest in foreign if getattr(args, dest) != defaults[dest]]
    if given:
        flags = ", ".join("--" + dest.replace("_", "-") for dest in given)
        raise SystemExit(f"bench: {flags} {'do' if len(given) > 1 else 'does'} not apply "
                         + ("with --layer (the model is the graph's preset)" if args.layer else "without --layer"))
    if args.layer and args.dtype not in DTYPES:
        raise SystemExit(f"bench --layer: --dtype must be one of {DTYPES}, got {args.dtype!r}")
    if not args.layer and args.dtype not in bm.DTYPES:
        raise SystemExit(f"bench: --dtype {args.dtype} is for --layer; the op bench takes {sorted(bm.DTYPES)}")


def graph_names(spec: str) -> list[str]:
    names = list(ALL_GRAPHS) if spec == "all" else [n.strip() for n in spec.split(",") if n.strip()]
    for name in names:
        if name not in GRAPHS:
            raise SystemExit(f"bench --layer: unknown graph {name!r}; choose from {GRAPHS} or 'all'")
    return names


def run(args) -> int:
    """``nt-kernels bench --layer``: measure (or read --from-json), print, write JSON, update the layer block."""
    if args.from_json:
        docs = bm.read_results(args.from_json)
    else:
        check_mode(args)
        _variants(args.variants)
        if args.repeats < 1 or args.warmup < 0:
            raise SystemExit("bench --layer: --repeats must be >= 1 and --warmup >= 0")
        if args.messages is not None and args.messages < 1:
            raise SystemExit(f"bench --layer: --messages must be >= 1, got {args.messages}")
        docs = bm.measure_graphs(graph_names(args.graph), args.out, lambda name: run_graph(name, args),
                                 default_out, "bench --layer")
    bm.print_results(docs, format_table)
    if args.plot and docs:
        print(f"-> {publish(docs, Path(args.docs_dir))}")
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1]))
