"""Message gradient of the fused NT layer's backward on CUDA (docs/design.md §9, "Backward").

``_message_grad_kernel`` turns the output gradient g = grad_out[receiver] and
the saved state (out, stats) into dy = dL/dy for a chunk's recomputed
pre-activations y (the message is m = GELU(y)), segment-locally:

* ``sum``: dm = g;  ``mean``: g / in-degree;  ``max``: g · [m = out] / count,
  with m rounded to the output type as in the forward;
* gated (per head, a = g · value): ``gated_sum`` w = sigmoid(gamma),
  dgamma = w (1 - w) a;  ``weighted_mean`` over receivers
  w = exp(gamma - stats[k]), dgamma = w (a - g · out[k]);  over centres
  (two passes) w from the segment softmax, pass 1 stores w·a per row, the
  segment sums S of it come from a segment reduction (ntconv_reduce.py), pass 2
  uses dgamma = w (a - S);  then d value = g w and d gate = dgamma / D;
* and finally dy = dm · GELU'(y), stored in the parameters' dtype (what the
  w_out gradient's tensor-core product reads);
* fused (``FUSE_DO``, while a row's padded heads fit FUSED_DO_WIDTH columns):
  do = dy · w_out from the dy tile in registers (the padded (head, dim) columns
  as the product's K, w_out's rows gathered to match), so dy is written once and
  read once (by the w_out gradient), not read again by a row GEMM.

y is read in the parameters' dtype, g = grad_out[receiver] gathered per row.
"""
from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from nt_kernels.backends.triton.common import cast, mm
from nt_kernels.backends.triton.ntconv_gemm import gelu, gelu_grad

__all__ = ["FUSED_DO_WIDTH", "GRAD_CENTRE_A", "GRAD_CENTRE_B", "GRAD_GATED_SUM", "GRAD_MAX", "GRAD_MEAN",
           "GRAD_SOFTMAX", "GRAD_SUM", "GradTiles", "grad_tiles", "message_grad"]

GRAD_SUM, GRAD_MEAN, GRAD_MAX, GRAD_GATED_SUM, GRAD_SOFTMAX, GRAD_CENTRE_A, GRAD_CENTRE_B = range(7)
# rows x heads x dims per tile: the gated modes keep eight such tiles live (ptxas, sm_90: 4,096 spill, 1,024 not)
GRAD_TILE_ELEMENTS = 1024
# do = dy · w_out is fused into the kernel while a row's padded heads (BLOCK_H x BLOCK_D) fit this many
# columns (tolokers: 2 x 32); wider layers store dy and run the row GEMM for do.
FUSED_DO_WIDTH = 128
DO_BLOCK_N = 64  # do columns per product of the fused do (the w_out block: FUSED_DO_WIDTH x DO_BLOCK_N)


@dataclass(frozen=True)
class GradTiles:
    """Launch shape of ``_message_grad_kernel``: BLOCK_E rows x BLOCK_H heads x BLOCK_D dims per
    program (BLOCK_H x BLOCK_D >= 16, the tensor cores' smallest K), whether do is fused, warps."""

    block_e: int
    block_h: int
    block_d: int
    fuse_do: bool
    num_warps: int


