"""``nt-kernels check``: every kernel path against the pure-PyTorch reference.

Runs the public ops (exact, Performer and switchable attention) on built-in
graphs whose segment sizes reach every scheduling branch of the kernels:
packed tiles filled exactly and partly, single-segment tiles, multi-tile
segments, empty and one-row segments, a 20,000-row hub through the
Performer, segments one row below, at and above the switch threshold, and
the switchable op on the tolokers graph when its npz file is found
(``--data-root`` or ``$NT_KERNELS_DATA``).  Head dims 1..256, float32,
bfloat16 and float16; the forward output and all three gradients.

Accuracy rule (every dtype): the kernel's max error against the float64
reference is at most twice the error of the same reference run in the test
dtype, plus a floor of about two units in the last place of the dtype times
max(1, max |reference|).  Where that low-precision PyTorch baseline is not
finite (float16 overflows in the reference Performer at large head dims),
its error is replaced by the float32 baseline's error times the ratio of
the two dtypes' machine epsilons (8,192 for float16, 65,536 for bfloat16);
the tolerance is then marked "*" in the table.  No tolerance is ever
infinite or NaN: if the float32 baseline is not finite either, the floor
alone is the tolerance.  Besides: two runs are bitwise identical, and a NaN
in one key row reaches only its own segment and head.

Prints a table (path, case, dtype, D, worst output, max error, tolerance,
result, seconds spent on the row) as each row is computed and exits with
status 1 when a check fails.  ``--quick`` runs a subset (head dims 1, 9, 64;
float32 and bfloat16) for CI.  ``--kernels-only`` runs every row's kernel
calls (forward and backward) without the references or verdicts (rows read
"skip"): it compiles exactly the Triton kernels a check launches, e.g. to
fill Triton's cache ahead (scripts/gpu_triton.py warm).
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

import torch

import nt_kernels
from nt_kernels import NeighbourhoodCSR, default_nb_features, orthogonal_random_features
from nt_kernels._extension import cpu_paths
from nt_reference import ops as ref

DIMS = (1, 8, 9, 23, 53, 64, 128, 256)
QUICK_DIMS = (1, 9, 64)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUICK_DTYPES = ("float32", "bfloat16")
# Absolute error floor of the accuracy rule, relative to max(1, max |reference|).
FLOOR = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
HEADS = 2
EPS = 1e-4
HUB = 20_000
HUB_MAX_DIM = 64          # the hub's float64 reference holds (HUB, H, m) feature maps
THRESHOLD = 40            # explicit switch threshold of the "threshold +- 1" case
DEFAULT_THRESHOLD_MAX_DIM = 64  # segments around the default n* stay small enough to check
PROPERTY_DIM = 23         # head dim of the determinism and NaN checks
TOLOKERS = ("tolokers", 4, 8)  # graph, heads, head dim of the real-graph check
CPU_REAL_GRAPH_NODES = 200     # on CPU the loop reference checks the first 200 centre nodes only

# Segment sizes per case.  Packed tiles hold T // n segments of size n (T = 16, 32, 64);
# segments above 64 rows are split into 64-row blocks.
EXACT_CASES = {
    "packed tiles, full": [2] * 16 + [4] * 8 + [8] * 6 + [16] * 3 + [32] * 2 + [64] * 2,
    "packed tiles, partial": [1] * 5 + [3] * 7 + [5] * 3 + [9] * 5 + [12, 24, 24, 33, 50],
    "single-segment tiles": [13, 16, 25, 32, 45, 64, 64],
    "multi-tile segments": [65, 100, 128, 129, 300, 1000],
    "empty and one-row segments": [0, 1, 0, 0, 1, 2, 0, 1],
}
PERFORMER_CASES = {
    "chunk edges": [0, 1, 2, 7, 37, 255, 256, 257, 0, 513, 1500, 3],
    "20,000-row hub": [3, HUB, 17],
}
MIXED = [0, 1, 3, 3, 5, 9, 12, 20, 64, 65, 130, 300, 0, 2]


@dataclass
class Row:
    """One line of the table."""

    path: str
    case: str
    dtype: str
    dim: int | None
    worst: str = ""
    error: float = 0.0
    tolerance: float = 0.0
    status: str = "pass"   # pass, FAIL or skip
    note: str = ""
    baseline: str = ""     # the PyTorch baseline of the tolerance: the dtype, or "float32 x <eps ratio>"
    seconds: float = 0.0   # wall time of the row (inputs, compiles, references, kernel)


@dataclass(frozen=True)
class Graph:
    sizes: tuple[int, ...]
    rowptr: torch.Tensor
    csr: NeighbourhoodCSR


@dataclass(frozen=True)
class Path:
    """A public op and its reference: both take (q, k, v, graph, projection, threshold)."""

    name: str
    kernel: Callable
    reference: Callable
    needs_projection: bool


PATHS = {
    "exact": Path(
        "exact",
        lambda q, k, v, g, p, t: nt_kernels.segment_softmax_attention(q, k, v, g.csr),
        lambda q, k, v, g, p, t: ref.segment_softmax_attention(q, k, v, g.rowptr), False),
    "performer": Path(
        "performer",
        lambda q, k, v, g, p, t: nt_kernels.segment_performer_attention(q, k, v, g.rowptr, p, eps=EPS),
        lambda q, k, v, g, p, t: ref.segment_performer_attention(q, k, v, g.rowptr, p, eps=EPS), True),
    "switch": Path(
        "switch",
        lambda q, k, v, g, p, t: nt_kernels.neighbourhood_attention(q, k, v, g.csr, projection=p, threshold=t,
                                                                    eps=EPS),
        lambda q, k, v, g, p, t: ref.neighbourhood_attention(q, k, v, g.rowptr, projection=p, threshold=t,
                                                             eps=EPS), True),
}


@dataclass
class Settings:
    device: torch.device
    dims: tuple[int, ...]
    dtypes: tuple[str, ...]
    data_root: str | None
    seed: int = 0
    kernels_only: bool = False
    # The last float64 reference (key, outputs): the dtypes of one case share it.
    reference: tuple = (None, None)


def make_graph(sizes, device) -> Graph:
    """A CSR whose segment s (centre node s) has sizes[s] rows."""
    sizes = torch.tensor(list(sizes), dtype=torch.long)
    centre = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
    edge_index = torch.stack([centre, torch.zeros_like(centre)]).to(device)
    csr = NeighbourhoodCSR.from_edge_index(edge_index, num_nodes=len(sizes))
    return Graph(tuple(sizes.tolist()), csr.rowptr, csr)


def make_inputs(rows: int, heads: int, dim: int, m: int | None, device, seed: int):
    """float64 q, k, v, grad_o on the device and a projection (or None)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(rows, heads, dim, generator=gen, dtype=torch.float64).to(device) for _ in range(4)]
    projection = None
    if m is not None:
        projection = orthogonal_random_features(m, dim, generator=gen, dtype=torch.float64).to(device)
    return tensors, projection


