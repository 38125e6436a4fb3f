"""Packed-tile kernels that hold every head of their rows: the bandwidth path for small segments.

The plan's packed tiles (plan.py: segments of equal size n <= 64, whole
segments per tile of height TILE) are walked ``TILES`` at a time, and a work
item holds *every head* of those tiles: operands are (B, TILE, DP) register
tensors with batch index b = tile * HP + head (HP: H padded to a power of two,
DP: D padded to a power of two, at least 16 where ``tl.dot`` contracts over
it).  So

* a load instruction reads whole (E, H, D) rows (H * D contiguous elements),
  not one head's D-slice of them, and with H and D constexpr the compiler sees
  their alignment and vectorises;
* ``TILES`` is the largest power of two with B * TILE * max(TILE, DP) <=
  ``tile_elems`` (configs.heads_tiles): enough packed segments per work item
  to keep the loads busy, and the same largest register tensor (operand or
  scores) for every head count;
* padding exists in registers only (masked loads and stores): q, k, v are read
  once, o and lse (and dq, dk, dv) written once;
* the contractions over d and over keys are batched ``tl.dot`` (``DOT=1``:
  tensor cores for half types, FMA for float32 in full precision) or
  broadcast products summed on CUDA cores (``DOT=0``: no padding of D to 16,
  for head dims <= 4), chosen per config.

Scores are masked block-diagonally within a tile (segment of row r is
r // n), as in the per-head kernels, and a NaN/inf input stays inside its
segment: operands contracted across segments are made finite and the
segment's outputs set to NaN.
"""
from __future__ import annotations

import triton
import triton.language as tl

from nt_kernels.backends.triton.common import (BLOCK_CLASS, LN2, LOG2E_C, LSE_UNALIGNED, block_rows, cast,
                                               finite_or_zero, mm, tile_table)

NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def tile_rows(plan, tab, n_tiles, g, TILE: tl.constexpr, TILES: tl.constexpr, H: tl.constexpr,
              HP: tl.constexpr, CLASS: tl.constexpr):
    """Rows of work item g (TILES packed tiles x HP heads): per (b, r) the packed row index,
    its local segment id and whether it is valid (the row blocks: common.block_rows), and per b its
    head."""
    b = tl.arange(0, TILES * HP)
    r = tl.arange(0, TILE)
    t = g * TILES + b // HP
    h = b % HP
    live = (t < n_tiles) & (h < H)
    entry = tab + 3 * t
    if CLASS == BLOCK_CLASS:
        first = tl.load(plan + entry, mask=live, other=0)
        nrows = tl.load(plan + entry + 1, mask=live, other=0)
        row, seg, valid = block_rows(plan, first[:, None], nrows[:, None], r[None, :])
        return row, seg, valid, h
    first = tl.load(plan + entry, mask=live, other=0)
    count = tl.load(plan + entry + 1, mask=live, other=0).to(tl.int32)
    n = tl.load(plan + entry + 2, mask=live, other=1).to(tl.int32)
    seg = r[None, :] // n[:, None]
    valid = seg < count[:, None]
    start = tl.load(plan + first[:, None] + seg, mask=valid, other=0)
    return start + (r[None, :] - seg * n[:, None]), seg, valid, h


@triton.jit
def load_heads(ptr, offs, valid, D: tl.constexpr, DP: tl.constexpr):
    """(B, TILE, DP) operand at row offsets ``offs`` (B, TILE); padding and invalid rows read as 0."""
    d = tl.arange(0, DP)
    mask = valid[:, :, None] & (d[None, None, :] < D)
    return tl.load(ptr + offs[:, :, None] + d[None, None, :], mask=mask, other=0.0)


@triton.jit
def tile_qkv(q_ptr, k_ptr, v_ptr, plan, tab, n_tiles, g, TILE: tl.constexpr, TILES: tl.constexpr,
             H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, CLASS: tl.constexpr):
    """Work item g's rows (tile_rows), their element offsets, whole rows of q, k, v, and the
    (B, TILE, TILE) same-segment mask."""
    row, seg, valid, h = tile_rows(plan, tab, n_tiles, g, TILE, TILES, H, HP, CLASS)
    offs = row * (H * D) + (h * D)[:, None]
    q = load_heads(q_ptr, offs, valid, D, DP)
    k = load_heads(k_ptr, offs, valid, D, DP)
    v = load_heads(v_ptr, offs, valid, D, DP)
    return row, valid, h, offs, q, k, v, seg[:, :, None] == seg[:, None, :]


@triton.jit
def store_heads(ptr, offs, valid, x, D: tl.constexpr, DP: tl.constexpr, BF16_EMU: tl.constexpr):
    """Store (B, TILE, DP), skipping padding columns and invalid rows."""
    d = tl.arange(0, DP)
    mask = valid[:, :, None] & (d[None, None, :] < D)
    tl.store(ptr + offs[:, :, None] + d[None, None, :], cast(x, ptr.dtype.element_ty, BF16_EMU), mask=mask)


@triton.jit
def dot_d(a, b, DOT: tl.constexpr, DOT_PREC: tl.constexpr, BF16_EMU: tl.constexpr):
    """(B, M, DP) x (B, N, DP) -> (B, M, N) float32: contraction over the head dim."""
    if DOT:
        return mm(a, tl.permute(b, (0, 2, 1)), DOT_PREC, BF16_EMU)
    return tl.sum(a[:, :, None, :].to(tl.float32) * b[:, None, :, :].to(tl.float32), axis=3)


