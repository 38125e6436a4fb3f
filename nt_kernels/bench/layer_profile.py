"""``nt-kernels bench --layer --profile``: where the fused NT layer's CPU training step goes (issue 31).

For one graph's preset (``--graph``, e.g. tolokers) it trains the fused NT
network on the CPU as ``bench --layer`` does, with the fused layer's stage
clocks on (``csrc/cpu/stage_profile.h``), and reports per kernel stage:

* its thread time per step (summed over the threads: the stage clocks run in
  every thread) and, dividing by the threads, its share of the step;
* its FLOPs and operand bytes per step, from the graph's segment sizes and the
  layer's shape (:func:`stage_costs`; the per-element costs of exp, GELU and
  the sigmoid are counted from our implementations, csrc/cpu/simd_math.h and
  ntconv_math.h);
* the achieved GFLOP/s (FLOPs over thread time / threads) against the peak of
  the cores used at the ISA path's FMA width (:func:`cpu_peak`): an
  **estimate**: the clock is measured once on one core before the steps (it
  may differ under an all-core load), and the FMA units per core come from the
  CPU family, not from a measurement.

The step's remainder -- the op's set-up around its kernels, the node-level
linears, autograd, the loss and Adam -- is the step time minus the kernels'
wall time (``outside the fused kernels``).

``--isa base,avx2,avx512`` (or ``all``: every path this CPU runs) profiles
several ``NT_KERNELS_CPU_ISA`` paths: one worker process per path
(``python -m nt_kernels.bench.layer_profile SPEC.json``), all set up first,
then the steps interleaved (one step of each path in turn, ``--warmup``
rounds untimed, then ``--repeats`` timed), so that a busy machine slows every
path alike and the ratios stay fair.  Medians over the timed rounds.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

SCHEMA_VERSION = 1
PATHS = ("base", "avx2", "avx512")
MARK = "NT-PROFILE "  # prefix of the workers' protocol lines on stdout
# Counted FLOPs per element of our float32 implementations: exp_f32 (range reduction and a
# degree-7 polynomial), GELU / GELU' (one Phi: a degree-6 polynomial, a division and one exp).
EXP_FLOPS, GELU_FLOPS, GELU_GRAD_FLOPS, SIGMOID_FLOPS = 22, 44, 47, 25
ITEM_ROWS = 64  # csrc/cpu/ntconv_plan.h NTCONV_GROUP_ROWS
FLOAT = 4
# Stages of csrc/cpu/stage_profile.h, with what each covers.
STAGES = {
    "fwd_prologue": "u, GELU, dropout, q/k/v projections",
    "fwd_exact": "exact attention",
    "fwd_performer": "Performer attention",
    "fwd_output": "output projection, GELU, aggregation inputs",
    "fwd_reduce": "reduction at receivers",
    "bwd_recompute_prologue": "recompute of the prologue (GELU' kept)",
    "bwd_recompute_exact": "recompute of exact attention (P kept)",
    "bwd_recompute_performer": "recompute of Performer attention (features kept)",
    "bwd_recompute_output": "recompute of the output (GELU' kept)",
    "bwd_output": "message gradient, output projection and GELU",
    "bwd_exact": "exact attention backward",
    "bwd_performer": "Performer attention backward",
    "bwd_qkv": "q/k/v projections, dropout, GELU of the inputs",
    "bwd_inputs": "d_centre, du, edge features",
    "bwd_weight_sum": "weight-gradient partials summed",
    "bwd_reduce": "d_receiver_term: reduction at receivers",
}


# ------------------------------------------------------------------ peak
def _cpuinfo() -> dict:
    info = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return info


def fma_flops_per_cycle(isa: str, vendor: str, family: int) -> tuple[int, str]:
    """float32 FLOPs per cycle and core at the path's vector width, and why."""
    if isa == "base":
        return 16, "SSE2: 4 lanes, separate multiply and add, 2 pipes each"
    if isa == "avx2":
        return 32, "AVX2: 2 FMA pipes x 8 lanes x 2"
    if vendor == "AuthenticAMD" and family == 25:
        return 32, "Zen 4: AVX-512 on 256-bit FMA pipes (2 x 8 lanes x 2), no gain in peak over AVX2"
    if vendor == "AuthenticAMD":
        return 64, "AMD after Zen 4: 2 FMA pipes x 16 lanes x 2 (assumed)"
    return 64, "Intel AVX-512: 2 FMA units x 16 lanes x 2 (assumed; some Xeon Silver/Bronze have 1)"


