"""Backends compared by ``nt-kernels bench`` and the pytest-benchmark suites.

Every backend computes the same packed (E, H, D) output from packed q, k, v:

* ``fused`` — ours, :func:`nt_kernels.neighbourhood_attention` on a
  :class:`NeighbourhoodCSR` whose segment split is built before timing;
* ``performer-simt``, ``performer-tc``, ``performer-flash`` — the same with the
  CUDA Performer path forced onto one implementation (``NT_KERNELS_PERFORMER``
  ``simt``, ``tc``: the tensor-core kernels of issue 27, ``flash``: the
  FlashAttention-2-style kernels of issue 39, bfloat16's default), so that one
  run times them side by side (CUDA only);
* ``performer-gemm`` — the yardstick: the same Performer math composed of library
  GEMMs (:mod:`nt_kernels.backends.performer_gemm`; grouped GEMMs, or ``bmm`` over
  padded chunks in float64), on graphs whose every segment takes the Performer
  path (``--subset performer``); every device;
* ``reference`` — the per-segment loop of :mod:`nt_reference.ops` (small graphs);
* the paper's strategies from :mod:`nt_kernels.baselines.strategies`: ``parallel``
  (one padded batch, exact attention everywhere), ``by-size`` (size split at the
  threshold, one padded batch per path), ``partitioned-<alpha>`` (size split +
  Algorithm 1) and ``sequential`` (one batch per distinct size);
* the peers of :mod:`nt_kernels.bench.peers`, what a user would write instead:
  ``pyg-pairs``, ``nested``, ``flex`` and ``varlen`` (exact attention everywhere) and the
  performer-pytorch ``FastAttention`` peers (graphs whose every segment takes
  the Performer path).

A backend's ``prepare(ctx)`` returns ``fn(q, k, v) -> o``; everything a backend
builds once per graph (plans, masks, compiled kernels) is built there, outside
the timed region.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from typing import Callable

import torch

from nt_kernels.bench import peers
from nt_kernels.bench.context import ALPHAS, STRATEGY_FAMILIES, Backend, Context

# The CUDA Performer implementation each performer-<kernels> backend forces (NT_KERNELS_PERFORMER).
PERFORMER_KERNELS = {"performer-simt": "simt", "performer-tc": "tc", "performer-flash": "flash"}

# Padded-tensor estimate: per padded row and head, c_d * D elements for the
# gathered q, k, v, their outputs and gradients, plus c_m * m Performer feature
# elements or c_l * L exact score elements (scores, probabilities, gradient).
EST_C_D, EST_C_M, EST_C_L = 8, 8, 3


def all_backends(alphas=ALPHAS) -> list[Backend]:
    """Every backend in table order: ours, the loop reference, the paper's strategies, the peers."""
    backends = [Backend("fused", "fused"), *(Backend(name, name) for name in PERFORMER_KERNELS),
                Backend("performer-gemm", "performer-gemm"), Backend("reference", "reference"),
                Backend("parallel", "parallel"), Backend("by-size", "by-size")]
    backends += [Backend(f"partitioned-{a:g}", "partitioned", float(a)) for a in alphas]
    backends += [Backend("sequential", "sequential"), *peers.peer_backends()]
    return backends


def select_backends(spec: str | None, alphas=ALPHAS) -> list[Backend]:
    """Backends named in a comma list (family names such as ``partitioned`` expand to every alpha)."""
    backends = all_backends(alphas)
    if not spec or spec == "all":
        return backends
    chosen = []
    for token in (t.strip() for t in spec.split(",") if t.strip()):
        hits = [b for b in backends if token in (b.name, b.family)]
        if not hits:
            raise ValueError(f"bench: unknown backend {token!r}; choose from "
                             f"{sorted({b.family for b in backends} | {b.name for b in backends})}")
        chosen += [b for b in hits if b not in chosen]
    return chosen


