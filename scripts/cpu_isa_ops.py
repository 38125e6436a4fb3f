"""Attention op forward+backward on each CPU ISA path, interleaved (issue 31's op-level target).

For each case -- graph (minesweeper, tolokers), heads x head dim (4 x 8, 2 x 32)
and path (``exact``: the segments up to the switch threshold, exact attention;
``performer``: the segments above it, Performer attention; on minesweeper,
whose segments are all below the threshold, ``performer`` runs every segment
through the Performer, threshold 0) -- one worker process per
NT_KERNELS_CPU_ISA path builds the sub-graph, float32 q, k, v and a
projection as ``nt-kernels bench --subset`` does, and times
``neighbourhood_attention`` forward + backward.  The workers take turns, one
timed fwd+bwd each per round (after --warmup untimed rounds), so that a busy
machine slows every path alike; medians over --repeats rounds.

    python scripts/cpu_isa_ops.py --isa avx2,avx512 --threads 2 --json out.json
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch

from nt_kernels.bench.layer_profile import MARK, Worker

CASES = [(graph, heads, head_dim, path) for graph in ("minesweeper", "tolokers") for heads, head_dim in ((4, 8), (2, 32))
         for path in ("exact", "performer")]


def case_name(case) -> str:
    graph, heads, head_dim, path = case
    return f"{graph} H{heads} D{head_dim} {path}"


def worker(spec: dict) -> int:
    """Set up one case on this process's ISA path; then one timed fwd+bwd per 'step' line."""
    from nt_kernels import neighbourhood_attention
    from nt_kernels._extension import extension
    from nt_kernels.bench import cli, measure
    from nt_kernels.performer import default_nb_features, switch_threshold

    torch.set_num_threads(spec["threads"])
    graph, heads, head_dim, path = spec["case"]
    csr, _, _ = cli.load_csr(graph, argparse.Namespace(scale=1.0, data_root=None))
    m = default_nb_features(head_dim)
    threshold = switch_threshold(m, head_dim)
    if path == "performer" and int(csr.max_degree) <= threshold:
        threshold = 0.0  # no segment above n*: every segment through the Performer
    csr = cli.subset_csr(csr, threshold, path)
    threshold = math.inf if path == "exact" else threshold
    settings = {"seed": 0, "heads": heads, "head_dim": head_dim, "dtype": "float32", "device": "cpu",
                "nb_features": m}
    q, k, v, grad = measure.make_inputs(csr.num_edges, settings, 0)
    projection = measure.make_projection(settings)
    csr.segment_split(threshold)

    def step() -> float:
        tick = time.perf_counter()
        out = neighbourhood_attention(q, k, v, csr, projection=projection, threshold=threshold)
        torch.autograd.grad(out, (q, k, v), grad)
        return time.perf_counter() - tick

    for _ in range(2):
        step()
    print(MARK + json.dumps({"isa": extension().cpu_isa(), "rows": csr.num_edges, "segments": csr.num_nodes,
                             "threshold": threshold}), flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        print(MARK + json.dumps({"fwd_bwd_s": step()}), flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--isa", default="avx2,avx512", help="comma list of NT_KERNELS_CPU_ISA paths")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--cases", default=None, help="substring filter on the case names")
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    isas = args.isa.split(",")
    results = []
    for case in CASES:
        if args.cases and args.cases not in case_name(case):
            continue
        spec = json.dumps({"case": case, "threads": args.threads})
        workers = [Worker([sys.executable, __file__, "--worker", spec], isa) for isa in isas]
        times = {isa: [] for isa in isas}
        try:
            for round_ in range(args.warmup + args.repeats):
                for w in workers:
                    seconds = w.send("step")["fwd_bwd_s"]
                    if round_ >= args.warmup:
                        times[w.isa].append(seconds)
        finally:
            for w in workers:
                w.close()
        medians = {isa: statistics.median(t) for isa, t in times.items()}
        entry = {"case": case_name(case), "rows": workers[0].ready["rows"], "threshold": workers[0].ready["threshold"],
                 "fwd_bwd_ms": {isa: t * 1e3 for isa, t in medians.items()},
                 "runs_ms": {isa: [x * 1e3 for x in t] for isa, t in times.items()}}
        results.append(entry)
        ratios = ", ".join(f"{a}/{isas[-1]} {medians[a] / medians[isas[-1]]:.2f}x" for a in isas[:-1])
        print(f"{entry['case']:32s} {entry['rows']:>9,} rows  " + "  ".join(
            f"{isa} {medians[isa] * 1e3:9.1f} ms" for isa in isas) + f"  ({ratios})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "isas": isas, "repeats": args.repeats, "results": results}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
