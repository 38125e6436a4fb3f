"""The streaming design of the fused NT layer's per-row kernels on CUDA (issue 40): ``NT_KERNELS_NTCONV_RECOMPUTE=stream``.

The recompute path's one-pass kernels (ntconv_grad._message_grad_split_kernel,
ntconv_igrad._input_grad_split_kernel) carry three 64 x 64 fp32 weight-gradient
sums and the weight blocks across each 2,048-row split: 98-255 registers, one
CTA per SM, a serial tile loop (the first H200 run: 6 % of the copy bandwidth).
Here the per-row work carries nothing from one tile to the next but the next
tiles' loads, and the weight gradients go to the split-K tensor-core GEMM
(ntconv_wgrad._weight_grad_kernel) over a z or dy written once in the
parameters' dtype:

* ``_project_stream_kernel`` (forward): y = o · w_outᵀ + b_out head by head,
  what the receiver reduction reads stored (plain: y; gated: the value halves
  and the gates of the same tile), with the products the backward recomputes
  y with;
* ``_dy_stream_kernel`` (backward, STREAM_MODES): y recomputed from o head by
  head, dy by design.md §9's rules stored in the parameters' dtype for the
  w_out gradient, do = dy · w_out stored;
* ``_du_stream_kernel`` (backward, C <= 64, no edge features): u gathered as
  the prologue does, z = GELU(u) · multiplier stored in the parameters' dtype
  for the w_qkv gradient, du = (dqkv · w_qkv) · dz/du stored; d_centre is the
  segment reduction of du (ntconv_reduce.segment_sum: a fused segmented scan
  took 90 more registers).

Every kernel runs STREAM_WARPS = 4 warps a program under a register cap of 96
on sm_90 (STREAM_MAX_REGISTERS, no spills: 5 CTAs of 4 warps per SM); a program
walks STREAM_ROWS consecutive rows tile by tile and issues the loads of later
tiles before the current tile's math: o two tiles ahead and the receivers one
tile ahead (message gradient, projection: by hand), dq, dk, dv one tile ahead
(input gradients: the compiler's cp.async pipeline, 2 stages) with the gathered
node rows one tile ahead and their indices two.  w_qkv's blocks are read once
per program (kept in shared memory as the products' operands); w_out's per head
and tile (L1: the head loop, a runtime loop, keeps one head's tiles live).  No
transposed or fp32 (FMA) products, no cross-tile sums: the sources of the
recompute kernels' shared-memory traffic.  No atomics.
"""
from __future__ import annotations

import triton
import triton.language as tl

from nt_kernels.backends.triton.common import cast, device_arch, mm
from nt_kernels.backends.triton.ntconv_gemm import (DU_MAX_CHANNELS, INV_SQRT_2PI, SQRT1_2, block_n, call_seed,
                                                    dropout_keep, gelu, gelu_grad)
from nt_kernels.backends.triton.ntconv_grad import GRAD_GATED_SUM, GRAD_MEAN, GRAD_SUM
from nt_kernels.backends.triton.ntconv_reduce import segment_sum

__all__ = ["CAP_MIN_ARCH", "DU_STAGES", "DU_STREAM_ROWS", "MESSAGE_STAGES", "STREAM_E", "STREAM_MAX_REGISTERS",
           "STREAM_MODES", "STREAM_ROWS", "STREAM_WARPS", "du_stream", "du_stream_ok", "dy_stream", "project_stream",
           "stream_maxnreg", "stream_tiles", "stream_width"]

