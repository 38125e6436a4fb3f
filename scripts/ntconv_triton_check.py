"""Ahead-of-time compile check of the fused NT layer's Triton kernels, no GPU needed.

Compiles every launch of ``ntconv_specs.compile_specs(dtype)``
(nt_kernels/backends/triton/ntconv_specs.py: the prologue, the split-K weight
gradients and their combine at the tiles the plan picks for a few layer
shapes, the row GEMMs with every autotuning config, gates, message
gradients, segment reductions, the receive kernel) for target GPUs through
Triton's own pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin with the bundled
ptxas), and prints per architecture and launch: whether it compiled, its
shared memory per block against the architecture's limit, and its registers
and spill stores from ``ptxas -v`` (unless ``--no-spills``).

A launch fails the check when it does not compile or (for a kernel launched
with the plan's tiles, or the first config of an autotuned one) does not fit
the shared memory, or spills registers (an autotuned kernel: when every
config that fits spills).  Exit status 1 on failure.  ``make triton-check``
runs it after scripts/triton_check.py.

    python scripts/ntconv_triton_check.py                       # sm_80, 89, 90; fp32 + bf16
    python scripts/ntconv_triton_check.py --arch 90 --no-spills
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("ntconv_triton_check: unset TRITON_INTERPRET (the check compiles for a GPU)")

os.environ.pop("NT_KERNELS_TRITON_AUTOTUNE", None)  # every autotuning config, not only the pinned one
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the runtime default; silences Triton 3.9's notice
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia import compiler as nvidia_compiler  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from nt_kernels.backends.triton.ntconv_specs import compile_specs, launches  # noqa: E402

# Shared memory per block (opt-in maximum) by compute capability, bytes.
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}


def ptxas_report(ptx: str, arch: int) -> tuple[int, int]:
    """(registers, spill store bytes) of the kernel in ``ptx`` from the ptxas Triton uses for ``arch``."""
    ptxas = nvidia_compiler.get_ptxas(arch).path
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        suffix = "a" if arch == 90 else ""
        out = subprocess.run([ptxas, f"-arch=sm_{arch}{suffix}", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
    regs = max((int(r) for r in re.findall(r"Used (\d+) registers", out)), default=0)
    return regs, sum(int(s) for s in re.findall(r"(\d+) bytes spill stores", out))


def compile_one(job) -> tuple:
    """(arch, dtype, spec name, launch index, autotuned, shared bytes or None, registers, spills, error)."""
    arch, dtype, spec_name, index, spills_too = job
    spec = next(s for s in compile_specs(dtype) if s.name == spec_name)
    fn, constexprs, options = launches(spec)[index]
    signature = {arg: "constexpr" if arg in constexprs else spec.types[arg] for arg in fn.arg_names}
    head = (arch, dtype, spec_name, index, spec.options is None)
    try:
        compiled = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", arch, 32),
                                  options=options)
        regs, spills = ptxas_report(compiled.asm["ptx"], arch) if spills_too else (0, 0)
        return (*head, compiled.metadata.shared, regs, spills, "")
    except Exception as exc:  # a compile failure is a check failure, reported with its message
        return (*head, None, 0, 0, f"{type(exc).__name__}: {exc}"[:300])


def summarize(arch: int, rows: list, spills: bool) -> bool:
    """Prints one architecture's table (one line per spec); True when a spec fails."""
    limit, failed = SHARED_LIMIT[arch], False
    groups: dict[tuple, list] = {}
    for row in rows:
        groups.setdefault(row[1:3], []).append(row)
    print(f"sm_{arch}, shared memory limit {limit} B per block; {len(rows)} compiles")
    print(f"{'dtype':<5} {'launch':<30} {'compiled':>8} {'fit':>4} {'first':>5} {'no spill':>8} {'max smem':>9} "
          f"{'regs':>5}")
    for (dtype, name), group in groups.items():
        errors = [r for r in group if r[5] is None]
        fit = [r for r in group if r[5] is not None and r[5] <= limit]
        clean = [r for r in fit if r[7] == 0]
        first_fits = any(r[3] == 0 for r in fit)
        bad = bool(errors) or not first_fits or (spills and not clean)
        failed |= bad
        print(f"{dtype:<5} {name:<30} {len(group) - len(errors):>4}/{len(group):<3} {len(fit):>4} "
              f"{'yes' if first_fits else 'NO':>5} {len(clean) if spills else '-':>8} "
              f"{max((r[5] for r in group if r[5] is not None), default=0):>9} "
              f"{max((r[6] for r in clean), default=0) if spills else '-':>5}{'  FAIL' if bad else ''}")
        for r in errors:
            print(f"    launch {r[3]}: {r[8]}")
    return failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="80,89,90",
                        help=f"comma-separated compute capabilities among {', '.join(map(str, sorted(SHARED_LIMIT)))}")
    parser.add_argument("--dtypes", default="fp32,bf16", help="operand dtypes among fp32, bf16, fp16")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--no-spills", dest="spills", action="store_false",
                        help="skip ptxas -v (registers and spills): about half the time")
    args = parser.parse_args()
    archs = [int(a) for a in args.arch.split(",")]
    for arch in archs:
        if arch not in SHARED_LIMIT:
            parser.error(f"--arch {arch}: choose among {', '.join(map(str, sorted(SHARED_LIMIT)))}")
    dtypes = args.dtypes.split(",")
    jobs = [(arch, dtype, spec.name, i, args.spills) for arch in archs for dtype in dtypes
            for spec in compile_specs(dtype) if arch >= spec.min_arch for i in range(len(launches(spec)))]
    with ProcessPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(compile_one, jobs))
    failed = False
    for arch in archs:
        failed |= summarize(arch, [r for r in rows if r[0] == arch], args.spills)
    print(f"ntconv-triton-check (triton {triton.__version__}, sm_{', sm_'.join(map(str, archs))}):",
          "FAILED" if failed else "OK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
