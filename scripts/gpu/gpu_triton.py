"""Triton compilation in the GPU runs (scripts/gpu/gpu_check.sh, gpu_perf.sh, make gpu-bundle).

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
* **sources**: a digest of each jit function's source and starting line (what
  Triton's cache key takes from the kernel); ``--compare`` against a bundle's
  ``triton-sources.json`` says whether its cache is stale (``gpu_bundle.sh --check``).
* **summary**, **specs** (the distinct logged specialisations, to keep under
  bench/results/gpu-runs/), **replay** (``preload`` of them: make gpu-bundle
  compiles them ahead), **pack**, **unpack** (a cache relocated: Triton's group
  files name absolute paths, rewritten on unpacking).

    python scripts/gpu/gpu_triton.py warm --jobs 16 --log L -- check --device cuda --kernels-only --dims 8,64
    python scripts/gpu/gpu_triton.py summary L --label check
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time

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


def _open_text(path: str, mode: str = "r"):
    """A log or a specs file, gzip-compressed when its name ends in .gz (the committed specs are)."""
    return gzip.open(path, mode + "t") if path.endswith(".gz") else open(path, mode)


def read_log(paths) -> list[dict]:
    records = []
    for path in paths:
        if os.path.exists(path):
            with _open_text(path) as f:
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
    p = sub.add_parser("sources", help="digests of the Triton kernels' sources and lines (a cache's staleness)")
    p.add_argument("--out", default=None)
    p.add_argument("--compare", default=None, help="the sources JSON of a bundle's cache (.gpu-bundle)")
    p = sub.add_parser("pack")
    p.add_argument("cache")
    p.add_argument("tar")
    p.add_argument("--log", default=None, help="only the kernels this log loaded")
    p = sub.add_parser("unpack")
    p.add_argument("tar")
    p.add_argument("cache")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpu_triton_cache import compare, fingerprint, pack, sources, stale, unpack
    from gpu_triton_warm import replay, warm, worker

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
        with _open_text(args.out, "w") as f:
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
    if args.what == "sources":
        mine = sources()
        if args.out:
            json.dump(mine, open(args.out, "w"), indent=1)
        if not args.compare:
            print(f"sources: {len(mine)} jit functions" + (f" -> {args.out}" if args.out else ""))
            return 0
        changed = stale(mine, json.load(open(args.compare)))
        print(f"sources: the cache of {args.compare} " + (f"matches the tree's {len(mine)} jit functions"
              if not changed else f"is stale for {len(changed)} jit functions (and what calls them): "
              + ", ".join(changed[:12]) + " (bash scripts/gpu/gpu_bundle.sh --triton-only)"))
        return 0 if not changed else 3
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
