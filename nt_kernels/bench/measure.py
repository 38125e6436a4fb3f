"""Measuring one backend: inputs, peak memory, timings and error (the bench worker).

``nt-kernels bench`` runs :func:`measure_backend` in a fresh subprocess per
backend (``python -m nt_kernels.bench.measure SPEC.json``) unless asked to stay
in-process.  What is counted:

* peak memory, CUDA: ``torch.cuda.max_memory_allocated()`` during one
  forward+backward minus the allocated bytes just before it (inputs, grad_output,
  graph, plans and any backend state are in the baseline, so not counted).
* peak memory, CPU: the process's peak resident set size during the first
  forward+backward on the benchmark graph minus its resident set size just
  before it.  One forward+backward on a three-segment graph runs before the
  baseline, so code pages and thread pools loaded on first use are not counted.
  The peak is reset first by writing ``5`` to ``/proc/self/clear_refs`` and read
  from ``VmHWM`` in ``/proc/self/status``; where that is not allowed the peak is
  ``ru_maxrss`` (which then also covers anything allocated earlier).  Only in a
  fresh process is this honest: memory freed by an earlier run may be reused
  without raising the resident size, so in-process CPU figures are lower bounds.
* times: ``forward_ms`` is a forward with autograd recording (as in training),
  ``forward_backward_ms`` that forward plus backward of a fixed random
  grad_output, both measured in the same iteration; medians over ``repeats``
  iterations that follow the memory pass and ``warmup`` untimed iterations.
  Iterations rotate among ``input_sets`` input sets; on CUDA the device is
  synchronised before every clock read.
* error: max |o - ref| and ||o - ref|| / ||ref|| of the memory pass's output
  (input set 0) against a float64 reference on the same (rounded) inputs.
* forward only: a backend without a backward on the device (FlexAttention on
  the CPU) gets inputs that do not require grad; its memory pass and timed
  iterations are forwards alone, and its status is ``ok (forward only)`` with
  the reason in ``forward_only``.
"""
from __future__ import annotations

import json
import math
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from nt_kernels.bench import backends as bb

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16}
PROJECTION_SEED_OFFSET = 7919
FORWARD_ONLY = "ok (forward only)"


