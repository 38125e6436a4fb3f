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

``_message_grad_split_kernel`` is the same gradient without a stored y or dy,
for the modes whose dy needs only the row's own values (SPLIT_MODES, where
``split_width`` allows): program s walks the chunk's split-K row block s
(ntconv_tiles.split_k_rows) in BLOCK_E-row tiles, recomputes each half of
y = o · w_outᵀ + b_out from the o tile (w_out's blocks loaded once per
program), gets dy by the rules above in registers, stores do = dy · w_out and
adds dyᵀ · o and Σ dy into fp32 registers, written once as the block's
partials of dW_out and db_out and summed in block order by
ntconv_wgrad.combine (no atomics; bitwise the same run to run).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nt_kernels.backends.triton.common import cast, mm
from nt_kernels.backends.triton.ntconv_gemm import gelu, gelu_grad
from nt_kernels.backends.triton.ntconv_project import project, w_blocks
from nt_kernels.backends.triton.ntconv_tiles import split_k_rows
from nt_kernels.backends.triton.ntconv_wgrad import combine, split_products, store_partial

__all__ = ["FUSED_DO_WIDTH", "GRAD_CENTRE_A", "GRAD_CENTRE_B", "GRAD_GATED_SUM", "GRAD_MAX", "GRAD_MEAN",
           "GRAD_SOFTMAX", "GRAD_SUM", "GradTiles", "grad_tiles", "message_grad", "message_grad_split",
           "split_width"]

GRAD_SUM, GRAD_MEAN, GRAD_MAX, GRAD_GATED_SUM, GRAD_SOFTMAX, GRAD_CENTRE_A, GRAD_CENTRE_B = range(7)
# rows x heads x dims per tile: the gated modes keep eight such tiles live (ptxas, sm_90: 4,096 spill, 1,024 not)
GRAD_TILE_ELEMENTS = 1024
# do = dy · w_out is fused into the kernel while a row's padded heads (BLOCK_H x BLOCK_D) fit this many
# columns (tolokers: 2 x 32); wider layers store dy and run the row GEMM for do.
FUSED_DO_WIDTH = 128
DO_BLOCK_N = 64  # do columns per product of the fused do (the w_out block: FUSED_DO_WIDTH x DO_BLOCK_N)
# fp32 elements of the split kernel's dW_out accumulators (tolokers, gated: 2 x 64 x 64); wider layers take
# the stored-y path.
SPLIT_ACCUMULATOR = 8192
# The modes whose dy needs nothing of y but the row's own values (no tie keys, no segment pass): the split
# kernel recomputes y from o for them.
SPLIT_MODES = (GRAD_SUM, GRAD_MEAN, GRAD_GATED_SUM, GRAD_SOFTMAX)
SPLIT_MIN_ARCH = 90  # the split kernel's compute capability floor (split_width)
# Warps of the split kernel (ptxas, sm_90, tolokers: 73-114 registers at 16 warps, 101-152 at 8, up to 227 at 4,
# none spilling; for the gated modes one program fits an SM either way, so 16 warps keep twice as many resident)
SPLIT_WARPS = 16


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
def _plain_grad(yv, g_out, stats, keys, recv_rowptr, k, valid, h, d, H: tl.constexpr, D: tl.constexpr,
                MODE: tl.constexpr):
    """sum / mean / max: dy = dm · GELU'(y) on C = H·D channels, from the fp32 (rows, heads, dims) y tile."""
    mask = valid[:, None, None] & (h < H)[None, :, None] & (d < D)[None, None, :]
    node = k[:, None, None] * (H * D) + (h * D)[None, :, None] + d[None, None, :]
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
def _gated_grad(y_gate, y_value, g_out, out, stats, gate, seg_sum, seg_of_row, wa, r, k, valid, h, d, seg0,
                H: tl.constexpr, D: tl.constexpr, MODE: tl.constexpr):
    """Gated modes: (d gate half, d value half) as (rows, heads, dims) fp32 from the fp32 (rows, heads,
    dims) halves of y; GRAD_CENTRE_A stores w·a."""
    mask = valid[:, None, None] & (h < H)[None, :, None] & (d < D)[None, None, :]
    hmask = valid[:, None] & (h < H)[None, :]
    node = k[:, None, None] * (H * D) + (h * D)[None, :, None] + d[None, None, :]
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
        gate_rows = (h * 2 * D)[None, :, None] + d[None, None, :]
        y_gate = tl.load(y + r[:, None, None] * C_OUT + gate_rows, mask=mask, other=0.0).to(tl.float32)
        y_value = tl.load(y + r[:, None, None] * C_OUT + gate_rows + D, mask=mask, other=0.0).to(tl.float32)
        dy_gate, dy_value = _gated_grad(y_gate, y_value, g_out, out, stats, gate, seg_sum, seg_of_row, wa, r, k,
                                        valid, h, d, seg0, H, D, MODE)
        if MODE != 5:
            offs = r[:, None, None] * C_OUT + gate_rows
            tl.store(dy + offs, cast(dy_gate, dy.dtype.element_ty, BF16_EMU), mask=mask)
            tl.store(dy + offs + D, cast(dy_value, dy.dtype.element_ty, BF16_EMU), mask=mask)
    else:
        plain_rows = (h * D)[None, :, None] + d[None, None, :]
        yv = tl.load(y + r[:, None, None] * C_OUT + plain_rows, mask=mask, other=0.0).to(tl.float32)
        dy_plain = _plain_grad(yv, g_out, stats, keys, recv_rowptr, k, valid, h, d, H, D, MODE)
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