STREAM_WARPS = 4      # warps per program of every streaming kernel (the occupancy gate's 4 warps)
# Software pipelining: the input gradients' dq / dk / dv tiles by the compiler (cp.async into shared memory, 2
# stages); the message gradient and the projection prefetch o by hand (the compiler's pipeliner would take
# their inner head loop instead).
DU_STAGES = 2
MESSAGE_STAGES = 1
STREAM_ROWS = 512     # rows per program (tiles of BLOCK_E / DU_STREAM_ROWS rows walked in order)
STREAM_E = 16         # rows per tile of the message gradient and the projection
STREAM_MAX_CHANNELS = 64  # widest padded C of the streaming message gradient (ptxas, sm_90: C = 128 spills)
# The message-gradient modes with a streaming kernel: dy from the row's own values (ntconv_grad.SPLIT_MODES) but
# weighted_mean over receivers, whose kernel took 126 registers (ptxas, sm_90: 40 bytes of spills under the cap
# of 96); it keeps the stored message gradient within this design.
STREAM_MODES = (GRAD_SUM, GRAD_MEAN, GRAD_GATED_SUM)
DU_STREAM_ROWS = 16   # rows per tile of _du_stream_kernel
# ptxas's register cap (.maxnreg) of the streaming kernels on sm_90 and newer: the occupancy gate's 96 (5 CTAs of
# 4 warps per SM); uncapped, ptxas took up to 111 for the input gradients, none spilling at 96.  sm_80 and sm_89
# run uncapped (the gated message gradient spilled 20 bytes at 96 on sm_80).
STREAM_MAX_REGISTERS = 96
CAP_MIN_ARCH = 90


def stream_maxnreg(arch: int) -> int | None:
    """The register cap of the streaming kernels on compute capability ``arch`` (None: uncapped)."""
    return STREAM_MAX_REGISTERS if arch >= CAP_MIN_ARCH else None


def stream_width(heads: int, dim: int, mode: int, operand_bytes: int) -> int:
    """Padded channels (BLOCK_C) of the streaming message gradient and projection, or 0 where they do not
    apply: a mode of STREAM_MODES, C = heads · dim padded to at most STREAM_MAX_CHANNELS, 16-bit parameters
    (ptxas, sm_90: with fp32 operands the products run on FMA and spill up to 1.6 KB under the cap)."""
    width = max(16, triton.next_power_of_2(heads * dim))
    return width if mode in STREAM_MODES and width <= STREAM_MAX_CHANNELS and operand_bytes == 2 else 0


def stream_tiles(dim: int) -> tuple[int, int]:
    """(BLOCK_E rows, BLOCK_D padded dims of a head) of the streaming message gradient and projection: 16 rows
    (a tensor-core product's M), each head's dims padded to a power of two >= 16 (its products' N and K)."""
    return STREAM_E, max(16, triton.next_power_of_2(dim))


def du_stream_ok(channels: int, operand_bytes: int, edge_dim: int) -> bool:
    """Whether the streaming input gradients serve C = ``channels`` (a whole row in one tile, as _du_kernel)
    with parameters of ``operand_bytes`` and ``edge_dim`` edge features: 16-bit parameters (fp32 operands spill,
    as for the message gradient) and no edge features (ptxas, sm_90: C = 64 with F = 32 spills 36-40 bytes under
    the cap of 96, 126 registers without it)."""
    return channels <= DU_MAX_CHANNELS and operand_bytes == 2 and edge_dim == 0


# ----------------------------------------------------------------------------------------------- message gradient
@triton.jit
def _gelu_and_grad(x):
    """(GELU(x), GELU'(x)) in fp32 from one erf (ntconv_gemm.gelu and gelu_grad)."""
    cdf = 0.5 * (1.0 + tl.math.erf(x * SQRT1_2))
    return x * cdf, cdf + x * tl.exp(-0.5 * x * x) * INV_SQRT_2PI


@triton.jit
def _head_y(o_tile, w_out, b_out, row, d, d_valid, c, c_valid, C: tl.constexpr, DOT_PREC: tl.constexpr,
            BF16_EMU: tl.constexpr):
    """One head's half of y = o · w_out[row + d]ᵀ + b_out[row + d] as (rows, BLOCK_D) fp32, rounded to the
    parameters' dtype as the forward's y (0 at padded dims); w_out's (C x BLOCK_D) block read per tile (L1)."""
    w = tl.load(w_out + (row + d)[None, :] * C + c[:, None], mask=c_valid[:, None] & d_valid[None, :], other=0.0)
    bias = tl.load(b_out + row + d, mask=d_valid, other=0.0).to(tl.float32)
    return cast(mm(o_tile, w, DOT_PREC, BF16_EMU) + bias[None, :], w.dtype, BF16_EMU).to(tl.float32)


