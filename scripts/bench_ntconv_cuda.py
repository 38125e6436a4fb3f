"""Fused NT layer vs ``fused=False``: training steps (forward + backward + Adam) of NT (issue 14).

Two benches, each writing one JSON (device, versions, graph, preset, per variant:
median step time, peak memory, or "OOM"):

* ``tolokers``: the released preset (undirected, self-loops kept, sep, gated_sum,
  30 dims x 2 heads, 5 layers, dropout 0.1) under bf16 autocast, fused vs
  ``fused=False``.  Issue 14's target on a GPU: >= 4x faster, <= 1/8 of the
  peak allocated memory.
* ``synthetic``: a power-law graph of ``--messages`` packed rows (default
  100M; Chung-Lu weights, exponent 2.5, drawn on the device, both directions
  of every edge stored; the largest degree is recorded and must reach 5,000),
  NT with H = 4, D = 16, 3 layers, one full-batch bf16 step.  ``fused=False``
  is expected to run out of memory there and is recorded as "OOM".

Peak memory is ``torch.cuda.max_memory_allocated`` on CUDA (reset before the
measured steps, so it includes the model, the graph and its plans) and
``None`` on CPU.  ``--dry-run`` runs both benches on the CPU at a tiny scale
(a synthetic stand-in for tolokers) in seconds, to check the code path.

    python scripts/bench_ntconv_cuda.py tolokers --device cuda --out DIR
    python scripts/bench_ntconv_cuda.py synthetic --device cuda --messages 100000000 --out DIR
    python scripts/bench_ntconv_cuda.py --dry-run --out DIR
"""
from __future__ import annotations

import argparse
import inspect
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from nt_kernels.nn import NT, NTConv

TOLOKERS = dict(aggr="gated_sum", head_dim=30, heads=2, num_layers=5, dropout=0.1, sep=True)
SYNTHETIC = dict(aggr="weighted_mean", head_dim=16, heads=4, num_layers=3, dropout=0.1, sep=True)
MIN_MAX_DEGREE = 5000


def powerlaw_messages(num_messages: int, num_nodes: int, *, exponent: float = 2.5, seed: int = 0,
                      device="cpu") -> torch.Tensor:
    """(2, num_messages) edge_index of a Chung-Lu graph drawn on ``device``: num_messages / 2 pairs with
    endpoints ~ w_i = (i + 1)^(-1/(exponent - 1)) (inverse CDF), self-loops redrawn as i -> i + 1,
    each pair stored both ways.  Duplicate pairs are kept (they are messages like any other)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = torch.arange(1, num_nodes + 1, dtype=torch.float64, device=device) ** (-1.0 / (exponent - 1.0))
    cdf = torch.cumsum(weights, 0)
    cdf /= cdf[-1].clone()
    pairs = num_messages // 2
    ends = torch.searchsorted(cdf, torch.rand(2, pairs, generator=gen, dtype=torch.float64, device=device))
    ends = ends.clamp(max=num_nodes - 1)
    ends[1] = torch.where(ends[0] == ends[1], (ends[1] + 1) % num_nodes, ends[1])
    shuffle = torch.randperm(num_nodes, generator=gen, device=device)  # hubs at random ids
    ends = shuffle[ends]
    return torch.cat([ends, ends.flip(0)], dim=1)


def supports_fused() -> bool:
    return "fused" in inspect.signature(NTConv.__init__).parameters


def make_model(in_channels: int, out_channels: int, preset: dict, fused: bool) -> NT:
    """NT of ``preset``; ``fused=False`` is the composition (today's NTConv when it has no ``fused``)."""
    kwargs = {"fused": fused} if supports_fused() else {}
    if fused and not kwargs:
        raise RuntimeError("NTConv has no `fused` argument yet (issue 13's NTConv(fused=...) integration)")
    return NT(in_channels, out_channels, preset["head_dim"] * preset["heads"], preset["num_layers"],
              heads=preset["heads"], dropout=preset["dropout"], sep=preset["sep"], aggr=preset["aggr"], **kwargs)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_steps(model, x, y, edge_index, *, steps: int, warmup: int, autocast: bool) -> dict:
    """Median wall time of ``steps`` training steps after ``warmup`` ones, and the peak memory."""
    device = x.device
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    tick = time.perf_counter()
    graph = model.prepare(edge_index, x.shape[0])
    _sync(device)
    prepare_s = time.perf_counter() - tick
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for step in range(warmup + steps):
        _sync(device)
        tick = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(model(x, graph), y)
        loss.backward()
        optimizer.step()
        _sync(device)
        if step >= warmup:
            times.append(time.perf_counter() - tick)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"status": "ok", "median_step_ms": 1e3 * statistics.median(times), "steps": steps,
            "prepare_s": prepare_s, "peak_allocated_bytes": peak, "loss": float(loss.detach())}


