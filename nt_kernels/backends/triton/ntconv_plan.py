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
``exact_plan`` slot and is cached on the CSR by :func:`cached_plan`):

  header[0..15]     FUSED_MAGIC and the sizes it was built for (H_* below)
  chunk table       CHUNK_FIELDS words per chunk (C_* below)
  per chunk         the exact kernel's work list for the chunk's exact segments
                    (``plan.build_plan`` over the chunk-local rowptr), the
                    chunk's Performer segment ids (chunk-local), and the
                    chunk-local rowptr (``rowptr[s0:s1+1] - row0``)
  items             int32 triples (dest, first, end): the work items of the
                    two reduction lists below, positions first:end
  splits            int32 triples (dest, slot0, slot1): the split groups
  rrow              int32, per chunk: its local rows ordered by (receiver,
                    row); chunk c occupies positions row0..row1 of it

Segmented reductions (docs/kernels-ntconv-cuda.md, "Receiver and segment reductions").
Each chunk has two *reduction lists*: its rows grouped by receiver (positions
into ``rrow``; dest = the receiver) and by centre segment (positions = the
chunk-local rows; dest = the chunk-local segment).  A group of n rows becomes
ceil(n / P) *items* of at most P = ``piece_rows`` consecutive positions; the
items of a chunk's list are sorted by size class k (2^(k-1) < length <= 2^k,
k < REDUCE_CLASSES), so one launch per class reduces slots of 2^k rows each
(no loop over a block's longest group, few padded lanes).  An item that is a
whole group merges its result into the running per-destination state
directly (dest >= 0); the pieces of a larger, *split* group store partial
states in scratch slot ``-1 - dest`` (consecutive slots per group), and a
second kernel combines each split group's slots in slot order.  Everything is
fixed by the graph and P: no atomics, the same summation order every run.

Tile sizes of the per-message kernels come from the layer's shape, not from
autotuning (:func:`prologue_tiles`, :func:`weight_grad_tiles`,
:func:`reduce_tiles`, :func:`merge_tiles`, :func:`normalize_tiles`): they decide
summation orders, so they must not depend on timing, and they depend only on
sizes (never on the device), so a result is the same on every GPU that runs
the same compiled code.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nt_kernels.backends.triton.plan import build_plan

__all__ = ["Chunk", "FUSED_MAGIC", "PIECE_ROWS", "Plan", "PrologueTiles", "REDUCE_CLASSES", "Reduction",
           "ReduceTiles", "WeightGradTiles", "build_ntconv_plan", "cached_plan", "default_chunk_rows", "merge_tiles",
           "normalize_tiles", "prologue_tiles", "read_plan", "reduce_tiles", "weight_grad_tiles"]

FUSED_MAGIC = 0x4E54_4632  # "NTF2" (NTF1: one receiver group per item, no size classes)
HEADER = 16
(H_MAGIC, H_CHUNKS, H_CHUNK_ROWS, H_ROWS, H_SEGMENTS, H_OUT, H_MAX_TILE, H_EXACT, H_PERF,
 H_ITEMS_OFF, H_SPLITS_OFF, H_RROW_OFF, H_RECV_BOUND, H_PIECE_ROWS, H_COVERED) = range(15)
REDUCE_CLASSES = 7   # item size classes: slots of 1, 2, 4, ..., 64 rows
PIECE_ROWS = 64      # the largest item; a larger group splits into pieces of this many rows
# Per reduction list and chunk: REDUCE_CLASSES + 1 item bounds (absolute item indices, one range per class),
# the range of its split groups (absolute) and its number of scratch slots.
LIST_FIELDS = REDUCE_CLASSES + 4
(L_ITEMS, L_SPLIT0, L_SPLIT1, L_SLOTS) = (0, REDUCE_CLASSES + 1, REDUCE_CLASSES + 2, REDUCE_CLASSES + 3)
(C_ROW0, C_ROW1, C_SEG0, C_SEG1, C_EXACT_OFF, C_EXACT_LEN, C_EXACT, C_PERF_OFF, C_PERF,
 C_RPTR_OFF, C_RECEIVERS) = range(11)
C_SEGMENTS = C_RECEIVERS + LIST_FIELDS
CHUNK_FIELDS = C_SEGMENTS + LIST_FIELDS
CHUNK_BYTES = 4 << 30  # transient per-chunk buffers of the backward, about 64 B per row and channel


def default_chunk_rows(channels: int) -> int:
    """Rows per chunk for a layer of C = ``channels``: a power of two near
    CHUNK_BYTES / (64 C), in [1024, 2**24] (2**20 for C = 64)."""
    rows = CHUNK_BYTES // (64 * max(int(channels), 1))
    return min(max(1 << (rows.bit_length() - 1), 1024), 1 << 24)


def _pow2(n: int, low: int = 16) -> int:
    """The next power of two >= max(n, low)."""
    return max(low, 1 << max(int(n) - 1, 0).bit_length())


# Register budgets (fp32 elements of a program's largest live tile), from ptxas on sm_90 (docs/kernels-ntconv-cuda.md,
# "Compile check"): beyond them the kernels spill or fall under 3 programs per SM.  Both kernels run 4 warps.
PROLOGUE_TILE = 2048       # rows x channels of z (and rows x columns of one output block): 16 per thread
PROLOGUE_WEIGHTS = 4096    # channels x columns of the w_qkv block one product reads
WGRAD_ACCUMULATOR = 4096   # BLOCK_M x BLOCK_N of the weight-gradient accumulator: 32 registers per thread
WGRAD_SPLITS = 512         # target number of split-K row blocks of a chunk
WGRAD_MIN_SPLIT_ROWS = 64  # fewest rows in a split-K block


@dataclass(frozen=True)
class PrologueTiles:
    """Launch shape of ``_prologue_kernel``: BLOCK_R rows x all BLOCK_C channels per program,
    output columns in blocks of BLOCK_N within each of q, k, v, edge features in steps of BLOCK_F."""

    block_r: int
    block_c: int
    block_n: int
    block_f: int
    num_warps: int
    num_stages: int


def prologue_tiles(channels: int, edge_dim: int, dtype_bytes: int = 2) -> PrologueTiles:
    """Tiles of the prologue for C = ``channels`` and F = ``edge_dim`` (0 without edge features):
    the whole (padded) channel width per program, so every input row is read once and z is
    computed once; BLOCK_R rows so that z stays within PROLOGUE_TILE elements (16 per thread of 4
    warps: C = 60 takes 32 rows), BLOCK_N columns so that the output block and the w_qkv block stay
    within PROLOGUE_TILE / PROLOGUE_WEIGHTS.  Parameters of ``dtype_bytes`` = 4 (float32) take 8 warps
    (their fp32 products spill at 4 warps for C = 60-64)."""
    block_c = _pow2(channels)
    block_r = min(max(PROLOGUE_TILE // block_c, 16), 128)
    block_n = min(block_c, max(16, PROLOGUE_TILE // block_r), max(16, PROLOGUE_WEIGHTS // block_c))
    block_f = min(_pow2(edge_dim), 32)
    # ptxas (sm_80/89/90): 4 warps keep the 2,048-element tiles spill-free up to C = 128 at 3 programs per SM;
    # from C = 256 on (16 rows x 256 channels) 8 warps and one stage (the fp32 product spills otherwise).
    if block_r * block_c > PROLOGUE_TILE:
        return PrologueTiles(block_r, block_c, block_n, block_f, 8, 1)
    return PrologueTiles(block_r, block_c, block_n, block_f, 8 if dtype_bytes > 2 else 4, 2)


@dataclass(frozen=True)
class WeightGradTiles:
    """Launch shape of the split-K weight gradient (ntconv_wgrad.py): rows in fixed blocks of
    ``split_rows`` (``splits`` of them), each walked in steps of BLOCK_R, into an output tile of
    BLOCK_M x BLOCK_N."""

    block_r: int
    block_m: int
    block_n: int
    split_rows: int
    splits: int
    num_warps: int


def weight_grad_tiles(rows: int, m: int, n: int, dtype_bytes: int = 2) -> WeightGradTiles:
    """Tiles of dW (m, n) = Aᵀ B over ``rows`` rows, for one part of A (m = C for each of q, k, v).

    BLOCK_N covers the whole width up to 128 and BLOCK_M as much of m as the accumulator budget
    allows, at most 128 (C = 60: one 64 x 64 tile per part of w_qkv, two for w_out's 120 rows); the
    rows split into about WGRAD_SPLITS blocks of a power-of-two size (>= WGRAD_MIN_SPLIT_ROWS),
    combined in block order.  4 warps; float32 operands (``dtype_bytes`` = 4) take 8 warps and half the
    accumulator, at most 64 rows (ptxas: w_out's 64 x 64 fp32 tile spills at C = 64 even on 8 warps,
    w_edge's 128 x 16 at C = 256 on sm_89).  Depends on sizes only."""
    block_n = min(_pow2(n), 128)  # 256-wide B tiles spill on sm_89 (bf16)
    wide = dtype_bytes > 2
    block_m = min(_pow2(m), max(16, WGRAD_ACCUMULATOR // (block_n * (2 if wide else 1))), 64 if wide else 128)
    split_rows = _pow2(-(-max(rows, 1) // WGRAD_SPLITS), WGRAD_MIN_SPLIT_ROWS)
    return WeightGradTiles(32, block_m, block_n, split_rows, -(-rows // split_rows), 8 if dtype_bytes > 2 else 4)


REDUCE_TILE = 4096       # items x rows x channels of one step of a segmented-reduction program
REDUCE_MAX_ROWS = 256    # rows of one step (tiny C: more programs rather than longer tiles)
REDUCE_MAX_CHANNELS = 256  # channels per program; wider rows split over a second grid axis
REDUCE_STATE = 1024      # items x channels of the per-item running state (up to six such fp32 tiles live)


@dataclass(frozen=True)
class ReduceTiles:
    """Launch shape of ``ntconv_reduce._reduce_kernel`` for one item class: BLOCK_G items of
    ``slot_rows`` rows per program, reduced BLOCK_E rows at a time (one step unless a slot is taller
    than the tile), BLOCK_C channels per program."""

    block_g: int
    block_e: int
    block_c: int
    slot_rows: int
    num_warps: int
    num_stages: int


def reduce_tiles(channels: int, slot_rows: int) -> ReduceTiles:
    """Tiles of the segmented reduction over ``channels`` columns for items of at most ``slot_rows``
    rows: BLOCK_C the padded width (at most REDUCE_MAX_CHANNELS), and REDUCE_TILE / BLOCK_C rows per
    step (at most REDUCE_MAX_ROWS: 64 for C = 60), filled with as many items as fit (64 one-row items,
    one 64-row item).  One pipeline stage: a slot is one step (four at most), and the latency of
    its gathers is hidden by the other programs on the SM, not by shared-memory buffers.
    Depends on sizes only."""
    block_c = min(_pow2(channels, 1), REDUCE_MAX_CHANNELS)
    rows = min(REDUCE_TILE // block_c, REDUCE_MAX_ROWS)
    block_e = min(slot_rows, rows)
    block_g = max(1, min(rows // block_e, REDUCE_STATE // block_c))
    return ReduceTiles(block_g, block_e, block_c, slot_rows, 4, 1)


NORMALIZE_TILE = 1024     # rows x heads per program of the centre softmax's second pass


def normalize_tiles(heads: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_H) of ``ntconv_reduce._normalize_kernel``: NORMALIZE_TILE (row, head) pairs
    per program."""
    block_h = _pow2(heads, 1)
    return max(1, NORMALIZE_TILE // block_h), block_h


def merge_tiles(channels: int) -> tuple[int, int]:
    """(BLOCK_P, BLOCK_C) of ``ntconv_reduce._merge_kernel``: the partial states of BLOCK_P pieces
    of one split group combined per step (a fixed tree), BLOCK_C channels per program."""
    block_c = min(_pow2(channels, 1), REDUCE_MAX_CHANNELS)
    return min(max(REDUCE_TILE // (4 * block_c), 4), 64), block_c


@dataclass(frozen=True)
class Reduction:
    """One chunk's reduction list (module docstring) as the host sees it."""

    items: torch.Tensor        # int32 (dest, first, end) triples of the whole plan, flat
    bounds: tuple[int, ...]    # REDUCE_CLASSES + 1 item indices: class k is items bounds[k]:bounds[k+1]
    splits: torch.Tensor       # int32 (dest, slot0, slot1) triples of the whole plan, flat
    split0: int                # this chunk's split groups: split0:split0 + num_split
    num_split: int
    slots: int                 # scratch slots its pieces write (slots of split groups)

    def classes(self):
        """(slot rows, first item, number of items) of every non-empty class, smallest first."""
        return [(1 << k, self.bounds[k], self.bounds[k + 1] - self.bounds[k]) for k in range(REDUCE_CLASSES)
                if self.bounds[k + 1] > self.bounds[k]]


@dataclass(frozen=True)
class Chunk:
    """One chunk as the host sees it: rows ``row0:row1``, segments ``seg0:seg1``
    and views into the plan (None where the chunk has no such segments)."""

    row0: int
    row1: int
    seg0: int
    seg1: int
    exact_plan: torch.Tensor | None   # work list of the exact kernel, chunk-local rows
    performer: torch.Tensor | None    # chunk-local Performer segment ids (int64)
    rowptr: torch.Tensor              # chunk-local rowptr (seg1 - seg0 + 1,) int64
    receivers: Reduction              # rows by receiver (positions into rrow, dest = receiver)
    segments: Reduction               # rows by centre segment (positions = rows, dest = local segment)
    rrow: torch.Tensor                # (row1 - row0,) int32 local rows in receiver order

    @property
    def rows(self) -> int:
        return self.row1 - self.row0


@dataclass(frozen=True)
class Plan:
    """The host's view of a fused plan: its chunks, the rows per piece it was built with, and
    whether the two segment lists hold every packed row (then the attention outputs of a chunk
    need no zero fill: the kernels write every row)."""

    chunks: list[Chunk]
    piece_rows: int
    rows_covered: bool = False


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


def build_ntconv_plan(rowptr: torch.Tensor, receiver: torch.Tensor, exact_segments: torch.Tensor,
                      performer_segments: torch.Tensor, num_out: int, chunk_rows: int,
                      max_tile: int, op: str = "ntconv", num_nodes: int | None = None,
                      perm: torch.Tensor | None = None, piece_rows: int = PIECE_ROWS) -> torch.Tensor:
    """Build the fused op's plan (module docstring) on ``rowptr``'s device.

    ``receiver`` (E,) is the receiver of every packed row, ``num_out`` the
    number of output rows; the segment lists are those of the op call, checked
    here (ids in range, none twice), like the receivers (< ``num_out`` and, when
    given, < ``num_nodes``, the rows of the receiver term), the row pointer
    (0 first, non-decreasing, E last) and, when given, ``perm`` (values in
    [0, E)).  ``piece_rows`` (P, at most 2 ** (REDUCE_CLASSES - 1)) is the largest work
    item of the segmented reductions.  Syncs with the host a few times.
    """
    device = rowptr.device
    rowptr = rowptr.to(torch.int64)
    num_rows, num_segments = receiver.numel(), rowptr.numel() - 1
    if num_rows and not 0 <= num_out < 2 ** 31:
        raise ValueError(f"{op}: the number of output rows must be in [0, 2**31), got {num_out}")
    _check_graph(op, rowptr, num_rows, perm)
    if not 1 <= piece_rows <= 1 << (REDUCE_CLASSES - 1):
        raise ValueError(f"{op}: piece_rows must be in [1, {1 << (REDUCE_CLASSES - 1)}], got {piece_rows}")
    recv_bound = 0
    if num_rows:
        lo, hi = torch.stack([receiver.min(), receiver.max()]).tolist()
        limit = num_out if num_nodes is None else min(num_out, num_nodes)
        if lo < 0 or hi >= limit:
            raise ValueError(f"{op}: receiver holds node {lo if lo < 0 else hi} outside [0, {limit})")
        recv_bound = hi + 1
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
    bounds = torch.tensor(seg_bounds, dtype=torch.int64, device=device)
    exact_bounds = torch.searchsorted(exact, bounds).tolist()
    perf_bounds = torch.searchsorted(perf, bounds).tolist()

    table, regions = [], []
    offset = HEADER + CHUNK_FIELDS * num_chunks
    for c in range(num_chunks):
        s0, s1, r0, r1 = seg_bounds[c], seg_bounds[c + 1], row_bounds[c], row_bounds[c + 1]
        local_rowptr = rowptr[s0:s1 + 1] - r0
        e0, e1 = exact_bounds[c], exact_bounds[c + 1]
        sub = build_plan(local_rowptr, exact[e0:e1] - s0, r1 - r0, max_tile) if e1 > e0 else rowptr.new_zeros(0)
        p0, p1 = perf_bounds[c], perf_bounds[c + 1]
        table += [r0, r1, s0, s1, offset, sub.numel(), e1 - e0, offset + sub.numel(), p1 - p0,
                  offset + sub.numel() + (p1 - p0)]
        # The segment list's items and splits follow the receiver list's in the plan's arrays.
        item_base, split_base = 0, 0
        for items, splits, rows in lists:
            rows = rows[c]
            table += ([b + item_base for b in rows[:L_SPLIT0]] + [b + split_base for b in rows[L_SPLIT0:L_SLOTS]]
                      + [rows[L_SLOTS]])
            item_base, split_base = item_base + items.shape[0], split_base + splits.shape[0]
        regions += [sub, perf[p0:p1] - s0, local_rowptr]
        offset += sub.numel() + (p1 - p0) + local_rowptr.numel()
    item_words = _as_words(torch.cat([lists[0][0], lists[1][0]]).reshape(-1))
    split_words = _as_words(torch.cat([lists[0][1], lists[1][1]]).reshape(-1))
    header = [FUSED_MAGIC, num_chunks, chunk_rows, num_rows, num_segments, num_out, max_tile,
              exact.numel(), perf.numel(), offset, offset + item_words.numel(),
              offset + item_words.numel() + split_words.numel(), recv_bound, piece_rows, int(covered)]
    head = torch.tensor(header + [0] * (HEADER - len(header)) + table, dtype=torch.int64, device=device)
    return torch.cat([head, *regions, item_words, split_words, _as_words(rrow)])


def read_plan(op: str, plan: torch.Tensor, *, num_rows: int, num_segments: int, num_out: int, chunk_rows: int,
              max_tile: int, num_exact: int, num_performer: int, num_nodes: int) -> Plan | None:
    """The chunks of a plan built for exactly these sizes and a packed-tile cap at most
    ``max_tile`` (one small device-to-host copy), or None when ``plan`` is not a fused plan
    (e.g. the exact kernel's own work list).  ``num_nodes`` (rows of the receiver term) must
    exceed every receiver."""
    bound = HEADER + CHUNK_FIELDS * -(-num_rows // chunk_rows)
    head = plan[:min(bound, plan.numel())].tolist()
    if len(head) < HEADER or head[H_MAGIC] != FUSED_MAGIC:
        return None
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
    items = plan[head[H_ITEMS_OFF]:head[H_SPLITS_OFF]].view(torch.int32)
    splits = plan[head[H_SPLITS_OFF]:head[H_RROW_OFF]].view(torch.int32)
    rrow = plan[head[H_RROW_OFF]:].view(torch.int32)

    def reduction(t, at):
        w = t[at:at + LIST_FIELDS]
        return Reduction(items, tuple(w[L_ITEMS:L_SPLIT0]), splits, w[L_SPLIT0], w[L_SPLIT1] - w[L_SPLIT0],
                         w[L_SLOTS])
    chunks = []
    for c in range(head[H_CHUNKS]):
        t = head[HEADER + CHUNK_FIELDS * c: HEADER + CHUNK_FIELDS * (c + 1)]
        exact = plan[t[C_EXACT_OFF]:t[C_EXACT_OFF] + t[C_EXACT_LEN]] if t[C_EXACT] else None
        perf = plan[t[C_PERF_OFF]:t[C_PERF_OFF] + t[C_PERF]] if t[C_PERF] else None
        chunks.append(Chunk(t[C_ROW0], t[C_ROW1], t[C_SEG0], t[C_SEG1], exact, perf,
                            plan[t[C_RPTR_OFF]:t[C_RPTR_OFF] + t[C_SEG1] - t[C_SEG0] + 1],
                            reduction(t, C_RECEIVERS), reduction(t, C_SEGMENTS), rrow[t[C_ROW0]:t[C_ROW1]]))
    return Plan(chunks, head[H_PIECE_ROWS], bool(head[H_COVERED]))


def cached_plan(csr, receiver_csr, threshold: float, dtype: torch.dtype, channels: int, heads: int,
                chunk_rows: int | None = None) -> torch.Tensor:
    """The fused plan of ``csr`` for this segment split and layer shape, cached on ``csr``.

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
