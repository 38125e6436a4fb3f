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
* An out-of-memory error is a result (``status: "OOM"``, the message in
  ``detail``), as is a worker killed by the kernel; other failures are
  ``error: ...``.  ``--in-process`` skips the subprocesses and the cap (CPU
  peaks are then lower bounds); ``--dry-run`` shrinks every graph (e.g. to
  check the GPU commands on a CPU).

Graphs: ``tolokers`` and ``minesweeper`` with their released presets (the
real data from ``--data-root`` / ``$NT_KERNELS_DATA``), ``synthetic``
(tolokers' degree sequence tiled to ``--messages`` rows, the tolokers preset)
and ``powerlaw`` (issue 14's scale graph: power-law degrees, H = 4, D = 16,
3 layers).  Both synthetic graphs come from one generator,
:func:`degree_sequence_graph`.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from nt_kernels.bench import measure as bm
from nt_kernels.bench.cli import device_name, slug, versions
from nt_kernels.csr import NeighbourhoodCSR

SCHEMA_VERSION = 1
VARIANTS = ("fused", "unfused")
DTYPES = ("float32", "bfloat16-autocast")
GRAPHS = ("tolokers", "minesweeper", "synthetic", "powerlaw")
ALL_GRAPHS = ("tolokers", "minesweeper", "synthetic")  # 'all': the CPU set of issue 13
SYNTHETIC_COPIES = 10  # default --messages of 'synthetic': tolokers' messages x 10
POWERLAW_MESSAGES = 100_000_000
POWERLAW_AVG_DEGREE = 20
POWERLAW_EXPONENT = 2.5
POWERLAW_FEATURES = 16
DRY_RUN_NODES = 1000
DRY_RUN_MESSAGES = 20_000
LEARNING_RATE = 1e-3


@dataclass(frozen=True)
class LayerPreset:
    """The NT model of one bench graph (hidden width = heads x head_dim)."""

    aggr: str
    head_dim: int
    heads: int
    num_layers: int
    dropout: float
    sep: bool
    self_loops: str
    source: str


# The released presets (nt_kernels.apps.presets.PAPER_PRESETS, undirected). The bench layer may not
# import apps (docs/design.md §0); tests/test_bench_layer.py checks that these agree with them.
PRESETS = {
    "tolokers": LayerPreset("gated_sum", 30, 2, 5, 0.1, True, "keep", "released preset of tolokers"),
    "minesweeper": LayerPreset("sum", 53, 1, 5, 0.2, True, "remove", "released preset of minesweeper"),
    "powerlaw": LayerPreset("weighted_mean", 16, 4, 3, 0.1, True, "keep", "issue 14 scale run: H=4, D=16, 3 layers"),
}
PRESETS["synthetic"] = PRESETS["tolokers"]


# ------------------------------------------------------------------ graphs
def degree_sequence_graph(degrees: torch.Tensor, *, seed: int, device=None) -> torch.Tensor:
    """(2, sum(degrees)) edge_index in which node j is the centre of exactly ``degrees[j]`` rows.

    Row 0 (centres) lists node j ``degrees[j]`` times; row 1 (receivers) is the
    same list in a seeded random order, so node j also receives exactly
    ``degrees[j]`` messages.  Self-loops and repeated pairs can occur, as in a
    configuration model; they are messages like any other.  Drawn on ``device``.
    """
    degrees = degrees.to(device=device, dtype=torch.long)
    gen = torch.Generator(device=degrees.device).manual_seed(seed)
    centre = torch.repeat_interleave(torch.arange(degrees.numel(), device=degrees.device), degrees)
    receiver = centre[torch.randperm(centre.numel(), generator=gen, device=degrees.device)]
    return torch.stack([centre, receiver])


def tiled_degrees(profile: torch.Tensor, messages: int, *, seed: int) -> torch.Tensor:
    """``profile`` repeated until it holds ``messages`` rows, nodes in a seeded random order.

    ``ceil(messages / sum(profile))`` copies are shuffled together; the
    shortest prefix reaching ``messages`` is kept and its last degree trimmed
    to make the total exact (so ``messages = k * sum(profile)`` is the profile
    tiled exactly k times).
    """
    total = int(profile.sum())
    if messages < 1 or total < 1:
        raise ValueError(f"tiled_degrees: need messages >= 1 and a non-empty profile, got {messages=}, {total=}")
    copies = -(-messages // total)
    gen = torch.Generator().manual_seed(seed)
    tiled = profile.long().repeat(copies)
    tiled = tiled[torch.randperm(tiled.numel(), generator=gen)]
    cumulative = torch.cumsum(tiled, 0)
    last = int(torch.searchsorted(cumulative, messages))
    kept = tiled[:last + 1].clone()
    kept[-1] -= int(cumulative[last]) - messages
    return kept


def powerlaw_degrees(messages: int, num_nodes: int, *, exponent: float = POWERLAW_EXPONENT,
                     seed: int) -> torch.Tensor:
    """Degrees ~ messages * w_i / sum(w), w_i = (i + 1)^(-1/(exponent - 1)), at least 1, shuffled.

    The largest degree absorbs the rounding so the total is exactly ``messages``.
    """
    weights = torch.arange(1, num_nodes + 1, dtype=torch.float64) ** (-1.0 / (exponent - 1.0))
    degrees = torch.clamp(torch.round(messages * weights / weights.sum()), min=1).long()
    degrees[0] += messages - int(degrees.sum())
    if int(degrees[0]) < 1:
        raise ValueError(f"powerlaw_degrees: {messages} messages are too few for {num_nodes} nodes")
    return degrees[torch.randperm(num_nodes, generator=torch.Generator().manual_seed(seed))]


@dataclass
class LayerGraph:
    """A bench graph on its device: features, labels, the nodes the loss reads, edges and how it was built."""

    name: str
    x: torch.Tensor
    y: torch.Tensor
    loss_nodes: torch.Tensor | None
    edge_index: torch.Tensor
    source: str
    description: str


def _real_graph(name: str, data_root, dry_run: bool, device) -> LayerGraph:
    from nt_kernels.data import load_dataset

    data = load_dataset(name, data_root, directed=False, self_loops=PRESETS[name].self_loops)
    x, y, edge_index, mask = data.x, data.y, data.edge_index, data.train_mask[0]
    how = f"load_dataset({name!r}, undirected, self_loops={PRESETS[name].self_loops!r}); loss on split 0's train nodes"
    if dry_run:
        keep = (edge_index < DRY_RUN_NODES).all(0)
        x, y, mask, edge_index = x[:DRY_RUN_NODES], y[:DRY_RUN_NODES], mask[:DRY_RUN_NODES], edge_index[:, keep]
        how = f"dry run: the subgraph induced by the first {DRY_RUN_NODES} nodes of " + how
    return LayerGraph(name, x.to(device), y.to(device), mask.to(device), edge_index.to(device), "real", how)


def _random_features(num_nodes: int, features: int, classes: int, seed: int, device):
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(num_nodes, features, generator=gen)
    y = torch.randint(0, classes, (num_nodes,), generator=gen)
    return x.to(device), y.to(device)


def build_graph(name: str, *, messages: int | None, seed: int, data_root=None, dry_run: bool = False,
                device=None) -> LayerGraph:
    """The bench graph ``name`` (see the module docstring) on ``device``."""
    if name in ("tolokers", "minesweeper"):
        return _real_graph(name, data_root, dry_run, device)
    if name == "synthetic":
        from nt_kernels.data import load_dataset

        tolokers = load_dataset("tolokers", data_root, directed=False, self_loops=PRESETS["tolokers"].self_loops)
        profile = torch.bincount(tolokers.edge_index[0], minlength=tolokers.num_nodes)
        messages = messages or SYNTHETIC_COPIES * int(profile.sum())
        degrees = tiled_degrees(profile, messages, seed=seed)
        how = (f"tolokers' degree sequence (undirected, self-loops kept: {int(profile.sum()):,} messages on "
               f"{profile.numel():,} nodes) tiled to {messages:,} messages in a seeded random node order "
               "(last degree trimmed), receivers a seeded shuffle of the centre list; random features "
               f"({tolokers.x.shape[1]}) and labels (2 classes); loss on all nodes")
        features, classes = tolokers.x.shape[1], int(tolokers.y.max()) + 1
    else:
        messages = messages or POWERLAW_MESSAGES
        num_nodes = max(2, messages // POWERLAW_AVG_DEGREE)
        degrees = powerlaw_degrees(messages, num_nodes, seed=seed)
        how = (f"power-law degrees on {num_nodes:,} nodes (messages / {POWERLAW_AVG_DEGREE}): "
               f"round(messages * w_i / sum w), w_i = (i+1)^(-1/({POWERLAW_EXPONENT:g}-1)), at least 1, "
               "rounding into the largest, shuffled; receivers a seeded shuffle of the centre list; random "
               f"features ({POWERLAW_FEATURES}) and labels (2 classes); loss on all nodes")
        features, classes = POWERLAW_FEATURES, 2
    edge_index = degree_sequence_graph(degrees, seed=seed, device=device)
    x, y = _random_features(degrees.numel(), features, classes, seed, device)
    return LayerGraph(name, x, y, None, edge_index, "synthetic", how)


def graph_stats(csr, threshold: float) -> dict:
    """Nodes, messages, max degree, and segments / messages on each path of the switch at ``threshold``."""
    sizes, counts = (t.tolist() for t in csr.size_hist)
    segments = {"exact": 0, "performer": 0, "empty": 0}
    rows = {"exact": 0, "performer": 0}
    for n, c in zip(sizes, counts):
        path = "empty" if n == 0 else "performer" if n > threshold else "exact"
        segments[path] += c
        if n:
            rows[path] += n * c
    return {"num_nodes": csr.num_nodes, "num_messages": csr.num_edges, "max_degree": csr.max_degree,
            "threshold": threshold, "segments": segments, "messages": rows}


# ------------------------------------------------------------------ worker
def _model(preset: LayerPreset, graph: LayerGraph, fused: bool):
    from nt_kernels.nn import NT

    return NT(graph.x.shape[1], int(graph.y.max()) + 1, preset.head_dim * preset.heads, preset.num_layers,
              heads=preset.heads, dropout=preset.dropout, sep=preset.sep, aggr=preset.aggr, fused=fused)


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
    model = _model(preset, graph, fused=entry["fused"]).to(device).train()
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
        optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)

        def run(count: int, key: str) -> list[tuple[float, float]]:
            done = []
            for _ in range(count):
                done.append(_timed_step(lambda: _step(model, optimizer, graph.x, graph.y, graph.loss_nodes, csr,
                                                      autocast), device))
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
        entry.update(peak_memory_bytes=memory.peak(), baseline_bytes=memory.baseline, memory_method=memory.method,
                     memory_pass_ms=entry.pop("memory_pass_runs")[0])
        if device.type == "cpu":
            run(s["warmup"], "warmup_ms_runs")
        timed = run(s["repeats"], "step_ms_runs")
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
                                          "peak_memory_bytes", "baseline_bytes", "memory_method", "step_ms_runs")
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
            "optimizer": f"Adam(lr={LEARNING_RATE:g})",
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
           "device": {"name": device_name(device), "type": device.type, "threads": torch.get_num_threads()},
           "versions": versions(), "graph": _merge_graph(name, results),
           "preset": {"name": "tolokers" if name == "synthetic" else name, **asdict(preset)},
           "settings": settings, "results": results,
           "load_average": {"start": list(load_start), "end": list(os.getloadavg())}}
    doc["summary"] = summarize(results)
    return doc