def run_variant(fused: bool, x, y, edge_index, preset: dict, *, steps: int, warmup: int, autocast: bool) -> dict:
    """One variant; an out-of-memory error is a result ("OOM"), not a crash."""
    try:
        torch.manual_seed(0)
        model = make_model(x.shape[1], int(y.max()) + 1, preset, fused).to(x.device)
        return train_steps(model, x, y, edge_index, steps=steps, warmup=warmup, autocast=autocast)
    except torch.cuda.OutOfMemoryError as exc:
        return {"status": "OOM", "message": str(exc).splitlines()[0]}
    except RuntimeError as exc:
        if "fused" in str(exc) or "out of memory" in str(exc).lower():
            return {"status": "OOM" if "out of memory" in str(exc).lower() else "error", "message": str(exc)}
        raise
    finally:
        if x.device.type == "cuda":
            torch.cuda.empty_cache()


def graph_info(edge_index: torch.Tensor, num_nodes: int) -> dict:
    degree = torch.bincount(edge_index[0], minlength=num_nodes)
    return {"num_nodes": num_nodes, "num_messages": edge_index.shape[1], "max_degree": int(degree.max())}


def tolokers_inputs(device, data_root, dry_run: bool):
    if dry_run:  # a tolokers-shaped stand-in: 10 features, 2 classes, power-law degrees
        num_nodes = 300
        edge_index = powerlaw_messages(2000, num_nodes, seed=1, device=device)
        gen = torch.Generator().manual_seed(0)
        return (torch.randn(num_nodes, 10, generator=gen).to(device),
                torch.randint(0, 2, (num_nodes,), generator=gen).to(device), edge_index, "tolokers-standin")
    from nt_kernels.data.datasets import load_dataset

    data = load_dataset("tolokers", data_root, directed=False, self_loops="keep")
    return data.x.to(device), data.y.to(device), data.edge_index.to(device), "tolokers"


def synthetic_inputs(device, num_messages: int, avg_degree: int):
    num_nodes = max(2, num_messages // avg_degree)
    edge_index = powerlaw_messages(num_messages, num_nodes, seed=0, device=device)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(num_nodes, 16, generator=gen, device=device)
    y = torch.randint(0, 2, (num_nodes,), generator=gen, device=device)
    return x, y, edge_index


def bench(name: str, args) -> dict:
    device = torch.device("cpu" if args.dry_run else args.device)
    steps, warmup = (1, 0) if args.dry_run else (args.steps, args.warmup)
    if name == "tolokers":
        x, y, edge_index, graph = tolokers_inputs(device, args.data_root, args.dry_run)
        preset, variants = TOLOKERS, (True, False)
    else:
        messages = 4000 if args.dry_run else args.messages
        x, y, edge_index = synthetic_inputs(device, messages, args.avg_degree)
        graph, preset, variants = f"powerlaw-{messages}", SYNTHETIC, (True, False)
    info = graph_info(edge_index, x.shape[0])
    if name == "synthetic" and not args.dry_run and info["max_degree"] < MIN_MAX_DEGREE:
        raise SystemExit(f"bench_ntconv_cuda: max degree {info['max_degree']} < {MIN_MAX_DEGREE}; lower --avg-degree")
    result = {"bench": name, "graph": graph, **info, "preset": preset, "autocast": "bfloat16",
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
              "torch": torch.__version__, "dry_run": args.dry_run, "variants": {}}
    for fused in variants:
        key = "fused" if fused else "fused=False"
        result["variants"][key] = run_variant(fused, x, y, edge_index, preset, steps=steps, warmup=warmup,
                                              autocast=True)
        print(f"{name} {key}: {result['variants'][key]}", flush=True)
    a, b = result["variants"]["fused"], result["variants"]["fused=False"]
    if a["status"] == b["status"] == "ok":
        result["speedup"] = b["median_step_ms"] / a["median_step_ms"]
        if a["peak_allocated_bytes"]:
            result["memory_ratio"] = a["peak_allocated_bytes"] / b["peak_allocated_bytes"]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("benches", nargs="*", help="tolokers and/or synthetic (default: both)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--messages", type=int, default=100_000_000)
    parser.add_argument("--avg-degree", type=int, default=20, help="messages per node of the synthetic graph")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--data-root", default=None)
    parser.add_argument("--out", default=".", help="directory for ntconv-<bench>-<device>.json")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny graphs, one step per variant")
    args = parser.parse_args()
    for name in args.benches:
        if name not in ("tolokers", "synthetic"):
            parser.error(f"unknown bench {name!r}: choose tolokers and/or synthetic")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.benches or ["tolokers", "synthetic"]:
        result = bench(name, args)
        path = out / f"ntconv-{name}-{'dry-run' if args.dry_run else args.device}.json"
        path.write_text(json.dumps(result, indent=2))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
