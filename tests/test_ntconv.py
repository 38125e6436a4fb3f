"""The fused NT layer op ``nt_kernels.ops.ntconv`` (issue 13, docs/design.md §9).

Every number is checked against ``nt_reference.nn.ntconv_messages`` (plain
PyTorch autograd over the same edge_index, same counter-based dropout):
forward and every gradient in float64, dropout reproducibility and mask,
gradcheck, opcheck, torch.compile, thread-count determinism, NaN isolation,
low precision, bad input and empty graphs.
"""
import contextlib
import copy
import functools
import math

import pytest
import torch
import torch.nn.functional as F

import nt_kernels as nk
from helpers import assert_close, assert_low_precision, projection
from nt_kernels import NeighbourhoodCSR
from nt_kernels.nn.aggregate import aggregate, receiver_csr
from nt_kernels.ops import ntconv
from nt_reference.dropout import counter_dropout_mask
from nt_reference.nn import ntconv_messages

HEADS, DIM, EDGE_DIM, M = 2, 4, 3, 4  # C = 8; n* = 4 + sqrt(32) ~ 9.66 for m = 4, D = 4
GIVEN_THRESHOLD = 5

# (aggr, gate_group) pairs: the five aggregators, weighted_mean with both gate groups.
AGGRS = [
    pytest.param("sum", "receiver", id="sum"),
    pytest.param("mean", "receiver", id="mean"),
    pytest.param("max", "receiver", id="max"),
    pytest.param("weighted_mean", "receiver", id="weighted_mean-receiver"),
    pytest.param("weighted_mean", "centre", id="weighted_mean-centre"),
    pytest.param("gated_sum", "receiver", id="gated_sum"),
]
# attention -> (uses a projection, threshold): softmax = no projection, performer = threshold 0,
# switch = projection with the default n* or a given threshold.
ATTENTIONS = {"softmax": (False, None), "performer": (True, 0), "switch": (True, None),
              "switch-t5": (True, GIVEN_THRESHOLD)}
EDGE_ATTR = [pytest.param(False, id="no-edge-attr"), pytest.param(True, id="edge-attr")]


# ------------------------------------------------------------------ graphs
def graph_from_sizes(sizes, receivers, seed=0):
    """edge_index where centre j sends sizes[j] edges to nodes of ``receivers``, in shuffled order.

    A centre's receivers are distinct while sizes[j] <= len(receivers): duplicated edges without
    edge features give messages equal up to rounding, where max's tie rule would depend on the
    last bit (the tie tests build exact ties instead).
    """
    gen = torch.Generator().manual_seed(seed)
    pool = torch.tensor(receivers)
    parts = []
    for j, size in enumerate(sizes):
        if size <= len(receivers):
            picked = pool[torch.randperm(len(receivers), generator=gen)[:size]]
        else:
            picked = pool[torch.randint(len(receivers), (size,), generator=gen)]
        parts.append(torch.stack([torch.full_like(picked, j), picked]))
    edge_index = torch.cat(parts, dim=1)
    return edge_index[:, torch.randperm(edge_index.shape[1], generator=gen)]


# 18 nodes.  Sizes 4, 5, 6 sit around the given threshold 5 and 9, 10 around n* ~ 9.66;
# centres 0, 9, 14, 15 send nothing; nodes 14..17 receive nothing (14, 15 fully isolated);
# 1, 2, 12, 17 have one-row neighbourhoods.
MIXED_SIZES = [0, 1, 1, 2, 4, 5, 6, 9, 10, 0, 3, 2, 1, 7, 0, 0, 3, 1]
MIXED_RECEIVERS = list(range(14))


def mixed_graph():
    return graph_from_sizes(MIXED_SIZES, MIXED_RECEIVERS), len(MIXED_SIZES)


def hub_graph():
    """8 nodes: a 3,000-row hub (centre 0) over receivers 0..6, small neighbourhoods, node 7 isolated."""
    return graph_from_sizes([3000, 1, 2, 5, 0, 3, 1, 0], list(range(7)), seed=1), 8


# ------------------------------------------------------------------ inputs
class Inputs:
    """Node terms, weights, edge features and projection of one op call (float64 unless cast)."""

    TENSORS = ("centre", "receiver_term", "edge_attr", "w_edge", "w_qkv", "b_qkv", "w_out", "b_out")

    def __init__(self, num_nodes, num_edges, aggr, *, edge_attr, heads=HEADS, dim=DIM, edge_dim=EDGE_DIM,
                 m=M, seed=0, dtype=torch.float64):
        gen = torch.Generator().manual_seed(seed)
        c = heads * dim
        c_out = 2 * c if aggr in ("weighted_mean", "gated_sum") else c

        def rand(*shape, scale=1.0):
            return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

        self.heads = heads
        self.centre, self.receiver_term = rand(num_nodes, c), rand(num_nodes, c)
        self.edge_attr = rand(num_edges, edge_dim) if edge_attr else None
        self.w_edge = rand(c, edge_dim, scale=edge_dim ** -0.5) if edge_attr else None
        self.w_qkv, self.b_qkv = rand(3 * c, c, scale=c ** -0.5), rand(3 * c, scale=0.1)
        self.w_out, self.b_out = rand(c_out, c, scale=c ** -0.5), rand(c_out, scale=0.1)
        self.projection = projection(m, dim, dtype=dtype, seed=seed)

    def tensors(self):
        """The differentiable inputs present in this call, by name."""
        return {name: getattr(self, name) for name in self.TENSORS if getattr(self, name) is not None}

    def replace(self, **fields):
        """A copy with some fields replaced."""
        new = copy.copy(self)
        for name, value in fields.items():
            setattr(new, name, value)
        return new

    def cast(self, dtype):
        return self.replace(**{n: t.to(dtype) for n, t in self.tensors().items()},
                            projection=self.projection.to(dtype))

    def requires_grad(self):
        return self.replace(**{n: t.detach().clone().requires_grad_() for n, t in self.tensors().items()})


