"""The captured step and the host share of ``nt-kernels bench --layer`` (issue 41).

After a variant's timed eager steps, on CUDA:

* **host share**: one eager step under ``torch.profiler``; the sum of its
  GPU kernels' device time is ``kernel_ms``, and ``host_ms = step_ms -
  kernel_ms`` is the part of the step that no kernel covers (Python,
  launches, syncs: what a CUDA graph removes); ``host_share = host_ms /
  step_ms``;
* **captured step**: the same step in a :class:`~nt_kernels.train.CapturedStep`
  (the whole step in one CUDA graph, fused capturable Adam), ``repeats``
  timed replays (``step_ms``, median), with the summed kernel time of one
  profiled replay and the host share that is left.

Both variants use ``torch.optim.Adam(fused=True, capturable=True)`` on CUDA,
so the eager and the captured step differ only by the capture.  On the CPU
neither exists (the host runs the kernels; no CUDA graphs): the entries say so
(``status``) and nothing is measured.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

__all__ = ["CPU_CAPTURE", "CPU_HOST_SHARE", "captured_step", "host_share", "kernel_ms", "make_optimizer",
           "optimizer_name"]

CPU_CAPTURE = "skipped: CUDA graphs need a CUDA device (the step ran on {device})"
CPU_HOST_SHARE = ("not available: the host share (step time minus summed kernel time) needs a GPU's kernel times; "
                  "on the {device} the host runs the kernels itself")


def make_optimizer(model: torch.nn.Module, lr: float, device: torch.device) -> torch.optim.Optimizer:
    """Adam: fused and capturable on CUDA (what a captured step needs, for both variants), torch's default
    elsewhere."""
    if device.type == "cuda":
        return torch.optim.Adam(model.parameters(), lr=lr, fused=True, capturable=True)
    return torch.optim.Adam(model.parameters(), lr=lr)


def optimizer_name(lr: float, device: torch.device) -> str:
    return f"Adam(lr={lr:g}, fused=True, capturable=True)" if device.type == "cuda" else f"Adam(lr={lr:g})"


def _sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def kernel_ms(run, device: torch.device) -> float:
    """Summed device time (ms) of the GPU kernels that ``run()`` launches, from one run under torch.profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        _sync(device)
    return sum(e.self_device_time_total for e in prof.key_averages() if e.device_type == DeviceType.CUDA) / 1e3


def host_share(step_ms: float, kernels: float) -> dict:
    """``kernel_ms``, ``host_ms`` (step minus kernels) and ``host_share`` (host_ms / step_ms)."""
    host = step_ms - kernels
    return {"kernel_ms": kernels, "host_ms": host, "host_share": host / step_ms if step_ms else None}


def eager_host_share(run, step_ms: float, device: torch.device) -> dict:
    """The eager step's host share (``status`` ok), or why it is not measured."""
    if device.type != "cuda":
        return {"status": CPU_HOST_SHARE.format(device=device.type)}
    try:
        return {"status": "ok", **host_share(step_ms, kernel_ms(run, device))}
    except Exception as exc:  # noqa: BLE001  (recorded; the variant's other results stand)
        return {"status": f"error: {type(exc).__name__}: {str(exc)[:300]}"}


def captured_step(model, optimizer, x, y, nodes, csr, autocast: bool, device: torch.device, repeats: int) -> dict:
    """``repeats`` timed replays of the whole step captured in a CUDA graph (module docstring); never raises."""
    if device.type != "cuda":
        return {"status": CPU_CAPTURE.format(device=device.type)}
    from nt_kernels.train import CapturedStep

    target = y if nodes is None else y.index_select(0, nodes)

    def loss_fn(out, target):
        return F.cross_entropy(out if nodes is None else out.index_select(0, nodes), target)

    try:
        step = CapturedStep(model, optimizer, loss_fn, autocast=torch.bfloat16 if autocast else None)
        loss = step(x, csr, target=target)
        runs = []
        for _ in range(repeats):
            tick = _sync(device)
            loss = step(x, csr, target=target)
            runs.append((_sync(device) - tick) * 1e3)
        entry = {"status": "ok", "step_ms_runs": runs, "step_ms": statistics.median(runs), "loss_last": float(loss)}
        entry.update(host_share(entry["step_ms"], kernel_ms(lambda: step(x, csr, target=target), device)))
        return entry
    except Exception as exc:  # noqa: BLE001  (a refused or failed capture is a result)
        return {"status": f"error: {type(exc).__name__}: {str(exc)[:400]}"}
