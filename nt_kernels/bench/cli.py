"""``nt-kernels bench``: our fused op against the loop reference, the paper's strategies and the peers.

One run measures every backend of :mod:`nt_kernels.bench.backends` on one or
more graphs with the same inputs, writes a JSON document per graph (device,
versions, graph statistics, settings, per-backend results and a summary) and
prints a table.  How memory, time and error are measured is documented in
:mod:`nt_kernels.bench.measure`; docs/results.md repeats it for readers.
``--layer`` measures NT training steps, fused vs ``fused=False``, instead
(:mod:`nt_kernels.bench.layer`).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from nt_kernels.bench import backends as bb
from nt_kernels.bench import layer, layer_profile
from nt_kernels.bench import measure as bm
from nt_kernels.bench import peers
from nt_kernels.bench.context import PEER_FAMILIES
from nt_kernels.bench.measure import device_name, slug, versions

SCHEMA_VERSION = 1
REAL_GRAPHS = ("minesweeper", "tolokers")
DEFAULT_CAP_GB = 10.0
DEFAULT_REFERENCE_MAX_EDGES = 20_000
DESCRIPTION = ("Measure forward and forward+backward time, peak memory and error of the fused op, the loop "
               "reference, the paper's parallel / by-size / partitioned(alpha) / sequential strategies and "
               "the peers a user would write instead (pyg-pairs, nested-tensor SDPA, FlexAttention, "
               "performer-pytorch FastAttention) on the same inputs; write one JSON per graph (to --out, "
               "default the current directory) and print a table. With --layer: NT training steps, "
               "fused vs fused=False (see the 'layer level' options).")
SUBSETS = ("all", "exact", "performer")


# ----------------------------------------------------------------- graphs
def graph_names(spec: str) -> list[str]:
    from nt_kernels.data import PAPER_GRAPHS

    known = list(REAL_GRAPHS) + [f"synthetic-{name}" for name in PAPER_GRAPHS]
    if spec == "all":
        return known
    names = [n.strip() for n in spec.split(",") if n.strip()]
    for name in names:
        if name not in known:
            raise ValueError(f"bench: unknown graph {name!r}; choose from {known} or 'all'")
    return names


def load_csr(name: str, args):
    """(NeighbourhoodCSR on the CPU, source, scale) for a real or synthetic graph name."""
    from nt_kernels.csr import NeighbourhoodCSR
    from nt_kernels.data import load_npz, synthetic_graph

    if name.startswith("synthetic-"):
        graph, source, scale = synthetic_graph(name[len("synthetic-"):], scale=args.scale), "synthetic", args.scale
    else:
        graph, source, scale = load_npz(name, args.data_root, undirected=True), "real", None
    return NeighbourhoodCSR.from_edge_index(graph.edge_index, graph.num_nodes), source, scale


def subset_csr(csr, threshold: float, subset: str):
    """The sub-CSR of the segments on one path: ``exact`` (0 < size <= threshold) or ``performer`` (> threshold)."""
    from nt_kernels.csr import NeighbourhoodCSR

    degree = csr.degree
    keep = (degree > 0) & (degree <= threshold) if subset == "exact" else degree > threshold
    rows = keep[csr.centre]
    sizes = degree[keep]
    rowptr = torch.zeros(sizes.numel() + 1, dtype=torch.long)
    torch.cumsum(sizes, 0, out=rowptr[1:])
    num_rows = int(rowptr[-1])
    return NeighbourhoodCSR(rowptr, torch.arange(num_rows), csr.receiver[rows], sizes.numel(),
                            int(sizes.max()) if sizes.numel() else 0)


def graph_stats(csr, threshold: float) -> dict:
    sizes, counts = (t.tolist() for t in csr.size_hist)
    per_path = {"exact": 0, "performer": 0, "empty": 0}
    for n, c in zip(sizes, counts):
        per_path["empty" if n == 0 else "performer" if n > threshold else "exact"] += c
    return {"num_nodes": csr.num_nodes, "num_edges": csr.num_edges, "max_degree": csr.max_degree,
            "distinct_sizes": len(sizes), "segments": per_path}


# -------------------------------------------------------------- reference
def compute_reference(ctx: bb.Context, settings: dict, semantics: str):
    """Float64 output on input set 0: the loop reference where E is small enough, else sequential."""
    from nt_reference import ops as ref
    from nt_kernels.baselines import strategies

    q, k, v = (t.detach().to("cpu", torch.float64) for t in bm.make_inputs(ctx.num_edges, settings, 0)[:3])
    rowptr = ctx.csr.rowptr.cpu()
    projection = ctx.projection.detach().to("cpu", torch.float64) if semantics == "switch" and \
        ctx.projection is not None else None
    threshold = ctx.threshold if projection is not None else math.inf
    with torch.no_grad():
        if ctx.num_edges <= ctx.reference_max_edges:
            out = ref.neighbourhood_attention(q, k, v, rowptr, projection=projection, threshold=threshold)
            return out, f"loop reference ({semantics}), float64"
        out = strategies.sequential(q, k, v, rowptr, projection=projection, threshold=threshold)
        return out, f"sequential strategy ({semantics}), float64"


# ------------------------------------------------------------------- runs
def _run_subprocess(backend: bb.Backend, settings: dict, graph_file: Path, refs: dict, tmp: Path,
                    timeout: float) -> dict:
    entry = {"backend": backend.name, "family": backend.family, "alpha": backend.alpha}
    spec = {"settings": settings, "graph_file": str(graph_file), "result_file": str(tmp / "result.json"),
            "backend": {"name": backend.name, "family": backend.family, "alpha": backend.alpha},
            "refs": {key: [str(path), label] for key, (path, label) in refs.items()}}
    (tmp / "spec.json").write_text(json.dumps(spec))
    Path(spec["result_file"]).unlink(missing_ok=True)
    return bm.run_worker("nt_kernels.bench.measure", tmp / "spec.json", Path(spec["result_file"]), timeout, entry)


def run_graph(name: str, args) -> dict:
    """Measure every selected backend on one graph; returns the JSON document."""
    from nt_kernels.performer import default_nb_features, switch_threshold

    device = torch.device(args.device)
    load_start = os.getloadavg()
    csr, source, scale = load_csr(name, args)
    m = args.nb_features or default_nb_features(args.head_dim)
    threshold = args.threshold if args.threshold is not None else switch_threshold(m, args.head_dim)
    if args.subset != "all":
        full_stats = graph_stats(csr, threshold)
        csr = subset_csr(csr, threshold, args.subset)
        if args.subset == "exact":
            m, threshold = 0, math.inf
    stats = graph_stats(csr, threshold)
    stats.update(name=name, source=source, scale=scale)
    if args.subset != "all":
        stats["full_graph"] = full_stats
    settings = {"heads": args.heads, "head_dim": args.head_dim, "dtype": args.dtype, "device": str(device),
                "threads": torch.get_num_threads(), "seed": args.seed, "repeats": args.repeats,
                "warmup": args.warmup, "input_sets": args.input_sets, "nb_features": m,
                "threshold": "inf" if math.isinf(threshold) else threshold, "subset": args.subset,
                "isolation": "in-process" if args.in_process else "subprocess",
                "memory_cap_gb": args.memory_cap_gb, "reference_max_edges": args.reference_max_edges}
    blob = {"rowptr": csr.rowptr, "perm": csr.perm, "receiver": csr.receiver, "num_nodes": csr.num_nodes,
            "max_degree": csr.max_degree, "hist": tuple(t.tolist() for t in csr.size_hist)}
    ctx = bm.build_context(blob, settings)
    backends = bb.select_backends(args.backends, args.alphas)
    skips = {b.name: bb.skip_reason(b, ctx) for b in backends}
    if args.in_process and any(b.family == "fused" and not skips[b.name] for b in backends):
        skips["fused"] = bb.fused_unavailable(device)
    needed = {b.semantics for b in backends if not skips[b.name]}
    if not ctx.has_performer_segments:
        needed = {"switch"} if needed else set()
    refs = {sem: compute_reference(ctx, settings, sem) for sem in sorted(needed)}
    if not ctx.has_performer_segments and refs:
        refs["exact"] = refs["switch"]
    results = []

    def document() -> dict:
        return {"schema_version": SCHEMA_VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "command": command_line(name, args),
                "device": {"name": device_name(device), "type": device.type, "threads": torch.get_num_threads()},
                "versions": versions(), "graph": stats, "settings": settings, "results": list(results),
                "load_average": {"start": list(load_start), "end": list(os.getloadavg())}}

    with tempfile.TemporaryDirectory(prefix="nt-bench-") as tmp_name:
        tmp = Path(tmp_name)
        if not args.in_process:
            torch.save(blob, tmp / "graph.pt")
            saved = {}
            for sem, (tensor, label) in refs.items():
                torch.save(tensor, tmp / f"ref-{sem}.pt")
                saved[sem] = (tmp / f"ref-{sem}.pt", label)
            refs = saved
        for backend in backends:
            started = time.perf_counter()
            entry = {"backend": backend.name, "family": backend.family, "alpha": backend.alpha}
            if skips[backend.name]:
                entry["status"] = skips[backend.name]
            elif args.in_process:
                entry = bm.measure_backend(backend, ctx, settings, refs)
            else:
                entry = _run_subprocess(backend, settings, tmp / "graph.pt", refs, tmp, args.timeout)
            estimate = bb.padded_estimate_bytes(backend, ctx)
            if estimate is not None:
                entry["padded_estimate_bytes"] = estimate
                entry["padded_calls"] = len(bb.padded_groups(backend, ctx))
            pairs = peers.pairs_estimate_bytes(backend, ctx)
            if pairs is not None:
                entry["pairs"] = peers.sum_squared_sizes(ctx)
                entry["pairs_estimate_bytes"] = pairs
            peer_estimate = peers.estimate_bytes(backend, ctx)
            if peer_estimate is not None and pairs is None:
                entry["memory_estimate_bytes"] = peer_estimate
            results.append(entry)
            print(f"  {name}: {backend.name:16s} {entry['status'][:60]:60s} ({time.perf_counter() - started:.1f} s)",
                  file=sys.stderr, flush=True)
            if args.out and args.out.endswith(".json") and backend is not backends[-1]:
                # A run stopped by a time limit (the GPU scripts') keeps every backend measured so far.
                partial = dict(document(), partial=f"{len(results)} of {len(backends)} backends")
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps(partial, indent=1) + "\n")
    doc = document()
    doc["summary"] = summarize(doc)
    return doc


# ---------------------------------------------------------------- summary
def _ok(entry: dict) -> bool:
    return entry.get("status") == "ok"


def _ratio(a, b):
    return a / b if b else None


# What a user would write instead: the peers, and the Performer composed of library GEMMs (issue 39's yardstick).
SUMMARY_PEERS = (*PEER_FAMILIES, "performer-gemm")


def summarize_peers(doc: dict) -> dict:
    """Fused vs the fastest peer: fwd+bwd among peers with a backward, forward among all that ran.

    Only peers that compute what the fused op computes count: on a graph with
    Performer-path segments the exact-everywhere peers do other work and are left out.
    """
    by_name = {e["backend"]: e for e in doc["results"]}
    fused = by_name.get("fused")
    all_exact = doc["graph"]["segments"]["performer"] == 0
    ran = [e for e in doc["results"] if e["family"] in SUMMARY_PEERS and "forward_ms" in e
           and e["status"] in ("ok", bm.FORWARD_ONLY)
           and (all_exact or bb.Backend(e["backend"], e["family"], e["alpha"]).semantics == "switch")]
    summary = {}
    if not ran or not (fused and _ok(fused)):
        return summary
    with_backward = [e for e in ran if _ok(e)]
    if with_backward:
        best = min(with_backward, key=lambda e: e["forward_backward_ms"])
        summary.update(fastest_peer=best["backend"],
                       speedup_fwd_bwd_vs_fastest_peer=_ratio(best["forward_backward_ms"],
                                                              fused["forward_backward_ms"]),
                       memory_ratio_vs_fastest_peer=_ratio(fused["peak_memory_bytes"], best["peak_memory_bytes"]))
    best = min(ran, key=lambda e: e["forward_ms"])
    summary.update(fastest_peer_forward=best["backend"],
                   speedup_fwd_vs_fastest_peer_forward=_ratio(best["forward_ms"], fused["forward_ms"]))
    return summary


def summarize_gemm(doc: dict) -> dict:
    """fwd+bwd speed-up of fused and of each forced CUDA Performer backend over the performer-gemm yardstick
    (issue 39: a hand-written Performer kernel must beat the library-GEMM composition of the same math)."""
    by_name = {e["backend"]: e for e in doc["results"]}
    gemm = by_name.get("performer-gemm")
    if not (gemm and _ok(gemm)):
        return {}
    names = ["fused", *bb.PERFORMER_KERNELS]
    return {f"speedup_fwd_bwd_vs_performer_gemm_{name}": _ratio(gemm["forward_backward_ms"],
                                                                 by_name[name]["forward_backward_ms"])
            for name in names if name in by_name and _ok(by_name[name])}


def summarize(doc: dict) -> dict:
    """Fused vs the fastest paper strategy (time and memory ratios), vs partitioned alpha = 0.4, vs the peers."""
    by_name = {e["backend"]: e for e in doc["results"]}
    fused = by_name.get("fused")
    strategies = [e for e in doc["results"] if e["family"] in bb.STRATEGY_FAMILIES and _ok(e)]
    summary = {"fused": "ok" if fused and _ok(fused) else (fused or {}).get("status", "not run")}
    summary.update(summarize_peers(doc))
    summary.update(summarize_gemm(doc))
    if not strategies:
        return summary
    best = min(strategies, key=lambda e: e["forward_backward_ms"])
    summary["best_strategy"] = best["backend"]
    lowest = min(strategies, key=lambda e: e["peak_memory_bytes"])
    summary["lowest_memory_strategy"] = lowest["backend"]
    if fused and _ok(fused):
        summary["speedup_fwd_bwd_vs_best"] = _ratio(best["forward_backward_ms"], fused["forward_backward_ms"])
        summary["speedup_fwd_vs_best"] = _ratio(best["forward_ms"], fused["forward_ms"])
        summary["memory_ratio_vs_best"] = _ratio(fused["peak_memory_bytes"], best["peak_memory_bytes"])
        summary["memory_ratio_vs_lowest"] = _ratio(fused["peak_memory_bytes"], lowest["peak_memory_bytes"])
        p04 = by_name.get("partitioned-0.4")
        if p04 and _ok(p04):
            summary["speedup_fwd_bwd_vs_partitioned_0.4"] = _ratio(p04["forward_backward_ms"],
                                                                  fused["forward_backward_ms"])
            summary["memory_ratio_vs_partitioned_0.4"] = _ratio(fused["peak_memory_bytes"], p04["peak_memory_bytes"])
    return summary


def command_line(name: str, args) -> str:
    """The full command that reproduces this graph's run (options left at their default omitted)."""
    parts = ["nt-kernels bench", f"--graph {name}", f"--heads {args.heads}", f"--head-dim {args.head_dim}",
             f"--dtype {args.dtype}", f"--device {args.device}", f"--repeats {args.repeats}",
             f"--warmup {args.warmup}"]
    if name.startswith("synthetic-"):
        parts.append(f"--scale {args.scale:g}")
    optional = [("--subset", args.subset, "all"), ("--backends", args.backends, None),
                ("--alphas", ",".join(f"{a:g}" for a in args.alphas), ",".join(f"{a:g}" for a in bb.ALPHAS)),
                ("--nb-features", args.nb_features, None), ("--threshold", args.threshold, None),
                ("--memory-cap-gb", args.memory_cap_gb, DEFAULT_CAP_GB),
                ("--reference-max-edges", args.reference_max_edges, DEFAULT_REFERENCE_MAX_EDGES),
                ("--input-sets", args.input_sets, 2), ("--seed", args.seed, 0)]
    parts += [f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}"
              for flag, value, default in optional if value != default]
    if args.in_process:
        parts.append("--in-process")
    return " ".join(parts)


