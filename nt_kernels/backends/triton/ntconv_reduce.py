"""Gates, segment reductions and the receiver reduction of the fused NT layer on CUDA.

All of them read a chunk's fp32 pre-activations y = o · w_outᵀ + b_out
(R, C_out) (the message is GELU(y)) and view a row as H heads of D channels,
as (rows, BLOCK_H, BLOCK_D) tiles; for the gated aggregators head h of y is
[gate half (D) | value half (D)].  Every sum runs over rows in a fixed order
(blocks of BLOCK_E rows, each reduced by ``tl.sum``), and every output element
is written by one program: no atomics, bitwise reproducible.

* ``_gate_kernel``: gamma = mean of GELU(gate half) per (row, head), or
  sigmoid(gamma) for ``gated_sum``.
* ``_segment_softmax_kernel``: gamma -> softmax over the centre's segment
  (``gate_group="centre"``), in place;
* ``_segment_sum_kernel``: per-segment column sums (d_centre, and the
  centre-gate backward's sum of w·a); both take BLOCK_S segments a program.
* ``_receive_kernel``: a program takes BLOCK_G (chunk, receiver) groups of
  the plan (channels flat, c = head·D + dim): reduces each group's messages
  and merges the result into the running per-receiver state, so chunks merge
  in chunk order: a sum (``sum``,
  ``mean``, the gated ones, d_receiver_term), an online softmax (running max
  M, sum L and accumulator; ``weighted_mean`` over receivers) or a running
  max with its tie count (``max``, on messages rounded to the output type).
"""
from __future__ import annotations

import triton
import triton.language as tl

from nt_kernels.backends.triton.common import cast
from nt_kernels.backends.triton.ntconv_gemm import gelu

__all__ = ["AGG_GATED", "AGG_MAX", "AGG_SOFTMAX", "AGG_SUM", "gate_values", "receive", "segment_softmax",
           "segment_sum", "tile_shape"]

AGG_SUM, AGG_GATED, AGG_SOFTMAX, AGG_MAX = 0, 1, 2, 3
TILE_ELEMENTS = 4096  # rows x BLOCK_H x BLOCK_D per tile


