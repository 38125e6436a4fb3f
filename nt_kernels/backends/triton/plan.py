"""Work lists ("plans") for the Triton exact-attention kernels.

A plan is one flat int64 tensor on the graph's device, built from ``rowptr``
and the segment ids to process with torch ops only (no host sync when the row
count is given), so it can travel as the ``Tensor? plan`` argument of the op
schema and be cached on the CSR object.

Scheduling:

* Segments of size n <= ``PLAN_BLOCK`` (64) are *packed*: segments of equal
  size n share a query tile of height T in {16, 32, 64}, k = T // n per tile,
  so a tile never splits a segment and the block-diagonal mask of a tile is
  simply ``row // n == col // n``.  T is the smallest height that keeps at
  least 75 % of the tile's rows busy (``_size_class``).  One packed tile holds
  every query *and* key row of its segments.
* ``max_tile`` caps T (``max_packed_tile``: 32 for float32 with head dims
  above 128, whose 64-row packed backward would not fit in shared memory);
  segments above the cap go to the multi-tile path below.
* Segments with n > ``PLAN_BLOCK`` (or > max_tile) are *multi-tile*: one work item per block
  of ``PLAN_BLOCK`` rows (a query block in the forward and dQ passes, a key
  block in the dK/dV pass), each looping over the segment's other blocks.
  Items are ordered by decreasing segment size for load balance.
* Empty segments produce no work; rows of segments not listed are never named.

Layout (all int64, offsets are absolute indices into the plan):

  header[0]        PLAN_MAGIC
  header[1 + c]    number of packed tiles of class c (heights TILE_HEIGHTS[c])
  header[4 + c]    offset of the first tile of class c (3 entries per tile)
  header[7]        number of multi-tile work items
  header[8]        offset of the multi-tile items (3 entries per item)
  header[9]        max_tile
  tiles            (first, count, n): ``count`` segments of size n whose start
                   rows are ``plan[first : first + count]``
  starts           start rows of the packed segments, sorted by (class, n)
  multi            (start row, n, block index)

The tile and item regions are sized by upper bounds known on the host (number
of segments K, number of rows E); the kernels read the true counts from the
header, so building a plan needs no host sync.
"""
from __future__ import annotations

import torch

__all__ = ["PLAN_BLOCK", "TILE_HEIGHTS", "build_plan", "describe_plan", "max_packed_tile"]

PLAN_MAGIC = 0x4E54_5031  # "NTP1"
PLAN_BLOCK = 64
TILE_HEIGHTS = (16, 32, 64)
HEADER = 16
H_TILES, H_TILE_OFF, H_MULTI, H_MULTI_OFF, H_MAX_TILE = 1, 4, 7, 8, 9
_NUM_KEYS = PLAN_BLOCK + 1  # group key = class * _NUM_KEYS + n


def max_packed_tile(dtype: torch.dtype, head_dim: int) -> int:
    """Tallest packed tile the kernels can run for this dtype and head dim.

    The packed backward holds four TILE x BLOCK_D operands in shared memory:
    for float32 with BLOCK_D = 256 (head dims 129..256) a 64-row tile needs
    262,144 B, over the 232,448 B per block of sm_90 (scripts/triton_check.py),
    so such plans stop at 32-row tiles and send segments of 33..64 rows to the
    multi-tile kernels (one 64-row block each).
    """
    return 32 if dtype == torch.float32 and head_dim > 128 else PLAN_BLOCK


