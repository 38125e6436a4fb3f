"""The prologue's gradients of the fused NT layer's backward on CUDA in one pass over dq, dk, dv.

``_input_grad_split_kernel`` replaces, where ``input_split_ok`` allows, the
w_qkv weight gradient (ntconv_wgrad.py, which reads dqkv and a stored z) and
``_du_kernel`` (ntconv_gemm.py, which reads dqkv again and a stored dz/du):
the backward's prologue then stores neither z nor dz/du.  Program s walks
the chunk's split-K row block s (ntconv_tiles.split_k_rows) in DU_ROWS-row
tiles; per tile:

1. u = centre[j] + receiver_term[k] (+ edge term) gathered as the prologue
   does (ntconv_gemm.messages_in), the dropout multiplier of (seed, row,
   channel), z = GELU(u) · multiplier rounded to the parameters' dtype (the
   forward's z) and dz/du = GELU'(u) · multiplier in fp32;
2. dq, dk and dv (each BLOCK_R x BLOCK_C, the parameters' dtype);
3. du = (Σ_part d_part · w_qkv[part]) · dz/du on tensor cores (w_qkv's three
   blocks loaded once per program), stored in the parameters' dtype;
4. dW_qkv[part] += d_partᵀ · z and db_qkv[part] += Σ_rows d_part in the
   program's fp32 registers, written once as the block's partials and summed
   in block order by ntconv_wgrad.combine (no atomics; bitwise the same run
   to run).

d_centre is the segment reduction of the stored du (ntconv_reduce.segment_sum,
as ntconv_stream does): with the tile's fused segment sums (_du_kernel's) the
kernel spilled on sm_90 (ptxas, bf16, C = 60, aligned pointers as at run time:
104 bytes with Triton 3.6, the GPU image's, 40 with 3.9; issue 40).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nt_kernels.backends.triton.common import cast
from nt_kernels.backends.triton.ntconv_gemm import (DU_MAX_CHANNELS, DU_ROWS, block_n, call_seed, dropout_keep,
                                                    fused_centre, gelu, gelu_grad, messages_in)
from nt_kernels.backends.triton.ntconv_reduce import segment_sum
from nt_kernels.backends.triton.ntconv_tiles import prologue_tiles, split_k_rows
from nt_kernels.backends.triton.ntconv_wgrad import combine, split_products, store_partial

__all__ = ["INPUT_MIN_ARCH", "INPUT_WARPS", "input_grad_split", "input_split_ok"]

INPUT_MIN_ARCH = 90  # compute capability floor of the one-pass kernel (input_split_ok)
# Warps per program (ptxas, sm_90, bf16, C = 16-64: 173-255 registers at 8 warps, no spills; 16 warps cap
# registers at 128 and spill 60-164 bytes): one program per SM.
INPUT_WARPS = 8


def input_split_ok(channels: int, operand_bytes: int, arch: int) -> bool:
    """Whether the one-pass kernel serves a layer of C = ``channels``: C within the du kernel's tile
    (ntconv_gemm.fused_centre), 16-bit parameters on sm_90 or newer."""
    return fused_centre(channels) and operand_bytes == 2 and arch >= INPUT_MIN_ARCH


@triton.jit(do_not_specialize=["row0", "R", "PART", "seed_word", "threshold"])
def _input_grad_split_kernel(centre, recv_term, edge_attr, w_edge, w_qkv, receiver, perm, seg_of_row, dqkv, du,
                             partials, row0, R, PART, seed_word, seed_ptr, threshold, drop_scale, C: tl.constexpr,
                             F: tl.constexpr, SPLIT_ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                             BLOCK_F: tl.constexpr, HAS_EDGE: tl.constexpr, DROPOUT: tl.constexpr,
                             SEED_ON_DEVICE: tl.constexpr, DOT_PREC: tl.constexpr, BF16_EMU: tl.constexpr):
    # Step 0: the three (C x C) blocks of w_qkv, loaded once; fp32 sums of dW_qkv and db_qkv per part.
    s = tl.program_id(0)
    ch = tl.arange(0, BLOCK_C)
    ch_valid = ch < C
    w_mask = ch_valid[:, None] & ch_valid[None, :]
    w_q = tl.load(w_qkv + ch[:, None] * C + ch[None, :], mask=w_mask, other=0.0)
    w_k = tl.load(w_qkv + (C + ch)[:, None] * C + ch[None, :], mask=w_mask, other=0.0)
    w_v = tl.load(w_qkv + (2 * C + ch)[:, None] * C + ch[None, :], mask=w_mask, other=0.0)
    acc_q = tl.zeros([BLOCK_C, BLOCK_C], tl.float32)
    acc_k = tl.zeros([BLOCK_C, BLOCK_C], tl.float32)
    acc_v = tl.zeros([BLOCK_C, BLOCK_C], tl.float32)
    bias_q = tl.zeros([BLOCK_C], tl.float32)
    bias_k = tl.zeros([BLOCK_C], tl.float32)
    bias_v = tl.zeros([BLOCK_C], tl.float32)
    seed = call_seed(seed_word, seed_ptr, SEED_ON_DEVICE)
    first = s * SPLIT_ROWS
    for r0 in range(first, tl.minimum(first + SPLIT_ROWS, R), BLOCK_R):
        # Step 1: u, z and dz/du of the tile's rows, as the prologue computes them.
        r = r0 + tl.arange(0, BLOCK_R)
        valid = r < R
        grow = row0 + r.to(tl.int64)
        mask = valid[:, None] & ch_valid[None, :]
        u = messages_in(centre, recv_term, edge_attr, w_edge, receiver, perm, seg_of_row, r, valid, grow, ch,
                        ch_valid, C, F, BLOCK_R, BLOCK_C, BLOCK_F, HAS_EDGE, DOT_PREC, BF16_EMU)
        scale = tl.full([BLOCK_R, BLOCK_C], 1.0, tl.float32)
        if DROPOUT:
            scale = tl.where(dropout_keep(grow, ch, seed, threshold), drop_scale, 0.0)
        z = cast(tl.where(mask, gelu(u) * scale, 0.0), w_q.dtype, BF16_EMU)
        # Step 2-3: dq, dk, dv of the rows; du = (dqkv · w_qkv) · dz/du and the weight sums, part by part.
        offs = r[:, None].to(tl.int64) * C + ch[None, :]
        d_q = tl.load(dqkv + offs, mask=mask, other=0.0)
        d_k = tl.load(dqkv + (r[:, None].to(tl.int64) + PART) * C + ch[None, :], mask=mask, other=0.0)
        d_v = tl.load(dqkv + (r[:, None].to(tl.int64) + 2 * PART) * C + ch[None, :], mask=mask, other=0.0)
        du_acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
        acc_q, bias_q, du_acc = split_products(acc_q, bias_q, du_acc, d_q, w_q, z, DOT_PREC, BF16_EMU)
        acc_k, bias_k, du_acc = split_products(acc_k, bias_k, du_acc, d_k, w_k, z, DOT_PREC, BF16_EMU)
        acc_v, bias_v, du_acc = split_products(acc_v, bias_v, du_acc, d_v, w_v, z, DOT_PREC, BF16_EMU)
        du_acc *= gelu_grad(u) * scale
        tl.store(du + offs, cast(du_acc, du.dtype.element_ty, BF16_EMU), mask=mask)
    # Step 4: the block's partial sums of dW_qkv and db_qkv, written once.
    base = partials + s.to(tl.int64) * (3 * C * (C + 1))
    store_partial(base, acc_q, bias_q, ch, ch_valid, ch, ch_valid, C)
    store_partial(base, acc_k, bias_k, C + ch, ch_valid, ch, ch_valid, C)
    store_partial(base, acc_v, bias_v, 2 * C + ch, ch_valid, ch, ch_valid, C)


def input_grad_split(du, dqkv, p, chunk, seg_of_row, d_centre, w_acc, b_acc) -> None:
    """du (rows, C) in the parameters' dtype, d_centre += its per-segment sums (when given), w_acc (3C, C)
    += dqkvᵀ z and b_acc += Σ dqkv for ``chunk`` (ntconv_op.Problem ``p``), z and dz/du recomputed from the
    node terms; ``dqkv`` is the chunk's (3, part_rows, C) gradient.  Any C with ``fused_centre(C)`` runs (the
    tests run fp32 through it); the op takes this path where ``input_split_ok`` holds."""
    rows, c = chunk.rows, p.channels
    if not fused_centre(c):
        raise ValueError(f"input_grad_split: C = {c} is wider than the du kernel's tile")
    if rows == 0:
        return
    split = split_k_rows(rows)
    if split % DU_ROWS:
        raise ValueError(f"input_grad_split: split-K blocks of {split} rows are not whole {DU_ROWS}-row tiles")
    splits = -(-rows // split)
    partials = torch.empty((splits, 3 * c, c + 1), dtype=torch.float32, device=du.device)
    edge = p.edge_attr is not None
    t = prologue_tiles(c, p.edge_dim, p.w_qkv.element_size())
    _input_grad_split_kernel[(splits,)](
        p.centre, p.receiver_term, p.edge_attr if edge else p.centre, p.w_edge if edge else p.centre, p.w_qkv,
        p.receiver, p.perm, seg_of_row, dqkv, du, partials, chunk.row0, rows, dqkv.shape[1], p.seed_word,
        p.seed_cell, p.drop_threshold, p.drop_scale, C=c, F=p.edge_dim, SPLIT_ROWS=split, BLOCK_R=DU_ROWS,
        BLOCK_C=block_n(c, DU_MAX_CHANNELS), BLOCK_F=t.block_f, HAS_EDGE=edge, DROPOUT=p.dropout > 0,
        SEED_ON_DEVICE=p.seed_on_device, DOT_PREC=p.dot_prec, BF16_EMU=p.bf16_emu, num_warps=INPUT_WARPS)
    if d_centre is not None:
        segment_sum(d_centre, du, chunk, c)
    combine(partials, w_acc, b_acc)
