"""Tile sizes of the fused NT layer's per-message kernels (ntconv_plan.py re-exports them).

They come from the layer's shape, not from autotuning: they decide summation
orders, so they must not depend on timing, and they depend only on sizes
(never on the device), so a result is the same on every GPU that runs the same
compiled code.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PrologueTiles", "REDUCE_MAX_CHANNELS", "REDUCE_MAX_ROWS", "REDUCE_STATE", "REDUCE_TILE", "ReduceTiles",
           "WeightGradTiles", "merge_tiles", "normalize_tiles", "prologue_tiles", "reduce_launch", "reduce_tiles",
           "split_k_rows", "weight_grad_tiles"]


def _pow2(n: int, low: int = 16) -> int:
    """The next power of two >= max(n, low)."""
    return max(low, 1 << max(int(n) - 1, 0).bit_length())


# Register budgets (fp32 elements of a program's largest live tile), from ptxas on sm_90 (docs/kernels-ntconv-cuda-checks.md,
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
    # One stage for 16-bit parameters from C = 128 on (ptxas, sm_89, Triton 3.9, 16 x 128 with F = 16 and
    # pointers aligned as at run time: 2 stages spill 8 bytes; 1 stage 64 registers on sm_80 / 89, 72 on sm_90).
    stages = 1 if dtype_bytes == 2 and block_c >= 128 else 2
    return PrologueTiles(block_r, block_c, block_n, block_f, 8 if dtype_bytes > 2 else 4, stages)


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


def split_k_rows(rows: int) -> int:
    """Rows per split-K block of a chunk's ``rows`` rows: about WGRAD_SPLITS blocks of a power-of-two size,
    at least WGRAD_MIN_SPLIT_ROWS (depends on the row count only, so sums are bitwise the same run to run)."""
    return _pow2(-(-max(rows, 1) // WGRAD_SPLITS), WGRAD_MIN_SPLIT_ROWS)


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
    split_rows = split_k_rows(rows)
    return WeightGradTiles(32, block_m, block_n, split_rows, -(-rows // split_rows), 8 if dtype_bytes > 2 else 4)


REDUCE_TILE = 4096       # items x rows x channels of one step of a segmented-reduction program
REDUCE_MAX_ROWS = 256    # rows of one step (tiny C: more programs rather than longer tiles)
REDUCE_MAX_CHANNELS = 256  # channels per program; wider rows split over a second grid axis
REDUCE_STATE = 1024      # items x channels of the per-item running state (up to six such fp32 tiles live)


@dataclass(frozen=True)
class ReduceTiles:
    """Launch shape of one item class in ``ntconv_reduce._reduce_kernel``: BLOCK_G items of
    ``slot_rows`` rows per program, reduced BLOCK_E rows at a time (one step unless a slot is taller
    than the tile), BLOCK_C channels per program."""

    block_g: int
    block_e: int
    block_c: int
    slot_rows: int
    num_warps: int
    num_stages: int


def reduce_launch(channels: int) -> tuple[int, int, int]:
    """(BLOCK_C, ROWS, STATE_ITEMS) of the segmented reduction over ``channels`` columns: BLOCK_C the
    padded width (at most REDUCE_MAX_CHANNELS), ROWS = REDUCE_TILE / BLOCK_C rows per step (at most
    REDUCE_MAX_ROWS: 64 for C = 60) and at most STATE_ITEMS = REDUCE_STATE / BLOCK_C items per
    program.  ``_reduce_kernel`` derives each class's tiles from these three as :func:`reduce_tiles`
    does."""
    block_c = min(_pow2(channels, 1), REDUCE_MAX_CHANNELS)
    return block_c, min(REDUCE_TILE // block_c, REDUCE_MAX_ROWS), REDUCE_STATE // block_c


def reduce_tiles(channels: int, slot_rows: int) -> ReduceTiles:
    """Tiles of the segmented reduction over ``channels`` columns for items of at most ``slot_rows``
    rows (:func:`reduce_launch`): BLOCK_E = min(slot, ROWS) rows per step, filled with
    BLOCK_G = min(ROWS / BLOCK_E, STATE_ITEMS) items (64 one-row items, one 64-row item).  One
    pipeline stage: a slot is one step (four at most), and the latency of its gathers is hidden by
    the other programs on the SM, not by shared-memory buffers; 8 warps (the one kernel of all seven
    classes spilled at C = 256 with 4, and held fewer warps per SM).  Depends on sizes only."""
    block_c, rows, state_items = reduce_launch(channels)
    block_e = min(slot_rows, rows)
    block_g = max(1, min(rows // block_e, state_items))
    return ReduceTiles(block_g, block_e, block_c, slot_rows, 8, 1)


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
