"""Compile specs of the fused NT layer's Triton kernels, for ahead-of-time checks without a GPU.

:func:`compile_specs` lists, for one operand dtype, every kernel launch
shape the launchers produce at their largest tiles: (name, kernel, argument
types, launch constexprs).  With a config of ``kernel.configs`` it is what
``triton.compile(ASTSource(kernel.fn, signature, constexprs))`` needs, the way
scripts/triton_check.py compiles the exact kernels.  tests/test_ntconv_triton.py
checks that every spec names each kernel argument exactly once.
"""
from __future__ import annotations

from typing import NamedTuple

from nt_kernels.backends.triton import ntconv_gemm, ntconv_grad, ntconv_reduce

__all__ = ["Spec", "compile_specs"]


class Spec(NamedTuple):
    name: str
    kernel: object        # the autotuned kernel: .fn is the JITFunction, .configs its configs
    types: dict           # runtime argument -> Triton type string ("*bf16", "i32", ...)
    constexprs: dict      # launch constexprs besides the config's


def compile_specs(dtype: str) -> list[Spec]:
    """Specs for operand type ``dtype`` ("fp32", "bf16" or "fp16"): parameters, q/k/v and ``out`` in it."""
    t = "*" + dtype
    base = dict(DOT_PREC="ieee", BF16_EMU=False)
    prologue = dict(centre=t, recv_term=t, edge_attr=t, w_edge=t, w_qkv=t, b_qkv=t, receiver="*i64", perm="*i64",
                    seg_of_row="*i64", qkv=t, z_out="*fp32", jac_out="*fp32", row0="i32", R="i32", C="i32",
                    F="i32", seed_word="i64", threshold="i32", drop_scale="fp32")
    gemm = dict(a=t, w=t, bias=t, mul="*fp32", out="*fp32", R="i32", K="i32", N="i32", A_SPLIT="i32",
                A_PART="i64", A_ROW="i32", W_K="i32", W_N="i32")
    grad = dict(y="*fp32", g_out=t, out=t, stats="*fp32", recv_rowptr="*i64", gate="*fp32", seg_sum="*fp32",
                seg_of_row="*i64", receiver="*i64", dy="*fp32", wa="*fp32", row0="i32", seg0="i32", R="i32",
                H="i32", D="i32")
    receive = dict(x="*fp32", gate="*fp32", groups="*i32", rrow="*i32", acc="*fp32", run_max="*fp32",
                   run_sum="*fp32", count="*fp32", out_type=t, group0="i32", num_groups="i32", H="i32", D="i32",
                   ROW="i32", HEAD_STRIDE="i32", VALUE_OFF="i32")
    gemm_k = dict(base, BLOCK_N=128, BLOCK_K=ntconv_gemm.BLOCK_K)
    specs = [Spec(f"prologue{'_bwd' if store else ''}", ntconv_gemm._prologue_kernel, prologue,
                  dict(base, BLOCK_N=256, BLOCK_K=ntconv_gemm.BLOCK_K, BLOCK_F=ntconv_gemm.BLOCK_F, HAS_EDGE=True,
                       DROPOUT=True, STORE_Z=store)) for store in (False, True)]
    specs += [Spec("gemm_y", ntconv_gemm._rows_gemm_kernel, gemm, dict(gemm_k, HAS_BIAS=True, HAS_MUL=False)),
              Spec("gemm_do", ntconv_gemm._rows_gemm_kernel, dict(gemm, a="*fp32", out=t),
                   dict(gemm_k, HAS_BIAS=False, HAS_MUL=False)),
              Spec("gemm_du", ntconv_gemm._rows_gemm_kernel, gemm, dict(gemm_k, HAS_BIAS=False, HAS_MUL=True))]
    for heads, dim in ((16, 32), (1, 256)):
        be, bh, bd = ntconv_reduce.tile_shape(heads, dim)
        specs.append(Spec(f"gate H{heads} D{dim}", ntconv_reduce._gate_kernel,
                          dict(y="*fp32", gate="*fp32", R="i32", H="i32", D="i32", C_OUT="i32"),
                          dict(SIGMOID=True, BLOCK_E=be, BLOCK_H=bh, BLOCK_D=bd)))
        be, bh, bd = ntconv_reduce.tile_shape(heads, dim, ntconv_grad.GRAD_TILE_ELEMENTS)
        specs += [Spec(f"message_grad{mode} H{heads} D{dim}", ntconv_grad._message_grad_kernel, grad,
                       dict(MODE=mode, BLOCK_E=be, BLOCK_H=bh, BLOCK_D=bd, BF16_EMU=False)) for mode in range(7)]
    segments = ntconv_reduce.SEGMENTS_PER_PROGRAM
    specs += [Spec("segment_softmax", ntconv_reduce._segment_softmax_kernel,
                   dict(gate="*fp32", rowptr="*i64", num_segments="i32", H="i32"),
                   dict(BLOCK_S=segments, BLOCK_E=16, BLOCK_H=16)),
              Spec("segment_sum", ntconv_reduce._segment_sum_kernel,
                   dict(x="*fp32", rowptr="*i64", out="*fp32", num_segments="i32", W="i32"),
                   dict(BLOCK_S=segments, BLOCK_E=1, BLOCK_W=256))]
    specs += [Spec(f"receive{mode}", ntconv_reduce._receive_kernel, receive,
                   dict(MODE=mode, APPLY_GELU=True, BLOCK_G=4, BLOCK_E=2, BLOCK_C=512, BF16_EMU=False))
              for mode in range(4)]
    return specs
