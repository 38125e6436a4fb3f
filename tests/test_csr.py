"""NeighbourhoodCSR: packing, round trips, edge cases and argument errors (DESIGN §3, §5)."""
import pytest
import torch

from nt_kernels import NeighbourhoodCSR
from nt_kernels.csr import split_segments


def random_edge_index(num_nodes, num_edges, seed=0, dtype=torch.int64):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, num_nodes, (2, num_edges), generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_packing_groups_rows_by_centre_stably(dtype):
    edge_index = random_edge_index(20, 200, dtype=dtype)
    csr = NeighbourhoodCSR.from_edge_index(edge_index, 20)
    centre = edge_index[0].long()
    assert csr.rowptr.dtype == torch.int64 and csr.rowptr.shape == (21,)
    assert torch.equal(csr.degree, torch.bincount(centre, minlength=20))
    assert torch.equal(csr.centre, centre[csr.perm])
    assert torch.all(torch.diff(csr.centre) >= 0)
    for j in range(20):
        rows = csr.perm[csr.rowptr[j]:csr.rowptr[j + 1]]
        assert torch.equal(rows, (centre == j).nonzero().flatten())  # stable: original order kept
    assert torch.equal(csr.receiver, edge_index[1].long()[csr.perm])
    assert csr.max_degree == int(csr.degree.max())


def test_size_histogram_counts_every_segment():
    csr = NeighbourhoodCSR.from_edge_index(random_edge_index(30, 100, seed=1), 30)
    sizes, counts = csr.size_hist
    assert int(counts.sum()) == 30
    assert int((sizes * counts).sum()) == 100
    assert torch.equal(sizes, torch.unique(csr.degree))


def test_pack_unpack_round_trip_and_gradient():
    edge_index = random_edge_index(15, 60, seed=2)
    csr = NeighbourhoodCSR.from_edge_index(edge_index, 15)
    feats = torch.randn(60, 3, 4, dtype=torch.float64, requires_grad=True)
    packed = csr.pack(feats)
    assert torch.equal(packed, feats[csr.perm])
    back = csr.unpack(packed)
    assert torch.equal(back, feats)
    back.sum().backward()
    assert torch.equal(feats.grad, torch.ones_like(feats))


def test_empty_graph():
    csr = NeighbourhoodCSR.from_edge_index(torch.empty(2, 0, dtype=torch.long))
    assert csr.num_nodes == 0 and csr.num_edges == 0 and csr.max_degree == 0
    assert torch.equal(csr.rowptr, torch.zeros(1, dtype=torch.long))
    assert csr.pack(torch.empty(0, 2)).shape == (0, 2)


def test_isolated_nodes_have_empty_segments():
    edge_index = torch.tensor([[1, 1, 4], [0, 2, 3]])
    csr = NeighbourhoodCSR.from_edge_index(edge_index, num_nodes=6)
    assert csr.degree.tolist() == [0, 2, 0, 0, 1, 0]
    assert csr.rowptr.tolist() == [0, 0, 2, 2, 2, 3, 3]


def test_num_nodes_inferred_from_max_index():
    csr = NeighbourhoodCSR.from_edge_index(torch.tensor([[0, 3], [2, 1]]))
    assert csr.num_nodes == 4


@pytest.mark.parametrize("threshold, exact, performer", [
    (2, [1, 2], [3]), (2.5, [1, 2], [3]), (3, [1, 2, 3], []), (0, [], [1, 2, 3]),
    (float("inf"), [1, 2, 3], []),
], ids=["int", "fractional", "at-largest", "zero", "inf"])
def test_segment_split_at_threshold(threshold, exact, performer):
    rowptr = torch.tensor([0, 0, 1, 3, 6])  # sizes 0, 1, 2, 3
    small, large = split_segments(rowptr, threshold)
    assert small.tolist() == exact and large.tolist() == performer


def test_plan_cache_builds_once():
    csr = NeighbourhoodCSR.from_edge_index(random_edge_index(10, 30))
    calls = []
    first = csr.plan("k", lambda: calls.append(1) or torch.ones(1))
    second = csr.plan("k", lambda: calls.append(1) or torch.zeros(1))
    assert first is second and calls == [1]
    assert csr.segment_split(3.0)[0] is csr.segment_split(3.0)[0]