@triton.jit
def _head_do(acc, dy_head, w_out, row, d, d_valid, c, c_valid, C: tl.constexpr, DOT_PREC: tl.constexpr,
             BF16_EMU: tl.constexpr):
    """acc += dy_head · w_out[row + d] (the head's rows of w_out as stored: (BLOCK_D x C))."""
    w = tl.load(w_out + (row + d)[:, None] * C + c[None, :], mask=d_valid[:, None] & c_valid[None, :], other=0.0)
    return acc + mm(dy_head, w, DOT_PREC, BF16_EMU)


@triton.jit
def _head_dy(y_first, y_value, g, e1, e2, D: tl.constexpr, MODE: tl.constexpr):
    """One head's (dy of the first half, dy of the value half) as (rows, BLOCK_D) fp32 from its fp32 halves of y
    (plain modes: the value half unused), g = grad_out[k]'s head slice, e1 = the in-degree (``mean``) or
    stats[k, head] (``weighted_mean``) per row and e2 = Σ_d g · out[k] over the head (``weighted_mean``); the rules of
    ntconv_grad._plain_grad / _gated_grad for SPLIT_MODES (padded dims of g and y are 0)."""
    g = g.to(tl.float32)
    if MODE >= 3:
        # Value half first, keeping only g · GELU'(y_value) and a; then the gate half.
        m_value, grad_value = _gelu_and_grad(y_value)
        a = tl.sum(g * m_value, axis=1)
        if MODE == 4:  # weighted_mean: a - b with b = Σ_d g · out[k] (e2)
            a -= e2
        g = g * grad_value
        m_first, grad_first = _gelu_and_grad(y_first)
        gamma = tl.sum(m_first, axis=1) / D
        if MODE == 3:  # GRAD_GATED_SUM
            w = tl.sigmoid(gamma)
            d_gamma = w * (1.0 - w) * a
        else:  # GRAD_SOFTMAX over the receiver's messages
            w = tl.exp(gamma - e1)
            d_gamma = w * a
        return (d_gamma / D)[:, None] * grad_first, w[:, None] * g
    if MODE == 1:  # GRAD_MEAN
        g = g / e1[:, None]
    return g * gelu_grad(y_first), y_value


@triton.jit
def _o_tile(o, r0, e, c, end, C: tl.constexpr):
    """o's rows r0 + e (those before ``end``), channels c < C: 64-bit row base, 32-bit offsets."""
    return tl.load(o + tl.cast(r0, tl.int64) * C + (e[:, None] * C + c[None, :]),
                   mask=(r0 + e < end)[:, None] & (c < C)[None, :], other=0.0)


