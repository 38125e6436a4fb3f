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
* Opt-in *row blocks* (``blocks=True``; issue 40): segments of 1 <= n <=
  ``BLOCK_SMALL`` (16) rows are not packed by size but taken in place, as
  contiguous runs of packed rows: window w holds the listed small segments
  whose start row lies in [w * BLOCK_WINDOW, (w + 1) * BLOCK_WINDOW)
  (BLOCK_WINDOW = 49), from the first such start to the last such end, at most
  BLOCK_WINDOW - 1 + BLOCK_SMALL = 64 rows: one 64-row tile (class
  BLOCK_CLASS) with whole segments only.  A per-row key (the row's segment
  start, -1 for rows of segments that are not listed or not small) is the
  block-diagonal mask, read with one vector load beside the rows themselves:
  no chain of dependent loads (tile entry, then segment starts, then rows) and
  no division per element.  Windows without a small segment are sorted last
  and not counted.

Layout (all int64, offsets are absolute indices into the plan):

  header[0]        PLAN_MAGIC
  header[1 + c]    number of packed tiles of class c (heights TILE_HEIGHTS[c])
  header[4 + c]    offset of the first tile of class c (3 entries per tile)
  header[7]        number of multi-tile work items
  header[8]        offset of the multi-tile items (3 entries per item)
  header[9]        max_tile
  header[10]       number of row-block tiles (0 without ``blocks``)
  header[11]       offset of the row-block tiles (3 entries per tile)
  header[12]       offset of the per-row keys (E entries; only with ``blocks``)
  tiles            (first, count, n): ``count`` segments of size n whose start
                   rows are ``plan[first : first + count]``
  starts           start rows of the packed segments, sorted by (class, n)
  multi            (start row, n, block index)
  row blocks       (first row, rows, 0) per non-empty window, then the empty
                   windows; only with ``blocks``
  keys             per packed row, its segment's start row if that segment is
                   listed and small, else -1; only with ``blocks``

