"""Kernel-level tests of the fused NT layer op's CPU kernel (csrc/cpu/ntconv_*).

The op's semantics are tested in test_ntconv.py against the float64 reference;
this file covers what belongs to the kernel itself: the float32 GELU and its
derivative, work items and chunks on a graph with many of both (long exact and
Performer segments included), segments left out of both lists, the C++ value
checks of the graph, the autocast registration, bfloat16 determinism across
thread counts, and the attention ops' outputs without a zero fill.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import nt_kernels as nk
from nt_kernels.csr import NeighbourhoodCSR, receiver_csr
from nt_reference.nn import ntconv_messages

OPS = torch.ops.nt_kernels
GROUP_ROWS, MIN_CHUNK_ROWS, PERFORMER_BLOCK = 64, 512, 512  # csrc/cpu/ntconv_plan.h, segment_performer_args.h


def random_weights(c, c_out, *, edge_dim=0, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    weights = dict(w_qkv=rand(3 * c, c, scale=c ** -0.5), b_qkv=rand(3 * c, scale=0.1),
                   w_out=rand(c_out, c, scale=c ** -0.5), b_out=rand(c_out, scale=0.1))
    if edge_dim:
        weights.update(w_edge=rand(c, edge_dim, scale=edge_dim ** -0.5))
    return weights


def raw_args(centre, receiver_term, csr, weights, *, heads, aggr="sum", gate_group="receiver", edge_attr=None,
             projection=None, threshold=math.inf, exact=None, performer=None, dropout=0.0, seed=0):
    """Arguments of torch.ops.nt_kernels.ntconv_fwd in schema order (docs/design.md §9)."""
    rcsr = receiver_csr(csr, centre.shape[0])
    split = csr.segment_split(threshold)
    exact = split[0] if exact is None else exact
    performer = split[1] if performer is None else performer
    head_dim = centre.shape[1] // heads
    return (centre, receiver_term, edge_attr, weights.get("w_edge"), weights["w_qkv"], weights["b_qkv"],
            weights["w_out"], weights["b_out"], csr.rowptr, csr.receiver, csr.perm, rcsr.rowptr, rcsr.perm,
            exact, performer, None, projection, torch.tensor(seed, dtype=torch.int64), heads, aggr, gate_group,
            dropout, head_dim ** -0.5, 1e-4)


# ------------------------------------------------------------------ GELU
def test_float32_gelu_and_derivative_within_twice_torch_error():
    """One-row neighbourhoods j -> j with v = z, W_out = I, b = 0 and aggr='sum' make
    out[j] = GELU(GELU(u_j)) and d centre = GELU'(GELU(u)) GELU'(u) g: the kernel's float32
    GELU and GELU' (a polynomial erf) against float64, at most twice the error of torch's
    float32 GELU on the same values, over u in [-9, 9]."""
    c, n = 8, 4000
    u = torch.linspace(-9.0, 9.0, n * c, dtype=torch.float64).reshape(n, c)
    nodes = torch.arange(n)
    csr = NeighbourhoodCSR.from_edge_index(torch.stack([nodes, nodes]), n)
    eye = torch.eye(c, dtype=torch.float64)
    weights = dict(w_qkv=torch.cat([torch.zeros(2 * c, c, dtype=torch.float64), eye]),
                   b_qkv=torch.zeros(3 * c, dtype=torch.float64), w_out=eye, b_out=torch.zeros(c, dtype=torch.float64))
    g = torch.randn(n, c, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def run(dtype, fn):
        x = u.to(dtype).requires_grad_()
        out = fn(x)
        grad, = torch.autograd.grad(out, x, g.to(dtype))
        return out.detach().double(), grad.double()

    def op(x):
        w = {k: t.to(x.dtype) for k, t in weights.items()}
        return nk.ntconv(x, torch.zeros_like(x), csr, w["w_qkv"], w["b_qkv"], w["w_out"], w["b_out"], heads=1,
                         aggr="sum")

    def torch_gelu(x):
        return F.gelu(F.gelu(x))

    truth = run(torch.float64, torch_gelu)
    assert torch.allclose(run(torch.float64, op)[0], truth[0], rtol=0, atol=1e-14)
    for got, theirs, want, name in zip(run(torch.float32, op), run(torch.float32, torch_gelu), truth,
                                       ("GELU", "GELU'")):
        ours, torch_error = (got - want).abs().max().item(), (theirs - want).abs().max().item()
        assert ours <= 2 * torch_error, f"{name}: error {ours:.3g} vs torch's {torch_error:.3g}"


# ------------------------------------------------------- items and chunks
def many_items_graph():
    """Sizes that fill many 64-row items and several chunks, cross item boundaries, and include
    an exact segment longer than an item (100 rows) and a Performer segment of more than one
    512-row block (700 rows)."""
    gen = torch.Generator().manual_seed(4)
    sizes = torch.randint(0, 12, (300,), generator=gen)
    sizes[[5, 17, 60]] = torch.tensor([0, 63, 65])
    sizes[100], sizes[200] = 100, 700
    num_nodes = sizes.numel()
    centre = torch.repeat_interleave(torch.arange(num_nodes), sizes)
    receiver = torch.randint(0, num_nodes, (centre.numel(),), generator=gen)
    edge_index = torch.stack([centre, receiver])[:, torch.randperm(centre.numel(), generator=gen)]
    return edge_index, num_nodes


@pytest.mark.parametrize("aggr, gate_group", [("gated_sum", "receiver"), ("weighted_mean", "centre"),
                                              ("weighted_mean", "receiver")])
def test_many_items_and_chunks_match_the_reference(aggr, gate_group):
    edge_index, n = many_items_graph()
    num_edges = edge_index.shape[1]
    assert num_edges >= 3 * MIN_CHUNK_ROWS
    heads, dim, edge_dim = 2, 4, 3
    c = heads * dim
    gen = torch.Generator().manual_seed(7)
    centre, receiver_term = (torch.randn(n, c, generator=gen, dtype=torch.float64) for _ in range(2))
    edge_attr = torch.randn(num_edges, edge_dim, generator=gen, dtype=torch.float64)
    weights = random_weights(c, 2 * c, edge_dim=edge_dim)
    projection = nk.orthogonal_random_features(6, dim, generator=gen, dtype=torch.float64)
    csr = NeighbourhoodCSR.from_edge_index(edge_index, n)
    threshold = 80  # the 100-row segment is exact, the 700-row one Performer
    names = ["centre", "receiver_term", "edge_attr", *weights]
    inputs = [t.clone().requires_grad_() for t in (centre, receiver_term, edge_attr, *weights.values())]
    kwargs = dict(heads=heads, aggr=aggr, gate_group=gate_group, projection=projection, threshold=threshold,
                  dropout=0.25)

    def unpack(tensors):
        named = dict(zip(names, tensors))
        return named, {k: named[k] for k in ("w_qkv", "b_qkv", "w_out", "b_out")}

    def op(*tensors):
        t, w = unpack(tensors)
        return nk.ntconv(t["centre"], t["receiver_term"], csr, *w.values(), edge_attr=t["edge_attr"],
                         w_edge=t["w_edge"], seed=99, **kwargs)

    def reference(*tensors):
        t, w = unpack(tensors)
        return ntconv_messages(t["centre"], t["receiver_term"], edge_index, *w.values(), edge_attr=t["edge_attr"],
                               w_edge=t["w_edge"], seed=99, **kwargs)

    g = torch.randn(n, c, generator=gen, dtype=torch.float64)
    for got, want, name in zip(run_with_grads(op, inputs, g), run_with_grads(reference, inputs, g),
                               ["output", *names]):
        scale = max(1.0, want.abs().max().item())
        assert (got - want).abs().max().item() <= 1e-10 * scale, name


def run_with_grads(fn, inputs, g):
    out = fn(*inputs)
    return [out.detach(), *torch.autograd.grad(out, inputs, g)]


# ------------------------------------------------------- unlisted segments
def test_segments_in_neither_list_have_zero_attention_output():
    """A segment in neither list takes o = 0 (as in attention_fwd), so its messages are
    GELU(b_out) and nothing flows back into q, k, v or the node terms."""
    edge_index = torch.tensor([[0, 0, 1, 2, 2, 2], [1, 2, 0, 0, 1, 3]])
    n, heads, c = 4, 2, 4
    csr = NeighbourhoodCSR.from_edge_index(edge_index, n)
    gen = torch.Generator().manual_seed(2)
    centre, receiver_term = (torch.randn(n, c, generator=gen, dtype=torch.float64) for _ in range(2))
    weights = random_weights(c, c)
    none = torch.empty(0, dtype=torch.int64)
    args = raw_args(centre, receiver_term, csr, weights, heads=heads, exact=none, performer=none)
    out, lse, _ = OPS.ntconv_fwd(*args)
    in_degree = torch.bincount(edge_index[1], minlength=n).double().unsqueeze(1)
    torch.testing.assert_close(out, in_degree * F.gelu(weights["b_out"]), rtol=0, atol=1e-14)
    assert not lse.any()
    grads = OPS.ntconv_bwd(torch.ones_like(out), out, lse, _, *args, [True, True, False])
    for name, grad in zip(("centre", "receiver_term", "w_qkv", "b_qkv"), (*grads[:2], *grads[4:6])):
        assert not grad.any(), f"gradient of {name}"


# ----------------------------------------------------- C++ graph checks
def checked_call(**replace):
    edge_index = torch.tensor([[0, 0, 1, 2], [1, 2, 2, 0]])
    n, c = 3, 4
    csr = NeighbourhoodCSR.from_edge_index(edge_index, n)
    centre = torch.zeros(n, c, dtype=torch.float64)
    args = list(raw_args(centre, centre.clone(), csr, random_weights(c, c), heads=2))
    index = {"rowptr": 8, "receiver": 9, "perm": 10, "recv_rowptr": 11, "recv_perm": 12, "exact": 13}
    for name, value in replace.items():
        args[index[name]] = value(args[index[name]])
    return OPS.ntconv_fwd(*args)


@pytest.mark.parametrize("replace, message", [
    (dict(rowptr=lambda t: torch.tensor([0, 2, 3, 5])), "rowptr must start at 0 and end at E"),
    (dict(rowptr=lambda t: torch.tensor([0, 3, 2, 4])), "rowptr must be non-decreasing"),
    (dict(receiver=lambda t: torch.tensor([1, 2, 2, 7])), r"receiver\[3\] = 7 is out of range"),
    (dict(recv_perm=lambda t: t.flip(0)), "recv_perm"),
    (dict(recv_perm=lambda t: torch.zeros_like(t)), "recv_perm"),
    (dict(exact=lambda t: torch.cat([t, t[:1]])), "listed twice"),
    (dict(exact=lambda t: torch.tensor([0, 5])), "out of range"),
], ids=["rowptr-end", "rowptr-order", "receiver-range", "recv_perm-order", "recv_perm-duplicate",
        "segment-twice", "segment-range"])
def test_graph_values_are_checked_by_the_kernel(replace, message):
    with pytest.raises(RuntimeError, match=message):
        checked_call(**replace)


# ----------------------------------------------------- autocast, threads
def autocast_case():
    edge_index, n = many_items_graph()
    heads, c = 2, 8
    gen = torch.Generator().manual_seed(3)
    centre, receiver_term = (torch.randn(n, c, generator=gen) for _ in range(2))
    return edge_index, n, heads, centre, receiver_term, random_weights(c, 2 * c, dtype=torch.float32)


def test_autocast_casts_the_parameters_only():
    """Under bf16 autocast the op equals a direct call with bf16 parameters and the float32
    node terms; out is bf16, the node terms' gradients stay float32."""
    edge_index, n, heads, centre, receiver_term, weights = autocast_case()
    csr = NeighbourhoodCSR.from_edge_index(edge_index, n)
    x = centre.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = nk.ntconv(x, receiver_term, csr, *weights.values(), heads=heads, aggr="gated_sum")
    grad, = torch.autograd.grad(out.float().sum(), x)
    direct = OPS.ntconv_fwd(*raw_args(centre, receiver_term, csr, {k: w.bfloat16() for k, w in weights.items()},
                                      heads=heads, aggr="gated_sum"))[0]
    assert out.dtype == torch.bfloat16 and grad.dtype == torch.float32
    assert torch.equal(out, direct)