# ------------------------------------------------------------------ inputs
def make_inputs(num_rows: int, settings: dict, index: int, *, requires_grad: bool = True):
    """Input set ``index``: q, k, v (E, H, D) (requiring grad) and grad_output, drawn in float32 from a seed."""
    gen = torch.Generator().manual_seed(settings["seed"] * 1000 + index)
    shape = (num_rows, settings["heads"], settings["head_dim"])
    dtype, device = DTYPES[settings["dtype"]], torch.device(settings["device"])
    q, k, v, grad = (torch.randn(shape, generator=gen).to(device=device, dtype=dtype) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(requires_grad)
    return q, k, v, grad


def make_projection(settings: dict) -> torch.Tensor | None:
    """The (m, D) FAVOR+ projection in the bench dtype and device (None in exact mode)."""
    from nt_kernels.performer import orthogonal_random_features

    if not settings["nb_features"]:
        return None
    gen = torch.Generator().manual_seed(settings["seed"] + PROJECTION_SEED_OFFSET)
    return orthogonal_random_features(settings["nb_features"], settings["head_dim"], generator=gen,
                                      device=settings["device"], dtype=DTYPES[settings["dtype"]])


def build_context(graph: dict, settings: dict) -> bb.Context:
    """The backend context from a saved graph (CSR tensors) and the run settings."""
    from nt_kernels.csr import NeighbourhoodCSR

    device = torch.device(settings["device"])
    csr = NeighbourhoodCSR(graph["rowptr"].to(device), graph["perm"].to(device), graph["receiver"].to(device),
                           graph["num_nodes"], graph["max_degree"])
    return bb.Context(csr=csr, projection=make_projection(settings), threshold=float(settings["threshold"]),
                      heads=settings["heads"], head_dim=settings["head_dim"], dtype=DTYPES[settings["dtype"]],
                      device=device, reference_max_edges=settings["reference_max_edges"],
                      memory_cap_bytes=int(settings["memory_cap_gb"] * 1e9), hist=graph.get("hist"))


# ------------------------------------------------------------------ memory
def _status_bytes(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class PeakMemory:
    """Peak memory above a baseline taken at construction (see the module docstring)."""

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.baseline = torch.cuda.memory_allocated(device)
            self.method = "cuda max_memory_allocated"
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.method = "VmHWM after clear_refs"
        except OSError:
            self.method = "ru_maxrss"
        self.baseline = _status_bytes("VmRSS") or 0

    def peak(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self.baseline
        if self.method == "ru_maxrss":
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        else:
            peak = _status_bytes("VmHWM") or 0
        return max(peak - self.baseline, 0)


def limit_address_space(cap_bytes: int) -> None:
    """CPU subprocess guard: allocations past the current address space + cap fail (recorded as OOM)."""
    size = _status_bytes("VmSize")
    if size is not None:
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        soft = size + cap_bytes
        if hard != resource.RLIM_INFINITY:
            soft = min(soft, hard)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text
                                              or "not enough memory" in text or "bad_alloc" in text)


# ----------------------------------------------------------------- measure
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(fn, q, k, v, grad, backward: bool) -> torch.Tensor:
    """One forward, and the backward of ``grad`` when ``backward``; returns the output."""
    out = fn(q, k, v)
    if backward:
        out.backward(grad)
    return out


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def _errors(out: torch.Tensor, ref: torch.Tensor) -> dict:
    diff = out.detach().to(device="cpu", dtype=torch.float64) - ref
    ref_norm = ref.norm().item()
    return {"max_abs_error": diff.abs().max().item() if diff.numel() else 0.0,
            "rel_error": diff.norm().item() / ref_norm if ref_norm > 0 else diff.norm().item()}


def tiny_warmup(backend: bb.Backend, ctx: bb.Context, settings: dict, *, backward: bool = True) -> None:
    """One forward+backward on a three-segment graph (sizes 1, 4 and one past the threshold).

    Run before the memory baseline on the CPU, so that code pages, thread pools
    and other one-time state loaded on first use are not counted as the op's memory.
    """
    import dataclasses

    from nt_kernels.csr import NeighbourhoodCSR

    big = 9 if math.isinf(ctx.threshold) else int(ctx.threshold) + 2
    rowptr = torch.tensor([0, 1, 5, 5 + big], device=ctx.device)
    rows = int(rowptr[-1])
    csr = NeighbourhoodCSR(rowptr, torch.arange(rows, device=ctx.device), torch.arange(rows, device=ctx.device),
                           3, big)
    tiny = dataclasses.replace(ctx, csr=csr, hist=None)
    q, k, v, grad = make_inputs(rows, settings, 999, requires_grad=backward)
    out = bb.prepare(backend, tiny)(q, k, v)
    if backward:
        out.backward(grad)


def measure_backend(backend: bb.Backend, ctx: bb.Context, settings: dict, refs: dict,
                    *, guard_memory: bool = False) -> dict:
    """Peak memory, timings and error of one backend; OOM and failures become a status, not a crash.

    ``refs`` maps semantics (``switch`` / ``exact``) to a (reference tensor, label)
    pair or a path of a saved one.
    """
    entry = {"backend": backend.name, "family": backend.family, "alpha": backend.alpha}
    try:
        forward_only = bb.forward_only_reason(backend, ctx)
        backward = forward_only is None
        sets = [make_inputs(ctx.num_edges, settings, i, requires_grad=backward)
                for i in range(settings["input_sets"])]
        if ctx.device.type == "cpu":
            tiny_warmup(backend, ctx, settings, backward=backward)
        fn = bb.prepare(backend, ctx)
        if ctx.device.type == "cuda":
            q, k, v, grad = sets[0]
            _step(fn, q, k, v, grad, backward)
        for t in sets[0][:3]:
            t.grad = None
        if guard_memory and ctx.device.type == "cpu":
            limit_address_space(ctx.memory_cap_bytes)
        memory = PeakMemory(ctx.device)
        q, k, v, grad = sets[0]
        out = _step(fn, q, k, v, grad, backward)
        entry["peak_memory_bytes"] = memory.peak()
        entry["memory_method"] = memory.method
        out = out.detach()
        forward, total = [], []
        for it in range(settings["warmup"] + settings["repeats"]):
            q, k, v, grad = sets[it % len(sets)]
            for t in (q, k, v):
                t.grad = None
            _sync(ctx.device)
            t0 = time.perf_counter()
            o = fn(q, k, v)
            _sync(ctx.device)
            t1 = time.perf_counter()
            if backward:
                o.backward(grad)
                _sync(ctx.device)
            t2 = time.perf_counter()
            del o
            if it >= settings["warmup"]:
                forward.append(t1 - t0)
                total.append(t2 - t0)
    except Exception as exc:  # noqa: BLE001  (every failure is recorded in the results)
        entry["status"] = "OOM" if is_oom(exc) else f"error: {type(exc).__name__}: {str(exc)[:300]}"
        return entry
    entry.update(status="ok", forward_ms=_median_ms(forward), forward_ms_runs=[x * 1e3 for x in forward])
    if backward:
        entry.update(forward_backward_ms=_median_ms(total), forward_backward_ms_runs=[x * 1e3 for x in total])
    else:
        entry.update(status=FORWARD_ONLY, forward_only=forward_only)
    ref = refs.get(backend.semantics)
    if ref is not None:
        tensor, label = ref
        if isinstance(tensor, (str, Path)):
            tensor = torch.load(tensor)
        entry.update(_errors(out, tensor), error_vs=label)
        if not math.isfinite(entry["max_abs_error"]):
            entry["status"] = "error: non-finite output"
    return entry


# --------------------------------------------------------------- provenance
def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU model from /proc/cpuinfo with the core count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} ({os.cpu_count()} cores)"


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")


def versions() -> dict:
    import nt_kernels

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"python": platform.python_version(), "torch": torch.__version__, "triton": triton_version,
            "nt_kernels": nt_kernels.__version__}


