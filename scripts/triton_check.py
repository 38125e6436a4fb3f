"""Ahead-of-time compile check of the exact-path Triton kernels and their config table, no GPU needed.

Compiles kernels of nt_kernels/backends/triton for target GPUs through Triton's
own pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin with the bundled ptxas),
exactly as the launchers would launch them (``fwd_spec`` / ``bwd_spec``:
kernel, constexprs, warps, stages; pointer arguments 16-byte aligned as the
runtime specialises them, except those the kernel leaves unspecialised,
``do_not_specialize_on_alignment``), and reads each compile's shared memory per block
and, from ``ptxas -v``, its registers and spill stores, and prints the
resident CTAs and warps per SM that follow (issue 40).

Two parts:

1. The table (always, every architecture in it): each entry of the config
   table (configs.py; $NT_KERNELS_TRITON_CONFIGS or the shipped
   config_table.py) is compiled for its architecture at head dim = its class
   and H = ``--heads``.  It fails when it does not compile, exceeds the
   architecture's shared memory per block, or spills registers.
2. The sweep (``--arch`` x ``--dtypes`` x ``--block-d``): per kernel and size
   class the config a launch would use there (table entry, else the
   heuristic) must compile, fit and not spill (a heuristic launch of the
   per-head packed or a multi-tile kernel that spills is reported, not
   failed: those kernels spilled before the table existed, see
   docs/kernels-exact-cuda.md); with
   ``--candidates`` every candidate the tuner times is compiled as well and
   reported (a candidate that does not fit is not a failure: the tuner skips
   it).

Packed tile classes follow each architecture's shared memory as the launchers
do (``packed_classes``).  Runs with Triton 3.6 (the GPU machines' version) and
3.9.  Exit status 1 on failure.

    python scripts/triton_check.py                          # sm_80, 89, 90; fp32, tf32, bf16; head dims 8..256
    python scripts/triton_check.py --block-d 64             # CI
    python scripts/triton_check.py --arch 90 --block-d 8,32 --candidates
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("triton_check: unset TRITON_INTERPRET (the check compiles for a GPU)")

os.environ.pop("NT_KERNELS_TRITON_AUTOTUNE", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the runtime default; silences Triton 3.9's notice
os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # registers and spills from Triton's own ptxas -v run
os.environ["TRITON_ALWAYS_COMPILE"] = "1"  # never a cache hit (it would print no ptxas log)
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from nt_kernels.backends.triton import configs  # noqa: E402
from nt_kernels.backends.triton.common import packed_classes  # noqa: E402
from nt_kernels.backends.triton.plan import BLOCK_CLASS, PLAN_BLOCK  # noqa: E402
from nt_kernels.backends.triton.occupancy import gate, occupancy  # noqa: E402
from nt_kernels.backends.triton.softmax_bwd import bwd_spec  # noqa: E402
from nt_kernels.backends.triton.softmax_fwd import fwd_spec  # noqa: E402

SHARED_LIMIT = configs.ARCH_SHARED_MEMORY
# "tf32": float32 under torch.backends.cuda.matmul.allow_tf32 (the dots' TF32 path, operands rounded first)
TORCH_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
POINTER_TYPES = {"fp32": "*fp32", "tf32": "*fp32", "bf16": "*bf16", "fp16": "*fp16"}
FLOAT32_POINTERS = ("lse_ptr", "delta_ptr")
SCALARS = {"plan": "*i64", "H": "i32", "D": "i32", "scale": "fp32", "qk_scale": "fp32"}


def spec_of(kernel: str, config: dict, dtype: str, heads: int, head_dim: int, cls: int, tile: int):
    make = fwd_spec if kernel.startswith("fwd") else bwd_spec
    return make(kernel, config, TORCH_DTYPES[dtype], heads, head_dim, cls, tile, allow_tf32=dtype == "tf32")


def settings(arch: int, dtype: str, head_dim: int) -> list[tuple[str, int, int]]:
    """(kernel, packed class, tile height) of every launch for this architecture, dtype and head dim."""
    classes = packed_classes(TORCH_DTYPES[dtype], head_dim, SHARED_LIMIT[arch])
    if PLAN_BLOCK in dict(classes).values():  # the opt-in row blocks (plan.py) run the 64-row tile's config
        classes.append((BLOCK_CLASS, PLAN_BLOCK))
    return ([("fwd_packed", c, t) for c, t in classes] + [("fwd_multi", 0, 0)]
            + [("bwd_packed", c, t) for c, t in classes] + [("bwd_dq", 0, 0), ("bwd_dkdv", 0, 0)])


def size_of(kernel: str, cls: int, tile: int) -> str:
    """The table's size class of a launch (``rows`` for the row blocks)."""
    return configs.size_class(kernel, configs.ROWS if cls == BLOCK_CLASS else (tile or None))