@pytest.mark.parametrize("aggr", ["max", "weighted_mean"])
def test_bfloat16_bitwise_identical_for_1_and_2_threads(aggr):
    edge_index, n, heads, centre, receiver_term, weights = autocast_case()
    if aggr == "max":
        weights["w_out"], weights["b_out"] = weights["w_out"][:8], weights["b_out"][:8]
    csr = NeighbourhoodCSR.from_edge_index(edge_index, n)
    inputs = [t.bfloat16().requires_grad_() for t in (centre, receiver_term, *weights.values())]
    g = torch.randn(n, 8, generator=torch.Generator().manual_seed(5)).bfloat16()

    def op(*t):
        return nk.ntconv(*t[:2], csr, *t[2:], heads=heads, aggr=aggr, dropout=0.1, seed=8)

    threads = torch.get_num_threads()
    try:
        runs = []
        for count in (1, 2):
            torch.set_num_threads(count)
            runs.append(run_with_grads(op, inputs, g))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


# ---------------------------------------- attention ops without zero fill
@pytest.mark.parametrize("kind", ["covered", "partial"])
def test_attention_outputs_of_covered_and_partial_lists(kind):
    """attention_fwd/bwd skip the zero fill when the lists cover every row; rows of a segment
    left out of partial lists stay exactly zero."""
    sizes = [3, 0, 5, 1, 4]
    rowptr = torch.tensor([0, 3, 3, 8, 9, 13])
    gen = torch.Generator().manual_seed(0)
    q, k, v, grad_o = (torch.randn(13, 2, 4, generator=gen, dtype=torch.float64) for _ in range(4))
    projection = nk.orthogonal_random_features(5, 4, generator=gen, dtype=torch.float64)
    exact, performer = torch.tensor([0, 3]), torch.tensor([2, 4] if kind == "covered" else [4])
    for _ in range(3):  # fresh allocations may reuse memory of earlier results
        o, lse = OPS.attention_fwd(q, k, v, rowptr, exact, performer, None, projection, 0.5, 1e-4)
        dq, dk, dv = OPS.attention_bwd(grad_o, q, k, v, o, lse, rowptr, exact, performer, None, projection, 0.5,
                                       1e-4)
        if kind == "partial":
            for t in (o, dq, dk, dv):
                assert not t[3:8].any()
    full = OPS.attention_fwd(q, k, v, rowptr, exact, torch.tensor([2, 4]), None, projection, 0.5, 1e-4)[0]
    listed = torch.ones(13, dtype=torch.bool)
    if kind == "partial":
        listed[3:8] = False
    assert torch.equal(o[listed], full[listed])
    assert sum(sizes) == 13