def forward_backward(fn: Callable, q, k, v, grad_o) -> list[torch.Tensor]:
    """[o, dq, dk, dv] of ``fn(q, k, v)`` for the cotangent grad_o."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o = fn(*leaves)
    o.backward(grad_o)
    return [o.detach()] + [t.grad for t in leaves]


def max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    diff = (got.double() - want).abs()
    return math.inf if not torch.isfinite(diff).all() else float(diff.max()) if diff.numel() else 0.0


def finite_scale(want: torch.Tensor) -> float:
    """max(1, max |want| over its finite elements): what the floor is relative to."""
    finite = want[torch.isfinite(want)]
    return max(1.0, float(finite.abs().max()) if finite.numel() else 0.0)


def tolerance(base_error: float, float32_error, dtype: torch.dtype, want: torch.Tensor) -> tuple[float, bool]:
    """(tolerance, substituted): 2 x the PyTorch baseline's error in ``dtype`` + the dtype's floor.

    ``float32_error`` (a number, or a function computing it) is used only when
    ``base_error`` is not finite: then the baseline error is the float32 one
    times eps(dtype) / eps(float32), or 0 (the floor alone) if that is not
    finite either.  The result is always finite."""
    substituted = not math.isfinite(base_error)
    if substituted:
        f32 = float32_error() if callable(float32_error) else float32_error
        ratio = torch.finfo(dtype).eps / torch.finfo(torch.float32).eps
        base_error = f32 * ratio if math.isfinite(f32) else 0.0
    return 2 * base_error + FLOOR[dtype] * finite_scale(want), substituted


def eps_ratio_label(dtype: torch.dtype) -> str:
    return f"float32 x {torch.finfo(dtype).eps / torch.finfo(torch.float32).eps:.0f}"


def verdict(row: Row, names, ours, torch_low, exact, dtype: torch.dtype, float32_run, *,
            same_dtype: bool = True) -> Row:
    """Fill ``row`` with the worst output of the accuracy rule.  ``float32_run()`` gives the
    reference's outputs in float32 (called only when the ``dtype`` baseline is not finite); an
    output of the wrong shape (or, with ``same_dtype``, not in ``dtype``) has an infinite error."""
    worst_ratio, f32 = -1.0, []

    def f32_error(i):
        if not f32:
            f32.append(float32_run())
        return max_error(f32[0][i], exact[i])
    row.baseline = str(dtype).replace("torch.", "")
    for i, (name, got, base, want) in enumerate(zip(names, ours, torch_low, exact)):
        tol, substituted = tolerance(max_error(base, want), lambda: f32_error(i), dtype, want)
        if substituted:
            row.baseline = eps_ratio_label(dtype)
        ok = got.shape == want.shape and (got.dtype == dtype or not same_dtype)
        err = max_error(got, want) if ok else math.inf
        ratio = err / tol if tol > 0 else (0.0 if err == 0 else math.inf)
        if ratio > worst_ratio:
            worst_ratio, row.worst, row.error, row.tolerance = ratio, name, err, tol
    row.status = "pass" if worst_ratio <= 1.0 else "FAIL"
    return row


def accuracy(path: Path, case: str, graph: Graph, dim: int, dtype_name: str, s: Settings, *,
             heads: int = HEADS, m: int | None = None, threshold: float | None = None) -> Row:
    """Kernel vs float64 reference under the 2x-PyTorch-error rule (o, dq, dk, dv)."""
    dtype = DTYPES[dtype_name]
    m = (m or default_nb_features(dim)) if path.needs_projection else None
    (q, k, v, grad_o), projection = make_inputs(sum(graph.sizes), heads, dim, m, s.device, s.seed + dim)

    def runner(fn, dt):
        p = None if projection is None else projection.to(dt)
        return forward_backward(lambda q, k, v: fn(q, k, v, graph, p, threshold),
                                *(t.to(dt) for t in (q, k, v, grad_o)))

    row = Row(path.name, case, dtype_name, dim)
    if s.kernels_only:
        runner(path.kernel, dtype)
        row.status, row.note = "skip", "kernels only"
        return row
    key = (path.name, case, id(graph), dim, heads, m, threshold)
    if s.reference[0] != key:
        s.reference = (None, None)  # free the previous case's tensors first
        s.reference = (key, runner(path.reference, torch.float64))
    exact = s.reference[1]
    torch_low = runner(path.reference, dtype)
    ours = runner(path.kernel, dtype)
    return verdict(row, ("o", "dq", "dk", "dv"), ours, torch_low, exact, dtype,
                   lambda: runner(path.reference, torch.float32))


# ----------------------------------------------------------------------- suites
def exact_suite(s: Settings) -> Iterator[Row]:
    for case, sizes in EXACT_CASES.items():
        graph = make_graph(sizes, s.device)
        for dim in s.dims:
            for dtype in s.dtypes:
                yield accuracy(PATHS["exact"], case, graph, dim, dtype, s)


def performer_suite(s: Settings) -> Iterator[Row]:
    for case, sizes in PERFORMER_CASES.items():
        graph = make_graph(sizes, s.device)
        hub = HUB in sizes
        for dim in s.dims:
            if hub and dim > HUB_MAX_DIM:
                continue
            for dtype in s.dtypes:
                yield accuracy(PATHS["performer"], case, graph, dim, dtype, s, heads=1 if hub else HEADS)


def switch_suite(s: Settings) -> Iterator[Row]:
    """Segments one below, at and one above the threshold take the right path."""
    explicit = make_graph([0, 1, THRESHOLD - 1, THRESHOLD, THRESHOLD + 1, THRESHOLD + 2, 300, 7], s.device)
    for dim in s.dims:
        for dtype in s.dtypes:
            yield accuracy(PATHS["switch"], f"threshold {THRESHOLD} +- 1", explicit, dim, dtype, s,
                           threshold=THRESHOLD)
        if dim <= DEFAULT_THRESHOLD_MAX_DIM:
            n_star = int(nt_kernels.switch_threshold(default_nb_features(dim), dim))
            graph = make_graph([n_star - 1, n_star, n_star + 1, 5], s.device)
            for dtype in s.dtypes:
                yield accuracy(PATHS["switch"], f"default n* = {n_star} +- 1", graph, dim, dtype, s)


def determinism_suite(s: Settings) -> Iterator[Row]:
    """Two runs of forward + backward are bitwise identical."""
    graph = make_graph(MIXED, s.device)
    for name, path in PATHS.items():
        for dtype_name in s.dtypes:
            dtype = DTYPES[dtype_name]
            m = default_nb_features(PROPERTY_DIM) if path.needs_projection else None
            (q, k, v, grad_o), p = make_inputs(sum(graph.sizes), HEADS, PROPERTY_DIM, m, s.device, s.seed)
            p = None if p is None else p.to(dtype)
            args = [t.to(dtype) for t in (q, k, v, grad_o)]
            fn = lambda q, k, v: path.kernel(q, k, v, graph, p, 20.0 if name == "switch" else None)  # noqa: E731
            first, second = forward_backward(fn, *args), forward_backward(fn, *args)
            differing = sum(int((a != b).sum()) - int((a.isnan() & b.isnan()).sum()) for a, b in zip(first, second))
            yield Row(name, "bitwise determinism, 2 runs", dtype_name, PROPERTY_DIM, "o,dq,dk,dv",
                      float(differing), 0.0, "pass" if differing == 0 else "FAIL", "differing elements")


def nan_suite(s: Settings) -> Iterator[Row]:
    """A NaN in one key row (segment `seg`, head 0) changes only that segment's head-0 outputs, which are NaN."""
    graph = make_graph(MIXED, s.device)
    seg = MIXED.index(130)
    start, end = sum(MIXED[:seg]), sum(MIXED[:seg + 1])
    for name, path in PATHS.items():
        dtype = DTYPES[s.dtypes[0]]
        m = default_nb_features(PROPERTY_DIM) if path.needs_projection else None
        (q, k, v, grad_o), p = make_inputs(sum(graph.sizes), HEADS, PROPERTY_DIM, m, s.device, s.seed)
        p = None if p is None else p.to(dtype)
        q, k, v, grad_o = (t.to(dtype) for t in (q, k, v, grad_o))
        fn = lambda q, k, v: path.kernel(q, k, v, graph, p, 20.0 if name == "switch" else None)  # noqa: E731
        clean = forward_backward(fn, q, k, v, grad_o)
        k_nan = k.clone()
        k_nan[start + 17, 0, 3] = float("nan")
        poisoned = forward_backward(fn, q, k_nan, v, grad_o)
        outside = torch.ones(q.shape[0], dtype=torch.bool, device=q.device)
        outside[start:end] = False
        bad = int((~torch.isnan(poisoned[0][start:end, 0])).sum())            # own segment, head 0: NaN
        bad += int((poisoned[0][start:end, 1] != clean[0][start:end, 1]).sum())  # other head unchanged
        for a, b in zip(poisoned, clean):                                     # other segments unchanged
            bad += int((a[outside] != b[outside]).sum())
        yield Row(name, "NaN stays in its segment and head", s.dtypes[0], PROPERTY_DIM, "o,dq,dk,dv",
                  float(bad), 0.0, "pass" if bad == 0 else "FAIL", "elements changed outside / not NaN inside")