@triton.jit(do_not_specialize=["row0", "R", "heads"])
def _dy_stream_kernel(o, g_out, out, stats, recv_rowptr, receiver, w_out, b_out, dy, do, row0, R, heads,
                      H: tl.constexpr, D: tl.constexpr, MODE: tl.constexpr, TILES: tl.constexpr,
                      BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, DOT_PREC: tl.constexpr,
                      BF16_EMU: tl.constexpr):
    # Step 0: the program's rows [first, end), the first tile's o and receivers (``heads`` = H at run time: the
    # head loop is not unrolled, so one head's tiles are live at a time).
    C: tl.constexpr = H * D
    GATED: tl.constexpr = MODE >= 3
    C_OUT: tl.constexpr = 2 * C if GATED else C
    HEAD_ROWS: tl.constexpr = 2 * D if GATED else D  # y's columns per head: gate half, then value half
    d = tl.arange(0, BLOCK_D)
    d_valid = d < D
    c = tl.arange(0, BLOCK_C)
    c_valid = c < C
    e = tl.arange(0, BLOCK_E)
    first = tl.program_id(0) * (TILES * BLOCK_E)
    end = tl.minimum(R, first + TILES * BLOCK_E)
    o_next = _o_tile(o, first, e, c, end, C)
    o_after = _o_tile(o, first + BLOCK_E, e, c, end, C)
    k_next = tl.load(receiver + row0 + first + e, mask=first + e < end, other=0)
    for r0 in range(first, end, BLOCK_E):
        # Step 1: this tile's o (loaded two tiles ago) and receivers (a tile ago); o of the tile after next and
        # the next tile's receivers, before this tile's math.
        o_tile, o_next, k = o_next, o_after, k_next
        valid = r0 + e < end
        o_after = _o_tile(o, r0 + 2 * BLOCK_E, e, c, end, C)
        k_next = tl.load(receiver + row0 + r0 + BLOCK_E + e, mask=r0 + BLOCK_E + e < end, other=0)
        e1 = tl.zeros([BLOCK_E], tl.float32)
        if MODE == 1:  # GRAD_MEAN: the receivers' in-degrees
            deg = tl.load(recv_rowptr + k + 1, mask=valid, other=1) - tl.load(recv_rowptr + k, mask=valid, other=0)
            e1 = tl.maximum(deg, 1).to(tl.float32)
        # Step 2: per head, y of its halves from o (the forward's products), its slice of g = grad_out[k]
        # gathered, dy by the mode's rules stored (64-bit row base, 32-bit offsets), do += dy · w_out[rows].
        mask = valid[:, None] & d_valid[None, :]
        dy_tile = dy + tl.cast(r0, tl.int64) * C_OUT
        node = k[:, None] * C + d[None, :]
        acc = tl.zeros([BLOCK_E, BLOCK_C], tl.float32)
        for hh in range(heads):
            row = hh * HEAD_ROWS
            g = tl.load(g_out + node + hh * D, mask=mask, other=0.0)
            e2 = e1
            if MODE == 4:  # GRAD_SOFTMAX: the receivers' stats, and b = Σ_d g · out[k] of the head
                e1 = tl.load(stats + k * H + hh, mask=valid, other=0.0)
                e2 = tl.sum(g.to(tl.float32) * tl.load(out + node + hh * D, mask=mask, other=0.0).to(tl.float32), axis=1)
            y_first = _head_y(o_tile, w_out, b_out, row, d, d_valid, c, c_valid, C, DOT_PREC, BF16_EMU)
            y_value = y_first
            if GATED:
                y_value = _head_y(o_tile, w_out, b_out, row + D, d, d_valid, c, c_valid, C, DOT_PREC, BF16_EMU)
            dy_first, dy_value = _head_dy(y_first, y_value, g, e1, e2, D, MODE)
            offs = e[:, None] * C_OUT + (row + d)[None, :]
            dy_first = cast(tl.where(d_valid[None, :], dy_first, 0.0), dy.dtype.element_ty, BF16_EMU)
            tl.store(dy_tile + offs, dy_first, mask=mask)
            acc = _head_do(acc, dy_first, w_out, row, d, d_valid, c, c_valid, C, DOT_PREC, BF16_EMU)
            if GATED:
                dy_value = cast(tl.where(d_valid[None, :], dy_value, 0.0), dy.dtype.element_ty, BF16_EMU)
                tl.store(dy_tile + offs + D, dy_value, mask=mask)
                acc = _head_do(acc, dy_value, w_out, row + D, d, d_valid, c, c_valid, C, DOT_PREC, BF16_EMU)
        # Step 3: do of the tile, from the rounded dy (as the stored path's).
        tl.store(do + tl.cast(r0, tl.int64) * C + (e[:, None] * C + c[None, :]), cast(acc, do.dtype.element_ty, BF16_EMU),
                 mask=valid[:, None] & c_valid[None, :])


