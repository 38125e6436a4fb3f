"""Arithmetic roofline and latency model of the CUDA Performer kernels on one layer of a real graph.

``--kernels flash`` (the default): the FlashAttention-2-style kernels of issue 39
(csrc/cuda/segment_performer_fl_*.cuh; the model is scripts/performer_flash_model.py): per kernel
the throughput bounds (tensor cores, DRAM, shared memory, exp2) and the latency bounds (issue
slots per tile, Little's law on the bytes the cp.async stages keep in flight per SM), the
resident warps, barriers per tile, and the tolokers layer's forward + backward as the fused
layer calls them (keys twice, queries twice, queries backward and key gradients once).

``--kernels tc``: the tensor-core kernels of issue 27.  Counts, per kernel
(csrc/cuda/segment_performer_tc_*.cuh, the code as written:
32-row tiles inside 256-row chunks, padded fragment sizes), the tensor-core
FLOPs (padded and useful), the exp2 calls, the device-memory bytes and the
shared-memory bytes of the Performer segments (n > n*) of one layer, forward
and backward, and the time each implies at the H100 roofs below.  Nothing here
is measured: it is the estimate docs/kernels-performer-cuda.md quotes
("Roofline estimate"), unverified on a GPU.

    NT_KERNELS_DATA=../shared/data/heterophilous \
        python scripts/performer_tc_roofline.py --graph tolokers --heads 2 --dim 30 --features 102
"""
from __future__ import annotations

import argparse
import math

import torch

from nt_kernels.csr import NeighbourhoodCSR
from nt_kernels.data.datasets import load_dataset
from nt_kernels.performer import switch_threshold
from performer_flash_model import rup, window_bytes  # scripts/: the flash model's helpers, shared

CHUNK, TILE, FRAG = 256, 32, 16
# H100 SXM roofs: dense tensor FLOP/s (bf16; TF32 is half), HBM copy bandwidth,
# shared memory (132 SMs x 128 B/clk x 1.755 GHz), MUFU exp2 (132 x 16/clk x 1.755 GHz).
ROOF = {"tc_bf16": 989e12, "tc_tf32": 494.5e12, "dram": 3.0e12, "smem": 29.7e12, "exp2": 3.7e12}


def performer_segments(graph: str, data_root: str | None, dim: int, m: int) -> list[int]:
    """Sizes of the graph's neighbourhoods that take the Performer path (n > n*)."""
    data = load_dataset(graph, data_root)
    csr = NeighbourhoodCSR.from_edge_index(data.edge_index, data.num_nodes)
    sizes = torch.diff(csr.rowptr)
    return sizes[sizes > switch_threshold(m, dim)].tolist()


def tile_rows(sizes: list[int]) -> list[int]:
    """Valid rows of every 32-row tile of every chunk."""
    out = []
    for n in sizes:
        for c0 in range(0, n, CHUNK):
            rows = min(CHUNK, n - c0)
            out += [min(TILE, rows - t) for t in range(0, rows, TILE)]
    return out