@triton.jit
def dot_rows(w, x, DOT: tl.constexpr, DOT_PREC: tl.constexpr, BF16_EMU: tl.constexpr):
    """(B, M, N) float32 weights x (B, N, DP) -> (B, M, DP) float32: contraction over rows.
    With tensor cores the weights are rounded to x's dtype first (as FlashAttention does)."""
    if DOT:
        return mm(cast(w, x.dtype, BF16_EMU), x, DOT_PREC, BF16_EMU)
    return tl.sum(w[:, :, :, None] * x[:, None, :, :].to(tl.float32), axis=2)


@triton.jit
def bad_rows(x):
    """(B, TILE) 1 where a row of x (B, TILE, DP) holds a NaN or infinity."""
    return tl.max(tl.where(tl.abs(x.to(tl.float32)) < float("inf"), 0, 1), axis=2)


@triton.jit
def segment_flag(flag, same):
    """(B, TILE): whether ``flag`` is set on any row of each row's segment."""
    return tl.max(tl.where(same, flag[:, None, :], 0), axis=2) > 0


@triton.jit(do_not_specialize_on_alignment=LSE_UNALIGNED)
def _fwd_heads_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, plan, qk_scale,
                      H: tl.constexpr, D: tl.constexpr, CLASS: tl.constexpr, TILE: tl.constexpr,
                      TILES: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr, DOT: tl.constexpr,
                      DOT_PREC: tl.constexpr, BF16_EMU: tl.constexpr):
    n_tiles, tab = tile_table(plan, CLASS)
    for g in range(tl.program_id(0), tl.cdiv(n_tiles, TILES), tl.num_programs(0)):
        # Step 1: the rows of TILES tiles, every head; whole rows of q, k, v.
        row, valid, h, offs, q, k, v, same = tile_qkv(q_ptr, k_ptr, v_ptr, plan, tab, n_tiles, g, TILE, TILES, H,
                                                      HP, D, DP, CLASS)
        # Step 2: scores in the log2 domain, block-diagonal mask per tile.
        s = tl.where(same, dot_d(q, k, DOT, DOT_PREC, BF16_EMU) * qk_scale, NEG_INF)
        # Step 3: one-pass softmax (every key of a row is in its tile) and P V.
        m = tl.max(s, axis=2)
        p = tl.exp2(s - m[:, :, None])
        denom = tl.sum(p, axis=2)
        o = dot_rows(p, finite_or_zero(v), DOT, DOT_PREC, BF16_EMU) / denom[:, :, None]
        # Step 4: a NaN/inf value row poisons its own segment only; store o and the natural-log lse.
        o = tl.where(segment_flag(bad_rows(v), same)[:, :, None], float("nan"), o)
        store_heads(o_ptr, offs, valid, o, D, DP, BF16_EMU)
        tl.store(lse_ptr + row * H + h[:, None], (m + tl.log2(denom)) * LN2, mask=valid)


@triton.jit(do_not_specialize_on_alignment=LSE_UNALIGNED)
def _bwd_heads_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, dq_ptr, dk_ptr, dv_ptr, plan, scale, qk_scale,
                      H: tl.constexpr, D: tl.constexpr, CLASS: tl.constexpr, TILE: tl.constexpr,
                      TILES: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr, DOT: tl.constexpr,
                      DOT_PREC: tl.constexpr, BF16_EMU: tl.constexpr):
    n_tiles, tab = tile_table(plan, CLASS)
    for g in range(tl.program_id(0), tl.cdiv(n_tiles, TILES), tl.num_programs(0)):
        # Step 1: whole rows of q, k, v, dO and the lse of TILES tiles, every head.
        row, valid, h, offs, q, k, v, same = tile_qkv(q_ptr, k_ptr, v_ptr, plan, tab, n_tiles, g, TILE, TILES, H,
                                                      HP, D, DP, CLASS)
        do = load_heads(do_ptr, offs, valid, D, DP)
        lse = tl.load(lse_ptr + row * H + h[:, None], mask=valid, other=0.0) * LOG2E_C
        # Step 2: P recomputed from the lse, zero outside the block diagonal.
        p = tl.where(same, tl.exp2(dot_d(q, k, DOT, DOT_PREC, BF16_EMU) * qk_scale - lse[:, :, None]), 0.0)
        # Step 3: dV = P^T dO; dS = P * (dP - delta) with dP = dO V^T and delta = rowsum(P * dP)
        # (whole segments in the tile: no O read).  Operands contracted across
        # segments are made finite so a zero weight never meets another segment's NaN.
        dv = dot_rows(tl.permute(p, (0, 2, 1)), finite_or_zero(do), DOT, DOT_PREC, BF16_EMU)
        pdp = tl.where(same, p * dot_d(do, v, DOT, DOT_PREC, BF16_EMU), 0.0)
        ds = tl.where(same, pdp - p * tl.sum(pdp, axis=2)[:, :, None], 0.0)  # a NaN delta stays in its segment
        # Step 4: dQ = scale dS K, dK = scale dS^T Q.
        dq = dot_rows(ds, finite_or_zero(k), DOT, DOT_PREC, BF16_EMU) * scale
        dk = dot_rows(tl.permute(ds, (0, 2, 1)), finite_or_zero(q), DOT, DOT_PREC, BF16_EMU) * scale
        # Step 5: a NaN/inf input row poisons the gradients of its own segment only.
        bad = segment_flag(bad_rows(q) | bad_rows(k) | bad_rows(v) | bad_rows(do), same)[:, :, None]
        store_heads(dq_ptr, offs, valid, tl.where(bad, float("nan"), dq), D, DP, BF16_EMU)
        store_heads(dk_ptr, offs, valid, tl.where(bad, float("nan"), dk), D, DP, BF16_EMU)
        store_heads(dv_ptr, offs, valid, tl.where(bad, float("nan"), dv), D, DP, BF16_EMU)
