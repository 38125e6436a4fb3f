"""``nt-kernels check``: every kernel path against the pure-PyTorch reference.

Runs the public ops (exact, Performer and switchable attention) on built-in
graphs whose segment sizes reach every scheduling branch of the kernels:
packed tiles filled exactly and partly, single-segment tiles, multi-tile
segments, empty and one-row segments, a 20,000-row hub through the
Performer, segments one row below, at and above the switch threshold, and
the switchable op on the tolokers graph when its npz file is found
(``--data-root`` or ``$NT_KERNELS_DATA``).  Head dims 1..256, float32,
bfloat16 and float16; the forward output and all three gradients.

Accuracy rule (every dtype; nt_kernels/apps/tolerance.py, docs/design.md §4):
the kernel's max error against the float64 reference is at most twice the
error of the same reference run in the test dtype, plus a floor of about two
units in the last place of the dtype times max |reference|.  Where that
low-precision PyTorch baseline is not finite, or its error exceeds the float32
baseline's error times eps(dtype) / eps(float32) (8,192 for float16, 65,536
for bfloat16) by more than 4x (float16 PyTorch overflows in the reference
Performer at large head dims, or computes its features too coarsely to say
anything), the latter is the baseline error; the tolerance is then marked "*"
in the table.  Every bound is at most 10 % of max |reference|: a row whose
honest bound is above that fails and says why.  Besides: two runs are bitwise
identical, and a NaN in one key row reaches only its own segment and head
(both for every head dim and dtype of the run).

Prints a table (path, case, dtype, D, worst output, max error, tolerance,
result, largest bound / max |reference|, seconds spent on the row) as each row is computed and exits with
status 1 when a check fails.  ``--quick`` runs a subset (head dims 1, 9, 64;
float32 and bfloat16) for CI.  ``--kernels-only`` runs every row's kernel
calls (forward and backward) without the references or verdicts (rows read
"skip"): it compiles exactly the Triton kernels a check launches, e.g. to
fill Triton's cache ahead (scripts/gpu/gpu_triton.py warm).
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

import torch

import nt_kernels
from nt_kernels import NeighbourhoodCSR, default_nb_features
from nt_kernels._extension import cpu_paths
from nt_kernels.apps.check_common import (DTYPES, LOW_PRECISION, Graph, Row, Settings, cached_reference,
                                          differing_elements, forward_backward, make_graph, make_inputs, verdict)
from nt_kernels.apps.check_ntconv import ntconv_suite
from nt_kernels.apps.tolerance import BASELINE_FACTOR, CAP
from nt_reference import ops as ref

DIMS = (1, 8, 9, 23, 53, 64, 128, 256)
QUICK_DIMS = (1, 9, 64)
QUICK_DTYPES = ("float32", "bfloat16")
HEADS = 2
EPS = 1e-4
HUB = 20_000
HUB_MAX_DIM = 64          # the hub's float64 reference holds (HUB, H, m) feature maps
THRESHOLD = 40            # explicit switch threshold of the "threshold +- 1" case
DEFAULT_THRESHOLD_MAX_DIM = 64  # segments around the default n* stay small enough to check
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


def accuracy(path: Path, case: str, graph: Graph, dim: int, dtype_name: str, s: Settings, *,
             heads: int = HEADS, m: int | None = None, threshold: float | None = None) -> Row:
    """Kernel vs float64 reference under the accuracy rule (o, dq, dk, dv)."""
    dtype = DTYPES[dtype_name]
    m = (m or default_nb_features(dim)) if path.needs_projection else None
    key = (path.name, case, id(graph), dim, heads, m, threshold)
    (q, k, v, grad_o), projection = cached_reference(
        s, key, "inputs", lambda _: make_inputs(sum(graph.sizes), heads, dim, m, s.device, s.seed + dim))

    def runner(fn, dt, compute=None):
        """fn's [o, dq, dk, dv] on the inputs in ``dt``, computed in ``compute`` (default ``dt``)."""
        compute = compute or dt
        p = None if projection is None else projection.to(dt).to(compute)
        return forward_backward(lambda q, k, v: fn(q, k, v, graph, p, threshold),
                                *(t.to(dt).to(compute) for t in (q, k, v, grad_o)))

    row = Row(path.name, case, dtype_name, dim)
    if s.kernels_only:
        runner(path.kernel, dtype)
        row.status, row.note = "skip", "kernels only"
        return row

    def compute(dt):  # a dtype, or ("mixed", dtype): in float32 on the dtype's inputs, rounded to it
        if isinstance(dt, tuple):
            return [t.to(dt[1]) for t in runner(path.reference, dt[1], torch.float32)]
        return runner(path.reference, dt)
    reference = lambda dt: cached_reference(s, key, dt, compute)  # noqa: E731
    exact, torch_low = reference(torch.float64), reference(dtype)
    torch_float32 = reference(torch.float32) if dtype in LOW_PRECISION else None
    mixed = lambda: reference(("mixed", dtype))  # noqa: E731
    return verdict(row, ("o", "dq", "dk", "dv"), runner(path.kernel, dtype), torch_low, exact, dtype, torch_float32,
                   mixed)


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


def _property_run(name: str, path: Path, graph: Graph, dim: int, dtype: torch.dtype, s: Settings):
    """(fn, [q, k, v, grad_o]) of a determinism or NaN row: the kernel on the MIXED graph in ``dtype``."""
    m = default_nb_features(dim) if path.needs_projection else None
    (q, k, v, grad_o), p = cached_reference(s, ("properties", id(graph), dim, m), "inputs",
                                            lambda _: make_inputs(sum(graph.sizes), HEADS, dim, m, s.device, s.seed))
    p = None if p is None else p.to(dtype)
    fn = lambda q, k, v: path.kernel(q, k, v, graph, p, 20.0 if name == "switch" else None)  # noqa: E731
    return fn, [t.to(dtype) for t in (q, k, v, grad_o)]


