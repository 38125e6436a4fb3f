"""Backward Triton kernels of exact softmax attention over CSR segments.

With P = exp(scale * Q K^T - lse) recomputed from the saved log-sum-exp and
delta_i = sum_j P_ij dP_ij = sum_d dO_i * O_i:

  dV = P^T dO,   dP = dO V^T,   dS = P * (dP - delta),
  dQ = scale * dS K,   dK = scale * dS^T Q.

* ``_bwd_packed_kernel``: a packed tile holds whole segments, so one program
  computes all three gradients of its rows and writes them (no atomics,
  deterministic).  One work item is one (tile, head);
  ``packed_heads._bwd_heads_kernel`` does the same for several tiles and every
  head per work item (whole-row loads), when the config table says so.
* Segments longer than a tile take two passes (FA2 style), each writing its
  own rows once, so they are deterministic too:
  ``_bwd_dq_kernel`` per query block (loops over key blocks; also stores delta
  for the second pass) and then ``_bwd_dkdv_kernel`` per key block (loops over
  query blocks).

Every launch's config comes from the config table (configs.py) through :func:`bwd_spec`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nt_kernels.backends.triton.common import (H_MULTI, H_MULTI_OFF, LOG2E, LOG2E_C, LSE_UNALIGNED,
                                               Spec, block_d, cast, exact_launches, finite_or_zero, key_block, launch,
                                               load_rows, meta_args, mm, nonfinite_rows, packed_rows, packed_spec,
                                               segment_any, tile_table)
from nt_kernels.backends.triton.packed_heads import _bwd_heads_kernel
from nt_kernels.backends.triton.plan import PLAN_BLOCK


@triton.jit
def store_rows(ptr, offs, valid, d, D, x, BF16_EMU: tl.constexpr):
    """Store (rows x BLOCK_D), skipping padding columns and invalid rows."""
    tl.store(ptr + offs[:, None] + d[None, :], cast(x, ptr.dtype.element_ty, BF16_EMU),
             mask=valid[:, None] & (d[None, :] < D))


@triton.jit(do_not_specialize_on_alignment=LSE_UNALIGNED)
def _bwd_packed_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, dq_ptr, dk_ptr, dv_ptr,
                       plan, H, D: tl.constexpr, scale, qk_scale,
                       CLASS: tl.constexpr, TILE: tl.constexpr, BLOCK_D: tl.constexpr,
                       DOT_PREC: tl.constexpr, BF16_EMU: tl.constexpr):
    n_tiles, tab = tile_table(plan, CLASS)
    n_work = n_tiles * H
    d = tl.arange(0, BLOCK_D)
    for w in range(tl.program_id(0), n_work, tl.num_programs(0)):
        # Step 1: load the tile's rows (queries and keys are the same rows).
        t = w // H
        h = w % H
        row, seg, valid = packed_rows(plan, t, tab, TILE, CLASS)
        offs = row * (H * D) + h * D
        q = load_rows(q_ptr, offs, valid, d, D)
        k = load_rows(k_ptr, offs, valid, d, D)
        v = load_rows(v_ptr, offs, valid, d, D)
        do = load_rows(do_ptr, offs, valid, d, D)
        lse = tl.load(lse_ptr + row * H + h, mask=valid, other=0.0) * LOG2E_C
        same = seg[:, None] == seg[None, :]
        # Step 2: recompute P from lse, zero outside the block diagonal.
        s = mm(q, tl.trans(k), DOT_PREC, BF16_EMU) * qk_scale
        p = tl.where(same, tl.exp2(s - lse[:, None]), 0.0)
        # Step 3: dV = P^T dO and dS = P * (dP - delta), dP = dO V^T.  The whole
        # segment is in the tile, so delta = rowsum(P * dP) exactly (no O read).
        # Operands contracted across segments are made finite so that a zero
        # weight never multiplies another segment's NaN/inf.
        dv = mm(cast(tl.trans(p), do.dtype, BF16_EMU), finite_or_zero(do), DOT_PREC, BF16_EMU)
        dp = mm(do, tl.trans(v), DOT_PREC, BF16_EMU)
        pdp = tl.where(same, p * dp, 0.0)
        ds = tl.where(same, pdp - p * tl.sum(pdp, axis=1)[:, None], 0.0)  # a NaN delta stays in its segment
        # Step 4: dQ = scale dS K, dK = scale dS^T Q.
        dq = mm(cast(ds, k.dtype, BF16_EMU), finite_or_zero(k), DOT_PREC, BF16_EMU) * scale
        ds_t = cast(tl.trans(ds), q.dtype, BF16_EMU)
        dk = mm(ds_t, finite_or_zero(q), DOT_PREC, BF16_EMU) * scale
        # Step 5: a NaN/inf input row poisons the gradients of its own segment only.
        bad = nonfinite_rows(q) | nonfinite_rows(k) | nonfinite_rows(v) | nonfinite_rows(do)
        bad = segment_any(bad, same)[:, None]
        store_rows(dq_ptr, offs, valid, d, D, tl.where(bad, float("nan"), dq), BF16_EMU)
        store_rows(dk_ptr, offs, valid, d, D, tl.where(bad, float("nan"), dk), BF16_EMU)
        store_rows(dv_ptr, offs, valid, d, D, tl.where(bad, float("nan"), dv), BF16_EMU)


@triton.jit
def multi_block(plan, tab, w, H, BLOCK: tl.constexpr):
    """Segment start, size and block rows (local indices) of multi-tile item w // H."""
    item = tab + 3 * (w // H)
    start = tl.load(plan + item)
    n = tl.load(plan + item + 1).to(tl.int32)
    rows = tl.load(plan + item + 2).to(tl.int32) * BLOCK + tl.arange(0, BLOCK)
    return start, n, rows


@triton.jit
def _dq_key_block(q, do, lse, k_ptr, v_ptr, start, n, j0, h, H, D, d, qk_scale,
                  BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, BF16_EMU: tl.constexpr):
    """Key block j0 of a query block: its keys, P = exp2(S - lse) (0 past the segment) and dP = dO Vᵀ."""
    k, v, k_valid, s = key_block(q, k_ptr, v_ptr, start, n, j0, h, H, D, d, qk_scale, BLOCK_N, DOT_PREC, BF16_EMU)
    p = tl.where(k_valid[None, :], tl.exp2(s - lse[:, None]), 0.0)
    return k, p, mm(do, tl.trans(v), DOT_PREC, BF16_EMU)


@triton.jit(do_not_specialize_on_alignment=LSE_UNALIGNED)
def _bwd_dq_kernel(q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
                   plan, H, D: tl.constexpr, scale, qk_scale,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   DOT_PREC: tl.constexpr, BF16_EMU: tl.constexpr, DELTA_FROM_P: tl.constexpr):
    n_work = tl.load(plan + H_MULTI) * H
    tab = tl.load(plan + H_MULTI_OFF)
    d = tl.arange(0, BLOCK_D)
    for w in range(tl.program_id(0), n_work, tl.num_programs(0)):
        # Step 1: the query block, its lse and delta (stored for the dK/dV pass).
        h = w % H
        start, n, qi = multi_block(plan, tab, w, H, BLOCK_M)
        q_valid = qi < n
        q_offs = (start + qi) * (H * D) + h * D
        q = load_rows(q_ptr, q_offs, q_valid, d, D)
        do = load_rows(do_ptr, q_offs, q_valid, d, D)
        lse = tl.load(lse_ptr + (start + qi) * H + h, mask=q_valid, other=0.0) * LOG2E_C
        if DELTA_FROM_P:
            # delta = rowsum(P * dP) over every key block, in float32: what rowsum(dO * O) is before O is
            # rounded to its dtype (at D = 1 that rounding alone put dQ's bf16 error at 2x PyTorch's).
            delta = tl.zeros([BLOCK_M], tl.float32)
            for j0 in range(0, n, BLOCK_N):
                _, p, dp = _dq_key_block(q, do, lse, k_ptr, v_ptr, start, n, j0, h, H, D, d, qk_scale,
                                         BLOCK_N, DOT_PREC, BF16_EMU)
                delta += tl.sum(p * dp, axis=1)
        else:
            o = load_rows(o_ptr, q_offs, q_valid, d, D)
            delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
        tl.store(delta_ptr + (start + qi) * H + h, delta, mask=q_valid)
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # Step 2: dQ += dS K over the segment's key blocks, dS = P * (dP - delta).
        for j0 in range(0, n, BLOCK_N):
            k, p, dp = _dq_key_block(q, do, lse, k_ptr, v_ptr, start, n, j0, h, H, D, d, qk_scale,
                                     BLOCK_N, DOT_PREC, BF16_EMU)
            ds = p * (dp - delta[:, None])
            dq += mm(cast(ds, k.dtype, BF16_EMU), k, DOT_PREC, BF16_EMU)
        store_rows(dq_ptr, q_offs, q_valid, d, D, dq * scale, BF16_EMU)


@triton.jit(do_not_specialize_on_alignment=LSE_UNALIGNED)
def _bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
                     plan, H, D: tl.constexpr, scale, qk_scale,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     DOT_PREC: tl.constexpr, BF16_EMU: tl.constexpr):
    n_work = tl.load(plan + H_MULTI) * H
    tab = tl.load(plan + H_MULTI_OFF)
    d = tl.arange(0, BLOCK_D)
    for w in range(tl.program_id(0), n_work, tl.num_programs(0)):
        # Step 1: the key block of this work item.
        h = w % H
        start, n, kj = multi_block(plan, tab, w, H, BLOCK_N)
        k_valid = kj < n
        kv_offs = (start + kj) * (H * D) + h * D
        k = load_rows(k_ptr, kv_offs, k_valid, d, D)
        v = load_rows(v_ptr, kv_offs, k_valid, d, D)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        # Step 2: accumulate over the segment's query blocks, in transposed
        # form (keys along rows): P^T, dP^T = V dO^T, dS^T = P^T * (dP^T - delta).
        for i0 in range(0, n, BLOCK_M):
            qi = i0 + tl.arange(0, BLOCK_M)
            q_valid = qi < n
            q_offs = (start + qi) * (H * D) + h * D
            q = load_rows(q_ptr, q_offs, q_valid, d, D)
            do = load_rows(do_ptr, q_offs, q_valid, d, D)
            lse = tl.load(lse_ptr + (start + qi) * H + h, mask=q_valid, other=0.0) * LOG2E_C
            delta = tl.load(delta_ptr + (start + qi) * H + h, mask=q_valid, other=0.0)
            st = mm(k, tl.trans(q), DOT_PREC, BF16_EMU) * qk_scale
            pt = tl.where(q_valid[None, :], tl.exp2(st - lse[None, :]), 0.0)
            dv += mm(cast(pt, do.dtype, BF16_EMU), do, DOT_PREC, BF16_EMU)
            dpt = mm(v, tl.trans(do), DOT_PREC, BF16_EMU)
            dst = pt * (dpt - delta[None, :])
            dk += mm(cast(dst, q.dtype, BF16_EMU), q, DOT_PREC, BF16_EMU)
        store_rows(dk_ptr, kv_offs, k_valid, d, D, dk * scale, BF16_EMU)
        store_rows(dv_ptr, kv_offs, k_valid, d, D, dv, BF16_EMU)