@pytest.mark.parametrize("lists", ["covered", "partial", "duplicate"])
def test_rows_covered_is_checked_on_cpu(lists):
    """rows_covered=True (what the public ops pass) skips the zero fill on every device; on CPU the
    promise is checked, so lists that leave rows out or repeat a segment are an error."""
    rowptr = torch.tensor([0, 3, 3, 8, 9])
    gen = torch.Generator().manual_seed(1)
    q, k, v, grad_o = (torch.randn(9, 2, 4, generator=gen, dtype=torch.float64) for _ in range(4))
    projection = nk.orthogonal_random_features(5, 4, generator=gen, dtype=torch.float64)
    performer = {"covered": [2, 3], "partial": [3], "duplicate": [0, 2, 3]}[lists]
    args = (rowptr, torch.tensor([0]), torch.tensor(performer), None, projection, 0.5, 1e-4)
    o, lse = OPS.attention_fwd(q, k, v, *args)
    if lists == "covered":
        grads = OPS.attention_bwd(grad_o, q, k, v, o, lse, *args)
        o2, lse2 = OPS.attention_fwd(q, k, v, *args, rows_covered=True)
        grads2 = OPS.attention_bwd(grad_o, q, k, v, o2, lse2, *args, rows_covered=True)
        for a, b in zip((o, lse, *grads), (o2, lse2, *grads2)):
            assert torch.equal(a, b)
        return
    message = "rows_covered=True, but exact_segments and performer_segments do not name distinct segments"
    with pytest.raises(RuntimeError, match=f"attention_fwd: {message}"):
        OPS.attention_fwd(q, k, v, *args, rows_covered=True)
    with pytest.raises(RuntimeError, match=f"attention_bwd: {message}"):
        OPS.attention_bwd(grad_o, q, k, v, o, lse, *args, rows_covered=True)