@pytest.mark.parametrize("edge_index, num_nodes, error, match", [
    ([[0, 1], [1, 0]], None, TypeError, "edge_index must be a torch.Tensor"),
    (torch.zeros(3, 4, dtype=torch.long), None, ValueError, r"edge_index must have shape \(2, E\)"),
    (torch.zeros(2, 4), None, ValueError, "edge_index must be int32 or int64"),
    (torch.tensor([[0, 5], [1, 0]]), 3, ValueError, "out of range for num_nodes=3"),
    (torch.tensor([[0, -1], [1, 0]]), None, ValueError, "negative node index"),
    (torch.tensor([[0, 1], [1, 0]]), -2, ValueError, "num_nodes must be non-negative"),
    (torch.tensor([[0, 1], [1, 0]]), 2.0, TypeError, "num_nodes must be an int"),
], ids=["not-tensor", "wrong-shape", "float-dtype", "out-of-range", "negative-index",
        "negative-num-nodes", "float-num-nodes"])
def test_from_edge_index_errors(edge_index, num_nodes, error, match):
    with pytest.raises(error, match=match):
        NeighbourhoodCSR.from_edge_index(edge_index, num_nodes)


def test_pack_rejects_wrong_row_count():
    csr = NeighbourhoodCSR.from_edge_index(random_edge_index(5, 10))
    with pytest.raises(ValueError, match="NeighbourhoodCSR.pack: expected a tensor with E = 10 rows"):
        csr.pack(torch.zeros(9, 2))
    with pytest.raises(ValueError, match="NeighbourhoodCSR.unpack: expected a tensor with E = 10 rows"):
        csr.unpack(torch.zeros(11))


def _fields(**overrides):
    """Fields of a valid 2-node, 3-row CSR, with overrides."""
    fields = dict(rowptr=torch.tensor([0, 2, 3]), perm=torch.tensor([1, 0, 2]), receiver=torch.tensor([1, 0, 0]),
                  num_nodes=2, max_degree=2)
    fields.update(overrides)
    return fields


def test_direct_construction_keeps_valid_fields():
    csr = NeighbourhoodCSR(**_fields())
    assert csr.num_edges == 3 and csr.degree.tolist() == [2, 1] and csr.centre.tolist() == [0, 0, 1]
    empty = NeighbourhoodCSR(torch.zeros(1, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                             torch.zeros(0, dtype=torch.long), 0, 0)
    assert empty.num_edges == 0


@pytest.mark.parametrize("overrides, error, match", [
    (dict(rowptr=[0, 2, 3]), TypeError, "rowptr must be a torch.Tensor"),
    (dict(rowptr=torch.tensor([0, 2, 3], dtype=torch.int32)), ValueError, "rowptr must be a 1-D int64 tensor"),
    (dict(perm=torch.tensor([[1, 0, 2]])), ValueError, "perm must be a 1-D int64 tensor"),
    (dict(receiver=torch.tensor([1.0, 0.0, 0.0])), ValueError, "receiver must be a 1-D int64 tensor"),
    (dict(receiver=torch.tensor([1, 0, 0], device="meta")), ValueError, "receiver is on meta but rowptr is on cpu"),
    (dict(num_nodes=3), ValueError, r"rowptr must have num_nodes \+ 1 = 4 entries, got 3"),
    (dict(num_nodes=-1), ValueError, "num_nodes must be an int >= 0"),
    (dict(receiver=torch.tensor([1, 0])), ValueError, r"receiver must have E = 3 entries"),
    (dict(rowptr=torch.tensor([1, 2, 3])), ValueError, r"rowptr\[0\] must be 0"),
    (dict(rowptr=torch.tensor([0, 3, 2])), ValueError, "rowptr must be non-decreasing"),
    (dict(rowptr=torch.tensor([0, 2, 4])), ValueError, r"rowptr\[-1\] must equal the number of packed rows E = 3"),
    (dict(perm=torch.tensor([1, 1, 2])), ValueError, r"perm must be a permutation of 0\.\.E-1"),
    (dict(perm=torch.tensor([1, 0, 3])), ValueError, r"perm must be a permutation of 0\.\.E-1"),
    (dict(receiver=torch.tensor([1, -1, 0])), ValueError, r"receiver has a negative node index \(-1\)"),
    (dict(max_degree=1), ValueError, "max_degree must be the largest segment size 2, got 1"),
], ids=["rowptr-list", "rowptr-int32", "perm-2d", "receiver-float", "device", "num-nodes", "negative-num-nodes",
        "receiver-length", "rowptr-start", "rowptr-order", "rowptr-end", "perm-duplicate", "perm-range",
        "receiver-negative", "max-degree"])
def test_direct_construction_checks_fields(overrides, error, match):
    with pytest.raises(error, match=f"NeighbourhoodCSR: {match}"):
        NeighbourhoodCSR(**_fields(**overrides))