# ----------------------------------------------------------- padded groups
def padded_groups(backend: Backend, ctx: Context) -> list[tuple[int, int, bool]] | None:
    """(segments G, padded length L, performer?) of every batched call a strategy or padded peer makes, else None."""
    from nt_kernels.baselines.partition import partition_by_area

    if backend.is_peer:
        return peers.padded_groups(backend, ctx)

    sizes, counts = ctx.hist
    present = [(n, c) for n, c in zip(sizes, counts) if n > 0 and c > 0]
    if not present:
        return []
    if backend.family == "parallel":
        return [(sum(c for _, c in present), max(n for n, _ in present), False)]
    if backend.family == "by-size":
        groups = []
        for perf in (True, False):
            part = [(n, c) for n, c in present if (n > ctx.threshold) == perf]
            if part:
                groups.append((sum(c for _, c in part), max(n for n, _ in part), perf))
        return groups
    if backend.family == "sequential":
        return [(c, n, n > ctx.threshold) for n, c in present]
    if backend.family == "partitioned":
        plan = partition_by_area([n for n, _ in present], [c for _, c in present],
                                 alpha=backend.alpha, threshold=ctx.threshold)
        return [(g.count, g.hi, g.performer) for g in plan]
    return None


def padded_estimate_bytes(backend: Backend, ctx: Context) -> int | None:
    """Rough size of a strategy's padded tensors for one forward+backward (all groups live at once)."""
    groups = padded_groups(backend, ctx)
    if groups is None:
        return None
    item = torch.empty(0, dtype=ctx.dtype).element_size()
    m = max(ctx.nb_features, 1)
    total = 0
    for count, length, performer in groups:
        per_row = EST_C_D * ctx.head_dim + (EST_C_M * m if performer else EST_C_L * length)
        total += count * length * ctx.heads * per_row * item
    return total


# --------------------------------------------------------------- applicability
def skip_reason(backend: Backend, ctx: Context) -> str | None:
    """Why ``backend`` is not run on this graph and device (a ``skipped: ...`` / ``n/a: ...`` status)."""
    if backend.is_peer:
        reason = peers.skip_reason(backend, ctx)
        if reason is not None:
            return reason
    if backend.family in PERFORMER_KERNELS:
        if ctx.device.type != "cuda":
            return f"n/a: the CUDA Performer kernels ({PERFORMER_KERNELS[backend.family]}) need a CUDA device"
        if not ctx.has_performer_segments:
            return "n/a: no Performer-path segments"
    if backend.family == "performer-gemm":
        reason = gemm_not_applicable(ctx)
        if reason is not None:
            return reason
    if backend.family == "reference" and ctx.num_edges > ctx.reference_max_edges:
        return f"skipped: loop reference limited to E <= {ctx.reference_max_edges} (--reference-max-edges)"
    est = padded_estimate_bytes(backend, ctx)
    if est is not None and est > ctx.memory_cap_bytes:
        return f"skipped: est. {est / 1e9:.1f} GB > cap {ctx.memory_cap_bytes / 1e9:.1f} GB"
    return None


def forward_only_reason(backend: Backend, ctx: Context) -> str | None:
    """Why ``backend`` has no backward on this device (it is then measured forward only), else None."""
    if backend.is_peer:
        return peers.backward_unsupported(backend, ctx)
    return None


