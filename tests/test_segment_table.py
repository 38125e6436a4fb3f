"""The segment-table check of the CUDA Performer binding (csrc/common/segment_table.cpp),
run through the op ``nt_kernels::check_segment_table`` on every available device.

The CUDA binding runs the same function on the device tensors before its
launches (tests/test_performer_cuda.py covers that path on a GPU).
"""
import pytest
import torch

import nt_kernels  # noqa: F401  (loads torch.ops.nt_kernels)

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