def delta_from_p(dtype, head_dim: int) -> bool:
    """Whether the multi-tile dQ pass sums delta from P and dP (a second pass over the keys) instead of
    reading O: for half-precision O at head dim 1, where O's rounding decides dS = P (dP - delta).  Measured
    in the interpreter with the GPU's bf16 rounding (65-125-row segments, 6 seeds): dQ's error over
    PyTorch's bf16 composition was 1.13-2.02x at D = 1 from O, at most 1.14x at D = 2, 4, 8 and 16."""
    return dtype in (torch.bfloat16, torch.float16) and head_dim == 1


def bwd_spec(kernel: str, config: dict, dtype, heads: int, head_dim: int, cls: int = 0, tile: int = 0,
             allow_tf32: bool = False) -> Spec:
    """The launch of backward kernel ``kernel`` ("bwd_packed" for class ``cls`` of height
    ``tile``, "bwd_dq" or "bwd_dkdv") under ``config`` (configs.py)."""
    meta = meta_args(dtype, allow_tf32)
    if kernel == "bwd_packed":
        return packed_spec(_bwd_packed_kernel, _bwd_heads_kernel, kernel, config, dtype, heads, head_dim, cls, tile,
                           meta)
    blocks = {"bwd_dq": (_bwd_dq_kernel, dict(BLOCK_M=PLAN_BLOCK, BLOCK_N=config.get("BLOCK_N"),
                                              DELTA_FROM_P=delta_from_p(dtype, head_dim))),
              "bwd_dkdv": (_bwd_dkdv_kernel, dict(BLOCK_M=config.get("BLOCK_M"), BLOCK_N=PLAN_BLOCK))}
    if kernel not in blocks:
        raise ValueError(f"bwd_spec: unknown kernel {kernel!r}")
    fn, sizes = blocks[kernel]
    return Spec(fn, dict(meta, **sizes, H=heads, D=head_dim, BLOCK_D=block_d(head_dim)),
                config["num_warps"], config["num_stages"])


