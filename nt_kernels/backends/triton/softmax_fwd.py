"""Forward Triton kernels of exact softmax attention over CSR segments.

Packed q, k, v, o are (E, H, D) contiguous; a program handles one (tile, head)
work item at a time and loads (rows x D) slices, each row a contiguous run of
D elements.  Every kernel is persistent: a fixed grid walks the work list of
the plan (see plan.py), whose lengths live on the device.

* ``_fwd_packed_kernel``: one tile of TILE rows holds whole segments of equal
  size n; scores are masked block-diagonally (``row // n == col // n``) and the
  softmax is done in one pass since all keys of a row are in the tile.  One
  work item is one (tile, head).
* ``packed_heads._fwd_heads_kernel``: the same packed tiles, several tiles and
  every head per work item (whole-row loads; the small-segment bandwidth path).
* ``_fwd_multi_kernel``: one query block of a segment longer than a tile,
  online softmax over the segment's key blocks.

All store o and the float32 log-sum-exp (natural log, scaled scores).  Which
packed kernel runs and every launch's config come from the config table
(configs.py) through :func:`fwd_spec`.  The head dim D is a constexpr here and
in the backward (H is not): with D = 30, a runtime D left every q / k / v / o
access a 2-byte load or store with its own address (D not a multiple of 16,
so no alignment known); a constexpr D makes row offsets even, so they pair
into 4-byte accesses (ptxas, sm_90, bf16: half the global load instructions,
and 152 -> 92 registers for the multi-tile forward).
"""
from __future__ import annotations

import triton
import triton.language as tl

from nt_kernels.backends.triton.common import (H_MULTI, H_MULTI_OFF, LN2, LOG2E, LSE_UNALIGNED,
                                               Spec, block_d, cast, exact_launches, finite_or_zero, key_block, launch,
                                               load_rows, meta_args, mm, nonfinite_rows, packed_rows, packed_spec,
                                               segment_any, tile_table)
from nt_kernels.backends.triton.packed_heads import _fwd_heads_kernel
from nt_kernels.backends.triton.plan import PLAN_BLOCK


@triton.jit(do_not_specialize_on_alignment=LSE_UNALIGNED)
def _fwd_packed_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, plan, H, D: tl.constexpr, qk_scale,
                       CLASS: tl.constexpr, TILE: tl.constexpr, BLOCK_D: tl.constexpr,
                       DOT_PREC: tl.constexpr, BF16_EMU: tl.constexpr):
    n_tiles, tab = tile_table(plan, CLASS)
    n_work = n_tiles * H
    d = tl.arange(0, BLOCK_D)
    for w in range(tl.program_id(0), n_work, tl.num_programs(0)):
        # Step 1: tile rows (heads innermost in the work index, so neighbouring
        # programs read neighbouring D-slices of the same rows).
        t = w // H
        h = w % H
        row, seg, valid = packed_rows(plan, t, tab, TILE, CLASS)
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


@triton.jit(do_not_specialize_on_alignment=LSE_UNALIGNED)
def _fwd_multi_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, plan, H, D: tl.constexpr, qk_scale,
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
            k, v, k_valid, s = key_block(q, k_ptr, v_ptr, start, n, j0, h, H, D, d, qk_scale, BLOCK_N, DOT_PREC,
                                         BF16_EMU)
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


def fwd_spec(kernel: str, config: dict, dtype, heads: int, head_dim: int, cls: int = 0, tile: int = 0,
             allow_tf32: bool = False) -> Spec:
    """The launch of forward kernel ``kernel`` ("fwd_packed" for class ``cls`` of height ``tile``,
    or "fwd_multi") under ``config`` (configs.py)."""
    meta = meta_args(dtype, allow_tf32)
    if kernel == "fwd_packed":
        return packed_spec(_fwd_packed_kernel, _fwd_heads_kernel, kernel, config, dtype, heads, head_dim, cls, tile,
                           meta)
    if kernel != "fwd_multi":
        raise ValueError(f"fwd_spec: unknown kernel {kernel!r}")
    return Spec(_fwd_multi_kernel, dict(meta, H=heads, D=head_dim, BLOCK_M=PLAN_BLOCK, BLOCK_N=config["BLOCK_N"],
                                        BLOCK_D=block_d(head_dim)), config["num_warps"], config["num_stages"])


def fwd_launches(q, tensors: dict, allow_tf32: bool = False, work=None,
                 blocks: bool = False) -> list[tuple[str, Spec, tuple]]:
    """(kernel, spec, grid) of every forward launch (``common.exact_launches``): each packed class (and
    the row blocks with ``blocks``), then the multi-tile kernel; only those with ``work`` when it is given."""
    dtype, heads, head_dim = q.dtype, q.shape[1], q.shape[2]
    return exact_launches(
        q, work, "fwd_packed",
        lambda cfg, c, tile: fwd_spec("fwd_packed", cfg, dtype, heads, head_dim, c, tile, allow_tf32),
        {"fwd_multi": lambda cfg: fwd_spec("fwd_multi", cfg, dtype, heads, head_dim, allow_tf32=allow_tf32)},
        {"fwd_packed": tensors, "fwd_multi": tensors}, blocks)


def softmax_fwd(o, lse, q, k, v, plan, scale, allow_tf32=False, work=None, memo=None, blocks=False):
    """Write o (E, H, D) and lse (E, H) float32 for the rows named in ``plan``.

    ``plan`` must be built with ``max_tile=max_packed_tile(q.dtype, D,
    shared_memory_per_block(q.device))`` (the packed classes above it are not
    launched).  Each kernel runs the config of the table (configs.py) for
    q's dtype, head dim and device.  ``work`` (the plan's work counts, when the
    host knows them) skips the kernels without work; ``memo(key, build)`` (a
    fused plan's ``Plan.memo``) keeps the launch list for later calls; ``blocks``: the plan has row
    blocks (``build_plan(..., blocks=True)``), which run too.
    """
    tensors = dict(q_ptr=q, k_ptr=k, v_ptr=v, o_ptr=o, lse_ptr=lse, plan=plan, qk_scale=float(scale) * LOG2E)
    key = ("fwd", q.dtype, q.shape[1], q.shape[2], q.device, allow_tf32, work, blocks)
    build = lambda: fwd_launches(q, tensors, allow_tf32, work, blocks)  # noqa: E731
    for _, spec, grid in build() if memo is None else memo(key, build):
        launch(spec, grid, **tensors)
