"""Weight gradients of the fused NT layer's backward on CUDA: split-K over fixed row blocks.

Every weight gradient of the layer is dW (M, N) += Aᵀ · B over a chunk's R
packed rows, and its bias gradient db (M) += the column sums of A:

| weight | A (R x M) | B (R x N) |
|---|---|---|
| w_qkv (3C, C), b_qkv | dq, dk, dv: the (3, R, C) buffer read as (R, 3C) | z, stored by the prologue |
| w_out (C_out, C), b_out | dy (fp32) | o |
| w_edge (C, F) | du (fp32) | edge_attr[perm[row]] (gathered) |

Both operands are rounded to the parameters' dtype (what the forward's
product ran in, as autocast's ``nn.Linear`` backward does) and multiplied on
tensor cores with fp32 accumulation (``tl.dot``; float32 parameters at the
op's float32 precision, "ieee" unless TF32 is allowed).  The bias sums ride
along on the tensor cores too: Aᵀ times a (rows x 16) block of ones, whose
first column is Σ_r A[r, m] (exact products, fp32 sums; full fp32 precision
even where TF32 is allowed, as PyTorch's bias gradient is a plain sum).

Algorithm (tiles from ``ntconv_plan.weight_grad_tiles``, never autotuned):

1. ``_weight_grad_kernel``: program (i, j, s) reduces rows
   [s·SPLIT_ROWS, (s+1)·SPLIT_ROWS) of the chunk in steps of BLOCK_R into a
   BLOCK_M x BLOCK_N fp32 tile (and BLOCK_M bias sums) and writes it to
   partials[s] (no atomics).  Each row of A is read once (dq, dk and dv in
   one pass where they fit one tile); the output tiles of one row block are
   neighbours in the grid (tile ids vary fastest), so they run together and
   B's rows, which each of them reads, come from L2 after the first.
2. ``_combine_kernel``: each output element adds partials[0..S) in split
   order (blocks of BLOCK_S summed by ``tl.sum``, a fixed tree) to the running
   fp32 gradient, which the op adds chunk by chunk in chunk order.

The split boundaries depend only on the chunk's row count, so the result is
bitwise the same run to run.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nt_kernels.backends.triton.common import INTERPRET, cast, mm
from nt_kernels.backends.triton.ntconv_plan import PART_ROWS, weight_grad_tiles

__all__ = ["COMBINE_BLOCK", "COMBINE_SPLITS", "TL_DTYPES", "combine", "split_products", "store_partial",
           "weight_grad"]

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
COMBINE_BLOCK = 64    # output elements per combine program (w_qkv with C = 60: 172 programs)
# Under the interpreter, whose programs run one after another at a fixed cost each: 11 programs for C = 60.
COMBINE_BLOCK_INTERPRETED = 1024
COMBINE_SPLITS = 64   # partials summed per step of the combine (512 splits: 8 steps)
NUM_STAGES = 2        # software pipelining of the split kernel (at most 32 KB of shared memory: fits sm_89)
ONES = tl.constexpr(16)  # columns of the ones block of the bias sums (the smallest tl.dot width)


@triton.jit(do_not_specialize=["R", "row0"])
def _weight_grad_kernel(a, b, index, partials, R, row0, M_PART: tl.constexpr, N: tl.constexpr,
                        PARTS: tl.constexpr, A_ROW: tl.constexpr, B_ROW: tl.constexpr, SPLIT_ROWS: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
                        GATHER: tl.constexpr, PART_ALIGN: tl.constexpr,
                        DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, BF16_EMU: tl.constexpr):
    # A is PARTS stacked (PART, M_PART) blocks of row stride A_ROW, PART = R padded to a multiple of PART_ALIGN
    # (part p at p PART A_ROW: the (3, part_rows, C) dqkv, PART_ALIGN = 8 in the op, so every part starts as
    # aligned as the first and the compiler sees it);
    # B[r, n] at row(r) B_ROW + n with row(r) = index[row0 + r] when GATHER, else r.  partials is
    # (splits, PARTS M_PART, N + HAS_BIAS) fp32.  Every stride is a compile-time constant, so the
    # compiler sees the rows' alignment (C = 60: 8 bytes in bf16) and vectorises the loads.
    # Step 1: this program's part, output tile and block of rows (part-major tile ids, no runtime divisor).
    M_TILES: tl.constexpr = (M_PART + BLOCK_M - 1) // BLOCK_M
    part = tl.program_id(0) // M_TILES
    m = (tl.program_id(0) % M_TILES) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    a_part = a + part.to(tl.int64) * ((R + PART_ALIGN - 1) // PART_ALIGN * PART_ALIGN) * A_ROW
    m_valid = m < M_PART
    n_valid = n < N
    first = split * SPLIT_ROWS
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    bias = tl.zeros([BLOCK_M, ONES], tl.float32)
    # Step 2: acc += A[rows]ᵀ · B[rows] over the block, BLOCK_R rows per tensor-core product.
    for r0 in range(first, tl.minimum(first + SPLIT_ROWS, R), BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        valid = r < R
        x = tl.load(a_part + r[:, None].to(tl.int64) * A_ROW + m[None, :], mask=valid[:, None] & m_valid[None, :],
                    other=0.0)
        row = tl.load(index + row0 + r, mask=valid, other=0) if GATHER else r.to(tl.int64)
        y = tl.load(b + row[:, None] * B_ROW + n[None, :], mask=valid[:, None] & n_valid[None, :], other=0.0)
        xt = tl.trans(cast(x, DOT_DTYPE, BF16_EMU))
        acc += mm(xt, cast(y, DOT_DTYPE, BF16_EMU), DOT_PREC, BF16_EMU)
        if HAS_BIAS:  # column sums of A: Aᵀ times ones (rows past R are 0 in A), never rounded to TF32
            bias += mm(xt, tl.full([BLOCK_R, ONES], 1.0, DOT_DTYPE), "ieee", BF16_EMU)
    # Step 3: the block's partial sums, written once; the bias sums (column 0 of ``bias``) as column N.
    WIDTH: tl.constexpr = N + HAS_BIAS
    base = partials + split.to(tl.int64) * (PARTS * M_PART * WIDTH) + part * (M_PART * WIDTH)
    tl.store(base + m[:, None] * WIDTH + n[None, :], acc, mask=m_valid[:, None] & n_valid[None, :])
    if HAS_BIAS:
        if tl.program_id(1) == 0:
            first_column = tl.arange(0, ONES)[None, :] == 0
            tl.store(base + m * WIDTH + N, tl.sum(tl.where(first_column, bias, 0.0), axis=1), mask=m_valid)


@triton.jit
def split_products(acc, bias, out, x, w, b, DOT_PREC: tl.constexpr, BF16_EMU: tl.constexpr):
    """One row tile of a fused split-K pass: out += x · w, acc += xᵀ · b and bias += Σ_rows x, for a
    (rows, M) operand x already in the parameters' dtype (rows past the chunk 0)."""
    bias += tl.sum(x.to(tl.float32), axis=0)
    return acc + mm(tl.trans(x), b, DOT_PREC, BF16_EMU), bias, out + mm(x, w, DOT_PREC, BF16_EMU)