def determinism_row(name: str, graph: Graph, dim: int, dtype_name: str, s: Settings) -> Row:
    """Two runs of forward + backward of path ``name`` on ``graph`` (MIXED) are bitwise identical."""
    fn, args = _property_run(name, PATHS[name], graph, dim, DTYPES[dtype_name], s)
    differing = differing_elements(forward_backward(fn, *args), forward_backward(fn, *args))
    return Row(name, "bitwise determinism, 2 runs", dtype_name, dim, "o,dq,dk,dv", float(differing), 0.0,
               "pass" if differing == 0 else "FAIL", "differing elements")


def nan_row(name: str, graph: Graph, dim: int, dtype_name: str, s: Settings) -> Row:
    """A NaN in one key row (the 130-row segment of MIXED, head 0) changes only that segment's head-0
    outputs, which are NaN."""
    fn, (q, k, v, grad_o) = _property_run(name, PATHS[name], graph, dim, DTYPES[dtype_name], s)
    seg = MIXED.index(130)
    start, end = sum(MIXED[:seg]), sum(MIXED[:seg + 1])
    clean = forward_backward(fn, q, k, v, grad_o)
    k_nan = k.clone()
    k_nan[start + 17, 0, dim // 2] = float("nan")
    poisoned = forward_backward(fn, q, k_nan, v, grad_o)
    outside = torch.ones(q.shape[0], dtype=torch.bool, device=q.device)
    outside[start:end] = False
    bad = int((~torch.isnan(poisoned[0][start:end, 0])).sum())              # own segment, head 0: NaN
    bad += int((poisoned[0][start:end, 1] != clean[0][start:end, 1]).sum())  # other head unchanged
    for a, b in zip(poisoned, clean):                                       # other segments unchanged
        bad += int((a[outside] != b[outside]).sum())
    return Row(name, "NaN stays in its segment and head", dtype_name, dim, "o,dq,dk,dv", float(bad), 0.0,
               "pass" if bad == 0 else "FAIL", "elements changed outside / not NaN inside")


def determinism_suite(s: Settings) -> Iterator[Row]:
    """determinism_row for every path, head dim and dtype."""
    graph = make_graph(MIXED, s.device)
    for name in PATHS:
        for dim in s.dims:
            for dtype_name in s.dtypes:
                yield determinism_row(name, graph, dim, dtype_name, s)


def nan_suite(s: Settings) -> Iterator[Row]:
    """nan_row for every path, head dim and dtype."""
    graph = make_graph(MIXED, s.device)
    for name in PATHS:
        for dim in s.dims:
            for dtype_name in s.dtypes:
                yield nan_row(name, graph, dim, dtype_name, s)


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
# Marks of a tolerance not from the dtype's own PyTorch baseline (nt_kernels/apps/tolerance.py)
SUBSTITUTED = "*"  # the float32 baseline x eps ratio (the dtype's baseline was not finite or too coarse)
CONDITIONED = "^"  # float32 on the dtype's inputs (the other bounds were above the cap)


def format_row(r: Row) -> str:
    dim = "-" if r.dim is None else str(r.dim)
    mark = {"float32 x": SUBSTITUTED, "float32 on": CONDITIONED}.get(r.baseline[:len("float32 x")], " ")
    numbers = f"{r.error:10.3e} {r.tolerance:10.3e}{mark}" if r.status != "skip" else f"{'-':>10} {'-':>10} "
    cap = f"{r.bound_ratio:6.3f}" if r.status != "skip" and r.bound_worst else f"{'-':>6}"
    return (f"{r.path:<10} {r.case:<34} {r.dtype:<9} {dim:>4} {r.worst:<10} {numbers} {r.status:<6} {cap} "
            f"{r.seconds:6.1f}" + (f"  ({r.note})" if r.note and r.status != "pass" else ""))


def header() -> str:
    return (f"{'path':<10} {'case':<34} {'dtype':<9} {'D':>4} {'worst':<10} {'max error':>10} "
            f"{'tolerance':>10}  {'result':<6} {'bound':>6} {'s':>6}")


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
    baselines = {b[:len("float32 x")] for r in rows for b in (r.baseline, r.bound_baseline)}
    if "float32 x" in baselines:
        print(f"{SUBSTITUTED} tolerance from the float32 baseline's error x eps(dtype) / eps(float32): "
              f"the PyTorch baseline in the row's dtype was not finite or more than {BASELINE_FACTOR:g}x that")
    if "float32 on" in baselines:
        print(f"{CONDITIONED} tolerance from PyTorch in float32 on the dtype's inputs, rounded to the dtype: the other "
              f"bounds were above {CAP:.2f} x max|reference|")
    checked = [r for r in rows if r.bound_worst]
    if checked:
        top = max(checked, key=lambda r: r.bound_ratio)
        print(f"bound: the largest bound / max|reference| over the row's tensors (at most {CAP:.2f}); the largest is "
              f"{top.bound_ratio:.3f} ({top.path}, {top.case}, {top.dtype}, D={top.dim}, {top.bound_worst})")
    print(f"check: {len(rows)} checks, {len(rows) - len(failed) - len(skipped)} passed, {len(failed)} failed, "
          f"{len(skipped)} skipped in {time.perf_counter() - start:.0f} s on {s.device}: "
          f"{'FAILED' if failed else 'OK'}")
    write_json(True)
    return 1 if failed else 0
