"""The output projection y = o · w_outᵀ + b_out per (rows, heads, dims) tile, for the sm_90 paths.

Shared by the forward's ``_project_kernel`` and the backward's message gradient from o
(ntconv_grad._message_grad_split_kernel), so that both compute y with the same tiles and the same
tensor-core products: a tile's padded (head, dim) positions are the columns of one product per half
(gated aggregators: the gate half and the value half of each head), K = all of o's channels.

``_project_kernel`` (the forward, where ntconv_grad.split_width applies): program s walks the chunk's
split-K row block s (as the message gradient) in BLOCK_E-row tiles with w_out's blocks loaded once;
per tile it computes y, rounded to the parameters' dtype, and stores what the receiver reduction reads
(plain modes: all of y; gated modes: the value halves only, since the gate of a head comes from the
same tile: gamma = mean_d GELU(gate half), or its sigmoid for ``gated_sum``, stored per (row, head)).
So the gated forward writes neither the gate halves of y nor reads them back in a gate kernel.
"""
from __future__ import annotations

import triton
import triton.language as tl

from nt_kernels.backends.triton.common import cast, mm
from nt_kernels.backends.triton.ntconv_gemm import gelu
from nt_kernels.backends.triton.ntconv_tiles import split_k_rows

__all__ = ["column_rows", "project", "project_forward", "w_block", "w_blocks"]


@triton.jit
def column_rows(H: tl.constexpr, D: tl.constexpr, GATED: tl.constexpr, BLOCK_H: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """(valid, rows) of a tile's BLOCK_H·BLOCK_D padded (head, dim) positions: whether the position is a
    real channel, and its column of y (the gate half's for gated modes)."""
    p = tl.arange(0, BLOCK_H * BLOCK_D)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    rows = tl.reshape((h * (2 * D if GATED else D))[:, None] + d[None, :], (BLOCK_H * BLOCK_D,))
    return (p // BLOCK_D < H) & (p % BLOCK_D < D), rows


@triton.jit
def w_block(w_out, rows, c, c_valid, p_valid, C: tl.constexpr):
    """w_out[rows]ᵀ as a (channels, padded (head, dim)) block, 0 at padding; loaded once per program."""
    return tl.load(w_out + rows[None, :] * C + c[:, None], mask=c_valid[:, None] & p_valid[None, :], other=0.0)


@triton.jit
def w_blocks(w_out, b_out, C: tl.constexpr, D: tl.constexpr, GATED: tl.constexpr, BLOCK_H: tl.constexpr,
             BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr):
    """(channels c, their mask, valid positions, w_out's first-half block and bias, its value-half block and
    bias) of a tile, loaded once per program; without GATED the value half is the first (unused)."""
    H: tl.constexpr = C // D
    p_valid, rows = column_rows(H, D, GATED, BLOCK_H, BLOCK_D)
    c = tl.arange(0, BLOCK_C)
    c_valid = c < C
    w_first = w_block(w_out, rows, c, c_valid, p_valid, C)
    b_first = tl.load(b_out + rows, mask=p_valid, other=0.0).to(tl.float32)
    w_value = w_first
    b_value = b_first
    if GATED:
        w_value = w_block(w_out, rows + D, c, c_valid, p_valid, C)
        b_value = tl.load(b_out + rows + D, mask=p_valid, other=0.0).to(tl.float32)
    return c, c_valid, p_valid, rows, w_first, b_first, w_value, b_value


@triton.jit
def project(o_tile, w, bias, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
            DOT_PREC: tl.constexpr, BF16_EMU: tl.constexpr):
    """y = o · w + bias for a (channels, columns) block w of w_outᵀ, as a (rows, heads, dims) fp32 tile rounded
    to the parameters' dtype (padded columns 0)."""
    y = cast(mm(o_tile, w, DOT_PREC, BF16_EMU) + bias[None, :], w.dtype, BF16_EMU).to(tl.float32)
    return tl.reshape(y, (BLOCK_E, BLOCK_H, BLOCK_D))


@triton.jit(do_not_specialize=["R"])
def _project_kernel(o, w_out, b_out, y, gate, R, H: tl.constexpr, D: tl.constexpr, GATED: tl.constexpr,
                    SIGMOID: tl.constexpr, SPLIT_ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, DOT_PREC: tl.constexpr,
                    BF16_EMU: tl.constexpr):
    # Step 1: the tile's columns and w_out's blocks for them (gate and value halves), loaded once.
    C: tl.constexpr = H * D
    C_OUT: tl.constexpr = 2 * C if GATED else C
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    c, c_valid, p_valid, rows, w_first, b_first, w_value, b_value = w_blocks(w_out, b_out, C, D, GATED, BLOCK_H,
                                                                             BLOCK_D, BLOCK_C)
    first = tl.program_id(0) * SPLIT_ROWS
    for r0 in range(first, tl.minimum(first + SPLIT_ROWS, R), BLOCK_E):
        # Step 2: o of the tile's rows; y of each half.
        r = (r0 + tl.arange(0, BLOCK_E)).to(tl.int64)
        valid = r < R
        o_tile = tl.load(o + r[:, None] * C + c[None, :], mask=valid[:, None] & c_valid[None, :], other=0.0)
        y_first = project(o_tile, w_first, b_first, BLOCK_E, BLOCK_H, BLOCK_D, DOT_PREC, BF16_EMU)
        mask = valid[:, None, None] & (h < H)[None, :, None] & (d < D)[None, None, :]
        # Step 3: what the reduction reads: y (plain), or the value halves and the gate per (row, head).
        if GATED:
            y_value = project(o_tile, w_value, b_value, BLOCK_E, BLOCK_H, BLOCK_D, DOT_PREC, BF16_EMU)
            col = (h * 2 * D + D)[None, :, None] + d[None, None, :]
            tl.store(y + r[:, None, None] * C_OUT + col, y_value.to(y.dtype.element_ty), mask=mask)
            gamma = tl.sum(tl.where(mask, gelu(y_first), 0.0), axis=2) / D
            if SIGMOID:
                gamma = tl.sigmoid(gamma)
            tl.store(gate + r[:, None] * H + h[None, :], gamma, mask=valid[:, None] & (h < H)[None, :])
        else:
            col = (h * D)[None, :, None] + d[None, None, :]
            tl.store(y + r[:, None, None] * C_OUT + col, y_first.to(y.dtype.element_ty), mask=mask)


def project_forward(y, gate, o, p, chunk, tiles, *, block_c: int, num_warps: int, sigmoid: bool) -> None:
    """y (rows, C_out) = o · w_outᵀ + b_out for ``chunk`` (ntconv_op.Problem ``p``) on the message gradient
    from o's tiles (``tiles``: ntconv_grad.GradTiles; ``block_c`` channels, ``num_warps``): all of y, or, with
    ``gate`` (rows, H) fp32 given (gated aggregators), the value halves and the gates (their sigmoid where
    ``sigmoid``)."""
    if chunk.rows == 0:
        return
    split = split_k_rows(chunk.rows)
    _project_kernel[(triton.cdiv(chunk.rows, split),)](
        o, p.w_out, p.b_out, y, y if gate is None else gate, chunk.rows, H=p.heads, D=p.head_dim,
        GATED=gate is not None, SIGMOID=sigmoid, SPLIT_ROWS=split, BLOCK_E=tiles.block_e, BLOCK_H=tiles.block_h,
        BLOCK_D=tiles.block_d, BLOCK_C=block_c, DOT_PREC=p.dot_prec, BF16_EMU=p.bf16_emu, num_warps=num_warps)