@triton.jit(do_not_specialize=["R", "heads"])
def _project_stream_kernel(o, w_out, b_out, y, gate, R, heads, H: tl.constexpr, D: tl.constexpr,
                           GATED: tl.constexpr, SIGMOID: tl.constexpr, TILES: tl.constexpr, BLOCK_E: tl.constexpr,
                           BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, DOT_PREC: tl.constexpr,
                           BF16_EMU: tl.constexpr):
    # Step 0: as _dy_stream_kernel: the program's rows, the first tile's o.
    C: tl.constexpr = H * D
    C_OUT: tl.constexpr = 2 * C if GATED else C
    HEAD_ROWS: tl.constexpr = 2 * D if GATED else D
    d = tl.arange(0, BLOCK_D)
    d_valid = d < D
    c = tl.arange(0, BLOCK_C)
    c_valid = c < C
    e = tl.arange(0, BLOCK_E)
    first = tl.program_id(0) * (TILES * BLOCK_E)
    end = tl.minimum(R, first + TILES * BLOCK_E)
    o_next = _o_tile(o, first, e, c, end, C)
    o_after = _o_tile(o, first + BLOCK_E, e, c, end, C)
    for r0 in range(first, end, BLOCK_E):
        # Step 1: this tile's o (loaded two tiles ago), o of the tile after next before this tile's products.
        o_tile, o_next = o_next, o_after
        valid = r0 + e < end
        o_after = _o_tile(o, r0 + 2 * BLOCK_E, e, c, end, C)
        # Step 2: per head, what the receiver reduction reads: y (plain), or the value half and the gate.
        mask = valid[:, None] & d_valid[None, :]
        y_tile = y + tl.cast(r0, tl.int64) * C_OUT
        for hh in range(heads):
            row = hh * HEAD_ROWS
            offs = e[:, None] * C_OUT + (row + d)[None, :]
            y_first = _head_y(o_tile, w_out, b_out, row, d, d_valid, c, c_valid, C, DOT_PREC, BF16_EMU)
            if GATED:
                y_value = _head_y(o_tile, w_out, b_out, row + D, d, d_valid, c, c_valid, C, DOT_PREC, BF16_EMU)
                tl.store(y_tile + offs + D, y_value.to(y.dtype.element_ty), mask=mask)
                gamma = tl.sum(gelu(y_first), axis=1) / D
                if SIGMOID:
                    gamma = tl.sigmoid(gamma)
                tl.store(gate + (r0 + e).to(tl.int64) * H + hh, gamma, mask=valid)
            else:
                tl.store(y_tile + offs, y_first.to(y.dtype.element_ty), mask=mask)