@triton.jit
def _dy_products(acc, bias, do_acc, dy, w, o_tile, valid, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr, BF16_EMU: tl.constexpr):
    """For a (rows, heads, dims) dy tile rounded to the parameters' dtype (what the stored dy was; rows
    past the chunk 0): do += dy · wᵀ, acc += dyᵀ · o (dW_out rows) and bias += Σ_rows dy (db_out)."""
    x = cast(tl.reshape(dy, (BLOCK_E, BLOCK_H * BLOCK_D)), w.dtype, BF16_EMU)
    x = tl.where(valid[:, None], x, 0.0).to(w.dtype)
    acc, bias, do_acc = split_products(acc, bias, do_acc, x, tl.trans(w), o_tile, DOT_PREC, BF16_EMU)
    return acc, bias, do_acc


@triton.jit(do_not_specialize=["row0", "R"])
def _message_grad_split_kernel(o, g_out, out, stats, recv_rowptr, receiver, w_out, b_out, do, partials, row0, R,
                               H: tl.constexpr, D: tl.constexpr, MODE: tl.constexpr, SPLIT_ROWS: tl.constexpr,
                               BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                               BLOCK_C: tl.constexpr, DOT_PREC: tl.constexpr, BF16_EMU: tl.constexpr):
    # Step 1: the y columns of the tile's (head, dim) positions (the gate half's for gated modes), o's
    # channels, and the blocks of w_out and b_out they use, loaded once.
    C: tl.constexpr = H * D
    GATED: tl.constexpr = MODE >= 3
    C_OUT: tl.constexpr = 2 * C if GATED else C
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    c, c_valid, p_valid, rows, w_first, b_first, w_value, b_value = w_blocks(w_out, b_out, C, D, GATED, BLOCK_H,
                                                                             BLOCK_D, BLOCK_C)
    acc = tl.zeros([BLOCK_H * BLOCK_D, BLOCK_C], tl.float32)
    acc_value = tl.zeros([BLOCK_H * BLOCK_D, BLOCK_C], tl.float32)
    bias = tl.zeros([BLOCK_H * BLOCK_D], tl.float32)
    bias_value = tl.zeros([BLOCK_H * BLOCK_D], tl.float32)
    first = tl.program_id(0) * SPLIT_ROWS
    for r0 in range(first, tl.minimum(first + SPLIT_ROWS, R), BLOCK_E):
        # Step 2: the tile's rows, receivers and o; y = o · w_outᵀ + b_out recomputed (never stored).
        r = (r0 + tl.arange(0, BLOCK_E)).to(tl.int64)
        valid = r < R
        k = tl.load(receiver + row0 + r, mask=valid, other=0)
        o_tile = tl.load(o + r[:, None] * C + c[None, :], mask=valid[:, None] & c_valid[None, :], other=0.0)
        y_first = project(o_tile, w_first, b_first, BLOCK_E, BLOCK_H, BLOCK_D, DOT_PREC, BF16_EMU)
        # Step 3: dy in registers; do = dy · w_out stored, dW_out and db_out summed in the split's registers.
        do_acc = tl.zeros([BLOCK_E, BLOCK_C], tl.float32)
        if GATED:
            y_value = project(o_tile, w_value, b_value, BLOCK_E, BLOCK_H, BLOCK_D, DOT_PREC, BF16_EMU)
            dy_gate, dy_value = _gated_grad(y_first, y_value, g_out, out, stats, stats, stats, receiver, stats, r, k,
                                            valid, h, d, 0, H, D, MODE)
            acc, bias, do_acc = _dy_products(acc, bias, do_acc, dy_gate, w_first, o_tile, valid, BLOCK_E, BLOCK_H,
                                             BLOCK_D, DOT_PREC, BF16_EMU)
            acc_value, bias_value, do_acc = _dy_products(acc_value, bias_value, do_acc, dy_value, w_value, o_tile,
                                                         valid, BLOCK_E, BLOCK_H, BLOCK_D, DOT_PREC, BF16_EMU)
        else:
            dy = _plain_grad(y_first, g_out, stats, stats, recv_rowptr, k, valid, h, d, H, D, MODE)
            acc, bias, do_acc = _dy_products(acc, bias, do_acc, dy, w_first, o_tile, valid, BLOCK_E, BLOCK_H,
                                             BLOCK_D, DOT_PREC, BF16_EMU)
        tl.store(do + r[:, None] * C + c[None, :], cast(do_acc, do.dtype.element_ty, BF16_EMU),
                 mask=valid[:, None] & c_valid[None, :])
    # Step 4: the split's partial sums, written once (combined in split order by ntconv_wgrad._combine_kernel).
    base = partials + tl.program_id(0).to(tl.int64) * (C_OUT * (C + 1))
    store_partial(base, acc, bias, rows, p_valid, c, c_valid, C)
    if GATED:
        store_partial(base, acc_value, bias_value, rows + D, p_valid, c, c_valid, C)