# --------------------------------------------------------------------- prepare
def prepare(backend: Backend, ctx: Context) -> Callable:
    """Build ``fn(q, k, v) -> o`` for ``backend`` with its per-graph state precomputed."""
    projection = ctx.projection if backend.semantics == "switch" else None
    threshold = ctx.threshold if backend.semantics == "switch" else math.inf
    rowptr = ctx.csr.rowptr
    if backend.family == "performer-gemm":
        return _prepare_gemm(ctx)
    if backend.family == "fused" or backend.family in PERFORMER_KERNELS:
        import nt_kernels

        _select_performer_kernels(backend.family)
        csr = ctx.csr
        csr.segment_split(threshold)
        return lambda q, k, v: nt_kernels.neighbourhood_attention(q, k, v, csr, projection=projection,
                                                                  threshold=threshold)
    if backend.family == "reference":
        from nt_reference import ops as ref

        return lambda q, k, v: ref.neighbourhood_attention(q, k, v, rowptr, projection=projection,
                                                           threshold=threshold)
    if backend.family in STRATEGY_FAMILIES:
        from nt_kernels.baselines import strategies

        if backend.family == "parallel":
            return lambda q, k, v: strategies.padded(q, k, v, rowptr)
        if backend.family == "by-size":
            return lambda q, k, v: strategies.padded(q, k, v, rowptr, projection=projection,
                                                     threshold=threshold)
        if backend.family == "sequential":
            return lambda q, k, v: strategies.sequential(q, k, v, rowptr, projection=projection,
                                                         threshold=threshold)
        alpha = backend.alpha
        return lambda q, k, v: strategies.partitioned(q, k, v, rowptr, projection=projection,
                                                      threshold=threshold, alpha=alpha)
    if backend.is_peer:
        return peers.prepare(backend, ctx)
    raise ValueError(f"bench: no backend family {backend.family!r}")


# NT_KERNELS_PERFORMER as set by the performer-<kernels> backends (read by the CUDA op at every call);
# fused restores the value it had, so an in-process run does not carry it over.
_PERFORMER_ENV = "NT_KERNELS_PERFORMER"
_performer_env_saved: list = []


def _select_performer_kernels(family: str) -> None:
    if family in PERFORMER_KERNELS:
        if not _performer_env_saved:
            _performer_env_saved.append(os.environ.get(_PERFORMER_ENV))
        os.environ[_PERFORMER_ENV] = PERFORMER_KERNELS[family]
    elif _performer_env_saved:
        old = _performer_env_saved.pop()
        if old is None:
            os.environ.pop(_PERFORMER_ENV, None)
        else:
            os.environ[_PERFORMER_ENV] = old


# ------------------------------------------------------------- performer-gemm
def gemm_not_applicable(ctx: Context) -> str | None:
    """Why the GEMM yardstick cannot run this bench: it computes the Performer path only."""
    if ctx.projection is None or math.isinf(ctx.threshold):
        return "n/a: exact mode (Performer-only backend)"
    if any(0 < n <= ctx.threshold and c > 0 for n, c in zip(*ctx.hist)):
        return "n/a: graph has exact-path segments (Performer-only backend; use --subset performer)"
    return None


def _prepare_gemm(ctx: Context) -> Callable:
    """The yardstick on this graph, with the plan the op switch takes (performer_gemm.make_plan)."""
    from nt_kernels.backends.performer_gemm import make_plan, performer_gemm

    projection, plan = ctx.projection, make_plan(ctx.csr.rowptr, ctx.heads, ctx.dtype)
    return lambda q, k, v: performer_gemm(q, k, v, plan, projection)


# ----------------------------------------------------------------- fused probe
_PROBE = """
import torch, nt_kernels
q = torch.randn(12, 2, 4, device={device!r}, requires_grad=True)
p = nt_kernels.orthogonal_random_features(4, 4, device={device!r})
o = nt_kernels.neighbourhood_attention(q, q, q, torch.tensor([0, 3, 12], device={device!r}),
                                       projection=p, threshold=5)
o.sum().backward()
assert torch.isfinite(o).all() and torch.isfinite(q.grad).all()
"""

_probe_cache: dict[str, str | None] = {}


def fused_unavailable(device: torch.device) -> str | None:
    """None if a tiny fused forward+backward runs on ``device`` (checked in a subprocess), else why not.

    A subprocess keeps a crashing extension (while a kernel is being rebuilt)
    from taking the benchmark or the test session down with it.
    """
    key = str(device)
    if key not in _probe_cache:
        proc = subprocess.run([sys.executable, "-c", _PROBE.format(device=key)], capture_output=True,
                              text=True, timeout=300)
        if proc.returncode == 0:
            _probe_cache[key] = None
        else:
            lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
            detail = lines[-1][:200] if lines else f"exit status {proc.returncode}"
            _probe_cache[key] = f"error: fused op unavailable on {key} ({detail})"
    return _probe_cache[key]
