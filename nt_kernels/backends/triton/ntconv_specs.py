"""Compile specs of the fused NT layer's Triton kernels, for ahead-of-time checks without a GPU.

:func:`compile_specs` lists, for one operand dtype, every kernel launch
shape the launchers produce at their largest tiles (and, for the kernels
whose tiles come from the plan, at the layer shapes below): (name, kernel,
argument types, launch constexprs, launch options).  :func:`launches` turns
a spec into what ``triton.compile(ASTSource(fn, signature, constexprs),
options=...)`` needs, once per autotuning config (autotuned kernels) or once
with the plan's options (the others); scripts/triton_check.py compiles them
with ``--fused``.  tests/test_ntconv_triton.py checks that every spec names
each kernel argument exactly once.
"""
from __future__ import annotations

import itertools
from typing import NamedTuple

import torch

from nt_kernels.backends.triton import (ntconv_gemm, ntconv_grad, ntconv_igrad, ntconv_plan, ntconv_project,
                                        ntconv_reduce, ntconv_stream, ntconv_wgrad)
from nt_kernels.backends.triton.ntconv_plan import prologue_tiles, weight_grad_tiles

__all__ = ["LAYER_SHAPES", "Spec", "compile_specs", "launches"]

# (C, F, C_out) of the layer shapes whose plan-chosen tiles are compiled: narrow, the tolokers preset's
# C = 60 (gated: C_out = 2C), C = 64 with wide edge features, C = 128, and the widest tiles (C >= 256).
LAYER_SHAPES = ((16, 3, 16), (60, 0, 120), (64, 32, 128), (128, 16, 128), (256, 8, 512))
TORCH_TYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class Spec(NamedTuple):
    name: str
    kernel: object        # an autotuned kernel (.fn the JITFunction, .configs its configs) or a JITFunction
    types: dict           # runtime argument -> Triton type string ("*bf16", "i32", ...)
    constexprs: dict      # launch constexprs besides the config's
    options: dict | None = None  # num_warps / num_stages of a kernel launched without autotuning
    min_arch: int = 0     # launched only on this compute capability or newer
    streaming: bool = False  # a per-row streaming kernel: gated at <= 96 registers, >= 4 CTAs of 4 warps (sm_90)


def launches(spec: Spec) -> list[tuple[object, dict, dict]]:
    """(JITFunction, constexprs, compile options) of every launch variant of ``spec``: one per
    autotuning config, or the spec's own options for a kernel whose tiles come from the plan."""
    if spec.options is not None:
        return [(spec.kernel, dict(spec.constexprs), dict(spec.options))]
    return [(spec.kernel.fn, dict(spec.constexprs, **config.kwargs),
             {"num_warps": config.num_warps, "num_stages": config.num_stages}) for config in spec.kernel.configs]