def ptxas_report(log: str) -> tuple[int, int]:
    """(registers, spill store bytes) from the ``ptxas -v`` log of Triton's own cubin step."""
    regs = max((int(r) for r in re.findall(r"Used (\d+) registers", log)), default=0)
    spills = sum(int(s) for s in re.findall(r"(\d+) bytes spill stores", log))
    return regs, spills


def compile_one(job):
    """Compile one launch; returns (job, shared bytes or None, registers, spill bytes, error)."""
    arch, kernel, dtype, head_dim, heads, cls, tile, config, label = job
    try:
        spec = spec_of(kernel, config, dtype, heads, head_dim, cls, tile)
        fn = spec.fn
        signature, attrs = {}, {}
        unaligned = set(getattr(fn, "do_not_specialize_on_alignment", None) or ())  # e.g. lse_ptr: any row
        for i, arg in enumerate(fn.arg_names):
            if arg in spec.kwargs and i in fn.constexprs:
                signature[arg] = "constexpr"
                continue
            if arg in spec.kwargs and spec.kwargs[arg] % 16 == 0:  # runtime H / D, specialised like the JIT does
                attrs[(i,)] = [["tt.divisibility", 16]]
            signature[arg] = SCALARS.get(arg) or ("*fp32" if arg in FLOAT32_POINTERS else POINTER_TYPES[dtype])
            if signature[arg].startswith("*") and arg not in unaligned:
                attrs[(i,)] = [["tt.divisibility", 16]]
        constexprs = {a: v for a, v in spec.kwargs.items() if fn.arg_names.index(a) in fn.constexprs}
        log = io.StringIO()
        with contextlib.redirect_stdout(log):  # Triton prints its ptxas -v log (TRITON_DUMP_PTXAS_LOG=1)
            compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs),
                                      target=GPUTarget("cuda", arch, 32),
                                      options={"num_warps": spec.num_warps, "num_stages": spec.num_stages})
        regs, spills = ptxas_report(log.getvalue())
        return (job, compiled.metadata.shared, regs, spills, launched(spec), spec.num_warps,
                "tt.dot" in compiled.asm["ttir"])
    except Exception as exc:  # a compile failure is a check failure, reported with its message
        return job, None, 0, 0, f"error {type(exc).__name__}: {exc}"[:300], 0, False


def launched(spec) -> str:
    """What runs: the kernel's short name, and the tiles per work item of the "heads" kernel."""
    name = spec.fn.__name__.strip("_").replace("_kernel", "")
    return f"{name} TILES={spec.kwargs['TILES']}" if "TILES" in spec.kwargs else name


def table_jobs(table: dict, heads: int) -> list[tuple]:
    """One job per table entry (every architecture of the table)."""
    jobs = []
    for arch_name, section in table["archs"].items():
        arch = int(arch_name[3:])
        for key, config in section["entries"].items():
            kernel, dtype, dim_class, size = configs.parse_key(key)
            tile = configs.size_tile(size)
            cls = BLOCK_CLASS if size == configs.ROWS else (configs.PACKED_HEIGHTS.index(tile) if tile else 0)
            if tile and tile not in dict(packed_classes(TORCH_DTYPES[dtype], dim_class, SHARED_LIMIT[arch])).values():
                continue  # a class the launchers never run on this architecture
            jobs.append((arch, kernel, dtype, dim_class, heads, cls, tile, config, "table"))
    return jobs


def sweep_jobs(args, table: dict) -> list[tuple]:
    """The launch config of every setting asked for; with --candidates also every tuner candidate."""
    jobs = []
    for arch in args.archs:
        for dtype in args.dtypes.split(","):
            for head_dim in (int(d) for d in args.block_d.split(",")):
                for kernel, cls, tile in settings(arch, dtype, head_dim):
                    dim_class, size = configs.head_dim_class(head_dim), size_of(kernel, cls, tile)
                    config, source = configs.lookup(kernel, dtype, dim_class, size, arch, table)
                    jobs.append((arch, kernel, dtype, head_dim, args.heads, cls, tile, config, source))
                    if args.candidates:
                        for i, cand in enumerate(configs.candidates(kernel, dtype, dim_class, size, args.heads, arch)):
                            jobs.append((arch, kernel, dtype, head_dim, args.heads, cls, tile, cand, f"candidate {i}"))
    return jobs