def summarize(results: list[dict]) -> dict:
    """Fused vs unfused: speed-up (unfused median step / fused), memory ratios (fused / unfused)."""
    by_variant = {entry["variant"]: entry for entry in results}
    summary = {v: by_variant[v]["status"] if v in by_variant else "not run" for v in VARIANTS}
    fused, unfused = by_variant.get("fused"), by_variant.get("unfused")
    if summary["fused"] == summary["unfused"] == "ok":
        summary["speedup"] = unfused["step_ms"] / fused["step_ms"]
        summary["memory_ratio"] = (fused["peak_memory_bytes"] / unfused["peak_memory_bytes"]
                                   if unfused["peak_memory_bytes"] else None)
        summary["memory_ratio_total"] = ((fused["peak_memory_bytes"] + fused["baseline_bytes"])
                                         / (unfused["peak_memory_bytes"] + unfused["baseline_bytes"]))
    return summary


def command_line(name: str, args) -> str:
    """The command that reproduces this graph's run (options at their default left out)."""
    parts = ["nt-kernels bench --layer", f"--graph {name}", f"--dtype {args.dtype}", f"--device {args.device}",
             f"--repeats {args.repeats}", f"--warmup {args.warmup}", f"--threads {torch.get_num_threads()}"]
    if _variants(args.variants) != VARIANTS:
        parts.append(f"--variants {args.variants}")
    if args.messages is not None and _messages(name, args) is not None:
        parts.append(f"--messages {args.messages}")
    if args.memory_cap_gb != args.layer_defaults["memory_cap_gb"]:
        parts.append(f"--memory-cap-gb {args.memory_cap_gb:g}")
    if args.seed:
        parts.append(f"--seed {args.seed}")
    parts += [flag for flag, on in (("--dry-run", args.dry_run), ("--in-process", args.in_process)) if on]
    return " ".join(parts)