def attention_kwargs(inp, attention):
    use_projection, threshold = ATTENTIONS[attention]
    return dict(projection=inp.projection if use_projection else None, threshold=threshold)


def call_op(inp, csr, **kwargs):
    return ntconv(inp.centre, inp.receiver_term, csr, inp.w_qkv, inp.b_qkv, inp.w_out, inp.b_out, heads=inp.heads,
                  edge_attr=inp.edge_attr, w_edge=inp.w_edge, **kwargs)


def call_reference(inp, edge_index, *, num_nodes=None, seed=None, **kwargs):
    """ntconv_messages on the same inputs; ``num_nodes`` > N pads the node terms with unused rows."""
    centre, receiver_term = inp.centre, inp.receiver_term
    if num_nodes is not None and num_nodes > centre.shape[0]:
        pad = centre.new_zeros(num_nodes - centre.shape[0], centre.shape[1])
        centre, receiver_term = torch.cat([centre, pad]), torch.cat([receiver_term, pad])
    seed = 0 if seed is None else int(seed)
    return ntconv_messages(centre, receiver_term, edge_index, inp.w_qkv, inp.b_qkv, inp.w_out, inp.b_out,
                           heads=inp.heads, edge_attr=inp.edge_attr, w_edge=inp.w_edge, seed=seed, **kwargs)


def call_composition(inp, csr, *, aggr="weighted_mean", gate_group="receiver", projection=None, threshold=None,
                     dropout=0.0, seed=None, num_nodes=None):
    """The op's semantics composed from nt_kernels pieces (the ``fused=False`` path of NTConv)."""
    num_edges, c = csr.num_edges, inp.centre.shape[1]
    u = inp.centre.index_select(0, csr.centre) + inp.receiver_term.index_select(0, csr.receiver)
    if inp.edge_attr is not None:
        u = u + F.linear(csr.pack(inp.edge_attr), inp.w_edge)
    z = F.gelu(u)
    if dropout > 0:
        z = z * counter_dropout_mask(int(seed), num_edges, c, dropout, dtype=z.dtype)
    q, k, v = F.linear(z, inp.w_qkv, inp.b_qkv).view(num_edges, 3, inp.heads, c // inp.heads).unbind(1)
    if projection is not None:
        projection = projection.to(q.dtype)  # under autocast q is bfloat16
    o = nk.neighbourhood_attention(q, k, v, csr, projection=projection,
                                   threshold=math.inf if projection is None else threshold)
    messages = F.gelu(F.linear(o.reshape(num_edges, c), inp.w_out, inp.b_out))
    return aggregate(messages, csr, aggr, num_nodes=inp.centre.shape[0] if num_nodes is None else num_nodes,
                     heads=inp.heads, gate_group=gate_group)


def grad_weight(shape, dtype, seed=5):
    """A fixed random output gradient, exactly representable in bfloat16 (so in every float dtype)."""
    g = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return g.to(torch.bfloat16).to(dtype)


def output_and_grads(run, inp, context=contextlib.nullcontext):
    """run(inp) (under ``context``) and the gradients of <run(inp), g> for a fixed g, by input name."""
    inp = inp.requires_grad()
    with context():
        out = run(inp)
    names, tensors = zip(*inp.tensors().items())
    grads = torch.autograd.grad(out, tensors, grad_weight(out.shape, out.dtype))
    return out.detach(), dict(zip(names, grads))


def check(got, want, name):
    """``got`` vs the float64 (or float32) ``want`` with the project's tolerance for got's dtype
    (tests/helpers.py: 1e-10 in float64), finite on both sides."""
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.isfinite(got).all() and torch.isfinite(want).all(), f"{name}: non-finite values"
    assert_close(got, want, msg=name)


def assert_matches_reference(inp, edge_index, num_nodes, **kwargs):
    csr = NeighbourhoodCSR.from_edge_index(edge_index, num_nodes)
    out, grads = output_and_grads(lambda i: call_op(i, csr, **kwargs), inp)
    out_ref, grads_ref = output_and_grads(lambda i: call_reference(i, edge_index, **kwargs), inp)
    assert out.dtype == out_ref.dtype
    check(out, out_ref, "output")
    for name, grad in grads.items():
        check(grad, grads_ref[name], f"gradient of {name}")


# ------------------------------------------------- harness check (no kernel needed)
@pytest.mark.parametrize("attention", ["softmax", "switch-t5"])
@pytest.mark.parametrize("aggr, gate_group", AGGRS)
def test_reference_matches_the_composition(aggr, gate_group, attention):
    """The reference and the nt_kernels composition agree to the criterion the op is held to."""
    edge_index, n = mixed_graph()
    inp = Inputs(n, edge_index.shape[1], aggr, edge_attr=True)
    csr = NeighbourhoodCSR.from_edge_index(edge_index, n)
    kwargs = dict(aggr=aggr, gate_group=gate_group, **attention_kwargs(inp, attention))
    out, grads = output_and_grads(lambda i: call_composition(i, csr, **kwargs), inp)
    out_ref, grads_ref = output_and_grads(lambda i: call_reference(i, edge_index, **kwargs), inp)
    check(out, out_ref, "output")
    for name, grad in grads.items():
        check(grad, grads_ref[name], f"gradient of {name}")


# ------------------------------------------------------- float64 vs reference
@pytest.mark.parametrize("attention", list(ATTENTIONS))
@pytest.mark.parametrize("edge_attr", EDGE_ATTR)
@pytest.mark.parametrize("aggr, gate_group", AGGRS)
def test_matches_reference_mixed_graph(aggr, gate_group, edge_attr, attention):
    edge_index, n = mixed_graph()
    inp = Inputs(n, edge_index.shape[1], aggr, edge_attr=edge_attr)
    assert_matches_reference(inp, edge_index, n, aggr=aggr, gate_group=gate_group,
                             **attention_kwargs(inp, attention))


HUB_CASES = [pytest.param(*aggr.values, "switch", id=f"{aggr.id}-switch") for aggr in AGGRS] + [
    pytest.param("sum", "receiver", "softmax", id="sum-softmax"),
    pytest.param("weighted_mean", "centre", "softmax", id="weighted_mean-centre-softmax"),
]


@pytest.mark.parametrize("aggr, gate_group, attention", HUB_CASES)
def test_matches_reference_3000_row_hub(aggr, gate_group, attention, single_thread):
    """Switch sends the hub to Performer; softmax runs it exact (3000 x 3000 scores per head)."""
    edge_index, n = hub_graph()
    inp = Inputs(n, edge_index.shape[1], aggr, edge_attr=True, dim=2, m=2)
    assert_matches_reference(inp, edge_index, n, aggr=aggr, gate_group=gate_group,
                             **attention_kwargs(inp, attention))


@pytest.mark.parametrize("aggr, gate_group", AGGRS[2:4])
def test_matches_reference_with_scale_and_eps(aggr, gate_group):
    edge_index, n = mixed_graph()
    inp = Inputs(n, edge_index.shape[1], aggr, edge_attr=True)
    assert_matches_reference(inp, edge_index, n, aggr=aggr, gate_group=gate_group, projection=inp.projection,
                             threshold=GIVEN_THRESHOLD, scale=0.3, eps=1e-2)


def tied_inputs(num_nodes, num_edges, edge_attr):
    """max inputs whose messages tie: W_out rows of half the channels are zero, so in those
    channels every message equals GELU(b_out) exactly and all messages at a receiver tie."""
    inp = Inputs(num_nodes, num_edges, "max", edge_attr=edge_attr)
    w_out = inp.w_out.clone()
    w_out[::2] = 0.0
    return inp.replace(w_out=w_out)


@pytest.mark.parametrize("attention", list(ATTENTIONS))
@pytest.mark.parametrize("edge_attr", EDGE_ATTR)
def test_max_ties_split_the_gradient_like_amax(edge_attr, attention):
    edge_index, n = mixed_graph()
    inp = tied_inputs(n, edge_index.shape[1], edge_attr)
    assert_matches_reference(inp, edge_index, n, aggr="max", **attention_kwargs(inp, attention))


def test_max_tie_gradient_is_split_evenly():
    """Direct check of the amax rule: with W_out = 0 every message is GELU(b_out), so the gradient
    of b_out is sum_k g[k] * GELU'(b_out) over receivers that receive anything."""
    edge_index, n = mixed_graph()
    inp = Inputs(n, edge_index.shape[1], "max", edge_attr=False)
    inp.w_out = torch.zeros_like(inp.w_out)
    csr = NeighbourhoodCSR.from_edge_index(edge_index, n)
    out, grads = output_and_grads(lambda i: call_op(i, csr, aggr="max"), inp)
    g = grad_weight(out.shape, out.dtype)
    receives = torch.bincount(edge_index[1], minlength=n) > 0
    b = inp.b_out.clone().requires_grad_()
    gelu_grad, = torch.autograd.grad(F.gelu(b).sum(), b)
    check(grads["b_out"], g[receives].sum(0) * gelu_grad, "gradient of b_out")


# ------------------------------------------------------------------- dropout
P_DROP = 0.3


def dropout_case(aggr="weighted_mean"):
    edge_index, n = mixed_graph()
    inp = Inputs(n, edge_index.shape[1], aggr, edge_attr=True)
    return edge_index, n, inp, NeighbourhoodCSR.from_edge_index(edge_index, n)


@pytest.mark.parametrize("seed", [pytest.param(11, id="int"), pytest.param(torch.tensor(11), id="tensor")])
def test_dropout_same_seed_is_bitwise_reproducible(seed):
    _, _, inp, csr = dropout_case()
    kwargs = dict(projection=inp.projection, threshold=GIVEN_THRESHOLD, dropout=P_DROP, seed=seed)
    out_a, grads_a = output_and_grads(lambda i: call_op(i, csr, **kwargs), inp)
    out_b, grads_b = output_and_grads(lambda i: call_op(i, csr, **kwargs), inp)
    assert torch.equal(out_a, out_b)
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), f"gradient of {name} differs between runs"
    out_c = call_op(inp, csr, **{**kwargs, "seed": 12})
    assert not torch.equal(out_a, out_c), "seeds 11 and 12 gave the same output"


