"""Triton compilation in the GPU runs (scripts/gpu_check.sh, gpu_perf.sh, make gpu-bundle).

Compiling Triton kernels dominated the first H100 run: every process compiled
what it launched, one kernel after another, the same kernels in several
processes.  This module makes that measured, shared and parallel:

* **log** (``install_log``; the GPU scripts call it in every Python process
  through a ``sitecustomize.py`` when ``$NT_TRITON_LOG`` is set): one JSON
  line per kernel a process loads: kernel, cache hit or compiled, compile
  seconds per stage, and Triton's specialization data (what
  ``JITFunction.preload`` compiles again, byte for byte the same key).
* **warm** ``-- ARGS``: runs ``nt-kernels ARGS`` (e.g. ``check --kernels-only
  ...``) in N processes.  Each process meets the same kernel specialisations
  in the same order; process i compiles the i-th of every N distinct ones and
  skips the others (Triton's ``jit_cache_hook``), so N cores compile the
  workload's kernels once each into the shared ``$TRITON_CACHE_DIR``, with
  exactly the keys its launches compute.  Later processes (the real check,
  the tests) load them from there.
* **--fake-target** (``CompileOnlyDriver``): a Triton driver for a machine
  without a GPU that compiles for sm_90 and launches nothing, with the exact
  ops' and the fused layer's Triton implementations registered for CPU
  tensors.  The same warm then fills a cache ahead of time (make gpu-bundle
  with TRITON_AOT=1) or dry-runs the warm on the CPU.
* **fingerprint**: what Triton's cache key holds besides the kernel (Triton's
  own source hash, ptxas version, default options, cache-invalidating
  environment variables); ``--compare`` says whether a cache built elsewhere
  can hit here.
* **summary**, **specs** (the distinct logged specialisations, to keep under
  bench/results/gpu-runs/), **replay** (``preload`` of them: make gpu-bundle
  compiles them ahead), **pack**, **unpack** (a cache relocated: Triton's group
  files name absolute paths, rewritten on unpacking).

    python scripts/gpu_triton.py warm --jobs 16 --log L -- check --device cuda --kernels-only --dims 8,64
    python scripts/gpu_triton.py summary L --label check
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import time

SM90 = dict(arch=90, warp_size=32, shared=232_448, sms=132)
CACHE_MARK = "@TRITON_CACHE@"  # group files in a packed cache name their files relative to it


# --------------------------------------------------------------------------------------------- log
def _append(path: str, record: dict) -> None:
    """One JSON line, appended in one write (O_APPEND: lines of concurrent processes never mix)."""
    line = (json.dumps(record, default=str) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def install_log(path: str, tag: str = "") -> None:
    """Log every kernel load of this process (Triton's compilation listener and post-compile hook).
    The hooks run inside Triton's compile path: whatever goes wrong in them is recorded, never raised."""
    from triton import knobs

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        try:
            stages = {name: round(us / 1e6, 3) for name, us in times.lowering_stages}
            _append(path, {"t": round(time.time(), 3), "pid": os.getpid(), "tag": tag, "event": "load",
                           "kernel": getattr(src, "name", "?"), "hit": bool(cache_hit),
                           "seconds": round(times.total / 1e6, 3), "stages": stages, "hash": metadata.get("hash")})
        except Exception as exc:  # noqa: BLE001
            _log_error(path, tag, "listener", exc)

    def post_compile(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        try:
            _append(path, {"t": round(time.time(), 3), "pid": os.getpid(), "tag": tag, "event": "spec",
                           "module": fn.module, "kernel": fn.name, "spec": compile["specialization_data"]})
        except Exception as exc:  # noqa: BLE001
            _log_error(path, tag, "post-compile hook", exc)

    knobs.compilation.listener = listener
    knobs.runtime.jit_post_compile_hook = post_compile


def _log_error(path: str, tag: str, where: str, exc: Exception) -> None:
    try:
        _append(path, {"t": round(time.time(), 3), "pid": os.getpid(), "tag": tag, "event": "error",
                       "where": where, "error": f"{type(exc).__name__}: {exc}"[:300]})
    except OSError:
        pass


def install_log_from_env() -> None:
    """The sitecustomize entry point: log when $NT_TRITON_LOG is set (and triton imports)."""
    path = os.environ.get("NT_TRITON_LOG")
    if not path:
        return
    try:
        install_log(path, os.environ.get("NT_TRITON_TAG", ""))
    except Exception:  # noqa: BLE001  (no triton, or another one: the process runs on unlogged)
        pass


def read_log(paths) -> list[dict]:
    records = []
    for path in paths:
        if os.path.exists(path):
            with open(path) as f:
                records += [json.loads(line) for line in f if line.strip()]
    return records


def summarize(records: list[dict], label: str = "") -> str:
    """Kernel loads, cache hits, compiles and their seconds (ptxas among them), duplicates, slowest."""
    loads = [r for r in records if r.get("event") == "load" and (not label or r.get("tag") == label)]
    hits = [r for r in loads if r["hit"]]
    compiled = [r for r in loads if not r["hit"]]
    seconds = sum(r["seconds"] for r in compiled)
    ptxas = sum(r["stages"].get("cubin", 0.0) for r in compiled)
    per_hash: dict = {}
    for r in compiled:
        per_hash.setdefault(r["hash"], []).append(r)
    duplicates = sum(len(v) - 1 for v in per_hash.values())
    procs = len({r["pid"] for r in loads})
    head = f"triton{' (' + label + ')' if label else ''}: {len(loads)} kernel loads in {procs} processes: " \
           f"{len(hits)} cache hits, {len(compiled)} compiled ({len(per_hash)} distinct, {duplicates} " \
           f"compiled twice or more), {seconds:.1f} s of compiling ({ptxas:.1f} s in ptxas)"
    errors = [r for r in records if r.get("event") == "error" and (not label or r.get("tag") == label)]
    if errors:
        head += f"; {len(errors)} logging errors (first: {errors[0]['where']}: {errors[0]['error']})"
    slow = sorted(compiled, key=lambda r: -r["seconds"])[:8]
    lines = [head] + [f"  slowest compile: {r['kernel']} {r['seconds']:.1f} s (ptxas {r['stages'].get('cubin', 0):.1f})"
                      for r in slow]
    return "\n".join(lines)


def counts(records: list[dict], label: str = "") -> dict:
    loads = [r for r in records if r.get("event") == "load" and (not label or r.get("tag") == label)]
    compiled = [r for r in loads if not r["hit"]]
    return {"loads": len(loads), "hits": len(loads) - len(compiled), "compiled": len(compiled),
            "compile_seconds": round(sum(r["seconds"] for r in compiled), 1)}


# ------------------------------------------------------------------------------- compile-only target
class _Utils:
    def __init__(self, shared: int, sms: int):
        self.props = {"max_shared_mem": shared, "multiprocessor_count": sms, "max_num_regs": 65536,
                      "warpSize": 32, "sm_clock_rate": 1_980_000, "mem_clock_rate": 2_619_000, "mem_bus_width": 5120}

    def get_device_properties(self, device):
        return self.props

    def load_binary(self, name, kernel, shared, device):
        return 1, 1, 0, 0, 1024   # module, function, registers, spills, max threads: placeholders


class _NoLaunch:
    def __init__(self, src, metadata):
        pass

    def __call__(self, *args, **kwargs):
        return None


class CompileOnlyDriver:
    """A Triton driver with no GPU behind it: compiles for sm_90 (the H100 / H200) and launches nothing.

    Everything Triton puts in a kernel's cache key comes from the kernel, its
    arguments, the options and Triton itself; the driver supplies only the
    target (backend, arch, warp size), so a key computed here equals the one
    an sm_90 machine computes for the same launch with the same Triton."""

    def __init__(self, arch: int = SM90["arch"], warp_size: int = SM90["warp_size"], shared: int = SM90["shared"],
                 sms: int = SM90["sms"]):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, warp_size)
        self.utils = _Utils(shared, sms)
        self.launcher_cls = _NoLaunch

    def is_active(self):
        return True

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_benchmarker(self):
        raise RuntimeError("CompileOnlyDriver: nothing can be timed without a GPU (pin one config per kernel)")


def use_compile_only_driver() -> None:
    """Compile for sm_90 without a GPU, with the Triton implementations serving CPU tensors."""
    from triton.runtime.driver import driver

    driver.set_active(CompileOnlyDriver())
    import nt_kernels  # noqa: F401  (registers the CUDA kernels first)
    from torch.library import register_kernel

    from nt_kernels.backends.triton import ntconv_op
    from nt_kernels.backends.triton import register as exact

    import torch

    for op, fn in (("softmax_fwd_into", exact.softmax_fwd_into), ("softmax_bwd_into", exact.softmax_bwd_into),
                   ("ntconv_fwd", ntconv_op.ntconv_fwd), ("ntconv_bwd", ntconv_op.ntconv_bwd)):
        if hasattr(torch.ops.nt_kernels, op):
            register_kernel(f"nt_kernels::{op}", "cpu", fn)


# --------------------------------------------------------------------------------------------- warm
def shard_hook(index: int, count: int):
    """A jit_cache_hook that lets this process compile only the index-th of every count distinct
    specialisations it meets (numbered in the order they are first launched); it skips the others."""
    seen: dict = {}

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        ident = (fn.module, fn.name, str(key))
        number = seen.setdefault(ident, len(seen))
        return number % count != index   # True: Triton neither compiles nor launches it here
    return hook


def worker(args) -> int:
    """One warm process: the shard filter (and the compile-only target), then ``nt-kernels ARGS``."""
    tests = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
    if os.path.isdir(tests):  # kernels that the CUDA tests define (tests/test_*.py) replay too
        sys.path.append(tests)
    index, count = (int(x) for x in args.shard.split("/"))
    if args.fake_target:
        use_compile_only_driver()
    from triton import knobs

    if args.log:
        install_log(args.log, args.tag)
    knobs.runtime.jit_cache_hook = shard_hook(index, count)
    from nt_kernels.cli import main

    status = main(args.command)
    print(f"warm worker {index}/{count}: nt-kernels exited {status}", flush=True)
    return 0


def warm(args) -> int:
    """Run the workload in --jobs processes (see the module docstring); their output goes to --out-dir."""
    os.makedirs(args.out_dir, exist_ok=True)
    start = time.time()
    procs = []
    for i in range(args.jobs):
        flags = ["-P"] + (["-S"] if sys.flags.no_site else [])  # as this process was started
        cmd = [sys.executable, *flags, os.path.abspath(__file__), "worker", "--shard", f"{i}/{args.jobs}",
               "--tag", args.tag] + (["--log", args.log] if args.log else []) \
            + (["--fake-target"] if args.fake_target else []) + ["--", *args.command]
        out = open(os.path.join(args.out_dir, f"warm-{i}.log"), "w")
        procs.append((subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT), out))
    failed = stopped = 0
    for proc, out in procs:
        try:
            failed += proc.wait(timeout=max(1.0, start + args.timeout - time.time())) != 0
        except subprocess.TimeoutExpired:  # what it compiled so far stays in the cache
            proc.kill()
            proc.wait()
            stopped += 1
        out.close()
    records = read_log([args.log]) if args.log else []
    print(f"warm: {args.jobs} processes in {time.time() - start:.0f} s, {failed} failed, {stopped} stopped at "
          f"the {args.timeout:.0f} s limit", flush=True)
    if records:
        print(summarize(records, args.tag), flush=True)
    return 1 if failed else 0


