"""Gates and the segmented reductions of the fused NT layer on CUDA.

The reductions read a chunk's per-row values x (R, W) and combine them per
*group* of rows: by receiver (the receiver reduction of the forward's
messages GELU(y), y = o · w_outᵀ + b_out, and of the backward's du for
d_receiver_term) or by centre segment (d_centre, the centre gates' softmax and
the centre-gate backward's sums).  The plan (ntconv_plan.py, "Segmented
reductions") lists each group as work *items* of at most P rows, sorted by
size class; channels are flat (c = head · D + dim; for the gated aggregators
head h of y is [gate half (D) | value half (D)] and the value half is read).

* ``_gate_kernel``: gamma = mean of GELU(gate half) per (row, head), or
  sigmoid(gamma) for ``gated_sum``.
* ``_reduce_kernel``: one launch for every item class of a list (no program
  for an empty class): a program takes BLOCK_G items of one class k (slots of
  2^k rows; the tallest class's programs first), gathers their rows whole
  (through ``rrow`` for receivers, directly for segments), reduces each item
  with ``tl.sum`` / ``tl.max`` over its slot (one step unless the slot is
  taller than the tile) and either merges the result into the destination's
  running state (an item that is a whole group: the only writer of that
  destination in this chunk) or stores it as a partial state in a scratch
  slot (a piece of a split group).  Opt-in, ``NT_KERNELS_NTCONV_REDUCE=pipe``
  (``PIPE``; issue 40): a persistent grid of PIPE_PER_SM programs per SM, each
  walking every class's blocks in turn; blocks of one item (slots at least a
  tile tall: tolokers' receivers) software-pipelined, the entries of the
  block two ahead and the next block's rows and running state loaded while
  this block's gathers are in flight.  One program per block waits on four
  dependent loads in turn (entries, rrow, rows, running state): at 2 CTAs
  per SM the H200 measured the forward receiver reduction at 14 % of DRAM
  (2026-11-28b).  Each item's values are reduced in the same order either
  way: bitwise the same state.
* ``_merge_kernel``: per split group, its pieces' partial states in slot
  order, BLOCK_P at a time (each block a fixed tree), merged into the running
  state (launched only for a list with split groups).

Arguments that vary between graphs, chunks or calls (row counts, offsets,
scratch planes) are not specialised (``do_not_specialize``), nor is the
alignment of the state pointers, which may be views (d_centre's rows from a
chunk's first segment): one compiled kernel per layer shape.
* ``_normalize_kernel``: the centre softmax's second pass, exp(gamma - M) / L
  per row from its segment's log-sum-exp state.

Modes (the running state): a sum (``sum``, ``mean``, the gated ones, the
backward's sums), an online softmax (running max M, sum L and accumulator;
``weighted_mean`` over receivers), a log-sum-exp (M and L only; the centre
softmax) or a running max with its tie key and count (``max``: the maximum of
the messages rounded to the output type; the key is the largest
pre-activation among the messages attaining it, and the messages with that
pre-activation tie: docs/design.md, "Max ties"; merged with ``_max_step``).
Every value is combined in an order fixed by the plan (items, then slots,
then chunks in chunk order): no atomics, bitwise reproducible.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nt_kernels.backends.triton.common import cast, num_programs
from nt_kernels.backends.triton.ntconv_gemm import gelu
from nt_kernels.backends.triton.ntconv_plan import (REDUCE_CLASSES, merge_tiles, normalize_tiles, reduce_launch,
                                                     reduce_tiles)

__all__ = ["AGG_GATED", "AGG_LSE", "AGG_MAX", "AGG_SOFTMAX", "AGG_SUM", "REDUCE_ENV", "State", "gate_values", "pipelined",
           "receive", "reduce", "segment_softmax", "segment_sum", "tile_shape"]

AGG_SUM, AGG_GATED, AGG_SOFTMAX, AGG_MAX, AGG_LSE = range(5)
# Planes of a piece's partial state in scratch: 0 the sum (max: the peak), 1 the softmax max (max: the tie
# key), 2 the softmax sum (max: the tie count), 3 the max's NaN flag.
PLANES = {AGG_SUM: 1, AGG_GATED: 1, AGG_SOFTMAX: 3, AGG_MAX: 4, AGG_LSE: 3}
TILE_ELEMENTS = 4096  # rows x BLOCK_H x BLOCK_D per tile of the gate kernel


def tile_shape(heads: int, dim: int, elements: int = TILE_ELEMENTS) -> tuple[int, int, int]:
    """(BLOCK_E rows, BLOCK_H, BLOCK_D) of a (rows, heads, dims) tile of about ``elements`` values."""
    bh, bd = triton.next_power_of_2(heads), triton.next_power_of_2(dim)
    return max(1, min(32, elements // (bh * bd))), bh, bd


@triton.jit(do_not_specialize=["R"])
def _gate_kernel(y, gate, R, H, D, C_OUT, SIGMOID: tl.constexpr, BLOCK_E: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (r < R)[:, None, None] & (h < H)[None, :, None] & (d < D)[None, None, :]
    offs = r[:, None, None].to(tl.int64) * C_OUT + (h * 2 * D)[None, :, None] + d[None, None, :]
    gamma = tl.sum(gelu(tl.load(y + offs, mask=mask, other=0.0).to(tl.float32)), axis=2) / D
    if SIGMOID:
        gamma = tl.sigmoid(gamma)
    tl.store(gate + r[:, None].to(tl.int64) * H + h[None, :], gamma, mask=(r < R)[:, None] & (h < H)[None, :])


@triton.jit
def _finite_or_zero(m):
    """A running max usable as an exp offset: -inf (nothing seen yet) becomes 0, so that
    exp(x - m) is exp(-inf) = 0 for x = -inf instead of exp(NaN)."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def _softmax_step(m_i, l_i, total, m_b, l_b, t_b, WITH_TOTAL: tl.constexpr):
    """Online softmax: the running (max, sum, accumulator) merged with a block's, both relative to
    their own max."""
    m_new = _finite_or_zero(tl.maximum(m_i, m_b))
    a_old = tl.exp(m_i - m_new)
    a_new = tl.exp(m_b - m_new)
    if WITH_TOTAL:
        total = total * a_old + t_b * a_new
    return m_new, l_i * a_old + l_b * a_new, total