The tile and item regions are sized by upper bounds known on the host (number
of segments K, number of rows E); the kernels read the true counts from the
header, so building a plan needs no host sync.
"""
from __future__ import annotations

import os

import torch

__all__ = ["BLOCK_CLASS", "BLOCK_SMALL", "BLOCK_WINDOW", "PLAN_BLOCK", "SM90_SHARED_MEMORY", "TILE_HEIGHTS",
           "blocks_requested", "build_plan", "check_plan", "describe_plan", "has_blocks", "max_packed_tile",
           "plan_length", "shared_memory_per_block"]

PLAN_MAGIC = 0x4E54_5031  # "NTP1"
PLAN_BLOCK = 64
TILE_HEIGHTS = (16, 32, 64)
HEADER = 16
H_TILES, H_TILE_OFF, H_MULTI, H_MULTI_OFF, H_MAX_TILE = 1, 4, 7, 8, 9
H_BLOCKS, H_BLOCK_OFF, H_KEYS_OFF = 10, 11, 12
# Row blocks (opt-in): segments of at most BLOCK_SMALL rows, taken in windows of BLOCK_WINDOW start rows, so that
# a window's rows (from its first start to its last end) fit one PLAN_BLOCK-row tile of class BLOCK_CLASS.
BLOCK_SMALL = 16
BLOCK_WINDOW = PLAN_BLOCK - BLOCK_SMALL + 1
BLOCK_CLASS = len(TILE_HEIGHTS) + 1
_NUM_KEYS = PLAN_BLOCK + 1  # group key = class * _NUM_KEYS + n
SM90_SHARED_MEMORY = 232_448  # opt-in shared memory per block of sm_90, bytes
PACKED_OPERANDS = 4  # TILE x BLOCK_D operands the packed backward keeps in shared memory


def max_packed_tile(dtype: torch.dtype, head_dim: int, shared_memory: int = SM90_SHARED_MEMORY) -> int:
    """Tallest packed tile the kernels can run for this dtype, head dim and
    shared memory per block (bytes; :func:`shared_memory_per_block`).

    The packed backward holds four TILE x BLOCK_D operands in shared memory
    (BLOCK_D: the head dim padded to a power of two >= 16).  On sm_90
    (232,448 B per block) float32 with BLOCK_D = 256 needs 262,144 B for a
    64-row tile, so its plans stop at 32-row tiles; on sm_86 / sm_89
    (101,376 B) float32 with BLOCK_D = 128 stops at 32 rows and BLOCK_D = 256
    at 16.  Segments above the cap go to the multi-tile kernels (one
    PLAN_BLOCK-row block each).  scripts/triton_check.py compiles the kernels
    against each architecture's limit.
    """
    padded = max(16, 1 << (int(head_dim) - 1).bit_length())
    item = dtype.itemsize
    fitting = [t for t in TILE_HEIGHTS if PACKED_OPERANDS * t * padded * item <= shared_memory]
    return fitting[-1] if fitting else TILE_HEIGHTS[0]


_SHARED_MEMORY: dict[int, int] = {}  # CUDA device index -> opt-in shared memory per block


def _cuda_shared_memory(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    value = getattr(props, "shared_memory_per_block_optin", None)
    if value:
        return int(value)
    from triton.runtime import driver

    return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])


def shared_memory_per_block(device: torch.device) -> int:
    """Opt-in shared memory per block of a CUDA device, in bytes (sm_90's off CUDA, e.g. under the interpreter).

    Read once per device (a plain dict, so a compiled region that runs after an
    eager call only reads it)."""
    if device.type != "cuda":
        return SM90_SHARED_MEMORY
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SHARED_MEMORY:
        _SHARED_MEMORY[index] = _cuda_shared_memory(index)
    return _SHARED_MEMORY[index]


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


BLOCKS_ENV = "NT_KERNELS_EXACT_BLOCKS"


def blocks_requested(max_tile: int) -> bool:
    """Whether the exact op's plans take row blocks: ``NT_KERNELS_EXACT_BLOCKS=1`` (opt-in until a GPU has
    timed them; read at every call) and a 64-row tile cap."""
    return max_tile == PLAN_BLOCK and os.environ.get(BLOCKS_ENV, "0") == "1"


def has_blocks(plan: torch.Tensor, num_segments: int, num_rows: int) -> bool:
    """Whether ``plan`` (checked by :func:`check_plan`) was built with row blocks: read from its length on the
    host.  (Launching the row-block class on a plan without them is only a wasted launch: its count is 0.)"""
    return plan.numel() == plan_length(num_segments, num_rows, PLAN_BLOCK, True)


def _windows(num_rows: int) -> int:
    """Row-block windows of a CSR with ``num_rows`` rows."""
    return -(-num_rows // BLOCK_WINDOW)


def plan_length(num_segments: int, num_rows: int, max_tile: int, blocks: bool = False) -> int:
    """Length of a plan for ``num_segments`` segments of a CSR with ``num_rows`` rows and tile cap ``max_tile``
    (with the row-block region and the per-row keys when ``blocks``)."""
    length = HEADER + 4 * num_segments + 3 * _multi_bound(num_rows, max_tile)
    return length + 3 * _windows(num_rows) + num_rows if blocks else length


def check_plan(op: str, plan: torch.Tensor, segments: torch.Tensor, num_rows: int, max_tile: int) -> None:
    """A plan handed to a kernel must be one built for ``segments`` (checked without a host sync).

    Its length encodes the segment count, the row count and its tile cap, so a
    plan of another segment list or graph, or one whose packed tiles are taller
    than the launchers run for this dtype / head dim / device (``max_tile``),
    is caught here instead of leaving rows unwritten.  Plans with a lower cap
    are valid (their larger segments are multi-tile items).
    """
    if not isinstance(plan, torch.Tensor) or plan.dtype != torch.int64 or plan.dim() != 1:
        raise ValueError(f"{op}: plan must be a 1-D int64 tensor from build_plan")
    if plan.device != segments.device:
        raise ValueError(f"{op}: plan is on {plan.device} but the segments are on {segments.device}")
    allowed = {plan_length(segments.numel(), num_rows, t) for t in TILE_HEIGHTS if t <= max_tile}
    if max_tile == PLAN_BLOCK:  # with row blocks (64-row tiles only)
        allowed.add(plan_length(segments.numel(), num_rows, PLAN_BLOCK, True))
    allowed = sorted(allowed)
    if plan.numel() not in allowed:
        raise ValueError(f"{op}: plan does not match the segment list: it has {plan.numel()} entries, a plan of "
                         f"{segments.numel()} segments over E = {num_rows} rows with max_tile <= {max_tile} has "
                         f"{' or '.join(map(str, allowed))}")


def build_plan(rowptr: torch.Tensor, segments: torch.Tensor, num_rows: int | None = None,
               max_tile: int = PLAN_BLOCK, blocks: bool = False):
    """Build the work list for ``segments`` (1-D int64 segment ids) of a CSR ``rowptr``.

    ``num_rows`` (= rowptr[-1] = E) sizes the multi-tile region; when it is not
    given it is read from ``rowptr`` (one host sync).  ``max_tile`` (one of
    TILE_HEIGHTS, see :func:`max_packed_tile`) is the tallest packed tile;
    larger segments become multi-tile items.  ``blocks`` (only with
    ``max_tile`` = PLAN_BLOCK) takes the segments of at most BLOCK_SMALL rows
    in place as row blocks instead of packing them by size.  Returns a 1-D
    int64 tensor on ``rowptr``'s device, of length :func:`plan_length`.
    """
    if max_tile not in TILE_HEIGHTS:
        raise ValueError(f"build_plan: max_tile must be one of {TILE_HEIGHTS}, got {max_tile}")
    if blocks and max_tile != PLAN_BLOCK:
        raise ValueError(f"build_plan: blocks needs max_tile = {PLAN_BLOCK} (the row-block tile), got {max_tile}")
    device = rowptr.device
    rowptr = rowptr.to(torch.int64)
    seg = segments.to(device=device, dtype=torch.int64).reshape(-1)
    if num_rows is None:
        num_rows = int(rowptr[-1])
    num_seg = seg.numel()
    multi_bound = _multi_bound(num_rows, max_tile)
    starts_off = HEADER + 3 * num_seg
    multi_off = starts_off + num_seg
    block_off = multi_off + 3 * multi_bound
    keys_off = block_off + 3 * _windows(num_rows)
    if num_seg == 0:
        header = torch.zeros(HEADER, dtype=torch.int64, device=device)
        header[0] = PLAN_MAGIC
        header[H_MULTI_OFF] = multi_off
        header[H_MAX_TILE] = max_tile
        parts = [header, torch.zeros(3 * multi_bound, dtype=torch.int64, device=device)]
        if blocks:  # every window empty, every key -1
            header[H_BLOCK_OFF], header[H_KEYS_OFF] = block_off, keys_off
            parts.append(_block_region(rowptr, seg, seg, seg, seg.bool(), num_rows)[0])
        return torch.cat(parts)

    # Step 1: size and class of every listed segment (row-block segments leave the packed and multi-tile classes).
    start = rowptr[seg]
    size = rowptr[seg + 1] - start
    cls = _class_table(device, max_tile)[size.clamp(max=PLAN_BLOCK + 1)]
    small = (size >= 1) & (size <= BLOCK_SMALL) if blocks else None
    if blocks:
        cls = torch.where(small, torch.full_like(cls, -1), cls)
    # Steps 2-4: packed segments grouped by (class, size), then cut into tiles.
    sorted_starts, group_count, group_first = _packed_groups(start, size, cls)
    tiles, class_tiles, class_first = _packed_tiles(group_count, group_first, num_seg, starts_off)
    # Step 5: multi-tile items.
    multi, num_items = _multi_items(start, size, cls, multi_bound)
    # Step 6: header with the device-side counts and region offsets.
    header = torch.cat([
        torch.tensor([PLAN_MAGIC], dtype=torch.int64, device=device),
        class_tiles,
        HEADER + 3 * class_first,
        num_items,
        torch.tensor([multi_off, max_tile], dtype=torch.int64, device=device),
    ])
    if not blocks:
        header = torch.cat([header, torch.zeros(HEADER - 10, dtype=torch.int64, device=device)])
        return torch.cat([header, tiles, sorted_starts, multi])
    region, num_blocks = _block_region(rowptr, seg, start, size, small, num_rows)
    header = torch.cat([header, num_blocks, torch.tensor([block_off, keys_off], dtype=torch.int64, device=device),
                        torch.zeros(HEADER - 13, dtype=torch.int64, device=device)])
    return torch.cat([header, tiles, sorted_starts, multi, region])


def _block_region(rowptr: torch.Tensor, seg: torch.Tensor, start: torch.Tensor, size: torch.Tensor,
                  small: torch.Tensor, num_rows: int):
    """Step 7 (row blocks): the windows' tiles then the per-row keys, and the number of non-empty windows."""
    block_tiles, num_blocks = _row_blocks(start, size, small, num_rows)
    return torch.cat([block_tiles, _row_keys(rowptr, seg, small, num_rows)]), num_blocks


