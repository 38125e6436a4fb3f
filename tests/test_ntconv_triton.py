"""The fused NT layer's CUDA implementation (nt_kernels/backends/triton/ntconv_*) on small graphs.

Without a GPU the Triton kernels run on CPU tensors under TRITON_INTERPRET=1
(conftest.py), called through the implementation functions directly (the
dispatcher sends CPU tensors to the C++ kernel instead).  Their Performer
stage then dispatches to the CPU C++ Performer kernel: the CUDA Performer
kernel is not exercised here.  Every case checks the output and all eight
gradients against ``nt_reference.nn.ntconv_messages`` in float64 (and
against the CPU fused op once it is built), with chunks small enough that
every graph spans several chunks (receiver groups merged across chunks, a
neighbourhood larger than a chunk).  With a GPU the same cases run compiled
through ``torch.ops.nt_kernels.ntconv_fwd`` / ``ntconv_bwd``, plus the
CUDA-only checks at the end.
"""
import math

import pytest
import torch

import nt_kernels as nk
from helpers import assert_close, assert_within_twice_torch_error
from nt_kernels import NeighbourhoodCSR
from nt_kernels.nn.aggregate import receiver_csr
from nt_reference.dropout import counter_dropout_mask, drop_threshold, seed_key
from nt_reference.nn import ntconv_messages

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from nt_kernels.backends.triton import ntconv_op  # noqa: E402
from nt_kernels.backends.triton.ntconv_gemm import dropout_keep  # noqa: E402
from nt_kernels.backends.triton.ntconv_plan import build_ntconv_plan, read_plan  # noqa: E402
from nt_kernels.backends.triton.plan import describe_plan  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
HAS_CPU_OP = hasattr(torch.ops.nt_kernels, "ntconv_fwd")
HEADS, DIM, EDGE_DIM, M = 2, 4, 3, 4
THRESHOLD = 5
CHUNK_ROWS = 12
GRAD_NAMES = ("centre", "receiver_term", "edge_attr", "w_edge", "w_qkv", "b_qkv", "w_out", "b_out")
AGGRS = [pytest.param("sum", "receiver", id="sum"), pytest.param("mean", "receiver", id="mean"),
         pytest.param("max", "receiver", id="max"),
         pytest.param("weighted_mean", "receiver", id="weighted_mean-receiver"),
         pytest.param("weighted_mean", "centre", id="weighted_mean-centre"),
         pytest.param("gated_sum", "receiver", id="gated_sum")]
# 13 nodes; sizes 4, 5, 6 around THRESHOLD (exact <= 5 < Performer); empty and one-row
# neighbourhoods; a 14-row neighbourhood larger than CHUNK_ROWS; nodes 10-12 receive nothing.
SIZES = [0, 1, 1, 2, 4, 5, 6, 3, 0, 2, 1, 14, 0]
RECEIVERS = 10


def make_graph(sizes=SIZES, receivers=RECEIVERS, seed=0):
    """(edge_index in shuffled order, num_nodes): centre j sends sizes[j] edges to random receivers."""
    gen = torch.Generator().manual_seed(seed)
    parts = [torch.stack([torch.full((n,), j), torch.randint(0, receivers, (n,), generator=gen)])
             for j, n in enumerate(sizes)]
    edge_index = torch.cat(parts, 1)
    return edge_index[:, torch.randperm(edge_index.shape[1], generator=gen)], len(sizes)


class Case:
    """Inputs of one call in float64 (cast on use) and the graph's CSRs."""

    def __init__(self, edge_index, num_nodes, aggr, *, edge_attr=True, heads=HEADS, dim=DIM, seed=1):
        gen = torch.Generator().manual_seed(seed)
        c = heads * dim
        c_out = 2 * c if aggr in ("weighted_mean", "gated_sum") else c

        def rand(*shape, scale=1.0):
            return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

        self.edge_index, self.heads = edge_index, heads
        e = edge_index.shape[1]
        self.tensors = dict(centre=rand(num_nodes, c), receiver_term=rand(num_nodes, c),
                            edge_attr=rand(e, EDGE_DIM) if edge_attr else None,
                            w_edge=rand(c, EDGE_DIM, scale=EDGE_DIM ** -0.5) if edge_attr else None,
                            w_qkv=rand(3 * c, c, scale=c ** -0.5), b_qkv=rand(3 * c, scale=0.1),
                            w_out=rand(c_out, c, scale=c ** -0.5), b_out=rand(c_out, scale=0.1))
        self.projection = nk.orthogonal_random_features(M, dim, generator=gen, dtype=torch.float64)
        self.csr = NeighbourhoodCSR.from_edge_index(edge_index, num_nodes)
        self.rcsr = receiver_csr(self.csr, num_nodes)
        self.grad_out = rand(num_nodes, c).to(torch.bfloat16).double()  # exact in every dtype


