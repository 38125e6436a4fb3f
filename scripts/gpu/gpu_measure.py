"""GPU measurements of scripts/gpu/gpu_check.sh that `nt-kernels bench` does not make.

``roofline``: the exact path's forward on a graph of E packed rows whose
segments all have 1..max_degree rows (every segment in packed tiles), timed
with CUDA events (median, input sets rotated), against the fewest bytes a
forward must move (q, k, v read once; o and the float32 lse written once) and
the device's copy bandwidth measured here (a device-to-device copy, bytes read
plus bytes written).  Also fwd+bwd time against its fewest bytes (the forward's
plus q, k, v, grad_o and the lse read and dq, dk, dv written once) and the
op's peak memory against q, k, v, o, grad_o, dq, dk, dv and lse.

``train-epoch``: NT training epochs on a real graph (paper preset) in float32
and under bf16 autocast, through nt_kernels.apps.train.train_split (one
epoch = forward, backward, Adam step and the evaluation forward).

Each writes one JSON document (``--out``) and prints a summary.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace

import torch

import nt_kernels
from nt_kernels import NeighbourhoodCSR


def event_median(fn, reps: int, warmup: int, device) -> float:
    """Median milliseconds of fn(i) over reps timed runs after warmup runs (CUDA events; a host clock on CPU)."""
    for i in range(warmup):
        fn(i)
    times = []
    for i in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(i)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn(i)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth(device, gib: float, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    n = int(gib * 2**30) // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    ms = event_median(lambda i: dst.copy_(src), reps, 3, device)
    return 2 * n * 4 / (ms * 1e-3) / 1e9


def small_degree_graph(num_edges: int, max_degree: int, seed: int, device) -> NeighbourhoodCSR:
    """Segments of 1..max_degree rows (uniform) until num_edges rows are packed."""
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, max_degree + 1, (2 * num_edges // max_degree + 16,), generator=gen)
    ends = sizes.cumsum(0)
    count = int(torch.searchsorted(ends, torch.tensor(num_edges)))
    sizes = sizes[: count + 1].clone()
    sizes[-1] -= int(ends[count]) - num_edges
    centre = torch.repeat_interleave(torch.arange(sizes.numel()), sizes)
    edge_index = torch.stack([centre, centre]).to(device)
    return NeighbourhoodCSR.from_edge_index(edge_index, num_nodes=sizes.numel())


def roofline(args) -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    csr = small_degree_graph(args.edges, args.max_degree, args.seed, device)
    e, h, d = csr.num_edges, args.heads, args.head_dim
    gen = torch.Generator(device=device).manual_seed(args.seed)
    sets = [[torch.randn(e, h, d, device=device, generator=gen, dtype=dtype) for _ in range(4)]
            for _ in range(args.input_sets)]
    element = sets[0][0].element_size()
    nt_kernels.segment_softmax_attention(*sets[0][:3], csr)  # plan built and kernels compiled
    fwd_ms = event_median(lambda i: nt_kernels.segment_softmax_attention(*sets[i % len(sets)][:3], csr),
                          args.reps, args.warmup, device)

    def fwd_bwd(i):
        q, k, v, grad_o = (t.requires_grad_(j < 3) for j, t in enumerate(sets[i % len(sets)]))
        nt_kernels.segment_softmax_attention(q, k, v, csr).backward(grad_o)
        for t in (q, k, v):
            t.grad = None

    fwd_bwd_ms = event_median(fwd_bwd, args.reps, args.warmup, device)
    del sets[1:]
    peak = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fwd_bwd(0)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(device) - before
    tensor_bytes = e * h * d * element
    essential = 8 * tensor_bytes + e * h * 4   # q, k, v, o, grad_o, dq, dk, dv and the float32 lse
    bandwidth = copy_bandwidth(device, 2.0 if device.type == "cuda" else 0.125)
    fwd_bytes = 4 * tensor_bytes + e * h * 4   # q, k, v read, o written, lse written
    achieved = fwd_bytes / (fwd_ms * 1e-3) / 1e9
    # fwd + bwd: the backward reads q, k, v, grad_o and the lse and writes dq, dk, dv (docs/kernels-exact-cuda.md)
    fwd_bwd_bytes = fwd_bytes + 7 * tensor_bytes + e * h * 4
    fwd_bwd_achieved = fwd_bwd_bytes / (fwd_bwd_ms * 1e-3) / 1e9
    return {
        "device": device_name(device), "torch": torch.__version__, "dtype": args.dtype,
        "num_edges": e, "num_segments": csr.num_nodes, "max_degree": csr.max_degree, "heads": h, "head_dim": d,
        "forward_ms": fwd_ms, "forward_backward_ms": fwd_bwd_ms, "forward_bytes": fwd_bytes,
        "forward_gb_per_s": achieved, "copy_gb_per_s": bandwidth, "fraction_of_copy_bandwidth": achieved / bandwidth,
        "forward_backward_bytes": fwd_bwd_bytes, "forward_backward_gb_per_s": fwd_bwd_achieved,
        "forward_backward_fraction_of_copy_bandwidth": fwd_bwd_achieved / bandwidth,
        "peak_extra_bytes_fwd_bwd": peak, "essential_bytes": essential,
        "peak_over_essential": None if peak is None else (peak + 4 * tensor_bytes) / essential,
        "note": "peak_extra: allocations during fwd+bwd beyond q, k, v, grad_o (already allocated); the ratio "
                "adds those four back and divides by q, k, v, o, grad_o, dq, dk, dv and lse",
    }


def device_name(device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def train_epoch(args) -> dict:
    from nt_kernels.apps.presets import preset
    from nt_kernels.apps.train import train_split
    from nt_kernels.data import load_dataset

    config = preset(args.dataset)
    data = load_dataset(args.dataset, args.data_root, self_loops=config.self_loops)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    result = {"device": device_name(device), "torch": torch.__version__, "dataset": args.dataset,
              "config": {k: getattr(config, k) for k in ("aggr", "head_dim", "heads", "num_layers", "attention")},
              "num_edges": data.num_edges, "epochs_timed": args.epochs}
    for mode in ("float32", "bf16-autocast"):
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=mode == "bf16-autocast")
        try:
            with autocast:
                train_split(data, 0, replace(config, epochs=1, patience=1), device=device)  # warm-up, compiles
                sync()
                start = time.perf_counter()
                run = train_split(data, 0, replace(config, epochs=args.epochs, patience=args.epochs), device=device)
                sync()
            result[mode] = {"seconds_per_epoch": (time.perf_counter() - start) / run["epochs"],
                            "final_loss": run["losses"][-1], "status": "ok"}
        except Exception as exc:  # recorded, not hidden: the summary shows the failure
            result[mode] = {"status": f"error: {type(exc).__name__}: {exc}"[:400]}
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("roofline")
    r.add_argument("--edges", type=int, default=2_000_000)
    r.add_argument("--max-degree", type=int, default=8)
    r.add_argument("--heads", type=int, default=4)
    r.add_argument("--head-dim", type=int, default=32)
    r.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    r.add_argument("--reps", type=int, default=20)
    r.add_argument("--warmup", type=int, default=3)
    r.add_argument("--input-sets", type=int, default=2)
    r.add_argument("--seed", type=int, default=0)
    t = sub.add_parser("train-epoch")
    t.add_argument("--dataset", default="tolokers")
    t.add_argument("--data-root", default=None)
    t.add_argument("--epochs", type=int, default=3)
    for p in (r, t):
        p.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run of the script")
        p.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_measure {args.command}: SKIP (no CUDA device)")
        return 0
    doc = roofline(args) if args.command == "roofline" else train_epoch(args)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