def default_out(doc: dict, results_dir: Path) -> Path:
    s, g = doc["settings"], doc["graph"]
    parts = [slug(doc["device"]["name"]), "layer", g["name"], s["dtype"]]
    if g.get("source") == "synthetic" and "num_messages" in g:
        parts.append(f"m{g['num_messages']}")
    if s["dry_run"]:
        parts.append("dry-run")
    return results_dir / f"{'-'.join(parts)}.json"


# ----------------------------------------------------------------- output
def _mib(value) -> str:
    return "–" if value is None else f"{value / 2**20:,.1f}"


def _ms(value) -> str:
    return f"{value:,.1f}"


def _graph_text(g: dict) -> str:
    if "num_messages" not in g:
        return f"{g['name']}: {g['status']}"
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
    return (f"fused is {summary['speedup']:.2f}x faster per step, "
            + (f"{memory:.3f}x" if memory is not None else "n/a (unfused peak 0) x")
            + f" the step's peak memory of fused=False ({summary['memory_ratio_total']:.3f}x with the baseline)")


def format_table(doc: dict) -> str:
    s = doc["settings"]
    lines = [_graph_text(doc["graph"]),
             f"{_preset_text(doc)} | {s['dtype']} | {doc['device']['name']}, {s['threads']} threads, "
             f"load average {doc['load_average']['start'][0]:.1f} -> {doc['load_average']['end'][0]:.1f}",
             f"{'variant':8s} {'step ms':>10s} {'peak MiB':>10s} {'baseline MiB':>13s}  status"]
    for e in doc["results"]:
        step = f"{e['step_ms']:10.1f}" if e.get("step_ms") is not None else f"{'-':>10s}"
        lines.append(f"{e['variant']:8s} {step} {_mib(e.get('peak_memory_bytes')):>10s} "
                     f"{_mib(e.get('baseline_bytes')):>13s}  {e['status']}")
    lines.append(_ratio_text(doc["summary"]))
    return "\n".join(lines)


