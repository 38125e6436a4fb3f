"""``nt-kernels tune``: time the launch configs of the exact-path Triton kernels on this GPU and write the table.

For every dtype, head-dim class and (kernel, size class) asked for, a synthetic
graph whose segments all fall into that size class (packed tiles of height
16, 32 or 64, the opt-in row blocks' segments of 1-16 rows in place, or
multi-tile segments of 65-256 rows) is built on the GPU with about ``--rows``
packed rows, ``--heads`` heads and the first of ``--head-dims`` in the class
(``--head-dims 30`` tunes class d32 at the tolokers layer's D = 30).  Each candidate config of
the key (configs.candidates: the heuristic's first) is launched alone on it
and timed with ``triton.testing.do_bench``; the fastest becomes the key's
entry for this GPU's architecture (``sm_<cc>``).  A candidate that fails to
compile or launch (e.g. out of shared memory) is skipped.

Keys run grouped by (dtype, head dim, size class), one tuning graph on the
device at a time; ``--max-candidates N`` times only the first N candidates of
each key (what the heuristic runs first, then the likelier ones).  The table is
rewritten after every key, in the shipped format (a Python module holding one
literal ``TABLE = {...}``; other architectures' entries are kept from
``--base``, default the table in use), so a run cut short keeps what it
timed.  Use it with ``NT_KERNELS_TRITON_CONFIGS=<file>``, or copy it over
nt_kernels/backends/triton/config_table.py to ship it (then run
``make triton-check`` to validate every entry).  ``--timings`` also writes
every candidate's time, the kernel's minimum bytes (docs/kernels-exact-cuda.md) and the
achieved fraction of the device-to-device copy bandwidth measured in the same
run.

``--compile-only`` times nothing and needs no GPU: it launches every
candidate once on CPU tensors for the active Triton target, which is how
``make gpu-bundle`` puts the tune stage's candidates (scripts/gpu/gpu_perf.sh)
in its Triton cache, under scripts/gpu/gpu_triton.py's compile-only sm_90
target.

    nt-kernels tune --device cuda --out config_table.py --timings tune.json
    nt-kernels tune --device cuda --dtypes bf16 --head-dims 8,32 --sizes t16,t32 --max-candidates 4 --out t.py
    python -P scripts/gpu/gpu_triton.py warm --fake-target -- tune --compile-only --dtypes bf16 --head-dims 30
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import platform

import torch

from nt_kernels.backends.triton import configs

ALL_KERNELS = tuple(configs.KERNELS)
ALL_SIZES = (*configs.PACKED_SIZES, "multi")  # t16, t32, t64, rows (the opt-in row blocks), multi
MULTI_SIZES = (65, 256)   # multi-tile segment sizes of the tuning graph (inclusive range)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("tune", help="time the Triton exact kernels' configs on this GPU, write the table",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="a CUDA device (tuning needs a GPU)")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma list among fp32, bf16, fp16")
    p.add_argument("--head-dims", default="1,2,4,8,16,32,64",
                   help="head dims to tune (each stands for its class, whose tuning graph has the first given)")
    p.add_argument("--heads", type=int, default=4, help="H of the tuning inputs (default 4)")
    p.add_argument("--rows", type=int, default=1 << 20, help="packed rows E of each tuning graph")
    p.add_argument("--kernels", default=",".join(ALL_KERNELS), help="comma list of kernels to tune")
    p.add_argument("--sizes", default=",".join(ALL_SIZES), help="comma list of size classes to tune")
    p.add_argument("--max-candidates", type=int, default=None,
                   help="time only the first N candidates of each key (the heuristic first; default all)")
    p.add_argument("--warmup", type=int, default=10, help="do_bench warm-up, milliseconds")
    p.add_argument("--rep", type=int, default=50, help="do_bench measuring time, milliseconds")
    p.add_argument("--base", default=None, help="table whose other entries are kept (default: the table in use)")
    p.add_argument("--out", default=None, help="table file to write (config_table.py format; required unless "
                   "--compile-only)")
    p.add_argument("--timings", default=None, help="also write every candidate's time to this JSON file")
    p.add_argument("--compile-only", action="store_true",
                   help="launch every candidate once on CPU tensors for the active Triton target and time nothing "
                        "(the bundle's compile-only sm_90 target; not under TRITON_INTERPRET=1)")
    p.set_defaults(func=run)
    return p


# ------------------------------------------------------------ device-independent part (tested on CPU)

def tune_keys(dtypes, head_dims, kernels, sizes) -> list[tuple[str, str, int, str]]:
    """(kernel, dtype, head-dim class, size class) of every key asked for, grouped by (dtype, head-dim
    class, size class) so the tuner holds one tuning graph at a time (sizes that do not apply to a
    kernel are left out; head dims of one class collapse to one key)."""
    keys = []
    for dtype in dtypes:
        for dim_class in dict.fromkeys(configs.head_dim_class(d) for d in head_dims):
            for size in sizes:
                for kernel in kernels:
                    packed = configs.KERNELS[kernel][0] == "packed"
                    if (size != "multi") == packed and (kernel, dtype, dim_class, size) not in keys:
                        keys.append((kernel, dtype, dim_class, size))
    return keys


def tune_entries(keys, candidates_of, time_of):
    """Time every candidate of every key; returns ({table key: fastest config}, log rows).

    ``candidates_of(key)`` lists the configs (the heuristic's first);
    ``time_of(key, config)`` returns milliseconds or raises (the candidate is
    then skipped).  Ties go to the earlier candidate.  A key none of whose
    candidates ran gets no entry (the heuristic serves it).
    """
    entries, log = {}, []
    for key in keys:
        timed = []
        for i, config in enumerate(candidates_of(key)):
            try:
                ms = float(time_of(key, config))
                error = ""
            except Exception as exc:  # recorded in the log; the tuner moves on
                ms, error = math.inf, f"{type(exc).__name__}: {exc}"[:200]
            timed.append({"config": config, "ms": ms, "error": error, "index": i})
        ok = [t for t in timed if math.isfinite(t["ms"])]
        best = min(ok, key=lambda t: (t["ms"], t["index"])) if ok else None
        if best is not None:
            entries[configs.table_key(*key)] = best["config"]
        log.append({"key": configs.table_key(*key), "best": best and best["config"],
                    "best_ms": best and best["ms"], "first_ms": timed[0]["ms"] if timed else None,
                    "candidates": timed})
    return entries, log


def merge_table(base: dict, arch: int, entries: dict, source: str) -> dict:
    """``base`` with this architecture's section updated by ``entries`` (other keys and architectures kept)."""
    table = copy.deepcopy(base)
    table.setdefault("archs", {})
    section = table["archs"].setdefault(configs.arch_name(arch), {"entries": {}})
    section["entries"] = dict(section.get("entries", {}), **entries)
    section["source"] = source
    table["version"] = configs.TABLE_VERSION
    return table


def minimum_bytes(kernel: str, rows: int, heads: int, head_dim: int, itemsize: int) -> int:
    """Fewest bytes a kernel must move for ``rows`` packed rows (docs/kernels-exact-cuda.md, "Minimum bytes")."""
    tensor, lse = rows * heads * head_dim * itemsize, rows * heads * 4
    return {"fwd_packed": 4 * tensor + lse, "fwd_multi": 4 * tensor + lse,
            "bwd_packed": 7 * tensor + lse, "bwd_dq": 6 * tensor + 2 * lse,
            "bwd_dkdv": 6 * tensor + 2 * lse}[kernel]


# ------------------------------------------------------------------------- GPU part

def class_sizes(size: str, max_tile: int) -> list[int]:
    """Segment sizes whose segments land in ``size`` (packed tile height, row blocks, or multi-tile)."""
    from nt_kernels.backends.triton.plan import BLOCK_SMALL, PLAN_BLOCK, TILE_HEIGHTS, _size_class

    if size == "multi":
        return list(range(MULTI_SIZES[0], MULTI_SIZES[1] + 1))
    if size == configs.ROWS:
        return list(range(1, BLOCK_SMALL + 1))
    c = TILE_HEIGHTS.index(int(size[1:]))
    return [n for n in range(1, min(max_tile, PLAN_BLOCK) + 1) if _size_class(n, max_tile) == c]


class GpuTimer:
    """time_of(key, config) on one CUDA device: a tuning graph per (dtype, D, size) and do_bench.

    ``head_dims`` maps a head-dim class to the head dim its tuning graph has (default: the class itself;
    ``--head-dims 30`` tunes class d32 at D = 30, the tolokers layer's, whose loads are masked and
    specialised differently from D = 32's).  With ``warmup`` None (``--compile-only``) the device is the
    CPU and each candidate is launched once, untimed (0 ms): what the active Triton target compiles is the
    point."""

    def __init__(self, device: torch.device, heads: int, rows: int, warmup: int | None, rep: int,
                 head_dims: dict | None = None):
        self.device, self.heads, self.rows, self.warmup, self.rep = device, heads, rows, warmup, rep
        self.head_dims = head_dims or {}
        self.cuda = device.type == "cuda"
        self.current: tuple = (None, None)   # (key, problem): one tuning graph on the device at a time
        self.row_counts: dict = {}           # (dtype, D, size) -> packed rows of its tuning graph

    def problem(self, dtype: str, dim_class: int, size: str) -> dict:
        from nt_kernels.backends.triton.common import num_programs
        from nt_kernels.backends.triton.plan import build_plan, max_packed_tile, shared_memory_per_block

        key, head_dim = (dtype, dim_class, size), self.head_dims.get(dim_class, dim_class)
        if self.current[0] != key:
            self.current = (None, None)
            if self.cuda:
                torch.cuda.empty_cache()
            torch_dtype = {v: k for k, v in configs.DTYPE_NAMES.items()}[dtype]
            max_tile = max_packed_tile(torch_dtype, head_dim, shared_memory_per_block(self.device))
            sizes = torch.tensor(class_sizes(size, max_tile))
            if size != "multi" and configs.size_tile(size) > max_tile:
                raise ValueError(f"{size}: the launchers never run this class for {dtype}, D = {head_dim} here")
            gen = torch.Generator().manual_seed(0)
            count = max(1, self.rows // int(sizes.float().mean()))
            seg = sizes[torch.randint(0, sizes.numel(), (count,), generator=gen)]
            rowptr = torch.cat([torch.zeros(1, dtype=torch.long), seg.cumsum(0)]).to(self.device)
            rows = int(rowptr[-1])
            shape = (rows, self.heads, head_dim)
            q, k, v, o, do, dq, dk, dv = (torch.randn(shape, device=self.device, dtype=torch_dtype)
                                          for _ in range(8))
            lse, delta = (torch.zeros(rows, self.heads, device=self.device) for _ in range(2))
            blocks = size == configs.ROWS  # the row blocks' tuning graph: segments of 1-16 rows in place
            plan = build_plan(rowptr, torch.arange(count, device=self.device), rows, max_tile, blocks)
            problem = dict(dtype=torch_dtype, rows=rows, head_dim=head_dim, blocks=blocks,
                           grid=(num_programs(self.device),),
                           tensors=dict(q_ptr=q, k_ptr=k, v_ptr=v, o_ptr=o, do_ptr=do, dq_ptr=dq, dk_ptr=dk, dv_ptr=dv,
                                        lse_ptr=lse, delta_ptr=delta, plan=plan))
            self._fill(problem, head_dim)
            self.current, self.row_counts[key] = (key, problem), rows
        return self.current[1]

    def _fill(self, problem: dict, head_dim: int) -> None:
        """The forward (lse) and the dQ pass (delta) of the inputs, with the configs in use."""
        from nt_kernels.backends.triton.common import LOG2E, launch
        from nt_kernels.backends.triton.softmax_bwd import bwd_spec
        from nt_kernels.backends.triton.softmax_fwd import softmax_fwd

        t, scale = problem["tensors"], head_dim ** -0.5
        problem["scales"] = dict(scale=scale, qk_scale=scale * LOG2E)
        softmax_fwd(t["o_ptr"], t["lse_ptr"], t["q_ptr"], t["k_ptr"], t["v_ptr"], t["plan"], scale,
                    blocks=problem["blocks"])
        name = configs.dtype_name(problem["dtype"])
        config = configs.heuristic("bwd_dq", name, configs.head_dim_class(head_dim), "multi", 0)
        launch(bwd_spec("bwd_dq", config, problem["dtype"], self.heads, head_dim), problem["grid"],
               **self.args("bwd_dq", problem))
        if self.cuda:
            torch.cuda.synchronize(self.device)

    @staticmethod
    def args(kernel: str, problem: dict) -> dict:
        """The keyword tensors and scales ``kernel`` takes (the names the launchers pass)."""
        t, s = problem["tensors"], problem["scales"]
        names = {"fwd_packed": ("q_ptr", "k_ptr", "v_ptr", "o_ptr", "lse_ptr", "plan"),
                 "fwd_multi": ("q_ptr", "k_ptr", "v_ptr", "o_ptr", "lse_ptr", "plan"),
                 "bwd_packed": ("q_ptr", "k_ptr", "v_ptr", "do_ptr", "lse_ptr", "dq_ptr", "dk_ptr", "dv_ptr", "plan"),
                 "bwd_dq": ("q_ptr", "k_ptr", "v_ptr", "o_ptr", "do_ptr", "lse_ptr", "delta_ptr", "dq_ptr", "plan"),
                 "bwd_dkdv": ("q_ptr", "k_ptr", "v_ptr", "do_ptr", "lse_ptr", "delta_ptr", "dk_ptr", "dv_ptr",
                              "plan")}[kernel]
        out = {n: t[n] for n in names}
        out["qk_scale"] = s["qk_scale"]
        if kernel.startswith("bwd"):
            out["scale"] = s["scale"]
        return out

    def __call__(self, key, config) -> float:
        from triton.testing import do_bench

        from nt_kernels.backends.triton.common import launch
        from nt_kernels.backends.triton.plan import BLOCK_CLASS
        from nt_kernels.backends.triton.softmax_bwd import bwd_spec
        from nt_kernels.backends.triton.softmax_fwd import fwd_spec

        kernel, dtype, dim_class, size = key
        problem = self.problem(dtype, dim_class, size)
        tile = configs.size_tile(size)
        cls = BLOCK_CLASS if size == configs.ROWS else (configs.PACKED_HEIGHTS.index(tile) if tile else 0)
        make = fwd_spec if kernel.startswith("fwd") else bwd_spec
        spec = make(kernel, config, problem["dtype"], self.heads, problem["head_dim"], cls, tile)
        args = self.args(kernel, problem)
        if self.warmup is None:
            launch(spec, problem["grid"], **args)
            return 0.0
        return do_bench(lambda: launch(spec, problem["grid"], **args), warmup=self.warmup, rep=self.rep)


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read plus written), as scripts/gpu/gpu_measure.py measures it."""
    from triton.testing import do_bench

    src = torch.randn(1 << 28, device=device)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=50)
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


COMPILE_ONLY_ROWS = 4096  # --compile-only's tuning graphs at most: their size changes nothing that compiles


def compile_only(keys, candidates_of, heads: int, rows: int, head_dims: dict) -> int:
    """``--compile-only``: every candidate of every key launched once on CPU tensors (graphs of at most
    COMPILE_ONLY_ROWS rows), untimed."""
    from nt_kernels.backends.triton.common import INTERPRET

    if INTERPRET:
        print("tune --compile-only: TRITON_INTERPRET=1 would run the kernels, not compile them (run it under "
              "scripts/gpu/gpu_triton.py's compile-only target: gpu_triton.py warm --fake-target -- tune ...)")
        return 2
    timer = GpuTimer(torch.device("cpu"), heads, min(rows, COMPILE_ONLY_ROWS), None, 0, head_dims)
    _, log = tune_entries(keys, candidates_of, timer)
    tried = [(row["key"], c) for row in log for c in row["candidates"]]
    failed = [(key, c) for key, c in tried if c["error"]]
    print(f"tune --compile-only: {len(tried) - len(failed)} of {len(tried)} candidates of {len(keys)} keys launched")
    for key, c in failed:  # e.g. out of shared memory: the GPU's tuner skips them too
        print(f"  {key} {c['config']}: {c['error']}")
    return 1 if tried and len(failed) == len(tried) else 0


def run(args: argparse.Namespace) -> int:
    device = torch.device("cpu" if args.compile_only else args.device)
    if not args.compile_only and not args.out:
        raise SystemExit("tune: --out is required (the table file to write)")
    if not args.compile_only and (device.type != "cuda" or not torch.cuda.is_available()):
        print("tune: needs a CUDA device (the table holds configs timed on a GPU); "
              f"--device {args.device} has none here (--compile-only only compiles)")
        return 2
    from nt_kernels.backends.triton.common import device_arch

    arch = device_arch(device)
    dtypes, sizes = args.dtypes.split(","), args.sizes.split(",")
    for name in dtypes:
        if name not in configs.DTYPE_NAMES.values():
            raise SystemExit(f"tune: unknown dtype {name!r} (fp32, bf16, fp16)")
    head_dims = [int(d) for d in args.head_dims.split(",")]
    keys = tune_keys(dtypes, head_dims, args.kernels.split(","), sizes)
    dims = {}  # each class's tuning graph at the first head dim asked for in it
    for d in head_dims:
        dims.setdefault(configs.head_dim_class(d), d)

    def candidates_of(key):
        return configs.candidates(*key, heads=args.heads, arch=arch)[:args.max_candidates]

    if args.compile_only:
        return compile_only(keys, candidates_of, args.heads, args.rows, dims)
    import triton

    name = torch.cuda.get_device_name(device)
    source = (f"nt-kernels tune on {name}, triton {triton.__version__}, torch {torch.__version__}, "
              f"H = {args.heads}, E ~ {args.rows}, {datetime.date.today().isoformat()}")
    print(f"tune: {len(keys)} keys, {sum(len(candidates_of(k)) for k in keys)} candidates for "
          f"{configs.arch_name(arch)} ({name}); writing {args.out} after each key", flush=True)
    table = configs.read_table(args.base) if args.base else configs.load_table()
    timer = GpuTimer(device, args.heads, args.rows, args.warmup, args.rep, dims)
    bandwidth = copy_bandwidth(device)
    entries, log = {}, []
    for key in keys:
        new, rows = tune_entries([key], candidates_of, timer)
        entries.update(new)
        table = merge_table(table, arch, new, source)
        configs.write_table(table, args.out, header=f"Written by `nt-kernels tune` ({source}).")
        log += [roofline_row(row, timer.row_counts, args.heads, bandwidth, dims) for row in rows]
        row = log[-1]
        print(f"{row['key']:<28} best {row['best_ms'] or math.inf:8.3f} ms (first {row['first_ms'] or math.inf:8.3f})"
              f"  {row.get('fraction_of_copy', 0):6.1%} of copy  {row['best']}", flush=True)
        if args.timings:
            with open(args.timings, "w") as f:
                json.dump({"device": name, "arch": configs.arch_name(arch), "python": platform.python_version(),
                           "torch": torch.__version__, "triton": triton.__version__, "heads": args.heads,
                           "copy_gb_per_s": bandwidth, "keys": log}, f, indent=1)
    print(f"tune: {len(entries)} of {len(keys)} keys tuned for {configs.arch_name(arch)}; wrote {args.out}")
    return 0


def roofline_row(row: dict, row_counts: dict, heads: int, bandwidth: float, head_dims: dict | None = None) -> dict:
    """A log row with the kernel's minimum bytes (at the head dim its graph had: ``head_dims``, class ->
    D), achieved GB/s and fraction of the copy bandwidth."""
    kernel, dtype, dim_class, size = configs.parse_key(row["key"])
    rows = row_counts.get((dtype, dim_class, size))
    if rows and row["best_ms"]:
        itemsize = {"fp32": 4, "bf16": 2, "fp16": 2}[dtype]
        head_dim = (head_dims or {}).get(dim_class, dim_class)
        need = minimum_bytes(kernel, rows, heads, head_dim, itemsize)
        row = dict(row, rows=rows, head_dim=head_dim, min_bytes=need, gb_per_s=need / (row["best_ms"] * 1e-3) / 1e9)
        row["fraction_of_copy"] = row["gb_per_s"] / bandwidth
    return row
