"""Per-message kernels of the fused NT layer on CUDA: the prologue and the row GEMM.

Both work on one chunk of packed rows (ntconv_plan.py) and tile a program as
(BLOCK_R rows) x (BLOCK_N output columns), walking the contraction in
BLOCK_K steps with ``tl.dot`` (tensor cores for bf16/fp16 operands, fp32
accumulation; fp32 operands at full precision unless TF32 is asked for).
BLOCK_K is fixed, so the summation order of every output element does not
depend on the autotuned tile shape.

* ``_prologue_kernel`` (DESIGN §6 steps 1-2): per packed row r of segment j
  with receiver k, u = centre[j] + receiver_term[k] (+ edge_attr[perm[r]] ·
  w_edgeᵀ), z = GELU(u) (exact erf) times the counter dropout multiplier of
  (seed, r, channel), then [q | k | v] = z · w_qkvᵀ + b_qkv, written to the
  chunk's (3, R, C) buffer.  z is rebuilt for every K step from the gathered
  node terms, so it never goes to memory in the forward; the backward's run
  also stores z and dz/du = GELU'(u) · multiplier (fp32).
* ``_rows_gemm_kernel``: out = A · W (+ bias) (· mul), A read through a
  (part, row, column) stride pattern so the (3, R, C) qkv gradient is read as
  one (R, 3C) operand.  Serves the output projection y = o · w_outᵀ + b_out,
  the message gradient do = dy · w_out and du = (dqkv · w_qkv) · dz/du.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

from nt_kernels.backends.triton.common import INTERPRET, cast, mm

__all__ = ["BLOCK_K", "gelu", "gelu_grad", "gemm_configs", "mix32", "prologue", "prologue_configs", "rows_gemm"]

SQRT1_2 = tl.constexpr(0.7071067811865476)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
GOLDEN = tl.constexpr(0x9E3779B9)
MIX_A = tl.constexpr(0x7FEB352D)
MIX_B = tl.constexpr(0x846CA68B)
BLOCK_K = 32   # contraction step of every GEMM here (fixed: see the module docstring)
BLOCK_F = 16   # edge-feature step of the edge term


# NT_KERNELS_TRITON_AUTOTUNE=0 pins each kernel to its first config (the time-boxed GPU script sets it).
AUTOTUNE = os.environ.get("NT_KERNELS_TRITON_AUTOTUNE", "1") != "0"


def gemm_configs():
    """Autotuning set of the row GEMM (one fixed config under the interpreter); the kernels only write."""
    if INTERPRET:
        return [triton.Config({"BLOCK_R": 32}, num_warps=4)]
    tuned = [triton.Config({"BLOCK_R": r}, num_warps=w, num_stages=s)
             for r in (32, 64) for w in (4, 8) for s in (2, 3)]
    return tuned if AUTOTUNE else tuned[:1]


def prologue_configs():
    """Autotuning set of the prologue: 8 warps, because its (BLOCK_R x BLOCK_N) accumulator lives next to
    the hash, GELU and edge-term tiles (ptxas, sm_90: 4 warps spill for BLOCK_N = 256, 8 warps with
    BLOCK_R = 16 do not, in fp32 or bf16)."""
    if INTERPRET:
        return [triton.Config({"BLOCK_R": 32}, num_warps=4)]
    tuned = [triton.Config({"BLOCK_R": r}, num_warps=8, num_stages=s) for r in (16, 32) for s in (2, 3)]
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
def dropout_keep(rows, ch, seed_word, threshold):
    """Keep mask of the counter dropout for global packed rows (int64) x channels."""
    lo = (rows & 0xFFFFFFFF).to(tl.uint32)
    hi = (rows >> 32).to(tl.uint32)
    row_key = mix32(seed_word.to(tl.uint32) ^ mix32(lo ^ mix32(hi ^ GOLDEN)))
    bits = mix32(row_key[:, None] ^ (ch.to(tl.uint32) * GOLDEN)[None, :])
    return (bits >> 8) >= threshold.to(tl.uint32)


@triton.jit
def _edge_term(edge_attr, w_edge, edge, valid, ch, ch_valid, F, BLOCK_R: tl.constexpr,
               BLOCK_K: tl.constexpr, BLOCK_F: tl.constexpr, DOT_PREC: tl.constexpr, BF16_EMU: tl.constexpr):
    """edge_attr[edge] · w_edge[ch]ᵀ for one (rows x BLOCK_K) tile, fp32."""
    acc = tl.zeros([BLOCK_R, BLOCK_K], tl.float32)
    for f0 in range(0, F, BLOCK_F):
        f = f0 + tl.arange(0, BLOCK_F)
        a = tl.load(edge_attr + edge[:, None] * F + f[None, :], mask=valid[:, None] & (f[None, :] < F), other=0.0)
        w = tl.load(w_edge + ch[None, :] * F + f[:, None], mask=ch_valid[None, :] & (f[:, None] < F), other=0.0)
        acc += mm(cast(a, w.dtype, BF16_EMU), w, DOT_PREC, BF16_EMU)  # edge features in w_edge's type
    return acc


@triton.autotune(configs=prologue_configs(), key=["C", "F", "BLOCK_N", "HAS_EDGE", "DROPOUT", "STORE_Z"])
@triton.jit(do_not_specialize=["row0", "seed_word", "threshold"])
def _prologue_kernel(centre, recv_term, edge_attr, w_edge, w_qkv, b_qkv, receiver, perm, seg_of_row,
                     qkv, z_out, jac_out, row0, R, C, F, seed_word, threshold, drop_scale,
                     BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_F: tl.constexpr, HAS_EDGE: tl.constexpr, DROPOUT: tl.constexpr,
                     STORE_Z: tl.constexpr, DOT_PREC: tl.constexpr, BF16_EMU: tl.constexpr):
    # Step 1: the tile's rows, their centre, receiver and edge, and output columns.
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    valid = r < R
    grow = row0 + r.to(tl.int64)
    j = tl.load(seg_of_row + r, mask=valid, other=0)
    k = tl.load(receiver + grow, mask=valid, other=0)
    edge = tl.load(perm + grow, mask=valid, other=0) if HAS_EDGE else grow
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = n < 3 * C
    acc = tl.zeros([BLOCK_R, BLOCK_N], tl.float32)
    for k0 in range(0, C, BLOCK_K):
        # Step 2: u = centre[j] + receiver_term[k] (+ edge term) for BLOCK_K channels.
        ch = k0 + tl.arange(0, BLOCK_K)
        ch_valid = ch < C
        mask = valid[:, None] & ch_valid[None, :]
        u = tl.load(centre + j[:, None] * C + ch[None, :], mask=mask, other=0.0).to(tl.float32)
        u += tl.load(recv_term + k[:, None] * C + ch[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_EDGE:
            u += _edge_term(edge_attr, w_edge, edge, valid, ch, ch_valid, F, BLOCK_R, BLOCK_K, BLOCK_F,
                            DOT_PREC, BF16_EMU)
        # Step 3: z = GELU(u) times the dropout multiplier of (seed, row, channel).
        z = gelu(u)
        scale = tl.full([BLOCK_R, BLOCK_K], 1.0, tl.float32)
        if DROPOUT:
            scale = tl.where(dropout_keep(grow, ch, seed_word, threshold), drop_scale, 0.0)
            z = z * scale
        if STORE_Z:  # the programs of the first column block store z and dz/du
            if tl.program_id(1) == 0:
                offs = r[:, None].to(tl.int64) * C + ch[None, :]
                tl.store(z_out + offs, z, mask=mask)
                tl.store(jac_out + offs, gelu_grad(u) * scale, mask=mask)
        # Step 4: acc += z · w_qkv[n, ch]ᵀ on tensor cores (z rounded to the weights' type).
        w = tl.load(w_qkv + n[None, :] * C + ch[:, None], mask=n_valid[None, :] & ch_valid[:, None], other=0.0)
        acc += mm(cast(z, w.dtype, BF16_EMU), w, DOT_PREC, BF16_EMU)
    # Step 5: bias, then column n of [q | k | v] goes to part n // C of the (3, R, C) buffer.
    acc += tl.load(b_qkv + n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    part = n // C
    offs = part[None, :].to(tl.int64) * R * C + r[:, None].to(tl.int64) * C + (n - part * C)[None, :]
    tl.store(qkv + offs, cast(acc, qkv.dtype.element_ty, BF16_EMU), mask=valid[:, None] & n_valid[None, :])


@triton.autotune(configs=gemm_configs(), key=["K", "N", "BLOCK_N", "HAS_BIAS", "HAS_MUL"])
@triton.jit
def _rows_gemm_kernel(a, w, bias, mul, out, R, K, N, A_SPLIT, A_PART, A_ROW, W_K, W_N,
                      BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      HAS_BIAS: tl.constexpr, HAS_MUL: tl.constexpr, DOT_PREC: tl.constexpr,
                      BF16_EMU: tl.constexpr):
    # out[r, n] = sum_kk A[r, kk] W[kk, n], A[r, kk] at (kk // A_SPLIT) A_PART + r A_ROW + kk % A_SPLIT,
    # W[kk, n] at kk W_K + n W_N; out is (R, N) row-major.
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
        acc *= tl.load(mul + offs, mask=mask, other=0.0)
    tl.store(out + offs, cast(acc, out.dtype.element_ty, BF16_EMU), mask=mask)


def prologue(qkv, z_out, jac_out, p, chunk, seg_of_row, dot_prec, bf16_emu):
    """Launch the prologue for ``chunk`` (ntconv_op.Problem ``p``); z_out/jac_out None in the forward."""
    rows, c = chunk.rows, p.channels
    bn = block_n(3 * c, 256)
    store = z_out is not None
    edge = p.edge_attr is not None
    grid = lambda meta: (triton.cdiv(rows, meta["BLOCK_R"]), triton.cdiv(3 * c, bn))  # noqa: E731
    _prologue_kernel[grid](
        p.centre, p.receiver_term, p.edge_attr if edge else p.centre, p.w_edge if edge else p.centre,
        p.w_qkv, p.b_qkv, p.receiver, p.perm, seg_of_row, qkv, z_out if store else qkv, jac_out if store else qkv,
        chunk.row0, rows, c, p.edge_dim, p.seed_word, p.drop_threshold, p.drop_scale,
        BLOCK_N=bn, BLOCK_K=BLOCK_K, BLOCK_F=BLOCK_F, HAS_EDGE=edge, DROPOUT=p.dropout > 0, STORE_Z=store,
        DOT_PREC=dot_prec, BF16_EMU=bf16_emu)


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