def _plan_specs(dtype: str, t: str, base: dict) -> list[Spec]:
    """The prologue and the weight-gradient kernels at the tiles the plan picks for LAYER_SHAPES."""
    prologue = dict(centre=t, recv_term=t, edge_attr=t, w_edge=t, w_qkv=t, b_qkv=t, receiver="*i64", perm="*i64",
                    seg_of_row="*i64", qkv=t, z_out=t, jac_out=t, row0="i32", R="i32", PART="i32", seed_word="i32",
                    seed_ptr="*i64", threshold="i32", drop_scale="fp32")
    wgrad = dict(a=t, b=t, index="*i64", partials="*fp32", R="i32", row0="i32")
    dot = dict(base, DOT_DTYPE=ntconv_wgrad.TL_DTYPES[getattr(torch, TORCH_TYPES[dtype])])
    specs = []
    for c, f, c_out in LAYER_SHAPES:
        tiles = prologue_tiles(c, f, 4 if dtype == "fp32" else 2)
        specs += [Spec(f"prologue{'_bwd' if store else ''} C{c} F{f}", ntconv_gemm._prologue_kernel, prologue,
                       dict(base, C=c, F=f, BLOCK_R=tiles.block_r, BLOCK_C=tiles.block_c, BLOCK_N=tiles.block_n,
                            BLOCK_F=tiles.block_f, HAS_EDGE=f > 0, DROPOUT=True, SEED_ON_DEVICE=False, STORE_Z=store),
                       dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages))
                  for store in (False, True)]
        # (name, parts, rows of a part, N, bias, gather): A = dqkv, B = z; A = dy, B = o; A = du, B = edge_attr[perm]
        uses = [("w_qkv", 3, c, c, True, False), ("w_out", 1, c_out, c, True, False), ("w_edge", 1, c, f, False, True)]
        for name, parts, m, n, bias, gather in uses:
            if n == 0:
                continue
            w = weight_grad_tiles(1 << 20, m, n, 4 if dtype == "fp32" else 2)
            specs.append(Spec(f"weight_grad {name} C{c} F{f}", ntconv_wgrad._weight_grad_kernel, wgrad,
                              dict(dot, M_PART=m, N=n, PARTS=parts, A_ROW=m, B_ROW=n, SPLIT_ROWS=w.split_rows,
                                   BLOCK_R=w.block_r, BLOCK_M=w.block_m, BLOCK_N=w.block_n, HAS_BIAS=bias,
                                   GATHER=gather, PART_ALIGN=ntconv_plan.PART_ROWS if parts > 1 else 1),
                              dict(num_warps=w.num_warps, num_stages=ntconv_wgrad.NUM_STAGES)))
    if dtype != "fp32":  # the one-pass input gradients (sm_90, 16-bit parameters) at the layer shapes they serve
        igrad = dict(centre=t, recv_term=t, edge_attr=t, w_edge=t, w_qkv=t, receiver="*i64", perm="*i64",
                     seg_of_row="*i64", dqkv=t, du=t, partials="*fp32", row0="i32", R="i32", PART="i32",
                     seed_word="i32", seed_ptr="*i64", threshold="i32", drop_scale="fp32")
        specs += [Spec(f"input_grad_split C{c} F{f}", ntconv_igrad._input_grad_split_kernel, igrad,
                       dict(base, C=c, F=f, SPLIT_ROWS=ntconv_plan.split_k_rows(1 << 20),
                            BLOCK_R=ntconv_gemm.DU_ROWS, BLOCK_C=ntconv_gemm.block_n(c, ntconv_gemm.DU_MAX_CHANNELS),
                            BLOCK_F=prologue_tiles(c, f, 2).block_f, HAS_EDGE=f > 0, DROPOUT=True, SEED_ON_DEVICE=False),
                       dict(num_warps=ntconv_igrad.INPUT_WARPS, num_stages=1), ntconv_igrad.INPUT_MIN_ARCH)
                  for c, f, _ in LAYER_SHAPES if ntconv_igrad.input_split_ok(c, 2, ntconv_igrad.INPUT_MIN_ARCH)]
    for c in sorted({c for c, _, _ in LAYER_SHAPES if ntconv_gemm.fused_centre(c)}):
        width = ntconv_gemm.block_n(c, ntconv_gemm.DU_MAX_CHANNELS)
        specs += [Spec(f"du{' + d_centre' if centre else ''} C{c}", ntconv_gemm._du_kernel,
                       dict(dqkv=t, w_qkv=t, jac=t, seg_of_row="*i64", rowptr="*i64", du=t, d_centre="*fp32",
                            part="*fp32", R="i32", PART="i32", seg0="i32"),
                       dict(base, C=c, BLOCK_R=ntconv_gemm.DU_ROWS, BLOCK_C=width, BLOCK_K=ntconv_gemm.BLOCK_K,
                            CENTRE=centre),
                       dict(num_warps=ntconv_gemm.du_warps(4 if dtype == "fp32" else 2), num_stages=2))
                  for centre in (False, True)]
        specs.append(Spec(f"centre_fixup C{c}", ntconv_gemm._centre_fixup_kernel,
                          dict(rowptr="*i64", part="*fp32", d_centre="*fp32"),
                          dict(C=c, BLOCK_R=ntconv_gemm.DU_ROWS, BLOCK_T=ntconv_gemm.FIXUP_TILES, BLOCK_C=width),
                          dict(num_warps=4, num_stages=1)))
    if dtype != "fp32":  # the streaming design (16-bit parameters, every architecture)
        specs += _stream_input_specs(t, base)
    specs += [Spec(f"combine{' bias' if bias else ''}", ntconv_wgrad._combine_kernel,
                   dict(partials="*fp32", w_acc="*fp32", b_acc="*fp32", S="i32", M="i32", N="i32"),
                   dict(HAS_BIAS=bias, BLOCK_S=ntconv_wgrad.COMBINE_SPLITS, BLOCK=ntconv_wgrad.COMBINE_BLOCK),
                   dict(num_warps=4, num_stages=2)) for bias in (False, True)]
    return specs