def tolokers_suite(s: Settings) -> Iterator[Row]:
    """The switchable op on a real graph (default threshold and m)."""
    from nt_kernels.data import load_npz

    name, heads, dim = TOLOKERS
    try:
        data = load_npz(name, s.data_root, undirected=True)
    except FileNotFoundError as exc:  # no data root, or no npz file in it
        note = str(exc).split(";")[0]
        if "NT_KERNELS_DATA" not in note:
            note += " (--data-root or $NT_KERNELS_DATA)"
        yield Row("switch", f"{name} H={heads}", "-", dim, status="skip", note=note)
        return
    csr = NeighbourhoodCSR.from_edge_index(data.edge_index.to(s.device), num_nodes=data.num_nodes)
    case = f"{name} H={heads}"
    graph = Graph(tuple(torch.diff(csr.rowptr).tolist()), csr.rowptr, csr)
    if s.device.type == "cpu":  # its real segment sizes, but only as many as the CPU reference loop can afford
        graph = make_graph(graph.sizes[:CPU_REAL_GRAPH_NODES], s.device)
        case += f", first {CPU_REAL_GRAPH_NODES} nodes"
    for dtype in s.dtypes:
        yield accuracy(PATHS["switch"], case, graph, dim, dtype, s, heads=heads)


def ntconv_suite(s: Settings) -> Iterator[Row]:
    """The fused NT layer op (nt_kernels/apps/check_ntconv.py, imported here to keep imports one-way)."""
    from nt_kernels.apps.check_ntconv import ntconv_suite as suite

    return suite(s)