@pytest.mark.parametrize("seed", [0, 12345, 2 ** 40 + 7, -3], ids=["0", "12345", "2^40+7", "negative"])
@pytest.mark.parametrize("aggr, gate_group", AGGRS)
def test_dropout_matches_reference_mask(aggr, gate_group, seed):
    edge_index, n, inp, _ = dropout_case(aggr)
    assert_matches_reference(inp, edge_index, n, aggr=aggr, gate_group=gate_group, projection=inp.projection,
                             threshold=GIVEN_THRESHOLD, dropout=P_DROP, seed=torch.tensor(seed))


def observable_mask_case(num_rows, heads=2, dim=8, dtype=torch.float32):
    """One-row neighbourhoods j -> j with a dropout mask that shows in the output.

    u > 0, so z = GELU(u) * mask is 0 exactly where dropped; W_v = I, b_v = 0, so
    v = z; a one-row segment gives o = v; W_out = I, b_out = 0 and aggr='sum' make
    out[j] = GELU(z_j), which is 0 exactly where z_j is.  Row j is packed row j.
    """
    c = heads * dim
    gen = torch.Generator().manual_seed(3)
    nodes = torch.arange(num_rows)
    csr = NeighbourhoodCSR.from_edge_index(torch.stack([nodes, nodes]), num_rows)
    w_qkv = torch.randn(3 * c, c, generator=gen, dtype=dtype)
    w_qkv[2 * c:] = torch.eye(c, dtype=dtype)
    b_qkv = torch.zeros(3 * c, dtype=dtype)
    centre = 1.0 + torch.rand(num_rows, c, generator=gen, dtype=dtype)
    args = (centre, torch.zeros_like(centre), csr, w_qkv, b_qkv, torch.eye(c, dtype=dtype),
            torch.zeros(c, dtype=dtype))
    return args, dict(heads=heads, aggr="sum")


