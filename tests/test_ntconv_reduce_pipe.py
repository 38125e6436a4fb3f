"""The pipelined segmented reductions of the fused NT layer (issue 40, NT_KERNELS_NTCONV_REDUCE=pipe).

Under TRITON_INTERPRET=1 (conftest.py) on CPU tensors, on the graphs and runners of tests/test_ntconv_triton.py:
``ntconv_reduce._reduce_kernel`` with ``PIPE`` (a persistent grid whose programs walk many item blocks, the
blocks of one item pipelined) against the one-block-per-program kernel, which test_ntconv_triton.py checks
against float64: the kernel alone in every mode, and the whole op for every aggregator.  Both reduce each
item's rows in the same order, so every value is bitwise equal.
"""
import pytest
import torch

pytest.importorskip("triton")

from nt_kernels.backends.triton import ntconv_reduce  # noqa: E402
from nt_kernels.backends.triton.ntconv_tiles import reduce_tiles  # noqa: E402
from test_ntconv_triton import (AGGRS, REDUCE_CASES, THRESHOLD, Case, _reduce_inputs, _reduce_plan,  # noqa: E402
                                _run_reduce, make_graph, run_triton)

# (sizes, receivers, chunk rows): 60 segments of 0-20 rows into 25 receivers in chunks of 64 rows, many
# item blocks in the classes of 1-32 rows; and tall segments and receivers in 512-row chunks, many
# 64-row pieces (one-item blocks at C = 64, the pipelined ones).
GRAPHS = [pytest.param(torch.randint(0, 21, (60,), generator=torch.Generator().manual_seed(3)).tolist(), 25, 64,
                       id="short"),
          pytest.param([300, 200, 70, 5, 0, 130, 1], 3, 512, id="tall")]


def _pipe(monkeypatch, programs):
    """NT_KERNELS_NTCONV_REDUCE=pipe on a persistent grid of ``programs`` programs."""
    monkeypatch.setenv(ntconv_reduce.REDUCE_ENV, "pipe")
    monkeypatch.setattr(ntconv_reduce, "pipe_programs", lambda device: programs)


@pytest.mark.parametrize("programs", [1, 2], ids=["programs1", "programs2"])
@pytest.mark.parametrize("heads, dim", [(2, 3), (4, 16), (3, 100)], ids=["C6", "C64", "C300"])
@pytest.mark.parametrize("sizes, receivers, chunk_rows", GRAPHS)
@pytest.mark.parametrize("by, mode", REDUCE_CASES)
def test_pipelined_reduction_equals_the_grid(by, mode, sizes, receivers, chunk_rows, heads, dim, programs,
                                             monkeypatch):
    """The kernel alone: every state tensor bitwise equal to the one-block-per-program kernel's, in
    every mode, with pieces of 4 and 64 rows (split groups), programs walking several blocks of a
    class: many-item blocks (C = 6, and the short graph), one-item blocks pipelined (C = 64 on the
    tall graph: 64-row slots) and C = 300 (two channel blocks of 256: not pipelined,
    PIPE_MAX_CHANNELS)."""
    csr, host = _reduce_plan(4 if heads == 2 else 64, sizes, receivers=receivers, chunk_rows=chunk_rows)
    x, gate = _reduce_inputs(csr.num_edges, heads, dim, mode)
    if by == "segment" and mode == 4:
        x = x[:, :heads]
    channels = x.shape[1] // 2 if mode in (1, 2) else x.shape[1]
    lists = [c.receivers if by == "receiver" else c.segments for c in host.chunks]
    blocks = max(red.programs(channels) for red in lists)
    assert blocks > programs, "a program must walk several blocks"
    if channels == 64 and chunk_rows == 512:
        assert reduce_tiles(channels, 64).block_g == 1, "64-row slots: one-item blocks, the pipelined ones"
        assert max(dict((slot, n) for slot, _, n in red.classes())[64] for red in lists) > programs
    grid = _run_reduce(csr, host, by, mode, x, gate, heads)
    _pipe(monkeypatch, programs)
    pipe = _run_reduce(csr, host, by, mode, x, gate, heads)
    for name in ("acc", "run_max", "run_sum", "count"):
        a, b = getattr(grid, name), getattr(pipe, name)
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), name
    reduced = pipe.run_sum if mode == 4 else pipe.acc
    assert reduced.isfinite().any() and reduced.nan_to_num(0.0).abs().sum() > 0, "the state must hold the rows"


@pytest.mark.parametrize("aggr, gate_group", AGGRS)
def test_op_with_pipelined_reductions_equals_the_default(aggr, gate_group, monkeypatch):
    """The op, forward and backward (every reduction: receivers, d_receiver_term, d_centre, the centre
    softmax), on one program: on a graph with two receivers of about 115 rows each and segments of
    150 and 80 rows in one chunk at C = 64 (64-row pieces: one-item blocks, pipelined) and on the
    default graph (C = 8: many-item blocks), with edge features and dropout: output and all eight gradients
    bitwise equal to the default design's."""
    tall = Case(*make_graph([150, 3, 1, 0, 80], receivers=2, seed=3), aggr, heads=2, dim=32)
    assert reduce_tiles(64, 64).block_g == 1, "C = 64: the 64-row slots are one-item blocks, pipelined"
    for case, chunk_rows in ((tall, 512), (Case(*make_graph(), aggr), 12)):
        kw = dict(aggr=aggr, gate_group=gate_group, threshold=THRESHOLD, dropout=0.2, seed=5, chunk_rows=chunk_rows)
        want = run_triton(case, **kw)
        with monkeypatch.context() as m:
            _pipe(m, 1)
            got = run_triton(case, **kw)
        assert torch.equal(want[0], got[0]), "output"
        for name, grad in want[3].items():
            assert torch.equal(grad.nan_to_num(7.0), got[3][name].nan_to_num(7.0)), f"gradient of {name}"


def test_reduction_design_is_checked(monkeypatch):
    monkeypatch.setenv(ntconv_reduce.REDUCE_ENV, "pipes")
    with pytest.raises(ValueError, match="NT_KERNELS_NTCONV_REDUCE='pipes': choose grid or pipe"):
        ntconv_reduce.pipelined()
    monkeypatch.setenv(ntconv_reduce.REDUCE_ENV, "pipe")
    assert ntconv_reduce.pipelined()
    monkeypatch.delenv(ntconv_reduce.REDUCE_ENV)
    assert not ntconv_reduce.pipelined()