def measured_clock_ghz() -> float:
    """This core's clock from a timed chain of dependent adds (best of 10 tries of 10 ms; 0 off x86)."""
    from nt_kernels._extension import extension

    return extension().cpu_clock_ghz(10.0, 10)


def core_clock(clock_ghz: float | None = None) -> tuple[float, str]:
    """(GHz, how it was found): ``clock_ghz`` if given, else measured (:func:`measured_clock_ghz`),
    else the nominal clock of /proc/cpuinfo."""
    if clock_ghz:
        return clock_ghz, "--clock-ghz"
    measured = measured_clock_ghz()
    if measured:
        return measured, "measured: dependent adds"
    return float(_cpuinfo().get("cpu MHz", "0") or 0) / 1e3, "nominal, /proc/cpuinfo"


def cpu_peak(isa: str, cores: int, clock: tuple[float, str]) -> dict:
    """Estimated float32 peak GFLOP/s of ``cores`` cores on ISA path ``isa`` at ``clock``
    (:func:`core_clock`): cores x clock x FLOPs per cycle."""
    info = _cpuinfo()
    vendor, family = info.get("vendor_id", platform.processor()), int(info.get("cpu family", "0") or 0)
    per_cycle, why = fma_flops_per_cycle(isa, vendor, family)
    return {"model": info.get("model name", platform.machine()), "vendor": vendor, "family": family,
            "isa": isa, "cores": cores, "clock_ghz": clock[0], "clock_source": clock[1],
            "nominal_ghz": float(info.get("cpu MHz", "0") or 0) / 1e3, "flops_per_cycle": per_cycle, "why": why,
            "gflops": cores * clock[0] * per_cycle}


# ------------------------------------------------------------------ costs
def layer_shape(model, csr) -> dict:
    """What stage_costs needs: the kernels' dimensions, layers and the segments on each path."""
    convs = list(model.convs)
    conv = convs[0]
    if any((c.out_channels, c.heads, c.aggr, c.threshold) != (conv.out_channels, conv.heads, conv.aggr,
                                                              conv.threshold) for c in convs):
        raise ValueError("bench --layer --profile: the layers differ in shape; the cost model assumes one shape")
    sizes, counts = (t.tolist() for t in csr.size_hist)
    exact = [(n, c) for n, c in zip(sizes, counts) if 0 < n <= conv.threshold]
    performer = [(n, c) for n, c in zip(sizes, counts) if n > conv.threshold]
    return {"layers": len(convs), "E": csr.num_edges, "N": csr.num_nodes, "C": conv.out_channels,
            "H": conv.heads, "D": conv.head_dim, "m": conv.nb_features or 0,
            "C_out": conv.lin_out.weight.shape[0], "F": conv.edge_dim or 0, "aggr": conv.aggr,
            "dropout": conv.dropout > 0, "threshold": conv.threshold,
            "exact_rows": sum(n * c for n, c in exact), "exact_sq": sum(n * n * c for n, c in exact),
            "performer_rows": sum(n * c for n, c in performer),
            "items": sum(c for n, c in zip(sizes, counts) if n >= ITEM_ROWS)
            + sum(n * c for n, c in zip(sizes, counts) if n < ITEM_ROWS) / ITEM_ROWS}