def call_op_args(args, kwargs, **extra):
    return ntconv(*args, **kwargs, **extra)


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5, 0.9])
def test_dropout_mask_is_the_reference_counter_mask(p):
    args, kwargs = observable_mask_case(600)
    for seed in (1, 2 ** 33 + 5):
        kept = call_op_args(args, kwargs, dropout=p, seed=seed) != 0
        expected = counter_dropout_mask(seed, 600, kept.shape[1], p) != 0
        assert torch.equal(kept, expected), f"seed {seed}: {int((kept != expected).sum())} elements differ"


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_dropout_kept_fraction_within_3_sigma(p):
    args, kwargs = observable_mask_case(3000)
    for seed in (0, 99):
        kept = call_op_args(args, kwargs, dropout=p, seed=seed) != 0
        n = kept.numel()
        sigma = math.sqrt(p * (1 - p) / n)
        fraction = kept.double().mean().item()
        assert abs(fraction - (1 - p)) <= 3 * sigma, f"seed {seed}: kept {fraction:.5f}, 1 - p = {1 - p} +- {3 * sigma:.5f}"


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_reference_mask_statistics(p):
    """The counter generator itself: kept fraction within 3 sigma, per-channel and per-seed independence."""
    rows, channels = 4000, 16
    a = counter_dropout_mask(7, rows, channels, p) != 0
    b = counter_dropout_mask(8, rows, channels, p) != 0
    n = a.numel()
    assert abs(a.double().mean().item() - (1 - p)) <= 3 * math.sqrt(p * (1 - p) / n)
    per_channel = a.double().mean(0)
    assert (per_channel - (1 - p)).abs().max().item() <= 4 * math.sqrt(p * (1 - p) / rows)
    both = (a & b).double().mean().item()  # independent seeds: P(kept twice) = (1 - p)^2
    q = (1 - p) ** 2
    assert abs(both - q) <= 3 * math.sqrt(q * (1 - q) / n)
    kept = counter_dropout_mask(7, rows, channels, p)
    assert torch.equal(kept[kept != 0], torch.full_like(kept[kept != 0], 1 / (1 - p)))


# ----------------------------------------------------------------- gradcheck
def tiny_case(aggr, edge_attr=True):
    edge_index = graph_from_sizes([0, 1, 2, 3, 2], [0, 1, 2, 3], seed=2)
    inp = Inputs(5, edge_index.shape[1], aggr, edge_attr=edge_attr, heads=2, dim=2, edge_dim=2, m=3)
    return inp, NeighbourhoodCSR.from_edge_index(edge_index, 5)


GRADCHECK_CASES = [pytest.param(aggr.values[0], aggr.values[1], "switch", 0.0, id=f"{aggr.id}-switch")
                   for aggr in AGGRS] + [
    pytest.param("weighted_mean", "receiver", "softmax", 0.0, id="weighted_mean-softmax"),
    pytest.param("gated_sum", "receiver", "performer", 0.0, id="gated_sum-performer"),
    pytest.param("sum", "receiver", "switch", P_DROP, id="sum-switch-dropout"),
    pytest.param("weighted_mean", "receiver", "switch", P_DROP, id="weighted_mean-switch-dropout"),
    pytest.param("max", "receiver", "softmax", P_DROP, id="max-softmax-dropout"),
]


@pytest.mark.parametrize("aggr, gate_group, attention, dropout", GRADCHECK_CASES)
def test_gradcheck(aggr, gate_group, attention, dropout):
    # threshold 2 sends the 3-row neighbourhood to Performer; eps = 0 makes the (constant)
    # Performer stabilisers cancel exactly, so finite differences see what autograd differentiates.
    inp, csr = tiny_case(aggr)
    use_projection, _ = ATTENTIONS[attention]
    threshold = {"switch": 2, "performer": 0, "softmax": None}[attention]
    names = list(inp.tensors())

    def op(*tensors):
        call = inp.replace(**dict(zip(names, tensors)))
        return call_op(call, csr, aggr=aggr, gate_group=gate_group, threshold=threshold, eps=0.0,
                       projection=inp.projection if use_projection else None, dropout=dropout, seed=5)

    tensors = [t.detach().clone().requires_grad_() for t in inp.tensors().values()]
    assert torch.autograd.gradcheck(op, tensors)


# ------------------------------------------------ opcheck and torch.compile
def raw_args(inp, csr, *, aggr, gate_group="receiver", threshold=GIVEN_THRESHOLD, dropout=0.0, seed=0):
    """Arguments of torch.ops.nt_kernels.ntconv_fwd in schema order (docs/design.md §9)."""
    rcsr = receiver_csr(csr, inp.centre.shape[0])
    exact, performer = csr.segment_split(threshold)
    return (inp.centre, inp.receiver_term, inp.edge_attr, inp.w_edge, inp.w_qkv, inp.b_qkv, inp.w_out, inp.b_out,
            csr.rowptr, csr.receiver, csr.perm, rcsr.rowptr, rcsr.perm, exact, performer, None, inp.projection,
            torch.tensor(seed, dtype=torch.int64), inp.heads, aggr, gate_group, dropout, DIM ** -0.5, 1e-4)


OPCHECK_CASES = [
    pytest.param("weighted_mean", "receiver", True, 0.0, id="weighted_mean-receiver-edge-attr"),
    pytest.param("weighted_mean", "centre", False, P_DROP, id="weighted_mean-centre-dropout"),
    pytest.param("max", "receiver", True, 0.0, id="max"),
    pytest.param("sum", "receiver", False, P_DROP, id="sum-dropout"),
]