@triton.jit
def store_partial(base, acc, bias, rows, rows_valid, cols, cols_valid, N: tl.constexpr):
    """A split's sums into its (M, N + 1) slice of the partials at ``base``: acc at (rows, cols < N), bias in
    column N (what _combine_kernel reads)."""
    tl.store(base + rows[:, None] * (N + 1) + cols[None, :], acc, mask=rows_valid[:, None] & cols_valid[None, :])
    tl.store(base + rows * (N + 1) + N, bias, mask=rows_valid)


@triton.jit(do_not_specialize=["S", "M", "N"])
def _combine_kernel(partials, w_acc, b_acc, S, M, N, HAS_BIAS: tl.constexpr, BLOCK_S: tl.constexpr,
                    BLOCK: tl.constexpr):
    # Step 1: the sum over splits 0..S of BLOCK flat elements of the (M, N + HAS_BIAS) partials, in split order.
    width = N + HAS_BIAS
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = i < M * width
    total = tl.zeros([BLOCK], tl.float32)
    for s0 in range(0, S, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        tile = tl.load(partials + s[:, None].to(tl.int64) * M * width + i[None, :],
                       mask=(s < S)[:, None] & valid[None, :], other=0.0)
        total += tl.sum(tile, axis=0)
    # Step 2: add into the running gradients: columns < N to dW, column N to db.
    m = i // width
    n = i - m * width
    is_w = valid & (n < N)
    w_offs = m * N + n
    tl.store(w_acc + w_offs, tl.load(w_acc + w_offs, mask=is_w, other=0.0) + total, mask=is_w)
    if HAS_BIAS:
        is_b = valid & (n == N)
        tl.store(b_acc + m, tl.load(b_acc + m, mask=is_b, other=0.0) + total, mask=is_b)


def weight_grad(w_acc, b_acc, a, b, *, rows, m, n, a_split, a_part, a_row, b_row, dtype, dot_prec, bf16_emu,
                index=None, row0=0):
    """w_acc (m, n) += Aᵀ B and, when ``b_acc`` is given, b_acc (m) += column sums of A, over ``rows``
    rows: A[r, i] at (i // a_split) a_part + r a_row + i % a_split, where a part (a_split columns) is
    a contiguous (a_part / a_row, a_row) block of ``rows`` rows or of ``rows`` padded to a multiple of
    PART_ROWS (the (3, part_rows, C) dqkv of the op: three parts); B rows
    gathered through ``index[row0 + r]`` when given; operands rounded to ``dtype``; both accumulators
    fp32 and contiguous."""
    if rows == 0:
        return
    parts = m // a_split
    # Rows per part: ``rows`` padded to a multiple of part_align (1 for one part, whose offset is 0: one
    # configuration per use whatever the chunk).
    padded = -(-rows // PART_ROWS) * PART_ROWS
    part_align = PART_ROWS if parts > 1 and a_part == padded * a_row else 1
    if parts * a_split != m or (parts > 1 and a_part != (padded if part_align > 1 else rows) * a_row):
        raise ValueError(f"weight_grad: A must be {m // max(a_split, 1)} parts of {a_split} columns, each a "
                         f"(rows, a_row) block or one of rows padded to a multiple of {PART_ROWS}; got "
                         f"a_split={a_split}, a_part={a_part}")
    has_bias = b_acc is not None
    t = weight_grad_tiles(rows, a_split, n, torch.empty(0, dtype=dtype).element_size())
    partials = torch.empty((t.splits, m, n + has_bias), dtype=torch.float32, device=w_acc.device)
    grid = (parts * triton.cdiv(a_split, t.block_m), triton.cdiv(n, t.block_n), t.splits)
    _weight_grad_kernel[grid](a, b, b if index is None else index, partials, rows, row0,
                              M_PART=a_split, N=n, PARTS=parts, A_ROW=a_row, B_ROW=b_row, SPLIT_ROWS=t.split_rows,
                              BLOCK_R=t.block_r, BLOCK_M=t.block_m, BLOCK_N=t.block_n, HAS_BIAS=has_bias,
                              GATHER=index is not None, PART_ALIGN=part_align,
                              DOT_DTYPE=TL_DTYPES[dtype], DOT_PREC=dot_prec, BF16_EMU=bf16_emu,
                              num_warps=t.num_warps, num_stages=NUM_STAGES)
    combine(partials, w_acc, b_acc)


def combine(partials, w_acc, b_acc) -> None:
    """w_acc (m, n) += the sum over splits of partials[:, :, :n] in split order, and b_acc (m) += that of
    partials[:, :, n] when ``b_acc`` is given; partials is (splits, m, n + (b_acc is not None)) fp32."""
    splits, m, width = partials.shape
    has_bias = b_acc is not None
    block = COMBINE_BLOCK_INTERPRETED if INTERPRET else COMBINE_BLOCK
    _combine_kernel[(triton.cdiv(m * width, block),)](
        partials, w_acc, w_acc if b_acc is None else b_acc, splits, m, width - has_bias, HAS_BIAS=has_bias,
        BLOCK_S=COMBINE_SPLITS, BLOCK=block, num_warps=4)
