"""Per-message kernels of the fused NT layer on CUDA: the prologue and the row GEMM.

Both work on one chunk of packed rows (ntconv_plan.py) with ``tl.dot``
(tensor cores for bf16/fp16 operands, fp32 accumulation; fp32 operands at
full precision unless TF32 is asked for).

* ``_prologue_kernel`` (DESIGN §6 steps 1-2): per packed row r of segment j
  with receiver k, u = centre[j] + receiver_term[k] (+ edge_attr[perm[r]] ·
  w_edgeᵀ), z = GELU(u) (exact erf) times the counter dropout multiplier of
  (seed, r, channel), then [q | k | v] = z · w_qkvᵀ + b_qkv, written to the
  chunk's (3, R, C) buffer.  A program takes BLOCK_R consecutive packed rows
  and all C channels (tiles from ``ntconv_plan.prologue_tiles``): the index
  vectors are read coalesced in packed order, each gathered node-term and
  edge row once as a whole row, z is computed once in registers and rounded
  to the parameters' type, then multiplied by w_qkv one (part, BLOCK_N
  columns) block at a time, each stored as a contiguous tile of q, k or v.
  The backward's run also stores z (in the parameters' type: what the
  w_qkv gradient multiplies) and dz/du = GELU'(u) · multiplier (fp32).
* ``_rows_gemm_kernel``: out = A · W (+ bias) (· mul), A read through a
  (part, row, column) stride pattern so the (3, R, C) qkv gradient is read as
  one (R, 3C) operand.  Serves the output projection y = o · w_outᵀ + b_out,
  the message gradient do = dy · w_out and du = (dqkv · w_qkv) · dz/du.  A
  program tiles (BLOCK_R rows) x (BLOCK_N output columns) and walks the
  contraction in fixed BLOCK_K steps, so the summation order of an output
  element does not depend on the autotuned BLOCK_R.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from nt_kernels.backends.triton.common import INTERPRET, cast, mm, nonfinite_rows
from nt_kernels.backends.triton.ntconv_plan import prologue_tiles

__all__ = ["BLOCK_K", "centre_fixup", "du_and_centre", "dropout_keep", "fused_centre", "gelu", "gelu_grad",
           "gemm_configs", "messages_in", "mix32", "prologue", "rows_gemm", "tile_segment_sums"]

SQRT1_2 = tl.constexpr(0.7071067811865476)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
GOLDEN = tl.constexpr(0x9E3779B9)
MIX_A = tl.constexpr(0x7FEB352D)
MIX_B = tl.constexpr(0x846CA68B)
BLOCK_K = 32   # contraction step of the row GEMM (fixed: see the module docstring)


# On-line autotuning is opt-in, as for the exact kernels (configs.py): NT_KERNELS_TRITON_AUTOTUNE=1 times
# every config; otherwise each kernel runs its first config (the one the first H100 run checked).
AUTOTUNE = os.environ.get("NT_KERNELS_TRITON_AUTOTUNE", "0") == "1"


def gemm_configs():
    """Autotuning set of the row GEMM (one fixed config under the interpreter); the kernels only write."""
    if INTERPRET:
        return [triton.Config({"BLOCK_R": 32}, num_warps=4)]
    tuned = [triton.Config({"BLOCK_R": r}, num_warps=w, num_stages=s)
             for r in (32, 64) for w in (4, 8) for s in (2, 3)]
    return tuned if AUTOTUNE else tuned[:1]


def block_n(width: int, cap: int) -> int:
    """Output tile width: the whole width up to ``cap`` (a power of two >= 16)."""
    return min(max(16, triton.next_power_of_2(width)), cap)


@triton.jit
def gelu(x):
    """Exact (erf) GELU in fp32."""
    return 0.5 * x * (1.0 + tl.math.erf(x * SQRT1_2))


@triton.jit
def gelu_grad(x):
    """d GELU / dx = Phi(x) + x phi(x)."""
    return 0.5 * (1.0 + tl.math.erf(x * SQRT1_2)) + x * tl.exp(-0.5 * x * x) * INV_SQRT_2PI


@triton.jit
def mix32(x):
    """lowbias32 on uint32 (python/nt_reference/dropout.py)."""
    x = x ^ (x >> 16)
    x = x * MIX_A
    x = x ^ (x >> 15)
    x = x * MIX_B
    return x ^ (x >> 16)


@triton.jit
def call_seed(seed_word, seed_ptr, SEED_ON_DEVICE: tl.constexpr):
    """The call's seed word: the scalar argument, or the int64 cell at ``seed_ptr`` holding it (a seed drawn on
    the device, inside a CUDA graph capture, where a scalar argument would be frozen at its captured value)."""
    word = seed_word
    if SEED_ON_DEVICE:
        word = tl.load(seed_ptr).to(tl.int32)
    return word


@triton.jit
def dropout_keep(rows, ch, seed_word, threshold):
    """Keep mask of the counter dropout for global packed rows (int64) x channels."""
    lo = (rows & 0xFFFFFFFF).to(tl.uint32)
    hi = (rows >> 32).to(tl.uint32)
    row_key = mix32(seed_word.to(tl.uint32) ^ mix32(lo ^ mix32(hi ^ GOLDEN)))
    bits = mix32(row_key[:, None] ^ (ch.to(tl.uint32) * GOLDEN)[None, :])
    return (bits >> 8) >= threshold.to(tl.uint32)


@triton.jit
def _edge_term(edge_attr, w_edge, edge, valid, ch, ch_valid, F, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
               BLOCK_F: tl.constexpr, DOT_PREC: tl.constexpr, BF16_EMU: tl.constexpr):
    """edge_attr[edge] · w_edgeᵀ for (BLOCK_R rows) x (BLOCK_C channels), fp32, BLOCK_F features a step."""
    acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    for f0 in range(0, F, BLOCK_F):
        f = f0 + tl.arange(0, BLOCK_F)
        a = tl.load(edge_attr + edge[:, None] * F + f[None, :], mask=valid[:, None] & (f[None, :] < F), other=0.0)
        w = tl.load(w_edge + ch[None, :] * F + f[:, None], mask=ch_valid[None, :] & (f[:, None] < F), other=0.0)
        acc += mm(cast(a, w.dtype, BF16_EMU), w, DOT_PREC, BF16_EMU)  # edge features in w_edge's type
    return acc


@triton.jit
def messages_in(centre, recv_term, edge_attr, w_edge, receiver, perm, seg_of_row, r, valid, grow, ch, ch_valid,
                C, F, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr,
                HAS_EDGE: tl.constexpr, DOT_PREC: tl.constexpr, BF16_EMU: tl.constexpr):
    """u = centre[j] + receiver_term[k] (+ edge term) of the tile's rows, whole rows, fp32."""
    j = tl.load(seg_of_row + r, mask=valid, other=0)
    k = tl.load(receiver + grow, mask=valid, other=0)
    mask = valid[:, None] & ch_valid[None, :]
    u = tl.load(centre + j[:, None] * C + ch[None, :], mask=mask, other=0.0).to(tl.float32)
    u += tl.load(recv_term + k[:, None] * C + ch[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_EDGE:
        edge = tl.load(perm + grow, mask=valid, other=0)
        u += _edge_term(edge_attr, w_edge, edge, valid, ch, ch_valid, F, BLOCK_R, BLOCK_C, BLOCK_F, DOT_PREC,
                        BF16_EMU)
    return u


@triton.jit(do_not_specialize=["row0", "R", "PART", "seed_word", "threshold"])
def _prologue_kernel(centre, recv_term, edge_attr, w_edge, w_qkv, b_qkv, receiver, perm, seg_of_row,
                     qkv, z_out, jac_out, row0, R, PART, seed_word, seed_ptr, threshold, drop_scale,
                     C: tl.constexpr, F: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr, HAS_EDGE: tl.constexpr, DROPOUT: tl.constexpr,
                     SEED_ON_DEVICE: tl.constexpr, STORE_Z: tl.constexpr, DOT_PREC: tl.constexpr,
                     BF16_EMU: tl.constexpr):
    # Step 1: the tile's BLOCK_R consecutive packed rows and all C channels (q, k, v: PART rows apart).
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    valid = r < R
    grow = row0 + r.to(tl.int64)
    ch = tl.arange(0, BLOCK_C)
    ch_valid = ch < C
    mask = valid[:, None] & ch_valid[None, :]
    # Step 2: u from the gathered node terms (+ edge term), each row read once.
    u = messages_in(centre, recv_term, edge_attr, w_edge, receiver, perm, seg_of_row, r, valid, grow, ch, ch_valid,
                    C, F, BLOCK_R, BLOCK_C, BLOCK_F, HAS_EDGE, DOT_PREC, BF16_EMU)
    # Step 3: z = GELU(u) times the dropout multiplier of (seed, row, channel), rounded to the weights' type.
    scale = tl.full([BLOCK_R, BLOCK_C], 1.0, tl.float32)
    if DROPOUT:
        seed = call_seed(seed_word, seed_ptr, SEED_ON_DEVICE)
        scale = tl.where(dropout_keep(grow, ch, seed, threshold), drop_scale, 0.0)
    z = cast(gelu(u) * scale, w_qkv.dtype.element_ty, BF16_EMU)
    if STORE_Z:  # the backward's run: z (for the w_qkv gradient) and dz/du, both in the parameters' type
        offs = r[:, None].to(tl.int64) * C + ch[None, :]
        tl.store(z_out + offs, z, mask=mask)
        tl.store(jac_out + offs, cast(gelu_grad(u) * scale, jac_out.dtype.element_ty, BF16_EMU), mask=mask)
    # Step 4: per part (q, k, v) and block of BLOCK_N columns: z · w_qkv[part C + n]ᵀ + b_qkv, stored in place.
    for part in range(3):
        for n0 in range(0, C, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_valid = n < C
            col = part * C + n
            w = tl.load(w_qkv + col[None, :] * C + ch[:, None], mask=n_valid[None, :] & ch_valid[:, None], other=0.0)
            acc = mm(z, w, DOT_PREC, BF16_EMU)
            acc += tl.load(b_qkv + col, mask=n_valid, other=0.0).to(tl.float32)[None, :]
            out_offs = (r[:, None].to(tl.int64) + part * PART) * C + n[None, :]
            tl.store(qkv + out_offs, cast(acc, qkv.dtype.element_ty, BF16_EMU),
                     mask=valid[:, None] & n_valid[None, :])


@triton.autotune(configs=gemm_configs(), key=["K", "N", "BLOCK_N", "HAS_BIAS", "HAS_MUL"])
@triton.jit(do_not_specialize=["R", "A_PART"])
def _rows_gemm_kernel(a, w, bias, mul, out, R, K: tl.constexpr, N: tl.constexpr, A_SPLIT: tl.constexpr, A_PART,
                      A_ROW: tl.constexpr, W_K: tl.constexpr, W_N: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MUL: tl.constexpr,
                      DOT_PREC: tl.constexpr, BF16_EMU: tl.constexpr):
    # out[r, n] = sum_kk A[r, kk] W[kk, n], A[r, kk] at (kk // A_SPLIT) A_PART + r A_ROW + kk % A_SPLIT,
    # W[kk, n] at kk W_K + n W_N; out is (R, N) row-major.  The layer's shape (every size and stride but R
    # and the chunk's A_PART) is constexpr: no integer division per element, and aligned rows, so that the
    # loads go through the compiler's cp.async pipeline (with run-time sizes it issued 2-byte loads and no
    # cp.async at all: ptxas, sm_90, Triton 3.6, tolokers' y: 239 -> 88 registers).
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    valid = r < R
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = n < N
    acc = tl.zeros([BLOCK_R, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_valid = kk < K
        part = kk // A_SPLIT
        a_offs = part[None, :].to(tl.int64) * A_PART + r[:, None].to(tl.int64) * A_ROW + (kk - part * A_SPLIT)[None, :]
        x = tl.load(a + a_offs, mask=valid[:, None] & k_valid[None, :], other=0.0)
        wt = tl.load(w + kk[:, None] * W_K + n[None, :] * W_N, mask=k_valid[:, None] & n_valid[None, :], other=0.0)
        acc += mm(cast(x, wt.dtype, BF16_EMU), wt, DOT_PREC, BF16_EMU)
    mask = valid[:, None] & n_valid[None, :]
    offs = r[:, None].to(tl.int64) * N + n[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    if HAS_MUL:
        acc *= tl.load(mul + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + offs, cast(acc, out.dtype.element_ty, BF16_EMU), mask=mask)


@triton.jit
def tile_segment_sums(x, seg_of_row, rowptr, d_centre, part, tile, r, valid, n, n_valid, seg0, C: tl.constexpr,
                      BLOCK_R: tl.constexpr, BF16_EMU: tl.constexpr):
    """Per-segment column sums of the rows x of tile ``tile`` (rows tile·BLOCK_R + [0, BLOCK_R) in packed
    order, fp32): a segment whole in the tile adds its sum to d_centre (its only writer); the tile's first
    and last segments, where they cross the tile's edges, store their partial sums in the tile's scratch
    slots 0 and 1 (summed by _centre_fixup_kernel)."""
    # Local segment of each row: the count of segment starts before it in the tile (empty segments skipped).
    tile0 = tile * BLOCK_R
    seg = tl.load(seg_of_row + r, mask=valid, other=-1)
    prev = tl.load(seg_of_row + r - 1, mask=valid & (r > tile0), other=-1)
    local = tl.cumsum((valid & (r > tile0) & (seg != prev)).to(tl.int32), axis=0)
    slot = tl.arange(0, BLOCK_R)
    onehot = (slot[:, None] == local[None, :]) & valid[None, :]
    # Exact 0/1 weights, fp32 sums.  A row holding NaN or inf is left out of the product (a 0 weight times
    # it would spread NaN to every segment of the tile) and makes its own segment's sums NaN.
    bad = nonfinite_rows(x) > 0
    sums = mm(onehot.to(tl.float32), tl.where(bad[:, None], 0.0, x), "ieee", BF16_EMU)
    sums = tl.where((tl.max((onehot & bad[None, :]).to(tl.int32), axis=1) > 0)[:, None], float("nan"), sums)
    owner = tl.max(tl.where(onehot, seg[None, :], -1), axis=1)
    used = owner >= 0
    local_seg = tl.where(used, owner - seg0, 0)
    first = tl.load(rowptr + local_seg, mask=used, other=0)
    end = tl.load(rowptr + local_seg + 1, mask=used, other=0)
    whole = used & (first >= tile0) & (end <= tile0 + BLOCK_R)
    offs = local_seg[:, None].to(tl.int64) * C + n[None, :]
    mask = whole[:, None] & n_valid[None, :]
    tl.store(d_centre + offs, tl.load(d_centre + offs, mask=mask, other=0.0) + sums, mask=mask)
    # At most two crossing segments: local 0 (slot 0) and the last one (slot 1).
    cross = used & (first < end) & ~whole
    scratch = (tile * 2 + tl.minimum(slot, 1)).to(tl.int64)[:, None] * C + n[None, :]
    tl.store(part + scratch, sums, mask=cross[:, None] & n_valid[None, :])


@triton.jit(do_not_specialize=["R", "PART", "seg0"], do_not_specialize_on_alignment=["d_centre"])
def _du_kernel(dqkv, w_qkv, jac, seg_of_row, rowptr, du, d_centre, part, R, PART, seg0, C: tl.constexpr,
               BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, CENTRE: tl.constexpr,
               DOT_PREC: tl.constexpr, BF16_EMU: tl.constexpr):
    # Step 1: du = (dqkv · w_qkv) · dz/du for BLOCK_R rows and every channel, the (3, PART, C) gradient (rows
    # < R used) read as one (R, 3C) operand in fixed BLOCK_K steps (as _rows_gemm_kernel), stored in du's type.
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    valid = r < R
    n = tl.arange(0, BLOCK_C)
    n_valid = n < C
    acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    for k0 in range(0, 3 * C, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_valid = kk < 3 * C
        qkv_part = kk // C
        offs = (qkv_part[None, :].to(tl.int64) * PART + r[:, None]) * C + (kk - qkv_part * C)[None, :]
        x = tl.load(dqkv + offs, mask=valid[:, None] & k_valid[None, :], other=0.0)
        w = tl.load(w_qkv + kk[:, None] * C + n[None, :], mask=k_valid[:, None] & n_valid[None, :], other=0.0)
        acc += mm(cast(x, w.dtype, BF16_EMU), w, DOT_PREC, BF16_EMU)
    mask = valid[:, None] & n_valid[None, :]
    offs = r[:, None].to(tl.int64) * C + n[None, :]
    acc *= tl.load(jac + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(du + offs, cast(acc, du.dtype.element_ty, BF16_EMU), mask=mask)
    # Step 2 (CENTRE): d_centre from the same tile, so du is not read back for it.
    if CENTRE:
        tile_segment_sums(acc, seg_of_row, rowptr, d_centre, part, tl.program_id(0), r, valid, n, n_valid, seg0,
                          C, BLOCK_R, BF16_EMU)


@triton.jit(do_not_specialize_on_alignment=["d_centre"])
def _centre_fixup_kernel(rowptr, part, d_centre, C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_C: tl.constexpr):
    # Segment s of the chunk, if it crosses a tile edge of _du_kernel: the partial sums of its tiles in tile
    # order (BLOCK_T at a time, each block a fixed tree), added to d_centre[s].
    s = tl.program_id(0)
    first = tl.load(rowptr + s)
    end = tl.load(rowptr + s + 1)
    t0 = first // BLOCK_R
    t1 = (end - 1) // BLOCK_R
    if (end > first) & (t1 > t0):
        n = tl.arange(0, BLOCK_C)
        n_valid = n < C
        total = tl.zeros([BLOCK_C], tl.float32)
        for tb in range(t0, t1 + 1, BLOCK_T):
            t = tb + tl.arange(0, BLOCK_T)
            slot = ((t == t0) & (first > t0 * BLOCK_R)).to(tl.int64)  # a later segment of its first tile: slot 1
            offs = (t.to(tl.int64) * 2 + slot)[:, None] * C + n[None, :]
            total += tl.sum(tl.load(part + offs, mask=(t <= t1)[:, None] & n_valid[None, :], other=0.0), axis=0)
        offs = s.to(tl.int64) * C + n
        tl.store(d_centre + offs, tl.load(d_centre + offs, mask=n_valid, other=0.0) + total, mask=n_valid)


def prologue(qkv, z_out, jac_out, p, chunk, seg_of_row, dot_prec, bf16_emu):
    """Launch the prologue for ``chunk`` (ntconv_op.Problem ``p``); z_out/jac_out None in the forward."""
    rows, c = chunk.rows, p.channels
    if rows == 0:
        return
    t = prologue_tiles(c, p.edge_dim, p.w_qkv.element_size())
    store = z_out is not None
    edge = p.edge_attr is not None
    _prologue_kernel[(triton.cdiv(rows, t.block_r),)](
        p.centre, p.receiver_term, p.edge_attr if edge else p.centre, p.w_edge if edge else p.centre,
        p.w_qkv, p.b_qkv, p.receiver, p.perm, seg_of_row, qkv, z_out if store else qkv, jac_out if store else qkv,
        chunk.row0, rows, qkv.shape[1], p.seed_word, p.seed_cell, p.drop_threshold, p.drop_scale, C=c,
        F=p.edge_dim, BLOCK_R=t.block_r, BLOCK_C=t.block_c, BLOCK_N=t.block_n, BLOCK_F=t.block_f, HAS_EDGE=edge,
        DROPOUT=p.dropout > 0, SEED_ON_DEVICE=p.seed_on_device, STORE_Z=store, DOT_PREC=dot_prec,
        BF16_EMU=bf16_emu, num_warps=t.num_warps, num_stages=t.num_stages)


def gemm_shape(use: str, channels: int, out_channels: int = 0, edge_dim: int = 0) -> dict:
    """The sizes and strides (rows_gemm's keywords; _rows_gemm_kernel's constexprs) of one use of the row
    GEMM: y = o·w_outᵀ, do = dy·w_out, du = dqkv·w_qkv (dqkv read as its three (R, C) parts), d_edge =
    du·w_edge."""
    c = channels
    return {"y": dict(k=c, n=out_channels, a_split=c, a_row=c, w_k=1, w_n=c),
            "do": dict(k=out_channels, n=c, a_split=out_channels, a_row=out_channels, w_k=c, w_n=1),
            "du": dict(k=3 * c, n=c, a_split=c, a_row=c, w_k=c, w_n=1),
            "d_edge": dict(k=c, n=edge_dim, a_split=c, a_row=c, w_k=edge_dim, w_n=1)}[use]


def rows_gemm(out, a, w, *, rows, k, n, a_split, a_part, a_row, w_k, w_n, bias=None, mul=None,
              dot_prec="ieee", bf16_emu=False):
    """out (rows, n) = A · W (+ bias) (* mul) with the stride pattern of ``_rows_gemm_kernel``."""
    if rows == 0:
        return out
    bn = block_n(n, 128)
    grid = lambda meta: (triton.cdiv(rows, meta["BLOCK_R"]), triton.cdiv(n, bn))  # noqa: E731
    _rows_gemm_kernel[grid](a, w, w if bias is None else bias, out if mul is None else mul, out,
                            rows, k, n, a_split, a_part, a_row, w_k, w_n, BLOCK_N=bn, BLOCK_K=BLOCK_K,
                            HAS_BIAS=bias is not None, HAS_MUL=mul is not None, DOT_PREC=dot_prec,
                            BF16_EMU=bf16_emu)
    return out


DU_ROWS = 32          # rows per program of _du_kernel (fixed: the d_centre partial sums follow these tiles)
DU_MAX_CHANNELS = 64  # widest C whose du rows one program holds whole (wider: row GEMM + segment reduction;
                      # ptxas, sm_90: the C = 128 tile with its segment sums spills)
FIXUP_TILES = 64      # tiles' partial sums per step of the fix-up


def du_warps(operand_bytes: int) -> int:
    """Warps of _du_kernel: 4, 8 for fp32 operands (ptxas, sm_80 / sm_89: the fp32 C = 60 tile with d_centre's
    sums spills at 4 warps since they keep a NaN row in its own segment)."""
    return 8 if operand_bytes > 2 else 4


def fused_centre(channels: int) -> bool:
    """Whether du and d_centre come from one kernel (_du_kernel) for C = ``channels``."""
    return channels <= DU_MAX_CHANNELS


def du_and_centre(du, dqkv, jac, p, chunk, seg_of_row, d_centre):
    """du (rows, C) = (dqkv · w_qkv) · dz/du for ``chunk`` and, when ``d_centre`` (the chunk's segments'
    rows of the fp32 accumulator) is given, d_centre += per-segment sums of du; requires
    ``fused_centre(C)``."""
    rows, c = chunk.rows, p.channels
    if rows == 0:
        return
    tiles = triton.cdiv(rows, DU_ROWS)
    centre = d_centre is not None
    part = torch.empty((tiles, 2, c) if centre else (1,), dtype=torch.float32, device=du.device)
    _du_kernel[(tiles,)](dqkv, p.w_qkv, jac, seg_of_row, chunk.rowptr, du, d_centre if centre else du, part, rows,
                         dqkv.shape[1], chunk.seg0, C=c, BLOCK_R=DU_ROWS, BLOCK_C=block_n(c, DU_MAX_CHANNELS), BLOCK_K=BLOCK_K,
                         CENTRE=centre, DOT_PREC=p.dot_prec, BF16_EMU=p.bf16_emu,
                         num_warps=du_warps(p.w_qkv.element_size()), num_stages=2)
    if centre:
        centre_fixup(part, d_centre, chunk, c)


def centre_fixup(part, d_centre, chunk, c) -> None:
    """d_centre += the partial sums of the segments that cross DU_ROWS-row tiles (``part``: tiles x 2 x C)."""
    if chunk.seg1 > chunk.seg0:
        _centre_fixup_kernel[(chunk.seg1 - chunk.seg0,)](chunk.rowptr, part, d_centre, C=c, BLOCK_R=DU_ROWS,
                                                         BLOCK_T=FIXUP_TILES, BLOCK_C=block_n(c, DU_MAX_CHANNELS),
                                                         num_warps=4, num_stages=1)