# C of the streaming input gradients (no edge features: ntconv_stream.du_stream_ok): narrow, tolokers, widest
STREAM_INPUT_CHANNELS = (16, 60, 64)


def _stream_input_specs(t: str, base: dict) -> list[Spec]:
    """The streaming input gradients (ntconv_stream._du_stream_kernel, 16-bit parameters, every architecture)."""
    types = dict(centre=t, recv_term=t, w_qkv=t, receiver="*i64", seg_of_row="*i64", dqkv=t, du=t, z_out=t,
                 row0="i32", R="i32", PART="i32", seed_word="i32", seed_ptr="*i64", threshold="i32", drop_scale="fp32")
    rows = ntconv_stream.DU_STREAM_ROWS
    return [Spec(f"du_stream C{c}", ntconv_stream._du_stream_kernel, types,
                 dict(base, C=c, TILES=ntconv_stream.STREAM_ROWS // rows, BLOCK_R=rows,
                      BLOCK_C=ntconv_gemm.block_n(c, ntconv_gemm.DU_MAX_CHANNELS), DROPOUT=True, SEED_ON_DEVICE=False),
                 dict(num_warps=ntconv_stream.STREAM_WARPS, num_stages=ntconv_stream.DU_STAGES,
                      maxnreg=ntconv_stream.STREAM_MAX_REGISTERS), streaming=True)
            for c in STREAM_INPUT_CHANNELS]


# (heads, dims) of the streaming message gradient and projection: the tolokers preset, the widest rows (C = 64) in
# heads of 16 dims and of 8 (padded to 16)
STREAM_HEADS = ((2, 30), (4, 16), (8, 8))