def split_width(heads: int, dim: int, mode: int, operand_bytes: int, arch: int) -> int:
    """Padded channels (BLOCK_C) of ``_message_grad_split_kernel`` for this layer, gradient mode, parameter
    size in bytes and compute capability, or 0 where it does not apply: a mode of SPLIT_MODES, do fused
    (grad_tiles), dW_out's accumulators within SPLIT_ACCUMULATOR, 16-bit parameters and sm_90 or newer
    (ptxas: up to 154 registers and no spills at 8 warps there; on sm_80 and sm_89, and with fp32 operands,
    the gated modes spill at 4, 8 and 16 warps)."""
    t = grad_tiles(heads, dim)
    block_c = max(16, triton.next_power_of_2(heads * dim))
    halves = 2 if mode >= GRAD_GATED_SUM else 1
    fits = t.fuse_do and halves * t.block_h * t.block_d * block_c <= SPLIT_ACCUMULATOR
    return block_c if mode in SPLIT_MODES and fits and operand_bytes == 2 and arch >= SPLIT_MIN_ARCH else 0


def message_grad_split(do, o, mode, p, chunk, state, w_acc, b_acc) -> None:
    """do = dy · w_out and w_acc += dyᵀ o, b_acc += Σ dy for ``chunk`` from o alone: y recomputed per
    tile, dy never stored; split-K partials over fixed row blocks (ntconv_tiles.split_k_rows) combined
    in split order (ntconv_wgrad.combine).  The caller picks this path where ``split_width(...)`` is
    nonzero for its dtype and device; any layer and mode it accepts runs (the tests run fp32 through it)."""
    block_c = split_width(p.heads, p.head_dim, mode, 2, SPLIT_MIN_ARCH)
    if not block_c:
        raise ValueError(f"message_grad_split: mode {mode} with {p.heads} heads of {p.head_dim} takes the "
                         "stored-y path")
    if chunk.rows == 0:
        return
    t = grad_tiles(p.heads, p.head_dim)
    split = split_k_rows(chunk.rows)
    partials = torch.empty((-(-chunk.rows // split), p.out_channels, p.channels + 1), dtype=torch.float32,
                           device=o.device)
    _message_grad_split_kernel[(partials.shape[0],)](
        o, state.grad_out, state.out, state.stats, p.recv_rowptr, p.receiver, p.w_out, p.b_out, do, partials,
        chunk.row0, chunk.rows, H=p.heads, D=p.head_dim, MODE=mode, SPLIT_ROWS=split, BLOCK_E=t.block_e,
        BLOCK_H=t.block_h, BLOCK_D=t.block_d, BLOCK_C=block_c, DOT_PREC=p.dot_prec, BF16_EMU=p.bf16_emu,
        num_warps=SPLIT_WARPS)
    combine(partials, w_acc, b_acc)