def _row_blocks(start: torch.Tensor, size: torch.Tensor, small: torch.Tensor, num_rows: int):
    """Step 7a: per window, (first row, rows, 0) from its first small segment's start to its last one's end
    (integer min / max: deterministic), non-empty windows first; and their count (a 1-element tensor)."""
    windows = _windows(num_rows)
    device = start.device
    slot = torch.where(small, start // BLOCK_WINDOW, torch.full_like(start, windows))  # slot `windows`: the rest
    lo = torch.full((windows + 1,), num_rows, dtype=torch.int64, device=device)
    lo.scatter_reduce_(0, slot, start, "amin")
    hi = torch.zeros(windows + 1, dtype=torch.int64, device=device)
    hi.scatter_reduce_(0, slot, start + size, "amax")
    lo, hi = lo[:windows], hi[:windows]
    empty = hi <= lo
    order = torch.argsort(empty.to(torch.int8), stable=True)
    rows = torch.where(empty, 0, hi - lo)[order]
    entries = torch.stack([lo[order].clamp(max=max(num_rows - 1, 0)), rows, torch.zeros_like(rows)], 1)
    return entries.reshape(-1), (~empty).sum().reshape(1)


def _row_keys(rowptr: torch.Tensor, seg: torch.Tensor, small: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Step 7b: per packed row, its segment's start row where that segment is listed and small, else -1."""
    device = rowptr.device
    flag = torch.zeros(rowptr.numel() - 1, dtype=torch.bool, device=device)
    flag.scatter_(0, seg, small)
    row_seg = torch.searchsorted(rowptr, torch.arange(num_rows, device=device), right=True) - 1
    return torch.where(flag[row_seg], rowptr[row_seg], torch.full_like(row_seg, -1))


def _packed_groups(start: torch.Tensor, size: torch.Tensor, cls: torch.Tensor):
    """Step 2: group packed segments by (class, size); others go to a sentinel group.

    Returns the start rows sorted by group, and per group its segment count
    and the index of its first segment in that order.
    """
    num_classes = len(TILE_HEIGHTS)
    num_groups = num_classes * _NUM_KEYS
    packed = (cls >= 0) & (cls < num_classes)
    key = torch.where(packed, cls * _NUM_KEYS + size, torch.full_like(size, num_groups))
    order = torch.argsort(key, stable=True)
    group_count = torch.zeros(num_groups + 1, dtype=torch.int64, device=start.device)
    group_count.scatter_add_(0, key, torch.ones_like(key))
    group_count = group_count[:num_groups]
    return start[order], group_count, torch.cumsum(group_count, 0) - group_count


def _packed_tiles(group_count: torch.Tensor, group_first: torch.Tensor, num_seg: int, starts_off: int):
    """Steps 3-4: k = T // n segments of size n per tile; one (first, count, n) entry per tile.

    The tile region has ``num_seg`` entries (an upper bound on the tiles);
    returns it with the tile count and first tile index of every class.
    """
    device = group_count.device
    num_classes = len(TILE_HEIGHTS)
    num_groups = num_classes * _NUM_KEYS
    gid = torch.arange(num_groups, device=device)
    group_n = gid % _NUM_KEYS
    heights = torch.tensor(TILE_HEIGHTS, dtype=torch.int64, device=device)
    per_tile = (heights[gid // _NUM_KEYS] // group_n.clamp(min=1)).clamp(min=1)
    group_tiles = torch.where(group_n > 0, (group_count + per_tile - 1) // per_tile, 0)
    tile_end = torch.cumsum(group_tiles, 0)
    class_tiles = group_tiles.view(num_classes, _NUM_KEYS).sum(1)
    class_first = torch.cumsum(class_tiles, 0) - class_tiles
    t = torch.arange(num_seg, device=device)
    g = torch.searchsorted(tile_end, t, right=True).clamp(max=num_groups - 1)
    local = t - (tile_end[g] - group_tiles[g])
    first = group_first[g] + local * per_tile[g]
    count = torch.minimum(per_tile[g], group_count[g] - local * per_tile[g])
    tiles = torch.stack([starts_off + first, count, group_n[g]], 1).reshape(-1)
    return tiles, class_tiles, class_first


def _multi_items(start: torch.Tensor, size: torch.Tensor, cls: torch.Tensor, multi_bound: int):
    """Step 5: one (start row, n, block index) item per PLAN_BLOCK rows of the
    multi-tile segments, largest segments first; ``multi_bound`` entries and the
    true item count (a 1-element tensor)."""
    blocks = torch.where(cls == len(TILE_HEIGHTS), (size + PLAN_BLOCK - 1) // PLAN_BLOCK, 0)
    big_order = torch.argsort(-blocks, stable=True)
    big_blocks = blocks[big_order]
    item_end = torch.cumsum(big_blocks, 0)
    u = torch.arange(multi_bound, device=start.device)
    idx = torch.searchsorted(item_end, u, right=True).clamp(max=start.numel() - 1)
    block = u - (item_end[idx] - big_blocks[idx])
    big_seg = big_order[idx]
    return torch.stack([start[big_seg], size[big_seg], block], 1).reshape(-1), item_end[-1:]


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
    if not p[H_KEYS_OFF]:
        return {"packed": packed, "multi": multi}
    off, keys = p[H_BLOCK_OFF], p[H_KEYS_OFF]
    blocks = [(p[off + 3 * t], p[keys + p[off + 3 * t]: keys + p[off + 3 * t] + p[off + 3 * t + 1]])
              for t in range(p[H_BLOCKS])]
    return {"packed": packed, "multi": multi, "blocks": blocks}
