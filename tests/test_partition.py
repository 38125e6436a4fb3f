"""partition_by_area: Algorithm 1 of the paper, preceded by the size split."""
import itertools
import math
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nt_kernels.baselines.partition import Group, _best_split, partition_by_area

histograms = st.dictionaries(
    st.integers(1, 60), st.integers(1, 12), min_size=1, max_size=9
).map(lambda h: (sorted(h, reverse=True), [h[n] for n in sorted(h, reverse=True)]))


def area(sizes, counts):
    """Padded area of a group given as explicit lists (no prefix sums)."""
    return max(sizes) * sum(counts)


def sub_area(sizes, counts, i, j):
    """Area of entries i..j (inclusive) of a descending histogram."""
    return area(sizes[i : j + 1], counts[i : j + 1])


def brute_split(sizes, counts, i, j):
    """min over every cut t in [i, j) of max(Area(i, t), Area(t+1, j)), smallest t on ties."""
    cuts = [
        (max(sub_area(sizes, counts, i, t), sub_area(sizes, counts, t + 1, j)), t)
        for t in range(i, j)
    ]
    return min(cuts)


def brute_partition(sizes, counts, alpha, threshold):
    """Size split, then Algorithm 1 over one queue holding both size groups (DESIGN §9), with the
    optimal cut found by brute force at every step; a stop ends the whole run."""
    limit = math.inf if threshold is None else threshold
    split = sum(1 for n in sizes if n > limit)  # sizes are descending: Performer sizes come first
    groups = [(i, j, i < split) for i, j in ((0, split - 1), (split, len(sizes) - 1)) if i <= j]
    while True:
        areas = [sub_area(sizes, counts, i, j) for i, j, _ in groups]
        pos = areas.index(max(areas))
        i, j, performer = groups[pos]
        if i == j:
            break
        best, t = brute_split(sizes, counts, i, j)
        if best >= alpha * areas[pos]:
            break
        groups[pos : pos + 1] = [(i, t, performer), (t + 1, j, performer)]
    return [Group(sizes[i], sizes[j], sum(counts[i : j + 1]), sub_area(sizes, counts, i, j), performer)
            for i, j, performer in groups]


def prefix_of(counts):
    return [0] + list(itertools.accumulate(counts))


@settings(max_examples=300, deadline=None)
@given(histograms)
def test_best_split_is_min_over_all_cut_points(hist):
    sizes, counts = hist
    prefix = prefix_of(counts)
    for i in range(len(sizes)):
        for j in range(i + 1, len(sizes)):
            t, s1, s2 = _best_split(sizes, prefix, i, j)
            assert (max(s1, s2), t) == brute_split(sizes, counts, i, j)
            assert s1 == area(sizes[i : t + 1], counts[i : t + 1])
            assert s2 == area(sizes[t + 1 : j + 1], counts[t + 1 : j + 1])


@pytest.mark.parametrize("seed", range(40))
def test_linear_scan_is_optimal_over_every_bipartition(seed):
    """Theorem 3: on the sorted list of neighbourhoods the best cut is as good
    as the best split into any two non-empty sets (brute force over subsets).

    Algorithm 1 itself cuts only between distinct sizes (its list holds
    distinct sizes), which test_best_split_is_min_over_all_cut_points covers.
    """
    rng = random.Random(seed)
    items = sorted((rng.randint(1, 30) for _ in range(rng.randint(2, 11))), reverse=True)
    best_any = math.inf
    for mask in range(1, 2 ** len(items) - 1):
        parts = ([], [])
        for b, n in enumerate(items):
            parts[mask >> b & 1].append(n)
        best_any = min(best_any, max(max(p) * len(p) for p in parts))
    _, s1, s2 = _best_split(items, prefix_of([1] * len(items)), 0, len(items) - 1)
    assert max(s1, s2) == best_any


@settings(max_examples=300, deadline=None)
@given(
    histograms,
    st.sampled_from([1e-6, 0.1, 0.3, 0.4, 0.5, 0.7, 0.9, 1.0]),
    st.one_of(st.none(), st.integers(0, 60), st.floats(0, 70)),
)
def test_matches_algorithm1_with_brute_force_splits(hist, alpha, threshold):
    sizes, counts = hist
    want = brute_partition(sizes, counts, alpha, threshold)
    assert partition_by_area(sizes, counts, alpha, threshold) == want