def per_tile(dim: int, m: int, elem: int, heads: int, nrows: int) -> dict[str, dict[str, float]]:
    """Per kernel, for one row tile with nrows valid rows: padded 16 x 16 x 16 MMA steps,
    useful FLOPs, exp2 calls and shared-memory bytes (read + written)."""
    dp, dh, mp = rup(dim), rup(dim + 1), rup(m)
    tp, th, tm = dp // FRAG, dh // FRAG, mp // FRAG
    frag = 2 * 512 if elem == 2 else 2 * 1024  # A + B operand bytes of one 16 x 16 x 16 step
    win = window_bytes(dim, elem, heads)
    n, d1 = nrows, dim + 1

    def stage(*widths):  # cp.async into the raw rows, repack into the padded tiles
        return len(widths) * n * (win + dim * elem) + TILE * sum(widths) * elem

    def gemm(steps, cols=0):  # operand fragments, then the fp32 result tile
        return steps * frag + TILE * cols * 4

    u, pw, hw, tq = 2 * tm * tp, 2 * th * tm, 2 * tm * th, 2 * tp * tm  # U, p W', h' W'^T (or e^T v'), t P
    feats = TILE * mp * elem                                             # one write of es
    keys = dict(mma=u + 2 * th + hw, useful=2 * n * m * dim + 2 * n * m * d1, exp2=n * m,
                smem=stage(dp, dh) + gemm(u, mp) + 2 * th * frag / 2 + FRAG * dh * 4 + 2 * n * m * 4 + feats
                + gemm(hw))
    front = stage(dp) + gemm(u, mp) + 2 * TILE * m * 4 + TILE * mp * 4 + feats + gemm(pw, dh)
    fwd = dict(mma=u + pw, useful=2 * n * m * dim + 2 * n * m * d1, exp2=TILE * m, smem=front + n * d1 * 4)
    grads = 4 * TILE * m * 4 + feats + gemm(tq, dp) + TILE * dim * (4 + elem)  # feature_grads, t P, dx
    bwd = dict(mma=u + pw + hw + hw + tq, useful=4 * n * m * dim + 6 * n * m * d1, exp2=TILE * m,
               smem=front + stage(dh) + 3 * TILE * d1 * (4 + elem) + TILE * m * 4 + feats + gemm(hw)
               + gemm(hw, mp) + grads)
    kgrad = dict(mma=u + pw + hw + tq, useful=4 * n * m * dim + 4 * n * m * d1, exp2=n * m,
                 smem=stage(dp, dh) + gemm(u, mp) + n * m * 4 + TILE * mp * 4 + feats + gemm(pw, dh)
                 + gemm(hw, mp) + n * dim * 4 + grads)
    return {"keys": keys, "queries fwd": fwd, "queries bwd": bwd, "key grad": kgrad}