def bwd_launches(q, args: dict, allow_tf32: bool = False, work=None,
                 blocks: bool = False) -> list[tuple[str, Spec, tuple]]:
    """(kernel, spec, grid) of every backward launch (``common.exact_launches``): the packed classes (and
    the row blocks with ``blocks``), then the multi-tile dQ and dK/dV passes; only those with ``work``
    when it is given."""
    dtype, heads, head_dim = q.dtype, q.shape[1], q.shape[2]
    return exact_launches(
        q, work, "bwd_packed",
        lambda cfg, c, tile: bwd_spec("bwd_packed", cfg, dtype, heads, head_dim, c, tile, allow_tf32),
        {kernel: (lambda cfg, kernel=kernel: bwd_spec(kernel, cfg, dtype, heads, head_dim, allow_tf32=allow_tf32))
         for kernel in ("bwd_dq", "bwd_dkdv")}, args, blocks)


def softmax_bwd(dq, dk, dv, grad_o, q, k, v, o, lse, plan, scale, allow_tf32=False, work=None, memo=None,
                blocks=False):
    """Write dq, dk, dv (E, H, D) for the rows named in ``plan``.

    ``plan`` must be built with ``max_tile=max_packed_tile(q.dtype, D,
    shared_memory_per_block(q.device))`` (the packed classes above it are not
    launched).  Each kernel runs the config of the table (configs.py) for
    q's dtype, head dim and device; ``work``, ``memo`` and ``blocks`` as in
    ``softmax_fwd.softmax_fwd``.
    """
    E, H, D = q.shape
    scale = float(scale)
    common = dict(q_ptr=q, k_ptr=k, v_ptr=v, do_ptr=grad_o, lse_ptr=lse, plan=plan, scale=scale,
                  qk_scale=scale * LOG2E)
    # Multi-tile segments: dQ pass (writes delta), then the dK/dV pass.
    delta = torch.empty((E, H), dtype=torch.float32, device=q.device)
    args = {"bwd_packed": dict(common, dq_ptr=dq, dk_ptr=dk, dv_ptr=dv),
            "bwd_dq": dict(common, o_ptr=o, delta_ptr=delta, dq_ptr=dq),
            "bwd_dkdv": dict(common, delta_ptr=delta, dk_ptr=dk, dv_ptr=dv)}
    key = ("bwd", q.dtype, H, D, q.device, allow_tf32, work, blocks)
    build = lambda: bwd_launches(q, args, allow_tf32, work, blocks)  # noqa: E731
    for kernel, spec, grid in build() if memo is None else memo(key, build):
        launch(spec, grid, **args[kernel])
