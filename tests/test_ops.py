"""Public ops on CPU: reference agreement, gradcheck, opcheck, torch.compile, edge cases, errors."""
import math

import pytest
import torch

import nt_kernels as nk
from helpers import assert_close, csr_of_sizes, packed, rowptr_of
from helpers import projection as random_projection
from nt_kernels import NeighbourhoodCSR
from nt_reference import ops as ref

M, DIM, HEADS = 6, 5, 2
THRESHOLD = nk.switch_threshold(M, DIM)  # 12.0 for m = 6, D = 5
N_STAR = math.floor(THRESHOLD)
SIZES = [0, 1, 2, N_STAR, N_STAR + 1, 0, 3, 40]  # empty, one row, threshold, threshold + 1, a tail


def make_inputs(sizes, heads=HEADS, dim=DIM, dtype=torch.float64, seed=0, requires_grad=False):
    """q, k, v, rowptr and an (M, dim) projection for segments of the given sizes."""
    rowptr = rowptr_of(sizes)
    q, k, v = packed(int(rowptr[-1]), heads, dim, dtype=dtype, seed=seed, requires_grad=requires_grad)
    return q, k, v, rowptr, random_projection(M, dim, dtype=dtype, seed=seed + 1)


OPS = {
    "softmax": (lambda q, k, v, r, p: nk.segment_softmax_attention(q, k, v, r),
                lambda q, k, v, r, p: ref.segment_softmax_attention(q, k, v, r)),
    "performer": (lambda q, k, v, r, p: nk.segment_performer_attention(q, k, v, r, p),
                  lambda q, k, v, r, p: ref.segment_performer_attention(q, k, v, r, p)),
    "switch": (lambda q, k, v, r, p: nk.neighbourhood_attention(q, k, v, r, projection=p),
               lambda q, k, v, r, p: ref.neighbourhood_attention(q, k, v, r, projection=p)),
}


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_forward_and_gradients_match_reference(name, dtype):
    """Output and gradients against the loop reference in float64 on the same (rounded) inputs."""
    ours, theirs = OPS[name]
    q, k, v, rowptr, proj = make_inputs(SIZES, dtype=dtype, requires_grad=True)
    grad_o = packed(q.shape[0], HEADS, DIM, count=1, dtype=dtype, seed=7)[0]
    out = ours(q, k, v, rowptr, proj)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = theirs(*leaves, rowptr, proj.double())
    assert_close(out, expected.detach(), msg="o")
    got = torch.autograd.grad(out, (q, k, v), grad_o)
    want = torch.autograd.grad(expected, leaves, grad_o.double())
    for label, g, w in zip(("dq", "dk", "dv"), got, want):
        assert_close(g, w, msg=label)


GRADCHECK_OPS = {
    "softmax": lambda q, k, v, r, p: nk.segment_softmax_attention(q, k, v, r),
    "performer": lambda q, k, v, r, p: nk.segment_performer_attention(q, k, v, r, p, eps=0.0),
    "switch": lambda q, k, v, r, p: nk.neighbourhood_attention(q, k, v, r, projection=p, threshold=2,
                                                               eps=0.0),
}


@pytest.mark.parametrize("name", list(GRADCHECK_OPS))
def test_gradcheck(name):
    # The Performer stabilisers are constants for autograd (DESIGN §4).  With
    # eps = 0 they cancel exactly from the output, so finite differences see the
    # same function autograd differentiates; eps > 0 is covered against the
    # reference above.
    op = GRADCHECK_OPS[name]
    q, k, v, rowptr, projection = make_inputs([0, 1, 3, 5], heads=2, dim=3, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v: op(q, k, v, rowptr, projection), (q, k, v))


