"""The fused NT layer's CUDA implementation (nt_kernels/backends/triton/ntconv_*) on small graphs.

Without a GPU the Triton kernels run on CPU tensors under TRITON_INTERPRET=1
(conftest.py), called through the implementation functions directly (the
dispatcher sends CPU tensors to the C++ kernel instead).  Their Performer
stage then dispatches to the CPU C++ Performer kernel: the CUDA Performer
kernel is not exercised here.  Every case checks the output and all eight
gradients against ``nt_reference.nn.ntconv_messages`` in float64 (and
against the CPU fused op), with chunks small enough that
every graph spans several chunks (receiver groups merged across chunks, a
neighbourhood larger than a chunk).  With a GPU the same cases run compiled
through ``torch.ops.nt_kernels.ntconv_fwd`` / ``ntconv_bwd``, plus the
CUDA-only checks at the end.
"""
import copy
import functools
import math

import pytest
import torch

import nt_kernels as nk
from helpers import assert_close, assert_low_precision
from nt_kernels import NeighbourhoodCSR
from nt_kernels.csr import reversed_csr
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
    """(edge_index in shuffled order, num_nodes): centre j sends sizes[j] edges to random receivers;
    ``receivers=None``: every edge to a receiver of its own (num_nodes = max(len(sizes), E)), the
    graph of ``max`` in low precision, where no rounding can swap which message is the maximum."""
    gen = torch.Generator().manual_seed(seed)
    num_nodes = len(sizes)
    if receivers is None:
        centre = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
        num_nodes = max(num_nodes, centre.numel())
        edge_index = torch.stack([centre, torch.randperm(num_nodes, generator=gen)[:centre.numel()]])
    else:
        edge_index = torch.cat([torch.stack([torch.full((n,), j), torch.randint(0, receivers, (n,), generator=gen)])
                                for j, n in enumerate(sizes)], 1)
    return edge_index[:, torch.randperm(edge_index.shape[1], generator=gen)], num_nodes


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


def assert_matches_reference_and_cpu_op(case, result, **kw):
    """``result`` (run_triton's): output and every gradient against the float64 definition, and
    everything against the CPU op (assert_matches_cpu_op)."""
    want, want_grads = reference(case, **kw)
    assert_close(result[0].cpu(), want, "output")
    for name, grad in result[3].items():
        assert_close(grad.cpu(), want_grads[name], f"gradient of {name}")
    assert_matches_cpu_op(case, result, **kw)


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
        assert_reduction_lists(chunk, receiver, rowptr, host.piece_rows)


def _items(red):
    """(slot rows, dest, first, end) of every work item of a reduction list, class by class."""
    out = []
    for slot_rows, item0, num in red.classes():
        out += [(slot_rows, *t) for t in red.items[3 * item0:3 * (item0 + num)].view(-1, 3).tolist()]
    return out