@pytest.mark.parametrize("aggr, gate_group, edge_attr, dropout", OPCHECK_CASES)
def test_opcheck_forward(aggr, gate_group, edge_attr, dropout):
    edge_index, n = mixed_graph()
    inp = Inputs(n, edge_index.shape[1], aggr, edge_attr=edge_attr).requires_grad()
    csr = NeighbourhoodCSR.from_edge_index(edge_index, n)
    args = raw_args(inp, csr, aggr=aggr, gate_group=gate_group, dropout=dropout, seed=4)
    torch.library.opcheck(torch.ops.nt_kernels.ntconv_fwd.default, args)


@pytest.mark.parametrize("aggr, gate_group, edge_attr, dropout", OPCHECK_CASES)
def test_opcheck_backward(aggr, gate_group, edge_attr, dropout):
    edge_index, n = mixed_graph()
    inp = Inputs(n, edge_index.shape[1], aggr, edge_attr=edge_attr)
    csr = NeighbourhoodCSR.from_edge_index(edge_index, n)
    args = raw_args(inp, csr, aggr=aggr, gate_group=gate_group, dropout=dropout, seed=4)
    out, lse, stats = torch.ops.nt_kernels.ntconv_fwd(*args)
    grad_out = torch.randn_like(out)
    torch.library.opcheck(torch.ops.nt_kernels.ntconv_bwd.default,
                          (grad_out, out, lse, stats, *args, [True, True, edge_attr]))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_fake_lse_follows_the_device(device):
    """The fake kernel's lse is what each device's kernel returns: (E, H) on CPU, whose backward reads it;
    empty (0, H) on CUDA, whose backward recomputes it (the Triton kernel's shape: test_ntconv_triton.py,
    test_saved_state_shapes).  Fake CUDA tensors need no GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    edge_index, n = mixed_graph()
    inp = Inputs(n, edge_index.shape[1], "weighted_mean", edge_attr=False)
    csr = NeighbourhoodCSR.from_edge_index(edge_index, n)
    args = raw_args(inp, csr, aggr="weighted_mean", seed=4)
    with FakeTensorMode():
        fake = [torch.empty(a.shape, dtype=a.dtype, device=device) if isinstance(a, torch.Tensor) else a
                for a in args]
        fake[17] = torch.empty((), dtype=torch.int64)  # the seed stays a CPU tensor
        out, lse, stats = torch.ops.nt_kernels.ntconv_fwd(*fake)
    assert out.device.type == lse.device.type == device
    assert tuple(lse.shape) == ((csr.num_edges if device == "cpu" else 0), inp.heads)
    assert lse.dtype == torch.float32 and tuple(stats.shape) == (n, inp.heads)


@pytest.mark.parametrize("dropout", [pytest.param(0.0, id="no-dropout"), pytest.param(P_DROP, id="dropout")])
def test_torch_compile_fullgraph(dropout):
    edge_index, n = mixed_graph()
    inp = Inputs(n, edge_index.shape[1], "gated_sum", edge_attr=True, dtype=torch.float32)
    csr = NeighbourhoodCSR.from_edge_index(edge_index, n)
    kwargs = dict(aggr="gated_sum", projection=inp.projection, threshold=GIVEN_THRESHOLD, dropout=dropout)
    names = list(inp.tensors())
    call = inp.replace()  # its tensors are set inside fn (copy.copy is untraceable in torch 2.11's dynamo)

    def fn(seed, *tensors):
        for name, t in zip(names, tensors):
            setattr(call, name, t)
        return call_op(call, csr, seed=seed, **kwargs)

    tensors = [t.clone().requires_grad_() for t in inp.tensors().values()]
    seed = torch.tensor(21)
    eager = fn(seed, *tensors)  # also builds every plan on the CSR before compiling
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    out = compiled(seed, *tensors)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    for got, want in zip(torch.autograd.grad(out.square().sum(), tensors),
                         torch.autograd.grad(eager.square().sum(), tensors)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    if dropout:  # the seed is a graph input, not a constant baked into the compiled graph
        assert not torch.equal(compiled(torch.tensor(22), *tensors), out)


# -------------------------------------------------------------- determinism
@pytest.mark.parametrize("aggr, gate_group, dtype", [
    *[pytest.param(*a.values, dtype, id=f"{a.id}-{name}") for a in AGGRS
      for name, dtype in (("float32", torch.float32), ("float64", torch.float64))],
    pytest.param("weighted_mean", "receiver", torch.bfloat16, id="weighted_mean-receiver-bfloat16"),
    pytest.param("weighted_mean", "receiver", torch.float16, id="weighted_mean-receiver-float16")])
def test_bitwise_identical_for_1_and_2_threads(aggr, gate_group, dtype):
    gen = torch.Generator().manual_seed(9)
    n = 300
    edge_index = torch.randint(0, n, (2, 3000), generator=gen)
    edge_index = torch.cat([edge_index, torch.stack([torch.zeros(400, dtype=torch.long),
                                                     torch.randint(0, n, (400,), generator=gen)])], dim=1)
    inp = Inputs(n, edge_index.shape[1], aggr, edge_attr=True, heads=2, dim=8, m=8, dtype=dtype)
    csr = NeighbourhoodCSR.from_edge_index(edge_index, n)
    kwargs = dict(aggr=aggr, gate_group=gate_group, projection=inp.projection, dropout=0.2, seed=3)
    threads = torch.get_num_threads()
    runs = []
    try:
        for count in (1, 2, 2):
            torch.set_num_threads(count)
            runs.append(output_and_grads(lambda i: call_op(i, csr, **kwargs), inp))
    finally:
        torch.set_num_threads(threads)
    (out_1, grads_1), *others = runs
    for run, (out, grads) in enumerate(others, start=2):
        assert_bitwise_equal(out, out_1, f"run {run}: output")
        for name in grads_1:
            assert_bitwise_equal(grads[name], grads_1[name], f"run {run}: gradient of {name}")


def assert_bitwise_equal(got, want, name):
    assert torch.equal(got, want), f"{name} differs, max abs difference {(got - want).abs().max().item():.3e}"


# ------------------------------------------------------------------- NaN
@pytest.mark.parametrize("centre", [pytest.param(7, id="exact-9-rows"), pytest.param(8, id="performer-10-rows")])
@pytest.mark.parametrize("aggr, gate_group", AGGRS)
def test_nan_stays_in_its_neighbourhood(aggr, gate_group, centre):
    """A NaN in one edge_attr row of ``centre``'s neighbourhood (n* ~ 9.66 splits 9 / 10 rows)."""
    edge_index, n = mixed_graph()
    inp = Inputs(n, edge_index.shape[1], aggr, edge_attr=True)
    csr = NeighbourhoodCSR.from_edge_index(edge_index, n)
    own_edges = edge_index[0] == centre
    poisoned = inp.edge_attr.clone()
    poisoned[int(own_edges.nonzero()[0]), 1] = float("nan")
    reached = torch.zeros(n, dtype=torch.bool)
    reached[edge_index[1, own_edges]] = True
    kwargs = dict(aggr=aggr, gate_group=gate_group, projection=inp.projection)
    clean_out, clean_grads = nan_run(inp, csr, reached, kwargs)
    out, grads = nan_run(inp.replace(edge_attr=poisoned), csr, reached, kwargs)
    assert torch.isnan(out[reached]).any(dim=1).all(), "a receiver of the NaN neighbourhood lost its NaN"
    assert torch.isfinite(out[~reached]).all(), "NaN spread to another receiver"
    assert torch.equal(out[~reached], clean_out[~reached])
    if aggr in ("sum", "mean", "gated_sum"):
        # No gradient flows into the reached rows, so for these aggregators the other
        # neighbourhoods' input gradients do not involve the NaN at all.
        for name, rows in (("centre", torch.arange(n) != centre), ("receiver_term", ~reached),
                           ("edge_attr", ~own_edges)):
            assert torch.isfinite(grads[name][rows]).all(), f"NaN spread into the gradient of {name}"
            assert torch.equal(grads[name][rows], clean_grads[name][rows]), f"gradient of {name} changed"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["float32", "bfloat16", "float16"])
