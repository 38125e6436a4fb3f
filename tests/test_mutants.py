"""Mutation harness (issue 32): faults injected into every kernel path are flagged by ``nt-kernels check``
and by the tests.

A fault replaces what one kernel path returns, at the op boundary (wrapping the Python attribute the
public ops, the check and the tests call through), in one dtype only:

* ``output zeroed``, ``output x 1.1``: the path's rows of the forward output (or the whole output);
* ``<gradient> zeroed``: one gradient, for each gradient of the path in turn;
* ``two segments swapped``: the outputs of the first two neighbouring segments (receivers) trade places;
* ``NaN into the next segment``: where a segment's output holds a NaN, the next segment's first row
  gets one too (a leak the NaN checks must see);
* ``nondeterministic rounding``: about half the output elements move by one unit in the last place,
  differently on every call.

A forward fault changes the output's value only; gradients still flow as from the true kernel (and
the backward kernel is untouched), so every fault is seen, or not, by itself.

Paths on every machine: the CPU exact and Performer kernels (``nt_kernels::attention_fwd`` /
``attention_bwd``, each fault limited to its own segment list), the CPU fused NT layer op
(``ntconv_fwd`` / ``ntconv_bwd``), and under TRITON_INTERPRET the Triton exact kernels
(``softmax_fwd_into`` / ``softmax_bwd_into``) and the Triton fused layer (``ntconv_op``).  With a GPU
also the CUDA Performer (``NT_KERNELS_PERFORMER=simt`` and ``tc``) and the compiled Triton kernels
(exact and fused layer) through the public ops.

For every fault, dtype (float32, bfloat16, float16) and head dim of the check (on CPU the dims of
CI's ``check --quick``, 1, 9 and 64, the fused layer's up to 64; on a GPU all of ``check.DIMS``), one
of the check's own rows for the path (its accuracy case, the determinism row, the NaN row; the check
runs the Triton paths only on a GPU) must report FAIL, and for every fault and dtype one of the path's
tests in that dtype must fail (tests/test_check.py has float16 at D = 53, the case of issue 32).  Both
sides first run clean, where everything must pass; a fault that leaves the right answer right (dq
zeroed where the Performer has one feature, see ``equivalent``) is not injected.  A fault is shown first to the detectors of its
kind (accuracy; determinism for the rounding; NaN containment for the leak) and the run stops at the
first one that flags it.  Under the Triton interpreter each distinct kernel call runs once: its clean
result is memoised by the call's inputs (the kernels are deterministic, which the tests check) and
the fault applied afterwards.  The tests' float64 / float32 / low-precision runs of the independent
reference (tests/test_ntconv.py ``reference_runs``: plain PyTorch, which no fault touches) are likewise
computed once per distinct input instead of once per fault.  Each path is one test per dtype for its
tests and one per head dim for its check rows (their memos and reference caches are per dtype and per
head dim, so nothing is computed twice, and pytest-xdist runs them side by side);
``conftest.py`` prints the count of caught faults after the run.
"""
from __future__ import annotations

import collections
import hashlib
import importlib
import inspect
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

import nt_kernels  # noqa: F401  (registers the ops)
from nt_kernels.apps import check, check_ntconv
from nt_kernels.apps.check_common import DTYPES, Settings, make_graph

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
DIMS = check.DIMS if HAS_CUDA else check.QUICK_DIMS
FORWARD_FAULTS = ("output zeroed", "output x 1.1", "two segments swapped", "NaN into the next segment",
                  "nondeterministic rounding")
ATTENTION_GRADS = ("dq", "dk", "dv")
NTCONV_GRADS = ("centre", "receiver_term", "edge_attr", "w_edge", "w_qkv", "b_qkv", "w_out", "b_out")
_calls = itertools.count()


