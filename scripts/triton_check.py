"""Ahead-of-time compile check of the Triton kernels, no GPU needed.

Compiles every kernel of nt_kernels/backends/triton with every autotuning config for a
target GPU (default sm_90, the H100 / H200) through Triton's own pipeline
(TTIR -> TTGIR -> LLVM -> PTX -> cubin with the bundled ptxas), for each
dtype and padded head dim asked for, and prints per kernel and setting:
how many configs compiled, how many fit the target's shared memory per block,
with ``--spills`` how many of those have no register spills, the smallest
shared memory among the configs that fit and (with ``--spills``) the fewest
registers among the spill-free ones.  Spills and registers come from
``ptxas -v`` on the PTX, run with the ptxas Triton uses for that
architecture.  Written against Triton 3.9's compiler API.  Large head dims
are slow to compile (ptxas takes 20-30 s per BLOCK_D = 256 kernel on one
core of the development CPU).

A setting fails the check when no config fits the shared-memory limit (the
autotuner could launch none), when a compile fails, or (with ``--spills``)
when every config that fits spills.  Exit status 1 on failure.

    python scripts/triton_check.py                     # sm_90, fp32 + bf16, BLOCK_D 16..256
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

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the runtime default; silences Triton 3.9's notice
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia import compiler as nvidia_compiler  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from nt_kernels.backends.triton import softmax_bwd, softmax_fwd  # noqa: E402
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


def launch_constexprs(name: str, dtype: str, block_d: int) -> list[dict]:
    """The constexprs the launcher passes besides the config's (one dict per launch);
    like the launchers, packed classes taller than max_packed_tile are left out."""
    if name.endswith("packed"):
        classes = softmax_fwd.packed_classes(TORCH_DTYPES[dtype], block_d)
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
        return name, dtype, block_d, str(extra), cfg_index, compiled.metadata.shared, regs, spills, ""
    except Exception as exc:  # a compile failure is a check failure, reported with its message
        return name, dtype, block_d, str(extra), cfg_index, None, 0, 0, f"{type(exc).__name__}: {exc}"[:200]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, choices=sorted(SHARED_LIMIT))
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--block-d", default="16,32,64,128,256", help="padded head dims (powers of two >= 16)")
    parser.add_argument("--kernels", default=",".join(KERNELS))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--spills", action="store_true",
                        help="also run ptxas -v on each kernel for registers and spills (doubles the time)")
    args = parser.parse_args()
    limit = SHARED_LIMIT[args.arch]
    jobs = [(name, dtype, int(bd), extra, i, args.arch, args.spills)
            for name in args.kernels.split(",")
            for dtype in args.dtypes.split(",")
            for bd in args.block_d.split(",")
            for extra in launch_constexprs(name, dtype, int(bd))
            for i in range(len(KERNELS[name][0].configs))]
    rows = []
    with ProcessPoolExecutor(args.jobs) as pool:
        for row in pool.map(compile_one, jobs):
            rows.append(row)
            print(f"  {row[0]} {row[1]} BLOCK_D={row[2]} {row[3]} config {row[4]}: "
                  f"{'error' if row[5] is None else f'{row[5]} B shared'}", flush=True)
    groups: dict[tuple, list] = {}
    for row in rows:
        groups.setdefault(row[:4], []).append(row)
    failed = False
    print(f"sm_{args.arch}, shared memory limit {limit} B per block; {len(rows)} compiles")
    print(f"{'kernel':<11} {'dtype':<5} {'BLOCK_D':>7} {'launch':<26} {'compiled':>8} {'fit':>4} "
          f"{'no spill':>8} {'min smem':>9} {'regs':>5}")
    for key, group in groups.items():
        errors = [r for r in group if r[5] is None]
        fit = [r for r in group if r[5] is not None and r[5] <= limit]
        clean = [r for r in fit if r[7] == 0]  # without --spills every fitting config counts
        bad = bool(errors) or not fit or not clean
        failed |= bad
        print(f"{key[0]:<11} {key[1]:<5} {key[2]:>7} {key[3]:<26} {len(group) - len(errors):>4}/{len(group):<3} "
              f"{len(fit):>4} {len(clean) if args.spills else '-':>8} {min((r[5] for r in fit), default=0):>9} "
              f"{min((r[6] for r in clean), default=0) if args.spills else '-':>5}{'  FAIL' if bad else ''}")
        for r in errors:
            print(f"    config {r[4]}: {r[8]}")
    print("triton-check:", "FAILED" if failed else "OK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