def test_switch_threshold_boundaries():
    q, k, v, rowptr, projection = make_inputs([3, 4, 5])
    for threshold, expect in ((4, ["exact", "exact", "performer"]), (3.5, ["exact", "performer", "performer"]),
                              (0, ["performer"] * 3), (math.inf, ["exact"] * 3)):
        out = nk.neighbourhood_attention(q, k, v, rowptr, projection=projection, threshold=threshold)
        exact = ref.segment_softmax_attention(q, k, v, rowptr)
        performer = ref.segment_performer_attention(q, k, v, rowptr, projection)
        for s, kind in enumerate(expect):
            rows = slice(int(rowptr[s]), int(rowptr[s + 1]))
            torch.testing.assert_close(out[rows], (exact if kind == "exact" else performer)[rows])


def test_csr_and_rowptr_give_the_same_result():
    edge_index = torch.randint(0, 12, (2, 80), generator=torch.Generator().manual_seed(4))
    csr = NeighbourhoodCSR.from_edge_index(edge_index, 12)
    q, k, v, _, projection = make_inputs([80])
    a = nk.neighbourhood_attention(q, k, v, csr, projection=projection, threshold=7)
    b = nk.neighbourhood_attention(q, k, v, csr.rowptr.int(), projection=projection, threshold=7)
    assert torch.equal(a, b)


def test_non_contiguous_inputs():
    q, k, v, rowptr, projection = make_inputs(SIZES)
    qt, kt, vt = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert not qt.is_contiguous()
    torch.testing.assert_close(nk.neighbourhood_attention(qt, kt, vt, rowptr, projection=projection),
                               nk.neighbourhood_attention(q, k, v, rowptr, projection=projection))


@pytest.mark.parametrize("name", list(OPS))
def test_empty_graph(name):
    ours, _ = OPS[name]
    q, k, v, rowptr, projection = make_inputs([], requires_grad=True)
    out = ours(q, k, v, rowptr, projection)
    assert out.shape == (0, HEADS, DIM)
    out.sum().backward()
    assert q.grad.shape == (0, HEADS, DIM)
    isolated = make_inputs([0, 0, 0])
    assert ours(*isolated).shape == (0, HEADS, DIM)


@pytest.mark.parametrize("name", list(OPS))
def test_nan_stays_in_its_segment(name):
    """A NaN in v (segment 1, head 0, channel 0) makes that channel NaN on every row of segment 1 and
    changes nothing else: each other segment, and segment 1's other head and channels, equal the clean run."""
    ours, _ = OPS[name]
    q, k, v, rowptr, projection = make_inputs([4, 30, 5])
    clean = ours(q, k, v, rowptr, projection)
    v = v.clone()
    v[6, 0, 0] = float("nan")  # inside segment 1
    out = ours(q, k, v, rowptr, projection)
    assert torch.isnan(out[4:34, 0, 0]).all(), "segment 1 lost its NaN"
    assert torch.equal(out[4:34, 0, 1:], clean[4:34, 0, 1:]) and torch.equal(out[4:34, 1], clean[4:34, 1])
    for rows in (slice(0, 4), slice(34, 39)):
        assert torch.equal(out[rows], clean[rows]), f"the NaN reached rows {rows.start}..{rows.stop - 1}"


def _sample_args(dtype=torch.float64):
    q, k, v, rowptr, projection = make_inputs(SIZES, dtype=dtype, requires_grad=True)
    small, large = nk.csr.split_segments(rowptr, THRESHOLD)
    return [(q, k, v, rowptr, small, large, None, projection, DIM ** -0.5, 1e-4),
            (q, k, v, rowptr, torch.arange(len(SIZES)), large[:0], None, None, 0.3, 1e-4)]


@pytest.mark.parametrize("rows_covered", [False, True], ids=["zero-filled", "rows-covered"])
@pytest.mark.parametrize("case", [0, 1], ids=["switched", "exact-only"])
def test_opcheck(case, rows_covered):
    torch.library.opcheck(torch.ops.nt_kernels.attention_fwd.default, _sample_args()[case],
                          {"rows_covered": rows_covered})