def replay(args) -> int:
    """Compile logged specialisations again (``JITFunction.preload``), process i taking every N-th."""
    if args.fake_target:
        use_compile_only_driver()
    install_log_from_env()
    import importlib

    specs, seen = [], set()
    for r in read_log(args.records):
        if r.get("event") == "spec" and r["spec"] not in seen:
            seen.add(r["spec"])
            specs.append(r)
    tests = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
    if os.path.isdir(tests):  # kernels that the CUDA tests define (tests/test_*.py) replay too
        sys.path.append(tests)
    index, count = (int(x) for x in args.shard.split("/"))
    done = stale = 0
    for number, r in enumerate(specs):
        if number % count != index:
            continue
        try:
            fn = getattr(importlib.import_module(r["module"]), r["kernel"].split(".")[-1])
        except (ImportError, AttributeError) as exc:
            print(f"replay {index}/{count}: {r['module']}.{r['kernel']} not found ({exc}); skipped", flush=True)
            continue
        while not hasattr(fn, "preload") and hasattr(fn, "fn"):  # an autotuner or heuristics wraps the JITFunction
            fn = fn.fn
        data = json.loads(r["spec"])
        data["options"].pop("extern_libs", None)  # a path of the machine that logged it; Triton hashes its content
        try:
            fn.preload(json.dumps(data))
        except Exception as exc:  # noqa: BLE001  (a record of an older kernel source: it no longer compiles)
            stale += 1
            print(f"replay {index}/{count}: {r['kernel']} no longer compiles with this spec "
                  f"({type(exc).__name__}: {str(exc).splitlines()[-1][:120] if str(exc) else ''}); skipped", flush=True)
            continue
        done += 1
    print(f"replay {index}/{count}: {done} of {len(specs)} specialisations compiled or found"
          + (f", {stale} stale" if stale else ""), flush=True)
    return 0