# ------------------------------------------------------------------- faults
def corrupt(fault: str, t: torch.Tensor, groups) -> torch.Tensor:
    """A copy of ``t`` with a forward ``fault`` in the row ranges ``groups`` (non-empty, in row order)."""
    out = t.clone()
    if not groups:
        return out
    rows = torch.cat([torch.arange(a, b, device=t.device) for a, b in groups])
    if fault == "output zeroed":
        out[rows] = 0
    elif fault == "output x 1.1":
        out[rows] = t[rows] * 1.1
    elif fault == "two segments swapped" and len(groups) > 1:
        (a, a_end), (b, b_end) = groups[:2]
        n = min(a_end - a, b_end - b)
        out[a:a + n], out[b:b + n] = t[b:b + n], t[a:a + n]
    elif fault == "NaN into the next segment":
        poisoned = [bool(t[a:b].isnan().any()) for a, b in groups]
        for i in range(len(groups) - 1):
            if poisoned[i] and not poisoned[i + 1]:
                out[groups[i + 1][0]] = math.nan
    elif fault == "nondeterministic rounding":
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        gen = torch.Generator().manual_seed(next(_calls))
        flip = torch.randint(0, 2, out[rows].shape, generator=gen).to(t.device, bits)
        picked = out[rows]
        moved = (picked.view(bits) + flip).view(t.dtype)
        out[rows] = torch.where(torch.isfinite(picked) & (picked != 0), moved, picked)
    return out