@pytest.mark.parametrize("name", ["softmax", "performer"])
def test_fake_kernel_on_meta_tensors(name):
    ours, _ = OPS[name]
    q, k, v, rowptr, projection = (t.detach().to("meta") for t in make_inputs(SIZES))
    out = ours(q, k, v, rowptr, projection)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device.type == "meta"


@pytest.mark.parametrize("name", list(OPS))
def test_torch_compile_fullgraph(name):
    ours, _ = OPS[name]
    q, k, v, rowptr, projection = make_inputs(SIZES, dtype=torch.float32, requires_grad=True)
    csr_like = rowptr
    if name == "switch":
        csr_like = csr_of_sizes(SIZES)
        csr_like.segment_split(THRESHOLD)  # plans are built before compiling
    compiled = torch.compile(lambda q, k, v: ours(q, k, v, csr_like, projection), fullgraph=True,
                             backend="aot_eager")
    out = compiled(q, k, v)
    torch.testing.assert_close(out, ours(q, k, v, csr_like, projection))
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def _bad(**overrides):
    q, k, v, rowptr, projection = make_inputs([2, 3])
    args = dict(q=q, k=k, v=v, rowptr=rowptr, projection=projection)
    args.update(overrides)
    return args


BAD_INPUTS = [
    ("q-rank", _bad(q=torch.zeros(5, 4)), ValueError, r"q must have shape \(E, H, D\)"),
    ("k-shape", _bad(k=torch.zeros(5, 2, 4, dtype=torch.float64)), ValueError, "k must have q's shape"),
    ("v-dtype", _bad(v=torch.zeros(5, 2, 5, dtype=torch.float32)), ValueError, "v dtype torch.float32 does not"),
    ("int-q", _bad(q=torch.zeros(5, 2, 5, dtype=torch.int64)), ValueError, "q must be float16, bfloat16"),
    ("device", _bad(v=torch.zeros(5, 2, 5, dtype=torch.float64, device="meta")), ValueError, "v is on meta"),
    ("rowptr-dtype", _bad(rowptr=torch.tensor([0.0, 2.0, 5.0])), ValueError, "rowptr must be int32 or int64"),
    ("rowptr-2d", _bad(rowptr=torch.tensor([[0, 2, 5]])), ValueError, "rowptr must be 1-D"),
    ("rowptr-start", _bad(rowptr=torch.tensor([1, 2, 5])), ValueError, r"rowptr\[0\] must be 0"),
    ("rowptr-order", _bad(rowptr=torch.tensor([0, 4, 3, 5])), ValueError, "rowptr must be non-decreasing"),
    ("rowptr-end", _bad(rowptr=torch.tensor([0, 2, 4])), ValueError, r"rowptr\[-1\] must equal .* E = 5"),
    ("projection-width", _bad(projection=torch.zeros(6, 4, dtype=torch.float64)), ValueError,
     r"projection must have shape \(m, D\)"),
    ("projection-dtype", _bad(projection=torch.zeros(6, 5)), ValueError, "projection dtype torch.float32"),
    ("projection-grad", _bad(projection=torch.zeros(6, 5, dtype=torch.float64, requires_grad=True)),
     ValueError, "projection must not require grad"),
    ("head-dim", _bad(q=torch.zeros(5, 1, 300), k=torch.zeros(5, 1, 300), v=torch.zeros(5, 1, 300)),
     ValueError, r"head dim D must be in 1\.\.256"),
]