def _forward_costs(s: dict, gelu: int) -> dict[str, tuple[float, float]]:
    E, N, C, H, D, m, C_out, F = (s[k] for k in ("E", "N", "C", "H", "D", "m", "C_out", "F"))
    Ex, S2, P = s["exact_rows"], s["exact_sq"], s["performer_rows"]
    gated = s["aggr"] in ("gated_sum", "weighted_mean")
    out_act = 0 if s["aggr"] == "max" else gelu
    return {
        "prologue": (E * C * (1 + gelu + s["dropout"]) + 2 * E * F * C + 6 * E * C * C,
                     FLOAT * (N * C + E * C + E * F + 3 * E * C)),
        # per head: scores and P V (2 n^2 D each), max, exp, sum and normalise (n^2 each)
        "exact": (H * S2 * (4 * D + EXP_FLOPS + 4), FLOAT * (4 * Ex * C + Ex * H + S2 * H)),
        # per row and head: key and query features (2 m D each), S' and the output (2 m D each)
        "performer": (H * P * (8 * m * D + m * (2 * EXP_FLOPS + 8) + 6 * D), FLOAT * (4 * P * C + 2 * P * H * m)),
        "output": (2 * E * C * C_out + E * C_out * out_act
                   + (E * (C + H * (SIGMOID_FLOPS + 1) + C) if gated else 0),
                   FLOAT * (E * C + E * C_out + E * C)),
    }


def stage_costs(s: dict) -> dict[str, dict[str, float]]:
    """FLOPs and operand bytes (each operand read or written once, 4 B per float32) of each
    stage per training step (all layers).  Products count 2 FLOPs per multiply-add."""
    E, N, C, H, D, m, C_out, F = (s[k] for k in ("E", "N", "C", "H", "D", "m", "C_out", "F"))
    Ex, S2, P = s["exact_rows"], s["exact_sq"], s["performer_rows"]
    fwd, again = _forward_costs(s, GELU_FLOPS), _forward_costs(s, GELU_GRAD_FLOPS)
    partial = 3 * C * C + 3 * C + C_out * C + C_out + F * C
    costs = {f"fwd_{k}": v for k, v in fwd.items()}
    costs["fwd_reduce"] = (E * C, FLOAT * (E * C + N * C) + 8 * E)
    costs.update({f"bwd_recompute_{k}": v for k, v in again.items()})
    costs.update({
        # message gradient (gated: gates, d value, g . value), d pre, dW_out, d_o, db_out
        "bwd_output": (4 * E * C * C_out + 2 * E * C_out + 4 * E * C, FLOAT * (2 * E * C + 2 * E * C_out)),
        # dP, dS and the three products of dq, dk, dv per head
        "bwd_exact": (H * S2 * (8 * D + 6), FLOAT * (7 * Ex * C + S2 * H)),
        # queries: S g, dS, dq; keys: dphi, dv, dk (2 m D each), and the element-wise work
        "bwd_performer": (H * P * (12 * m * D + 16 * m + 4 * D), FLOAT * (7 * P * C + 2 * P * H * m)),
        "bwd_qkv": (12 * E * C * C + E * C * (3 + 1 + s["dropout"]), FLOAT * (5 * E * C)),
        "bwd_inputs": (E * C + 4 * E * C * F, FLOAT * (3 * E * C + 2 * E * F)),
        "bwd_weight_sum": (s["items"] * partial, FLOAT * 2 * s["items"] * partial),
        "bwd_reduce": (E * C, FLOAT * (E * C + N * C) + 8 * E),
    })
    layers = s["layers"]
    return {name: {"flops": costs[name][0] * layers, "bytes": costs[name][1] * layers} for name in STAGES}


# ------------------------------------------------------------------ worker
def _emit(doc: dict) -> None:
    print(MARK + json.dumps(doc), flush=True)