def run_worker(module: str, spec_file: Path, result_file: Path, timeout: float, entry: dict) -> dict:
    """Runs ``python -m module spec_file`` and returns the result document it
    wrote to ``result_file``, else ``entry`` with the status: a timeout, OOM
    (the worker killed by SIGKILL) or the worker's last stderr line."""
    try:
        proc = subprocess.run([sys.executable, "-m", module, str(spec_file)],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**entry, "status": f"timeout: > {timeout:g} s"}
    if proc.returncode == 0 and result_file.is_file():
        return json.loads(result_file.read_text())
    if proc.returncode == -9:
        return {**entry, "status": "OOM (worker killed by SIGKILL)"}
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    detail = lines[-1][:200] if lines else ""
    return {**entry, "status": f"error: worker exited with status {proc.returncode} {detail}".strip()}


def measure_graphs(names: list[str], out_arg: str | None, run_one, out_path, prog: str) -> list[tuple[dict, Path]]:
    """Runs ``run_one(name)`` for each graph and writes each result document as
    JSON to ``--out`` (a file for one graph, else a directory where
    ``out_path(doc, directory)`` names the file; default the current directory)."""
    out = Path(out_arg) if out_arg else Path.cwd()
    if len(names) > 1 and out.suffix == ".json":
        raise SystemExit(f"{prog}: --out must be a directory when several graphs are measured")
    docs = []
    for name in names:
        doc = run_one(name)
        path = out if out.suffix == ".json" else out_path(doc, out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1) + "\n")
        docs.append((doc, path))
    return docs


def read_results(files: list[str]) -> list[tuple[dict, Path]]:
    """The result documents of ``--from-json`` files with their paths."""
    return [(json.loads(Path(f).read_text()), Path(f)) for f in files]


def print_results(docs: list[tuple[dict, Path]], format_table) -> None:
    for doc, path in docs:
        print(format_table(doc))
        print(f"-> {path}\n")


def worker_main(spec_path: str) -> int:
    """Subprocess entry: measure the backend described in a spec JSON, write the result JSON."""
    spec = json.loads(Path(spec_path).read_text())
    settings = spec["settings"]
    torch.set_num_threads(settings["threads"])
    graph = torch.load(spec["graph_file"])
    ctx = build_context(graph, settings)
    backend = bb.Backend(spec["backend"]["name"], spec["backend"]["family"], spec["backend"]["alpha"])
    refs = {key: tuple(value) for key, value in spec["refs"].items()}
    entry = measure_backend(backend, ctx, settings, refs, guard_memory=True)
    Path(spec["result_file"]).write_text(json.dumps(entry))
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1]))