def report(rows: list) -> bool:
    """Print one line per compile; True when a table entry or a launch config fails.

    Table entries and every launch of the "heads" kernel must fit shared
    memory and not spill; every launch (not a tuner candidate) must pass the
    occupancy gate on sm_90 (nt_kernels/backends/triton/occupancy.py: at least
    8 resident warps per SM for a kernel with ``tl.dot``, 16 without).  The per-head packed kernel and the multi-tile
    kernels (unchanged since before the config table) spill registers in some
    settings under their heuristic config (the pinned one of the H100 run); such
    a launch is reported ("spills") without failing, and never written as a
    table entry.
    """
    failed, warned = False, 0
    print(f"{'arch':<6} {'kernel':<11} {'dtype':<5} {'D':>4} {'size':<5} {'config':<12} {'runs':<20} {'smem':>7} "
          f"{'regs':>5} {'spill':>5} {'warps':>5} {'CTA/SM':>6} {'warps/SM':>8} {'dot':>3}  params")
    for job, shared, regs, spills, what, warps, dot in sorted(rows, key=lambda r: r[0][:7] + (r[0][8],)):
        arch, kernel, dtype, head_dim, _, cls, tile, config, label = job
        size = size_of(kernel, cls, tile)
        error = shared is None
        too_big = not error and shared > SHARED_LIMIT[arch]
        occ = None if error or too_big else occupancy(arch, regs, shared, warps)
        gates = [] if occ is None else gate(arch, regs, 0, shared, warps, dot)  # spills: judged below
        if label.startswith("candidate"):
            bad, note = error, "  (does not fit)" if too_big else ("  (spills)" if spills else "")
        elif label == "heuristic" and not what.startswith(("fwd_heads", "bwd_heads")) and not too_big and spills:
            bad, note = bool(gates), "  spills (kernel as before the table)" + (f"; FAIL: {'; '.join(gates)}"
                                                                                  if gates else "")
            warned += 1
        else:
            bad = error or too_big or spills > 0 or bool(gates)
            note = f"  FAIL{': ' + '; '.join(gates) if gates else ''}" if bad else ""
        failed |= bad
        params = ",".join(f"{k}={v}" for k, v in config.items())
        occ_text = f"{occ.ctas:>6} {occ.warps:>8}" if occ else f"{'-':>6} {'-':>8}"
        print(f"sm_{arch:<3} {kernel:<11} {dtype:<5} {head_dim:>4} {size:<5} {label:<12} "
              f"{'-' if error else what:<20} {'-' if error else shared:>7} {regs:>5} {spills:>5} {warps:>5} "
              f"{occ_text} {'yes' if dot else 'no':>3}  {params}{note}")
        if error:
            print(f"    {what}")
    if warned:
        print(f"{warned} heuristic launches of the per-head packed or multi-tile kernels spill registers "
              "(not a failure; docs/kernels-exact-cuda.md)")
    return failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="80,89,90", help=f"comma-separated compute capabilities among "
                        f"{', '.join(map(str, sorted(SHARED_LIMIT)))}")
    parser.add_argument("--dtypes", default="fp32,tf32,bf16")
    parser.add_argument("--block-d", default="8,16,32,64,128,256", help="head dims of the sweep")
    parser.add_argument("--heads", type=int, default=4, help="H the kernels are compiled for (default 4)")
    parser.add_argument("--candidates", action="store_true", help="also compile every tuner candidate")
    parser.add_argument("--no-table", action="store_true", help="skip the table entries (sweep only)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    args.archs = [int(a) for a in args.arch.split(",")]
    for arch in args.archs:
        if arch not in SHARED_LIMIT:
            parser.error(f"--arch {arch}: choose among {', '.join(map(str, sorted(SHARED_LIMIT)))}")
    table = configs.load_table()
    jobs = ([] if args.no_table else table_jobs(table, args.heads)) + sweep_jobs(args, table)
    unique = list(dict.fromkeys((j[:7] + (tuple(sorted(j[7].items())),) + j[8:]) for j in jobs))
    jobs = [j[:7] + (dict(j[7]),) + j[8:] for j in unique]
    print(f"triton {triton.__version__}; table version {table['version']} "
          f"({sum(len(s['entries']) for s in table['archs'].values())} entries); {len(jobs)} compiles", flush=True)
    with ProcessPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(compile_one, jobs))
    failed = report(rows)
    print(f"triton-check (triton {triton.__version__}, sm_{', sm_'.join(map(str, args.archs))}, table):",
          "FAILED" if failed else "OK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