def worker_main(spec_path: str) -> int:
    """One path's worker: set up the graph and the fused model, report the shape, then run one
    training step per ``step`` / ``profile`` line on stdin (reporting its time and stage clocks)."""
    from nt_kernels._extension import extension
    from nt_kernels.bench import layer

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["settings"]["threads"])
    device = torch.device("cpu")
    graph, csr, model, threshold = layer._setup(spec, device, {"fused": True, "variant": "fused"})
    optimizer = torch.optim.Adam(model.parameters(), lr=layer.LEARNING_RATE)
    layer._tiny_warmup(model, graph, threshold, False)
    _emit({"ready": True, "isa": extension().cpu_isa(), "shape": layer_shape(model, csr),
           "threads": torch.get_num_threads()})
    for line in sys.stdin:
        command = line.strip()
        if command not in ("step", "profile"):
            break
        extension().cpu_stage_profile(command == "profile")
        tick = time.perf_counter()
        loss = layer._step(model, optimizer, graph.x, graph.y, graph.loss_nodes, csr, False)
        elapsed = time.perf_counter() - tick
        times = extension().cpu_stage_times()
        extension().cpu_stage_profile(False)
        _emit({"step_s": elapsed, "loss": float(loss), **times})
    return 0


class Worker:
    """A worker process on one ISA path (``NT_KERNELS_CPU_ISA``), driven line by line: it reports
    ``ready`` (a MARK line) after its set-up, and one MARK line per command it is sent."""

    def __init__(self, argv: list[str], isa: str):
        self.isa = isa
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "NT_KERNELS_CPU_ISA": isa})
        self.ready = self.read()
        if self.ready.get("isa") != isa:
            raise RuntimeError(f"ISA worker: the {isa} worker runs path {self.ready.get('isa')!r}")

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        raise RuntimeError(f"ISA worker: the {self.isa} worker exited with status {self.proc.wait()}")

    def send(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


# ------------------------------------------------------------------ driver
def _paths(text: str) -> list[str]:
    from nt_kernels._extension import cpu_paths

    available = cpu_paths()["nt_kernels_isa_paths"]
    if text == "all":
        return list(available)
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in PATHS]
    if unknown or not names or len(set(names)) != len(names):
        raise SystemExit(f"bench --layer --profile: --isa must be 'all' or a comma list of distinct {PATHS}, "
                         f"got {text!r}")
    missing = [p for p in names if p not in available]
    if missing:
        raise SystemExit(f"bench --layer --profile: this CPU (or build) cannot run {', '.join(missing)}; "
                         f"it has {', '.join(available)}")
    return names


def _median_entry(steps: list[dict]) -> dict:
    """Medians over the timed steps of one path: step, kernel walls and every stage's thread time."""
    return {"step_s": statistics.median(s["step_s"] for s in steps),
            "forward_wall_s": statistics.median(s["forward_wall_s"] for s in steps),
            "backward_wall_s": statistics.median(s["backward_wall_s"] for s in steps),
            "thread_s": {name: statistics.median(s["thread_s"][name] for s in steps) for name in STAGES}}