def _stream_programs(rows: int, block: int) -> tuple[int, int]:
    """(tiles per program, programs) of a streaming kernel over ``rows`` rows in tiles of ``block``."""
    tiles = max(1, STREAM_ROWS // block)
    return tiles, triton.cdiv(rows, tiles * block)


def project_stream(y, gate, o, p, chunk, *, sigmoid: bool) -> None:
    """The forward's y (rows, C_out) = o · w_outᵀ + b_out for ``chunk`` on the streaming tiles: all of y, or,
    with ``gate`` (rows, H) fp32 given (gated aggregators), the value halves and the gates (their sigmoid
    where ``sigmoid``); requires a nonzero ``stream_width``."""
    if chunk.rows == 0:
        return
    block_e, block_d = stream_tiles(p.head_dim)
    tiles, programs = _stream_programs(chunk.rows, block_e)
    _project_stream_kernel[(programs,)](
        o, p.w_out, p.b_out, y, y if gate is None else gate, chunk.rows, p.heads, H=p.heads, D=p.head_dim,
        GATED=gate is not None, SIGMOID=sigmoid, TILES=tiles, BLOCK_E=block_e, BLOCK_D=block_d,
        BLOCK_C=max(16, triton.next_power_of_2(p.channels)), DOT_PREC=p.dot_prec, BF16_EMU=p.bf16_emu,
        num_warps=STREAM_WARPS, num_stages=MESSAGE_STAGES, maxnreg=stream_maxnreg(device_arch(o.device)))


def dy_stream(dy, do, o, mode, p, chunk, state) -> None:
    """dy (rows, C_out) and do = dy · w_out (rows, C), both in the parameters' dtype, for ``chunk`` from o:
    y recomputed per tile (the forward's tiles, project_stream); the caller adds dW_out += dyᵀ o by the
    split-K weight gradient."""
    block_c = stream_width(p.heads, p.head_dim, mode, 2)
    if not block_c:
        raise ValueError(f"dy_stream: mode {mode} with {p.heads} heads of {p.head_dim} takes the stored-y path")
    if chunk.rows == 0:
        return
    block_e, block_d = stream_tiles(p.head_dim)
    tiles, programs = _stream_programs(chunk.rows, block_e)
    _dy_stream_kernel[(programs,)](
        o, state.grad_out, state.out, state.stats, p.recv_rowptr, p.receiver, p.w_out, p.b_out, dy, do, chunk.row0,
        chunk.rows, p.heads, H=p.heads, D=p.head_dim, MODE=mode, TILES=tiles, BLOCK_E=block_e, BLOCK_D=block_d,
        BLOCK_C=block_c, DOT_PREC=p.dot_prec, BF16_EMU=p.bf16_emu, num_warps=STREAM_WARPS, num_stages=MESSAGE_STAGES,
        maxnreg=stream_maxnreg(device_arch(o.device)))


# ----------------------------------------------------------------------------------------------- input gradients
@triton.jit
def _row_indices(seg_of_row, receiver, row0, r, valid):
    """(centre j, receiver k) of the chunk's packed rows r."""
    return tl.load(seg_of_row + r, mask=valid, other=0), tl.load(receiver + row0 + r, mask=valid, other=0)


@triton.jit
def _node_rows(centre, recv_term, j, k, valid, ch, ch_valid, C: tl.constexpr):
    """centre[j] + receiver_term[k] of the rows (fp32), whole rows gathered."""
    mask = valid[:, None] & ch_valid[None, :]
    u = tl.load(centre + j[:, None] * C + ch[None, :], mask=mask, other=0.0).to(tl.float32)
    return u + tl.load(recv_term + k[:, None] * C + ch[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit(do_not_specialize=["row0", "R", "PART", "seed_word", "threshold"])
def _du_stream_kernel(centre, recv_term, w_qkv, receiver, seg_of_row, dqkv, du, z_out, row0, R, PART, seed_word,
                      seed_ptr, threshold, drop_scale, C: tl.constexpr, TILES: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_C: tl.constexpr, DROPOUT: tl.constexpr, SEED_ON_DEVICE: tl.constexpr,
                      DOT_PREC: tl.constexpr, BF16_EMU: tl.constexpr):
    # Step 0: w_qkv's three (C x C) blocks, read once per program (the products' operands, kept in shared
    # memory); the first tile's indices and gathered node rows, the second tile's indices.
    ch = tl.arange(0, BLOCK_C)
    ch_valid = ch < C
    w_offs = ch[:, None] * C + ch[None, :]
    w_mask = ch_valid[:, None] & ch_valid[None, :]
    w_q = tl.load(w_qkv + w_offs, mask=w_mask, other=0.0)
    w_k = tl.load(w_qkv + C * C + w_offs, mask=w_mask, other=0.0)
    w_v = tl.load(w_qkv + 2 * C * C + w_offs, mask=w_mask, other=0.0)
    seed = call_seed(seed_word, seed_ptr, SEED_ON_DEVICE)
    first = tl.program_id(0) * (TILES * BLOCK_R)
    end = tl.minimum(R, first + TILES * BLOCK_R)  # the program's rows: [first, end)
    e = tl.arange(0, BLOCK_R)
    j, k = _row_indices(seg_of_row, receiver, row0, first + e, first + e < end)
    u_nodes = _node_rows(centre, recv_term, j, k, first + e < end, ch, ch_valid, C)
    j_next, k_next = _row_indices(seg_of_row, receiver, row0, first + BLOCK_R + e, first + BLOCK_R + e < end)
    for r0 in range(first, end, BLOCK_R):
        # Step 1: this tile's dq, dk, dv (contiguous: pipelined by the compiler, num_stages = 2); tile i+1's
        # node rows (its indices loaded a tile ago) and tile i+2's indices, before this tile's math.
        r = r0 + e
        valid = r < end
        mask = valid[:, None] & ch_valid[None, :]
        offs = r[:, None].to(tl.int64) * C + ch[None, :]
        d_q = tl.load(dqkv + offs, mask=mask, other=0.0)
        d_k = tl.load(dqkv + (r[:, None].to(tl.int64) + PART) * C + ch[None, :], mask=mask, other=0.0)
        d_v = tl.load(dqkv + (r[:, None].to(tl.int64) + 2 * PART) * C + ch[None, :], mask=mask, other=0.0)
        u_nodes_next = _node_rows(centre, recv_term, j_next, k_next, r + BLOCK_R < end, ch, ch_valid, C)
        j_next, k_next = _row_indices(seg_of_row, receiver, row0, r + 2 * BLOCK_R, r + 2 * BLOCK_R < end)
        # Step 2: u, z (stored for the w_qkv gradient) and the dropout multiplier of (seed, row, channel).
        u = u_nodes
        scale = tl.full([BLOCK_R, BLOCK_C], 1.0, tl.float32)
        if DROPOUT:
            scale = tl.where(dropout_keep(row0 + r.to(tl.int64), ch, seed, threshold), drop_scale, 0.0)
        tl.store(z_out + offs, cast(gelu(u) * scale, z_out.dtype.element_ty, BF16_EMU), mask=mask)
        # Step 3: du = (Σ_part d_part · w_qkv[part]) · dz/du on tensor cores, stored.
        acc = mm(d_q, w_q, DOT_PREC, BF16_EMU)
        acc += mm(d_k, w_k, DOT_PREC, BF16_EMU)
        acc += mm(d_v, w_v, DOT_PREC, BF16_EMU)
        acc *= gelu_grad(u) * scale
        tl.store(du + offs, cast(acc, du.dtype.element_ty, BF16_EMU), mask=mask)
        u_nodes = u_nodes_next


def du_stream(du, z, dqkv, p, chunk, seg_of_row, d_centre) -> None:
    """du (rows, C) and z (rows, C) in the parameters' dtype for ``chunk`` (ntconv_op.Problem ``p``; z and dz/du
    recomputed from the node terms), d_centre += du's per-segment sums when given (the segment reduction over
    du, in packed order); ``dqkv`` is the chunk's (3, part_rows, C) gradient.  The caller adds
    dW_qkv += dqkvᵀ z by the split-K weight gradient."""
    rows, c = chunk.rows, p.channels
    if not du_stream_ok(c, 2, p.edge_dim):
        raise ValueError(f"du_stream: C = {c} with {p.edge_dim} edge features takes the stored path")
    if rows == 0:
        return
    tiles, programs = _stream_programs(rows, DU_STREAM_ROWS)
    _du_stream_kernel[(programs,)](
        p.centre, p.receiver_term, p.w_qkv, p.receiver, seg_of_row, dqkv, du, z, chunk.row0, rows, dqkv.shape[1],
        p.seed_word, p.seed_cell, p.drop_threshold, p.drop_scale, C=c, TILES=tiles, BLOCK_R=DU_STREAM_ROWS,
        BLOCK_C=block_n(c, DU_MAX_CHANNELS), DROPOUT=p.dropout > 0, SEED_ON_DEVICE=p.seed_on_device,
        DOT_PREC=p.dot_prec, BF16_EMU=p.bf16_emu, num_warps=STREAM_WARPS, num_stages=DU_STAGES,
        maxnreg=stream_maxnreg(device_arch(du.device)))
    if d_centre is not None:
        segment_sum(d_centre, du, chunk, c)
