"""Stage "ncu" of scripts/gpu/gpu_perf.sh (issue 42): hardware counters of one warm tolokers layer.

``layer`` is the program Nsight Compute profiles: the tolokers preset's NT model under bf16
autocast, ``--warmup`` full training steps (Triton compiles, plans), then, inside
``cudaProfilerStart`` / ``cudaProfilerStop``, one forward + backward of its first NTConv on
the encoder's output, with the variant's environment switches set (``fused``: the default
path; ``fused:recompute:tc``: the sm_90 recompute path with the tensor-core Performer, the
candidate; scripts/gpu/gpu_profile.py's SWITCHES).  ``--calibrate`` adds, inside the range, a
copy kernel over 1 GiB (read + write) and an 8192^3 bf16 cuBLAS GEMM: the two ceilings the other
rows are read against.

``kernels`` prints the ``--kernel-name`` regex (on demangled names) of the launches the stage profiles:
the project's CUDA and Triton kernels, cuBLAS / CUTLASS and the calibration's add, not ATen's glue.

``table`` turns the CSV pages that ``ncu --csv --page raw`` (one row per kernel, a column per
metric) and, where it was exported, ``--page source`` wrote into one Markdown table per kernel
(docs/gpu-ncu.md): launch and occupancy (achieved against theoretical, and the limiter),
speed of light, memory (DRAM bytes, L2 hit rate, sectors per request, bank conflicts),
warp-state stalls, and the source lines with the most stall samples.

    ncu --profile-from-start off --clock-control none ... python scripts/gpu/gpu_ncu.py layer --variant fused
    python scripts/gpu/gpu_ncu.py table raw-fused.csv --source source-fused.csv --out docs/gpu-ncu.md
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_ncu_tables import EXTRA_METRICS, table  # noqa: E402

# ------------------------------------------------------------------------------- the kernel filter
# What ncu profiles (--kernel-name-base demangled --kernel-name regex:KERNELS): the project's kernels (the
# CUDA ones in namespace nt_kernels, the Triton ones by their bare function names), cuBLAS / CUTLASS, and
# the calibration's add.  The glue ATen launches between them (fills, index arithmetic, scatters, sorts,
# casts: about 60 % of a layer's launches, each a few microseconds, each ~1 s under ncu's replay) is left
# to the layer stage's torch.profiler table; GPU_NCU_KERNELS=all profiles it too.
KERNELS = "|".join([
    r"nt_kernels::",                   # the CUDA kernels (Performer, exact, fused op)
    r"^_[A-Za-z0-9_]*_kernel$",        # the Triton kernels: a bare name, no return type or parameters
    r"nvjet|gemm|cutlass|cublas|xmma",  # cuBLAS and CUTLASS (the projections, the calibration GEMM)
    r"CUDAFunctorOnSelf_add<float>",   # the calibration's copy (torch.add of a float32 scalar)
])

# ----------------------------------------------------------------------------------- the program

def layer(args) -> int:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpu_profile import switches, train_step

    from nt_kernels.bench.layer import LEARNING_RATE, _model
    from nt_kernels.bench.layer_graphs import PRESETS, build_graph
    from nt_kernels.csr import NeighbourhoodCSR

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    base, *names = args.variant.split(":")
    graph = build_graph(args.graph, messages=None, seed=0, device=device, dry_run=not cuda)
    csr = NeighbourhoodCSR.from_edge_index(graph.edge_index, graph.x.shape[0])
    torch.manual_seed(0)
    model = _model(PRESETS[args.graph], graph, fused=base == "fused").to(device).train()
    model.prepare(csr, graph.x.shape[0])
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    with switches(names):
        for _ in range(args.warmup):
            train_step(model, optimizer, graph, csr, autocast=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            h = model.encoder(graph.x).detach().requires_grad_()
        conv = model.convs[0]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            grad = torch.randn_like(conv(h, csr))
        for _ in range(args.warmup):  # the layer alone, warm (its plans and kernels loaded)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                conv(h, csr).backward(grad)
        if cuda:
            torch.cuda.synchronize()
            calibration = _calibration(device) if args.calibrate else None
            torch.cuda.cudart().cudaProfilerStart()
            if calibration:
                calibration()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            conv(h, csr).backward(grad)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
    print(f"gpu_ncu layer: {args.graph} {args.variant} on {device}: one NTConv forward + backward profiled"
          + (" after the copy and GEMM calibration" if args.calibrate and cuda else ""))
    return 0


def _calibration(device):
    """A copy kernel (1 GiB read + 1 GiB written) and a cuBLAS bf16 GEMM, on random data (never zeros)."""
    import torch

    src = torch.randn(2**28, device=device)  # 1 GiB of float32
    dst = torch.empty_like(src)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    torch.cuda.synchronize()

    def run():
        torch.add(src, 1.0, out=dst)  # a kernel (a plain copy_ is a cudaMemcpy, which ncu does not profile)
        torch.mm(a, b)
    return run



def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("layer", help="the profiled program: one warm NTConv forward + backward")
    p.add_argument("--graph", default="tolokers")
    p.add_argument("--variant", default="fused", help="fused or unfused, with gpu_profile.py's :switches")
    p.add_argument("--device", default="cuda")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--calibrate", action="store_true", help="a copy and a cuBLAS GEMM inside the range too")
    p = sub.add_parser("table", help="Markdown tables from raw-<label>.csv (and source-<label>.csv beside it)")
    p.add_argument("raw", nargs="+")
    p.add_argument("--out", default=None)
    sub.add_parser("metrics", help="print the --metrics list the stage passes to ncu")
    sub.add_parser("kernels", help="print the --kernel-name regex the stage passes to ncu (demangled names)")
    args = parser.parse_args(argv)
    if args.command in ("metrics", "kernels"):
        print(",".join(EXTRA_METRICS) if args.command == "metrics" else KERNELS)
        return 0
    return layer(args) if args.command == "layer" else table(args)


if __name__ == "__main__":
    sys.exit(main())