def profile_graph(name: str, args) -> dict:
    """Profile the fused step of graph ``name`` on each selected ISA path; returns the JSON document."""
    import tempfile

    from nt_kernels.bench import layer

    if torch.device(args.device).type != "cpu":
        raise SystemExit("bench --layer --profile: the stage clocks are the CPU kernels'; use --device cpu")
    paths = _paths(args.isa) if args.isa else [None]
    threads = torch.get_num_threads()
    spec = {"graph": name, "messages": args.messages, "data_root": args.data_root, "variant": "fused",
            "preset": asdict(layer.PRESETS[name]),
            "settings": {"seed": args.seed, "dry_run": args.dry_run, "device": "cpu", "threads": threads}}
    load_start = os.getloadavg()
    clock = core_clock(args.clock_ghz)
    with tempfile.TemporaryDirectory(prefix="nt-bench-profile-") as tmp:
        from nt_kernels._extension import extension

        isas = [p or extension().cpu_isa() for p in paths]
        workers = []
        try:
            spec_file = Path(tmp) / "spec.json"
            spec_file.write_text(json.dumps(spec))
            for isa in isas:  # set up one at a time, so set-ups do not compete
                workers.append(Worker([sys.executable, "-m", "nt_kernels.bench.layer_profile", str(spec_file)], isa))
            steps = {isa: [] for isa in isas}
            for round_ in range(args.warmup + args.repeats):
                timed, done = round_ >= args.warmup, []
                for worker in workers:
                    result = worker.send("profile" if timed else "step")
                    done.append(f"{worker.isa} {result['step_s']:.2f} s")
                    if timed:
                        steps[worker.isa].append(result)
                print(f"  {name}: {'timed' if timed else 'warm-up'} round {round_ + 1}/{args.warmup + args.repeats}: "
                      + ", ".join(done), file=sys.stderr, flush=True)
        finally:
            for worker in workers:
                worker.close()
    shape = workers[0].ready["shape"]
    return {"schema_version": SCHEMA_VERSION, "kind": "layer-profile",
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": command_line(name, args, isas),
            "device": {"name": _cpuinfo().get("model name", platform.machine()), "threads": threads},
            "versions": {"torch": torch.__version__, "python": platform.python_version()},
            "graph": name, "preset": asdict(layer.PRESETS[name]), "shape": shape, "stages": stage_costs(shape),
            "settings": {"threads": threads, "seed": args.seed, "repeats": args.repeats, "warmup": args.warmup,
                         "dry_run": args.dry_run, "clock_ghz": args.clock_ghz},
            "paths": {isa: {"peak": cpu_peak(isa, min(threads, os.cpu_count() or threads), clock),
                            "steps": steps[isa], **_median_entry(steps[isa])} for isa in isas},
            "load_average": {"start": list(load_start), "end": list(os.getloadavg())}}


def command_line(name: str, args, isas: list[str]) -> str:
    parts = ["nt-kernels bench --layer --profile", f"--graph {name}", f"--isa {','.join(isas)}",
             f"--repeats {args.repeats}", f"--warmup {args.warmup}", f"--threads {torch.get_num_threads()}"]
    parts += [f"--clock-ghz {args.clock_ghz:g}"] if args.clock_ghz else []
    parts += ["--dry-run"] if args.dry_run else []
    return " ".join(parts)


# ------------------------------------------------------------------ output
def stage_rows(doc: dict) -> list[dict]:
    """Per stage and path: wall-equivalent ms (thread time / threads), GFLOP/s and share of peak."""
    threads = doc["settings"]["threads"]
    rows = []
    for name, cost in doc["stages"].items():
        row = {"stage": name, "what": STAGES[name], "gflop": cost["flops"] / 1e9, "mb": cost["bytes"] / 1e6,
               "paths": {}}
        for isa, entry in doc["paths"].items():
            seconds = entry["thread_s"][name] / threads
            rate = cost["flops"] / seconds / 1e9 if seconds > 0 else 0.0
            row["paths"][isa] = {"ms": seconds * 1e3, "gflops": rate, "peak_share": rate / entry["peak"]["gflops"]}
        rows.append(row)
    return rows


def summary(doc: dict) -> dict:
    """Per path: kernel and outside times, total FLOP rate, and the largest stage with its share of peak."""
    threads, rows = doc["settings"]["threads"], stage_rows(doc)
    total_flops = sum(c["flops"] for c in doc["stages"].values())
    out = {}
    for isa, entry in doc["paths"].items():
        kernels = entry["forward_wall_s"] + entry["backward_wall_s"]
        largest = max(rows, key=lambda r: r["paths"][isa]["ms"])
        busy = sum(entry["thread_s"].values()) / threads
        out[isa] = {"step_s": entry["step_s"], "kernels_wall_s": kernels, "outside_s": entry["step_s"] - kernels,
                    "stages_s": busy, "step_gflops": total_flops / entry["step_s"] / 1e9,
                    "kernel_gflops": total_flops / busy / 1e9 if busy else 0.0,
                    "peak_gflops": entry["peak"]["gflops"], "largest_stage": largest["stage"],
                    "largest_share_of_step": largest["paths"][isa]["ms"] / 1e3 / entry["step_s"],
                    "largest_gflops": largest["paths"][isa]["gflops"],
                    "largest_peak_share": largest["paths"][isa]["peak_share"]}
    return out