@settings(max_examples=300, deadline=None)
@given(histograms, st.floats(0.01, 1.0), st.one_of(st.none(), st.integers(0, 60)))
def test_groups_cover_every_size_once_and_areas_add_up(hist, alpha, threshold):
    sizes, counts = hist
    groups = partition_by_area(sizes, counts, alpha, threshold)
    limit = math.inf if threshold is None else threshold
    for n, c in zip(sizes, counts):
        owners = [g for g in groups if g.lo <= n <= g.hi]
        assert len(owners) == 1
        assert owners[0].performer == (n > limit)
    for g in groups:
        members = [(n, c) for n, c in zip(sizes, counts) if g.lo <= n <= g.hi]
        assert g.hi == max(n for n, _ in members) and g.lo == min(n for n, _ in members)
        assert g.count == sum(c for _, c in members)
        assert g.area == g.hi * g.count >= sum(n * c for n, c in members)
        assert g.performer == (g.lo > limit) == (g.hi > limit)
    assert sum(g.count for g in groups) == sum(counts)
    assert [g.hi for g in groups] == sorted((g.hi for g in groups), reverse=True)


@settings(max_examples=200, deadline=None)
@given(histograms, st.one_of(st.none(), st.integers(0, 60)))
def test_alpha_near_zero_keeps_only_the_size_split(hist, threshold):
    sizes, counts = hist
    groups = partition_by_area(sizes, counts, 1e-6, threshold)
    limit = math.inf if threshold is None else threshold
    expected = [p for p in (True, False) if any((n > limit) == p for n in sizes)]
    assert [g.performer for g in groups] == expected


@settings(max_examples=200, deadline=None)
@given(histograms, st.one_of(st.none(), st.integers(0, 60)))
def test_alpha_one_splits_until_the_largest_group_is_a_single_size(hist, threshold):
    """alpha = 1 accepts every split (max(s1, s2) < s for any cut), so the run
    stops only at line 6: when the largest-area group of both size groups holds one size."""
    sizes, counts = hist
    groups = partition_by_area(sizes, counts, 1.0, threshold)
    largest = max(g.area for g in groups)
    selected = next(g for g in groups if g.area == largest)  # ties: larger sizes first
    assert selected.hi == selected.lo


def test_alpha_one_reaches_single_sizes_when_areas_allow():
    groups = partition_by_area([3, 2, 1], [1, 1, 1], alpha=1.0)
    assert [(g.hi, g.lo) for g in groups] == [(3, 3), (2, 2), (1, 1)]


def test_alpha_one_still_stops_at_an_atomic_largest_group():
    # 12 -> {3}: 6 and {2, 1}: 4; the largest group {3} is atomic, so line 6 ends
    # the run and {2, 1} stays whole (paper: "we terminate partitioning other
    # smaller groups").
    groups = partition_by_area([3, 2, 1], [2, 1, 1], alpha=1.0)
    assert groups == [Group(3, 3, 2, 6, False), Group(2, 1, 2, 4, False)]


def test_split_refused_when_max_area_equals_alpha_times_area():
    # s = 2 * 3 = 6; the best cut gives s1 = 2 * 1, s2 = 1 * 2, max 2 = s / 3.
    assert len(partition_by_area([2, 1], [1, 2], alpha=1 / 3)) == 1
    assert partition_by_area([2, 1], [1, 2], alpha=0.34) == [
        Group(2, 2, 1, 2, False),
        Group(1, 1, 2, 2, False),
    ]


def test_stops_when_largest_group_is_atomic():
    # After the first split the size-100 group has the largest area and is atomic,
    # so the [2, 1] group (area 40, splittable into 20 and 10) is left whole.
    groups = partition_by_area([100, 2, 1], [1, 10, 10], alpha=0.9)
    assert groups == [Group(100, 100, 1, 100, False), Group(2, 1, 20, 40, False)]


