"""CUDA Performer kernel (csrc/cuda/segment_performer_*) against the loop reference.

Calls the composite ops directly with every segment on the Performer path:
``attention_fwd(q, k, v, rowptr, exact=empty, performer=all, None, P, scale, eps)`` and
``attention_bwd``.  Accuracy rule: the kernel's max error against the float64
reference is at most twice that of the same reference run in the test dtype
(plus a small floor relative to the output's magnitude).
"""
import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

if torch.cuda.is_available():
    import nt_kernels  # noqa: F401  (registers torch.ops.nt_kernels)
    from nt_kernels.performer import default_nb_features, orthogonal_random_features
    from nt_reference import ops as ref

EPS = 1e-4
HEADS = 2
HUB = 20_000
# empty, one row, chunk edges (255 / 256 / 257 / 513), a tail and a hub split over many blocks
SIZES = [0, 1, 2, 7, 37, 255, 256, 257, 0, 513, 1500, HUB, 3]
SMALL_SIZES = [0, 1, 5, 40, 300]
FLOOR = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def make_case(sizes, dim, dtype, heads=HEADS, seed=0, m=None):
    gen = torch.Generator().manual_seed(seed)
    rowptr = torch.tensor([0] + sizes).cumsum(0)
    e = int(rowptr[-1])
    q, k, v = (torch.randn(e, heads, dim, generator=gen, dtype=torch.float64) for _ in range(3))
    m = default_nb_features(dim) if m is None else m
    projection = orthogonal_random_features(m, dim, generator=gen, dtype=torch.float64)
    grad_o = torch.randn(e, heads, dim, generator=gen, dtype=torch.float64)
    dev = torch.device("cuda")
    return [t.to(dev) for t in (q, k, v, rowptr, projection, grad_o)]


def cast(case, dtype):
    """The float tensors of a case in `dtype`; rowptr stays int64."""
    return [t.to(dtype) if t.is_floating_point() else t for t in case]


def kernel_fwd_bwd(q, k, v, rowptr, projection, grad_o, segments=None):
    if segments is None:
        segments = torch.arange(rowptr.numel() - 1, device=q.device)
    none = torch.empty(0, dtype=torch.long, device=q.device)
    scale = q.shape[-1] ** -0.5
    ops = torch.ops.nt_kernels
    o, lse = ops.attention_fwd(q, k, v, rowptr, none, segments, None, projection, scale, EPS)
    grads = ops.attention_bwd(grad_o, q, k, v, o, lse, rowptr, none, segments, None, projection,
                              scale, EPS)
    return (o, *grads)


def reference_fwd_bwd(q, k, v, rowptr, projection, grad_o):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = ref.segment_performer_attention(q, k, v, rowptr.cpu(), projection, eps=EPS)
    grads = torch.autograd.grad(o, (q, k, v), grad_o)
    return (o.detach(), *grads)


def max_err(x, exact):
    return (x.double() - exact).abs().max().item()


def assert_within_twice_torch_error(case, dtype, label):
    """Kernel error vs float64 <= 2 x (reference in `dtype` vs float64) + floor."""
    exact = reference_fwd_bwd(*case)
    low = cast(case, dtype)
    torch_low = reference_fwd_bwd(*low)
    ours = kernel_fwd_bwd(*low)
    for name, got, base, want in zip(["o", "dq", "dk", "dv"], ours, torch_low, exact):
        assert got.dtype == dtype and got.shape == want.shape, name
        assert torch.isfinite(got).all(), f"{name}: non-finite values ({label})"
        bound = 2 * max_err(base, want) + FLOOR[dtype] * max(1.0, want.abs().max().item())
        err = max_err(got, want)
        assert err <= bound, f"{name}: error {err:.3e} > bound {bound:.3e} ({label})"


