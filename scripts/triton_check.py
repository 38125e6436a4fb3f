"""Ahead-of-time compile check of the Triton kernels, no GPU needed.

Compiles every kernel of nt_kernels/backends/triton with every autotuning config for
target GPUs (default sm_90, the H100 / H200; ``--arch 80,89,90`` for the A100,
the L4 / RTX 40 and the H100) through Triton's own pipeline
(TTIR -> TTGIR -> LLVM -> PTX -> cubin with the bundled ptxas), for each
dtype and padded head dim asked for, and prints per architecture, kernel and
setting: how many configs compiled, how many fit the target's shared memory
per block, whether the first config (the one NT_KERNELS_TRITON_AUTOTUNE=0
pins) fits, with ``--spills`` how many of the fitting ones have no register
spills, the smallest shared memory among the configs that fit and (with
``--spills``) the fewest registers among the spill-free ones.  Packed tile
classes follow each architecture's shared memory as the launchers do
(``packed_classes``).  Spills and registers come from ``ptxas -v`` on the
PTX, run with the ptxas Triton uses for that architecture.  Runs with Triton
3.6 (the GPU machines' version) and 3.9.  Large head dims are slow to compile
(ptxas takes 20-30 s per BLOCK_D = 256 kernel on one core of the development CPU).

A setting fails the check when no config fits the shared-memory limit (the
autotuner could launch none), when the first config does not fit (the pinned
mode could not launch), when a compile fails, or (with ``--spills``) when
every config that fits spills.  Exit status 1 on failure.

    python scripts/triton_check.py                     # sm_90, fp32 + bf16, BLOCK_D 16..256
    python scripts/triton_check.py --arch 80,89,90 --block-d 64
    python scripts/triton_check.py --arch 80 --dtypes fp32 --block-d 256
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
    sys.exit("triton_check: unset TRITON_INTERPRET (the check compiles for a GPU)")

os.environ.pop("NT_KERNELS_TRITON_AUTOTUNE", None)  # compile every config, not only the pinned one
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the runtime default; silences Triton 3.9's notice
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia import compiler as nvidia_compiler  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from nt_kernels.backends.triton import softmax_bwd, softmax_fwd  # noqa: E402
from nt_kernels.backends.triton.common import packed_classes  # noqa: E402
from nt_kernels.backends.triton.plan import PLAN_BLOCK  # noqa: E402

# Shared memory per block (opt-in maximum) by compute capability, bytes.
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
DTYPES = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16"}
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# kernel -> (pointer args, scalar args with types, fixed constexprs besides BLOCK_D / DOT_PREC / BF16_EMU)
KERNELS = {
    "fwd_packed": (softmax_fwd._fwd_packed_kernel, ["q_ptr", "k_ptr", "v_ptr", "o_ptr"],
                   {"lse_ptr": "*fp32", "plan": "*i64", "H": "i32", "D": "i32", "qk_scale": "fp32"}),
    "fwd_multi": (softmax_fwd._fwd_multi_kernel, ["q_ptr", "k_ptr", "v_ptr", "o_ptr"],
                  {"lse_ptr": "*fp32", "plan": "*i64", "H": "i32", "D": "i32", "qk_scale": "fp32"}),
    "bwd_packed": (softmax_bwd._bwd_packed_kernel,
                   ["q_ptr", "k_ptr", "v_ptr", "do_ptr", "dq_ptr", "dk_ptr", "dv_ptr"],
                   {"lse_ptr": "*fp32", "plan": "*i64", "H": "i32", "D": "i32", "scale": "fp32",
                    "qk_scale": "fp32"}),
    "bwd_dq": (softmax_bwd._bwd_dq_kernel, ["q_ptr", "k_ptr", "v_ptr", "o_ptr", "do_ptr", "dq_ptr"],
               {"lse_ptr": "*fp32", "delta_ptr": "*fp32", "plan": "*i64", "H": "i32", "D": "i32",
                "scale": "fp32", "qk_scale": "fp32"}),
    "bwd_dkdv": (softmax_bwd._bwd_dkdv_kernel,
                 ["q_ptr", "k_ptr", "v_ptr", "do_ptr", "dk_ptr", "dv_ptr"],
                 {"lse_ptr": "*fp32", "delta_ptr": "*fp32", "plan": "*i64", "H": "i32", "D": "i32",
                  "scale": "fp32", "qk_scale": "fp32"}),
}


def launch_constexprs(name: str, dtype: str, block_d: int, arch: int) -> list[dict]:
    """The constexprs the launcher passes besides the config's (one dict per launch);
    like the launchers, packed classes taller than the architecture's
    max_packed_tile are left out."""
    if name.endswith("packed"):
        classes = packed_classes(TORCH_DTYPES[dtype], block_d, SHARED_LIMIT[arch])
        return [{"CLASS": c, "TILE": t} for c, t in classes]
    if name == "bwd_dkdv":
        return [{"BLOCK_N": PLAN_BLOCK}]
    return [{"BLOCK_M": PLAN_BLOCK}]


def ptxas_report(ptx: str, arch: int) -> tuple[int, int]:
    """(registers, spill store bytes) of the kernel in ``ptx`` from the bundled ptxas."""
    ptxas = nvidia_compiler.get_ptxas(arch).path  # the ptxas Triton itself uses for this arch
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        suffix = "a" if arch == 90 else ""
        out = subprocess.run([ptxas, f"-arch=sm_{arch}{suffix}", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
    regs = max((int(r) for r in re.findall(r"Used (\d+) registers", out)), default=0)
    spills = sum(int(s) for s in re.findall(r"(\d+) bytes spill stores", out))
    return regs, spills


def compile_one(job):
    """Compiles one (kernel, dtype, BLOCK_D, launch constexprs, config); returns a result row."""
    name, dtype, block_d, extra, cfg_index, arch, spills_too = job
    kernel, pointers, scalars = KERNELS[name]
    config = kernel.configs[cfg_index]
    fn = kernel.fn
    constexprs = dict(extra, **config.kwargs, BLOCK_D=block_d, DOT_PREC="ieee", BF16_EMU=False)
    signature = {}
    for arg in fn.arg_names:
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg in scalars:
            signature[arg] = scalars[arg]
        else:
            assert arg in pointers, f"{name}: no type for argument {arg}"
            signature[arg] = DTYPES[dtype]
    try:
        compiled = triton.compile(ASTSource(fn, signature, constexprs),
                                  target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": config.num_warps, "num_stages": config.num_stages})
        regs, spills = ptxas_report(compiled.asm["ptx"], arch) if spills_too else (0, 0)
        return arch, name, dtype, block_d, str(extra), cfg_index, compiled.metadata.shared, regs, spills, ""
    except Exception as exc:  # a compile failure is a check failure, reported with its message
        return arch, name, dtype, block_d, str(extra), cfg_index, None, 0, 0, f"{type(exc).__name__}: {exc}"[:200]


def summarize(arch: int, rows: list, spills: bool) -> bool:
    """Prints one architecture's table; True when a setting fails."""
    limit = SHARED_LIMIT[arch]
    groups: dict[tuple, list] = {}
    for row in rows:
        groups.setdefault(row[1:5], []).append(row)
    failed = False
    print(f"sm_{arch}, shared memory limit {limit} B per block; {len(rows)} compiles")
    print(f"{'kernel':<11} {'dtype':<5} {'BLOCK_D':>7} {'launch':<26} {'compiled':>8} {'fit':>4} {'first':>5} "
          f"{'no spill':>8} {'min smem':>9} {'regs':>5}")
    for key, group in groups.items():
        errors = [r for r in group if r[6] is None]
        fit = [r for r in group if r[6] is not None and r[6] <= limit]
        first_fits = any(r[5] == 0 for r in fit)
        clean = [r for r in fit if r[8] == 0]  # without --spills every fitting config counts
        bad = bool(errors) or not fit or not clean or not first_fits
        failed |= bad
        print(f"{key[0]:<11} {key[1]:<5} {key[2]:>7} {key[3]:<26} {len(group) - len(errors):>4}/{len(group):<3} "
              f"{len(fit):>4} {'yes' if first_fits else 'NO':>5} {len(clean) if spills else '-':>8} "
              f"{min((r[6] for r in fit), default=0):>9} "
              f"{min((r[7] for r in clean), default=0) if spills else '-':>5}{'  FAIL' if bad else ''}")
        for r in errors:
            print(f"    config {r[5]}: {r[9]}")
    return failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="90", help=f"comma-separated compute capabilities among "
                        f"{', '.join(map(str, sorted(SHARED_LIMIT)))}")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--block-d", default="16,32,64,128,256", help="padded head dims (powers of two >= 16)")
    parser.add_argument("--kernels", default=",".join(KERNELS))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--spills", action="store_true",
                        help="also run ptxas -v on each kernel for registers and spills (doubles the time)")
    args = parser.parse_args()
    archs = [int(a) for a in args.arch.split(",")]
    for arch in archs:
        if arch not in SHARED_LIMIT:
            parser.error(f"--arch {arch}: choose among {', '.join(map(str, sorted(SHARED_LIMIT)))}")
    print(f"triton {triton.__version__}; configs per kernel: "
          f"{', '.join(f'{n} {len(k.configs)}' for n, (k, _, _) in KERNELS.items())}")
    jobs = [(name, dtype, int(bd), extra, i, arch, args.spills)
            for arch in archs
            for name in args.kernels.split(",")
            for dtype in args.dtypes.split(",")
            for bd in args.block_d.split(",")
            for extra in launch_constexprs(name, dtype, int(bd), arch)
            for i in range(len(KERNELS[name][0].configs))]
    rows = []
    with ProcessPoolExecutor(args.jobs) as pool:
        for row in pool.map(compile_one, jobs):
            rows.append(row)
            print(f"  sm_{row[0]} {row[1]} {row[2]} BLOCK_D={row[3]} {row[4]} config {row[5]}: "
                  f"{'error' if row[6] is None else f'{row[6]} B shared'}", flush=True)
    failed = False
    for arch in archs:
        failed |= summarize(arch, [r for r in rows if r[0] == arch], args.spills)
    print(f"triton-check (triton {triton.__version__}, sm_{', sm_'.join(map(str, archs))}):",
          "FAILED" if failed else "OK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
