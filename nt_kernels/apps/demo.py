"""``nt-kernels demo``: the main job on an embedded synthetic graph.

1. The fused op against the paper's strategies (padded, sequential,
   partitioned α = 0.4; "parallel" pads everything, "by-size" pads each path) on a degree-matched
   synthetic graph (a quarter-size synthetic minesweeper with power-law
   degrees, so hubs take the Performer path): forward and forward+backward
   medians, peak memory (each backend in a fresh subprocess) and max error
   against the float64 loop reference.
2. A short training run on a small graph with monophily: NT against an MLP of
   equal width, printing both validation scores.
"""
from __future__ import annotations

import argparse
import tempfile

DEMO_GRAPH = "synthetic-minesweeper"
DEMO_SCALE = 0.25
DEMO_BACKENDS = "fused,parallel,by-size,sequential,partitioned"


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("demo", help="check and time the fused op on a synthetic graph, then train NT vs MLP",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="timed iterations per backend (median reported)")
    p.add_argument("--no-train", action="store_true", help="skip the NT vs MLP training run")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from nt_kernels.apps.train import demo_training
    from nt_kernels.bench import cli as bench

    with tempfile.TemporaryDirectory(prefix="nt-demo-") as out:
        parser = argparse.ArgumentParser()
        bench.add_parser(parser.add_subparsers())
        bench_args = parser.parse_args([
            "bench", "--graph", DEMO_GRAPH, "--scale", str(DEMO_SCALE), "--heads", str(args.heads),
            "--head-dim", str(args.head_dim), "--device", "cpu", "--repeats", str(args.repeats),
            "--backends", DEMO_BACKENDS, "--alphas", "0.4", "--out", out])
        doc = bench.run_graph(DEMO_GRAPH, bench_args)
    print(bench.format_table(doc))
    failed = [e["backend"] for e in doc["results"]
              if e.get("status") != "ok" and not e.get("status", "").startswith("skipped")]
    if failed:
        print(f"demo: backends failed: {', '.join(failed)}")
        return 1
    if not args.no_train:
        result = demo_training()
        print(f"\ntraining on a monophily graph ({result['graph']}), {result['epochs']} epochs, "
              f"validation {result['metric']}: NT {result['nt_val']:.3f} vs MLP {result['mlp_val']:.3f}")
    return 0
