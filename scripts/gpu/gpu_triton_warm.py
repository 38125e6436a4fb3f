"""The compile-only Triton target and the warm / worker / replay commands of scripts/gpu/gpu_triton.py
(that module's docstring says what they do; its CLI calls these)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # run with python -P, as the GPU scripts do
from gpu_triton import install_log, install_log_from_env, read_log, summarize  # noqa: E402

SM90 = dict(arch=90, warp_size=32, shared=232_448, sms=132)


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
        cmd = [sys.executable, *flags, os.path.join(HERE, "gpu_triton.py"), "worker", "--shard", f"{i}/{args.jobs}",
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
    tests = os.path.join(os.path.dirname(os.path.dirname(HERE)), "tests")
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


