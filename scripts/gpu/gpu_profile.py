"""Stage "layer" of scripts/gpu/gpu_perf.sh: where a training step's GPU time goes.

For each variant (``fused``: every NTConv ``fused=True``; ``unfused``: ``fused=False``) of a
bench graph's preset (default tolokers: gated_sum, 30 x 2 heads, 5 layers) under bf16
autocast: ``--warmup`` untimed steps (Triton compiles, plans), ``--repeats`` timed steps (the
device synchronised around each; median reported), the peak memory of one step above what was
allocated before it, then one step under ``torch.profiler`` whose ``--top`` most expensive
GPU kernels (self device time) are printed and saved with their share of the step's kernel
time.  A step is forward, cross-entropy on the loss nodes, backward and an Adam step, as in
``nt-kernels bench --layer`` (same graphs and presets: nt_kernels.bench.layer), but here
the variants run in this one process, one after the other.

A variant may name environment switches after colons, set while it runs (the op reads both at
every call): ``:recompute`` (``NT_KERNELS_NTCONV_RECOMPUTE=1``, the fused layer's opt-in sm_90
recompute path), ``:stream`` (``NT_KERNELS_NTCONV_RECOMPUTE=stream``, its streaming design, issue 40: the
default since the H200 run of 2026-11-28c), ``:stored`` (``NT_KERNELS_NTCONV_RECOMPUTE=0``, the stored path),
``:pipe`` (``NT_KERNELS_NTCONV_REDUCE=pipe``, the pipelined segmented reductions, issue 40) and ``:tc`` /
``:simt`` / ``:flash`` / ``:gemm`` (``NT_KERNELS_PERFORMER``: the CUDA Performer kernels, or
``performer-gemm``, the library-GEMM yardstick),
e.g. ``--variants fused,fused:recompute,fused:recompute:tc,unfused``.

``--variant-timeout S``: a variant still running after S seconds (a hung kernel) is recorded as
"timeout" in the JSON, which is written before each variant starts, and ends the process (Python's
faulthandler, which needs no GIL: a thread blocked in a CUDA call cannot stop it; every thread's
stack goes to stderr).  ``--resume`` skips the variants the JSON already holds, so that
scripts/gpu/gpu_perf.sh runs the ones after a hung variant in a fresh process.

On a machine without CUDA (``--device cpu``, a dry run of the GPU script) the graphs are cut
down (``build_graph(dry_run=True)``) and the table ranks CPU time instead.

    python scripts/gpu/gpu_profile.py --graph tolokers --json perf-layer.json
"""
from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import statistics
import sys
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from nt_kernels.bench.layer import LEARNING_RATE, _model, _step
from nt_kernels.bench.layer_graphs import PRESETS, build_graph
from nt_kernels.csr import NeighbourhoodCSR


def sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def train_step(model, optimizer, graph, csr, autocast: bool) -> torch.Tensor:
    """nt_kernels.bench.layer's step: forward, cross-entropy on the loss nodes, backward, Adam step."""
    return _step(model, optimizer, graph.x, graph.y, graph.loss_nodes, csr, autocast)


def kernel_table(prof, device: torch.device, top: int) -> tuple[list[dict], float, list[dict]]:
    """The ``top`` GPU kernels by device time, the sum of every kernel's time, and the ``top`` operator
    rows apart (an operator's device time is that of the kernels it launched, so adding operator rows
    to kernel rows counts the time twice: the first H200 run's table did).  On CPU, where there are
    no kernels, the operators' self CPU time stands in for both."""
    events = prof.key_averages()
    if device.type == "cuda":
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        ops = [e for e in events if e.device_type == DeviceType.CPU and e.device_time_total > 0]
        key, op_key = "self_device_time_total", "device_time_total"
    else:
        kernels = ops = list(events)
        key = op_key = "self_cpu_time_total"
    total = sum(getattr(e, key) for e in kernels) / 1e3

    def rows(items, attr):
        out = []
        for e in sorted(items, key=lambda e: -getattr(e, attr))[:top]:
            ms = getattr(e, attr) / 1e3
            out.append({"name": e.key, "calls": e.count, "ms": round(ms, 3),
                        "share": round(ms / total, 4) if total else 0.0})
        return out
    return rows(kernels, key), total, rows(ops, op_key)