def _stream_message_specs(t: str, base: dict) -> list[Spec]:
    """The streaming message gradient in each mode it serves and the forward's projection (plain and gated),
    every dtype and architecture (ntconv_stream.py)."""
    dy_types = dict(o=t, g_out=t, out=t, stats="*fp32", recv_rowptr="*i64", receiver="*i64", w_out=t, b_out=t, dy=t,
                    do=t, row0="i32", R="i32", heads="i32")
    project_types = dict(o=t, w_out=t, b_out=t, y=t, gate="*fp32", R="i32", heads="i32")
    options = dict(num_warps=ntconv_stream.STREAM_WARPS, num_stages=ntconv_stream.MESSAGE_STAGES,
                   maxnreg=ntconv_stream.STREAM_MAX_REGISTERS)
    specs = []
    for heads, dim in STREAM_HEADS:
        block_e, block_d = ntconv_stream.stream_tiles(dim)
        tiles = dict(TILES=ntconv_stream.STREAM_ROWS // block_e, BLOCK_E=block_e, BLOCK_D=block_d)
        specs += [Spec(f"dy_stream{mode} H{heads} D{dim}", ntconv_stream._dy_stream_kernel, dy_types,
                       dict(base, **tiles, H=heads, D=dim, MODE=mode,
                            BLOCK_C=ntconv_stream.stream_width(heads, dim, mode, 2)), options, streaming=True)
                  for mode in ntconv_stream.STREAM_MODES]
        specs += [Spec(f"project_stream{' gated' if gated else ''} H{heads} D{dim}",
                       ntconv_stream._project_stream_kernel, project_types,
                       dict(base, **tiles, H=heads, D=dim, GATED=gated, SIGMOID=gated,
                            BLOCK_C=ntconv_stream.stream_width(heads, dim, ntconv_grad.GRAD_SUM, 2)), options,
                       streaming=True) for gated in (False, True)]
    return specs


def compile_specs(dtype: str) -> list[Spec]:
    """Specs for operand type ``dtype`` ("fp32", "bf16" or "fp16"): parameters, q/k/v and ``out`` in it."""
    t = "*" + dtype
    base = dict(DOT_PREC="ieee", BF16_EMU=False)
    gemm = dict(a=t, w=t, bias=t, mul=t, out=t, R="i32", A_PART="i32")
    grad = dict(y=t, g_out=t, out=t, stats="*fp32", keys="*fp32", recv_rowptr="*i64", gate="*fp32", seg_sum="*fp32",
                seg_of_row="*i64", receiver="*i64", w_out=t, dy=t, do=t, wa="*fp32", row0="i32", seg0="i32", R="i32")
    gemm_k = dict(base, BLOCK_K=ntconv_gemm.BLOCK_K)
    specs = _plan_specs(dtype, t, base)
    # The row GEMM's four uses at the tolokers preset (C = 60, gated: C_out = 120) and d_edge at C = 64, F = 32,
    # with the sizes and strides the op passes (ntconv_gemm.gemm_shape).
    for use, (channels, out_channels, edge_dim) in {"y": (60, 120, 0), "do": (60, 120, 0), "du": (60, 0, 0),
                                                    "d_edge": (64, 0, 32)}.items():
        shape = ntconv_gemm.gemm_shape(use, channels, out_channels, edge_dim)
        specs.append(Spec(f"gemm_{use}", ntconv_gemm._rows_gemm_kernel, gemm,
                          dict(gemm_k, **{key.upper(): value for key, value in shape.items()},
                               BLOCK_N=ntconv_gemm.block_n(shape["n"], 128), HAS_BIAS=use == "y", HAS_MUL=use == "du")))
    for heads, dim in ((16, 32), (1, 256)):
        be, bh, bd = ntconv_reduce.tile_shape(heads, dim)
        specs.append(Spec(f"gate H{heads} D{dim}", ntconv_reduce._gate_kernel,
                          dict(y=t, gate="*fp32", R="i32", H="i32", D="i32", C_OUT="i32"),
                          dict(SIGMOID=True, BLOCK_E=be, BLOCK_H=bh, BLOCK_D=bd), dict(num_warps=4, num_stages=1)))
    # The message gradient at the tolokers preset's heads (do fused) and at two wide layers (dy only).
    size = 4 if dtype == "fp32" else 2
    for heads, dim in ((2, 30), (16, 32), (1, 256)):
        g = ntconv_grad.grad_tiles(heads, dim)
        specs += [Spec(f"message_grad{mode} H{heads} D{dim}", ntconv_grad._message_grad_kernel, grad,
                       dict(base, H=heads, D=dim, MODE=mode, FUSE_DO=g.fuse_do and mode != 5, BLOCK_E=g.block_e,
                            BLOCK_H=g.block_h, BLOCK_D=g.block_d, BLOCK_N=ntconv_grad.DO_BLOCK_N),
                       dict(num_warps=g.num_warps, num_stages=1)) for mode in range(7)]
        split = dict(o=t, g_out=t, out=t, stats="*fp32", recv_rowptr="*i64", receiver="*i64", w_out=t, b_out=t, do=t,
                     partials="*fp32", row0="i32", R="i32")
        specs += [Spec(f"message_grad_split{mode} H{heads} D{dim}", ntconv_grad._message_grad_split_kernel, split,
                       dict(base, H=heads, D=dim, MODE=mode, SPLIT_ROWS=ntconv_plan.split_k_rows(1 << 20),
                            BLOCK_E=g.block_e, BLOCK_H=g.block_h, BLOCK_D=g.block_d,
                            BLOCK_C=ntconv_grad.split_width(heads, dim, mode, size, ntconv_grad.SPLIT_MIN_ARCH)),
                       dict(num_warps=ntconv_grad.SPLIT_WARPS, num_stages=1), ntconv_grad.SPLIT_MIN_ARCH)
                  for mode in ntconv_grad.SPLIT_MODES
                  if ntconv_grad.split_width(heads, dim, mode, size, ntconv_grad.SPLIT_MIN_ARCH)]
        project = dict(o=t, w_out=t, b_out=t, y=t, gate="*fp32", R="i32")
        specs += [Spec(f"project{' gated' if gated else ''} H{heads} D{dim}", ntconv_project._project_kernel, project,
                       dict(base, H=heads, D=dim, GATED=gated, SIGMOID=gated,
                            SPLIT_ROWS=ntconv_plan.split_k_rows(1 << 20), BLOCK_E=g.block_e, BLOCK_H=g.block_h,
                            BLOCK_D=g.block_d, BLOCK_C=ntconv_grad.split_width(heads, dim, mode, size,
                                                                               ntconv_grad.SPLIT_MIN_ARCH)),
                       dict(num_warps=ntconv_grad.SPLIT_WARPS, num_stages=1), ntconv_grad.SPLIT_MIN_ARCH)
                  for gated, mode in ((False, ntconv_grad.GRAD_SUM), (True, ntconv_grad.GRAD_GATED_SUM))
                  if ntconv_grad.split_width(heads, dim, mode, size, ntconv_grad.SPLIT_MIN_ARCH)]
    if dtype != "fp32":
        specs += _stream_message_specs(t, base)
    return specs + _reduction_specs(t, all_modes=dtype == "fp32")


# (name, mode, channels, APPLY_GELU, GATHER) of the segmented reductions the op runs: the forward's
# receiver reduction of GELU(y) in every mode (tolokers' C = 60 and the widest tile, C = 256), the backward's
# d_receiver_term (gathered) and d_centre (direct) sums of du, and the centre softmax's log-sum-exp over the
# gates (C = H: 2 and 16).
REDUCTIONS = ([(f"receive{m} C{c}", m, c, True, True) for m in range(4) for c in (60, 256)]
              + [(f"d_receiver C{c}", 0, c, False, True) for c in (60, 256)]
              + [(f"d_centre C{c}", 0, c, False, False) for c in (60, 256)]
              + [(f"lse H{h}", 4, h, False, False) for h in (2, 16)])
# The tolokers layer's reductions, also compiled pipelined (NT_KERNELS_NTCONV_REDUCE=pipe; the softmax mode
# never is: ntconv_reduce.PIPE_MAX_CHANNELS).
PIPE_CHANNELS = (60, 2)


def _reduction_specs(t: str, all_modes: bool) -> list[Spec]:
    """The reduce kernel (every item class in one launch) for every use in REDUCTIONS, the merge
    kernel in every mode (0 and 1 share their code: mode 0 only), the centre softmax's normalisation.
    The reductions of per-row values (y, du) read them in the parameters' dtype, so they are compiled
    for every operand dtype; the log-sum-exp of the (fp32) gates, the merge (fp32 partial states, except
    the max mode's output type) and the normalisation read fp32, so for other operand dtypes
    (``all_modes`` False) only their max mode and the normalisation are compiled again (so that every
    dtype lists every kernel)."""
    reduce_types = dict(x=t, gate="*fp32", items="*i32", bounds="*i64", rrow="*i32", acc="*fp32", run_max="*fp32",
                        run_sum="*fp32", count="*fp32", part="*fp32", out_type=t, C="i32", H="i32", D="i32",
                        ROW="i32", KEY_OFF="i32", PLANE="i32")
    merge_types = dict(splits="*i32", part="*fp32", acc="*fp32", run_max="*fp32", run_sum="*fp32", count="*fp32",
                       split0="i32", C="i32", KEY_OFF="i32", PLANE="i32")
    specs = []
    for (name, mode, channels, gelu, gather), pipe in itertools.product(REDUCTIONS, (False, True)):
        if (mode == 4 and not all_modes) or (pipe and (channels not in PIPE_CHANNELS or mode == 2)):
            continue
        types = dict(reduce_types, x="*fp32") if mode == 4 else reduce_types
        block_c, rows, state_items = ntconv_plan.reduce_launch(channels)
        tiles = ntconv_plan.reduce_tiles(channels, 1)
        specs.append(Spec(f"reduce {name}" + (" pipe" if pipe else ""), ntconv_reduce._reduce_kernel, types,
                          dict(MODE=mode, APPLY_GELU=gelu, GATHER=gather, CLASSES=ntconv_plan.REDUCE_CLASSES,
                               ROWS=rows, STATE_ITEMS=state_items, BLOCK_C=block_c, BF16_EMU=False, PIPE=pipe),
                          dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)))
    merges = [(m, c) for m in (0, 2, 3) for c in (60, 256) if all_modes or m == 3] + ([(4, 16)] if all_modes else [])
    for mode, channels in merges:
        block_p, block_c = ntconv_plan.merge_tiles(channels)
        specs.append(Spec(f"merge{mode} C{channels}", ntconv_reduce._merge_kernel, merge_types,
                          dict(MODE=mode, BLOCK_P=block_p, BLOCK_C=block_c), dict(num_warps=4, num_stages=1)))
    specs += [Spec(f"normalize H{h}", ntconv_reduce._normalize_kernel,
                   dict(gate="*fp32", seg_of_row="*i64", run_max="*fp32", run_sum="*fp32", seg0="i32", R="i32",
                        H="i32"),
                   dict(zip(("BLOCK_R", "BLOCK_H"), ntconv_plan.normalize_tiles(h))), dict(num_warps=4, num_stages=1))
              for h in (2, 16)]
    return specs
