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
  segment sums S of it come from ``_segment_sum_kernel``, pass 2 uses
  dgamma = w (a - S);  then d value = g w and d gate = dgamma / D;
* and finally dy = dm · GELU'(y).
"""
from __future__ import annotations

import triton
import triton.language as tl

from nt_kernels.backends.triton.ntconv_gemm import gelu, gelu_grad
from nt_kernels.backends.triton.ntconv_reduce import tile_shape

__all__ = ["GRAD_CENTRE_A", "GRAD_CENTRE_B", "GRAD_GATED_SUM", "GRAD_MAX", "GRAD_MEAN", "GRAD_SOFTMAX",
           "GRAD_SUM", "message_grad"]

GRAD_SUM, GRAD_MEAN, GRAD_MAX, GRAD_GATED_SUM, GRAD_SOFTMAX, GRAD_CENTRE_A, GRAD_CENTRE_B = range(7)
# rows x heads x dims per tile: the gated modes keep eight such tiles live (ptxas, sm_90: 4,096 spill, 1,024 not)
GRAD_TILE_ELEMENTS = 1024


@triton.jit
def _plain_grad(y, g_out, stats, keys, recv_rowptr, dy, r, k, valid, h, d, H, D, MODE: tl.constexpr):
    """sum / mean / max: dy = dm · GELU'(y) on C = H·D channels."""
    mask = valid[:, None, None] & (h < H)[None, :, None] & (d < D)[None, None, :]
    col = (h * D)[None, :, None] + d[None, None, :]
    offs = r[:, None, None] * (H * D) + col
    node = k[:, None, None] * (H * D) + col
    yv = tl.load(y + offs, mask=mask, other=0.0)
    g = tl.load(g_out + node, mask=mask, other=0.0).to(tl.float32)
    if MODE == 1:  # GRAD_MEAN
        deg = tl.load(recv_rowptr + k + 1, mask=valid, other=1) - tl.load(recv_rowptr + k, mask=valid, other=0)
        g = g / tl.maximum(deg, 1).to(tl.float32)[:, None, None]
    if MODE == 2:  # GRAD_MAX: the messages whose pre-activation equals the tie key share g evenly
        key = tl.load(keys + node, mask=mask, other=0.0)
        ties = tl.load(stats + node, mask=mask, other=1.0)
        g = tl.where(yv == key, g / ties, 0.0)
    tl.store(dy + offs, g * gelu_grad(yv), mask=mask)


@triton.autotune(configs=[triton.Config({}, num_warps=4)], key=["H", "D", "MODE"])
@triton.jit(do_not_specialize=["row0", "seg0", "R"], do_not_specialize_on_alignment=["keys"])
def _message_grad_kernel(y, g_out, out, stats, keys, recv_rowptr, gate, seg_sum, seg_of_row, receiver, dy, wa,
                         row0, seg0, R, H, D, MODE: tl.constexpr, BLOCK_E: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    # Step 1: the tile's rows and their receivers.
    r = (tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)).to(tl.int64)
    valid = r < R
    k = tl.load(receiver + row0 + r, mask=valid, other=0)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    if MODE <= 2:
        _plain_grad(y, g_out, stats, keys, recv_rowptr, dy, r, k, valid, h, d, H, D, MODE)
    else:
        # Step 2 (gated): gate and value halves of every head, a = g · value.
        mask = valid[:, None, None] & (h < H)[None, :, None] & (d < D)[None, None, :]
        hmask = valid[:, None] & (h < H)[None, :]
        gate_offs = r[:, None, None] * (2 * H * D) + (h * 2 * D)[None, :, None] + d[None, None, :]
        node = k[:, None, None] * (H * D) + (h * D)[None, :, None] + d[None, None, :]
        y_gate = tl.load(y + gate_offs, mask=mask, other=0.0)
        y_value = tl.load(y + gate_offs + D, mask=mask, other=0.0)
        g = tl.load(g_out + node, mask=mask, other=0.0).to(tl.float32)
        gamma = tl.sum(gelu(y_gate), axis=2) / D
        a = tl.sum(g * gelu(y_value), axis=2)
        # Step 3: the gate weight w and dgamma per (row, head).
        if MODE == 5:  # GRAD_CENTRE_A: only w·a, for the segment sums of pass B
            w = tl.load(gate + r[:, None] * H + h[None, :], mask=hmask, other=0.0)
            tl.store(wa + r[:, None] * H + h[None, :], w * a, mask=hmask)
        else:
            if MODE == 3:  # GRAD_GATED_SUM
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
            # Step 4: d value = g w, d gate = dgamma / D, then through GELU'.
            tl.store(dy + gate_offs, (d_gamma / D)[:, :, None] * gelu_grad(y_gate), mask=mask)
            tl.store(dy + gate_offs + D, g * w[:, :, None] * gelu_grad(y_value), mask=mask)


def message_grad(dy, y, mode, p, chunk, state, seg_of_row, *, gate=None, seg_sum=None, wa=None):
    """Launch the message gradient for ``chunk`` (ntconv_op.Problem ``p``, saved ``state``)."""
    if chunk.rows == 0:
        return
    be, bh, bd = tile_shape(p.heads, p.head_dim, GRAD_TILE_ELEMENTS)
    _message_grad_kernel[(triton.cdiv(chunk.rows, be),)](
        y, state.grad_out, state.out, state.stats, state.stats[1] if mode == GRAD_MAX else state.stats,
        p.recv_rowptr, y if gate is None else gate,
        y if seg_sum is None else seg_sum, seg_of_row, p.receiver, dy, y if wa is None else wa,
        chunk.row0, chunk.seg0, chunk.rows, p.heads, p.head_dim, MODE=mode, BLOCK_E=be, BLOCK_H=bh,
        BLOCK_D=bd)