@pytest.mark.parametrize("args, error, match", [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_name_the_op_and_argument(args, error, match):
    with pytest.raises(error, match=f"neighbourhood_attention: {match}"):
        nk.neighbourhood_attention(args["q"], args["k"], args["v"], args["rowptr"],
                                   projection=args["projection"])


@pytest.mark.parametrize("kwargs, match", [
    (dict(threshold=-1), "threshold must be a non-negative number"),
    (dict(threshold="big"), "threshold must be a non-negative number"),
    (dict(projection=None, threshold=4), "a finite threshold .* needs a projection"),
], ids=["negative-threshold", "string-threshold", "threshold-without-projection"])
def test_bad_threshold(kwargs, match):
    q, k, v, rowptr, projection = make_inputs([2, 3])
    kwargs.setdefault("projection", projection)
    with pytest.raises(ValueError, match=match):
        nk.neighbourhood_attention(q, k, v, rowptr, **kwargs)


def test_csr_of_another_graph_is_rejected():
    q, k, v, _, projection = make_inputs([2, 3])
    csr = NeighbourhoodCSR.from_edge_index(torch.tensor([[0, 1], [1, 0]]))
    with pytest.raises(ValueError, match="segment_softmax_attention: csr has E = 2 packed rows but q has 5"):
        nk.segment_softmax_attention(q, k, v, csr)


# ------------------------------------------------------------ autocast, autograd hygiene
@pytest.mark.parametrize("name", list(OPS))
def test_autocast_cpu_bfloat16_runs_in_bfloat16(name):
    """Under CPU bf16 autocast, float32 q, k, v (and a float32 projection) run in bfloat16, like SDPA:
    the same result as the op on inputs cast by hand, and gradients reach the float32 leaves."""
    ours, _ = OPS[name]
    q, k, v, rowptr, projection = make_inputs(SIZES, dtype=torch.float32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ours(q, k, v, rowptr, projection)
    by_hand = ours(*(t.detach().bfloat16() for t in (q, k, v)), rowptr, projection.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, by_hand, atol=0, rtol=0)
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32 and torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0


def test_projection_changed_in_place_before_backward_raises():
    """The projection is saved for backward: changing it in place (e.g. reset_parameters redrawing a
    buffer) makes backward raise instead of returning gradients of another function."""
    q, k, v, rowptr, projection = make_inputs(SIZES, requires_grad=True)
    out = nk.neighbourhood_attention(q, k, v, rowptr, projection=projection)
    projection.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_backward_returns_only_the_gradients_asked_for():
    q, k, v, rowptr, projection = make_inputs(SIZES)
    q.requires_grad_(True)
    out = nk.neighbourhood_attention(q, k, v, rowptr, projection=projection)
    grads = out.grad_fn.apply(torch.ones_like(out), None)
    assert grads[0] is not None and grads[0].shape == q.shape
    assert all(g is None for g in grads[1:])


def test_head_dim_limit_is_the_extensions():
    """One head-dim limit: defined in C++ (csrc/ops/checks.h), exported as _C.MAX_HEAD_DIM, used by the
    Python checks; the C++ op enforces the same bound for direct torch.ops callers."""
    from nt_kernels import _C
    from nt_kernels.ops import _checks

    assert _checks.MAX_HEAD_DIM == _C.MAX_HEAD_DIM == 256
    rowptr = torch.tensor([0, 2])
    for dim, ok in ((_C.MAX_HEAD_DIM, True), (_C.MAX_HEAD_DIM + 1, False)):
        q = torch.randn(2, 1, dim)
        if ok:
            nk.segment_softmax_attention(q, q, q, rowptr)
            torch.ops.nt_kernels.attention_fwd(q, q, q, rowptr, torch.arange(1), torch.arange(0), None, None,
                                               1.0, 1e-4)
            continue
        with pytest.raises(ValueError, match=f"head dim D must be in 1..{_C.MAX_HEAD_DIM}, got {dim}"):
            nk.segment_softmax_attention(q, q, q, rowptr)
        with pytest.raises(RuntimeError, match=f"attention_fwd: head dim D must be in 1..{_C.MAX_HEAD_DIM}"):
            torch.ops.nt_kernels.attention_fwd(q, q, q, rowptr, torch.arange(1), torch.arange(0), None, None,
                                               1.0, 1e-4)
