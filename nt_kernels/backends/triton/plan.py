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

__all__ = ["PLAN_BLOCK", "SM90_SHARED_MEMORY", "TILE_HEIGHTS", "build_plan", "check_plan", "describe_plan",
           "max_packed_tile", "plan_length", "shared_memory_per_block"]

PLAN_MAGIC = 0x4E54_5031  # "NTP1"
PLAN_BLOCK = 64
TILE_HEIGHTS = (16, 32, 64)
HEADER = 16
H_TILES, H_TILE_OFF, H_MULTI, H_MULTI_OFF, H_MAX_TILE = 1, 4, 7, 8, 9
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


def plan_length(num_segments: int, num_rows: int, max_tile: int) -> int:
    """Length of a plan for ``num_segments`` segments of a CSR with ``num_rows`` rows and tile cap ``max_tile``."""
    return HEADER + 4 * num_segments + 3 * _multi_bound(num_rows, max_tile)


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
    allowed = sorted({plan_length(segments.numel(), num_rows, t) for t in TILE_HEIGHTS if t <= max_tile})
    if plan.numel() not in allowed:
        raise ValueError(f"{op}: plan does not match the segment list: it has {plan.numel()} entries, a plan of "
                         f"{segments.numel()} segments over E = {num_rows} rows with max_tile <= {max_tile} has "
                         f"{' or '.join(map(str, allowed))}")


def build_plan(rowptr: torch.Tensor, segments: torch.Tensor, num_rows: int | None = None,
               max_tile: int = PLAN_BLOCK):
    """Build the work list for ``segments`` (1-D int64 segment ids) of a CSR ``rowptr``.

    ``num_rows`` (= rowptr[-1] = E) sizes the multi-tile region; when it is not
    given it is read from ``rowptr`` (one host sync).  ``max_tile`` (one of
    TILE_HEIGHTS, see :func:`max_packed_tile`) is the tallest packed tile;
    larger segments become multi-tile items.  Returns a 1-D int64 tensor on
    ``rowptr``'s device, of length :func:`plan_length`.
    """
    if max_tile not in TILE_HEIGHTS:
        raise ValueError(f"build_plan: max_tile must be one of {TILE_HEIGHTS}, got {max_tile}")
    device = rowptr.device
    rowptr = rowptr.to(torch.int64)
    seg = segments.to(device=device, dtype=torch.int64).reshape(-1)
    if num_rows is None:
        num_rows = int(rowptr[-1])
    num_seg = seg.numel()
    multi_bound = _multi_bound(num_rows, max_tile)
    starts_off = HEADER + 3 * num_seg
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
        torch.zeros(HEADER - 10, dtype=torch.int64, device=device),
    ])
    return torch.cat([header, tiles, sorted_starts, multi])


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
    return {"packed": packed, "multi": multi}