def _peak_text(peak: dict) -> str:
    return (f"{peak['isa']} peak estimate {peak['gflops']:.0f} GFLOP/s = {peak['cores']} cores x "
            f"{peak['clock_ghz']:.2f} GHz ({peak['clock_source']}) x {peak['flops_per_cycle']} FLOP/cycle "
            f"({peak['why']})")


def format_table(doc: dict) -> str:
    isas, sm = list(doc["paths"]), summary(doc)
    lines = [f"{doc['graph']}: fused training step on the CPU, {doc['device']['name']}, {doc['settings']['threads']} "
             f"threads; {doc['shape']['layers']} layers, E={doc['shape']['E']:,}, C={doc['shape']['C']}, "
             f"H={doc['shape']['H']}, D={doc['shape']['D']}, m={doc['shape']['m']}, {doc['shape']['aggr']}; "
             f"median of {doc['settings']['repeats']} interleaved steps; load average "
             f"{doc['load_average']['start'][0]:.1f} -> {doc['load_average']['end'][0]:.1f}",
             f"{'stage':24s} {'GFLOP':>8s} {'MB':>8s} " + " ".join(f"{isa + ' ms':>10s} {'GFLOP/s':>8s} {'peak':>6s}"
                                                                    for isa in isas)]
    for row in stage_rows(doc):
        lines.append(f"{row['stage']:24s} {row['gflop']:8.1f} {row['mb']:8.0f} " + " ".join(
            f"{row['paths'][isa]['ms']:10.0f} {row['paths'][isa]['gflops']:8.1f} "
            f"{100 * row['paths'][isa]['peak_share']:5.1f}%" for isa in isas))
    for label, key in (("stages (thread s / threads)", "stages_s"), ("fused kernels, wall", "kernels_wall_s"),
                       ("outside the fused kernels", "outside_s"), ("step", "step_s")):
        lines.append(f"{label:42s} " + " ".join(f"{sm[isa][key] * 1e3:10.0f} {'':8s} {'':6s}" for isa in isas))
    for isa in isas:
        s = sm[isa]
        lines.append(f"{isa}: {s['step_gflops']:.1f} GFLOP/s over the step, {s['kernel_gflops']:.1f} over the kernel "
                     f"stages; largest stage {s['largest_stage']} ({100 * s['largest_share_of_step']:.0f}% of the "
                     f"step) at {s['largest_gflops']:.1f} GFLOP/s = {100 * s['largest_peak_share']:.0f}% of the "
                     f"{_peak_text(doc['paths'][isa]['peak'])}")
    if len(isas) > 1:
        base = isas[-1]
        lines.append("step time ratios: " + ", ".join(
            f"{isa}/{base} {sm[isa]['step_s'] / sm[base]['step_s']:.2f}x" for isa in isas[:-1]))
    return "\n".join(lines)


