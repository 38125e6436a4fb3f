"""Small CUDA workloads for compute-sanitizer (issue 28; scripts/gpu/gpu_check.sh stage 5 runs them).

Two parts, each a forward and a backward, each checked against the CPU op on the same inputs so that a
run under the sanitizer that finishes also says whether the numbers were right:

* ``fused``: ``nt_kernels::ntconv_fwd`` / ``ntconv_bwd`` (on CUDA their Triton implementation called
  directly, ``ntconv_op``, so that it plans chunks of 64 rows) on a small graph (a 300-row hub, Performer
  neighbourhoods above the threshold, empty and one-row neighbourhoods, edge features, dropout), every
  aggregator, float32 and bfloat16 parameters (bf16 on both the stored path, ``NT_KERNELS_NTCONV_RECOMPUTE=0``,
  and the streaming design, its default since the H200 run of 2026-11-28c; the opt-in recompute path, ``=1``,
  was clean under all three tools on the H200 runs of 2026-11-28 to 2026-11-28c), with every floating buffer
  the op allocates starting as NaN (``torch.empty`` / ``torch.empty_like`` filled), so that a row the kernels
  leave unwritten shows in the output;
* ``performer``: ``segment_performer_attention`` forward and backward on segments of 1 to 700 rows (a hub
  split into 256-row chunks) for each implementation: SIMT (``NT_KERNELS_PERFORMER=simt``) in float32,
  bfloat16 and float16, and the tensor-core kernels (``=tc``): WMMA in bfloat16 / float16, 3xTF32 in
  float32;
* ``flash``: the same for the FlashAttention-2-style kernels (``=flash``; bfloat16's default since the H200
  run of 2026-11-28b) in bfloat16, float16 and float32 (3xTF32), a part of its own so that gpu_check.sh
  can place it in each tool's order (their first GPU run hung).

    compute-sanitizer --tool memcheck --error-exitcode 3 python scripts/gpu/gpu_sanitize.py
    python scripts/gpu/gpu_sanitize.py --device cpu          # a dry run on CPU: the CPU op, no CUDA kernel
    TRITON_INTERPRET=1 python scripts/gpu/gpu_sanitize.py --device cpu   # the fused op's Triton code, interpreted

Exit status 1 when an output is not finite or differs from the CPU op in float32 (on the same rounded
inputs) by more than TOLERANCE of its largest value.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys

import torch

import nt_kernels as nk
from nt_kernels import NeighbourhoodCSR
from nt_kernels.backends.triton import ntconv_op
from nt_kernels.backends.triton.common import INTERPRET
from nt_kernels.nn.aggregate import receiver_csr

AGGRS = [("sum", "receiver"), ("mean", "receiver"), ("max", "receiver"), ("weighted_mean", "receiver"),
         ("weighted_mean", "centre"), ("gated_sum", "receiver")]
HEADS, DIM, EDGE_DIM, FEATURES, THRESHOLD, CHUNK_ROWS = 2, 8, 3, 16, 12, 64
TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 6e-2, torch.float16: 2e-2}  # of max |CPU result|


@contextlib.contextmanager
def nan_filled():
    """torch.empty / torch.empty_like whose floating results start as NaN."""
    real = torch.empty, torch.empty_like

    def wrap(alloc):
        def alloc_nan(*args, **kwargs):
            t = alloc(*args, **kwargs)
            return t.fill_(math.nan) if t.is_floating_point() else t
        return alloc_nan
    torch.empty, torch.empty_like = wrap(real[0]), wrap(real[1])
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real


def graph(gen):
    """(edge_index, num_nodes): a 300-row hub, neighbourhoods of 0-20 rows, 16 receivers."""
    sizes = [300, 0, 1, 5, 12, 13, 20, 2, 0, 7, 14, 1]
    edges = [torch.stack([torch.full((n,), j), torch.randint(0, 16, (n,), generator=gen)])
             for j, n in enumerate(sizes)]
    return torch.cat(edges, 1), 16


def compare(name, got, want, dtype) -> bool:
    """Finite and within TOLERANCE[dtype] of max |want|; prints one line."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    scale = max(want.abs().max().item() if want.numel() else 0.0, 1.0)
    err = (got - want).abs().max().item() if want.numel() else 0.0
    ok = bool(torch.isfinite(got).all()) and err <= TOLERANCE[dtype] * scale
    print(f"  {'ok  ' if ok else 'FAIL'} {name}: max error {err:.2e} (scale {scale:.2e})")
    return ok


def fused_args(device, aggr, gate_group, param_dtype, gen):
    """Arguments of ntconv_fwd on ``device`` (node terms float32, parameters in ``param_dtype``)."""
    edge_index, n = graph(gen)
    c, e = HEADS * DIM, edge_index.shape[1]
    c_out = 2 * c if aggr in ("weighted_mean", "gated_sum") else c
    csr = NeighbourhoodCSR.from_edge_index(edge_index, n)
    rcsr = receiver_csr(csr, n)
    exact, performer = csr.segment_split(THRESHOLD)
    p = dict(w_edge=torch.randn(c, EDGE_DIM, generator=gen) / 2, w_qkv=torch.randn(3 * c, c, generator=gen) / 4,
             b_qkv=torch.randn(3 * c, generator=gen) / 10, w_out=torch.randn(c_out, c, generator=gen) / 4,
             b_out=torch.randn(c_out, generator=gen) / 10)
    p = {k: v.to(device, param_dtype) for k, v in p.items()}
    projection = nk.orthogonal_random_features(FEATURES, DIM, generator=gen).to(device, param_dtype)
    x = [torch.randn(n, c, generator=gen).to(device), torch.randn(n, c, generator=gen).to(device),
         torch.randn(e, EDGE_DIM, generator=gen).to(device)]
    graph_t = [t.to(device) for t in (csr.rowptr, csr.receiver, csr.perm, rcsr.rowptr, rcsr.perm, exact, performer)]
    return (*x, p["w_edge"], p["w_qkv"], p["b_qkv"], p["w_out"], p["b_out"], *graph_t, None, projection,
            torch.tensor(7), HEADS, aggr, gate_group, 0.2, DIM ** -0.5, 1e-4), torch.randn(n, c, generator=gen)


