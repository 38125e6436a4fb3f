"""Work plan of the fused NT layer on CUDA (``nt_kernels::ntconv_fwd`` / ``ntconv_bwd``).

The fused op never holds per-message activations for the whole graph: it
walks the graph in *chunks* of whole neighbourhoods (consecutive centre
segments) of about ``chunk_rows`` packed rows, and every per-message buffer
(q, k, v, o, the messages, their gradients) is sized by one chunk.  Chunk
boundaries depend only on the graph and ``chunk_rows`` (never on the device
or a thread count), so results are reproducible.

Chunking: chunk c starts at the first segment whose first row is at or after
``c * chunk_rows`` (repeated starts merged, chunks without rows dropped).  A
chunk therefore holds fewer than ``chunk_rows + max_degree`` rows, and a
neighbourhood is never split between chunks.

The plan is one int64 tensor on the graph's device (it travels in the op's
``exact_plan`` slot and is cached on the CSR by :func:`cached_plan`); every
region starts at an even word, so every view of it is 16-byte aligned (one
Triton specialisation per kernel, whatever the chunk):

  header[0..15]     FUSED_MAGIC and the sizes it was built for (H_* below)
  chunk table       CHUNK_FIELDS words per chunk (C_* below): rows, segments,
                    region offsets, the exact kernels' work counts per class,
                    and both reduction lists' item bounds
  per chunk         the exact kernel's work list for the chunk's exact segments
                    (``plan.build_plan`` over the chunk-local rowptr), the
                    chunk's Performer segment ids (chunk-local), their chunk
                    offsets (``nt_kernels::performer_segment_table``: the
                    trusted table the Performer kernels take), the chunk-local
                    rowptr (``rowptr[s0:s1+1] - row0``), the segment of
                    every row (``seg_of_row``, absolute ids) and ``rrow``
                    (int32): its local rows ordered by (receiver, row)
  items             int32 triples (dest, first, end): the work items of the
                    two reduction lists below, positions first:end
  splits            int32 triples (dest, slot0, slot1): the split groups

Host syncs (docs/design.md, "Host syncs"): building a plan syncs (its checks,
the chunk boundaries, the work counts); reading one does not.  The host's view
of a plan (:class:`Plan`: chunks, views into the plan, launch specs) is parsed
once and kept on the plan tensor itself (:func:`read_plan`), so the plan a CSR
caches carries its parsed view, and a call that hands the op that tensor reads
nothing from the device.  The views are storage aliases, not tensor views: a
view would keep the plan tensor alive through the reference it holds to its
base, a cycle the garbage collector cannot see.

Segmented reductions (docs/kernels-ntconv-cuda.md, "Receiver and segment reductions").
Each chunk has two *reduction lists*: its rows grouped by receiver (positions
into ``rrow``; dest = the receiver) and by centre segment (positions = the
chunk-local rows; dest = the chunk-local segment).  A group of n rows becomes
ceil(n / P) *items* of at most P = ``piece_rows`` consecutive positions; the
items of a chunk's list are sorted by size class k (2^(k-1) < length <= 2^k,
k < REDUCE_CLASSES), and one launch reduces every class (each program takes
items of one class, in slots of 2^k rows: no loop over a block's longest
group, few padded lanes).  An item that is a whole group merges its result
into the running per-destination state directly (dest >= 0); the pieces of a
larger, *split* group store partial states in scratch slot ``-1 - dest``
(consecutive slots per group), and a second kernel combines each split
group's slots in slot order.  Everything is fixed by the graph and P: no
atomics, the same summation order every run.

Tile sizes of the per-message kernels come from the layer's shape, not from
autotuning (:func:`prologue_tiles`, :func:`weight_grad_tiles`,
:func:`reduce_tiles`, :func:`merge_tiles`, :func:`normalize_tiles`): they decide
summation orders, so they must not depend on timing, and they depend only on
sizes (never on the device), so a result is the same on every GPU that runs
the same compiled code.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nt_kernels.backends.triton.ntconv_tiles import (PrologueTiles, ReduceTiles, WeightGradTiles, merge_tiles,
                                                     normalize_tiles, prologue_tiles, reduce_launch, reduce_tiles,
                                                     split_k_rows, weight_grad_tiles)
from nt_kernels.backends.triton.plan import H_MULTI, H_TILES, TILE_HEIGHTS, build_plan

__all__ = ["Chunk", "FUSED_MAGIC", "PART_ROWS", "PIECE_ROWS", "Plan", "PrologueTiles", "REDUCE_CLASSES", "Reduction",
           "ReduceTiles", "WeightGradTiles", "build_ntconv_plan", "cached_plan", "default_chunk_rows", "merge_tiles",
           "normalize_tiles", "prologue_tiles", "read_plan", "reduce_launch", "reduce_tiles", "split_k_rows",
           "weight_grad_tiles"]

FUSED_MAGIC = 0x4E54_4633  # "NTF3" (NTF2: no alignment, Performer tables or row segments; NTF1: no size classes)
HEADER = 16
(H_MAGIC, H_CHUNKS, H_CHUNK_ROWS, H_ROWS, H_SEGMENTS, H_OUT, H_MAX_TILE, H_EXACT, H_PERF,
 H_ITEMS_OFF, H_SPLITS_OFF, H_SPLITS_END, H_RECV_BOUND, H_PIECE_ROWS, H_COVERED) = range(15)
REDUCE_CLASSES = 7   # item size classes: slots of 1, 2, 4, ..., 64 rows
PIECE_ROWS = 64      # the largest item; a larger group splits into pieces of this many rows
PART_ROWS = 8        # q, k and v of a chunk start on 16-byte boundaries: their rows are padded to a multiple of 8
# Per reduction list and chunk (even, so that the item bounds the reduce kernel reads are aligned):
# REDUCE_CLASSES + 1 item bounds (absolute item indices, one range per class), the range of its split groups
# (absolute), its number of scratch slots and a spare word.
LIST_FIELDS = REDUCE_CLASSES + 5
(L_ITEMS, L_SPLIT0, L_SPLIT1, L_SLOTS) = (0, REDUCE_CLASSES + 1, REDUCE_CLASSES + 2, REDUCE_CLASSES + 3)
# Per chunk: rows, segments, the offsets of its regions, the number of exact and Performer segments, a
# spare word, the exact kernels' work per packed class and multi-tile items (EXACT_WORK words), then the lists.
EXACT_WORK = len(TILE_HEIGHTS) + 1
(C_ROW0, C_ROW1, C_SEG0, C_SEG1, C_EXACT_OFF, C_EXACT_LEN, C_EXACT, C_PERF_OFF, C_PERF, C_TABLE_OFF,
 C_RPTR_OFF, C_SEGROW_OFF, C_RROW_OFF, _C_SPARE, C_WORK) = range(15)
C_RECEIVERS = C_WORK + EXACT_WORK
C_SEGMENTS = C_RECEIVERS + LIST_FIELDS
CHUNK_FIELDS = C_SEGMENTS + LIST_FIELDS
CHUNK_BYTES = 4 << 30  # transient per-chunk buffers of the backward, about 64 B per row and channel
_HOST = "_nt_fused_plan"  # attribute of a plan tensor: (its version when parsed, its Plan)


def default_chunk_rows(channels: int) -> int:
    """Rows per chunk for a layer of C = ``channels``: a power of two near
    CHUNK_BYTES / (64 C), in [1024, 2**24] (2**20 for C = 64)."""
    rows = CHUNK_BYTES // (64 * max(int(channels), 1))
    return min(max(1 << (rows.bit_length() - 1), 1024), 1 << 24)


@dataclass(frozen=True)
class Reduction:
    """One chunk's reduction list (module docstring) as the host sees it."""

    items: torch.Tensor        # int32 (dest, first, end) triples of the whole plan, flat
    bounds: tuple[int, ...]    # REDUCE_CLASSES + 1 item indices: class k is items bounds[k]:bounds[k+1]
    device_bounds: torch.Tensor  # the same bounds in the plan (int64), read by the reduce kernel
    splits: torch.Tensor       # int32 (dest, slot0, slot1) triples of the whole plan, flat
    split0: int                # this chunk's split groups: split0:split0 + num_split
    num_split: int
    slots: int                 # scratch slots its pieces write (slots of split groups)
    launch: dict = field(default_factory=dict, compare=False, repr=False)  # channels -> programs

    def classes(self):
        """(slot rows, first item, number of items) of every non-empty class, smallest first."""
        return [(1 << k, self.bounds[k], self.bounds[k + 1] - self.bounds[k]) for k in range(REDUCE_CLASSES)
                if self.bounds[k + 1] > self.bounds[k]]

    def programs(self, channels: int) -> int:
        """Programs (per channel block) of the one launch that reduces every class over ``channels``:
        each class's items in blocks of its BLOCK_G (``reduce_tiles``); 0 for an empty list.  Kept
        per ``channels`` (the launch's grid, computed once per plan and layer)."""
        if channels not in self.launch:
            self.launch[channels] = sum(-(-num // reduce_tiles(channels, slot).block_g)
                                        for slot, _, num in self.classes())
        return self.launch[channels]


@dataclass(frozen=True)
class Chunk:
    """One chunk as the host sees it: rows ``row0:row1``, segments ``seg0:seg1``
    and aliases of its regions of the plan (None where the chunk has no such segments)."""

    row0: int
    row1: int
    seg0: int
    seg1: int
    exact_plan: torch.Tensor | None   # work list of the exact kernel, chunk-local rows
    exact_work: tuple[int, ...]       # the exact kernels' work: tiles per packed class, multi-tile items
    performer: torch.Tensor | None    # chunk-local Performer segment ids (int64)
    performer_table: torch.Tensor | None  # their chunk offsets (performer_segment_table: checked at build)
    rowptr: torch.Tensor              # chunk-local rowptr (seg1 - seg0 + 1,) int64
    seg_of_row: torch.Tensor          # (row1 - row0,) int64 absolute segment (centre node) of each row
    receivers: Reduction              # rows by receiver (positions into rrow, dest = receiver)
    segments: Reduction               # rows by centre segment (positions = rows, dest = local segment)
    rrow: torch.Tensor                # (row1 - row0,) int32 local rows in receiver order

    @property
    def rows(self) -> int:
        return self.row1 - self.row0

    @property
    def part_rows(self) -> int:
        """Rows of each of q, k, v in a chunk buffer (and of their gradients): ``rows`` padded to a
        multiple of PART_ROWS, so that every part starts 16-byte aligned in any dtype."""
        return -(-self.rows // PART_ROWS) * PART_ROWS


@dataclass(frozen=True)
class Plan:
    """The host's view of a fused plan: its chunks, the rows per piece it was built with, whether
    the two segment lists hold every packed row (then the attention outputs of a chunk need no zero
    fill: the kernels write every row), the header it was built with (checked against each call)
    and the launch specs of its calls (:meth:`memo`, filled on first use)."""

    chunks: list[Chunk]
    piece_rows: int
    rows_covered: bool
    header: tuple[int, ...]
    specs: dict = field(default_factory=dict, compare=False, repr=False)

    def memo(self, key, build):
        """``build()`` once per ``key``: launch specs and grids that depend only on the plan and the
        layer, kept for every later call on this plan."""
        if key not in self.specs:
            self.specs[key] = build()
        return self.specs[key]


def _sorted_ids(op: str, name: str, ids: torch.Tensor, num_segments: int) -> torch.Tensor:
    ids = torch.sort(ids.reshape(-1).to(torch.int64)).values
    if ids.numel():
        lo, hi, dup = torch.stack([ids[0], ids[-1], (torch.diff(ids) == 0).sum()]).tolist()
        if lo < 0 or hi >= num_segments:
            raise ValueError(f"{op}: {name} holds segment id {lo if lo < 0 else hi} outside [0, {num_segments})")
        if dup:
            raise ValueError(f"{op}: {name} lists a segment twice")
    return ids


def _check_graph(op: str, rowptr: torch.Tensor, num_rows: int, perm: torch.Tensor | None) -> None:
    steps = torch.diff(rowptr)
    first, last, min_step = torch.stack([rowptr[0], rowptr[-1], steps.min() if steps.numel() else rowptr[0] * 0]
                                        ).tolist()
    if first != 0 or last != num_rows or min_step < 0:
        raise ValueError(f"{op}: rowptr must start at 0, never decrease and end at E = {num_rows} "
                         f"(got first {first}, last {last})")
    if perm is not None and num_rows:
        lo, hi = torch.stack([perm.min(), perm.max()]).tolist()
        if lo < 0 or hi >= num_rows:
            raise ValueError(f"{op}: perm holds edge {lo if lo < 0 else hi} outside [0, {num_rows})")


def _chunk_bounds(rowptr: torch.Tensor, num_rows: int, chunk_rows: int) -> tuple[list[int], list[int]]:
    """Segment and row boundaries of the chunks (host lists, one sync)."""
    num_segments = rowptr.numel() - 1
    marks = torch.arange(0, num_rows, chunk_rows, device=rowptr.device)
    first = torch.searchsorted(rowptr, marks)
    seg = torch.unique(torch.cat([first, first.new_tensor([num_segments])]))
    seg_bounds = seg.tolist()
    row_bounds = rowptr[seg].tolist()
    keep = [0] + [i for i in range(1, len(seg_bounds)) if row_bounds[i] > row_bounds[i - 1]]
    return [seg_bounds[i] for i in keep], [row_bounds[i] for i in keep]


def _receiver_groups(receiver: torch.Tensor, row_starts: torch.Tensor, num_out: int):
    """(rrow, groups): rows ordered by (chunk, receiver, row), and the (dest, first, end, chunk) columns
    of the groups (one per chunk and receiver; positions into the chunk's part of rrow)."""
    num_rows = receiver.numel()
    rows = torch.arange(num_rows, device=receiver.device)
    chunk_of = torch.searchsorted(row_starts, rows, right=True) - 1
    key = chunk_of * max(num_out, 1) + receiver
    order = torch.argsort(key, stable=True)
    rrow = (order - row_starts[chunk_of]).to(torch.int32)   # position i lies in the chunk of row i
    sorted_key = key[order]
    is_first = torch.ones(num_rows, dtype=torch.bool, device=receiver.device)
    is_first[1:] = sorted_key[1:] != sorted_key[:-1]
    starts = torch.nonzero(is_first).squeeze(1)
    ends = torch.cat([starts[1:], starts.new_tensor([num_rows])])
    chunk = chunk_of[starts]
    base = row_starts[chunk]
    return rrow, (receiver[order[starts]], starts - base, ends - base, chunk)


def _segment_groups(rowptr: torch.Tensor, seg_bounds: list[int], row_bounds: list[int]):
    """The (dest, first, end, chunk) columns of the non-empty segments: chunk-local segment and rows."""
    device = rowptr.device
    segs = torch.nonzero(torch.diff(rowptr) > 0).squeeze(1)
    chunk = torch.searchsorted(torch.tensor(seg_bounds, dtype=torch.int64, device=device), segs, right=True) - 1
    base = torch.tensor(row_bounds, dtype=torch.int64, device=device)[chunk]
    seg0 = torch.tensor(seg_bounds, dtype=torch.int64, device=device)[chunk]
    return segs - seg0, rowptr[segs] - base, rowptr[segs + 1] - base, chunk


def _work_items(groups, num_chunks: int, piece_rows: int):
    """A reduction list (module docstring) from its groups' (dest, first, end, chunk) columns, sorted by
    (chunk, first): (items (K, 3) int32, splits (G, 3) int32, per-chunk table rows of LIST_FIELDS words
    with item and split indices relative to this list)."""
    dest, first, end, chunk = groups
    device = dest.device
    pieces = -(-(end - first) // piece_rows)
    group = torch.repeat_interleave(torch.arange(dest.numel(), device=device), pieces)
    start = torch.cumsum(pieces, 0) - pieces
    p_first = first[group] + (torch.arange(group.numel(), device=device) - start[group]) * piece_rows
    p_end = torch.minimum(p_first + piece_rows, end[group])
    p_chunk, split = chunk[group], pieces[group] > 1
    # Scratch slots: the split pieces of a chunk numbered in order (a split group's slots are consecutive).
    slots = torch.bincount(p_chunk[split], minlength=num_chunks)
    slot = torch.cumsum(split, 0) - split.long() - (torch.cumsum(slots, 0) - slots)[p_chunk]
    item_dest = torch.where(split, -1 - slot, dest[group])
    # Size class k: the smallest 2^k >= length; items sorted by (chunk, class), stable in position.
    sizes = 2 ** torch.arange(REDUCE_CLASSES, device=device)
    key = p_chunk * REDUCE_CLASSES + torch.searchsorted(sizes, p_end - p_first)
    order = torch.argsort(key, stable=True)
    items = torch.stack([item_dest, p_first, p_end], 1)[order].to(torch.int32)
    per_class = torch.bincount(key, minlength=num_chunks * REDUCE_CLASSES)
    item_bounds = torch.cat([key.new_zeros(1), torch.cumsum(per_class, 0)])
    big = pieces > 1
    splits = torch.stack([dest[big], slot[start[big]], slot[start[big]] + pieces[big]], 1).to(torch.int32)
    split_bounds = torch.cat([key.new_zeros(1), torch.cumsum(torch.bincount(chunk[big], minlength=num_chunks), 0)])
    item_bounds, split_bounds, slots = item_bounds.tolist(), split_bounds.tolist(), slots.tolist()
    table = [item_bounds[c * REDUCE_CLASSES:(c + 1) * REDUCE_CLASSES + 1] + split_bounds[c:c + 2] + [slots[c]]
             for c in range(num_chunks)]
    return items, splits, table


def _as_words(x: torch.Tensor) -> torch.Tensor:
    """An int32 tensor packed into int64 words (zero-padded to an even length)."""
    if x.numel() % 2:
        x = torch.cat([x, x.new_zeros(1)])
    return x.view(torch.int64)


def _even(x: torch.Tensor) -> torch.Tensor:
    """x (int64 words) zero-padded to an even length: the next region starts 16-byte aligned."""
    return torch.cat([x, x.new_zeros(1)]) if x.numel() % 2 else x


def _check_receivers(op: str, receiver: torch.Tensor, num_out: int, num_nodes: int | None) -> int:
    """The receivers' bound (largest + 1, 0 without rows); each must be below ``num_out`` and ``num_nodes``."""
    if not receiver.numel():
        return 0
    lo, hi = torch.stack([receiver.min(), receiver.max()]).tolist()
    limit = num_out if num_nodes is None else min(num_out, num_nodes)
    if lo < 0 or hi >= limit:
        raise ValueError(f"{op}: receiver holds node {lo if lo < 0 else hi} outside [0, {limit})")
    return hi + 1


def _chunk_regions(rowptr, exact, perf, rrow, seg_bounds, row_bounds, max_tile):
    """Per chunk: its regions (exact work list, Performer ids, their checked chunk offsets, local rowptr,
    row segments, rrow) and its exact work counts (one sync for all chunks)."""
    exact_bounds = torch.searchsorted(exact, torch.tensor(seg_bounds, dtype=torch.int64, device=rowptr.device))
    perf_bounds = torch.searchsorted(perf, torch.tensor(seg_bounds, dtype=torch.int64, device=rowptr.device))
    exact_bounds, perf_bounds = exact_bounds.tolist(), perf_bounds.tolist()
    regions, work = [], []
    for c in range(len(seg_bounds) - 1):
        s0, s1, r0, r1 = seg_bounds[c], seg_bounds[c + 1], row_bounds[c], row_bounds[c + 1]
        local_rowptr = rowptr[s0:s1 + 1] - r0
        e0, e1, p0, p1 = exact_bounds[c], exact_bounds[c + 1], perf_bounds[c], perf_bounds[c + 1]
        sub = build_plan(local_rowptr, exact[e0:e1] - s0, r1 - r0, max_tile) if e1 > e0 else rowptr.new_zeros(0)
        local_perf = perf[p0:p1] - s0
        table = (torch.ops.nt_kernels.performer_segment_table(local_rowptr, local_perf, r1 - r0) if p1 > p0
                 else rowptr.new_zeros(0))
        seg_of_row = torch.repeat_interleave(torch.arange(s0, s1, device=rowptr.device), torch.diff(local_rowptr),
                                             output_size=r1 - r0)
        regions.append((sub, local_perf, table, local_rowptr, seg_of_row, rrow[r0:r1].clone(), e1 - e0))
        work.append(torch.cat([sub[H_TILES:H_TILES + len(TILE_HEIGHTS)], sub[H_MULTI:H_MULTI + 1]]) if e1 > e0
                    else rowptr.new_zeros(EXACT_WORK))
    return regions, (torch.stack(work).tolist() if work else [])


def build_ntconv_plan(rowptr: torch.Tensor, receiver: torch.Tensor, exact_segments: torch.Tensor,
                      performer_segments: torch.Tensor, num_out: int, chunk_rows: int,
                      max_tile: int, op: str = "ntconv", num_nodes: int | None = None,
                      perm: torch.Tensor | None = None, piece_rows: int = PIECE_ROWS) -> torch.Tensor:
    """Build the fused op's plan (module docstring) on ``rowptr``'s device, with its host view attached.

    ``receiver`` (E,) is the receiver of every packed row, ``num_out`` the
    number of output rows; the segment lists are those of the op call, checked
    here (ids in range, none twice), like the receivers (< ``num_out`` and, when
    given, < ``num_nodes``, the rows of the receiver term), the row pointer
    (0 first, non-decreasing, E last) and, when given, ``perm`` (values in
    [0, E)).  ``piece_rows`` (P, at most 2 ** (REDUCE_CLASSES - 1)) is the largest work
    item of the segmented reductions.  Syncs with the host a few times (a plan is
    built once per graph; every call that reads it then syncs no more).
    """
    device = rowptr.device
    rowptr = rowptr.to(torch.int64)
    num_rows, num_segments = receiver.numel(), rowptr.numel() - 1
    if num_rows and not 0 <= num_out < 2 ** 31:
        raise ValueError(f"{op}: the number of output rows must be in [0, 2**31), got {num_out}")
    _check_graph(op, rowptr, num_rows, perm)
    if not 1 <= piece_rows <= 1 << (REDUCE_CLASSES - 1):
        raise ValueError(f"{op}: piece_rows must be in [1, {1 << (REDUCE_CLASSES - 1)}], got {piece_rows}")
    recv_bound = _check_receivers(op, receiver, num_out, num_nodes)
    exact = _sorted_ids(op, "exact_segments", exact_segments.to(device), num_segments)
    perf = _sorted_ids(op, "performer_segments", performer_segments.to(device), num_segments)
    listed = torch.zeros(num_segments, dtype=torch.bool, device=device)
    listed[exact], listed[perf] = True, True
    covered = int((torch.diff(rowptr) * listed).sum()) == num_rows
    seg_bounds, row_bounds = _chunk_bounds(rowptr, num_rows, chunk_rows) if num_rows else ([], [])
    num_chunks = max(len(seg_bounds) - 1, 0)
    row_starts = torch.tensor(row_bounds[:-1] or [0], dtype=torch.int64, device=device)
    rrow, recv_groups = _receiver_groups(receiver.to(torch.int64), row_starts, num_out)
    lists = [_work_items(recv_groups, num_chunks, piece_rows),
             _work_items(_segment_groups(rowptr, seg_bounds, row_bounds), num_chunks, piece_rows)]
    regions, work = _chunk_regions(rowptr, exact, perf, rrow, seg_bounds, row_bounds, max_tile)

    table, words = [], []
    offset = HEADER + CHUNK_FIELDS * num_chunks
    for c, (sub, local_perf, perf_table, local_rowptr, seg_of_row, local_rrow, num_exact) in enumerate(regions):
        starts = []
        for part in (sub, local_perf, perf_table, local_rowptr, seg_of_row, _as_words(local_rrow)):
            starts.append(offset)
            words.append(_even(part))
            offset += words[-1].numel()
        row = [row_bounds[c], row_bounds[c + 1], seg_bounds[c], seg_bounds[c + 1], starts[0], sub.numel(),
               num_exact, starts[1], local_perf.numel(), starts[2], starts[3], starts[4], starts[5], 0] + work[c]
        # The segment list's items and splits follow the receiver list's in the plan's arrays.
        item_base, split_base = 0, 0
        for items, splits, rows in lists:
            rows = rows[c]
            row += ([b + item_base for b in rows[:L_SPLIT0]] + [b + split_base for b in rows[L_SPLIT0:L_SLOTS]]
                    + [rows[L_SLOTS], 0])
            item_base, split_base = item_base + items.shape[0], split_base + splits.shape[0]
        table += row
    item_words = _even(_as_words(torch.cat([lists[0][0], lists[1][0]]).reshape(-1)))
    split_words = _even(_as_words(torch.cat([lists[0][1], lists[1][1]]).reshape(-1)))
    header = [FUSED_MAGIC, num_chunks, chunk_rows, num_rows, num_segments, num_out, max_tile,
              exact.numel(), perf.numel(), offset, offset + item_words.numel(),
              offset + item_words.numel() + split_words.numel(), recv_bound, piece_rows, int(covered)]
    head = header + [0] * (HEADER - len(header)) + table
    plan = torch.cat([torch.tensor(head, dtype=torch.int64, device=device), *words, item_words, split_words])
    _attach(plan, _parse(plan, head))
    return plan


def _alias(plan: torch.Tensor, word: int, length: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``length`` elements of ``dtype`` of the plan from word ``word`` on, sharing its storage without
    being a view of it (a view would keep the plan tensor alive: module docstring)."""
    per_word = 8 // dtype.itemsize
    out = torch.empty(0, dtype=dtype, device=plan.device)
    return out.set_(plan.untyped_storage(), (plan.storage_offset() + word) * per_word, (length,))


def _reduction(plan: torch.Tensor, head: list[int], at: int, items, splits) -> Reduction:
    """The reduction list whose LIST_FIELDS words start at word ``at`` of the chunk table."""
    w = head[at:at + LIST_FIELDS]
    return Reduction(items, tuple(w[L_ITEMS:L_SPLIT0]), _alias(plan, at, REDUCE_CLASSES + 1), splits, w[L_SPLIT0],
                     w[L_SPLIT1] - w[L_SPLIT0], w[L_SLOTS])


def _parse(plan: torch.Tensor, head: list[int]) -> Plan:
    """The host view of ``plan`` from its header and chunk table (``head``, already on the host)."""
    items_off, splits_off, splits_end = head[H_ITEMS_OFF], head[H_SPLITS_OFF], head[H_SPLITS_END]
    items = _alias(plan, items_off, 2 * (splits_off - items_off), torch.int32)
    splits = _alias(plan, splits_off, 2 * (splits_end - splits_off), torch.int32)
    chunks = []
    for c in range(head[H_CHUNKS]):
        base = HEADER + CHUNK_FIELDS * c
        t = head[base:base + CHUNK_FIELDS]
        rows, segs, perf = t[C_ROW1] - t[C_ROW0], t[C_SEG1] - t[C_SEG0], t[C_PERF]
        chunks.append(Chunk(
            t[C_ROW0], t[C_ROW1], t[C_SEG0], t[C_SEG1],
            _alias(plan, t[C_EXACT_OFF], t[C_EXACT_LEN]) if t[C_EXACT] else None,
            tuple(t[C_WORK:C_WORK + EXACT_WORK]),
            _alias(plan, t[C_PERF_OFF], perf) if perf else None,
            _alias(plan, t[C_TABLE_OFF], perf + 1) if perf else None,
            _alias(plan, t[C_RPTR_OFF], segs + 1), _alias(plan, t[C_SEGROW_OFF], rows),
            _reduction(plan, head, base + C_RECEIVERS, items, splits),
            _reduction(plan, head, base + C_SEGMENTS, items, splits),
            _alias(plan, t[C_RROW_OFF], rows, torch.int32)))
    return Plan(chunks, head[H_PIECE_ROWS], bool(head[H_COVERED]), tuple(head[:HEADER]))


def _attach(plan: torch.Tensor, host: Plan) -> Plan:
    setattr(plan, _HOST, (plan._version, host))
    return host


def read_plan(op: str, plan: torch.Tensor, *, num_rows: int, num_segments: int, num_out: int, chunk_rows: int,
              max_tile: int, num_exact: int, num_performer: int, num_nodes: int) -> Plan | None:
    """The host view of a plan built for exactly these sizes and a packed-tile cap at most
    ``max_tile``, or None when ``plan`` is not a fused plan (e.g. the exact kernel's own work list).
    ``num_nodes`` (rows of the receiver term) must exceed every receiver.

    The view is the one attached to ``plan`` when it was built or first read (no device access,
    unless the plan was changed in place since); otherwise it is parsed (one small device-to-host
    copy) and attached, so a plan read twice syncs once."""
    cached = getattr(plan, _HOST, None)
    if cached is not None and cached[0] == plan._version:
        host = cached[1]
    else:
        bound = HEADER + CHUNK_FIELDS * -(-num_rows // chunk_rows)
        head = plan[:min(bound, plan.numel())].tolist()
        if len(head) < HEADER or head[H_MAGIC] != FUSED_MAGIC:
            return None
        host = _attach(plan, _parse(plan, head))
    head = host.header
    want = {H_CHUNK_ROWS: chunk_rows, H_ROWS: num_rows, H_SEGMENTS: num_segments, H_OUT: num_out,
            H_EXACT: num_exact, H_PERF: num_performer}
    wrong = [(i, head[i], v) for i, v in want.items() if head[i] != v]
    if head[H_MAX_TILE] > max_tile:  # lower caps are fine: the launchers run every class up to max_tile
        wrong.append((H_MAX_TILE, head[H_MAX_TILE], max_tile))
    if wrong:
        raise ValueError(f"{op}: exact_plan was built for another graph, segment split or layer "
                         f"(header word, plan, call): {wrong}")
    if head[H_RECV_BOUND] > num_nodes:
        raise ValueError(f"{op}: the graph has receiver {head[H_RECV_BOUND] - 1} but receiver_term has "
                         f"{num_nodes} rows")
    return host


def cached_plan(csr, receiver_csr, threshold: float, dtype: torch.dtype, channels: int, heads: int,
                chunk_rows: int | None = None) -> torch.Tensor:
    """The fused plan of ``csr`` for this segment split and layer shape, cached on ``csr`` with its
    host view (:func:`read_plan`).

    What the public op passes as ``exact_plan`` on CUDA, so that a call reads
    its plan instead of building it (docs/design.md §9).
    """
    from nt_kernels.backends.triton.plan import max_packed_tile, shared_memory_per_block

    rows = default_chunk_rows(channels) if chunk_rows is None else int(chunk_rows)
    max_tile = max_packed_tile(dtype, channels // heads, shared_memory_per_block(csr.device))
    num_out = receiver_csr.rowptr.numel() - 1
    key = ("ntconv-plan", float(threshold), num_out, rows, max_tile)

    def build():
        exact, performer = csr.segment_split(threshold)
        return build_ntconv_plan(csr.rowptr, csr.receiver, exact, performer, num_out, rows, max_tile,
                                 perm=csr.perm)
    return csr.plan(key, build)