class _Replace(torch.autograd.Function):
    """The value of ``bad`` with the gradient of ``good``: a forward fault that leaves backward alone."""

    @staticmethod
    def forward(ctx, good, bad):
        return bad.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def replace(good: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    return _Replace.apply(good, bad) if good.requires_grad else bad


def segment_groups(rowptr: torch.Tensor, segments: torch.Tensor):
    """Row ranges of the listed non-empty segments, in row order."""
    bounds = rowptr.tolist()
    return [(bounds[s], bounds[s + 1]) for s in sorted(segments.tolist()) if bounds[s + 1] > bounds[s]]


def node_groups(out: torch.Tensor):
    """One group per output row that holds anything (a receiver of messages)."""
    return [(i, i + 1) for i in (out.flatten(1) != 0).any(1).nonzero().flatten().tolist()]


@dataclass
class Injector:
    """The active fault (None: clean), the dtype it is limited to, and the clean forward outputs of
    faulty ones by id (a backward kernel gets the output the forward kernel saved, as in autograd)."""

    fault: str | None = None
    dtype: torch.dtype | None = None
    clean: dict = field(default_factory=dict)

    def keep_clean(self, faulty, clean) -> None:
        self.clean = {id(faulty): (faulty, clean)}  # holding faulty keeps its id from being reused

    def unfaulted(self, t):
        faulty, clean = self.clean.get(id(t), (None, None))
        return clean if faulty is t else t

    def forward(self, dtype) -> str | None:
        return self.fault if self.fault in FORWARD_FAULTS and dtype == self.dtype else None

    def gradient(self, dtype, names) -> int | None:
        if dtype != self.dtype or self.fault is None or not self.fault.endswith(" zeroed"):
            return None
        name = self.fault[:-len(" zeroed")]
        return names.index(name) if name in names else None


class Memo:
    """Clean results of deterministic kernel calls, by a digest of every argument (a small LRU)."""

    def __init__(self, size=48):
        self.size, self.store = size, collections.OrderedDict()

    @staticmethod
    def key(name, args, kwargs):
        h = hashlib.blake2b(name.encode(), digest_size=16)
        for a in [*args, *sorted(kwargs.items())]:
            if isinstance(a, torch.Tensor):
                h.update(f"{a.dtype}{tuple(a.shape)}{a.device}".encode())
                raw = a.detach().contiguous().cpu()
                h.update(raw.reshape(-1).view(torch.uint8).numpy().tobytes() if raw.numel() else b"")
            else:
                h.update(repr(a).encode())
        return h.digest()

    def call(self, name, fn, args, kwargs, outputs):
        """fn(*args, **kwargs) once per distinct input; ``outputs(args, result)`` lists the tensors
        the call produced (returned or written), which a repeat gets back."""
        key = self.key(name, args, kwargs)
        if key in self.store:
            self.store.move_to_end(key)
            result, saved = self.store[key]
            for dst, src in zip(outputs(args, result), saved):
                if dst is not None:
                    dst.copy_(src)
            return None if result is None else tuple(None if t is None else t.clone() for t in result)
        result = fn(*args, **kwargs)
        self.store[key] = (None if result is None else tuple(result),
                           [None if t is None else t.clone() for t in outputs(args, result)])
        if len(self.store) > self.size:
            self.store.popitem(last=False)
        return result


# ------------------------------------------------------------- patch points
def patch_attention(mp, inj: Injector, which: str) -> None:
    """Wrap ``torch.ops.nt_kernels.attention_fwd`` / ``attention_bwd``: the fault touches only the rows
    of the ``which`` ("exact" or "performer") segment list."""
    ops = torch.ops.nt_kernels
    fwd, bwd = ops.attention_fwd, ops.attention_bwd
    at = 4 if which == "exact" else 5

    def attention_fwd(*args, **kwargs):
        o, lse = fwd(*args, **kwargs)
        fault = inj.forward(args[0].dtype)
        if fault:
            o = replace(o, corrupt(fault, o.detach(), segment_groups(args[3], args[at])))
        return o, lse

    def attention_bwd(*args, **kwargs):
        grads = list(bwd(*args, **kwargs))
        i = inj.gradient(args[1].dtype, ATTENTION_GRADS)
        if i is not None:
            grads[i] = corrupt("output zeroed", grads[i], segment_groups(args[6], args[at + 3]))
        return tuple(grads)
    mp.setattr(ops, "attention_fwd", attention_fwd)
    mp.setattr(ops, "attention_bwd", attention_bwd)


def _ntconv_wrappers(inj: Injector, fwd, bwd, memo: Memo | None):
    def run(name, fn, args, kwargs):
        if memo is None:
            return fn(*args, **kwargs)
        return memo.call(name, fn, args, kwargs, lambda a, r: list(r))

    def ntconv_fwd(*args, **kwargs):
        inj.clean = {}
        out, lse, stats = run("ntconv_fwd", fwd, args, kwargs)
        fault = inj.forward(out.dtype)
        if fault:
            good, out = out, replace(out, corrupt(fault, out.detach(), node_groups(out.detach())))
            inj.keep_clean(out, good)
        return out, lse, stats

    def ntconv_bwd(*args, **kwargs):
        args = (args[0], inj.unfaulted(args[1]), *args[2:])
        grads = list(run("ntconv_bwd", bwd, args, kwargs))
        i = inj.gradient(args[0].dtype, NTCONV_GRADS)
        if i is not None and grads[i] is not None:
            grads[i] = torch.zeros_like(grads[i])
        return tuple(grads)
    return ntconv_fwd, ntconv_bwd


def patch_ntconv_op(mp, inj: Injector) -> None:
    """Wrap ``torch.ops.nt_kernels.ntconv_fwd`` / ``ntconv_bwd`` (the C++ kernels on CPU, Triton on CUDA)."""
    ops = torch.ops.nt_kernels
    fwd, bwd = _ntconv_wrappers(inj, ops.ntconv_fwd, ops.ntconv_bwd, None)
    mp.setattr(ops, "ntconv_fwd", fwd)
    mp.setattr(ops, "ntconv_bwd", bwd)


def patch_cuda_ntconv(mp, inj: Injector) -> None:
    """On CUDA, both entries of the Triton fused layer: the dispatcher (``patch_ntconv_op``; register_kernel
    holds the functions themselves) and ntconv_op's functions, which the chunked tests call directly
    (run_triton_chunked).  Each call passes one wrapper, so each fault is injected once."""
    from nt_kernels.backends.triton import ntconv_op

    patch_ntconv_op(mp, inj)
    fwd, bwd = _ntconv_wrappers(inj, ntconv_op.ntconv_fwd, ntconv_op.ntconv_bwd, None)
    mp.setattr(ntconv_op, "ntconv_fwd", fwd)
    mp.setattr(ntconv_op, "ntconv_bwd", bwd)


def patch_triton_ntconv(mp, inj: Injector, memo: Memo) -> None:
    """Wrap the Triton fused layer's functions (nt_kernels.backends.triton.ntconv_op), as the interpreter
    tests call them."""
    from nt_kernels.backends.triton import ntconv_op

    fwd, bwd = _ntconv_wrappers(inj, ntconv_op.ntconv_fwd, ntconv_op.ntconv_bwd, memo)
    mp.setattr(ntconv_op, "ntconv_fwd", fwd)
    mp.setattr(ntconv_op, "ntconv_bwd", bwd)


def patch_triton_exact(mp, inj: Injector, memo: Memo) -> None:
    """Wrap the Triton exact kernels (nt_kernels.backends.triton.register), as the interpreter tests call them."""
    import nt_kernels.backends.triton.register as ntt

    fwd, bwd = ntt.softmax_fwd_into, ntt.softmax_bwd_into

    def softmax_fwd_into(*args):
        inj.clean = {}
        memo.call("softmax_fwd_into", fwd, args, {}, lambda a, r: [a[0], a[1]])
        fault = inj.forward(args[0].dtype)
        if fault:
            inj.keep_clean(args[0], args[0].clone())
            args[0].copy_(corrupt(fault, args[0], segment_groups(args[5], args[6])))

    def softmax_bwd_into(*args):
        args = (*args[:7], inj.unfaulted(args[7]), *args[8:])
        memo.call("softmax_bwd_into", bwd, args, {}, lambda a, r: [a[0], a[1], a[2]])
        i = inj.gradient(args[0].dtype, ATTENTION_GRADS)
        if i is not None:
            args[i].copy_(corrupt("output zeroed", args[i], segment_groups(args[9], args[10])))
    mp.setattr(ntt, "softmax_fwd_into", softmax_fwd_into)
    mp.setattr(ntt, "softmax_bwd_into", softmax_bwd_into)


def memoise_references(mp, memo: Memo) -> None:
    """tests/test_ntconv.py's ``reference_runs`` (the reference's runs on one input, no kernel of ours among
    them) once per distinct input: the same result for the clean run and every fault."""
    import test_ntconv

    runs = test_ntconv.reference_runs

    def reference_runs(inp_lo, edge_index, kwargs, autocast, rule):
        key = Memo.key("reference_runs", (*inp_lo.tensors().values(), inp_lo.projection, inp_lo.heads, edge_index),
                       dict(kwargs, autocast=autocast, rule=rule))
        if key not in memo.store:
            memo.store[key] = runs(inp_lo, edge_index, kwargs, autocast, rule)
        return memo.store[key]
    mp.setattr(test_ntconv, "reference_runs", reference_runs)


# ---------------------------------------------------------------- detectors
# Each detector has a kind; a fault is first shown to the detectors of its kind (then to the others),
# so that a run stops at the first detector that flags it.
FAULT_KIND = {"nondeterministic rounding": "determinism", "NaN into the next segment": "nan"}


def _graph(s: Settings, name: str, sizes):
    if name not in s.graphs:
        s.graphs[name] = make_graph(sizes, s.device)
    return s.graphs[name]


def _attention_check(name: str, case: str, cases: dict):
    """The check's rows for one attention path, by kind: its accuracy case, determinism and NaN rows."""
    return {
        "accuracy": lambda s, dim, dtype: [check.accuracy(check.PATHS[name], case, _graph(s, case, cases[case]), dim,
                                                          dtype, s)],
        "determinism": lambda s, dim, dtype: [check.determinism_row(name, _graph(s, "mixed", check.MIXED), dim,
                                                                    dtype, s)],
        "nan": lambda s, dim, dtype: [check.nan_row(name, _graph(s, "mixed", check.MIXED), dim, dtype, s)],
    }


NTCONV_CHECK = {  # weighted_mean on both graphs (on the hub's, every receiver's output is about the same mean)
    "accuracy": lambda s, dim, dtype: (
        row for graph in reversed(check_ntconv.GRAPHS)
        for row in check_ntconv.accuracy_rows(graph, "weighted_mean", "receiver", dim, s, dtypes=(dtype,))),
    "determinism": lambda s, dim, dtype: check_ntconv.property_rows(dim, dtype, s),  # and the NaN row
}


def _tests(*entries):
    """{dtype name: [(kind, label, (module, function, args))]} from (kind, module, function, {dtype: [args]})."""
    table = collections.defaultdict(list)
    for kind, module, function, by_dtype in entries:
        for dtype, arg_lists in by_dtype.items():
            for args in arg_lists:
                table[dtype].append((kind, f"{module}::{function}{list(args)}", (module, function, args)))
    return table


def _every_dtype(args_of):
    """{dtype name: [args_of(dtype name)]} for the three dtypes."""
    return {d: [args_of(d)] for d in DTYPES}


def run_test(spec) -> None:
    """Call one test function of a test module (monkeypatch-taking tests get a fresh MonkeyPatch)."""
    module, function, args = spec
    fn = getattr(importlib.import_module(module), function)
    if "monkeypatch" in inspect.signature(fn).parameters:
        with pytest.MonkeyPatch.context() as mp:
            fn(*args, monkeypatch=mp)
    else:
        fn(*args)


F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
CPU_KERNEL_TESTS = [
    ("accuracy", "test_cpu_kernels", "test_matches_reference", {"float32": [(F32, 8, 1)]}),
    ("accuracy", "test_cpu_kernels", "test_low_precision_within_twice_pytorch_error", {"bfloat16": [(BF16, 8, 1)],
                                                                                      "float16": [(F16, 8, 1)]}),
    ("determinism", "test_cpu_kernels", "test_reruns_are_bitwise_identical", _every_dtype(lambda d: (DTYPES[d],))),
]
CPU_EXACT_TESTS = _tests(
    *CPU_KERNEL_TESTS,
    ("nan", "test_cpu_kernels", "test_nan_stays_in_its_segment", _every_dtype(lambda d: (DTYPES[d], "exact"))))
CPU_PERFORMER_TESTS = _tests(
    *CPU_KERNEL_TESTS,
    ("nan", "test_cpu_kernels", "test_nan_stays_in_its_segment", _every_dtype(lambda d: (DTYPES[d], "performer"))))
NTCONV_TESTS = _tests(
    ("accuracy", "test_ntconv", "test_low_precision_against_the_float64_reference",
     _every_dtype(lambda d: ("weighted_mean", "receiver", DTYPES[d], DTYPES[d], False))),
    ("determinism", "test_ntconv", "test_bitwise_identical_for_1_and_2_threads",
     _every_dtype(lambda d: ("weighted_mean", "receiver", DTYPES[d]))),
    ("nan", "test_ntconv", "test_nan_stays_in_its_neighbourhood_in_every_dtype", _every_dtype(lambda d: (DTYPES[d],))))
TRITON_EXACT_TESTS = _tests(
    ("accuracy", "test_triton", "test_segment_softmax_matches_reference", _every_dtype(lambda d: (9, DTYPES[d]))),
    ("determinism", "test_triton", "test_reruns_are_bitwise_identical", _every_dtype(lambda d: (DTYPES[d],))),
    ("nan", "test_triton", "test_nan_stays_in_its_segment", _every_dtype(lambda d: (DTYPES[d],))))
# The opt-in row blocks (NT_KERNELS_EXACT_BLOCKS=1, the path's env; the block tests set it too).
TRITON_BLOCK_TESTS = _tests(
    ("accuracy", "test_triton_blocks", "test_blocks_match_reference", _every_dtype(lambda d: (9, DTYPES[d]))),
    ("determinism", "test_triton", "test_reruns_are_bitwise_identical", _every_dtype(lambda d: (DTYPES[d],))),
    ("nan", "test_triton_blocks", "test_blocks_keep_nan_in_its_segment", {"float32": [(F32,)], "bfloat16": [(BF16,)]}),
    ("nan", "test_triton", "test_nan_stays_in_its_segment", {"float16": [(F16,)]}))
TRITON_NTCONV_TESTS = _tests(
    ("accuracy", "test_ntconv_triton", "test_matches_reference_with_edge_attr_and_dropout",
     {"float32": [("sum", "receiver")]}),
    ("accuracy", "test_ntconv_triton", "test_half_precision_error_at_most_twice_pytorchs", {
        "bfloat16": [("weighted_mean", "centre", BF16, 5)], "float16": [("gated_sum", "receiver", F16, None)]}),
    ("determinism", "test_ntconv_triton", "test_same_seed_is_bitwise_reproducible_and_seeds_differ",
     _every_dtype(lambda d: (DTYPES[d],))),
    ("nan", "test_ntconv_triton", "test_nan_stays_in_its_neighbourhood",
     _every_dtype(lambda d: ("weighted_mean", "receiver", DTYPES[d]))))
# The streaming design (NT_KERNELS_NTCONV_RECOMPUTE=stream, the path's env): its kernels in every dtype (forced onto
# fp32 operands), with edge features (the input gradients stored) and without (all three streaming kernels).
TRITON_STREAM_TESTS = _tests(
    ("accuracy", "test_ntconv_stream", "stream_float32_accuracy",
     {"float32": [("gated_sum", "receiver", True), ("sum", "receiver", False)]}),
    ("accuracy", "test_ntconv_stream", "test_stream_design_bf16_every_aggregator",
     {"bfloat16": [("gated_sum", "receiver", True), ("mean", "receiver", False)]}),
    ("accuracy", "test_ntconv_triton", "test_half_precision_error_at_most_twice_pytorchs",
     {"float16": [("gated_sum", "receiver", F16, None)]}),
    ("determinism", "test_ntconv_stream", "test_stream_same_seed_is_bitwise_reproducible",
     _every_dtype(lambda d: (DTYPES[d],))),
    ("nan", "test_ntconv_stream", "test_stream_nan_gradient_stays_in_its_neighbourhood",
     _every_dtype(lambda d: (DTYPES[d],))),
    ("nan", "test_ntconv_triton", "test_nan_stays_in_its_neighbourhood",
     _every_dtype(lambda d: ("gated_sum", "receiver", DTYPES[d]))))
# The fused layer's stored backward (16-bit parameters take the streaming design by default since the H200 run
# of 2026-11-28c; float32 ones the stored path either way).
STORED_ENV = {"NT_KERNELS_NTCONV_RECOMPUTE": "0"}
CUDA_PERFORMER_TESTS = {impl: _tests(
    ("accuracy", "test_performer_cuda", "test_forward_and_gradients_match_reference",
     _every_dtype(lambda d: (impl, d, 23, 72))),
    ("determinism", "test_performer_cuda", "test_deterministic_and_nan_stays_in_its_segment",
     _every_dtype(lambda d: (impl, d))),  # and NaN
) for impl in ("simt", "tc", "flash")}


@dataclass
class KernelPath:
    name: str
    patch: Callable            # patch(monkeypatch, injector, memo)
    gradients: tuple[str, ...]
    tests: dict
    check: dict | None = None      # kind -> rows(settings, dim, dtype name) of nt-kernels check
    dims: tuple[int, ...] = ()     # the head dims of those rows
    env: dict = field(default_factory=dict)

    @property
    def faults(self):
        return (*FORWARD_FAULTS, *(f"{g} zeroed" for g in self.gradients))


def _paths():
    exact_check = _attention_check("exact", "packed tiles, partial", check.EXACT_CASES)
    performer_check = _attention_check("performer", "chunk edges", check.PERFORMER_CASES)
    ntconv_dims = tuple(d for d in DIMS if d <= check_ntconv.MAX_DIM)
    if not HAS_CUDA:
        return [
            KernelPath("cpu exact", lambda mp, inj, memo: patch_attention(mp, inj, "exact"), ATTENTION_GRADS,
                       CPU_EXACT_TESTS, exact_check, DIMS),
            KernelPath("cpu performer", lambda mp, inj, memo: patch_attention(mp, inj, "performer"), ATTENTION_GRADS,
                       CPU_PERFORMER_TESTS, performer_check, DIMS),
            KernelPath("cpu ntconv", lambda mp, inj, memo: patch_ntconv_op(mp, inj), NTCONV_GRADS, NTCONV_TESTS,
                       NTCONV_CHECK, ntconv_dims),
            KernelPath("triton exact (interpreter)", patch_triton_exact, ATTENTION_GRADS, TRITON_EXACT_TESTS),
            KernelPath("triton exact blocks (interpreter)", patch_triton_exact, ATTENTION_GRADS, TRITON_BLOCK_TESTS,
                       env={"NT_KERNELS_EXACT_BLOCKS": "1"}),
            KernelPath("triton ntconv (interpreter)", patch_triton_ntconv, NTCONV_GRADS, TRITON_NTCONV_TESTS,
                       env=STORED_ENV),
            KernelPath("triton ntconv stream (interpreter)", patch_triton_ntconv, NTCONV_GRADS, TRITON_STREAM_TESTS,
                       env={"NT_KERNELS_NTCONV_RECOMPUTE": "stream"})]
    return [
        KernelPath("cuda exact (triton)", lambda mp, inj, memo: patch_attention(mp, inj, "exact"), ATTENTION_GRADS,
                   TRITON_EXACT_TESTS, exact_check, DIMS),
        KernelPath("cuda exact blocks (triton)", lambda mp, inj, memo: patch_attention(mp, inj, "exact"),
                   ATTENTION_GRADS, TRITON_BLOCK_TESTS, env={"NT_KERNELS_EXACT_BLOCKS": "1"}),
        *[KernelPath(f"cuda performer ({impl})", lambda mp, inj, memo: patch_attention(mp, inj, "performer"),
                     ATTENTION_GRADS, CUDA_PERFORMER_TESTS[impl], performer_check, DIMS,
                     {"NT_KERNELS_PERFORMER": impl}) for impl in ("simt", "tc", "flash")],
        KernelPath("cuda ntconv (triton)", lambda mp, inj, memo: patch_cuda_ntconv(mp, inj), NTCONV_GRADS,
                   TRITON_NTCONV_TESTS, NTCONV_CHECK, ntconv_dims, STORED_ENV),
        KernelPath("cuda ntconv stream (triton)", lambda mp, inj, memo: patch_cuda_ntconv(mp, inj), NTCONV_GRADS,
                   TRITON_STREAM_TESTS, NTCONV_CHECK, ntconv_dims, {"NT_KERNELS_NTCONV_RECOMPUTE": "stream"})]


PATHS = _paths()


# -------------------------------------------------------------------- runs
def equivalent(path: KernelPath, fault: str, dim: int) -> bool:
    """Faults that leave the right answer right, so no check may flag them: with one random feature
    (the default m at D = 1) the Performer's o does not depend on q (phi(q) cancels from num / den),
    so dq is zero and zeroing it is no fault."""
    return "performer" in path.name and fault == "dq zeroed" and check.default_nb_features(dim) == 1


def _in_order(detectors, fault):
    """The detectors of the fault's kind first (None: clean, every detector)."""
    kind = FAULT_KIND.get(fault, "accuracy")
    return sorted(detectors, key=lambda d: d[0] != kind) if fault else list(detectors)


def flagged_by_check(path: KernelPath, s: Settings, dim: int, dtype: str, fault) -> str:
    """The first of the path's check rows that fails ("" if all pass)."""
    for _, rows in _in_order(path.check.items(), fault):
        for row in rows(s, dim, dtype):
            if row.status == "FAIL":
                return f"{row.case} ({row.worst}: {row.note or row.error})"
    return ""


def flagged_by_tests(path: KernelPath, dtype: str, fault) -> str:
    """The first of the path's tests in ``dtype`` that fails ("" if all pass)."""
    for _, label, spec in _in_order(path.tests[dtype], fault):
        try:
            run_test(spec)
        except Exception as exc:  # a failed assertion, or an error the fault provoked
            return f"{label}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
    return ""


def _parts(path: KernelPath) -> list[str]:
    """The path's tests in each dtype, then its check rows at each head dim: one pytest case each."""
    return [*(f"tests-{dtype}" for dtype in DTYPES), *(f"check-D{dim}" for dim in path.dims if path.check is not None)]


CASES = [pytest.param(path, part, id=f"{path.name.replace(' ', '-')}-{part}") for path in PATHS for part in _parts(path)]


@pytest.mark.parametrize("path, part", CASES)
def test_every_injected_fault_is_flagged(path, part, monkeypatch, record_property):
    """Every fault on ``path`` (``part``: its tests in one dtype, or its check rows at one head dim in every
    dtype): clean runs pass, faulty ones fail."""
    start = time.perf_counter()
    for key, value in path.env.items():
        monkeypatch.setenv(key, value)
    inj, memo = Injector(), Memo()
    path.patch(monkeypatch, inj, memo)
    escaped, caught = [], 0
    if part.startswith("tests-"):
        memoise_references(monkeypatch, Memo())
        dtype_name = part.removeprefix("tests-")
        inj.fault, inj.dtype = None, DTYPES[dtype_name]
        clean = flagged_by_tests(path, dtype_name, None)
        assert not clean, f"{path.name}, {dtype_name}, no fault: a test fails already: {clean}"
        for fault in path.faults:
            inj.fault = fault
            if flagged_by_tests(path, dtype_name, fault):
                caught += 1
            else:
                escaped.append(f"tests, {dtype_name}: {fault}")
    else:
        dim = int(part.removeprefix("check-D"))
        s = Settings(DEVICE, path.dims, tuple(DTYPES), None, cached_cases=4)
        s.graphs = {}
        for dtype_name in DTYPES:
            inj.fault, inj.dtype = None, DTYPES[dtype_name]
            clean = flagged_by_check(path, s, dim, dtype_name, None)
            assert not clean, f"{path.name}, {dtype_name}, D={dim}, no fault: the check fails already: {clean}"
            for fault in (f for f in path.faults if not equivalent(path, f, dim)):
                inj.fault = fault
                if flagged_by_check(path, s, dim, dtype_name, fault):
                    caught += 1
                else:
                    escaped.append(f"check, {dtype_name}, D={dim}: {fault}")
    record_property("mutants_caught", caught)
    record_property("mutants_injected", caught + len(escaped))
    record_property("mutants_seconds", round(time.perf_counter() - start, 1))
    assert not escaped, f"{path.name}: {len(escaped)} injected faults not flagged: " + "; ".join(escaped)
