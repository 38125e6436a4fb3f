"""C++ CPU kernels of the exact and Performer segment attention (issue 3).

The kernels are the four ``nt_kernels::*_into`` ops.  ``fused_forward`` /
``fused_backward`` call them the way the composite ``attention_fwd`` /
``attention_bwd`` does (zero-filled outputs, each segment list through its
kernel, both writing into the same tensors), and every number is compared with
the loop reference of ``nt_reference.ops`` and its autograd gradients.
"""
import functools
import math

import pytest
import torch

import nt_kernels  # noqa: F401  (loads the ops)
from helpers import TOLERANCE, assert_close, assert_low_precision, packed, projection, rowptr_of
from nt_kernels.performer import default_nb_features, orthogonal_random_features, switch_threshold
from nt_reference import ops as ref

OPS = torch.ops.nt_kernels
EPS = 1e-4
# Features per head capped so that thresholds (and the exact path's n^2) stay small for big D.
MAX_FEATURES = 48
FLOAT64_TOL = TOLERANCE[torch.float64]
HEADS = [1, 4]
HEAD_DIMS = [1, 8, 9, 23, 53, 64, 128]


def fused_forward(q, k, v, rowptr, exact, performer, projection, scale, eps=EPS):
    """Both lists through the composite op: zero-filled outputs, one pass per kernel."""
    return OPS.attention_fwd(q, k, v, rowptr, exact, performer, None, projection, scale, eps)


def fused_backward(grad_o, q, k, v, o, lse, rowptr, exact, performer, projection, scale, eps=EPS):
    return OPS.attention_bwd(grad_o, q, k, v, o, lse, rowptr, exact, performer, None, projection, scale, eps)


class Case:
    """Random packed q, k, v (float64) over segments of the given sizes, and a projection."""

    def __init__(self, sizes, heads, head_dim, *, seed=0, m=None):
        self.sizes = torch.tensor(sizes, dtype=torch.long)
        self.rowptr = rowptr_of(sizes)
        rows = int(self.rowptr[-1])
        self.q, self.k, self.v, self.grad_o = packed(rows, heads, head_dim, count=4, seed=seed)
        self.m = m or min(default_nb_features(head_dim), MAX_FEATURES)
        self.projection = projection(self.m, head_dim, seed=seed + 1)
        self.threshold = switch_threshold(self.m, head_dim)
        self.scale = head_dim**-0.5
        self.exact = torch.nonzero(self.sizes <= self.threshold).flatten()
        self.performer = torch.nonzero(self.sizes > self.threshold).flatten()

    def kernel(self, dtype):
        """Kernel output and gradients, with inputs rounded to dtype."""
        q, k, v, g, p = (t.to(dtype) for t in (self.q, self.k, self.v, self.grad_o, self.projection))
        o, lse = fused_forward(q, k, v, self.rowptr, self.exact, self.performer, p, self.scale)
        grads = fused_backward(g, q, k, v, o, lse, self.rowptr, self.exact, self.performer, p, self.scale)
        return (o, *grads)

    def reference(self, dtype, compute=None):
        """Loop reference output and autograd gradients, inputs rounded to dtype, math in ``compute``
        (default dtype), results in dtype."""
        compute = compute or dtype
        x = [t.to(dtype).to(compute).requires_grad_() for t in (self.q, self.k, self.v)]
        p = self.projection.to(dtype).to(compute)
        o = ref.neighbourhood_attention(*x, self.rowptr, projection=p, threshold=self.threshold, scale=self.scale)
        grads = torch.autograd.grad(o, x, self.grad_o.to(dtype).to(compute))
        return tuple(t.detach().to(dtype) for t in (o, *grads))


def mixed_sizes(threshold):
    """0, 1, small, threshold, threshold + 1, a long tail, in shuffled order."""
    t = int(threshold)
    return [3, 0, t + 1, 1, 60, t, 2, 0, 2 * t + 5, 7, 1]


NAMES = ("o", "dq", "dk", "dv")


@functools.lru_cache(maxsize=None)
def mixed_case(head_dim, heads):
    """The mixed-size case and its float64 reference, shared by the float64 and float32 tests."""
    m = min(default_nb_features(head_dim), MAX_FEATURES)
    case = Case(mixed_sizes(switch_threshold(m, head_dim)), heads, head_dim)
    return case, case.reference(torch.float64)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"H{h}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda d: f"D{d}")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_matches_reference(dtype, head_dim, heads):
    case, expected = mixed_case(head_dim, heads)
    assert case.exact.numel() and case.performer.numel()
    for name, got, want in zip(NAMES, case.kernel(dtype), expected):
        assert got.dtype == dtype
        assert_close(got, want, msg=name)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"H{h}")