@triton.jit
def _max_step(peak, key, ties, new_peak, new_key, new_ties):
    """Running (max, tie key, tie count) merged with another's: the larger max wins; at an equal
    max the larger key wins, and equal keys add their counts.  Order-independent."""
    above = new_peak > peak
    level = new_peak == peak
    take = above | (level & (new_key > key))
    ties = tl.where(take, new_ties, tl.where(level & (new_key == key), ties + new_ties, ties))
    return tl.maximum(peak, new_peak), tl.where(take, new_key, key), ties


@triton.jit
def _max_block(v, pre, mask, weight, AXIS: tl.constexpr):
    """(max, tie key, tie count) over ``AXIS`` of a block: v the candidates (NaN and masked lanes
    already -inf), pre their keys, weight the count each candidate stands for."""
    peak = tl.max(v, axis=AXIS)
    at_peak = mask & (v == tl.expand_dims(peak, AXIS))
    key = tl.max(tl.where(at_peak, pre, float("-inf")), axis=AXIS)
    ties = tl.sum(tl.where(at_peak & (pre == tl.expand_dims(key, AXIS)), weight, 0.0), axis=AXIS)
    return peak, key, ties


@triton.jit
def _load_state(acc, run_max, run_sum, count, node, mask, KEY_OFF, MODE: tl.constexpr):
    """A destination's running state in global memory before a merge: (acc, M, L), or (peak, tie key,
    tie count) for ``max``; the planes a mode does not keep are returned as placeholders."""
    if MODE == 3:
        old = tl.load(acc + node, mask=mask, other=float("-inf"))
        old_key = tl.load(count + KEY_OFF + node, mask=mask, other=float("-inf"))
        old_ties = tl.load(count + node, mask=mask, other=0.0)
        return old, old_key, old_ties
    elif MODE == 2 or MODE == 4:
        old_m = tl.load(run_max + node, mask=mask, other=float("-inf"))
        old_l = tl.load(run_sum + node, mask=mask, other=0.0)
        old_acc = tl.load(acc + node, mask=mask, other=0.0) if MODE == 2 else old_l
        return old_acc, old_m, old_l
    else:
        old = tl.load(acc + node, mask=mask, other=0.0)
        return old, old, old


@triton.jit
def _merge_state(acc, run_max, run_sum, count, node, mask, KEY_OFF, MODE: tl.constexpr, total, m_i, l_i, key, ties,
                 has_nan, old, old_m, old_l):
    """Merge a destination's reduced state into its running state ``(old, old_m, old_l)`` read by
    :func:`_load_state` and write it back (the caller is the only writer of ``node`` at this point,
    and each element is read and written by the same thread).  Softmax and log-sum-exp keep M and L
    per channel (equal across a head's channels), so channel blocks never share an element."""
    if MODE == 0 or MODE == 1:
        tl.store(acc + node, old + total, mask=mask)
    elif MODE == 2 or MODE == 4:
        new_m, new_l, new_acc = _softmax_step(old_m, old_l, old if MODE == 2 else total, m_i, l_i, total, MODE == 2)
        tl.store(run_max + node, new_m, mask=mask)
        tl.store(run_sum + node, new_l, mask=mask)
        if MODE == 2:
            tl.store(acc + node, new_acc, mask=mask)
    else:  # count[node]: the tie counts, count[KEY_OFF + node]: the tie keys
        new_peak, new_key, new_ties = _max_step(old, old_m, old_l, m_i, key, ties)
        nan = (has_nan > 0) | (old != old)
        tl.store(acc + node, tl.where(nan, float("nan"), new_peak), mask=mask)
        tl.store(count + KEY_OFF + node, new_key, mask=mask)
        tl.store(count + node, new_ties, mask=mask)


