"""Our small float32 GEMM (mm_acc) against torch's CPU BLAS on the fused layer's shapes (issue 31).

For each shape the kernels multiply -- the tolokers preset (C = 60, H = 2,
D = 30, m = 102, items of 64 rows, Performer groups of 32 rows) and the op
bench's H = 4, D = 8 (m = 16) -- it times C += A B on one thread with
``nt_kernels._C.cpu_gemm_bench``: ``ours`` on each ISA path (one child process
per NT_KERNELS_CPU_ISA value), ``cpublas`` (at::native::cpublas::gemm: MKL
sgemm in torch's x86 wheels) and ``brgemm`` (at::native::cpublas::brgemm: the
oneDNN micro-kernel of PyTorch's CPU flash attention; row-major A only).
Each figure is the best of --rounds rounds of about --ms milliseconds of calls,
the implementations interleaved within a round.

It also checks what the kernels rely on for determinism and max ties: a row
of C must not depend on which rows share the call.  ``torch.mm`` (the same
BLAS as cpublas) is run on all rows and on each row alone and compared bitwise.

    python scripts/cpu_gemm_compare.py --isa avx2,avx512 [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

# (name, rows, K, N, A transposed): the products of csrc/cpu (ntconv_rows_impl.h,
# segment_performer_impl.h, segment_softmax_impl.h) at the tolokers preset and at H=4 D=8.
SHAPES = [
    ("q/k/v projection (R=64, C=60)", 64, 60, 60, False),
    ("output projection (C_out=120)", 64, 60, 120, False),
    ("d_o = d pre W_out", 64, 120, 60, False),
    ("weight gradient dy^T x (A^T)", 60, 64, 60, True),
    ("Performer features x Pc^T (m=102, D=30)", 32, 30, 102, False),
    ("Performer S' = e^T v (A^T)", 102, 32, 30, True),
    ("Performer out = phi S", 32, 102, 30, False),
    ("exact scores Q K^T (n=44, D=30)", 44, 30, 44, False),
    ("exact P V (n=44)", 44, 44, 30, False),
    ("H4 D8 Performer features (m=16)", 32, 8, 16, False),
    ("H4 D8 Performer out", 32, 16, 8, False),
]
IMPLS = ("ours", "cpublas", "brgemm")


def time_shape(impl: str, rows: int, K: int, N: int, a_t: bool, ms: float) -> float:
    from nt_kernels._extension import extension

    bench = extension().cpu_gemm_bench
    once = bench(impl, rows, K, N, a_t, 20)
    iterations = max(20, int(ms * 1e-3 / max(once, 1e-9)))
    return bench(impl, rows, K, N, a_t, iterations)


def rows_independent(rows: int, K: int, N: int, a_t: bool) -> bool:
    """torch.mm's row i on all rows equals it on row i alone, bitwise, for every i."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(K, rows, generator=gen).t() if a_t else torch.randn(rows, K, generator=gen)
    b = torch.randn(K, N, generator=gen)
    full = torch.mm(a, b)
    return all(torch.equal(full[i], torch.mm(a[i:i + 1], b)[0]) for i in range(rows))


def child(rounds: int, ms: float) -> dict:
    from nt_kernels._extension import extension

    torch.set_num_threads(1)
    results = []
    for name, rows, K, N, a_t in SHAPES:
        impls = [i for i in IMPLS if not (i == "brgemm" and a_t)]
        best = {impl: float("inf") for impl in impls}
        for _ in range(rounds):
            for impl in impls:
                best[impl] = min(best[impl], time_shape(impl, rows, K, N, a_t, ms))
        results.append({"shape": name, "rows": rows, "K": K, "N": N, "a_transposed": a_t,
                        "gflops": {impl: 2 * rows * K * N / t / 1e9 for impl, t in best.items()},
                        "us": {impl: t * 1e6 for impl, t in best.items()},
                        "torch_mm_rows_independent": rows_independent(rows, K, N, a_t)})
    return {"isa": extension().cpu_isa(), "results": results}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--isa", default="avx2,avx512", help="comma list of NT_KERNELS_CPU_ISA paths")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ms", type=float, default=30.0, help="milliseconds of calls per timing")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.rounds, args.ms)))
        return 0
    runs = {}
    for isa in args.isa.split(","):
        proc = subprocess.run([sys.executable, __file__, "--child", "--rounds", str(args.rounds), "--ms", str(args.ms)],
                              env={**os.environ, "NT_KERNELS_CPU_ISA": isa}, capture_output=True, text=True, check=True)
        runs[isa] = json.loads(proc.stdout)
    isas = list(runs)
    last = runs[isas[-1]]["results"]
    print("| shape (rows x K x N) | " + " | ".join(f"ours {isa}" for isa in isas)
          + " | cpublas (MKL) | brgemm (oneDNN) | torch.mm rows independent |")
    print("|---|" + "---:|" * (len(isas) + 2) + "---|")
    for i, entry in enumerate(last):
        g = entry["gflops"]
        cells = [f"{entry['shape']}: {entry['rows']} x {entry['K']} x {entry['N']}"]
        cells += [f"{runs[isa]['results'][i]['gflops']['ours']:.1f}" for isa in isas]
        cells += [f"{g['cpublas']:.1f}", f"{g['brgemm']:.1f}" if "brgemm" in g else "n/a (A^T)",
                  "yes" if entry["torch_mm_rows_independent"] else "**no**"]
        print("| " + " | ".join(cells) + " |")
    print("GFLOP/s, one thread, best of the rounds.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
