"""Forward Triton kernels of exact softmax attention over CSR segments.

Packed q, k, v, o are (E, H, D) contiguous; a program handles one (tile, head)
work item at a time and loads (rows x D) slices, each row a contiguous run of
D elements.  Every kernel is persistent: a fixed grid walks the work list of
the plan (see plan.py), whose lengths live on the device.

* ``_fwd_packed_kernel``: one tile of TILE rows holds whole segments of equal
  size n; scores are masked block-diagonally (``row // n == col // n``) and the
  softmax is done in one pass since all keys of a row are in the tile.
* ``_fwd_multi_kernel``: one query block of a segment longer than a tile,
  online softmax over the segment's key blocks.

Both store o and the float32 log-sum-exp (natural log, scaled scores).
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from nt_kernels.backends.triton import plan as plan_layout
from nt_kernels.backends.triton.plan import PLAN_BLOCK, TILE_HEIGHTS, max_packed_tile

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)
LOG2E_C = tl.constexpr(LOG2E)
H_TILES = tl.constexpr(plan_layout.H_TILES)
H_TILE_OFF = tl.constexpr(plan_layout.H_TILE_OFF)
H_MULTI = tl.constexpr(plan_layout.H_MULTI)
H_MULTI_OFF = tl.constexpr(plan_layout.H_MULTI_OFF)


def configs(inner_blocks=(32, 64), warps=(4, 8), inner_name="BLOCK_N"):
    """A small autotuning set; one fixed config under the interpreter."""
    if INTERPRET:
        return [triton.Config({inner_name: PLAN_BLOCK} if inner_name else {}, num_warps=4)]
    return [
        triton.Config({inner_name: b} if inner_name else {}, num_warps=w, num_stages=s)
        for b in (inner_blocks if inner_name else (None,))
        for w in warps
        for s in (1, 2)
    ]


def num_programs(device: torch.device, per_sm: int = 32) -> int:
    """Persistent grid size: a few waves of programs per SM (4 under the interpreter)."""
    if INTERPRET or device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count * per_sm


def dot_precision(dtype: torch.dtype, allow_tf32: bool) -> str:
    """float32 runs in full precision ("ieee") unless TF32 is asked for."""
    return "tf32" if (dtype == torch.float32 and allow_tf32 and not INTERPRET) else "ieee"


def bf16_emulation(dtype: torch.dtype) -> bool:
    """Under the interpreter (triton 3.9) tl.dot multiplies bfloat16 bit
    patterns as integers and fp32 -> bf16 casts truncate.  There bf16 kernels
    emulate the GPU instead: exact float32 dots of the bf16 operands (what the
    tensor cores compute: exact products, fp32 sums) and casts rounded to
    nearest even by hand."""
    return INTERPRET and dtype == torch.bfloat16


def packed_classes(dtype: torch.dtype, d: int) -> list[tuple[int, int]]:
    """(class, tile height) of the packed classes a plan for this dtype and
    head dim can hold (``max_packed_tile``); the launchers run only these."""
    return [(c, t) for c, t in enumerate(TILE_HEIGHTS) if t <= max_packed_tile(dtype, d)]


def block_d(d: int) -> int:
    """Head dim padded (in registers only) to a power of two >= 16."""
    return max(16, triton.next_power_of_2(d))


@triton.jit
def packed_rows(plan, t, tab, TILE: tl.constexpr):
    """Rows of packed tile t: (row index, local segment id, valid mask) per tile row."""
    entry = tab + 3 * t
    first = tl.load(plan + entry)
    count = tl.load(plan + entry + 1).to(tl.int32)
    n = tl.load(plan + entry + 2).to(tl.int32)
    r = tl.arange(0, TILE)
    seg = r // n
    valid = seg < count
    start = tl.load(plan + first + seg, mask=valid, other=0)
    return start + (r - seg * n), seg, valid


@triton.jit
def mm(a, b, DOT_PREC: tl.constexpr, BF16_EMU: tl.constexpr):
    """a @ b with float32 accumulation."""
    if BF16_EMU:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=DOT_PREC)


@triton.jit
def cast(x, dtype: tl.constexpr, BF16_EMU: tl.constexpr):
    """x.to(dtype), rounded to nearest even (by hand under the bf16 emulation)."""
    if BF16_EMU:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(dtype)
    return x.to(dtype)


@triton.jit
def load_rows(ptr, offs, valid, d, D):
    """Load (rows x BLOCK_D) with padding columns and invalid rows as 0."""
    mask = valid[:, None] & (d[None, :] < D)
    return tl.load(ptr + offs[:, None] + d[None, :], mask=mask, other=0.0)


@triton.jit
def nonfinite_rows(x):
    """1 for rows holding a NaN or infinity, else 0."""
    bad = tl.abs(x.to(tl.float32)) < float("inf")
    return tl.max(tl.where(bad, 0, 1), axis=1)


@triton.jit
def finite_or_zero(x):
    """x with NaN/inf replaced by 0, so 0-weights never pick them up across segments."""
    return tl.where(tl.abs(x.to(tl.float32)) < float("inf"), x, tl.zeros_like(x))


@triton.jit
def segment_any(flag, same):
    """For each row, whether ``flag`` is set on any row of its segment."""
    return tl.max(tl.where(same, flag[None, :], 0), axis=1) > 0


@triton.autotune(configs=configs(inner_name=None), key=["D", "TILE"])
@triton.jit
def _fwd_packed_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, plan, H, D, qk_scale,
                       CLASS: tl.constexpr, TILE: tl.constexpr, BLOCK_D: tl.constexpr,
                       DOT_PREC: tl.constexpr, BF16_EMU: tl.constexpr):
    n_work = tl.load(plan + H_TILES + CLASS) * H
    tab = tl.load(plan + H_TILE_OFF + CLASS)
    d = tl.arange(0, BLOCK_D)
    for w in range(tl.program_id(0), n_work, tl.num_programs(0)):
        # Step 1: tile rows (heads innermost in the work index, so neighbouring
        # programs read neighbouring D-slices of the same rows).
        t = w // H
        h = w % H
        row, seg, valid = packed_rows(plan, t, tab, TILE)
        offs = row * (H * D) + h * D
        q = load_rows(q_ptr, offs, valid, d, D)
        k = load_rows(k_ptr, offs, valid, d, D)
        v = load_rows(v_ptr, offs, valid, d, D)
        same = seg[:, None] == seg[None, :]
        # Step 2: scores in the log2 domain, block-diagonal mask.
        s = mm(q, tl.trans(k), DOT_PREC, BF16_EMU) * qk_scale
        s = tl.where(same, s, float("-inf"))
        # Step 3: softmax over the whole segment (all its keys are in the tile).
        m = tl.max(s, axis=1)
        p = tl.exp2(s - m[:, None])
        denom = tl.sum(p, axis=1)
        acc = mm(cast(p, v.dtype, BF16_EMU), finite_or_zero(v), DOT_PREC, BF16_EMU)
        o = acc / denom[:, None]
        # Step 4: a NaN/inf value row poisons its own segment only.
        o = tl.where(segment_any(nonfinite_rows(v), same)[:, None], float("nan"), o)
        tl.store(o_ptr + offs[:, None] + d[None, :], cast(o, o_ptr.dtype.element_ty, BF16_EMU),
                 mask=valid[:, None] & (d[None, :] < D))
        tl.store(lse_ptr + row * H + h, (m + tl.log2(denom)) * LN2, mask=valid)


@triton.autotune(configs=configs(), key=["D"])
@triton.jit
def _fwd_multi_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, plan, H, D, qk_scale,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                      DOT_PREC: tl.constexpr, BF16_EMU: tl.constexpr):
    n_work = tl.load(plan + H_MULTI) * H
    tab = tl.load(plan + H_MULTI_OFF)
    d = tl.arange(0, BLOCK_D)
    for w in range(tl.program_id(0), n_work, tl.num_programs(0)):
        # Step 1: the query block of this work item.
        item = tab + 3 * (w // H)
        h = w % H
        start = tl.load(plan + item)
        n = tl.load(plan + item + 1).to(tl.int32)
        qi = tl.load(plan + item + 2).to(tl.int32) * BLOCK_M + tl.arange(0, BLOCK_M)
        q_valid = qi < n
        q_offs = (start + qi) * (H * D) + h * D
        q = load_rows(q_ptr, q_offs, q_valid, d, D)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # Step 2: online softmax over the segment's key blocks.
        for j0 in range(0, n, BLOCK_N):
            kj = j0 + tl.arange(0, BLOCK_N)
            k_valid = kj < n
            kv_offs = (start + kj) * (H * D) + h * D
            k = load_rows(k_ptr, kv_offs, k_valid, d, D)
            v = load_rows(v_ptr, kv_offs, k_valid, d, D)
            s = mm(q, tl.trans(k), DOT_PREC, BF16_EMU) * qk_scale
            s = tl.where(k_valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + mm(cast(p, v.dtype, BF16_EMU), v, DOT_PREC, BF16_EMU)
            m_i = m_new
        # Step 3: normalise and store o and the natural-log lse.
        o = acc / l_i[:, None]
        tl.store(o_ptr + q_offs[:, None] + d[None, :], cast(o, o_ptr.dtype.element_ty, BF16_EMU),
                 mask=q_valid[:, None] & (d[None, :] < D))
        tl.store(lse_ptr + (start + qi) * H + h, (m_i + tl.log2(l_i)) * LN2, mask=q_valid)


def softmax_fwd(o, lse, q, k, v, plan, scale, allow_tf32=False, wrap=lambda kernel: kernel):
    """Write o (E, H, D) and lse (E, H) float32 for the rows named in ``plan``.

    ``plan`` must be built with ``max_tile=max_packed_tile(q.dtype, D)`` (the
    packed classes above it are not launched).

    ``wrap`` is ``torch.library.wrap_triton`` when called from a triton_op.
    """
    _, H, D = q.shape
    grid = (num_programs(q.device),)
    args = (q, k, v, o, lse, plan, H, D, float(scale) * LOG2E)
    meta = dict(BLOCK_D=block_d(D), DOT_PREC=dot_precision(q.dtype, allow_tf32),
                BF16_EMU=bf16_emulation(q.dtype))
    for c, tile in packed_classes(q.dtype, D):
        wrap(_fwd_packed_kernel)[grid](*args, CLASS=c, TILE=tile, **meta)
    wrap(_fwd_multi_kernel)[grid](*args, BLOCK_M=PLAN_BLOCK, **meta)


def default_scale(d: int, scale) -> float:
    """DESIGN §4: scale = D^-1/2 unless given."""
    return 1.0 / math.sqrt(d) if scale is None else float(scale)