SWITCHES = {"recompute": ("NT_KERNELS_NTCONV_RECOMPUTE", "1"), "stream": ("NT_KERNELS_NTCONV_RECOMPUTE", "stream"),
            "stored": ("NT_KERNELS_NTCONV_RECOMPUTE", "0"),
            "tc": ("NT_KERNELS_PERFORMER", "tc"), "simt": ("NT_KERNELS_PERFORMER", "simt"),
            "flash": ("NT_KERNELS_PERFORMER", "flash"), "gemm": ("NT_KERNELS_PERFORMER", "gemm"),
            "pipe": ("NT_KERNELS_NTCONV_REDUCE", "pipe")}


@contextlib.contextmanager
def switches(names: list[str]):
    """The environment switches of a variant (SWITCHES), set while it runs and restored after."""
    unknown = [n for n in names if n not in SWITCHES]
    if unknown:
        raise ValueError(f"--variants: unknown switch {unknown[0]!r}; expected one of {sorted(SWITCHES)}")
    saved = {SWITCHES[n][0]: os.environ.get(SWITCHES[n][0]) for n in names}
    os.environ.update(dict(SWITCHES[n] for n in names))
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def profile_variant(args, variant: str, device: torch.device) -> dict:
    base, *names = variant.split(":")
    if base not in ("fused", "unfused", "released"):
        raise ValueError(f"--variants: {variant!r} must start with fused, unfused or released")
    with switches(names):
        return _profile(args, variant, base == "fused", device, released=base == "released")


