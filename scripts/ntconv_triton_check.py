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

Per launch (a kernel launched with the plan's tiles, or the first config of an
autotuned one: what runs without NT_KERNELS_TRITON_AUTOTUNE) it prints the
occupancy that follows on that architecture (nt_kernels/backends/triton/
occupancy.py): warps per CTA, resident CTAs and warps per SM and what limits
them, whether the kernel has a ``tl.dot``, and the shared-memory instructions
and barriers of its PTX (static counts: a proxy for the round trips through
shared memory and the barriers per tile).

A launch fails the check when it does not compile or does not fit the shared
memory, or spills registers (an autotuned kernel: when its first config does
not fit or every config that fits spills), or, on sm_90, misses an occupancy
gate of issue 40 (``occupancy.gate``): at least 16 resident warps per SM for a
kernel without ``tl.dot``, 8 for one with, and for the per-row streaming
kernels of the backward (``Spec.streaming``) at most 96 registers and at least
4 CTAs of 4 warps per SM.  Exit status 1 on failure.  ``make triton-check``
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
from typing import NamedTuple
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
from nt_kernels.backends.triton.ntconv_stream import CAP_MIN_ARCH  # noqa: E402
from nt_kernels.backends.triton.occupancy import gate, occupancy  # noqa: E402

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


def ptx_counts(ptx: str) -> tuple[int, int]:
    """(shared-memory instructions, barriers) in the PTX: ld/st.shared, ldmatrix/stmatrix, and bar/barrier.sync."""
    shared = len(re.findall(r"^\s*(?:@!?%p\d+\s+)?(?:ld|st)\.shared|^\s*(?:@!?%p\d+\s+)?(?:ldmatrix|stmatrix)", ptx,
                            re.MULTILINE))
    return shared, len(re.findall(r"^\s*(?:bar|barrier)\.sync", ptx, re.MULTILINE))


class Row(NamedTuple):
    arch: int
    dtype: str
    name: str
    index: int
    autotuned: bool
    streaming: bool
    warps: int
    shared: int | None   # bytes per CTA; None: did not compile
    regs: int
    spills: int
    dot: bool
    smem_ops: int
    bars: int
    error: str


def compile_one(job) -> Row:
    """One launch compiled for one architecture."""
    arch, dtype, spec_name, index, spills_too = job
    spec = next(s for s in compile_specs(dtype) if s.name == spec_name)
    fn, constexprs, options = launches(spec)[index]
    if "maxnreg" in options and arch < CAP_MIN_ARCH:  # the streaming kernels' cap: sm_90 and newer (ntconv_stream)
        options.pop("maxnreg")
    signature = {arg: "constexpr" if arg in constexprs else spec.types[arg] for arg in fn.arg_names}
    # Pointers 16-byte aligned, as the runtime specialises them (torch's allocations), except those the kernel
    # leaves unspecialised (do_not_specialize_on_alignment): the loads vectorise as they will on the GPU.
    unaligned = set(getattr(fn, "do_not_specialize_on_alignment", None) or ())
    attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(fn.arg_names)
             if signature[arg].startswith("*") and arg not in unaligned}
    head = (arch, dtype, spec_name, index, spec.options is None, spec.streaming, options["num_warps"])
    try:
        compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                                  options=options)
        regs, spills = ptxas_report(compiled.asm["ptx"], arch) if spills_too else (0, 0)
        return Row(*head, compiled.metadata.shared, regs, spills, "tt.dot" in compiled.asm["ttir"],
                   *ptx_counts(compiled.asm["ptx"]), "")
    except Exception as exc:  # a compile failure is a check failure, reported with its message
        return Row(*head, None, 0, 0, False, 0, 0, f"{type(exc).__name__}: {exc}"[:300])


def summarize(arch: int, rows: list[Row], spills: bool) -> bool:
    """Prints one architecture's table (one line per spec: its launched config); True when a spec fails."""
    limit, failed = SHARED_LIMIT[arch], False
    groups: dict[tuple, list[Row]] = {}
    for row in rows:
        groups.setdefault((row.dtype, row.name), []).append(row)
    print(f"sm_{arch}, shared memory limit {limit} B per block; {len(rows)} compiles"
          f"{'; gated: occupancy.gate' if arch == 90 else ''}")
    print(f"{'dtype':<5} {'launch':<34} {'configs':>7} {'warps':>5} {'regs':>5} {'spill':>5} {'smem':>7} "
          f"{'CTA/SM':>6} {'warps/SM':>8} {'limit':<9} {'dot':>3} {'smem ops':>8} {'bars':>4}")
    for (dtype, name), group in groups.items():
        errors = [r for r in group if r.shared is None]
        fit = [r for r in group if r.shared is not None and r.shared <= limit]
        clean = [r for r in fit if r.spills == 0]
        first = next((r for r in group if r.index == 0), group[0])
        first_fits = first in fit
        problems = [f"launch {r.index}: {r.error}" for r in errors]
        if not first_fits and not errors:
            problems.append("does not fit")
        if spills and not clean:
            problems.append("spills")
        if first_fits and spills:  # the occupancy of the launched config (spills are judged above)
            problems += gate(arch, first.regs, 0, first.shared, first.warps, first.dot, first.streaming)
        failed |= bool(problems)
        if first.shared is None:
            occ_text = f"{'-':>6} {'-':>8} {'-':<9}"
        else:
            occ = occupancy(arch, first.regs, first.shared, first.warps) if spills else None
            occ_text = f"{occ.ctas:>6} {occ.warps:>8} {occ.limit:<9}" if occ else f"{'-':>6} {'-':>8} {'-':<9}"
        configs = f"{len(clean) if spills else len(fit)}/{len(group)}"
        print(f"{dtype:<5} {name + (' *' if first.streaming else ''):<34} {configs:>7} {first.warps:>5} "
              f"{first.regs if spills else '-':>5} {first.spills if spills else '-':>5} "
              f"{first.shared if first.shared is not None else '-':>7} {occ_text} {'yes' if first.dot else 'no':>3} "
              f"{first.smem_ops:>8} {first.bars:>4}{'  FAIL: ' + '; '.join(problems) if problems else ''}")
    print("configs: spill-free (--no-spills: fitting) configs of all; the other columns are the launched config's "
          "(an autotuned kernel's first); * streaming kernel")
    return failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="80,89,90",
                        help=f"comma-separated compute capabilities among {', '.join(map(str, sorted(SHARED_LIMIT)))}")
    parser.add_argument("--dtypes", default="fp32,bf16", help="operand dtypes among fp32, bf16, fp16")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--no-spills", dest="spills", action="store_false",
                        help="skip ptxas -v (registers, spills and the occupancy gates): about half the time")
    parser.add_argument("--only", default="", help="compile only the launches whose name matches this regex")
    args = parser.parse_args()
    archs = [int(a) for a in args.arch.split(",")]
    for arch in archs:
        if arch not in SHARED_LIMIT:
            parser.error(f"--arch {arch}: choose among {', '.join(map(str, sorted(SHARED_LIMIT)))}")
    dtypes = args.dtypes.split(",")
    jobs = [(arch, dtype, spec.name, i, args.spills) for arch in archs for dtype in dtypes
            for spec in compile_specs(dtype) if arch >= spec.min_arch and re.search(args.only, spec.name)
            for i in range(len(launches(spec)))]
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