SUITES: dict[str, Callable[[Settings], Iterator[Row]]] = {
    "exact": exact_suite,
    "performer": performer_suite,
    "switch": switch_suite,
    "determinism": determinism_suite,
    "nan": nan_suite,
    "tolokers": tolokers_suite,
    "ntconv": ntconv_suite,
}


# ---------------------------------------------------------------------- command
SUBSTITUTED = "*"  # marks a tolerance from the float32 baseline (the dtype's baseline was not finite)


def format_row(r: Row) -> str:
    dim = "-" if r.dim is None else str(r.dim)
    mark = SUBSTITUTED if r.baseline.startswith("float32 x") else " "
    numbers = f"{r.error:10.3e} {r.tolerance:10.3e}{mark}" if r.status != "skip" else f"{'-':>10} {'-':>10} "
    return (f"{r.path:<10} {r.case:<34} {r.dtype:<9} {dim:>4} {r.worst:<10} {numbers} {r.status:<6} "
            f"{r.seconds:6.1f}" + (f"  ({r.note})" if r.note and r.status != "pass" else ""))


def header() -> str:
    return (f"{'path':<10} {'case':<34} {'dtype':<9} {'D':>4} {'worst':<10} {'max error':>10} "
            f"{'tolerance':>10}  {'result':<6} {'s':>6}")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("check", help="self-test: every kernel path against the PyTorch reference",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="device to check (default: cuda when available, else cpu)")
    p.add_argument("--quick", action="store_true", help="head dims 1, 9, 64 and float32 + bfloat16 only")
    p.add_argument("--dims", default=None, help="comma-separated head dims (default: all, or --quick's)")
    p.add_argument("--dtypes", default=None, help="comma-separated dtypes among float32, bfloat16, float16")
    p.add_argument("--suites", default=",".join(SUITES), help=f"comma-separated among {', '.join(SUITES)}")
    p.add_argument("--data-root", default=None, help="folder with tolokers.npz (default: $NT_KERNELS_DATA)")
    p.add_argument("--json", default=None, help="also write the rows and a summary to this JSON file")
    p.add_argument("--kernels-only", action="store_true",
                   help="run each row's kernel calls only: no references, no verdicts (rows read skip); "
                        "compiles the Triton kernels a check launches")
    p.set_defaults(func=run)
    return p