# ------------------------------------------------------------------------------------- fingerprint
def fingerprint() -> dict:
    """The parts of Triton's cache key that do not come from the kernel or its launch, for sm_90."""
    import triton
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.cache import triton_key

    backend = make_backend(GPUTarget("cuda", SM90["arch"], SM90["warp_size"]))
    options = backend.parse_options({"num_warps": 4, "num_stages": 2})
    ptxas = backend.hash()
    release = [line for line in ptxas.splitlines() if "release" in line]
    return {"triton": triton.__version__, "triton_key": hashlib.sha256(triton_key().encode()).hexdigest()[:16],
            "ptxas": release[0].strip() if release else ptxas.strip()[:80],
            "backend": hashlib.sha256(ptxas.encode()).hexdigest()[:16], "options": options.hash()[:16],
            "env": {k: v for k, v in sorted(get_cache_invalidating_env_vars().items())}}


def compare(mine: dict, theirs: dict) -> list[str]:
    return [f"{k}: here {mine.get(k)!r}, cache {theirs.get(k)!r}" for k in sorted(set(mine) | set(theirs))
            if mine.get(k) != theirs.get(k)]


# ---------------------------------------------------------------------------------------- pack
KEEP = (".json", ".cubin", ".so")


def pack(cache: str, tar_path: str, hashes: set | None = None) -> int:
    """Cache entries (metadata, cubin, group file; launcher modules) into a tar.gz whose group files
    name paths relative to CACHE_MARK.  ``hashes``: only those kernels' entries (and all launchers)."""
    count = 0
    with tarfile.open(tar_path, "w:gz") as tar:
        for entry in sorted(os.listdir(cache)):
            folder = os.path.join(cache, entry)
            names = [n for n in os.listdir(folder) if n.endswith(KEEP) and not n.startswith("tmp")]
            groups = [n for n in names if n.startswith("__grp__")]
            if groups and hashes is not None and not _group_hash(folder, groups[0]) in hashes:
                continue
            for name in names:
                path = os.path.join(folder, name)
                if name.startswith("__grp__"):
                    data = json.load(open(path))
                    data["child_paths"] = {k: os.path.join(CACHE_MARK, entry, os.path.basename(v))
                                           for k, v in data["child_paths"].items()
                                           if k.endswith(KEEP) and os.path.exists(v)}
                    _add_bytes(tar, f"{entry}/{name}", json.dumps(data).encode())
                else:
                    tar.add(path, f"{entry}/{name}")
            count += bool(groups)
    return count