@pytest.mark.parametrize("dim", [8, 9, 23, 53, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["float32", "bfloat16", "float16"])
def test_forward_and_gradients_match_reference(dim, dtype):
    case = make_case(SIZES, dim, torch.float64)
    assert_within_twice_torch_error(case, dtype, f"D={dim}, {dtype}")


@pytest.mark.parametrize("dim, m", [(1, 1), (4, 3), (16, 300), (100, 40), (256, 20)])
def test_unusual_dims_and_feature_counts(dim, m):
    """Head dims 1..256 and feature counts that need several tiles or passes."""
    case = make_case(SMALL_SIZES, dim, torch.float64, m=m)
    assert_within_twice_torch_error(case, torch.float32, f"D={dim}, m={m}")


def test_only_listed_segments_are_written():
    case = cast(make_case(SMALL_SIZES, 8, torch.float64), torch.float32)
    q, rowptr = case[0], case[3]
    listed = torch.tensor([2, 4], device=q.device)
    outs = kernel_fwd_bwd(*case, segments=listed)
    full = kernel_fwd_bwd(*case)
    bounds = rowptr.tolist()
    rows = torch.zeros(q.shape[0], dtype=torch.bool, device=q.device)
    for s in listed.tolist():
        rows[bounds[s]:bounds[s + 1]] = True
    for got, want in zip(outs, full):
        assert (got[~rows] == 0).all()
        torch.testing.assert_close(got[rows], want[rows], rtol=0, atol=0)


def test_deterministic_and_nan_stays_in_its_segment():
    q, k, v, rowptr, projection, grad_o = cast(make_case(SIZES, 23, torch.float64), torch.float32)
    first = kernel_fwd_bwd(q, k, v, rowptr, projection, grad_o)
    second = kernel_fwd_bwd(q, k, v, rowptr, projection, grad_o)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    hub = SIZES.index(HUB)
    start, end = rowptr[hub].item(), rowptr[hub + 1].item()
    k_nan = k.clone()
    k_nan[start + 17, 0, 3] = float("nan")
    o_nan = kernel_fwd_bwd(q, k_nan, v, rowptr, projection, grad_o)[0]
    assert torch.isnan(o_nan[start:end, 0]).all()
    outside = torch.ones(q.shape[0], dtype=torch.bool, device=q.device)
    outside[start:end] = False
    assert torch.equal(o_nan[outside], first[0][outside])
    assert torch.equal(o_nan[start:end, 1], first[0][start:end, 1])


# SMALL_SIZES gives rowptr [0, 0, 1, 6, 46, 346]: 5 segments over 346 rows.
@pytest.mark.parametrize("segments, message", [
    ([0, 5], r"segments\[1\] = 5 is out of range for rowptr with 5 segments"),
    ([-1, 2], r"segments\[0\] = -1 is out of range for rowptr with 5 segments"),
    ([1, 3, 4, 3], r"segments lists segment 3 more than once"),
])
@pytest.mark.parametrize("op", ["performer_fwd_into", "performer_bwd_into"])
def test_bad_segment_ids_are_rejected(segments, message, op):
    q, k, v, rowptr, projection, grad_o = cast(make_case(SMALL_SIZES, 8, torch.float64), torch.float32)
    seg = torch.tensor(segments, device=q.device)
    kernels = torch.ops.nt_kernels
    with pytest.raises(RuntimeError, match=f"{op}: {message}"):
        if op == "performer_fwd_into":
            kernels.performer_fwd_into(torch.empty_like(q), q, k, v, rowptr, seg, projection, EPS)
        else:
            grads = [torch.empty_like(q) for _ in range(3)]
            kernels.performer_bwd_into(*grads, grad_o, q, k, v, rowptr, seg, projection, EPS)


def test_bad_rowptr_values_are_rejected():
    q, k, v, rowptr, projection, _ = cast(make_case(SMALL_SIZES, 8, torch.float64), torch.float32)
    seg = torch.arange(rowptr.numel() - 1, device=q.device)
    descending = torch.tensor([0, 0, 7, 6, 46, 346], device=q.device)
    with pytest.raises(RuntimeError, match=r"rowptr must be non-decreasing, but rowptr\[2\] = 7 > rowptr\[3\] = 6"):
        torch.ops.nt_kernels.performer_fwd_into(torch.empty_like(q), q, k, v, descending, seg, projection, EPS)
    short = torch.tensor([0, 0, 1, 6, 46, 345], device=q.device)
    with pytest.raises(RuntimeError, match=r"rowptr\[-1\] must equal E = 346, got 345"):
        torch.ops.nt_kernels.performer_fwd_into(torch.empty_like(q), q, k, v, short, seg, projection, EPS)


def test_segments_changed_in_place_are_checked_again():
    """A checked (rowptr, segments) pair is remembered by tensor and version: an
    in-place change after a successful call is still caught."""
    case = cast(make_case(SMALL_SIZES, 8, torch.float64), torch.float32)
    seg = torch.tensor([1, 3], device=case[0].device)
    kernel_fwd_bwd(*case, segments=seg)
    seg[1] = 1
    with pytest.raises(RuntimeError, match="segments lists segment 1 more than once"):
        kernel_fwd_bwd(*case, segments=seg)


def test_bad_dtype_and_dim_are_rejected():
    with pytest.raises(RuntimeError, match="performer_fwd_into: CUDA supports float32"):
        kernel_fwd_bwd(*make_case([3], 8, torch.float64))
    with pytest.raises(RuntimeError, match="head dim must be in 1..256"):
        kernel_fwd_bwd(*cast(make_case([3], 257, torch.float64, m=4), torch.float32))



def test_opcheck_on_cuda():
    q, k, v, rowptr, projection, _ = cast(make_case(SMALL_SIZES, 9, torch.float64), torch.float32)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    none = torch.empty(0, dtype=torch.long, device=q.device)
    segments = torch.arange(rowptr.numel() - 1, device=q.device)
    torch.library.opcheck(torch.ops.nt_kernels.attention_fwd.default,
                          (q, k, v, rowptr, none, segments, None, projection, 9 ** -0.5, EPS))


def test_torch_compile_fullgraph_on_cuda():
    from nt_kernels import segment_performer_attention

    q, k, v, rowptr, projection, grad_o = cast(make_case(SMALL_SIZES, 9, torch.float64), torch.float32)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    compiled = torch.compile(lambda q, k, v: segment_performer_attention(q, k, v, rowptr, projection),
                             fullgraph=True)
    out = compiled(q, k, v)
    torch.testing.assert_close(out, segment_performer_attention(q, k, v, rowptr, projection))
    out.backward(grad_o)
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()