def grad_tiles(heads: int, dim: int) -> GradTiles:
    """Tiles of the message gradient: about GRAD_TILE_ELEMENTS values per (rows x heads x dims) tile;
    with do fused at least 16 rows (a tensor-core product's M) and 8 warps (ptxas, sm_90: the gated modes
    at 4 warps take up to 207 registers or spill), 8 warps as well where 16 rows double the tile."""
    bh = triton.next_power_of_2(heads)
    bd = max(triton.next_power_of_2(dim), -(-16 // bh))
    width = bh * bd
    fuse = width <= FUSED_DO_WIDTH
    be = min(32, max(16 if fuse else 1, GRAD_TILE_ELEMENTS // width))
    return GradTiles(be, bh, bd, fuse, 8 if fuse or be * width > GRAD_TILE_ELEMENTS else 4)


@triton.jit
def _plain_grad(y, g_out, stats, keys, recv_rowptr, r, k, valid, h, d, H: tl.constexpr, D: tl.constexpr,
                MODE: tl.constexpr):
    """sum / mean / max: dy = dm · GELU'(y) on C = H·D channels, (rows, heads, dims) fp32."""
    mask = valid[:, None, None] & (h < H)[None, :, None] & (d < D)[None, None, :]
    col = (h * D)[None, :, None] + d[None, None, :]
    offs = r[:, None, None] * (H * D) + col
    node = k[:, None, None] * (H * D) + col
    yv = tl.load(y + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_out + node, mask=mask, other=0.0).to(tl.float32)
    if MODE == 1:  # GRAD_MEAN
        deg = tl.load(recv_rowptr + k + 1, mask=valid, other=1) - tl.load(recv_rowptr + k, mask=valid, other=0)
        g = g / tl.maximum(deg, 1).to(tl.float32)[:, None, None]
    if MODE == 2:  # GRAD_MAX: the messages whose pre-activation equals the tie key share g evenly
        key = tl.load(keys + node, mask=mask, other=0.0)
        ties = tl.load(stats + node, mask=mask, other=1.0)
        g = tl.where(yv == key, g / ties, 0.0)
    return g * gelu_grad(yv)


@triton.jit
def _gated_grad(y, g_out, out, stats, gate, seg_sum, seg_of_row, wa, r, k, valid, h, d, seg0, H: tl.constexpr,
                D: tl.constexpr, MODE: tl.constexpr):
    """Gated modes: (d gate half, d value half) as (rows, heads, dims) fp32; GRAD_CENTRE_A stores w·a."""
    mask = valid[:, None, None] & (h < H)[None, :, None] & (d < D)[None, None, :]
    hmask = valid[:, None] & (h < H)[None, :]
    gate_offs = r[:, None, None] * (2 * H * D) + (h * 2 * D)[None, :, None] + d[None, None, :]
    node = k[:, None, None] * (H * D) + (h * D)[None, :, None] + d[None, None, :]
    y_gate = tl.load(y + gate_offs, mask=mask, other=0.0).to(tl.float32)
    y_value = tl.load(y + gate_offs + D, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_out + node, mask=mask, other=0.0).to(tl.float32)
    gamma = tl.sum(gelu(y_gate), axis=2) / D
    a = tl.sum(g * gelu(y_value), axis=2)
    # The gate weight w and dgamma per (row, head).
    if MODE == 5:  # GRAD_CENTRE_A: only w·a, for the segment sums of pass B
        w = tl.load(gate + r[:, None] * H + h[None, :], mask=hmask, other=0.0)
        tl.store(wa + r[:, None] * H + h[None, :], w * a, mask=hmask)
        d_gamma = tl.zeros_like(w)
    elif MODE == 3:  # GRAD_GATED_SUM
        w = tl.sigmoid(gamma)
        d_gamma = w * (1.0 - w) * a
    elif MODE == 4:  # GRAD_SOFTMAX over the receiver's messages
        w = tl.exp(gamma - tl.load(stats + k[:, None] * H + h[None, :], mask=hmask, other=0.0))
        b = tl.sum(g * tl.load(out + node, mask=mask, other=0.0).to(tl.float32), axis=2)
        d_gamma = w * (a - b)
    else:  # GRAD_CENTRE_B: softmax over the centre's segment, S = sum of w·a over it
        w = tl.load(gate + r[:, None] * H + h[None, :], mask=hmask, other=0.0)
        s = tl.load(seg_of_row + r, mask=valid, other=seg0) - seg0
        d_gamma = w * (a - tl.load(seg_sum + s[:, None] * H + h[None, :], mask=hmask, other=0.0))
    # d value = g w, d gate = dgamma / D, then through GELU'.
    return (d_gamma / D)[:, :, None] * gelu_grad(y_gate), g * w[:, :, None] * gelu_grad(y_value)


@triton.jit
def _back_project(acc, dy, w_out, rows, n, n_valid, C: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_D: tl.constexpr, D: tl.constexpr, H: tl.constexpr, DOT_PREC: tl.constexpr,
                  BF16_EMU: tl.constexpr):
    """acc += dy · w_out[rows] for a (rows, heads, dims) dy tile: its padded columns (h, d) multiply w_out
    row ``rows[h, d]`` (0 where h >= H or d >= D), columns n."""
    p = tl.arange(0, BLOCK_H * BLOCK_D)
    ph = p // BLOCK_D
    pd = p % BLOCK_D
    p_valid = (ph < H) & (pd < D)
    w_row = tl.reshape(rows, (BLOCK_H * BLOCK_D,))
    w = tl.load(w_out + w_row[:, None] * C + n[None, :], mask=p_valid[:, None] & n_valid[None, :], other=0.0)
    x = cast(tl.reshape(dy, (BLOCK_E, BLOCK_H * BLOCK_D)), w.dtype, BF16_EMU)
    return acc + mm(x, w, DOT_PREC, BF16_EMU)


@triton.jit(do_not_specialize=["row0", "seg0", "R"], do_not_specialize_on_alignment=["keys"])
def _message_grad_kernel(y, g_out, out, stats, keys, recv_rowptr, gate, seg_sum, seg_of_row, receiver, w_out, dy,
                         do, wa, row0, seg0, R, H: tl.constexpr, D: tl.constexpr, MODE: tl.constexpr,
                         FUSE_DO: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
                         BF16_EMU: tl.constexpr):
    # Step 1: the tile's rows and their receivers.
    r = (tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)).to(tl.int64)
    valid = r < R
    k = tl.load(receiver + row0 + r, mask=valid, other=0)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = valid[:, None, None] & (h < H)[None, :, None] & (d < D)[None, None, :]
    GATED: tl.constexpr = MODE >= 3
    C_OUT: tl.constexpr = 2 * H * D if GATED else H * D
    # Step 2: dy of the tile's rows, stored in dy's type (the parameters').
    if GATED:
        dy_gate, dy_value = _gated_grad(y, g_out, out, stats, gate, seg_sum, seg_of_row, wa, r, k, valid, h, d,
                                        seg0, H, D, MODE)
        gate_rows = (h * 2 * D)[None, :, None] + d[None, None, :]
        if MODE != 5:
            offs = r[:, None, None] * C_OUT + gate_rows
            tl.store(dy + offs, cast(dy_gate, dy.dtype.element_ty, BF16_EMU), mask=mask)
            tl.store(dy + offs + D, cast(dy_value, dy.dtype.element_ty, BF16_EMU), mask=mask)
    else:
        dy_plain = _plain_grad(y, g_out, stats, keys, recv_rowptr, r, k, valid, h, d, H, D, MODE)
        plain_rows = (h * D)[None, :, None] + d[None, None, :]
        tl.store(dy + r[:, None, None] * C_OUT + plain_rows, cast(dy_plain, dy.dtype.element_ty, BF16_EMU),
                 mask=mask)
    # Step 3 (FUSE_DO): do = dy · w_out, BLOCK_N columns at a time, so dy is never read back for it.
    if FUSE_DO and MODE != 5:
        for n0 in range(0, H * D, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_valid = n < H * D
            acc = tl.zeros([BLOCK_E, BLOCK_N], tl.float32)
            if GATED:
                acc = _back_project(acc, dy_gate, w_out, gate_rows, n,
                                    n_valid, H * D, BLOCK_E, BLOCK_H, BLOCK_D, D, H, DOT_PREC, BF16_EMU)
                acc = _back_project(acc, dy_value, w_out, gate_rows + D, n,
                                    n_valid, H * D, BLOCK_E, BLOCK_H, BLOCK_D, D, H, DOT_PREC, BF16_EMU)
            else:
                acc = _back_project(acc, dy_plain, w_out, plain_rows, n,
                                    n_valid, H * D, BLOCK_E, BLOCK_H, BLOCK_D, D, H, DOT_PREC, BF16_EMU)
            tl.store(do + r[:, None] * (H * D) + n[None, :], cast(acc, do.dtype.element_ty, BF16_EMU),
                     mask=valid[:, None] & n_valid[None, :])


def message_grad(dy, y, mode, p, chunk, state, seg_of_row, *, do=None, gate=None, seg_sum=None, wa=None):
    """Launch the message gradient for ``chunk`` (ntconv_op.Problem ``p``, saved ``state``): dy, and
    do = dy · w_out where ``do`` is given (then ``grad_tiles(...).fuse_do`` must hold)."""
    if chunk.rows == 0:
        return
    t = grad_tiles(p.heads, p.head_dim)
    fuse = do is not None
    if fuse and not t.fuse_do:
        raise ValueError(f"message_grad: do is fused only up to {FUSED_DO_WIDTH} padded columns per row")
    _message_grad_kernel[(triton.cdiv(chunk.rows, t.block_e),)](
        y, state.grad_out, state.out, state.stats, state.stats[1] if mode == GRAD_MAX else state.stats,
        p.recv_rowptr, y if gate is None else gate, y if seg_sum is None else seg_sum, seg_of_row, p.receiver,
        p.w_out, dy, do if fuse else dy, y if wa is None else wa, chunk.row0, chunk.seg0, chunk.rows, H=p.heads,
        D=p.head_dim, MODE=mode, FUSE_DO=fuse, BLOCK_E=t.block_e, BLOCK_H=t.block_h, BLOCK_D=t.block_d,
        BLOCK_N=DO_BLOCK_N, DOT_PREC=p.dot_prec, BF16_EMU=p.bf16_emu, num_warps=t.num_warps)