def test_atomic_performer_group_stops_the_exact_group_too():
    # One queue holds both size groups: the Performer group {500} is atomic and
    # has the largest area, so the run ends (line 6) and the exact group
    # {8, 2} (area 2640, splittable into 240 and 600) stays whole.
    groups = partition_by_area([500, 8, 2], [10, 30, 300], alpha=0.9, threshold=10)
    assert groups == [Group(500, 500, 10, 5000, True), Group(8, 2, 330, 2640, False)]


def test_refused_split_stops_the_other_size_group():
    # The Performer group {500, 400} (area 10000) is the largest; its best split
    # (5000, 4000) is refused at alpha = 0.4 (line 12), so nothing else is split:
    # the exact group {8, 2} (best split 240, 600 < 0.4 * 2640) stays whole.
    groups = partition_by_area([500, 400, 8, 2], [10, 10, 30, 300], alpha=0.4, threshold=10)
    assert groups == [Group(500, 400, 20, 10000, True), Group(8, 2, 330, 2640, False)]
    # Without the Performer group the same exact group is split.
    assert partition_by_area([8, 2], [30, 300], alpha=0.4, threshold=10) == [
        Group(8, 8, 30, 240, False), Group(2, 2, 300, 600, False)]


def test_partition_by_area_is_exported_from_the_package():
    import nt_kernels

    assert nt_kernels.partition_by_area is partition_by_area and nt_kernels.Group is Group


def test_threshold_inf_and_zero_force_one_path():
    assert all(not g.performer for g in partition_by_area([1, 5, 9], [3, 2, 1], threshold=math.inf))
    assert all(g.performer for g in partition_by_area([1, 5, 9], [3, 2, 1], threshold=0))
    assert all(not g.performer for g in partition_by_area([1, 5, 9], [3, 2, 1], threshold=None))


@pytest.mark.parametrize(
    "sizes, counts",
    [
        pytest.param([9, 1, 5], [1, 3, 2], id="list"),
        pytest.param(np.array([5, 9, 1]), np.array([2, 1, 3]), id="numpy"),
        pytest.param(torch.tensor([1, 5, 9]), torch.tensor([3, 2, 1]), id="tensor"),
        pytest.param([0, 9, 1, 5, 7], [100, 1, 3, 2, 0], id="zero-size-and-zero-count-ignored"),
        pytest.param([9, 1, 5, 1], [1, 2, 2, 1], id="repeated-size-merged"),
    ],
)
def test_input_forms_give_the_same_groups(sizes, counts):
    want = partition_by_area([9, 5, 1], [1, 2, 3], 0.6, 4)
    assert partition_by_area(sizes, counts, 0.6, 4) == want


@pytest.mark.parametrize(
    "sizes, counts",
    [([], []), ([0], [7]), ([3], [0])],
    ids=["empty", "only-size-0", "only-count-0"],
)
def test_nothing_to_partition_gives_no_groups(sizes, counts):
    assert partition_by_area(sizes, counts) == []


@pytest.mark.parametrize(
    "kwargs, match",
    [
        pytest.param(dict(alpha=0.0), "alpha", id="alpha-zero"),
        pytest.param(dict(alpha=-0.5), "alpha", id="alpha-negative"),
        pytest.param(dict(alpha=1.5), "alpha", id="alpha-above-one"),
        pytest.param(dict(alpha=float("nan")), "alpha", id="alpha-nan"),
        pytest.param(dict(alpha="x"), "alpha", id="alpha-not-a-number"),
        pytest.param(dict(counts=[1, 2]), "same length", id="length-mismatch"),
        pytest.param(dict(sizes=[3, -1, 2]), "sizes", id="negative-size"),
        pytest.param(dict(counts=[1, -2, 3]), "counts", id="negative-count"),
        pytest.param(dict(sizes=torch.tensor([3.0, 1.0, 2.0])), "sizes", id="float-tensor-sizes"),
        pytest.param(dict(counts=[1.5, 2, 3]), "counts", id="float-counts"),
        pytest.param(dict(sizes=[[3, 1, 2]]), "sizes", id="2d-sizes"),
        pytest.param(dict(threshold=-1), "threshold", id="threshold-negative"),
        pytest.param(dict(threshold=float("nan")), "threshold", id="threshold-nan"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_argument(kwargs, match):
    args = dict(sizes=[3, 1, 2], counts=[1, 1, 1])
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        partition_by_area(**args)