def layer_block(results_dir: Path) -> str:
    """The markdown table of every layer result file in ``results_dir`` (the block in docs/results.md)."""
    lines = ["| device | graph | preset | dtype | fused step ms | fused=False step ms | speed-up | fused peak MiB "
             "| fused=False peak MiB | memory ratio | raw |", "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
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

        ratio, speedup = sm.get("memory_ratio"), sm.get("speedup")
        graph = _graph_text(doc["graph"]) + (" (dry run)" if doc["settings"]["dry_run"] else "")
        cells = [doc["device"]["name"], graph, _preset_text(doc), doc["settings"]["dtype"],
                 cell("fused", "step_ms", _ms), cell("unfused", "step_ms", _ms),
                 "–" if speedup is None else f"{speedup:.2f}×",
                 cell("fused", "peak_memory_bytes", _mib), cell("unfused", "peak_memory_bytes", _mib),
                 "–" if ratio is None else f"{ratio:.3f}", f"`{path.name}`"]
        lines.append("| " + " | ".join(cells) + " |")
        load = doc["load_average"]
        commands.append(f"* `{doc['command']}` — {doc['created']}, 1-min load {load['start'][0]:.1f} → "
                        f"{load['end'][0]:.1f}, torch {doc['versions']['torch']}")
    if not commands:
        return "(no layer run yet)"
    return "\n".join(lines + ["", "Commands:", ""] + commands)


def publish(docs: list[tuple[dict, Path]], docs_dir: Path) -> Path:
    """Write the layer block of ``docs_dir``/results.md from the result files next to the first document."""
    from nt_kernels.bench.plot import replace_block

    md = docs_dir / "results.md"
    text = md.read_text() if md.is_file() else "# Results\n"
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(replace_block(text, "layer", layer_block(docs[0][1].parent)))
    return md


# -------------------------------------------------------------------- CLI
# Options of the op bench that do not apply to --layer (the model comes from the graph's preset).
OP_ONLY = ("heads", "head_dim", "scale", "input_sets", "nb_features", "threshold", "subset", "backends", "alphas",
           "reference_max_edges")
LAYER_ONLY = ("variants", "messages", "dry_run")


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
        "steps it finished; --device, --threads, --seed, --memory-cap-gb (CPU workers' address-space cap), "
        "--in-process, --data-root, --out, --from-json and --plot (the layer block of results.md) apply")
    group.add_argument("--layer", action="store_true", help="measure NT training steps instead of the op")
    group.add_argument("--variants", default=",".join(VARIANTS), help="comma list of fused, unfused")
    group.add_argument("--messages", type=int, default=None,
                       help=f"rows of the synthetic graphs (default: synthetic {SYNTHETIC_COPIES} x tolokers' "
                            f"messages, powerlaw {POWERLAW_MESSAGES:,})")
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
    """``nt-kernels bench --layer``: measure (or read --from-json), print, write JSON, update results.md."""
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