def _group_hash(folder: str, group: str) -> str | None:
    name = group[len("__grp__"):]
    path = os.path.join(folder, name)
    return json.load(open(path)).get("hash") if os.path.exists(path) else None


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    import io

    info = tarfile.TarInfo(name)
    info.size, info.mtime = len(data), int(time.time())
    tar.addfile(info, io.BytesIO(data))


def unpack(tar_path: str, cache: str) -> int:
    """Extract a packed cache into ``cache``, pointing its group files at their new place."""
    os.makedirs(cache, exist_ok=True)
    with tarfile.open(tar_path) as tar:
        tar.extractall(cache, filter="data") if hasattr(tarfile, "data_filter") else tar.extractall(cache)
    groups = glob.glob(os.path.join(cache, "*", "__grp__*"))
    for path in groups:
        text = open(path).read().replace(CACHE_MARK, os.path.abspath(cache))
        with open(path, "w") as f:
            f.write(text)
    return len(groups)


# ------------------------------------------------------------------------------------------ CLI
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    for name in ("warm", "worker"):
        p = sub.add_parser(name)
        p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
        p.add_argument("--shard", default="0/1", help="worker: i/N")
        p.add_argument("--log", default=os.environ.get("NT_TRITON_LOG"))
        p.add_argument("--tag", default="warm")
        p.add_argument("--out-dir", default=".")
        p.add_argument("--timeout", type=float, default=600.0, help="warm: seconds before the processes are stopped")
        p.add_argument("--fake-target", action="store_true", help="compile for sm_90 without a GPU")
        p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the nt-kernels arguments")
    p = sub.add_parser("replay")
    p.add_argument("records", nargs="+")
    p.add_argument("--shard", default="0/1")
    p.add_argument("--fake-target", action="store_true")
    p = sub.add_parser("summary")
    p.add_argument("logs", nargs="+")
    p.add_argument("--label", default="")
    p.add_argument("--json", action="store_true", help="print the counts as JSON")
    p = sub.add_parser("specs", help="the distinct logged specialisations (for bench/results/gpu-runs/*/)")
    p.add_argument("logs", nargs="+")
    p.add_argument("--out", required=True)
    p = sub.add_parser("fingerprint")
    p.add_argument("--out", default=None)
    p.add_argument("--compare", default=None, help="a fingerprint JSON (of the machine that built a cache)")
    p = sub.add_parser("pack")
    p.add_argument("cache")
    p.add_argument("tar")
    p.add_argument("--log", default=None, help="only the kernels this log loaded")
    p = sub.add_parser("unpack")
    p.add_argument("tar")
    p.add_argument("cache")
    args = parser.parse_args(argv)
    if getattr(args, "command", None) and args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if args.what == "warm":
        return warm(args)
    if args.what == "worker":
        return worker(args)
    if args.what == "replay":
        return replay(args)
    if args.what == "summary":
        records = read_log(args.logs)
        print(json.dumps(counts(records, args.label)) if args.json else summarize(records, args.label))
        return 0
    if args.what == "specs":
        seen, kept = set(), []
        for r in read_log(args.logs):
            if r.get("event") == "spec" and r["spec"] not in seen:
                seen.add(r["spec"])
                kept.append({k: r[k] for k in ("module", "kernel", "spec")} | {"event": "spec"})
        with open(args.out, "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in kept))
        print(f"specs: {len(kept)} distinct specialisations -> {args.out}")
        return 0
    if args.what == "fingerprint":
        mine = fingerprint()
        print(json.dumps(mine, indent=1))
        if args.out:
            json.dump(mine, open(args.out, "w"), indent=1)
        if args.compare:
            differences = compare(mine, json.load(open(args.compare)))
            print("fingerprint: " + ("matches " + args.compare if not differences else
                                     "differs from " + args.compare + ": " + "; ".join(differences)))
            return 0 if not differences else 3
        return 0
    if args.what == "pack":
        hashes = {r["hash"] for r in read_log([args.log]) if r.get("event") == "load"} if args.log else None
        print(f"pack: {pack(args.cache, args.tar, hashes)} kernels -> {args.tar}")
        return 0
    if args.what == "unpack":
        print(f"unpack: {unpack(args.tar, args.cache)} kernels -> {args.cache}")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