def device_bytes(sizes: list[int], heads: int, dim: int, m: int, elem: int) -> dict[str, float]:
    """Device-memory bytes: inputs and outputs once, fp32 chunk partials written and read once,
    W / C per segment written once and read once per chunk (L2 hits counted as device bytes)."""
    rows = sum(sizes)
    chunks = sum(-(-n // CHUNK) for n in sizes)
    x = rows * heads * dim * elem
    mat = m * (dim + 1) * 4 * heads
    seg = len(sizes) * mat
    part = chunks * (mat + heads * (dim + 2) * 4)
    return {"keys": 2 * x + 2 * part + seg, "queries fwd": 2 * x + chunks * mat,
            "queries bwd": 3 * x + chunks * mat + 2 * part + seg, "key grad": 4 * x + chunks * mat}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graph", default="tolokers")
    ap.add_argument("--data-root", default=None, help="folder of the npz files (default: $NT_KERNELS_DATA)")
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=30)
    ap.add_argument("--features", type=int, default=102)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--kernels", choices=["flash", "tc"], default="flash")
    args = ap.parse_args()
    elem = 2 if args.dtype == "bfloat16" else 4
    sizes = performer_segments(args.graph, args.data_root, args.dim, args.features)
    if args.kernels == "flash":
        flash_main(args, sizes)
        return
    tiles = tile_rows(sizes)
    print(f"{args.graph}: {len(sizes)} Performer segments, {sum(sizes)} rows, "
          f"{sum(-(-n // CHUNK) for n in sizes)} chunks, {len(tiles)} row tiles per head; "
          f"H={args.heads} D={args.dim} m={args.features} {args.dtype}")
    flop_per_mma = 2 * FRAG ** 3 * (3 if elem == 4 else 1)  # 3xTF32: three products per step
    tc_roof = ROOF["tc_bf16"] if elem == 2 else ROOF["tc_tf32"]
    dram = device_bytes(sizes, args.heads, args.dim, args.features, elem)
    totals = dict(tc=0.0, useful=0.0, dram=0.0, smem=0.0, exp2=0.0, t=0.0)
    print(f"{'kernel':<12} {'TC GFLOP':>9} {'useful':>7} {'exp2 M':>7} {'DRAM MB':>8} {'smem GB':>8} "
          f"{'TC ms':>7} {'DRAM ms':>7} {'smem ms':>7} {'exp2 ms':>7} {'bound ms':>8}")
    runs = {"keys": 2, "queries fwd": 1, "queries bwd": 1, "key grad": 1}  # the keys pass runs in both passes
    for name, times_run in runs.items():
        acc = dict(mma=0.0, useful=0.0, exp2=0.0, smem=0.0)
        for n in tiles:
            t = per_tile(args.dim, args.features, elem, args.heads, n)[name]
            for k in acc:
                acc[k] += t[k] * args.heads
        tc = acc["mma"] * flop_per_mma
        times = [tc / tc_roof, dram[name] / ROOF["dram"], acc["smem"] / ROOF["smem"], acc["exp2"] / ROOF["exp2"]]
        print(f"{name:<12} {tc / 1e9:9.1f} {acc['useful'] / 1e9:7.1f} {acc['exp2'] / 1e6:7.1f} "
              f"{dram[name] / 1e6:8.0f} {acc['smem'] / 1e9:8.2f} "
              + " ".join(f"{1e3 * x:7.3f}" for x in times) + f" {1e3 * max(times):8.3f}")
        for k, v in (("tc", tc), ("useful", acc["useful"]), ("dram", dram[name]), ("smem", acc["smem"]),
                     ("exp2", acc["exp2"]), ("t", max(times))):
            totals[k] += v * times_run
    print(f"{'fwd + bwd':<12} {totals['tc'] / 1e9:9.1f} {totals['useful'] / 1e9:7.1f} {totals['exp2'] / 1e6:7.1f} "
          f"{totals['dram'] / 1e6:8.0f} {totals['smem'] / 1e9:8.2f} {'':>31} {1e3 * totals['t']:8.3f}")
    print("fwd + bwd = 2 x keys + queries fwd + queries bwd + key grad (forward: keys, queries fwd)")


def flash_main(args, sizes: list[int]) -> None:
    """The flash kernels' table (scripts/performer_flash_model.py)."""
    import performer_flash_model as fm

    d = fm.Dims(args.dim, args.features, 2 if args.dtype == "bfloat16" else 4)
    rep = fm.kernel_report(sizes, args.heads, d, args.dtype, ROOF)
    print(f"{args.graph}: {len(sizes)} Performer segments, {sum(sizes)} rows, "
          f"{sum(-(-n // CHUNK) for n in sizes)} chunks; H={args.heads} D={args.dim} m={args.features} "
          f"{args.dtype}; flash kernels (DP={d.dp}, D+1 -> {d.dh}, m+1 -> {d.mp}, row groups {d.rg})")
    print(f"{'kernel':<12} {'GFLOP':>6} {'exp2 M':>6} {'DRAM MB':>7} {'smem GB':>7} | {'TC':>6} {'DRAM':>6} "
          f"{'smem':>6} {'exp2':>6} {'issue':>6} {'Little':>6} ms | {'regs':>4} {'smem KB':>7} {'CTAs':>4} "
          f"{'warps':>5} {'flight KB':>9} {'slots/tile':>10} {'barriers':>8}")
    total = dict(throughput=0.0, latency=0.0)
    for name, r in rep.items():
        t, res = r["times"], r["res"]
        times = " ".join(f"{1e3 * t[k]:6.3f}" for k in ("tc", "dram", "smem", "exp2", "issue", "little"))
        print(f"{name:<12} {r['flop'] / 1e9:6.1f} {r['exp2'] / 1e6:6.1f} {r['dram'] / 1e6:7.0f} "
              f"{r['smem'] / 1e9:7.2f} | {times}    | {res['regs']:4d} {res['smem'] / 1024:7.1f} "
              f"{res['ctas']:4d} {res['warps']:5d} {r['flight'] / 1024:9.1f} {r['issue']:10d} {r['barriers']:8d}")
        for k in total:
            total[k] += r[k] * fm.LAYER_CALLS[name]
    calls = ", ".join(f"{n} x{c}" for n, c in fm.LAYER_CALLS.items())
    print(f"layer fwd + bwd ({calls}): throughput bound {1e3 * total['throughput']:.3f} ms, "
          f"latency bound {1e3 * total['latency']:.3f} ms, estimate (the larger per kernel) "
          f"{1e3 * sum(max(r['throughput'], r['latency']) * fm.LAYER_CALLS[n] for n, r in rep.items()):.3f} ms")


if __name__ == "__main__":
    main()