def _size_class(n: int, max_tile: int) -> int:
    """Packed tile class of a segment of 1 <= n <= max_tile rows."""
    classes = [c for c, height in enumerate(TILE_HEIGHTS) if height <= max_tile]
    for c in classes:
        height = TILE_HEIGHTS[c]
        if n <= height and (height // n) * n * 4 >= 3 * height:
            return c
    return classes[-1]


def _class_table(device, max_tile: int) -> torch.Tensor:
    """Size -> class lookup for sizes 0..PLAN_BLOCK+1 (-1: empty, len(TILE_HEIGHTS): multi-tile)."""
    multi = len(TILE_HEIGHTS)
    table = [-1] + [_size_class(n, max_tile) if n <= max_tile else multi
                    for n in range(1, PLAN_BLOCK + 1)] + [multi]
    return torch.tensor(table, dtype=torch.int64, device=device)


def _multi_bound(num_rows: int, max_tile: int) -> int:
    """Upper bound on the multi-tile items: a segment of n > t = max_tile rows
    has ceil(n / B) <= 2 n / (t + 1) blocks (1 <= 2 n / (t + 1) for t < n <= B;
    ceil(n / B) <= 2 n / (B + 1) for n > B)."""
    return 2 * num_rows // (max_tile + 1) + 1


def build_plan(rowptr: torch.Tensor, segments: torch.Tensor, num_rows: int | None = None,
               max_tile: int = PLAN_BLOCK):
    """Build the work list for ``segments`` (1-D int64 segment ids) of a CSR ``rowptr``.

    ``num_rows`` (= rowptr[-1] = E) sizes the multi-tile region; when it is not
    given it is read from ``rowptr`` (one host sync).  ``max_tile`` (one of
    TILE_HEIGHTS, see :func:`max_packed_tile`) is the tallest packed tile;
    larger segments become multi-tile items.  Returns a 1-D int64 tensor on
    ``rowptr``'s device.
    """
    if max_tile not in TILE_HEIGHTS:
        raise ValueError(f"build_plan: max_tile must be one of {TILE_HEIGHTS}, got {max_tile}")
    device = rowptr.device
    rowptr = rowptr.to(torch.int64)
    seg = segments.to(device=device, dtype=torch.int64).reshape(-1)
    if num_rows is None:
        num_rows = int(rowptr[-1])
    num_seg = seg.numel()
    num_classes = len(TILE_HEIGHTS)
    multi_bound = _multi_bound(num_rows, max_tile)
    tiles_off = HEADER
    starts_off = tiles_off + 3 * num_seg
    multi_off = starts_off + num_seg
    if num_seg == 0:
        header = torch.zeros(HEADER, dtype=torch.int64, device=device)
        header[0] = PLAN_MAGIC
        header[H_MULTI_OFF] = multi_off
        header[H_MAX_TILE] = max_tile
        return torch.cat([header, torch.zeros(3 * multi_bound, dtype=torch.int64, device=device)])

    # Step 1: size and class of every listed segment.
    start = rowptr[seg]
    size = rowptr[seg + 1] - start
    cls = _class_table(device, max_tile)[size.clamp(max=PLAN_BLOCK + 1)]
    packed = (cls >= 0) & (cls < num_classes)

    # Step 2: group packed segments by (class, size); others go to a sentinel group.
    num_groups = num_classes * _NUM_KEYS
    key = torch.where(packed, cls * _NUM_KEYS + size, torch.full_like(size, num_groups))
    order = torch.argsort(key, stable=True)
    sorted_starts = start[order]
    group_count = torch.zeros(num_groups + 1, dtype=torch.int64, device=device)
    group_count.scatter_add_(0, key, torch.ones_like(key))
    group_count = group_count[:num_groups]
    group_first = torch.cumsum(group_count, 0) - group_count

    # Step 3: tiles per group: k = T // n segments of size n per tile.
    gid = torch.arange(num_groups, device=device)
    group_n = gid % _NUM_KEYS
    heights = torch.tensor(TILE_HEIGHTS, dtype=torch.int64, device=device)
    per_tile = (heights[gid // _NUM_KEYS] // group_n.clamp(min=1)).clamp(min=1)
    group_tiles = torch.where(group_n > 0, (group_count + per_tile - 1) // per_tile, 0)
    tile_end = torch.cumsum(group_tiles, 0)
    class_tiles = group_tiles.view(num_classes, _NUM_KEYS).sum(1)
    class_first = torch.cumsum(class_tiles, 0) - class_tiles

    # Step 4: expand to one (first, count, n) entry per tile (region sized K >= #tiles).
    t = torch.arange(num_seg, device=device)
    g = torch.searchsorted(tile_end, t, right=True).clamp(max=num_groups - 1)
    local = t - (tile_end[g] - group_tiles[g])
    first = group_first[g] + local * per_tile[g]
    count = torch.minimum(per_tile[g], group_count[g] - local * per_tile[g])
    tiles = torch.stack([starts_off + first, count, group_n[g]], 1).reshape(-1)

    # Step 5: multi-tile items, one per PLAN_BLOCK rows, largest segments first.
    blocks = torch.where(cls == num_classes, (size + PLAN_BLOCK - 1) // PLAN_BLOCK, 0)
    big_order = torch.argsort(-blocks, stable=True)
    big_blocks = blocks[big_order]
    item_end = torch.cumsum(big_blocks, 0)
    u = torch.arange(multi_bound, device=device)
    idx = torch.searchsorted(item_end, u, right=True).clamp(max=num_seg - 1)
    block = u - (item_end[idx] - big_blocks[idx])
    big_seg = big_order[idx]
    multi = torch.stack([start[big_seg], size[big_seg], block], 1).reshape(-1)

    # Step 6: header with the device-side counts and region offsets.
    header = torch.cat([
        torch.tensor([PLAN_MAGIC], dtype=torch.int64, device=device),
        class_tiles,
        tiles_off + 3 * class_first,
        item_end[-1:],
        torch.tensor([multi_off, max_tile], dtype=torch.int64, device=device),
        torch.zeros(HEADER - 10, dtype=torch.int64, device=device),
    ])
    return torch.cat([header, tiles, sorted_starts, multi])


def describe_plan(plan: torch.Tensor) -> dict:
    """Decode a plan on the host (for tests and debugging, not the hot path).

    Returns ``{"packed": [(height, n, [start rows...]), ...],
    "multi": [(start, n, block), ...]}``.
    """
    p = plan.cpu().tolist()
    if p[0] != PLAN_MAGIC:
        raise ValueError("describe_plan: not an nt_kernels Triton plan")
    packed = []
    for c, height in enumerate(TILE_HEIGHTS):
        off = p[H_TILE_OFF + c]
        for t in range(p[H_TILES + c]):
            first, count, n = p[off + 3 * t: off + 3 * t + 3]
            packed.append((height, n, p[first: first + count]))
    off = p[H_MULTI_OFF]
    multi = [tuple(p[off + 3 * i: off + 3 * i + 3]) for i in range(p[H_MULTI])]
    return {"packed": packed, "multi": multi}