def settings_from(args: argparse.Namespace) -> Settings:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dims = tuple(int(d) for d in args.dims.split(",")) if args.dims else (QUICK_DIMS if args.quick else DIMS)
    dtypes = tuple(args.dtypes.split(",")) if args.dtypes else (QUICK_DTYPES if args.quick else tuple(DTYPES))
    for name in dtypes:
        if name not in DTYPES:
            raise ValueError(f"check: unknown dtype {name!r}; choose among {', '.join(DTYPES)}")
    for dim in dims:
        if not 1 <= dim <= 256:
            raise ValueError(f"check: head dims must be in 1..256, got {dim}")
    return Settings(device, dims, dtypes, args.data_root, kernels_only=getattr(args, "kernels_only", False))


def run(args: argparse.Namespace) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        print("check: --device cuda, but torch sees no CUDA device")
        return 2
    s = settings_from(args)
    suites = args.suites.split(",")
    unknown = [name for name in suites if name not in SUITES]
    if unknown:
        raise ValueError(f"check: unknown suite(s) {', '.join(unknown)}; choose among {', '.join(SUITES)}")
    name = torch.cuda.get_device_name(s.device) if s.device.type == "cuda" else platform.processor() or "cpu"
    paths = cpu_paths()
    print(f"nt-kernels {nt_kernels.__version__} check on {s.device} ({name}), torch {torch.__version__}; "
          f"head dims {','.join(map(str, s.dims))}; {', '.join(s.dtypes)}; "
          f"torch CPU capability {paths['torch_capability']}, nt_kernels CPU ISA path {paths['nt_kernels_isa']}")
    print(header())
    rows: list[Row] = []
    start = time.perf_counter()

    def write_json(finished: bool) -> None:
        # Rewritten after every row, so a run cut short still leaves what it checked.
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": str(s.device), "device_name": name, "torch": torch.__version__,
                           "torch_cpu_capability": paths["torch_capability"],
                           "nt_kernels_cpu_isa": paths["nt_kernels_isa"],
                           "nt_kernels": nt_kernels.__version__, "dims": s.dims, "dtypes": s.dtypes,
                           "suites": suites, "finished": finished, "seconds": round(time.perf_counter() - start, 1),
                           "ok": finished and all(r.status != "FAIL" for r in rows),
                           "rows": [asdict(r) for r in rows]}, f, indent=1)

    tick = start
    for suite in suites:
        for row in SUITES[suite](s):
            if s.kernels_only:  # the determinism and NaN suites compare kernel runs only: no verdict either
                row.status, row.note = "skip", "kernels only"
            row.seconds, tick = round(time.perf_counter() - tick, 2), time.perf_counter()
            rows.append(row)
            print(format_row(row), flush=True)
            write_json(False)
    failed = [r for r in rows if r.status == "FAIL"]
    skipped = [r for r in rows if r.status == "skip"]
    if any(r.baseline.startswith("float32 x") for r in rows):
        print(f"{SUBSTITUTED} tolerance from the float32 baseline's error x eps(dtype) / eps(float32): "
              "the PyTorch baseline in the row's dtype was not finite")
    print(f"check: {len(rows)} checks, {len(rows) - len(failed) - len(skipped)} passed, {len(failed)} failed, "
          f"{len(skipped)} skipped in {time.perf_counter() - start:.0f} s on {s.device}: "
          f"{'FAILED' if failed else 'OK'}")
    write_json(True)
    return 1 if failed else 0