@pytest.mark.parametrize("head_dim", [8, 23, 64], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_low_precision_within_twice_pytorch_error(dtype, head_dim, heads):
    """The accuracy rule (tests/helpers.py): error vs float64 at most 2x that of the loop reference
    run in the same dtype plus the dtype's floor, with the float32 baseline x eps ratio where the
    half-precision reference is not finite (float16 Performer gradients overflow) and the float32
    reference on the rounded inputs where those bounds exceed the cap."""
    m = min(default_nb_features(head_dim), MAX_FEATURES)
    case = Case(mixed_sizes(switch_threshold(m, head_dim)), heads, head_dim, seed=1)
    exact, low, float32 = case.reference(torch.float64), case.reference(dtype), case.reference(torch.float32)
    mixed = functools.cache(lambda: case.reference(dtype, compute=torch.float32))
    for i, (name, got, want, torch_low, torch_f32) in enumerate(zip(NAMES, case.kernel(dtype), exact, low, float32)):
        assert got.dtype == dtype and torch.isfinite(got).all(), name
        assert_low_precision(got, want, torch_low, torch_f32, msg=name, torch_mixed=lambda i=i: mixed()[i])


@pytest.mark.parametrize("path", ["exact", "performer"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_hub_segment(dtype, path):
    """A 2000-row hub among small segments, all through one path (the hub spans many work chunks)."""
    case = Case([2000, 3, 1, 0, 40], 2, 8, seed=2)
    all_segments = torch.arange(5)
    none = all_segments[:0]
    case.exact, case.performer = (all_segments, none) if path == "exact" else (none, all_segments)
    case.threshold = math.inf if path == "exact" else 0
    expected = case.reference(torch.float64)
    for name, got, want in zip(NAMES, case.kernel(dtype), expected):
        assert_close(got, want, msg=name)


def test_segment_lists_split_and_unlisted_rows_untouched():
    case = Case([5, 80, 0, 1, 50, 9, 120], 4, 8, seed=3)
    # Sizes 5, 1, 9 exact; 80, 120 Performer; 50 (and the empty one) in neither list, in any order.
    case.exact = torch.tensor([5, 0, 3])
    case.performer = torch.tensor([6, 1])
    o, dq, dk, dv = case.kernel(torch.float64)
    q, k, v, p = case.q, case.k, case.v, case.projection
    _, lse = fused_forward(q, k, v, case.rowptr, case.exact, case.performer, p, case.scale)
    rows = lambda s: slice(int(case.rowptr[s]), int(case.rowptr[s + 1]))  # noqa: E731
    for s in case.exact.tolist():
        want = ref.softmax_attention(q[rows(s)], k[rows(s)], v[rows(s)], case.scale)
        torch.testing.assert_close(o[rows(s)], want, rtol=FLOAT64_TOL, atol=FLOAT64_TOL)
        assert (lse[rows(s)] != 0).all()
    for s in case.performer.tolist():
        want = ref.performer_attention(q[rows(s)], k[rows(s)], v[rows(s)], p, EPS)
        torch.testing.assert_close(o[rows(s)], want, rtol=FLOAT64_TOL, atol=FLOAT64_TOL)
        assert (lse[rows(s)] == 0).all()
        assert (dq[rows(s)] != 0).all() and (dk[rows(s)] != 0).all() and (dv[rows(s)] != 0).all()
    unlisted = rows(4)
    for t in (o, dq, dk, dv, lse):
        assert (t[unlisted] == 0).all()


def run_all(case, dtype):
    q, k, v, g, p = (t.to(dtype) for t in (case.q, case.k, case.v, case.grad_o, case.projection))
    o, lse = fused_forward(q, k, v, case.rowptr, case.exact, case.performer, p, case.scale)
    return (o, lse, *fused_backward(g, q, k, v, o, lse, case.rowptr, case.exact, case.performer, p, case.scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["float32", "bfloat16", "float16"])
def test_bitwise_identical_across_threads_and_runs(dtype):
    # A 2500-row hub on each path (split over work chunks / Performer blocks) and many small segments.
    sizes = [2500, 1200] + [(7 * i) % 60 for i in range(300)]
    case = Case(sizes, 2, 16, seed=4)
    case.exact = torch.tensor([0] + list(range(2, len(sizes), 2)))
    case.performer = torch.tensor([1] + list(range(3, len(sizes), 2)))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run_all(case, dtype)
        torch.set_num_threads(2)
        first, second = run_all(case, dtype), run_all(case, dtype)
    finally:
        torch.set_num_threads(threads)
    for a, b, c in zip(single, first, second):
        assert torch.equal(a, b) and torch.equal(b, c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["float32", "bfloat16", "float16"])
def test_reruns_are_bitwise_identical(dtype):
    """Two runs of both kernels (forward and backward) on the mixed-size case give the same bits."""
    case, _ = mixed_case(8, 2)
    for name, a, b in zip(NAMES, case.kernel(dtype), case.kernel(dtype)):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("path", ["exact", "performer"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16],
                         ids=["float64", "float32", "bfloat16", "float16"])
def test_nan_stays_in_its_segment(dtype, path):
    """A NaN in one input row of an exact (q of segment 0) or Performer (k of segment 1) segment
    reaches that segment's outputs and gradients, and no other segment's (each compared with the
    clean run)."""
    case = Case([6, 90, 4, 70], 1, 8, seed=5)
    case.exact, case.performer = torch.tensor([0, 2]), torch.tensor([1, 3])
    clean = case.kernel(dtype)
    segment, tensor, row = (0, case.q, 0) if path == "exact" else (1, case.k, 6)
    tensor[row, 0, 0] = float("nan")
    dirty = case.kernel(dtype)
    bounds = case.rowptr.tolist()
    for name, a, b in zip(NAMES, clean, dirty):
        for s in range(len(bounds) - 1):
            rows = slice(bounds[s], bounds[s + 1])
            if s == segment:
                assert torch.isnan(b[rows]).any(), f"{name}: segment {s} lost its NaN"
            else:
                assert torch.equal(a[rows], b[rows]), f"{name}: the NaN reached segment {s}"


@pytest.mark.parametrize("rowptr", [[0], [0, 0, 0]], ids=["no-segments", "empty-segments"])
def test_empty_input(rowptr):
    rowptr = torch.tensor(rowptr, dtype=torch.long)
    segments = torch.arange(rowptr.numel() - 1)
    q = torch.zeros(0, 2, 8)
    p = orthogonal_random_features(16, 8)
    o, lse = fused_forward(q, q, q, rowptr, segments, segments, p, 0.5)
    grads = fused_backward(q, q, q, q, o, lse, rowptr, segments, segments, p, 0.5)
    assert o.shape == q.shape and lse.shape == (0, 2)
    assert all(g.shape == q.shape for g in grads)


BAD_INPUTS = {
    "segment-too-large": ([0, 2, 5], [0, 2], r"segments\[1\] = 2 is out of range"),
    "segment-negative": ([0, 2, 5], [-1], r"segments\[0\] = -1 is out of range"),
    "rowptr-first-not-zero": ([1, 2, 5], [0], r"rowptr\[0\] must be 0"),
    "rowptr-decreasing": ([0, 4, 3, 5], [0], r"rowptr must be non-decreasing"),
    "rowptr-last-not-E": ([0, 2, 4], [0], r"rowptr\[-1\] must equal E = 5"),
}


def call_op(op, rowptr, segments):
    q = torch.randn(5, 1, 4)
    rowptr, segments = torch.tensor(rowptr), torch.tensor(segments)
    z, lse, p = torch.zeros_like(q), torch.zeros(5, 1), torch.randn(3, 4)
    if op == "softmax_fwd_into":
        OPS.softmax_fwd_into(z, lse, q, q, q, rowptr, segments, None, 0.5)
    elif op == "softmax_bwd_into":
        OPS.softmax_bwd_into(z, z.clone(), z.clone(), q, q, q, q, q, lse, rowptr, segments, None, 0.5)
    elif op == "performer_fwd_into":
        OPS.performer_fwd_into(z, q, q, q, rowptr, segments, p, EPS)
    else:
        OPS.performer_bwd_into(z, z.clone(), z.clone(), q, q, q, q, rowptr, segments, p, EPS)


@pytest.mark.parametrize("bad", list(BAD_INPUTS), ids=str)
@pytest.mark.parametrize(
    "op", ["softmax_fwd_into", "softmax_bwd_into", "performer_fwd_into", "performer_bwd_into"]
)
def test_bad_input_names_op_and_argument(op, bad):
    rowptr, segments, message = BAD_INPUTS[bad]
    with pytest.raises(RuntimeError, match=f"{op}: {message}"):
        call_op(op, rowptr, segments)