def run_fused(device) -> bool:
    ok = True
    for param_dtype, recompute in ((torch.float32, "0"), (torch.bfloat16, "0"), (torch.bfloat16, "stream")):
        os.environ["NT_KERNELS_NTCONV_RECOMPUTE"] = recompute  # bf16: the stored path and the default streaming one
        for aggr, group in AGGRS:
            args, grad_out = fused_args(device, aggr, group, param_dtype, torch.Generator().manual_seed(3))
            chunks = f", chunks of {CHUNK_ROWS} rows" if device.type == "cuda" or INTERPRET else " (the CPU op)"
            print(f"fused {aggr}/{group}, parameters {param_dtype}{chunks}, NT_KERNELS_NTCONV_RECOMPUTE={recompute}")
            # On CUDA the op's own functions (the registered kernels; the Performer stage through the dispatcher),
            # called directly so that they build their plan with CHUNK_ROWS-row chunks.
            fwd, bwd, extra = torch.ops.nt_kernels.ntconv_fwd, torch.ops.nt_kernels.ntconv_bwd, {}
            if device.type == "cuda" or INTERPRET:
                fwd, bwd, extra = ntconv_op.ntconv_fwd, ntconv_op.ntconv_bwd, dict(chunk_rows=CHUNK_ROWS)
            with nan_filled():
                out, lse, stats = fwd(*args, **extra)
                grads = bwd(grad_out.to(device, out.dtype), out, lse, stats, *args, [True, True, True], **extra)
            # the CPU op in float32 (parameters upcast) is the reference
            cpu = tuple(a.cpu().float() if isinstance(a, torch.Tensor) and a.is_floating_point() else
                        a.cpu() if isinstance(a, torch.Tensor) else a for a in args)
            cpu_out, cpu_lse, cpu_stats = torch.ops.nt_kernels.ntconv_fwd(*cpu)
            cpu_grads = torch.ops.nt_kernels.ntconv_bwd(grad_out.to(cpu_out.dtype), cpu_out, cpu_lse, cpu_stats,
                                                        *cpu, [True, True, True])
            ok &= compare("output", out, cpu_out, param_dtype)
            if aggr == "max" and param_dtype != torch.float32:
                print("  (max in bfloat16: gradients not compared; rounding may move a maximum)")
                continue
            for name, got, want in zip(("centre", "receiver_term", "edge_attr", "w_edge", "w_qkv", "b_qkv", "w_out",
                                        "b_out"), grads, cpu_grads):
                ok &= compare(f"gradient of {name}", got, want, param_dtype)
    os.environ.pop("NT_KERNELS_NTCONV_RECOMPUTE", None)
    return ok


def run_performer(device, impls=None) -> bool:
    """The CUDA Performer's kernels against the CPU op: each (implementation, dtype) of ``impls`` (default
    SIMT in float32 / bfloat16 / float16, then the tensor cores in bfloat16 / float16 / float32)."""
    ok = True
    gen = torch.Generator().manual_seed(5)
    sizes = torch.tensor([0, 1, 2, 37, 256, 257, 700])
    rowptr = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])
    rows = int(rowptr[-1])
    base = [torch.randn(rows, HEADS, DIM, generator=gen) for _ in range(4)]
    projection = nk.orthogonal_random_features(FEATURES, DIM, generator=gen)
    if impls is None:
        impls = [("simt", d) for d in (torch.float32, torch.bfloat16, torch.float16)]
        impls += [("tc", d) for d in (torch.bfloat16, torch.float16, torch.float32)]
    for impl, dtype in impls:
        print(f"performer {impl} {dtype}: segments of {sizes.tolist()} rows")
        os.environ["NT_KERNELS_PERFORMER"] = impl
        q, k, v = (t.to(device, dtype).detach().requires_grad_() for t in base[:3])
        o = nk.segment_performer_attention(q, k, v, rowptr.to(device), projection.to(device, dtype))
        o.backward(base[3].to(device, dtype))
        # the CPU op in float32 on the same rounded inputs is the reference
        qc, kc, vc = (t.to(dtype).float().detach().requires_grad_() for t in base[:3])
        oc = nk.segment_performer_attention(qc, kc, vc, rowptr, projection.to(dtype).float())
        oc.backward(base[3].to(dtype).float())
        for name, got, want in (("o", o, oc), ("dq", q.grad, qc.grad), ("dk", k.grad, kc.grad),
                                ("dv", v.grad, vc.grad)):
            ok &= compare(name, got, want, dtype)
    os.environ.pop("NT_KERNELS_PERFORMER", None)
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--part", default="fused,performer",
                        help="comma list of fused, performer and flash, run in that order (default fused,performer)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device (use --device cpu for a dry run)")
    flash = [("flash", d) for d in (torch.bfloat16, torch.float16, torch.float32)]
    parts = {"fused": run_fused, "performer": run_performer, "flash": lambda dev: run_performer(dev, flash)}
    names = args.part.split(",")
    if not names or any(n not in parts for n in names):
        parser.error(f"--part: expected a comma list of {sorted(parts)}, got {args.part!r}")
    ok = True
    for name in names:
        ok &= parts[name](device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    print("gpu_sanitize:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