def markdown(doc: dict) -> str:
    """The per-stage table of one profile document (the block in docs/runs/cpu-2026-11-27-avx512.md)."""
    isas, sm = list(doc["paths"]), summary(doc)
    head = "| stage | GFLOP | MB | " + " | ".join(f"{isa} ms | {isa} GFLOP/s | {isa} % of peak" for isa in isas) + " |"
    lines = [head, "|---|---:|---:|" + "---:|---:|---:|" * len(isas)]
    for row in stage_rows(doc):
        lines.append(f"| {row['stage']} ({row['what']}) | {row['gflop']:,.1f} | {row['mb']:,.0f} | " + " | ".join(
            f"{row['paths'][isa]['ms']:,.0f} | {row['paths'][isa]['gflops']:.1f} | "
            f"{100 * row['paths'][isa]['peak_share']:.1f}%" for isa in isas) + " |")
    for label, key in (("all stages (thread time / threads)", "stages_s"), ("fused kernels, wall", "kernels_wall_s"),
                       ("outside the fused kernels", "outside_s"), ("**step**", "step_s")):
        total = f"{sum(c['flops'] for c in doc['stages'].values()) / 1e9:,.1f}" if key == "step_s" else ""
        lines.append(f"| {label} | {total} | | " + " | ".join(
            f"{sm[isa][key] * 1e3:,.0f} | {sm[isa]['step_gflops']:.1f} | {100 * sm[isa]['step_gflops'] / sm[isa]['peak_gflops']:.1f}%"
            if key == "step_s" else f"{sm[isa][key] * 1e3:,.0f} | | " for isa in isas) + " |")
    lines += ["", f"`{doc['command']}` — {doc['created']}, {doc['device']['name']}, 1-min load "
                  f"{doc['load_average']['start'][0]:.1f} → {doc['load_average']['end'][0]:.1f}, torch "
                  f"{doc['versions']['torch']}. Peaks: " + "; ".join(_peak_text(doc["paths"][isa]["peak"]) for isa in isas)]
    return "\n".join(lines)


def default_out(doc: dict, results_dir: Path) -> Path:
    import re

    slug = re.sub(r"[^a-z0-9.]+", "-", doc["device"]["name"].lower()).strip("-")
    suffix = "-dry-run" if doc["settings"]["dry_run"] else ""
    return results_dir / f"{slug}-layer-profile-{doc['graph']}{suffix}.json"


def publish(doc: dict, docs_dir: Path) -> Path:
    """Write the profile block (``<!-- bench:layer-profile-GRAPH -->``) on the page of ``docs_dir`` that holds
    it (results.md when none does)."""
    from nt_kernels.bench.plot import write_block

    return write_block(docs_dir, f"layer-profile-{doc['graph']}", markdown(doc))


# -------------------------------------------------------------------- CLI
def add_arguments(parser) -> None:
    """The --profile options of ``nt-kernels bench --layer``."""
    group = parser.add_argument_group(
        "CPU profile (--layer --profile)", "the fused step's time, FLOPs, bytes and GFLOP/s per kernel stage on the "
        "CPU against the estimated peak of the ISA path; --graph, --repeats, --warmup, --threads, --seed, "
        "--messages, --dry-run, --data-root, --out, --from-json, --plot and --docs-dir apply")
    group.add_argument("--profile", action="store_true", help="profile the fused step's CPU kernel stages")
    group.add_argument("--isa", default=None,
                       help="ISA paths to profile, interleaved: a comma list of base, avx2, avx512 or 'all' (every "
                            "path this CPU runs); default: this process's path (NT_KERNELS_CPU_ISA)")
    group.add_argument("--clock-ghz", type=float, default=None,
                       help="core clock for the peak estimate (default: measured with a chain of dependent adds)")


def run(args) -> int:
    """``nt-kernels bench --layer --profile``: measure (or read --from-json), print, write JSON, update its block."""
    from nt_kernels.bench import measure as bm

    if args.from_json:
        docs = bm.read_results(args.from_json)
    else:
        if not args.layer:
            raise SystemExit("bench: --profile, --isa and --clock-ghz apply with --layer")
        from nt_kernels.bench import layer

        layer.check_mode(args)
        if args.dtype != "float32":
            raise SystemExit(f"bench --layer --profile: the CPU kernels are profiled in float32, got --dtype {args.dtype}")
        if args.repeats < 1 or args.warmup < 0:
            raise SystemExit("bench --layer --profile: --repeats must be >= 1 and --warmup >= 0")
        names = [n.strip() for n in args.graph.split(",") if n.strip()]
        docs = bm.measure_graphs(names, args.out, lambda name: profile_graph(name, args), default_out,
                                 "bench --layer --profile")
    bm.print_results(docs, format_table)
    if args.plot:
        for doc, _ in docs:
            print(f"-> {publish(doc, Path(args.docs_dir))}")
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1]))