def assert_reduction_lists(chunk, receiver, rowptr, piece_rows):
    """Both reduction lists of a chunk: every row once, grouped by receiver (through rrow) / by
    segment, rows in order, items of at most piece_rows rows in their size class, whole groups
    with their destination and split groups as consecutive scratch slots, pieces in row order."""
    rrow = chunk.rrow.tolist()
    lists = [(chunk.receivers, lambda pos: rrow[pos], lambda r: receiver[chunk.row0 + r]),
             (chunk.segments, lambda pos: pos,
              lambda r: next(s for s in range(chunk.seg0, chunk.seg1) if rowptr[s + 1] > chunk.row0 + r) - chunk.seg0)]
    for red, row_of, dest_of in lists:
        groups, slots, seen = {}, {}, []
        for slot_rows, dest, first, end in _items(red):
            rows = [row_of(pos) for pos in range(first, end)]
            assert 0 < end - first <= min(slot_rows, piece_rows) and (slot_rows == 1 or end - first > slot_rows // 2)
            assert rows == sorted(rows) and len({dest_of(r) for r in rows}) == 1
            if dest >= 0:
                assert dest == dest_of(rows[0]) and dest not in groups, "a whole group: one item"
                groups[dest] = None
            else:
                slots[-1 - dest] = (first, rows)
            seen += rows
        assert sorted(seen) == list(range(chunk.rows)), "every row of the chunk once"
        splits = red.splits[3 * red.split0:3 * (red.split0 + red.num_split)].view(-1, 3).tolist()
        assert sorted(s for _, s0, s1 in splits for s in range(s0, s1)) == list(range(red.slots)) == sorted(slots)
        for dest, s0, s1 in splits:
            assert s1 - s0 >= 2 and dest not in groups
            groups[dest] = None
            pieces = [slots[s] for s in range(s0, s1)]
            assert [f for f, _ in pieces] == sorted(f for f, _ in pieces), "slots in row order"
            assert {dest_of(r) for _, rows in pieces for r in rows} == {dest}
            assert all(len(rows) == piece_rows for _, rows in pieces[:-1])


@pytest.mark.parametrize("piece_rows", [1, 2, 4, 64], ids=["P1", "P2", "P4", "P64"])
def test_plan_reduction_lists_split_groups_into_pieces(piece_rows):
    """Groups of 0, 1 and many rows, a 40-row neighbourhood and receivers spanning chunks, with
    pieces of P rows: items, size classes and split groups of both lists."""
    edge_index, n = make_graph([40, 1, 0, 3, 9, 2, 17], receivers=4, seed=6)
    csr = NeighbourhoodCSR.from_edge_index(edge_index, n)
    exact, performer = csr.segment_split(THRESHOLD)
    plan = build_ntconv_plan(csr.rowptr, csr.receiver, exact, performer, n, 16, 64, piece_rows=piece_rows)
    host = read_plan("test", plan, num_rows=csr.num_edges, num_segments=n, num_out=n, chunk_rows=16, max_tile=64,
                     num_exact=exact.numel(), num_performer=performer.numel(), num_nodes=n)
    assert host.piece_rows == piece_rows and len(host.chunks) >= 3
    receiver, rowptr = csr.receiver.tolist(), csr.rowptr.tolist()
    for chunk in host.chunks:
        assert_reduction_lists(chunk, receiver, rowptr, piece_rows)
    splits = sum(chunk.receivers.num_split + chunk.segments.num_split for chunk in host.chunks)
    assert (splits > 0) == (piece_rows < 40)


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


# --------------------------------------- segmented reductions (ntconv_reduce.py)
# Segments of 40 (alone in its chunk), 17, 9, 3, 2, 1 and 0 rows into 4 receivers, chunks of 16 rows:
# receivers span chunks, and with small pieces both lists have split groups.
REDUCE_SIZES = [40, 1, 0, 3, 9, 2, 17]
REDUCE_CASES = [pytest.param("receiver", mode, id=f"receiver-{name}")
                for mode, name in enumerate(("sum", "gated", "softmax", "max"))]
REDUCE_CASES += [pytest.param("segment", 0, id="segment-sum"), pytest.param("segment", 4, id="segment-lse")]


def _reduce_plan(piece_rows, sizes=REDUCE_SIZES, receivers=4, chunk_rows=16):
    edge_index, n = make_graph(sizes, receivers=receivers, seed=6)
    csr = NeighbourhoodCSR.from_edge_index(edge_index, n).to(DEVICE)
    exact, performer = csr.segment_split(THRESHOLD)
    plan = build_ntconv_plan(csr.rowptr, csr.receiver, exact, performer, n, chunk_rows, 64, piece_rows=piece_rows)
    return csr, read_plan("test", plan, num_rows=csr.num_edges, num_segments=n, num_out=n, chunk_rows=chunk_rows,
                          max_tile=64, num_exact=exact.numel(), num_performer=performer.numel(), num_nodes=n)


def _reduce_inputs(e, heads, dim, mode, seed=0):
    """x (E, W) in packed order from a few values (max: many ties, channel 0 all negative where GELU
    is not monotonic, one NaN) and the gates (E, H)."""
    gen = torch.Generator().manual_seed(seed)
    width = 2 * heads * dim if mode in (1, 2) else heads * dim
    x = torch.randint(-4, 5, (e, width), generator=gen).double() / 2
    if mode == 3:
        x[:, 0] = -x[:, 0].abs() - 0.5
        x[5, 1] = float("nan")
    else:
        x += torch.randn(e, width, generator=gen, dtype=torch.float64) / 8
    return x, torch.randn(e, heads, generator=gen, dtype=torch.float64)


def _run_reduce(csr, host, by, mode, x, gate, heads):
    """Every chunk's reduction list merged into a fresh State (x and the gates float32 on DEVICE)."""
    from nt_kernels.backends.triton.ntconv_reduce import AGG_LSE, State, reduce

    n = csr.num_nodes
    channels = x.shape[1] // 2 if mode in (1, 2) else x.shape[1]
    state = State.empty(n, channels, mode, torch.empty(0, device=DEVICE))
    x32, gate32 = x.float().to(DEVICE), gate.float().to(DEVICE)
    for chunk in host.chunks:
        rows = slice(chunk.row0, chunk.row1)
        if by == "receiver":
            reduce(state, x32[rows].contiguous(), chunk.receivers, channels=channels, heads=heads, row=x.shape[1],
                   mode=mode, rrow=chunk.rrow, gate=gate32[rows].contiguous(), apply_gelu=True)
        else:  # chunk-local segments: the state's rows from seg0 on
            local = State(state.acc[chunk.seg0:], state.run_max[chunk.seg0:], state.run_sum[chunk.seg0:])
            reduce(local, x32[rows].contiguous(), chunk.segments, channels=channels,
                   heads=channels if mode == AGG_LSE else heads, row=x.shape[1], mode=mode)
    return state


def _amax(dest, values, n):
    """Per destination (n rows) the largest of ``values`` (E, W); -inf where none."""
    out = torch.full((n, values.shape[1]), float("-inf"), dtype=values.dtype)
    return out.scatter_reduce_(0, dest[:, None].expand_as(values), values, "amax")


def _expected_reduce(dest, n, mode, x, gate, heads):
    """float64 truth per destination (messages GELU(x)): (acc, M, L) or (peak, tie key, tie count)."""
    gelu = torch.nn.functional.gelu
    if mode == 4:  # log-sum-exp of x itself per (segment, channel)
        m = _amax(dest, x, n)
        return m, torch.zeros_like(m).index_add_(0, dest, torch.exp(x - m[dest]))
    if mode == 3:
        m = gelu(x)
        peak = _amax(dest, torch.nan_to_num(m, nan=-9.0), n)
        at = m == peak[dest]
        key = _amax(dest, torch.where(at, x, -9.0), n)
        ties = torch.zeros_like(peak).index_add_(0, dest, (at & (x == key[dest])).double())
        nan = torch.zeros_like(peak).index_add_(0, dest, torch.isnan(x).double()) > 0
        return torch.where(nan, float("nan"), peak), key, ties
    if mode == 0:
        return (torch.zeros(n, x.shape[1], dtype=torch.float64).index_add_(0, dest, gelu(x)),)
    c = x.shape[1] // 2
    value = gelu(x.view(-1, heads, 2, c // heads)[:, :, 1])  # the value halves (E, H, D)
    if mode == 1:
        return (torch.zeros(n, heads, c // heads, dtype=torch.float64).index_add_(
            0, dest, gate[:, :, None] * value).view(n, c),)
    m = _amax(dest, gate, n)
    p = torch.exp(gate - m[dest])
    acc = torch.zeros(n, heads, c // heads, dtype=torch.float64).index_add_(0, dest, p[:, :, None] * value)
    per_channel = (m, torch.zeros_like(m).index_add_(0, dest, p))  # M and L per head, kept per channel
    return acc.view(n, c), *(t.repeat_interleave(c // heads, 1) for t in per_channel)


@pytest.mark.parametrize("heads, dim, piece_rows", [(2, 3, 1), (2, 3, 3), (2, 3, 64), (3, 100, 3), (3, 100, 64)],
                         ids=["C6-P1", "C6-P3", "C6-P64", "C300-P3", "C300-P64"])
@pytest.mark.parametrize("by, mode", REDUCE_CASES)
def test_reduce_kernels_against_float64(by, mode, heads, dim, piece_rows):
    """The item and merge kernels alone, every mode the op uses, by receiver (gathered through rrow,
    GELU applied) and by segment (direct): groups of 0, 1 and many rows, pieces of 1, 3 (a class that
    is not a power of two) or 64 rows, receivers spanning chunks; C = 300: two channel blocks (a head
    across their boundary) and slots of 32 and 64 rows reduced in 2 and 4 steps of 16 rows.  Against
    float64 index reductions (max: the peak, the tie key on the pre-activations and the tie count
    exactly, a NaN kept in its receiver), and bitwise equal on a rerun."""
    csr, host = _reduce_plan(piece_rows)
    x, gate = _reduce_inputs(csr.num_edges, heads, dim, mode)
    if by == "receiver":
        dest = csr.receiver.cpu()
    else:
        dest = torch.repeat_interleave(torch.arange(csr.num_nodes), torch.diff(csr.rowptr.cpu()))
        x = x[:, :heads] if mode == 4 else x  # the centre softmax runs on the (E, H) gates
    state = _run_reduce(csr, host, by, mode, x, gate, heads)
    n = csr.num_nodes
    if mode == 0 and by == "segment":
        want = (torch.zeros(n, x.shape[1], dtype=torch.float64).index_add_(0, dest, x),)
    else:
        want = _expected_reduce(dest, n, mode, x, gate, heads)
    if mode == 3:
        got = (state.acc, state.count[1], state.count[0])
        assert (want[2] > 1).any(), "the inputs must produce ties"
    elif mode == 4:
        got = (state.run_max, state.run_sum)
    else:
        got = (state.acc, state.run_max, state.run_sum)[:len(want)]
    received = (torch.bincount(dest, minlength=n) > 0)[:, None]
    nan = torch.isnan(want[0])
    assert torch.equal(torch.isnan(got[0].cpu()), nan), "NaN exactly where a message is NaN"
    for name, g, w in zip(("acc or peak", "max or key", "sum or ties"), got, want):
        keep = (received & ~nan).expand_as(w) if w.shape == nan.shape else received.expand_as(w)
        g = g.cpu()
        assert_close(g[keep], w[keep], name)
        if mode == 3 and name != "acc or peak":  # keys and counts exactly
            assert torch.equal(g[keep].double(), w[keep]), name
    again = _run_reduce(csr, host, by, mode, x, gate, heads)
    for a, b in ((state.acc, again.acc), (state.run_max, again.run_max), (state.run_sum, again.run_sum),
                 (state.count, again.count)):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


def piece_plan(case, piece_rows, *, threshold=THRESHOLD, chunk_rows=CHUNK_ROWS):
    """The op's plan for ``case`` built with pieces of ``piece_rows`` rows (passed as exact_plan)."""
    from nt_kernels.backends.triton.ntconv_plan import default_chunk_rows
    from nt_kernels.backends.triton.plan import max_packed_tile, shared_memory_per_block

    csr, c = case.csr.to(DEVICE), case.tensors["centre"].shape[1]
    exact, performer = csr.segment_split(math.inf if threshold is None else threshold)
    max_tile = max_packed_tile(torch.float32, c // case.heads, shared_memory_per_block(DEVICE))
    rows = default_chunk_rows(c) if HAS_CUDA else chunk_rows
    return build_ntconv_plan(csr.rowptr, csr.receiver, exact, performer, case.rcsr.rowptr.numel() - 1, rows,
                             max_tile, perm=csr.perm, piece_rows=piece_rows)


@pytest.mark.parametrize("aggr, gate_group", AGGRS)
def test_pieces_of_two_rows_match_reference_cpu_op_and_rerun_bitwise(aggr, gate_group):
    """Every group above two rows split into pieces (merge kernel in every mode, receivers and
    segments spanning pieces and chunks): output and all eight gradients against the float64
    definition and the CPU op; bitwise equal on a rerun."""
    case = Case(*make_graph(), aggr)
    kw = dict(aggr=aggr, gate_group=gate_group, threshold=THRESHOLD, dropout=0.3, seed=7)
    plan = piece_plan(case, 2)
    result = run_triton(case, plan=plan, **kw)
    assert_matches_reference_and_cpu_op(case, result, **kw)
    again = run_triton(case, plan=plan, **kw)
    assert torch.equal(result[0], again[0]) and all(torch.equal(result[3][n], again[3][n]) for n in result[3])


@pytest.mark.parametrize("aggr, gate_group", [AGGRS[2], AGGRS[3], AGGRS[4]])
def test_receiver_groups_above_the_piece_size(aggr, gate_group):
    """The default plan (pieces of 64 rows) on a graph whose two receivers get about 75 rows each from
    a 150-row neighbourhood in one chunk, and an 80-row neighbourhood: items of every size class,
    split receiver and segment groups, against the float64 definition."""
    case = Case(*make_graph([150, 3, 1, 0, 80], receivers=2, seed=3), aggr, edge_attr=False)
    p = ntconv_op.problem("test", dict(zip(ntconv_op.ARG_NAMES, op_args(
        case, aggr=aggr, gate_group=gate_group, threshold=THRESHOLD, dropout=0.0, seed=0, dtype=torch.float32)),
        chunk_rows=64))
    assert p.plan.piece_rows == 64 and any(chunk.receivers.num_split for chunk in p.plan.chunks)
    assert_float32_matches(case, aggr=aggr, gate_group=gate_group, threshold=THRESHOLD, dropout=0.1, seed=2,
                           chunk_rows=64)


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


@pytest.mark.parametrize("repeats, heads, dim", [(2, 1, 3), (3, 3, 3), (2, 2, 5)],
                         ids=["twice-C3", "thrice-C9", "twice-C10"])
def test_max_ties_at_several_layouts_match_the_cpu_op_and_reference(repeats, heads, dim):
    """Every edge repeated (identical messages at one receiver, at rows far apart) and half of
    W_out's rows zero: ties decided on the pre-activations (docs/design.md, "Max ties") give the
    reference's output and gradients, and the CPU op's tie counts and keys (tests/test_isa.py
    runs the same layouts through the composition and the reference)."""
    edge_index, n = make_graph(sizes=[3, 1, 4, 2, 7, 0, 2], receivers=5, seed=repeats)
    edge_index = edge_index.repeat(1, repeats)[:, torch.randperm(edge_index.shape[1] * repeats,
                                                                 generator=torch.Generator().manual_seed(0))]
    case = Case(edge_index, n, "max", heads=heads, dim=dim)
    case.tensors["w_out"][::2] = 0.0
    kw = dict(aggr="max", gate_group="receiver", threshold=THRESHOLD, dropout=0.0, seed=0)
    result = run_triton(case, **kw)
    assert (result[2][0] > 1).any(), "the layout must produce ties"
    assert_matches_reference_and_cpu_op(case, result, **kw)


def test_input_mask_skips_input_gradients():
    case = Case(*make_graph(), "gated_sum")
    kw = dict(aggr="gated_sum", gate_group="receiver", threshold=THRESHOLD, dropout=0.0, seed=0)
    _, _, _, grads = run_triton(case, input_mask=(False, True, False), **kw)
    _, want = reference(case, **kw)
    assert grads["centre"].numel() == 0 and grads["edge_attr"].numel() == 0
    for name in ("receiver_term", "w_edge", "w_qkv", "w_out"):
        assert_close(grads[name].cpu(), want[name], name)


def test_saved_state_shapes():
    """out and stats as on CPU; lse empty: the backward (which the gradient tests run on it) recomputes it."""
    case = Case(*make_graph(), "weighted_mean")
    kw = dict(gate_group="receiver", threshold=THRESHOLD, dropout=0.0, seed=0)
    out, lse, stats, _ = run_triton(case, aggr="weighted_mean", **kw)
    n = case.csr.num_nodes
    assert out.shape == (n, HEADS * DIM) and lse.shape == (0, HEADS) and stats.shape == (n, HEADS)
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_same_seed_is_bitwise_reproducible_and_seeds_differ(dtype):
    case = Case(*make_graph(), "weighted_mean")
    kw = dict(aggr="weighted_mean", gate_group="centre", threshold=THRESHOLD, dropout=0.3, dtype=dtype)
    a = run_triton(case, seed=3, **kw)
    b = run_triton(case, seed=3, **kw)
    assert torch.equal(a[0], b[0]) and all(torch.equal(a[3][n], b[3][n]) for n in a[3])
    assert not torch.equal(run_triton(case, seed=4, backward=False, **kw)[0], a[0])


# ------------------------------------------------------------- low precision
def assert_low_precision_result(case, out, grads, dtype, kw, autocast=False):
    """The accuracy rule of tests/helpers.py for the output and every gradient of a run in ``dtype``
    (or under bfloat16 autocast on float32 inputs), against the plain-PyTorch definition
    (nt_reference.nn.ntconv_messages) run the same way, in float32 and in float64."""
    truth = reference(case, **kw)
    float32 = reference(case, dtype=torch.float32, **kw)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        low = reference(case, dtype=torch.float32 if autocast else dtype, **kw)

    @functools.cache
    def mixed():  # in float32 on the inputs rounded to dtype, rounded to dtype
        rounded = copy.copy(case)
        rounded.tensors = {n: None if t is None else t.to(dtype).double() for n, t in case.tensors.items()}
        rounded.projection = case.projection.to(dtype).double()
        out, grads = reference(rounded, dtype=torch.float32, **kw)
        return out.to(dtype), {n: g.to(dtype) for n, g in grads.items()}
    assert_low_precision(out.cpu(), truth[0], low[0], float32[0], "output", dtype=dtype,
                         torch_mixed=lambda: mixed()[0])
    for name, grad in grads.items():
        assert_low_precision(grad.cpu(), truth[1][name], low[1][name], float32[1][name], f"gradient of {name}",
                             dtype=dtype, torch_mixed=lambda n=name: mixed()[1][n])


# The plain-PyTorch definition in float16 overflows: its Performer backward and weighted_mean's
# dense masked softmax (filled with float16's lowest value) give non-finite gradients, so float16
# is checked on gated_sum with exact attention.  max runs on a graph where every message has a
# receiver of its own: with several messages per receiver, rounding swaps which one is the maximum
# and PyTorch's bfloat16 gradient error becomes O(1), a bound that passes a zeroed gradient.
HALF_CASES = [pytest.param("max", "receiver", torch.bfloat16, THRESHOLD, id="max-bf16"),
              pytest.param("weighted_mean", "centre", torch.bfloat16, THRESHOLD, id="weighted_mean-centre-bf16"),
              pytest.param("gated_sum", "receiver", torch.float16, None, id="gated_sum-exact-fp16")]


@pytest.mark.parametrize("aggr, gate_group, dtype, threshold", HALF_CASES)
def test_half_precision_error_at_most_twice_pytorchs(aggr, gate_group, dtype, threshold):
    """Flash-attention rule (tests/helpers.py): against the float64 truth on the same rounded
    inputs, the max error of the output and of every gradient is at most twice that of the
    plain-PyTorch definition run in ``dtype`` (autograd of nt_reference.nn.ntconv_messages), plus
    the floor.  The graph is three times the small one: on ~40 messages one neighbourhood's
    rounding luck decides a max error (docs/kernels-ntconv-cuda-checks.md, "Tests without a GPU")."""
    case = Case(*make_graph(SIZES * 3, receivers=None if aggr == "max" else 24), aggr)
    case.tensors = {n: None if t is None else t.to(dtype).double() for n, t in case.tensors.items()}
    case.projection = case.projection.to(dtype).double()
    kw = dict(aggr=aggr, gate_group=gate_group, threshold=threshold, dropout=0.2, seed=6)
    out, _, _, grads = run_triton(case, dtype=dtype, chunk_rows=48, **kw)
    assert out.dtype == dtype
    assert_low_precision_result(case, out, grads, dtype, kw)


def test_autocast_dtypes_float32_node_terms_bf16_parameters():
    """Under autocast the op gets float32 node terms and edge features with bfloat16 parameters:
    out and the parameter gradients come back in bfloat16, the node-term and edge gradients in
    float32, and every error is within the bfloat16 rule against the definition run under CPU autocast."""
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
    assert_low_precision_result(case, out, grads, torch.bfloat16, kw, autocast=True)


# --------------------------------------------------------------- edge cases
@pytest.mark.parametrize("num_nodes", [0, 5], ids=["no-nodes", "all-isolated"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_graph_without_edges(num_nodes, dtype, monkeypatch):
    """No messages: zero output and gradients, on the stored path (fp32) and the opt-in recompute path
    (bf16)."""
    monkeypatch.setenv("NT_KERNELS_NTCONV_RECOMPUTE", "1")
    case = Case(torch.empty(2, 0, dtype=torch.long), num_nodes, "weighted_mean")
    out, lse, stats, grads = run_triton(case, aggr="weighted_mean", gate_group="receiver", threshold=THRESHOLD,
                                        dropout=0.5, seed=1, dtype=dtype)
    assert out.shape == (num_nodes, HEADS * DIM) and not out.any() and lse.shape == (0, HEADS)
    for name, grad in grads.items():
        assert grad.shape == case.tensors[name].shape and not grad.any(), name


@pytest.mark.parametrize("aggr, gate_group, dtype", [
    pytest.param("sum", "receiver", torch.float32, id="sum-fp32"),
    *[pytest.param("weighted_mean", "receiver", dtype, id=f"weighted_mean-receiver-{name}")
      for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16))]])
def test_nan_stays_in_its_neighbourhood(aggr, gate_group, dtype):
    """A NaN in one edge_attr row of centre 6 (6 rows, Performer) makes each of its receivers' rows
    NaN and leaves every other row as in the clean run."""
    case = Case(*make_graph(), aggr)
    kw = dict(aggr=aggr, gate_group=gate_group, threshold=THRESHOLD, dropout=0.0, seed=0, backward=False,
              dtype=dtype)
    clean = run_triton(case, **kw)[0].cpu()
    own = case.edge_index[0] == 6
    case.tensors["edge_attr"] = case.tensors["edge_attr"].clone()
    case.tensors["edge_attr"][int(own.nonzero()[0]), 1] = float("nan")
    out = run_triton(case, **kw)[0].cpu()
    reached = torch.zeros(len(SIZES), dtype=torch.bool)
    reached[case.edge_index[1, own]] = True
    assert torch.isnan(out[reached]).any(dim=1).all()
    for node in (~reached).nonzero().flatten().tolist():
        assert torch.equal(out[node], clean[node]), f"the NaN reached node {node}"


@pytest.mark.parametrize("aggr, dtype", [("sum", torch.float32), ("gated_sum", torch.float32),
                                         ("sum", torch.bfloat16), ("gated_sum", torch.bfloat16)],
                         ids=["sum-fp32", "gated_sum-fp32", "sum-bf16", "gated_sum-bf16"])
def test_nan_gradient_stays_in_its_neighbourhood(aggr, dtype, monkeypatch):
    """A NaN in one edge_attr row of centre 6 makes d_centre[6] NaN and leaves d_centre of every other
    centre and d_receiver_term of every receiver outside its neighbourhood as in the clean run (fp32: the
    stored path's du kernel; bf16: the opt-in one-pass input gradients, whose tile sums span several
    segments)."""
    monkeypatch.setenv("NT_KERNELS_NTCONV_RECOMPUTE", "1")
    case = Case(*make_graph(), aggr)
    kw = dict(aggr=aggr, gate_group="receiver", threshold=THRESHOLD, dropout=0.0, seed=0, dtype=dtype)
    clean = run_triton(case, **kw)[3]
    own = case.edge_index[0] == 6
    case.tensors["edge_attr"] = case.tensors["edge_attr"].clone()
    case.tensors["edge_attr"][int(own.nonzero()[0]), 1] = float("nan")
    assert_nan_confined(case, run_triton(case, **kw)[3], clean, 6, whole_row=True)


def assert_nan_confined(case, grads, clean, centre, *, whole_row):
    """d_centre[centre] NaN (every entry where ``whole_row``, else some); d_centre of every other centre and
    d_receiver_term of every receiver outside ``centre``'s neighbourhood as in the clean run."""
    d_centre, d_receiver = grads["centre"].cpu(), grads["receiver_term"].cpu()
    nan = torch.isnan(d_centre[centre])
    assert nan.all() if whole_row else nan.any()
    reached = torch.zeros(len(SIZES), dtype=torch.bool)
    reached[case.edge_index[1, case.edge_index[0] == centre]] = True
    for node in range(len(SIZES)):
        if node != centre:
            assert torch.equal(d_centre[node], clean["centre"].cpu()[node]), f"the NaN reached d_centre[{node}]"
        if not reached[node]:
            assert torch.equal(d_receiver[node], clean["receiver_term"].cpu()[node]), \
                f"the NaN reached d_receiver_term[{node}]"


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
def test_registered_as_the_cuda_kernel_of_the_op():
    """``import nt_kernels`` registered them (backends.register_backends -> triton.register)."""
    for name in ("ntconv_fwd", "ntconv_bwd"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"nt_kernels::{name}", "CUDA"), name


def assert_matches_cpu_op(case, triton_result, **kw):
    """The CPU C++ op on the same float32 inputs and seed: output, saved state (the per-receiver
    statistics) and every gradient of ``triton_result`` (run_triton's) agree.  The Triton forward keeps no
    lse (its backward recomputes it with the attention; a wrong one shows in the gradients)."""
    out, lse, stats, grads = triton_result
    assert lse.shape == (0, case.heads), "the Triton forward returns an empty lse"
    args = op_args(case, dtype=torch.float32, **kw)
    args = tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)
    cpu_out, cpu_lse, cpu_stats = torch.ops.nt_kernels.ntconv_fwd(*args)
    cpu_grads = dict(zip(GRAD_NAMES, torch.ops.nt_kernels.ntconv_bwd(
        case.grad_out.float(), cpu_out, cpu_lse, cpu_stats, *args, [True, True, True])))
    assert_close(stats.cpu(), cpu_stats.double(), "stats")
    assert_close(out.cpu(), cpu_out.double(), "output")
    for name, grad in grads.items():
        assert_close(grad.cpu(), cpu_grads[name].double(), f"gradient of {name}")


@pytest.mark.parametrize("aggr, gate_group", AGGRS)
def test_matches_the_cpu_fused_op(aggr, gate_group):
    """Same inputs, same seed: the CPU C++ op and the Triton implementation agree (float32)."""
    case = Case(*make_graph(), aggr)
    kw = dict(aggr=aggr, gate_group=gate_group, threshold=THRESHOLD, dropout=0.3, seed=2 ** 40 + 3)
    assert_matches_cpu_op(case, run_triton(case, **kw), **kw)


# ------------------------------------------- weight gradients: split-K over row blocks
WGRAD_DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16"),
                pytest.param(torch.float16, id="fp16")]
WGRAD_USES = [pytest.param("w_qkv", id="qkv-three-parts-bias"), pytest.param("w_out", id="out-fp32-A-bias"),
              pytest.param("w_edge", id="edge-gathered-B")]


def _weight_grad_case(use, dtype, rows, seed=0, channels=12):
    """Operands of one weight gradient as the op passes them (ntconv_op._input_grads / _backward_chunk),
    with C = ``channels``, and the float64 truth of dW and db from the operands rounded to ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    c, f, row0 = channels, 5, 3

    def rand(*shape, to=dtype):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(to)
    if use == "w_qkv":  # A = dqkv (3, R, C) in the parameters' dtype, B = z (R, C)
        a, b, m, n = rand(3, rows, c), rand(rows, c), 3 * c, c
        kw = dict(a_split=c, a_part=rows * c, a_row=c, b_row=c)
        a_rows, b_rows = a.permute(1, 0, 2).reshape(rows, m), b
    elif use == "w_out":  # A = dy (R, 2C) fp32, B = o (R, C)
        a, b, m, n = rand(rows, 2 * c, to=torch.float32), rand(rows, c), 2 * c, c
        kw = dict(a_split=m, a_part=0, a_row=m, b_row=c)
        a_rows, b_rows = a, b
    else:  # A = du (R, C) fp32, B = edge_attr (fp32 under autocast) gathered through perm[row0 + r]
        index = torch.randperm(rows + row0 + 4, generator=gen)
        a, b, m, n = rand(rows, c, to=torch.float32), rand(rows + row0 + 4, f, to=torch.float32), c, f
        kw = dict(a_split=c, a_part=0, a_row=c, b_row=f, index=index.to(DEVICE), row0=row0)
        a_rows, b_rows = a, b[index[row0:row0 + rows]]
    a64, b64 = a_rows.to(dtype).double(), b_rows.to(dtype).double()
    w0, b0 = rand(m, n, to=torch.float32), rand(m, to=torch.float32)  # the running sums the call adds to
    truth = (w0.double() + a64.t() @ b64, b0.double() + a64.sum(0) if use != "w_edge" else None)
    return dict(a=a.to(DEVICE), b=b.to(DEVICE), rows=rows, m=m, n=n, **kw), w0, b0, truth


def _run_weight_grad(args, w0, b0, use, dtype):
    from nt_kernels.backends.triton.common import bf16_emulation
    from nt_kernels.backends.triton.ntconv_wgrad import weight_grad

    w_acc, b_acc = w0.clone().to(DEVICE), b0.clone().to(DEVICE) if use != "w_edge" else None
    weight_grad(w_acc, b_acc, dtype=dtype, dot_prec="ieee", bf16_emu=bf16_emulation(dtype), **args)
    return w_acc.cpu(), None if b_acc is None else b_acc.cpu()


@pytest.mark.parametrize("dtype", WGRAD_DTYPES)
@pytest.mark.parametrize("use", WGRAD_USES)
def test_weight_grad_kernel_over_several_row_blocks(use, dtype):
    """dW += Aᵀ B and db += Σ A over 300 rows = 5 split-K blocks of 64 (the last one ragged): tensor-core
    products of the operands rounded to the parameters' dtype (exact there) with fp32 sums, against the
    float64 truth of the rounded operands within the float32 tolerance; bitwise equal on a rerun."""
    from nt_kernels.backends.triton.ntconv_plan import weight_grad_tiles

    args, w0, b0, (want_w, want_b) = _weight_grad_case(use, dtype, rows=300)
    assert weight_grad_tiles(300, args["m"], args["n"]).splits == 5
    got_w, got_b = _run_weight_grad(args, w0, b0, use, dtype)
    assert_close(got_w, want_w, "dW")
    if want_b is not None:
        assert_close(got_b, want_b, "db")
    again_w, again_b = _run_weight_grad(args, w0, b0, use, dtype)
    assert torch.equal(got_w, again_w) and (got_b is None or torch.equal(got_b, again_b))


@pytest.mark.parametrize("rows", [1, 64, 65], ids=["one-row", "one-full-block", "block-plus-one"])
def test_weight_grad_kernel_block_boundaries(rows):
    args, w0, b0, (want_w, want_b) = _weight_grad_case("w_qkv", torch.float32, rows=rows, seed=rows)
    got_w, got_b = _run_weight_grad(args, w0, b0, "w_qkv", torch.float32)
    assert_close(got_w, want_w, "dW")
    assert_close(got_b, want_b, "db")


# A 300-row and a 40-row neighbourhood above THRESHOLD (Performer), small exact ones, an empty one.
HUB_SIZES = [300, 3, 1, 8, 0, 5, 2, 40, 1]
HUB_CHUNK_ROWS = 64  # the 300-row hub alone in its chunk: 5 split-K blocks of its weight gradients


def _hub_case(aggr, dtype=torch.float64):
    case = Case(*make_graph(HUB_SIZES, receivers=9, seed=9), aggr)
    case.tensors = {n: None if t is None else t.to(dtype).double() for n, t in case.tensors.items()}
    case.projection = case.projection.to(dtype).double()
    return case


def test_hub_chunk_spans_several_weight_gradient_blocks():
    from nt_kernels.backends.triton.ntconv_plan import weight_grad_tiles

    case = _hub_case("sum")
    args = op_args(case, aggr="sum", gate_group="receiver", threshold=THRESHOLD, dropout=0.0, seed=0,
                   dtype=torch.float32)
    p = ntconv_op.problem("test", dict(zip(ntconv_op.ARG_NAMES, args), chunk_rows=HUB_CHUNK_ROWS))
    hub = max(p.plan.chunks, key=lambda chunk: chunk.rows)
    assert hub.rows == 300 and hub.performer is not None
    assert weight_grad_tiles(hub.rows, 3 * HEADS * DIM, HEADS * DIM).splits == 5


@pytest.mark.parametrize("aggr, gate_group", AGGRS)
def test_performer_hub_matches_reference_cpu_op_and_reruns_bitwise(aggr, gate_group):
    """Hub neighbourhoods on the Performer path, edge features, dropout: float32 output and all eight
    gradients against the float64 definition and the CPU op; weight gradients bitwise equal on a rerun."""
    case = _hub_case(aggr)
    kw = dict(aggr=aggr, gate_group=gate_group, threshold=THRESHOLD, dropout=0.2, seed=4)
    result = run_triton(case, chunk_rows=HUB_CHUNK_ROWS, **kw)
    assert_matches_reference_and_cpu_op(case, result, **kw)
    again = run_triton(case, chunk_rows=HUB_CHUNK_ROWS, **kw)[3]
    for name in ("w_edge", "w_qkv", "b_qkv", "w_out", "b_out"):
        assert torch.equal(result[3][name], again[name]), name


@pytest.mark.parametrize("aggr, gate_group", [AGGRS[4], AGGRS[5]])
def test_performer_hub_bf16_error_at_most_twice_pytorchs(aggr, gate_group):
    """bfloat16 throughout (weight gradients from bf16 operands on the tensor-core path): the accuracy rule."""
    case = _hub_case(aggr, torch.bfloat16)
    kw = dict(aggr=aggr, gate_group=gate_group, threshold=THRESHOLD, dropout=0.2, seed=4)
    out, _, _, grads = run_triton(case, dtype=torch.bfloat16, chunk_rows=HUB_CHUNK_ROWS, **kw)
    assert_low_precision_result(case, out, grads, torch.bfloat16, kw)


@pytest.mark.parametrize("aggr, gate_group", [AGGRS[3], AGGRS[5]])
def test_dirnt_reversed_graph(aggr, gate_group):
    """DirNT's second conv: the reversed CSR (nt_kernels.csr.reversed_csr), whose perm indexes the
    original edge order, so edge_attr is gathered through a non-trivial perm; against the float64
    definition on the flipped edge_index and the CPU op."""
    edge_index, n = make_graph(seed=5)
    case = Case(edge_index.flip(0), n, aggr)
    case.csr = reversed_csr(NeighbourhoodCSR.from_edge_index(edge_index, n), n)
    case.rcsr = receiver_csr(case.csr, n)
    kw = dict(aggr=aggr, gate_group=gate_group, threshold=THRESHOLD, dropout=0.3, seed=8)
    result = run_triton(case, **kw)
    assert result[0].dtype == torch.float32
    assert_matches_reference_and_cpu_op(case, result, **kw)


# ---------------------------------------------------------------- CUDA only
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def hub_case(aggr, dtype=torch.float64):
    """A 3,000-row hub (Performer, split over several chunks of the default plan's size class),
    a 70-row exact neighbourhood, many small ones; inputs rounded to ``dtype``.  In low precision
    ``max`` sends every message to a receiver of its own (make_graph, receivers=None)."""
    receivers = None if aggr == "max" and dtype != torch.float64 else 25
    case = Case(*make_graph([3000, 70, 1, 2, 5, 0, 3, 1, 9, 4] * 3, receivers=receivers, seed=7), aggr)
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
    assert_low_precision_result(case, out, grads, torch.bfloat16, kw)


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
    assert sum(r["status"] == "pass" for r in doc["rows"]) == 14  # 2 graphs x 6 aggregators, determinism, NaN


TRITON_ROW = """
import sys, torch
from torch.library import register_kernel
import nt_kernels
from nt_kernels.apps import check
from nt_kernels.apps.check_ntconv import accuracy_rows
from nt_kernels.backends.triton import ntconv_op
if torch.device(sys.argv[1]).type == "cpu":  # the Triton kernels (interpreter) serve the CPU op
    for name, fn in (("ntconv_fwd", ntconv_op.ntconv_fwd), ("ntconv_bwd", ntconv_op.ntconv_bwd)):
        register_kernel(f"nt_kernels::{name}", "cpu", fn)
import argparse
s = check.settings_from(argparse.Namespace(device=sys.argv[1], dims="1", dtypes="bfloat16", data_root=None,
                                           quick=False, kernels_only=False))
for row in accuracy_rows("exact: packed + multi-tile", "weighted_mean", "centre", 1, s):
    print(row.status, row.worst, row.error, row.tolerance, row.note)
"""


def test_check_row_of_the_h200_run_passes_through_the_triton_kernels():
    """The one check row the H200 run of 2026-11-27 failed (exact multi-tile segments, weighted_mean gated
    by the centre, bf16, D = 1: the centre gradient at 1.22x its bound) through the fused op's Triton kernels
    (the interpreter on CPU, in a subprocess so that the CPU op's registration stays the C++ kernel here).
    A delta from O rounded to bf16 in the multi-tile dQ pass put it at 0.106; from P and dP, 0.016."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", TRITON_ROW, DEVICE.type], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    status, worst, error, tolerance = done.stdout.split()[:4]
    assert status == "pass", done.stdout


def _spec_kernels(dtype):
    """The kernels of the fused layer launched with ``dtype`` operands (the sm_90 paths and the streaming
    design: 16-bit only)."""
    from nt_kernels.backends.triton import (ntconv_gemm, ntconv_grad, ntconv_igrad, ntconv_project, ntconv_reduce,
                                            ntconv_stream, ntconv_wgrad)

    sm90 = {ntconv_grad._message_grad_split_kernel, ntconv_igrad._input_grad_split_kernel,
            ntconv_project._project_kernel, ntconv_stream._project_stream_kernel, ntconv_stream._dy_stream_kernel,
            ntconv_stream._du_stream_kernel}
    split = set() if dtype == "fp32" else sm90
    return split | {ntconv_gemm._prologue_kernel, ntconv_gemm._rows_gemm_kernel, ntconv_gemm._du_kernel,
                    ntconv_gemm._centre_fixup_kernel, ntconv_grad._message_grad_kernel,
                    ntconv_reduce._gate_kernel, ntconv_reduce._reduce_kernel, ntconv_reduce._merge_kernel,
                    ntconv_reduce._normalize_kernel, ntconv_wgrad._weight_grad_kernel, ntconv_wgrad._combine_kernel}


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_compile_specs_name_every_kernel_argument(dtype):
    """The AOT compile specs (ntconv_specs.py) type or fix every argument of their kernel exactly once."""
    from nt_kernels.backends.triton.ntconv_specs import compile_specs, launches

    specs = compile_specs(dtype)
    assert {s.kernel for s in specs} == _spec_kernels(dtype), "every fused-layer kernel has specs"
    for spec in specs:
        for fn, constexprs, options in launches(spec):
            assert sorted([*spec.types, *constexprs]) == sorted(fn.arg_names), spec.name
            assert {"num_warps", "num_stages"} <= set(options) <= {"num_warps", "num_stages", "maxnreg"}, spec.name
            assert spec.streaming == ("maxnreg" in options), spec.name  # the streaming kernels' register cap


# ------------------------------------------- segments left out of both lists
def _nan_filled(alloc):
    """``alloc`` (torch.empty / empty_like) whose floating results start as NaN: a row the
    kernels leave unwritten then shows."""
    def wrapped(*args, **kwargs):
        t = alloc(*args, **kwargs)
        return t.fill_(math.nan) if t.is_floating_point() else t
    return wrapped


@pytest.mark.parametrize("lists", ["covered", "partial"])
def test_segments_left_out_of_both_lists_match_the_cpu_op(lists, monkeypatch):
    """With every row in a list the plan says so (rows_covered) and the chunk buffers skip their
    zero fill; every uninitialised buffer here starts as NaN, so a row the kernels leave
    unwritten fails.  A segment left out of both lists takes o = 0, as in the CPU op."""
    case = Case(*make_graph(), "sum")
    kw = dict(aggr="sum", gate_group="receiver", threshold=THRESHOLD, dropout=0.0, seed=5)
    args = list(op_args(case, dtype=torch.float32, **kw))
    if lists == "partial":  # drop a one-row exact segment and the 14-row Performer one
        args[13], args[14] = args[13][1:], args[14][:-1]
    csr, n = case.csr, case.csr.num_nodes
    plan = build_ntconv_plan(csr.rowptr, csr.receiver, args[13].cpu(), args[14].cpu(), n, CHUNK_ROWS, 64)
    host = read_plan("test", plan, num_rows=csr.num_edges, num_segments=n, num_out=n, chunk_rows=CHUNK_ROWS,
                     max_tile=64, num_exact=args[13].numel(), num_performer=args[14].numel(), num_nodes=n)
    assert host.rows_covered == (lists == "covered")
    if HAS_CUDA:
        fwd, bwd, extra = torch.ops.nt_kernels.ntconv_fwd, torch.ops.nt_kernels.ntconv_bwd, {}
    else:
        fwd, bwd, extra = ntconv_op.ntconv_fwd, ntconv_op.ntconv_bwd, dict(chunk_rows=CHUNK_ROWS)
        monkeypatch.setattr(torch, "empty", _nan_filled(torch.empty))
        monkeypatch.setattr(torch, "empty_like", _nan_filled(torch.empty_like))
    out, lse, stats = fwd(*args, **extra)
    grads = bwd(case.grad_out.to(DEVICE, out.dtype), out, lse, stats, *args, [True, True, True], **extra)
    monkeypatch.undo()
    cpu_args = tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)
    cpu_out, cpu_lse, cpu_stats = torch.ops.nt_kernels.ntconv_fwd(*cpu_args)
    cpu_grads = torch.ops.nt_kernels.ntconv_bwd(case.grad_out.float(), cpu_out, cpu_lse, cpu_stats, *cpu_args,
                                                [True, True, True])
    assert_close(out.cpu(), cpu_out.double(), "output")
    for name, grad, want in zip(GRAD_NAMES, grads, cpu_grads):
        if want is not None and want.numel():
            assert_close(grad.cpu(), want.double(), f"gradient of {name}")
