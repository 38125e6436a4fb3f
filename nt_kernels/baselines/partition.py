"""Neighbourhood partitioning by size and by area (paper §4.2, Algorithm 1).

The partition is host-side bookkeeping over the segment-size histogram (a few
hundred distinct sizes at most), so it is plain Python on integers.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

__all__ = ["Group", "partition_by_area"]


class Group(NamedTuple):
    """A group of neighbourhoods whose sizes lie in [lo, hi].

    ``count`` neighbourhoods, ``area = hi * count`` (the padded footprint of
    the group), ``performer`` is True for groups above the size threshold.
    """

    hi: int
    lo: int
    count: int
    area: int
    performer: bool


def _as_ints(x, name: str) -> list[int]:
    """A 1-D list of Python ints from a list, tuple, numpy array or tensor."""
    if isinstance(x, torch.Tensor):
        if x.is_floating_point() or x.is_complex():
            raise ValueError(f"partition_by_area: {name} must hold integers, got {x.dtype}")
        arr = x.detach().cpu().numpy()
    else:
        arr = np.asarray(x)
        if arr.size == 0:
            arr = arr.astype(np.int64)
    if arr.ndim > 1:
        raise ValueError(f"partition_by_area: {name} must be 1-D, got shape {tuple(arr.shape)}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"partition_by_area: {name} must hold integers, got dtype {arr.dtype}")
    return [int(v) for v in arr.reshape(-1).tolist()]


def _area(sizes: list[int], prefix: list[int], i: int, j: int) -> int:
    """Area(i, j) of Algorithm 1: neighbourhoods i..j (sizes descending) padded to sizes[i]."""
    return (prefix[j + 1] - prefix[i]) * sizes[i]


def _best_split(sizes, prefix, i: int, j: int) -> tuple[int, int, int]:
    """Theorem 3's linear scan: the cut t in [i, j) minimising max(Area(i,t), Area(t+1,j)).

    Returns (t, s1, s2); ties go to the smallest t.  O(j - i) with prefix sums.
    """
    best = None
    for t in range(i, j):
        s1 = _area(sizes, prefix, i, t)
        s2 = _area(sizes, prefix, t + 1, j)
        if best is None or max(s1, s2) < max(best[1], best[2]):
            best = (t, s1, s2)
    return best


def _algorithm1(sizes: list[int], counts: list[int], alpha: float, num_performer: int) -> list[Group]:
    """Algorithm 1 over one queue holding both size groups.

    ``sizes`` strictly descending, all counts > 0; the first ``num_performer``
    sizes form the Performer group, the rest the exact group.  Each starts as
    one element of S; splits stay inside a group.
    """
    prefix = [0]
    for c in counts:
        prefix.append(prefix[-1] + c)
    last = len(sizes) - 1
    bounds = [(0, num_performer - 1, True), (num_performer, last, False)]
    # S as (i, j, s, performer) ranges kept in size order, so max() breaks area
    # ties towards the group of larger neighbourhoods.
    groups = [(i, j, _area(sizes, prefix, i, j), perf) for i, j, perf in bounds if i <= j]
    while True:
        pos = max(range(len(groups)), key=lambda g: groups[g][2])
        i, j, s, performer = groups[pos]
        if i == j:  # line 6: the largest group is atomic
            break
        t, s1, s2 = _best_split(sizes, prefix, i, j)
        if max(s1, s2) >= alpha * s:  # line 12: the split is refused
            break
        groups[pos : pos + 1] = [(i, t, s1, performer), (t + 1, j, s2, performer)]
    return [Group(sizes[i], sizes[j], prefix[j + 1] - prefix[i], s, performer) for i, j, s, performer in groups]


def partition_by_area(sizes, counts, alpha: float = 0.4, threshold=None) -> list[Group]:
    """Partition neighbourhoods by size, then recursively by area (Algorithm 1).

    ``sizes``/``counts`` is the segment-size histogram: ``counts[i]``
    neighbourhoods hold ``sizes[i]`` rows.  Lists, tuples, numpy arrays and 1-D
    integer tensors are accepted, in any order; repeated sizes are merged.
    Sizes and counts of 0 are ignored: an empty neighbourhood holds no rows
    and needs no attention call, so it belongs to no group.

    1. Size split (only when ``threshold`` is given): sizes ``<= threshold``
       form the exact group, sizes ``> threshold`` the Performer group
       (``performer=True``).  ``threshold=math.inf`` puts everything in the
       exact group, ``threshold=0`` everything in the Performer group.
    2. Area split: Algorithm 1 over ONE set S that starts with both size
       groups (as the released code's ``divide_edges`` keeps one queue):
       repeatedly take the group of S with the largest area (ties: the one of
       larger sizes); if it holds a single distinct size, stop (line 6);
       otherwise find the cut t* minimising max(Area(i, t), Area(t+1, j)) by a
       linear scan over the sorted sizes with prefix sums (Theorem 3; ties: the
       smallest t); if max(s1, s2) >= alpha * s, stop (line 12); else replace
       the group by its two halves.  Once a run stops, nothing else is split,
       in either size group: the paper "terminate[s] partitioning other
       smaller groups" (DESIGN §9).

    Cuts fall between distinct sizes of one size group, so neighbourhoods of
    one size always share a group and no group mixes the two paths.  A split
    is accepted only when max(s1, s2) < alpha * s: alpha -> 0 never splits;
    alpha = 1 accepts every split, so a run ends only when its largest-area
    group holds a single size.

    Returns the groups ordered from the largest sizes to the smallest
    (Performer groups first); every present size lies in exactly one group.
    """
    alpha, limit = _check_alpha_threshold(alpha, threshold)
    hist = _histogram(sizes, counts)
    ordered = sorted(hist, reverse=True)
    if not ordered:
        return []
    num_performer = sum(1 for n in ordered if n > limit)
    return _algorithm1(ordered, [hist[n] for n in ordered], alpha, num_performer)


def _check_alpha_threshold(alpha, threshold) -> tuple[float, float]:
    """(alpha, size limit of the exact group) after the argument checks."""
    try:
        alpha = float(alpha)
    except (TypeError, ValueError):
        raise ValueError(f"partition_by_area: alpha must be a number, got {alpha!r}") from None
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"partition_by_area: alpha must be in (0, 1], got {alpha}")
    if threshold is None:
        return alpha, math.inf
    try:
        threshold = float(threshold)
    except (TypeError, ValueError):
        raise ValueError(f"partition_by_area: threshold must be a number or None, got {threshold!r}") from None
    if math.isnan(threshold) or threshold < 0:
        raise ValueError(f"partition_by_area: threshold must be >= 0, got {threshold}")
    return alpha, threshold


def _histogram(sizes, counts) -> dict[int, int]:
    """size -> count over the non-empty sizes with a non-zero count (repeated sizes merged)."""
    size_list = _as_ints(sizes, "sizes")
    count_list = _as_ints(counts, "counts")
    if len(size_list) != len(count_list):
        raise ValueError(f"partition_by_area: sizes and counts must have the same length, "
                         f"got {len(size_list)} and {len(count_list)}")
    if any(n < 0 for n in size_list):
        raise ValueError(f"partition_by_area: sizes must be >= 0, got {min(size_list)}")
    if any(c < 0 for c in count_list):
        raise ValueError(f"partition_by_area: counts must be >= 0, got {min(count_list)}")
    hist: dict[int, int] = {}
    for n, c in zip(size_list, count_list):
        if n > 0 and c > 0:
            hist[n] = hist.get(n, 0) + c
    return hist