def test_nan_stays_in_its_neighbourhood_in_every_dtype(dtype):
    """weighted_mean in the kernels' dtypes: a NaN in one edge_attr row of the 10-row (Performer)
    neighbourhood makes each of its receivers' rows NaN and leaves every other row as in the clean run."""
    edge_index, n = mixed_graph()
    centre = 8
    inp = Inputs(n, edge_index.shape[1], "weighted_mean", edge_attr=True, dtype=dtype)
    csr = NeighbourhoodCSR.from_edge_index(edge_index, n)
    own_edges = edge_index[0] == centre
    reached = torch.zeros(n, dtype=torch.bool)
    reached[edge_index[1, own_edges]] = True
    poisoned = inp.edge_attr.clone()
    poisoned[int(own_edges.nonzero()[0]), 1] = float("nan")
    kwargs = dict(aggr="weighted_mean", projection=inp.projection)
    clean = call_op(inp, csr, **kwargs)
    out = call_op(inp.replace(edge_attr=poisoned), csr, **kwargs)
    assert torch.isnan(out[reached]).any(dim=1).all(), "a receiver of the NaN neighbourhood lost its NaN"
    for node in (~reached).nonzero().flatten().tolist():
        assert torch.equal(out[node], clean[node]), f"the NaN reached node {node}"


def nan_run(inp, csr, reached, kwargs):
    inp = inp.requires_grad()
    out = call_op(inp, csr, **kwargs)
    g = grad_weight(out.shape, out.dtype)
    g[reached] = 0.0
    names, tensors = zip(*inp.tensors().items())
    return out.detach(), dict(zip(names, torch.autograd.grad(out, tensors, g)))


# --------------------------------------------------------- low precision
def low_precision_runs(inp_lo, csr, edge_index, kwargs, autocast, rule):
    """Outputs and gradients of the op and of the independent reference (nt_reference's
    ntconv_messages) on the low-precision inputs, both under the same autocast (forward under
    autocast, backward outside), of that reference in float32 and in float64 on the same values,
    and (a function) of it in float32 on the inputs rounded to ``rule``, rounded to ``rule``."""
    context = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext
    op = output_and_grads(lambda i: call_op(i, csr, **dict(kwargs, projection=inp_lo.projection)), inp_lo, context)
    return (op, *reference_runs(inp_lo, edge_index, kwargs, autocast, rule))


def reference_runs(inp_lo, edge_index, kwargs, autocast, rule):
    """The reference's runs of low_precision_runs (no nt_kernels op among them: the mutation harness,
    tests/test_mutants.py, computes them once per distinct input)."""
    context = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext
    # under autocast the op casts its projection to q's bfloat16, which the reference's einsum needs given
    low_projection = inp_lo.projection.to(torch.bfloat16) if autocast else inp_lo.projection

    def reference(inp, projection, context=contextlib.nullcontext):
        return output_and_grads(lambda i: call_reference(i, edge_index, **dict(kwargs, projection=projection)),
                                inp, context)

    @functools.cache
    def mixed():
        rounded = inp_lo.cast(rule).cast(torch.float32)
        out, grads = reference(rounded, rounded.projection)
        return out.to(rule), {name: g.to(rule) for name, g in grads.items()}
    torch_low = reference(inp_lo, low_projection, context)
    float32 = reference(inp_lo.cast(torch.float32), inp_lo.projection.float())
    truth = reference(inp_lo.cast(torch.float64), inp_lo.projection.double())
    return torch_low, float32, truth, mixed