@triton.jit
def _store_part(part, slot, mask, PLANE, MODE: tl.constexpr, total, m_i, l_i, key, ties, has_nan):
    """A piece's partial state into its scratch slot (planes: see PLANES)."""
    if MODE == 3:
        tl.store(part + slot, m_i, mask=mask)
        tl.store(part + PLANE + slot, key, mask=mask)
        tl.store(part + 2 * PLANE + slot, ties, mask=mask)
        tl.store(part + 3 * PLANE + slot, has_nan.to(tl.float32), mask=mask)
    else:
        if MODE != 4:
            tl.store(part + slot, total, mask=mask)
        if MODE == 2 or MODE == 4:
            tl.store(part + PLANE + slot, m_i, mask=mask)
            tl.store(part + 2 * PLANE + slot, l_i, mask=mask)


@triton.jit
def _items(items, item0, item1, BLOCK_G: tl.constexpr):
    """(dest, first, length, valid) of the items item0 .. min(item0 + BLOCK_G, item1) of the list
    (dest, first, end) (none past item1: a block beyond its class loads nothing)."""
    gi = item0 + tl.arange(0, BLOCK_G)
    valid = gi < item1
    it = gi.to(tl.int64) * 3
    dest = tl.load(items + it, mask=valid, other=0)
    first = tl.load(items + it + 1, mask=valid, other=0)
    return dest, first, tl.load(items + it + 2, mask=valid, other=0) - first, valid


@triton.jit
def _item_rows(rrow, first, length, e0, GATHER: tl.constexpr, BLOCK_E: tl.constexpr):
    """Rows e0 .. e0 + BLOCK_E of each item (BLOCK_G, BLOCK_E): through ``rrow`` (receivers) or the
    positions themselves (segments), with their mask."""
    e = e0 + tl.arange(0, BLOCK_E)
    e_valid = e[None, :] < length[:, None]
    pos = first[:, None] + e[None, :]
    if GATHER:
        return tl.load(rrow + pos, mask=e_valid, other=0), e_valid
    return pos, e_valid