def default_out(doc: dict, results_dir: Path) -> Path:
    s, g = doc["settings"], doc["graph"]
    parts = [f"h{s['heads']}", f"d{s['head_dim']}", s["dtype"]]
    if g["source"] == "synthetic" and g["scale"] != 1:
        parts.append(f"x{g['scale']:g}")
    if s["subset"] != "all":
        parts.append(s["subset"])
    elif s["threshold"] == "inf":
        parts.append("exact-everywhere")
    return results_dir / f"{slug(doc['device']['name'])}-{g['name']}-{'-'.join(parts)}.json"


def format_table(doc: dict) -> str:
    s, g = doc["settings"], doc["graph"]
    lines = [f"{g['name']}: N={g['num_nodes']} E={g['num_edges']} max degree={g['max_degree']} "
             f"segments={g['segments']} | H={s['heads']} D={s['head_dim']} {s['dtype']} m={s['nb_features']} "
             f"threshold={s['threshold']} | {doc['device']['name']}, {s['threads']} threads"
             + (f", load average {doc['load_average']['start'][0]:.1f} -> {doc['load_average']['end'][0]:.1f}"
                if "load_average" in doc else ""),
             f"{'backend':16s} {'fwd ms':>10s} {'fwd+bwd ms':>11s} {'peak MB':>9s} {'max err':>9s} "
             f"{'rel err':>9s}  status"]
    for e in doc["results"]:
        if _ok(e):
            lines.append(f"{e['backend']:16s} {e['forward_ms']:10.2f} {e['forward_backward_ms']:11.2f} "
                         f"{e['peak_memory_bytes'] / 2**20:9.1f} {e.get('max_abs_error', math.nan):9.2e} "
                         f"{e.get('rel_error', math.nan):9.2e}  ok")
        elif e["status"] == bm.FORWARD_ONLY:
            lines.append(f"{e['backend']:16s} {e['forward_ms']:10.2f} {'-':>11s} "
                         f"{e['peak_memory_bytes'] / 2**20:9.1f} {e.get('max_abs_error', math.nan):9.2e} "
                         f"{e.get('rel_error', math.nan):9.2e}  {e['status']}: {e['forward_only']}")
        else:
            lines.append(f"{e['backend']:16s} {'-':>10s} {'-':>11s} {'-':>9s} {'-':>9s} {'-':>9s}  {e['status']}")
    sm = doc["summary"]
    if "speedup_fwd_bwd_vs_best" in sm:
        memory = sm["memory_ratio_vs_best"]
        lines.append(f"fused vs best strategy ({sm['best_strategy']}): {sm['speedup_fwd_bwd_vs_best']:.2f}x faster "
                     f"fwd+bwd, " + (f"{memory:.3f}x its peak memory" if memory is not None else
                                     "its peak memory was 0 (n/a)"))
    if "speedup_fwd_vs_fastest_peer_forward" in sm:
        line = (f"fused vs fastest peer forward ({sm['fastest_peer_forward']}): "
                f"{sm['speedup_fwd_vs_fastest_peer_forward']:.2f}x faster forward")
        if "speedup_fwd_bwd_vs_fastest_peer" in sm:
            line += (f"; vs fastest peer fwd+bwd ({sm['fastest_peer']}): "
                     f"{sm['speedup_fwd_bwd_vs_fastest_peer']:.2f}x faster")
        lines.append(line)
    return "\n".join(lines)