# (node-term dtype, weight and edge_attr dtype, autocast to bfloat16)
LOW_PRECISION = [
    pytest.param(torch.bfloat16, torch.bfloat16, False, id="bf16-inputs"),
    pytest.param(torch.float16, torch.float16, False, id="fp16-inputs"),
    pytest.param(torch.float32, torch.float32, True, id="autocast-float32-inputs"),
    pytest.param(torch.bfloat16, torch.float32, True, id="autocast-bf16-node-terms-float32-weights"),
    pytest.param(torch.float32, torch.float32, False, id="float32-inputs"),
]


def one_message_per_receiver_graph():
    """Segments of 1..6 rows (6 > the given threshold 5), every node receiving exactly one message."""
    gen = torch.Generator().manual_seed(6)
    sizes = torch.arange(1, 7)
    centre = torch.repeat_interleave(torch.arange(6), sizes)
    receiver = torch.randperm(centre.numel(), generator=gen)
    return torch.stack([centre, receiver]), centre.numel()


def assert_low_precision_op(aggr, gate_group, node_dtype, weight_dtype, autocast, graph):
    edge_index, n = graph
    csr = NeighbourhoodCSR.from_edge_index(edge_index, n)
    inp = Inputs(n, edge_index.shape[1], aggr, edge_attr=True).cast(weight_dtype)
    inp = inp.replace(centre=inp.centre.to(node_dtype), receiver_term=inp.receiver_term.to(node_dtype))
    kwargs = dict(aggr=aggr, gate_group=gate_group, threshold=GIVEN_THRESHOLD)
    rule = torch.bfloat16 if autocast else node_dtype
    op, low, float32, truth, mixed = low_precision_runs(inp, csr, edge_index, kwargs, autocast, rule)
    assert torch.isfinite(op[0]).all()
    for key in ["output", *op[1]]:
        pick = (lambda run: run[0]) if key == "output" else (lambda run: run[1][key])  # noqa: B023
        name = key if key == "output" else f"gradient of {key}"
        if rule != torch.float32:
            assert_low_precision(pick(op), pick(truth), pick(low), pick(float32), msg=name, dtype=rule,
                                 torch_mixed=lambda: pick(mixed()))  # noqa: B023
        else:
            check(pick(op), pick(truth), name)


@pytest.mark.parametrize("node_dtype, weight_dtype, autocast", LOW_PRECISION)
@pytest.mark.parametrize("aggr, gate_group", AGGRS)
def test_low_precision_against_the_float64_reference(aggr, gate_group, node_dtype, weight_dtype, autocast):
    """bfloat16 and float16 inputs, or bfloat16 autocast: the accuracy rule (tests/helpers.py) for the
    output and every gradient, against nt_reference's ntconv_messages run the same way (the same
    inputs, under the same autocast), its float32 run and its float64 run on the same values.  float32: the project's
    float32 tolerance against the float64 reference (in float32 both errors are a few ulps of
    rounding noise, so their ratio says nothing).

    max routes its gradient to the largest message, and rounding can swap two messages closer
    than the precision (seen: 1e-4 apart in bfloat16), so that the baseline's error is decided
    by which message won; max is compared on a graph where every receiver gets one message.
    """
    graph = one_message_per_receiver_graph() if aggr == "max" else mixed_graph()
    assert_low_precision_op(aggr, gate_group, node_dtype, weight_dtype, autocast, graph)


def test_bf16_inputs_give_bf16_output():
    edge_index, n = mixed_graph()
    inp = Inputs(n, edge_index.shape[1], "sum", edge_attr=True, dtype=torch.bfloat16)
    out = call_op(inp, NeighbourhoodCSR.from_edge_index(edge_index, n), aggr="sum", projection=inp.projection)
    assert out.dtype == torch.bfloat16 and out.shape == (n, HEADS * DIM)


# ------------------------------------------------------------ empty graphs
@pytest.mark.parametrize("num_nodes", [0, 6], ids=["no-nodes", "all-isolated"])
@pytest.mark.parametrize("aggr, gate_group", AGGRS)
def test_graph_without_edges(aggr, gate_group, num_nodes):
    edge_index = torch.empty(2, 0, dtype=torch.long)
    inp = Inputs(num_nodes, 0, aggr, edge_attr=True)
    csr = NeighbourhoodCSR.from_edge_index(edge_index, num_nodes)
    out, grads = output_and_grads(
        lambda i: call_op(i, csr, aggr=aggr, gate_group=gate_group, projection=i.projection, dropout=0.5, seed=1),
        inp)
    assert out.shape == (num_nodes, HEADS * DIM) and not out.any()
    for name, grad in grads.items():
        assert grad.shape == inp.tensors()[name].shape and not grad.any(), f"gradient of {name}"


def test_num_nodes_larger_than_the_node_terms():
    """num_nodes adds output rows nobody sends to: equal to the reference on zero-padded node terms."""
    edge_index, n = mixed_graph()
    inp = Inputs(n, edge_index.shape[1], "mean", edge_attr=True)
    csr = NeighbourhoodCSR.from_edge_index(edge_index, n)
    out = call_op(inp, csr, aggr="mean", num_nodes=n + 3)
    expected = call_reference(inp, edge_index, aggr="mean", num_nodes=n + 3)
    assert out.shape == (n + 3, HEADS * DIM) and not out[n:].any()
    check(out, expected, "output")


def test_exported_names():
    assert nk.ntconv is ntconv
    assert hasattr(torch.ops.nt_kernels, "ntconv_fwd") and hasattr(torch.ops.nt_kernels, "ntconv_bwd")