def reference(case, *, aggr, gate_group, threshold, dropout, seed, dtype=torch.float64):
    """Output and gradients (by name) of the plain-PyTorch definition, computed in ``dtype``."""
    leaves = {n: t.to(dtype).requires_grad_() for n, t in case.tensors.items() if t is not None}
    projection = case.projection.to(dtype) if threshold is not None else None
    out = ntconv_messages(leaves["centre"], leaves["receiver_term"], case.edge_index, leaves["w_qkv"],
                          leaves["b_qkv"], leaves["w_out"], leaves["b_out"], heads=case.heads, aggr=aggr,
                          gate_group=gate_group, edge_attr=leaves.get("edge_attr"), w_edge=leaves.get("w_edge"),
                          projection=projection, threshold=threshold, dropout=dropout, seed=seed)
    grads = torch.autograd.grad(out, list(leaves.values()), case.grad_out.to(dtype))
    return out.detach(), dict(zip(leaves, grads))


NODE_TENSORS = ("centre", "receiver_term", "edge_attr")


def op_args(case, *, aggr, gate_group, threshold, dropout, seed, dtype, param_dtype=None, plan=None):
    """Arguments of ntconv_fwd in schema order, on DEVICE: node terms and edge features in ``dtype``,
    the parameters in ``param_dtype`` (default ``dtype``; they differ under autocast)."""
    param_dtype = dtype if param_dtype is None else param_dtype
    t = {n: None if v is None else v.to(DEVICE, dtype if n in NODE_TENSORS else param_dtype)
         for n, v in case.tensors.items()}
    csr, rcsr = case.csr.to(DEVICE), case.rcsr.to(DEVICE)
    exact, performer = csr.segment_split(math.inf if threshold is None else threshold)
    projection = None if threshold is None else case.projection.to(DEVICE, param_dtype)
    return (t["centre"], t["receiver_term"], t["edge_attr"], t["w_edge"], t["w_qkv"], t["b_qkv"], t["w_out"],
            t["b_out"], csr.rowptr, csr.receiver, csr.perm, rcsr.rowptr, rcsr.perm, exact, performer, plan,
            projection, torch.tensor(seed), case.heads, aggr, gate_group, float(dropout),
            (case.tensors["centre"].shape[1] // case.heads) ** -0.5, 1e-4)


def run_triton(case, *, dtype=torch.float32, param_dtype=None, chunk_rows=CHUNK_ROWS,
               input_mask=(True, True, True), backward=True, **kw):
    """(out, lse, stats, grads by name) of the Triton implementation (grads None without ``backward``)."""
    args = op_args(case, dtype=dtype, param_dtype=param_dtype, **kw)
    if HAS_CUDA:  # compiled, through the dispatcher (the registered CUDA kernels)
        fwd, bwd, extra = torch.ops.nt_kernels.ntconv_fwd, torch.ops.nt_kernels.ntconv_bwd, {}
    else:
        fwd, bwd, extra = ntconv_op.ntconv_fwd, ntconv_op.ntconv_bwd, dict(chunk_rows=chunk_rows)
    out, lse, stats = fwd(*args, **extra)
    if not backward:
        return out, lse, stats, None
    grads = bwd(case.grad_out.to(DEVICE, out.dtype), out, lse, stats, *args, list(input_mask), **extra)
    return out, lse, stats, {n: g for n, g in zip(GRAD_NAMES, grads) if case.tensors[n] is not None}


def assert_float32_matches(case, chunk_rows=CHUNK_ROWS, **kw):
    """Output and every gradient within the float32 tolerance of tests/helpers.py."""
    out, _, _, grads = run_triton(case, chunk_rows=chunk_rows, **kw)
    want, want_grads = reference(case, **kw)
    assert out.dtype == torch.float32
    assert_close(out.cpu(), want, "output")
    for name, grad in grads.items():
        assert_close(grad.cpu(), want_grads[name], f"gradient of {name}")
    return out, grads


# ------------------------------------------------------------------ the plan
def test_plan_chunks_partition_rows_and_group_receivers():
    edge_index, n = make_graph(seed=3)
    csr = NeighbourhoodCSR.from_edge_index(edge_index, n)
    exact, performer = csr.segment_split(THRESHOLD)
    plan = build_ntconv_plan(csr.rowptr, csr.receiver, exact, performer, n, CHUNK_ROWS, 64)
    sizes = dict(num_rows=csr.num_edges, num_segments=n, num_out=n, chunk_rows=CHUNK_ROWS, max_tile=64,
                 num_exact=exact.numel(), num_performer=performer.numel(), num_nodes=n)
    host = read_plan("test", plan, **sizes)
    rowptr, receiver = csr.rowptr.tolist(), csr.receiver.tolist()
    assert len(host.chunks) >= 3
    assert host.chunks[0].row0 == 0 and host.chunks[-1].row1 == csr.num_edges
    exact_set, perf_set = set(exact.tolist()), set(performer.tolist())
    for prev, chunk in zip([None] + host.chunks[:-1], host.chunks):
        assert prev is None or (prev.row1, prev.seg1) == (chunk.row0, chunk.seg0), "chunks are contiguous"
        assert rowptr[chunk.seg0] == chunk.row0 and rowptr[chunk.seg1] == chunk.row1, "whole segments"
        assert chunk.rows < CHUNK_ROWS + csr.max_degree
        segs = range(chunk.seg0, chunk.seg1)
        local_exact = sorted(s - chunk.seg0 for s in segs if s in exact_set)
        if chunk.exact_plan is None:
            assert not local_exact
        else:
            desc = describe_plan(chunk.exact_plan)
            starts = sorted(st for _, _, tile in desc["packed"] for st in tile) + [m[0] for m in desc["multi"]]
            local_rowptr = chunk.rowptr.tolist()
            non_empty = [s for s in local_exact if local_rowptr[s + 1] > local_rowptr[s]]
            assert sorted(set(starts)) == [local_rowptr[s] for s in non_empty]
        perf = [] if chunk.performer is None else chunk.performer.tolist()
        assert perf == sorted(s - chunk.seg0 for s in segs if s in perf_set)
        # receiver groups: every row of the chunk once, one receiver per group, rows in order
        groups = host.groups[3 * chunk.group0: 3 * (chunk.group0 + chunk.num_groups)].view(-1, 3).tolist()
        rrow = chunk.rrow.tolist()
        seen = []
        for recv, first, end in groups:
            rows = rrow[first:end]
            assert rows == sorted(rows) and all(receiver[chunk.row0 + r] == recv for r in rows)
            seen += rows
        assert sorted(seen) == list(range(chunk.rows))
        assert len({g[0] for g in groups}) == len(groups), "one group per receiver and chunk"


def test_plan_of_another_layer_or_graph_is_rejected():
    case = Case(*make_graph(), "sum")
    args = list(op_args(case, aggr="sum", gate_group="receiver", threshold=THRESHOLD, dropout=0.0, seed=0,
                        dtype=torch.float32))
    csr = case.csr
    exact, performer = csr.segment_split(THRESHOLD + 1)  # another split: other list sizes
    args[15] = build_ntconv_plan(csr.rowptr, csr.receiver, exact, performer, csr.num_nodes, CHUNK_ROWS, 64)
    with pytest.raises(ValueError, match="exact_plan"):
        ntconv_op.ntconv_fwd(*args, chunk_rows=CHUNK_ROWS)


def test_plan_build_checks_segment_ids_and_receivers():
    csr = NeighbourhoodCSR.from_edge_index(make_graph()[0], len(SIZES))
    ids = torch.arange(len(SIZES))
    none = ids[:0]
    with pytest.raises(ValueError, match="exact_segments"):
        build_ntconv_plan(csr.rowptr, csr.receiver, torch.cat([ids, ids[:1]]), none, len(SIZES), 8, 64)
    with pytest.raises(ValueError, match="performer_segments"):
        build_ntconv_plan(csr.rowptr, csr.receiver, none, ids + 1, len(SIZES), 8, 64)
    with pytest.raises(ValueError, match="receiver"):
        build_ntconv_plan(csr.rowptr, csr.receiver, ids, none, 5, 8, 64)


# ------------------------------------------------------- float32 vs float64
@pytest.mark.parametrize("aggr, gate_group", AGGRS)
def test_matches_reference_with_edge_attr_and_dropout(aggr, gate_group):
    """Exact and Performer neighbourhoods (threshold +- 1), dropout, edge features, several chunks."""
    case = Case(*make_graph(), aggr)
    assert_float32_matches(case, aggr=aggr, gate_group=gate_group, threshold=THRESHOLD, dropout=0.3, seed=11)


@pytest.mark.parametrize("aggr, gate_group", [AGGRS[1], AGGRS[4]])
def test_matches_reference_without_edge_attr(aggr, gate_group):
    case = Case(*make_graph(seed=2), aggr, edge_attr=False)
    assert_float32_matches(case, aggr=aggr, gate_group=gate_group, threshold=THRESHOLD, dropout=0.0, seed=0)


@pytest.mark.parametrize("heads, dim, aggr, gate_group", [
    pytest.param(3, 5, "weighted_mean", "receiver", id="H3-D5"),
    pytest.param(4, 1, "max", "receiver", id="H4-D1"),
    pytest.param(1, 40, "weighted_mean", "centre", id="H1-D40")])
def test_head_shapes(heads, dim, aggr, gate_group):
    """Head dims that are not powers of two, D = 1, one wide head (padding in registers only)."""
    case = Case(*make_graph(), aggr, heads=heads, dim=dim)
    assert_float32_matches(case, aggr=aggr, gate_group=gate_group, threshold=THRESHOLD, dropout=0.3, seed=3)


def test_exact_multi_tile_neighbourhood_and_one_chunk_per_hub():
    """Exact attention only: a 70-row neighbourhood (two 64-row blocks) alone in its chunk."""
    case = Case(*make_graph([3, 70, 1, 0, 5, 2], receivers=5), "weighted_mean")
    assert_float32_matches(case, aggr="weighted_mean", gate_group="receiver", threshold=None, dropout=0.2, seed=5,
                           chunk_rows=16)


def test_max_ties_split_the_gradient():
    """W_out rows zeroed for half the channels: there every message equals GELU(b_out) and all tie."""
    case = Case(*make_graph(seed=4), "max")
    case.tensors["w_out"][::2] = 0.0
    assert_float32_matches(case, aggr="max", gate_group="receiver", threshold=THRESHOLD, dropout=0.0, seed=0)


def test_input_mask_skips_input_gradients():
    case = Case(*make_graph(), "gated_sum")
    kw = dict(aggr="gated_sum", gate_group="receiver", threshold=THRESHOLD, dropout=0.0, seed=0)
    _, _, _, grads = run_triton(case, input_mask=(False, True, False), **kw)
    _, want = reference(case, **kw)
    assert grads["centre"].numel() == 0 and grads["edge_attr"].numel() == 0
    for name in ("receiver_term", "w_edge", "w_qkv", "w_out"):
        assert_close(grads[name].cpu(), want[name], name)


def test_saved_state_shapes():
    case = Case(*make_graph(), "weighted_mean")
    kw = dict(gate_group="receiver", threshold=THRESHOLD, dropout=0.0, seed=0)
    out, lse, stats, _ = run_triton(case, aggr="weighted_mean", **kw)
    n, e = case.csr.num_nodes, case.csr.num_edges
    assert out.shape == (n, HEADS * DIM) and lse.shape == (e, HEADS) and stats.shape == (n, HEADS)
    assert lse.dtype == stats.dtype == torch.float32
    receives = (torch.diff(case.rcsr.rowptr) > 0).to(stats.device)
    assert torch.isfinite(stats[receives]).all() and not stats[~receives].any()  # empty receivers: 0


# ------------------------------------------------------------------ dropout
@triton.jit
def _keep_kernel(rows_ptr, out_ptr, seed_word, threshold, NUM_ROWS: tl.constexpr, NUM_CH: tl.constexpr):
    r = tl.arange(0, NUM_ROWS)
    ch = tl.arange(0, NUM_CH)
    keep = dropout_keep(tl.load(rows_ptr + r), ch, seed_word, threshold)
    tl.store(out_ptr + r[:, None] * NUM_CH + ch[None, :], keep.to(tl.int32))


def _keep_mask(rows, channels, seed, p):
    """The Triton dropout_keep of global rows x channels, through a one-program test kernel."""
    out = torch.empty(rows.numel(), channels, dtype=torch.int32, device=DEVICE)
    _keep_kernel[(1,)](rows.to(DEVICE), out, seed_key(seed), drop_threshold(p), NUM_ROWS=rows.numel(),
                       NUM_CH=channels)
    return out.cpu() != 0


@pytest.mark.parametrize("seed", [0, 2 ** 33 + 5, -3], ids=["0", "2^33+5", "negative"])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_mask_equals_the_reference_generator(seed, p):
    """Rows past 2^32 included: the row key uses both 32-bit halves of the packed row."""
    offset = 2 ** 32 - 8
    rows = torch.arange(offset, offset + 16)
    want = counter_dropout_mask(seed, 16, 32, p, row_offset=offset) != 0
    assert torch.equal(_keep_mask(rows, 32, seed, p), want)


def test_dropout_of_the_prologue_is_the_reference_mask():
    """u > 0 everywhere, so z = GELU(u) * mask is 0 exactly where the mask drops; z comes from the
    backward's recompute (the prologue stores it there) and must equal the reference mask."""
    case = Case(*make_graph(), "sum")
    case.tensors["centre"] = case.tensors["centre"].abs() + 1.0
    case.tensors["receiver_term"] = case.tensors["receiver_term"].abs()
    case.tensors["w_edge"] = case.tensors["w_edge"].abs()
    case.tensors["edge_attr"] = case.tensors["edge_attr"].abs()
    args = op_args(case, aggr="sum", gate_group="receiver", threshold=THRESHOLD, dropout=0.4, seed=9,
                   dtype=torch.float32)
    p = ntconv_op.problem("test", dict(zip(ntconv_op.ARG_NAMES, args), chunk_rows=CHUNK_ROWS))
    kept = []
    for chunk in p.plan.chunks:
        qkv = torch.empty((3, chunk.rows, HEADS, DIM), device=DEVICE)
        z = torch.empty((chunk.rows, HEADS * DIM), device=DEVICE)
        ntconv_op.prologue(qkv, z, torch.empty_like(z), p, chunk, ntconv_op.segment_of_rows(chunk), "ieee", False)
        kept.append(z.cpu() != 0)
    want = counter_dropout_mask(9, case.csr.num_edges, HEADS * DIM, 0.4) != 0
    assert torch.equal(torch.cat(kept), want)


def test_same_seed_is_bitwise_reproducible_and_seeds_differ():
    case = Case(*make_graph(), "weighted_mean")
    kw = dict(aggr="weighted_mean", gate_group="centre", threshold=THRESHOLD, dropout=0.3)
    a = run_triton(case, seed=3, **kw)
    b = run_triton(case, seed=3, **kw)
    assert torch.equal(a[0], b[0]) and all(torch.equal(a[3][n], b[3][n]) for n in a[3])
    assert not torch.equal(run_triton(case, seed=4, backward=False, **kw)[0], a[0])


# ------------------------------------------------------------- low precision
# The plain-PyTorch definition in float16 overflows: its Performer backward and weighted_mean's
# dense masked softmax (filled with float16's lowest value) give non-finite gradients, so float16
# is checked on gated_sum with exact attention only.
HALF_CASES = [pytest.param("max", "receiver", torch.bfloat16, THRESHOLD, id="max-bf16"),
              pytest.param("weighted_mean", "centre", torch.bfloat16, THRESHOLD, id="weighted_mean-centre-bf16"),
              pytest.param("gated_sum", "receiver", torch.float16, None, id="gated_sum-exact-fp16")]


@pytest.mark.parametrize("aggr, gate_group, dtype, threshold", HALF_CASES)
def test_half_precision_error_at_most_twice_pytorchs(aggr, gate_group, dtype, threshold):
    """Flash-attention rule: against the float64 truth on the same rounded inputs, the max error
    of the output and of every gradient is at most twice that of the plain-PyTorch definition
    run in ``dtype`` (autograd of nt_reference.nn.ntconv_messages), plus the floor of
    tests/helpers.py.  The graph
    is three times the small one: on ~40 messages one neighbourhood's rounding luck decides a
    max error (docs/kernels.md, "Fused NT layer", tests)."""
    case = Case(*make_graph(SIZES * 3, receivers=24), aggr)
    case.tensors = {n: None if t is None else t.to(dtype).double() for n, t in case.tensors.items()}
    case.projection = case.projection.to(dtype).double()
    kw = dict(aggr=aggr, gate_group=gate_group, threshold=threshold, dropout=0.2, seed=6)
    out, _, _, grads = run_triton(case, dtype=dtype, chunk_rows=48, **kw)
    truth, truth_grads = reference(case, **kw)
    torch_out, torch_grads = reference(case, dtype=dtype, **kw)
    assert out.dtype == dtype
    assert_within_twice_torch_error(out.cpu(), torch_out, truth, "output")
    for name, grad in grads.items():
        assert_within_twice_torch_error(grad.cpu(), torch_grads[name], truth_grads[name], f"gradient of {name}")


def test_autocast_dtypes_float32_node_terms_bf16_parameters():
    """Under autocast the op gets float32 node terms and edge features with bfloat16 parameters:
    out and the parameter gradients come back in bfloat16, the node-term and edge gradients in
    float32, and every error is within the 2x rule against the definition run under CPU autocast."""
    aggr = "gated_sum"
    case = Case(*make_graph(SIZES * 3, receivers=24), aggr)
    case.tensors = {n: None if t is None else t if n in NODE_TENSORS else t.to(torch.bfloat16).double()
                    for n, t in case.tensors.items()}
    case.projection = case.projection.to(torch.bfloat16).double()
    kw = dict(aggr=aggr, gate_group="receiver", threshold=THRESHOLD, dropout=0.2, seed=6)
    out, _, _, grads = run_triton(case, dtype=torch.float32, param_dtype=torch.bfloat16, chunk_rows=48, **kw)
    assert out.dtype == torch.bfloat16
    assert {n: g.dtype for n, g in grads.items()} == {
        n: torch.float32 if n in NODE_TENSORS else torch.bfloat16 for n in grads}
    truth, truth_grads = reference(case, **kw)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch_out, torch_grads = reference(case, dtype=torch.float32, **kw)
    assert_within_twice_torch_error(out.cpu(), torch_out, truth, "output")
    for name, grad in grads.items():
        assert_within_twice_torch_error(grad.cpu(), torch_grads[name], truth_grads[name], f"gradient of {name}")


# --------------------------------------------------------------- edge cases
@pytest.mark.parametrize("num_nodes", [0, 5], ids=["no-nodes", "all-isolated"])
def test_graph_without_edges(num_nodes):
    case = Case(torch.empty(2, 0, dtype=torch.long), num_nodes, "weighted_mean")
    out, lse, stats, grads = run_triton(case, aggr="weighted_mean", gate_group="receiver", threshold=THRESHOLD,
                                        dropout=0.5, seed=1)
    assert out.shape == (num_nodes, HEADS * DIM) and not out.any() and lse.shape == (0, HEADS)
    for name, grad in grads.items():
        assert grad.shape == case.tensors[name].shape and not grad.any(), name


@pytest.mark.parametrize("aggr, gate_group", [AGGRS[0], AGGRS[3]])
def test_nan_stays_in_its_neighbourhood(aggr, gate_group):
    """A NaN in one edge_attr row of centre 6 (6 rows, Performer) reaches only its receivers."""
    case = Case(*make_graph(), aggr)
    kw = dict(aggr=aggr, gate_group=gate_group, threshold=THRESHOLD, dropout=0.0, seed=0, backward=False)
    clean = run_triton(case, **kw)[0].cpu()
    own = case.edge_index[0] == 6
    case.tensors["edge_attr"] = case.tensors["edge_attr"].clone()
    case.tensors["edge_attr"][int(own.nonzero()[0]), 1] = float("nan")
    out = run_triton(case, **kw)[0].cpu()
    reached = torch.zeros(len(SIZES), dtype=torch.bool)
    reached[case.edge_index[1, own]] = True
    assert torch.isnan(out[reached]).any(dim=1).all()
    assert torch.equal(out[~reached], clean[~reached])


BAD = [
    ("aggr", dict(aggr="median"), "aggr"),
    ("gate_group", dict(gate_group="edge"), "gate_group"),
    ("heads", dict(heads=3), "heads"),
    ("w_out-width", dict(w_out=lambda a: a["w_out"][:8]), "w_out"),
    ("w_qkv-dtype", dict(w_qkv=lambda a: a["w_qkv"].double()), "w_qkv"),
    ("edge_attr-without-w_edge", dict(w_edge=None), "edge_attr and w_edge"),
    ("edge_attr-rows", dict(edge_attr=lambda a: a["edge_attr"][1:]), "edge_attr"),
    ("seed-float", dict(seed=torch.tensor(1.0)), "seed"),
    ("dropout", dict(dropout=1.0), "dropout"),
    ("no-projection", dict(projection=None), "projection"),
    ("projection-width", dict(projection=lambda a: a["projection"][:, :3]), "projection"),
    ("perm-length", dict(perm=lambda a: a["perm"][1:]), "perm"),
    ("exact-segment-id", dict(exact_segments=lambda a: a["exact_segments"] + 100), "exact_segments"),
]


@pytest.mark.parametrize("overrides, name", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_names_the_argument(overrides, name):
    case = Case(*make_graph(), "weighted_mean")
    args = dict(zip(ntconv_op.ARG_NAMES, op_args(case, aggr="weighted_mean", gate_group="receiver",
                                                 threshold=THRESHOLD, dropout=0.0, seed=0, dtype=torch.float32)))
    args.update({k: v(args) if callable(v) else v for k, v in overrides.items()})
    with pytest.raises((ValueError, TypeError), match=rf"ntconv_fwd: .*{name}|ntconv_fwd: {name}"):
        ntconv_op.ntconv_fwd(*args.values(), chunk_rows=CHUNK_ROWS)


# ------------------------------------------------------ registration and CPU op
@pytest.mark.skipif(not HAS_CPU_OP, reason="the nt_kernels::ntconv_fwd schema and CPU kernel are not built yet")
def test_registered_as_the_cuda_kernel_of_the_op():
    """``import nt_kernels`` registered them (backends.register_backends -> triton.register)."""
    for name in ("ntconv_fwd", "ntconv_bwd"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"nt_kernels::{name}", "CUDA"), name


@pytest.mark.skipif(not HAS_CPU_OP, reason="the nt_kernels::ntconv_fwd schema and CPU kernel are not built yet")
@pytest.mark.parametrize("aggr, gate_group", [AGGRS[2], AGGRS[3], AGGRS[4]])
def test_matches_the_cpu_fused_op(aggr, gate_group):
    """Same inputs, same seed: the CPU C++ op and the Triton implementation agree (float32), saved
    state included (the exact rows' lse, the per-receiver statistics)."""
    case = Case(*make_graph(), aggr)
    kw = dict(aggr=aggr, gate_group=gate_group, threshold=THRESHOLD, dropout=0.3, seed=2 ** 40 + 3)
    out, lse, stats, grads = run_triton(case, **kw)
    args = op_args(case, dtype=torch.float32, **kw)
    args = tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)
    cpu_out, cpu_lse, cpu_stats = torch.ops.nt_kernels.ntconv_fwd(*args)
    cpu_grads = torch.ops.nt_kernels.ntconv_bwd(case.grad_out.float(), cpu_out, cpu_lse, cpu_stats, *args,
                                                [True, True, True])
    exact_rows = torch.zeros(case.csr.num_edges, dtype=torch.bool)
    for s in case.csr.segment_split(THRESHOLD)[0].tolist():
        exact_rows[case.csr.rowptr[s]:case.csr.rowptr[s + 1]] = True
    assert_close(lse.cpu()[exact_rows], cpu_lse[exact_rows].double(), "lse")
    assert_close(stats.cpu(), cpu_stats.double(), "stats")
    assert_close(out.cpu(), cpu_out.double(), "output")
    for name, grad in zip(GRAD_NAMES, cpu_grads):
        assert_close(grads[name].cpu(), grad.double(), f"gradient of {name}")


# ---------------------------------------------------------------- CUDA only
needs_cuda = pytest.mark.skipif(not (HAS_CUDA and HAS_CPU_OP), reason="needs a CUDA device and the built op")


def hub_case(aggr, dtype=torch.float64):
    """A 3,000-row hub (Performer, split over several chunks of the default plan's size class),
    a 70-row exact neighbourhood, many small ones; inputs rounded to ``dtype``."""
    case = Case(*make_graph([3000, 70, 1, 2, 5, 0, 3, 1, 9, 4] * 3, receivers=25, seed=7), aggr)
    case.tensors = {n: None if t is None else t.to(dtype).double() for n, t in case.tensors.items()}
    case.projection = case.projection.to(dtype).double()
    return case


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("aggr, gate_group", AGGRS)
def test_cuda_hub_graph_float32(aggr, gate_group):
    """Compiled, through the dispatcher, with the op's own plan (default chunk size)."""
    assert_float32_matches(hub_case(aggr), aggr=aggr, gate_group=gate_group, threshold=THRESHOLD, dropout=0.1,
                           seed=123)


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("aggr, gate_group", AGGRS)
def test_cuda_hub_graph_bf16(aggr, gate_group):
    case = hub_case(aggr, torch.bfloat16)
    kw = dict(aggr=aggr, gate_group=gate_group, threshold=THRESHOLD, dropout=0.1, seed=123)
    out, _, _, grads = run_triton(case, dtype=torch.bfloat16, **kw)
    truth, truth_grads = reference(case, **kw)
    torch_out, torch_grads = reference(case, dtype=torch.bfloat16, **kw)
    assert_within_twice_torch_error(out.cpu(), torch_out, truth, "output")
    for name, grad in grads.items():
        assert_within_twice_torch_error(grad.cpu(), torch_grads[name], truth_grads[name], f"gradient of {name}")


@needs_cuda
@pytest.mark.cuda
def test_cuda_matches_the_cpu_op_through_the_public_function():
    """nt_kernels.ops.ntconv on CUDA (the Triton kernels, with the plan the public op passes)
    against the same call on CPU (the C++ kernels)."""
    from nt_kernels.ops import ntconv

    case = hub_case("gated_sum")
    results = []
    for device in ("cpu", "cuda"):
        t = {n: None if v is None else v.to(device, torch.float32).requires_grad_() for n, v in case.tensors.items()}
        out = ntconv(t["centre"], t["receiver_term"], case.csr.to(device), t["w_qkv"], t["b_qkv"], t["w_out"],
                     t["b_out"], heads=case.heads, aggr="gated_sum", edge_attr=t["edge_attr"], w_edge=t["w_edge"],
                     projection=case.projection.to(device, torch.float32), threshold=THRESHOLD, dropout=0.2, seed=9)
        out.backward(case.grad_out.to(device, torch.float32))
        results.append([out.detach().cpu()] + [t[n].grad.cpu() for n in GRAD_NAMES])
    for name, got, want in zip(("output",) + GRAD_NAMES, results[1], results[0]):
        assert_close(got, want.double(), name)


@needs_cuda
@pytest.mark.cuda
def test_cuda_runs_are_bitwise_identical():
    edge_index, n = make_graph([500, 3, 1, 8, 2] * 20, receivers=60, seed=8)
    case = Case(edge_index, n, "weighted_mean")
    kw = dict(aggr="weighted_mean", gate_group="receiver", threshold=THRESHOLD, dropout=0.2, seed=5)
    a, b = run_triton(case, **kw), run_triton(case, **kw)
    assert torch.equal(a[0], b[0]) and all(torch.equal(a[3][k], b[3][k]) for k in a[3])


@pytest.mark.skipif(not HAS_CPU_OP, reason="the nt_kernels::ntconv_fwd schema and CPU kernel are not built yet")
def test_check_suite_runs(tmp_path):
    """`nt-kernels check --suites ntconv` (the suite the GPU script runs on CUDA) on this device."""
    import json
    import subprocess
    import sys

    out = tmp_path / "check.json"
    done = subprocess.run([sys.executable, "-m", "nt_kernels.cli", "check", "--device", DEVICE.type, "--suites",
                           "ntconv", "--dims", "1", "--dtypes", "float32", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    doc = json.loads(out.read_text())
    assert done.returncode == 0 and doc["ok"], done.stdout[-2000:]
    assert sum(r["status"] == "pass" for r in doc["rows"]) == 13  # 2 graphs x 6 aggregators + determinism


def _spec_kernels():
    from nt_kernels.backends.triton import ntconv_gemm, ntconv_grad, ntconv_reduce

    return {ntconv_gemm._prologue_kernel, ntconv_gemm._rows_gemm_kernel, ntconv_grad._message_grad_kernel,
            ntconv_reduce._gate_kernel, ntconv_reduce._segment_softmax_kernel, ntconv_reduce._segment_sum_kernel,
            ntconv_reduce._receive_kernel}


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_compile_specs_name_every_kernel_argument(dtype):
    """The AOT compile specs (ntconv_specs.py) type or fix every argument of their kernel exactly once."""
    from nt_kernels.backends.triton.ntconv_specs import compile_specs

    specs = compile_specs(dtype)
    assert {s.kernel for s in specs} == _spec_kernels(), "every fused-layer kernel has specs"
    for spec in specs:
        from_configs = {key for config in spec.kernel.configs for key in config.kwargs}
        named = [*spec.types, *spec.constexprs, *from_configs]
        assert sorted(named) == sorted(spec.kernel.fn.arg_names), spec.name