@triton.jit
def _channels(C, D, MODE: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's BLOCK_C channels c, their mask, head (c // D) and column of x: for the gated
    modes head * 2D + D + dim (the value half), else c."""
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    head = c // D
    col = head * 2 * D + D + (c - head * D) if (MODE == 1 or MODE == 2) else c
    return c, c < C, head, col


@triton.jit
def _gather(x, gate, rows, e_valid, c_valid, head, col, H, ROW, MODE: tl.constexpr):
    """The loads of one step of an item block: its rows (BLOCK_G, BLOCK_E) of x read whole and, for
    the gated and softmax modes, their gates; with the elements' mask."""
    rows = rows.to(tl.int64)
    mask = e_valid[:, :, None] & c_valid[None, None, :]
    pre = tl.load(x + rows[:, :, None] * ROW + col[None, None, :], mask=mask, other=0.0)
    if MODE == 1 or MODE == 2:
        w = tl.load(gate + rows[:, :, None] * H + head[None, None, :], mask=mask,
                    other=0.0 if MODE == 1 else float("-inf"))
    else:
        w = pre
    return pre, w, mask


@triton.jit
def _reduce_step(pre, w, mask, out_type, MODE: tl.constexpr, APPLY_GELU: tl.constexpr, BF16_EMU: tl.constexpr, total,
                 m_i, l_i, key, ties, has_nan):
    """One step of an item block: its gathered rows (:func:`_gather`) reduced over the rows and
    combined with the block's running state (total, m_i, l_i, key, ties, has_nan)."""
    pre = pre.to(tl.float32)
    v = gelu(pre) if APPLY_GELU else pre
    if MODE == 0:  # AGG_SUM
        total += tl.sum(v, axis=1)
    elif MODE == 1:  # AGG_GATED: weights precomputed per (row, head)
        total += tl.sum(w * v, axis=1)
    elif MODE == 2 or MODE == 4:  # AGG_SOFTMAX (of gamma per head) / AGG_LSE (of v itself)
        gam = w if MODE == 2 else tl.where(mask, v, float("-inf"))
        m_b = _finite_or_zero(tl.max(gam, axis=1))
        p = tl.exp(gam - m_b[:, None, :])
        m_i, l_i, total = _softmax_step(m_i, l_i, total, m_b, tl.sum(p, axis=1), tl.sum(p * v, axis=1), MODE == 2)
    else:  # AGG_MAX on messages rounded to the output type, ties on pre; NaN tracked apart
        v = cast(v, out_type.dtype.element_ty, BF16_EMU).to(tl.float32)
        has_nan |= tl.max((mask & (v != v)).to(tl.int32), axis=1)
        v = tl.where(mask & (v == v), v, float("-inf"))
        b_peak, b_key, b_ties = _max_block(v, pre, mask, 1.0, 1)
        m_i, key, ties = _max_step(m_i, key, ties, b_peak, b_key, b_ties)
    return total, m_i, l_i, key, ties, has_nan


@triton.jit
def _empty_block(BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr):
    """An item block's state before its rows: (total, m_i, l_i, key, ties, has_nan); m_i is the
    softmax's running max or the max's peak."""
    return (tl.zeros([BLOCK_G, BLOCK_C], tl.float32), tl.full([BLOCK_G, BLOCK_C], float("-inf"), tl.float32),
            tl.zeros([BLOCK_G, BLOCK_C], tl.float32), tl.full([BLOCK_G, BLOCK_C], float("-inf"), tl.float32),
            tl.zeros([BLOCK_G, BLOCK_C], tl.float32), tl.zeros([BLOCK_G, BLOCK_C], tl.int32))


@triton.jit
def _dest_nodes(dest, valid, c, c_valid, C):
    """A block's destination elements and the masks of its whole groups and of its pieces."""
    mask = valid[:, None] & c_valid[None, :]
    return dest[:, None].to(tl.int64) * C + c[None, :], mask & (dest[:, None] >= 0), mask & (dest[:, None] < 0)


@triton.jit
def _reduce_items(x, gate, items, rrow, acc, run_max, run_sum, count, part, out_type, item0, item1, C, H, D, ROW,
                  KEY_OFF, PLANE, MODE: tl.constexpr, APPLY_GELU: tl.constexpr, GATHER: tl.constexpr,
                  SLOT_ROWS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr,
                  BF16_EMU: tl.constexpr):
    # Step 1: the items item0 .. min(item0 + BLOCK_G, item1) (dest, first, end) of one size class (at
    # most SLOT_ROWS rows each) and BLOCK_C channels.
    dest, first, length, g_valid = _items(items, item0, item1, BLOCK_G)
    c, c_valid, head, col = _channels(C, D, MODE, BLOCK_C)
    total, m_i, l_i, key, ties, has_nan = _empty_block(BLOCK_G, BLOCK_C)
    # Step 2: the items' rows, BLOCK_E per item at a time in position order, each row read whole.
    for e0 in range(0, SLOT_ROWS, BLOCK_E):
        rows, e_valid = _item_rows(rrow, first, length, e0, GATHER, BLOCK_E)
        pre, w, mask = _gather(x, gate, rows, e_valid, c_valid, head, col, H, ROW, MODE)
        total, m_i, l_i, key, ties, has_nan = _reduce_step(pre, w, mask, out_type, MODE, APPLY_GELU, BF16_EMU, total,
                                                           m_i, l_i, key, ties, has_nan)
    # Step 3: a whole group merges into its destination's running state, a piece stores its partial state.
    node, whole, piece = _dest_nodes(dest, g_valid, c, c_valid, C)
    old, old_m, old_l = _load_state(acc, run_max, run_sum, count, node, whole, KEY_OFF, MODE)
    _merge_state(acc, run_max, run_sum, count, node, whole, KEY_OFF, MODE, total, m_i, l_i, key, ties, has_nan, old,
                 old_m, old_l)
    slot = (-1 - dest[:, None]).to(tl.int64) * C + c[None, :]
    _store_part(part, slot, piece, PLANE, MODE, total, m_i, l_i, key, ties, has_nan)


@triton.jit
def _pipe_items(x, gate, items, rrow, acc, run_max, run_sum, count, part, out_type, lo, hi, programs, pid, nprog, C,
                H, D, ROW, KEY_OFF, PLANE, MODE: tl.constexpr, APPLY_GELU: tl.constexpr, GATHER: tl.constexpr,
                SLOT_ROWS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr,
                BF16_EMU: tl.constexpr):
    # The blocks pid, pid + nprog, ... of one size class (items lo .. hi, BLOCK_G per block), software-
    # pipelined: while a block's gathers of x are in flight, the item entries of the block two ahead
    # and the next block's first rows (through rrow) and running state are loaded, so that a block
    # waits for its gathers only.  Each block is reduced and merged as _reduce_items does: the same
    # values.  For blocks of one item (BLOCK_G = 1): the entries and rows of many-item blocks carried
    # from one step to the next took about 70 more registers (1 CTA of 8 warps per SM).  The softmax
    # and max modes read their three-plane running state after the block (EARLY_STATE): loaded ahead
    # it spilled on sm_89.
    EARLY_STATE: tl.constexpr = MODE != 2 and MODE != 3
    c, c_valid, head, col = _channels(C, D, MODE, BLOCK_C)
    dest, first, length, valid = _items(items, lo + pid * BLOCK_G, hi, BLOCK_G)
    n_dest, n_first, n_length, n_valid = _items(items, lo + (pid + nprog) * BLOCK_G, hi, BLOCK_G)
    rows, e_valid = _item_rows(rrow, first, length, 0, GATHER, BLOCK_E)
    node, whole, piece = _dest_nodes(dest, valid, c, c_valid, C)
    old, old_m, old_l = _load_state(acc, run_max, run_sum, count, node, whole, KEY_OFF, MODE)
    for local in range(pid, programs, nprog):
        # Step 1: this block's gathers go out, then the entries two blocks ahead and the next block's
        # rows and running state.
        pre, w, mask = _gather(x, gate, rows, e_valid, c_valid, head, col, H, ROW, MODE)
        nn_dest, nn_first, nn_length, nn_valid = _items(items, lo + (local + 2 * nprog) * BLOCK_G, hi, BLOCK_G)
        rows, e_valid = _item_rows(rrow, n_first, n_length, 0, GATHER, BLOCK_E)
        n_node, n_whole, n_piece = _dest_nodes(n_dest, n_valid, c, c_valid, C)
        if EARLY_STATE:
            n_old, n_old_m, n_old_l = _load_state(acc, run_max, run_sum, count, n_node, n_whole, KEY_OFF, MODE)
        # Step 2: this block's first step, then any further steps in position order.
        total, m_i, l_i, key, ties, has_nan = _reduce_step(pre, w, mask, out_type, MODE, APPLY_GELU, BF16_EMU,
                                                           *_empty_block(BLOCK_G, BLOCK_C))
        for e0 in range(BLOCK_E, SLOT_ROWS, BLOCK_E):
            more, more_valid = _item_rows(rrow, first, length, e0, GATHER, BLOCK_E)
            pre, w, mask = _gather(x, gate, more, more_valid, c_valid, head, col, H, ROW, MODE)
            total, m_i, l_i, key, ties, has_nan = _reduce_step(pre, w, mask, out_type, MODE, APPLY_GELU, BF16_EMU,
                                                               total, m_i, l_i, key, ties, has_nan)
        # Step 3: whole groups merge into their running state, pieces store their partial state.
        if not EARLY_STATE:
            old, old_m, old_l = _load_state(acc, run_max, run_sum, count, node, whole, KEY_OFF, MODE)
        _merge_state(acc, run_max, run_sum, count, node, whole, KEY_OFF, MODE, total, m_i, l_i, key, ties, has_nan,
                     old, old_m, old_l)
        _store_part(part, (-1 - dest[:, None]).to(tl.int64) * C + c[None, :], piece, PLANE, MODE, total, m_i, l_i,
                    key, ties, has_nan)
        # Step 4: the pipeline moves one block on.
        dest, first, length, node, whole, piece = n_dest, n_first, n_length, n_node, n_whole, n_piece
        if EARLY_STATE:
            old, old_m, old_l = n_old, n_old_m, n_old_l
        n_dest, n_first, n_length, n_valid = nn_dest, nn_first, nn_length, nn_valid


@triton.jit
def _reduce_class(x, gate, items, bounds, rrow, acc, run_max, run_sum, count, part, out_type, local, nprog, C, H, D,
                  ROW, KEY_OFF, PLANE, K: tl.constexpr, MODE: tl.constexpr, APPLY_GELU: tl.constexpr,
                  GATHER: tl.constexpr, ROWS: tl.constexpr, STATE_ITEMS: tl.constexpr, BLOCK_C: tl.constexpr,
                  BF16_EMU: tl.constexpr, PIPE: tl.constexpr):
    """Class K's share of the launch: its blocks of BLOCK_G items (ceil(items / BLOCK_G)) are returned.
    One block per program: program ``local`` of them, if it is one, reduces its block.  PIPE: program
    ``local`` of ``nprog`` reduces blocks local, local + nprog, ..., pipelined where a block is one item
    (_pipe_items).  Tiles as
    ``ntconv_plan.reduce_tiles``: slots of 2^K rows read BLOCK_E = min(2^K, ROWS) rows per step,
    BLOCK_G = min(ROWS / BLOCK_E, STATE_ITEMS) items per block."""
    SLOT: tl.constexpr = 1 << K
    BLOCK_E: tl.constexpr = SLOT if SLOT < ROWS else ROWS
    FIT: tl.constexpr = ROWS // BLOCK_E
    CAP: tl.constexpr = FIT if FIT < STATE_ITEMS else STATE_ITEMS
    BLOCK_G: tl.constexpr = CAP if CAP > 1 else 1
    lo = tl.load(bounds + K).to(tl.int32)
    hi = tl.load(bounds + K + 1).to(tl.int32)
    programs = (hi - lo + BLOCK_G - 1) // BLOCK_G
    if PIPE and BLOCK_G == 1:
        _pipe_items(x, gate, items, rrow, acc, run_max, run_sum, count, part, out_type, lo, hi, programs, local, nprog,
                    C, H, D, ROW, KEY_OFF, PLANE, MODE, APPLY_GELU, GATHER, SLOT, BLOCK_G, BLOCK_E, BLOCK_C, BF16_EMU)
    elif PIPE:
        for block in range(local, programs, nprog):
            _reduce_items(x, gate, items, rrow, acc, run_max, run_sum, count, part, out_type, lo + block * BLOCK_G, hi,
                          C, H, D, ROW, KEY_OFF, PLANE, MODE, APPLY_GELU, GATHER, SLOT, BLOCK_G, BLOCK_E, BLOCK_C,
                          BF16_EMU)
    elif (local >= 0) & (local < programs):
        _reduce_items(x, gate, items, rrow, acc, run_max, run_sum, count, part, out_type, lo + local * BLOCK_G, hi,
                      C, H, D, ROW, KEY_OFF, PLANE, MODE, APPLY_GELU, GATHER, SLOT, BLOCK_G, BLOCK_E, BLOCK_C,
                      BF16_EMU)
    return programs


@triton.jit(do_not_specialize=["KEY_OFF", "PLANE"],
            do_not_specialize_on_alignment=["acc", "run_max", "run_sum", "count", "part", "out_type"])
def _reduce_kernel(x, gate, items, bounds, rrow, acc, run_max, run_sum, count, part, out_type, C, H, D, ROW,
                   KEY_OFF, PLANE, MODE: tl.constexpr, APPLY_GELU: tl.constexpr, GATHER: tl.constexpr,
                   CLASSES: tl.constexpr, ROWS: tl.constexpr, STATE_ITEMS: tl.constexpr, BLOCK_C: tl.constexpr,
                   BF16_EMU: tl.constexpr, PIPE: tl.constexpr):
    # Step 0: one launch for every size class, the tallest class first, each class's items
    # (bounds[k]:bounds[k+1]) in blocks of its BLOCK_G (_reduce_class).  One block per program (the
    # longest programs start first; an empty class has no programs), or PIPE: a persistent grid whose
    # programs walk every class's blocks in turn, pipelined (_pipe_items).
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    first = 0
    for i in tl.static_range(CLASSES):
        first += _reduce_class(x, gate, items, bounds, rrow, acc, run_max, run_sum, count, part, out_type,
                               pid if PIPE else pid - first, nprog, C, H, D, ROW, KEY_OFF, PLANE, CLASSES - 1 - i,
                               MODE, APPLY_GELU, GATHER, ROWS, STATE_ITEMS, BLOCK_C, BF16_EMU, PIPE)


@triton.jit(do_not_specialize=["split0", "KEY_OFF", "PLANE"],
            do_not_specialize_on_alignment=["part", "acc", "run_max", "run_sum", "count"])
def _merge_kernel(splits, part, acc, run_max, run_sum, count, split0, C, KEY_OFF, PLANE, MODE: tl.constexpr,
                  BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    # Step 1: one split group (dest, slot0, slot1) and BLOCK_C channels.
    g = (split0 + tl.program_id(0)).to(tl.int64) * 3
    dest = tl.load(splits + g).to(tl.int64)
    slot0 = tl.load(splits + g + 1)
    slot1 = tl.load(splits + g + 2)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_valid = c < C
    total = tl.zeros([BLOCK_C], tl.float32)
    m_i = tl.full([BLOCK_C], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_C], tl.float32)
    key = tl.full([BLOCK_C], float("-inf"), tl.float32)
    ties = tl.zeros([BLOCK_C], tl.float32)
    has_nan = tl.zeros([BLOCK_C], tl.int32)
    # Step 2: the pieces' partial states, BLOCK_P slots at a time in slot order.
    for p0 in range(slot0, slot1, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        mask = (p < slot1)[:, None] & c_valid[None, :]
        offs = p[:, None].to(tl.int64) * C + c[None, :]
        if MODE == 0 or MODE == 1:
            total += tl.sum(tl.load(part + offs, mask=mask, other=0.0), axis=0)
        elif MODE == 2 or MODE == 4:
            m_p = tl.load(part + PLANE + offs, mask=mask, other=float("-inf"))
            m_b = _finite_or_zero(tl.max(m_p, axis=0))
            scale = tl.exp(m_p - m_b[None, :])
            l_b = tl.sum(tl.load(part + 2 * PLANE + offs, mask=mask, other=0.0) * scale, axis=0)
            t_b = tl.sum(tl.load(part + offs, mask=mask, other=0.0) * scale, axis=0) if MODE == 2 else total
            m_i, l_i, total = _softmax_step(m_i, l_i, total, m_b, l_b, t_b, MODE == 2)
        else:
            peak_p = tl.load(part + offs, mask=mask, other=float("-inf"))
            key_p = tl.load(part + PLANE + offs, mask=mask, other=float("-inf"))
            ties_p = tl.load(part + 2 * PLANE + offs, mask=mask, other=0.0)
            has_nan |= (tl.max(tl.load(part + 3 * PLANE + offs, mask=mask, other=0.0), axis=0) > 0).to(tl.int32)
            b_peak, b_key, b_ties = _max_block(peak_p, key_p, mask, ties_p, 0)
            m_i, key, ties = _max_step(m_i, key, ties, b_peak, b_key, b_ties)
    # Step 3: merge into the destination's running state.
    old, old_m, old_l = _load_state(acc, run_max, run_sum, count, dest * C + c, c_valid, KEY_OFF, MODE)
    _merge_state(acc, run_max, run_sum, count, dest * C + c, c_valid, KEY_OFF, MODE, total, m_i, l_i, key, ties,
                 has_nan, old, old_m, old_l)


@triton.jit(do_not_specialize=["seg0", "R"])
def _normalize_kernel(gate, seg_of_row, run_max, run_sum, seg0, R, H, BLOCK_R: tl.constexpr,
                      BLOCK_H: tl.constexpr):
    # gate[r, h] = exp(gate[r, h] - M[s, h]) / L[s, h] for the segment s of row r, in place.
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    h = tl.arange(0, BLOCK_H)
    mask = (r < R)[:, None] & (h < H)[None, :]
    s = tl.load(seg_of_row + r, mask=r < R, other=seg0) - seg0
    offs = r[:, None].to(tl.int64) * H + h[None, :]
    state = s[:, None] * H + h[None, :]
    g = tl.load(gate + offs, mask=mask, other=0.0)
    m = tl.load(run_max + state, mask=mask, other=0.0)
    total = tl.load(run_sum + state, mask=mask, other=1.0)
    tl.store(gate + offs, tl.exp(g - m) / total, mask=mask)


@dataclass
class State:
    """Running per-destination state of a reduction (fp32): the accumulator (rows, C), the softmax
    max / sum (rows, C: per channel, equal across a head's channels) and the max's tie counts and
    keys (2, rows, C), each where the mode needs it (the accumulator stands in for the others), and
    a tensor of the output type (``max``)."""

    acc: torch.Tensor
    run_max: torch.Tensor = None
    run_sum: torch.Tensor = None
    count: torch.Tensor = None
    out_type: torch.Tensor = None

    def __post_init__(self):
        for name in ("run_max", "run_sum", "count", "out_type"):
            if getattr(self, name) is None:
                setattr(self, name, self.acc)

    @classmethod
    def empty(cls, rows: int, channels: int, mode: int, out_type: torch.Tensor):
        """The state before any row: acc 0 (-inf for ``max``), M -inf, L 0, counts 0, keys -inf."""
        dev = out_type.device
        fill = float("-inf") if mode == AGG_MAX else 0.0
        acc = torch.full((rows, channels), fill, dtype=torch.float32, device=dev)
        state = cls(acc, out_type=out_type)
        if mode in (AGG_SOFTMAX, AGG_LSE):
            state.run_max = torch.full((rows, channels), float("-inf"), device=dev)
            state.run_sum = torch.zeros((rows, channels), device=dev)
        if mode == AGG_MAX:
            state.count = torch.stack([torch.zeros((rows, channels), device=dev),
                                       torch.full((rows, channels), float("-inf"), device=dev)])
        return state


REDUCE_ENV = "NT_KERNELS_NTCONV_REDUCE"
PIPE_PER_SM = 2  # programs per SM of the pipelined reduction: its CTAs of 8 warps resident on sm_90
# Widest channel block reduced pipelined: at 128 channels its softmax and max modes spilled (sm_90, 128
# registers), at 256 every mode took 157-178 registers; wider rows keep one block per program.  Nor is the
# softmax mode (weighted_mean over receivers) pipelined: with Triton 3.6 (the GPU machines') it spilled 480
# bytes at C = 64 on sm_90.
PIPE_MAX_CHANNELS = 64


def pipelined() -> bool:
    """Whether the segmented reductions run pipelined on a persistent grid: ``NT_KERNELS_NTCONV_REDUCE``
    ``grid`` (one block of items per program, the default) or ``pipe`` (opt-in: slower on the H200 of
    2026-11-28c, 1 CTA per SM; reductions of at most PIPE_MAX_CHANNELS channels, all modes but the
    softmax); read at each call."""
    design = os.environ.get(REDUCE_ENV, "grid")
    if design not in ("grid", "pipe"):
        raise ValueError(f"{REDUCE_ENV}={design!r}: choose grid or pipe")
    return design == "pipe"


def pipe_programs(device: torch.device) -> int:
    """Programs of the pipelined reduction's persistent grid: PIPE_PER_SM per SM (4 under the
    interpreter)."""
    return num_programs(device, PIPE_PER_SM)


def reduce(state: State, x: torch.Tensor, red, *, channels: int, heads: int, row: int, mode: int,
           rrow: torch.Tensor | None = None, gate: torch.Tensor | None = None, apply_gelu: bool = False,
           bf16_emu: bool = False) -> None:
    """Merge the reduction list ``red`` (ntconv_plan.Reduction) of the rows of x (row stride ``row``)
    into ``state``: rows through ``rrow`` (receivers) or x's own rows (segments).  One launch for
    every item class (none for an empty list), and one more when the list has split groups."""
    programs = red.programs(channels)
    if not programs:
        return
    dim = channels // heads
    key_off = state.count[0].numel() if mode == AGG_MAX else 0
    plane = red.slots * channels
    # Only the max mode reads the output type; the others get an fp32 tensor, so that one compiled
    # kernel serves every dtype.
    out_type = state.out_type if mode == AGG_MAX else state.acc
    part = (torch.empty((PLANES[mode], red.slots, channels), dtype=torch.float32, device=x.device)
            if red.slots else state.acc)
    block_c, rows, state_items = reduce_launch(channels)
    t = reduce_tiles(channels, 1)
    pipe = pipelined() and block_c <= PIPE_MAX_CHANNELS and mode != AGG_SOFTMAX
    if pipe:
        programs = min(programs, pipe_programs(x.device))
    _reduce_kernel[(programs, triton.cdiv(channels, block_c))](
        x, x if gate is None else gate, red.items, red.device_bounds, red.items if rrow is None else rrow, state.acc,
        state.run_max, state.run_sum, state.count, part, out_type, channels, heads, dim, row, key_off, plane,
        MODE=mode, APPLY_GELU=apply_gelu, GATHER=rrow is not None, CLASSES=REDUCE_CLASSES, ROWS=rows,
        STATE_ITEMS=state_items, BLOCK_C=block_c, BF16_EMU=bf16_emu and mode == AGG_MAX, PIPE=pipe,
        num_warps=t.num_warps, num_stages=t.num_stages)
    if red.num_split:
        block_p, block_c = merge_tiles(channels)
        _merge_kernel[(red.num_split, triton.cdiv(channels, block_c))](
            red.splits, part, state.acc, state.run_max, state.run_sum, state.count, red.split0, channels, key_off,
            plane, MODE=mode, BLOCK_P=block_p, BLOCK_C=block_c, num_warps=4, num_stages=1)


def gate_values(gate, y, rows, heads, dim, sigmoid):
    """gate (rows, H) = mean of GELU(gate half) of y (rows, 2C), or its sigmoid."""
    if rows == 0:
        return
    be, bh, bd = tile_shape(heads, dim)
    _gate_kernel[(triton.cdiv(rows, be),)](y, gate, rows, heads, dim, 2 * heads * dim, SIGMOID=sigmoid,
                                           BLOCK_E=be, BLOCK_H=bh, BLOCK_D=bd, num_warps=4, num_stages=1)


def receive(state: State, x, chunk, *, channels, heads, row, mode, apply_gelu, gate=None, bf16_emu=False):
    """Merge the chunk's rows of x into the running per-receiver ``state``, in receiver order."""
    reduce(state, x, chunk.receivers, channels=channels, heads=heads, row=row, mode=mode, rrow=chunk.rrow,
           gate=gate, apply_gelu=apply_gelu, bf16_emu=bf16_emu)


def segment_sum(out, x, chunk, width):
    """out (segments, width) += per-segment column sums of the chunk's rows of x (rows, width), fp32;
    out's row s is the chunk's segment s."""
    reduce(State(out), x, chunk.segments, channels=width, heads=width, row=width, mode=AGG_SUM)


def segment_softmax(gate, chunk, seg_of_row, heads):
    """In place: gate (rows, H) -> its softmax over each of the chunk's segments."""
    num_seg = chunk.seg1 - chunk.seg0
    if chunk.rows == 0 or num_seg == 0:
        return
    state = State.empty(num_seg, heads, AGG_LSE, gate)
    reduce(state, gate, chunk.segments, channels=heads, heads=heads, row=heads, mode=AGG_LSE)
    block_r, block_h = normalize_tiles(heads)
    _normalize_kernel[(triton.cdiv(chunk.rows, block_r),)](
        gate, seg_of_row, state.run_max, state.run_sum, chunk.seg0, chunk.rows, heads, BLOCK_R=block_r,
        BLOCK_H=block_h, num_warps=4, num_stages=1)