def tile_shape(heads: int, dim: int, elements: int = TILE_ELEMENTS) -> tuple[int, int, int]:
    """(BLOCK_E rows, BLOCK_H, BLOCK_D) of a (rows, heads, dims) tile of about ``elements`` values."""
    bh, bd = triton.next_power_of_2(heads), triton.next_power_of_2(dim)
    return max(1, min(32, elements // (bh * bd))), bh, bd


def _one_config():
    # One config, so the autotuner never reruns these kernels (some update their outputs in place).
    return [triton.Config({}, num_warps=4)]


@triton.autotune(configs=_one_config(), key=["H", "D"])
@triton.jit
def _gate_kernel(y, gate, R, H, D, C_OUT, SIGMOID: tl.constexpr, BLOCK_E: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (r < R)[:, None, None] & (h < H)[None, :, None] & (d < D)[None, None, :]
    offs = r[:, None, None].to(tl.int64) * C_OUT + (h * 2 * D)[None, :, None] + d[None, None, :]
    gamma = tl.sum(gelu(tl.load(y + offs, mask=mask, other=0.0)), axis=2) / D
    if SIGMOID:
        gamma = tl.sigmoid(gamma)
    tl.store(gate + r[:, None].to(tl.int64) * H + h[None, :], gamma, mask=(r < R)[:, None] & (h < H)[None, :])


@triton.jit
def _finite_or_zero(m):
    """A running max usable as an exp offset: -inf (nothing seen yet) becomes 0, so that
    exp(x - m) is exp(-inf) = 0 for x = -inf instead of exp(NaN)."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def _segment_block(rowptr, num_segments, BLOCK_S: tl.constexpr):
    """First rows and sizes of this program's BLOCK_S segments (size 0 past the end)."""
    s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    valid = s < num_segments
    first = tl.load(rowptr + s, mask=valid, other=0)
    return s, valid, first, tl.load(rowptr + s + 1, mask=valid, other=0) - first


@triton.autotune(configs=_one_config(), key=["H"])
@triton.jit
def _segment_softmax_kernel(gate, rowptr, num_segments, H, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr,
                            BLOCK_H: tl.constexpr):
    # BLOCK_S segments per program.  Pass 1: online max and sum of exp over each segment's rows;
    # pass 2: normalise in place.
    s, valid, first, size = _segment_block(rowptr, num_segments, BLOCK_S)
    h = tl.arange(0, BLOCK_H)
    longest = tl.max(size, axis=0)
    m = tl.full([BLOCK_S, BLOCK_H], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_S, BLOCK_H], tl.float32)
    for e0 in range(0, longest, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        mask = (e[None, :] < size[:, None])[:, :, None] & (h < H)[None, None, :]
        offs = (first[:, None] + e[None, :])[:, :, None] * H + h[None, None, :]
        g = tl.load(gate + offs, mask=mask, other=float("-inf"))
        m_new = _finite_or_zero(tl.maximum(m, tl.max(g, axis=1)))
        total = total * tl.exp(m - m_new) + tl.sum(tl.exp(g - m_new[:, None, :]), axis=1)
        m = m_new
    for e0 in range(0, longest, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        mask = (e[None, :] < size[:, None])[:, :, None] & (h < H)[None, None, :]
        offs = (first[:, None] + e[None, :])[:, :, None] * H + h[None, None, :]
        g = tl.load(gate + offs, mask=mask, other=0.0)
        tl.store(gate + offs, tl.exp(g - m[:, None, :]) / tl.where(mask, total[:, None, :], 1.0), mask=mask)


@triton.autotune(configs=_one_config(), key=["W"])
@triton.jit
def _segment_sum_kernel(x, rowptr, out, num_segments, W, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr,
                        BLOCK_W: tl.constexpr):
    # out[s, w] = sum over the rows of segment s of x[row, w], in row order (BLOCK_S segments per program).
    s, valid, first, size = _segment_block(rowptr, num_segments, BLOCK_S)
    w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    total = tl.zeros([BLOCK_S, BLOCK_W], tl.float32)
    for e0 in range(0, tl.max(size, axis=0), BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        mask = (e[None, :] < size[:, None])[:, :, None] & (w < W)[None, None, :]
        offs = (first[:, None] + e[None, :])[:, :, None] * W + w[None, None, :]
        total += tl.sum(tl.load(x + offs, mask=mask, other=0.0), axis=1)
    tl.store(out + s[:, None].to(tl.int64) * W + w[None, :], total, mask=valid[:, None] & (w < W)[None, :])


@triton.jit
def _merge_softmax(acc, run_max, run_sum, node, head, first_d, mask, total, m_i, l_i):
    """Merge groups' online-softmax state (per channel; equal across a head's channels) into the
    receivers' running state; the per-head max and sum are stored from each head's first channel."""
    old_m = tl.load(run_max + head, mask=mask, other=float("-inf"))
    old_l = tl.load(run_sum + head, mask=mask, other=0.0)
    old_acc = tl.load(acc + node, mask=mask, other=0.0)
    new_m = _finite_or_zero(tl.maximum(old_m, m_i))
    a_old = tl.exp(old_m - new_m)
    a_new = tl.exp(m_i - new_m)
    tl.store(run_max + head, new_m, mask=mask & first_d)
    tl.store(run_sum + head, old_l * a_old + l_i * a_new, mask=mask & first_d)
    tl.store(acc + node, old_acc * a_old + total * a_new, mask=mask)


@triton.jit
def _merge_max(acc, count, node, mask, peak, ties, has_nan):
    """Merge groups' max, tie count and NaN flag into the receivers' running max and count."""
    old = tl.load(acc + node, mask=mask, other=float("-inf"))
    old_ties = tl.load(count + node, mask=mask, other=0.0)
    ties = tl.where(peak > old, ties, tl.where(peak == old, old_ties + ties, old_ties))
    nan = (has_nan > 0) | (old != old)
    tl.store(acc + node, tl.where(nan, float("nan"), tl.maximum(old, peak)), mask=mask)
    tl.store(count + node, ties, mask=mask)


@triton.autotune(configs=_one_config(), key=["H", "D", "MODE", "APPLY_GELU"])
@triton.jit
def _receive_kernel(x, gate, groups, rrow, acc, run_max, run_sum, count, out_type, group0, num_groups, H, D,
                    ROW, HEAD_STRIDE, VALUE_OFF, MODE: tl.constexpr, APPLY_GELU: tl.constexpr,
                    BLOCK_G: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr,
                    BF16_EMU: tl.constexpr):
    # Step 1: BLOCK_G groups (one receiver each) and their rows rrow[first:end] in this chunk;
    # channel c is (head c // D, dim c % D), read at column head * HEAD_STRIDE + VALUE_OFF + dim.
    gi = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
    g = (group0 + gi).to(tl.int64)
    g_valid = gi < num_groups
    recv = tl.load(groups + 3 * g, mask=g_valid, other=0).to(tl.int64)
    first = tl.load(groups + 3 * g + 1, mask=g_valid, other=0)
    length = tl.load(groups + 3 * g + 2, mask=g_valid, other=0) - first
    c = tl.arange(0, BLOCK_C)
    head = c // D
    c_valid = c < H * D
    col = head * HEAD_STRIDE + VALUE_OFF + (c - head * D)
    total = tl.zeros([BLOCK_G, BLOCK_C], tl.float32)
    m_i = tl.full([BLOCK_G, BLOCK_C], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G, BLOCK_C], tl.float32)
    ties = tl.zeros([BLOCK_G, BLOCK_C], tl.float32)
    has_nan = tl.zeros([BLOCK_G, BLOCK_C], tl.int32)
    # Step 2: reduce the groups' rows, BLOCK_E per group at a time, in row order.
    for e0 in range(0, tl.max(length, axis=0), BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        e_valid = e[None, :] < length[:, None]
        rows = tl.load(rrow + first[:, None] + e[None, :], mask=e_valid, other=0).to(tl.int64)
        mask = e_valid[:, :, None] & c_valid[None, None, :]
        v = tl.load(x + rows[:, :, None] * ROW + col[None, None, :], mask=mask, other=0.0).to(tl.float32)
        if APPLY_GELU:
            v = gelu(v)
        if MODE == 0:  # AGG_SUM
            total += tl.sum(v, axis=1)
        elif MODE == 1:  # AGG_GATED: weights precomputed per (row, head)
            w = tl.load(gate + rows[:, :, None] * H + head[None, None, :], mask=mask, other=0.0)
            total += tl.sum(w * v, axis=1)
        elif MODE == 2:  # AGG_SOFTMAX: online softmax of gamma per head
            gam = tl.load(gate + rows[:, :, None] * H + head[None, None, :], mask=mask, other=float("-inf"))
            m_new = _finite_or_zero(tl.maximum(m_i, tl.max(gam, axis=1)))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(gam - m_new[:, None, :])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            total = total * alpha + tl.sum(p * v, axis=1)
            m_i = m_new
        else:  # AGG_MAX on messages rounded to the output type; NaN tracked apart (m_i: the peak)
            v = cast(v, out_type.dtype.element_ty, BF16_EMU).to(tl.float32)
            has_nan |= tl.max((mask & (v != v)).to(tl.int32), axis=1)
            v = tl.where(mask & (v == v), v, float("-inf"))
            block_peak = tl.max(v, axis=1)
            block_ties = tl.sum(tl.where(mask & (v == block_peak[:, None, :]), 1.0, 0.0), axis=1)
            ties = tl.where(block_peak > m_i, block_ties, tl.where(block_peak == m_i, ties + block_ties, ties))
            m_i = tl.maximum(m_i, block_peak)
    # Step 3: merge into the receivers' running state (each receiver in one group per chunk).
    mask = g_valid[:, None] & c_valid[None, :]
    node = recv[:, None] * (H * D) + c[None, :]
    if MODE == 2:
        per_head = recv[:, None] * H + head[None, :]
        _merge_softmax(acc, run_max, run_sum, node, per_head, (c - head * D == 0)[None, :], mask, total, m_i, l_i)
    elif MODE == 3:
        _merge_max(acc, count, node, mask, m_i, ties, has_nan)
    else:
        tl.store(acc + node, tl.load(acc + node, mask=mask, other=0.0) + total, mask=mask)


def gate_values(gate, y, rows, heads, dim, sigmoid):
    """gate (rows, H) = mean of GELU(gate half) of y (rows, 2C), or its sigmoid."""
    if rows == 0:
        return
    be, bh, bd = tile_shape(heads, dim)
    _gate_kernel[(triton.cdiv(rows, be),)](y, gate, rows, heads, dim, 2 * heads * dim, SIGMOID=sigmoid,
                                           BLOCK_E=be, BLOCK_H=bh, BLOCK_D=bd)


SEGMENTS_PER_PROGRAM = 16


def segment_softmax(gate, rowptr, num_segments, heads):
    """In place: gate (rows, H) -> its softmax over each segment of the chunk-local ``rowptr``."""
    if num_segments:
        bh = triton.next_power_of_2(heads)
        bs = SEGMENTS_PER_PROGRAM
        _segment_softmax_kernel[(triton.cdiv(num_segments, bs),)](gate, rowptr, num_segments, heads, BLOCK_S=bs,
                                                                 BLOCK_E=max(1, min(16, 256 // bh)), BLOCK_H=bh)


def segment_sum(out, x, rowptr, num_segments, width):
    """out (segments, width) = per-segment column sums of x (rows, width), fp32."""
    if num_segments:
        bw = min(triton.next_power_of_2(width), 256)
        bs = SEGMENTS_PER_PROGRAM
        _segment_sum_kernel[(triton.cdiv(num_segments, bs), triton.cdiv(width, bw))](
            x, rowptr, out, num_segments, width, BLOCK_S=bs, BLOCK_E=max(1, min(8, TILE_ELEMENTS // (bs * bw))),
            BLOCK_W=bw)


def receive(state, x, chunk, groups, *, heads, dim, row, head_stride, value_off, mode, apply_gelu,
            gate=None, bf16_emu=False):
    """Merge the chunk's rows of x into the running per-receiver ``state`` (ntconv_op.ReceiverState)."""
    if chunk.num_groups == 0:
        return
    bc = triton.next_power_of_2(heads * dim)
    be = 4 if bc <= 256 else 2
    bg = max(1, min(16, TILE_ELEMENTS // (be * bc)))
    _receive_kernel[(triton.cdiv(chunk.num_groups, bg),)](
        x, x if gate is None else gate, groups, chunk.rrow, state.acc, state.run_max, state.run_sum,
        state.count, state.out_type, chunk.group0, chunk.num_groups, heads, dim, row, head_stride, value_off,
        MODE=mode, APPLY_GELU=apply_gelu, BLOCK_G=bg, BLOCK_E=be, BLOCK_C=bc, BF16_EMU=bf16_emu)
