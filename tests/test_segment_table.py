"""The segment-table check of the CUDA Performer binding (csrc/common/segment_table.cpp),
run through the op ``nt_kernels::check_segment_table`` on every available device, and the
trusted-table ops (``performer_segment_table``, ``performer_{fwd,bwd}_table_into``).

The CUDA binding runs the same function on the device tensors before its
launches (tests/test_performer_cuda.py covers that path on a GPU).
"""
import pytest
import torch

import nt_kernels  # noqa: F401  (loads torch.ops.nt_kernels)
from helpers import packed, projection

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
ROWPTR = [0, 2, 2, 5, 9]  # 4 segments over 9 rows, segment 1 empty


def check(rowptr, segments, num_rows, device):
    torch.ops.nt_kernels.check_segment_table(
        torch.tensor(rowptr, dtype=torch.long, device=device),
        torch.tensor(segments, dtype=torch.long, device=device), num_rows)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rowptr, segments, num_rows", [
    (ROWPTR, [0, 1, 2, 3], 9),
    (ROWPTR, [3, 0], 9),
    (ROWPTR, [], 9),
    ([0], [], 0),
    ([0, 0, 0], [1, 0], 0),
])
def test_valid_tables_pass(rowptr, segments, num_rows, device):
    check(rowptr, segments, num_rows, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rowptr, segments, num_rows, message", [
    (ROWPTR, [0, 4], 9, r"segments\[1\] = 4 is out of range for rowptr with 4 segments"),
    (ROWPTR, [2, -3, 7], 9, r"segments\[1\] = -3 is out of range for rowptr with 4 segments"),
    ([0], [0], 0, r"segments\[0\] = 0 is out of range for rowptr with 0 segments"),
    (ROWPTR, [2, 0, 2], 9, r"segments lists segment 2 more than once"),
    (ROWPTR, [3, 1, 3, 1], 9, r"segments lists segment 1 more than once"),
    ([1, 2, 5, 9], [0], 9, r"rowptr\[0\] must be 0, got 1"),
    (ROWPTR, [0], 10, r"rowptr\[-1\] must equal E = 10, got 9"),
    ([0, 3, 2, 9], [0], 9, r"rowptr must be non-decreasing, but rowptr\[1\] = 3 > rowptr\[2\] = 2"),
])
def test_bad_tables_are_rejected_with_the_argument_named(rowptr, segments, num_rows, message, device):
    with pytest.raises(RuntimeError, match=r"check_segment_table: " + message):
        check(rowptr, segments, num_rows, device)


def test_structure_is_checked_first():
    with pytest.raises(RuntimeError, match="rowptr must be a 1-D int64 tensor"):
        torch.ops.nt_kernels.check_segment_table(torch.tensor([0, 1], dtype=torch.int32),
                                                 torch.tensor([0]), 1)
    with pytest.raises(RuntimeError, match="segments must be a 1-D int64 tensor"):
        torch.ops.nt_kernels.check_segment_table(torch.tensor([0, 1]), torch.tensor([[0]]), 1)


# ------------------------------------------ trusted tables (docs/design.md, "Host syncs")
CHUNK = 256  # rows per CUDA Performer work item (PERFORMER_TABLE_CHUNK_ROWS)


@pytest.mark.parametrize("device", DEVICES)
def test_performer_segment_table_is_the_chunk_offsets_of_a_checked_table(device):
    rowptr = torch.tensor([0, 300, 300, 1000, 1001], device=device)
    segments = torch.tensor([3, 0, 2, 1], device=device)
    table = torch.ops.nt_kernels.performer_segment_table(rowptr, segments, 1001)
    chunks = [-(-n // CHUNK) for n in (1, 300, 700, 0)]  # segments 3, 0, 2, 1
    assert table.tolist() == [0] + torch.tensor(chunks).cumsum(0).tolist()
    assert torch.ops.nt_kernels.performer_segment_table(rowptr, segments[:0], 1001).tolist() == [0]
    with pytest.raises(RuntimeError, match=r"performer_segment_table: segments lists segment 2 more than once"):
        torch.ops.nt_kernels.performer_segment_table(rowptr, torch.tensor([2, 2], device=device), 1001)


# The dtype of the table-op comparison on each device: float64 on the CPU; the CUDA Performer
# takes float32, float16 and bfloat16 only (its binding rejects float64 by design), so float32 there.
PERFORMER_DTYPE = {"cpu": torch.float64, "cuda": torch.float32}


def _performer_inputs(device, dtype):
    """Inputs drawn in float64 and rounded to ``dtype`` (tests/helpers.py), so both devices see the same
    numbers up to that rounding."""
    rowptr = torch.tensor([0, 3, 3, 300, 301])
    e, h, d = 301, 2, 5
    q, k, v, grad_o = packed(e, h, d, count=4, dtype=dtype, device=device)
    return (rowptr.to(device), torch.tensor([2, 0, 3], device=device), q, k, v, grad_o,
            projection(7, d, dtype=dtype, device=device))


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("device", DEVICES)
def test_table_ops_match_the_checking_ops_and_name_a_false_table(direction, device):
    """performer_{fwd,bwd}_table_into given the table write bit for bit what performer_{fwd,bwd}_into
    write (rows of unlisted segments untouched); off CUDA they check the table, so a table that is not
    performer_segment_table's is an error naming it (on CUDA it is trusted: the caller's promise).
    float64 on the CPU, float32 on CUDA (PERFORMER_DTYPE)."""
    rowptr, segments, q, k, v, grad_o, features = _performer_inputs(device, PERFORMER_DTYPE[device])
    assert q.dtype == PERFORMER_DTYPE[device]
    table = torch.ops.nt_kernels.performer_segment_table(rowptr, segments, q.shape[0])
    ops = torch.ops.nt_kernels

    def run(with_table, table=table):
        outs = [torch.full_like(q, 7.0) for _ in range(1 if direction == "fwd" else 3)]
        if direction == "fwd":
            args = (q, k, v, rowptr, segments)
            op, extra = (ops.performer_fwd_table_into, (table,)) if with_table else (ops.performer_fwd_into, ())
        else:
            args = (grad_o, q, k, v, rowptr, segments)
            op, extra = (ops.performer_bwd_table_into, (table,)) if with_table else (ops.performer_bwd_into, ())
        op(*outs, *args, *extra, features, 1e-4)
        return outs

    want, got = run(False), run(True)
    assert all(t.dtype == q.dtype for t in want + got)
    assert all(t.isfinite().all() for t in want), "a non-finite result would make the comparison vacuous"
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert all(t.ne(7.0).all() for t in want), "the listed segments hold every row"
    if device == "cuda":
        return
    with pytest.raises(RuntimeError, match=rf"performer_{direction}_table_into: table is not the chunk-offset table"):
        run(True, table + 1)
    with pytest.raises(RuntimeError, match=rf"performer_{direction}_table_into: table must be the \(K \+ 1,\) int64"):
        run(True, table[:-1])