# -------------------------------------------------------------------- CLI
def _alphas(text: str) -> tuple[float, ...]:
    return tuple(float(a) for a in text.split(",") if a.strip())


def _threshold(text: str) -> float:
    return math.inf if text == "inf" else float(text)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="time and measure the fused op against the paper's strategies",
                              description=DESCRIPTION)
    p.add_argument("--graph", default="minesweeper", help="minesweeper, tolokers, synthetic-<paper dataset>, "
                   "a comma list, or 'all' (default: minesweeper)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=8)
    p.add_argument("--dtype", choices=[*sorted(bm.DTYPES), "bfloat16-autocast"], default="float32",
                   help="input dtype; --layer: float32 or bfloat16-autocast (default float32)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="intra-op CPU threads (default: torch's)")
    p.add_argument("--scale", type=float, default=1.0, help="size factor of synthetic graphs")
    p.add_argument("--repeats", type=int, default=10, help="timed iterations (median reported)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed iterations after the memory pass (which is itself a warm-up); --layer: "
                        "warm-up steps before the timed ones (layer options)")
    p.add_argument("--input-sets", type=int, default=2, help="input sets rotated between iterations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nb-features", type=int, default=None, help="Performer features m (default D ln D)")
    p.add_argument("--threshold", type=_threshold, default=None, help="switch size (default the paper's n*)")
    p.add_argument("--subset", choices=SUBSETS, default="all",
                   help="'exact': only the exact-path segments, exact attention everywhere; 'performer': only "
                        "the segments above the threshold (Performer everywhere; the performer-pytorch peers)")
    p.add_argument("--backends", default=None, help="comma list of backends or families (default all)")
    p.add_argument("--alphas", type=_alphas, default=bb.ALPHAS, help="alphas of the partitioned strategy")
    p.add_argument("--memory-cap-gb", type=float, default=DEFAULT_CAP_GB,
                   help="skip strategies whose padded-tensor estimate exceeds this; CPU workers get it as "
                        "an address-space limit (default %(default)s)")
    p.add_argument("--reference-max-edges", type=int, default=DEFAULT_REFERENCE_MAX_EDGES,
                   help="run the loop reference only up to this many messages")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per backend worker (--layer: per variant)")
    p.add_argument("--in-process", action="store_true",
                   help="measure in this process (fast; CPU peak memory is then a lower bound)")
    p.add_argument("--data-root", default=None, help="directory of the real graphs' npz files")
    p.add_argument("--out", default=None, help="JSON file (one graph) or directory (default: the current directory)")
    p.add_argument("--from-json", nargs="+", default=None, metavar="FILE",
                   help="measure nothing: print, plot and tabulate these result files")
    p.add_argument("--plot", action="store_true",
                   help="draw the efficiency figures and write each result file's block in --docs-dir (on the page "
                        "that holds it, a new one in results.md; the headline tables: nt-kernels results)")
    p.add_argument("--docs-dir", default=".",
                   help="where --plot writes the figures and the blocks (default: the current directory)")
    p.set_defaults(func=run)
    layer.add_arguments(p)
    layer_profile.add_arguments(p)
    return p


def run(args) -> int:
    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit(f"bench: --threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.profile or args.isa or args.clock_ghz:
        return layer_profile.run(args)
    if args.layer:
        return layer.run(args)
    if args.from_json:
        docs = bm.read_results(args.from_json)
    else:
        layer.check_mode(args)
        docs = bm.measure_graphs(graph_names(args.graph), args.out, lambda name: run_graph(name, args),
                                 default_out, "bench")
    bm.print_results(docs, format_table)
    if args.plot:
        from nt_kernels.bench import plot

        for written in plot.publish(docs, Path(args.docs_dir)):
            print(f"-> {written}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nt-kernels")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