# --------------------------------------------------------------- bad input
def bad_call(aggr="weighted_mean", **overrides):
    """Call the op on the mixed graph with edge features, one argument replaced."""
    edge_index, n = mixed_graph()
    inp = Inputs(n, edge_index.shape[1], aggr, edge_attr=True)
    c = HEADS * DIM
    args = dict(centre=inp.centre, receiver_term=inp.receiver_term,
                csr=NeighbourhoodCSR.from_edge_index(edge_index, n), w_qkv=inp.w_qkv, b_qkv=inp.b_qkv,
                w_out=inp.w_out, b_out=inp.b_out, heads=HEADS, aggr=aggr, edge_attr=inp.edge_attr,
                w_edge=inp.w_edge, projection=inp.projection)
    for name, value in overrides.items():
        args[name] = value(args, c) if callable(value) else value
    ntconv(args.pop("centre"), args.pop("receiver_term"), args.pop("csr"), args.pop("w_qkv"), args.pop("b_qkv"),
           args.pop("w_out"), args.pop("b_out"), **args)


def bigger_graph_csr():
    """The mixed graph (same E) with one edge moved to centre 20 -> receiver 19: 21 nodes, 18 rows given."""
    edge_index, _ = mixed_graph()
    edge_index = edge_index.clone()
    edge_index[:, 0] = torch.tensor([20, 19])
    return NeighbourhoodCSR.from_edge_index(edge_index, 21)


def f64(*shape):
    return torch.zeros(*shape, dtype=torch.float64)


BAD_INPUTS = [
    # (id, overrides, argument names any of which the message must contain)
    ("centre-1d", dict(centre=lambda a, c: f64(18 * c)), "centre"),
    ("centre-int", dict(centre=lambda a, c: torch.zeros(18, c, dtype=torch.int64)), "centre"),
    ("centre-not-tensor", dict(centre=lambda a, c: a["centre"].tolist()), "centre"),
    ("receiver_term-width", dict(receiver_term=lambda a, c: f64(18, c + 2)), "receiver_term"),
    ("receiver_term-rows", dict(receiver_term=lambda a, c: f64(17, c)), "receiver_term"),
    ("w_qkv-in-width", dict(w_qkv=lambda a, c: f64(3 * c, c + 1)), "w_qkv"),
    ("w_qkv-out-width", dict(w_qkv=lambda a, c: f64(3 * c - 1, c)), "w_qkv"),
    ("b_qkv-shape", dict(b_qkv=lambda a, c: f64(3 * c + 1)), "b_qkv"),
    ("b_qkv-2d", dict(b_qkv=lambda a, c: f64(1, 3 * c)), "b_qkv"),
    ("w_out-width-vs-weighted_mean", dict(w_out=lambda a, c: f64(c, c), b_out=lambda a, c: f64(c)), "w_out"),
    ("w_out-width-vs-sum", dict(aggr="sum", w_out=lambda a, c: f64(2 * c, c), b_out=lambda a, c: f64(2 * c)),
     "w_out"),
    ("w_out-in-width", dict(w_out=lambda a, c: f64(2 * c, c + 1)), "w_out"),
    ("b_out-shape", dict(b_out=lambda a, c: f64(2 * c - 1)), "b_out"),
    ("edge_attr-rows", dict(edge_attr=lambda a, c: a["edge_attr"][1:]), "edge_attr"),
    ("edge_attr-1d", dict(edge_attr=lambda a, c: a["edge_attr"][:, 0]), "edge_attr"),
    ("w_edge-in-width", dict(w_edge=lambda a, c: f64(c, EDGE_DIM + 1)), "w_edge"),
    ("w_edge-out-width", dict(w_edge=lambda a, c: f64(c + 1, EDGE_DIM)), "w_edge"),
    ("edge_attr-without-w_edge", dict(w_edge=None), ("w_edge", "edge_attr")),
    ("w_edge-without-edge_attr", dict(edge_attr=None), ("w_edge", "edge_attr")),
    ("w_qkv-dtype", dict(w_qkv=lambda a, c: a["w_qkv"].float()), "w_qkv"),
    ("edge_attr-dtype", dict(edge_attr=lambda a, c: a["edge_attr"].float()), "edge_attr"),
    ("b_out-dtype", dict(b_out=lambda a, c: a["b_out"].float()), "b_out"),
    ("w_out-device", dict(w_out=lambda a, c: a["w_out"].to("meta")), "w_out"),
    ("receiver_term-device", dict(receiver_term=lambda a, c: a["receiver_term"].to("meta")), "receiver_term"),
    ("aggr-name", dict(aggr="median"), "aggr"),
    ("gate_group-name", dict(gate_group="edge"), "gate_group"),
    ("heads-not-dividing", dict(heads=3), "heads"),
    ("heads-zero", dict(heads=0), "heads"),
    ("dropout-one", dict(dropout=1.0, seed=1), "dropout"),
    ("dropout-negative", dict(dropout=-0.1, seed=1), "dropout"),
    ("dropout-without-seed", dict(dropout=0.2), "seed"),
    ("seed-float", dict(dropout=0.2, seed=1.5), "seed"),
    ("seed-float-tensor", dict(dropout=0.2, seed=torch.tensor(1.0)), "seed"),
    ("num_nodes-too-small", dict(num_nodes=5), "num_nodes"),
    ("projection-width", dict(projection=lambda a, c: f64(M, DIM + 1)), "projection"),
    ("projection-requires-grad", dict(projection=lambda a, c: a["projection"].clone().requires_grad_()),
     "projection"),
    ("threshold-without-projection", dict(projection=None, threshold=4), ("threshold", "projection")),
    ("threshold-negative", dict(threshold=-1), "threshold"),
    ("csr-not-a-csr", dict(csr=lambda a, c: a["csr"].rowptr), "csr"),
    ("csr-of-a-bigger-graph", dict(csr=lambda a, c: bigger_graph_csr()), ("csr", "centre", "num_nodes")),
]


@pytest.mark.parametrize("overrides, names", [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_names_the_argument(overrides, names):
    names = (names,) if isinstance(names, str) else names
    pattern = rf"(?s)ntconv.*\b({'|'.join(names)})\b"
    with pytest.raises((ValueError, TypeError), match=pattern):
        bad_call(**overrides)