def _profile(args, variant: str, fused: bool, device: torch.device, released: bool = False) -> dict:
    graph = build_graph(args.graph, messages=None, seed=0, device=device, dry_run=device.type != "cuda")
    csr = NeighbourhoodCSR.from_edge_index(graph.edge_index, graph.x.shape[0])
    graph.edge_index = None
    torch.manual_seed(0)
    model = _model(PRESETS[args.graph], graph, fused=fused, released=released).to(device).train()
    model.prepare(csr, graph.x.shape[0])
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    autocast = args.dtype == "bfloat16-autocast"
    entry = {"variant": variant, "warmup_ms_runs": [], "step_ms_runs": []}
    for _ in range(args.warmup):
        tick = sync(device)
        train_step(model, optimizer, graph, csr, autocast)
        entry["warmup_ms_runs"].append(round(1e3 * (sync(device) - tick), 2))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    losses = []
    for _ in range(args.repeats):
        tick = sync(device)
        losses.append(float(train_step(model, optimizer, graph, csr, autocast)))
        entry["step_ms_runs"].append(round(1e3 * (sync(device) - tick), 2))
    if device.type == "cuda":
        entry["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device) - before
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        profiled_start = sync(device)
        train_step(model, optimizer, graph, csr, autocast)
        profiled_end = sync(device)
    entry["top_kernels"], entry["profiled_kernel_ms"], entry["top_ops"] = kernel_table(prof, device, args.top)
    entry["profiled_step_ms"] = round(1e3 * (profiled_end - profiled_start), 3)
    entry.update(step_ms=statistics.median(entry["step_ms_runs"]), loss_first=losses[0], loss_last=losses[-1],
                 status="ok" if all(map(lambda x: x == x and abs(x) != float("inf"), losses)) else "non-finite loss")
    return entry


def print_variant(entry: dict, device: torch.device) -> None:
    what = "GPU kernel" if device.type == "cuda" else "CPU op"
    peak = entry.get("peak_memory_bytes")
    kernels = entry["profiled_kernel_ms"]
    print(f"\n== {entry['variant']}: step {entry['step_ms']:.1f} ms (median of {len(entry['step_ms_runs'])}; "
          f"warm-up {entry['warmup_ms_runs']} ms)"
          + (f", peak {peak / 2**20:,.0f} MiB above the baseline" if peak is not None else ""), flush=True)
    print(f"profiled step {entry['profiled_step_ms']:.1f} ms (profiler on): {what}s {kernels:.1f} ms in all, "
          f"host share {entry['profiled_step_ms'] - kernels:.1f} ms (step - {what}s)")
    print(f"{'ms':>9} {'share':>6} {'calls':>6}  {what} (self time; these rows add up to the sum above)")
    for row in entry["top_kernels"]:
        print(f"{row['ms']:9.2f} {100 * row['share']:5.1f}% {row['calls']:6d}  {row['name'][:110]}")
    if device.type == "cuda":
        print(f"{'ms':>9} {'share':>6} {'calls':>6}  operator (device time of the kernels it launched: "
              "not to be added to the rows above)")
        for row in entry["top_ops"]:
            print(f"{row['ms']:9.2f} {100 * row['share']:5.1f}% {row['calls']:6d}  {row['name'][:110]}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--graph", default="tolokers", choices=sorted(PRESETS))
    parser.add_argument("--variants", default="fused,unfused",
                        help="comma list: fused, unfused or released (the paper's released attention), each "
                             "with optional :recompute, :tc or :simt switches")
    parser.add_argument("--dtype", default="bfloat16-autocast", choices=("float32", "bfloat16-autocast"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--json", default=None)
    parser.add_argument("--variant-timeout", type=float, default=0,
                        help="seconds a variant may run before it is recorded as a timeout and the process ends "
                             "(0: no limit)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the variants already in --json and run only the others")
    args = parser.parse_args(argv)
    if args.resume and not args.json:
        parser.error("--resume needs --json")
    device = torch.device(args.device)
    doc = {"graph": args.graph, "preset": vars(PRESETS[args.graph]), "dtype": args.dtype, "device": str(device),
           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "warmup": args.warmup, "repeats": args.repeats, "variants": []}
    if args.resume and os.path.exists(args.json):
        with open(args.json) as f:
            doc["variants"] = json.load(f)["variants"]
    done = {e["variant"] for e in doc["variants"]}
    for variant in args.variants.split(","):
        if variant in done:
            continue
        unfinished = (f"timeout: not finished in {args.variant_timeout:g} s" if args.variant_timeout > 0
                      else "unfinished: the process ended during it")
        doc["variants"].append({"variant": variant, "status": unfinished})
        write_json(args.json, doc)  # what stays if the watchdog (or anything else) ends the process
        if args.variant_timeout > 0:
            faulthandler.dump_traceback_later(args.variant_timeout, exit=True)
        try:
            entry = profile_variant(args, variant, device)
        except Exception as exc:  # recorded, and the next variant still runs
            entry = {"variant": variant, "status": f"error: {type(exc).__name__}: {exc}"[:400]}
            print(f"\n== {variant}: {entry['status']}", flush=True)
        else:
            print_variant(entry, device)
        finally:
            faulthandler.cancel_dump_traceback_later()
        doc["variants"][-1] = entry
        write_json(args.json, doc)
    ok = [e for e in doc["variants"] if e.get("status") == "ok"]
    by = {e["variant"]: e for e in ok}
    if "unfused" in by:
        for name, entry in by.items():
            if name.startswith("fused"):
                entry["speedup_vs_unfused"] = by["unfused"]["step_ms"] / entry["step_ms"]
                print(f"{name} vs unfused: {entry['speedup_vs_unfused']:.2f}x faster per step")
        if "fused" in by:
            doc["fused_speedup"] = by["fused"]["speedup_vs_unfused"]
    write_json(args.json, doc)
    return 0 if len(ok) == len(doc["variants"]) else 1


def write_json(path, doc: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
