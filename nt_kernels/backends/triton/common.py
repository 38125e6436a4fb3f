"""Helpers shared by the forward and backward Triton kernels.

Host side: the interpreter switch, launch specs (kernel, keyword arguments,
warps, stages) and how a packed-tile config picks its kernel, persistent grid
size, dot precision, the bf16 emulation under the interpreter, the packed tile
classes a launch runs and the padded head dim.  Device side (``@triton.jit``):
reading a packed tile's rows from the plan, the matrix product and casts
(emulated for bf16 under the interpreter), row loads and the non-finite row
masks that keep a NaN/inf inside its own segment.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nt_kernels.backends.triton import configs as config_table
from nt_kernels.backends.triton import plan as plan_layout
from nt_kernels.backends.triton.plan import (SM90_SHARED_MEMORY, TILE_HEIGHTS, max_packed_tile,
                                             shared_memory_per_block)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)
LOG2E_C = tl.constexpr(LOG2E)
H_TILES = tl.constexpr(plan_layout.H_TILES)
H_TILE_OFF = tl.constexpr(plan_layout.H_TILE_OFF)
H_MULTI = tl.constexpr(plan_layout.H_MULTI)
H_MULTI_OFF = tl.constexpr(plan_layout.H_MULTI_OFF)
H_BLOCKS = tl.constexpr(plan_layout.H_BLOCKS)
H_BLOCK_OFF = tl.constexpr(plan_layout.H_BLOCK_OFF)
H_KEYS_OFF = tl.constexpr(plan_layout.H_KEYS_OFF)
BLOCK_CLASS = tl.constexpr(plan_layout.BLOCK_CLASS)
# The exact kernels' log-sum-exp pointer is not specialised on its alignment: the fused layer passes the rows of a
# chunk (a view at any row), and the kernels read and write it one element per row anyway.
LSE_UNALIGNED = ["lse_ptr"]


class Spec(NamedTuple):
    """One kernel launch as configured: the ``@triton.jit`` function, its keyword
    arguments besides the tensors and scales (constexprs, and H / D where they are
    runtime arguments), warps and pipeline stages."""
    fn: object
    kwargs: dict
    num_warps: int
    num_stages: int


def launch(spec: Spec, grid, **tensors) -> None:
    """Launch ``spec`` on ``grid`` with the given tensor / scale keyword arguments."""
    spec.fn[grid](**tensors, **spec.kwargs, num_warps=spec.num_warps, num_stages=spec.num_stages)


_ARCH: dict = {}  # CUDA device index -> compute capability


def device_arch(device: torch.device) -> int:
    """Compute capability as an int (90 for sm_90; read once per device); 90 off CUDA (the interpreter
    runs sm_90's configs)."""
    if device.type != "cuda":
        return 90
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _ARCH:
        major, minor = torch.cuda.get_device_capability(index)
        _ARCH[index] = 10 * major + minor
    return _ARCH[index]


def meta_args(dtype: torch.dtype, allow_tf32: bool) -> dict:
    """Constexprs every exact kernel takes: dot precision and the interpreter's bf16 emulation."""
    return {"DOT_PREC": dot_precision(dtype, allow_tf32), "BF16_EMU": bf16_emulation(dtype)}


def packed_spec(head_fn, heads_fn, kernel: str, config: dict, dtype: torch.dtype, heads: int, head_dim: int,
                cls: int, tile: int, meta: dict) -> Spec:
    """The launch of packed class ``cls`` (height ``tile``) of ``kernel`` under ``config``.

    ``kernel: heads`` runs ``heads_fn`` (every head of ``TILES`` tiles per work
    item, packed_heads.py) when one tile's heads fit the config's
    ``tile_elems`` at this head count; otherwise, and for ``kernel: head``, the
    per-head kernel ``head_fn`` runs (with :func:`configs.head_kernel_config`
    when the config was a "heads" one).
    """
    dim_class = config_table.head_dim_class(head_dim)
    tiles = config_table.heads_tiles(config, heads, dim_class, tile) if config["kernel"] == "heads" else 0
    if tiles:
        return Spec(heads_fn, dict(meta, H=heads, D=head_dim, CLASS=cls, TILE=tile, TILES=tiles,
                                   HP=triton.next_power_of_2(heads), DOT=config["dot"],
                                   DP=config_table.padded_head_dim(dim_class, bool(config["dot"]))),
                    config["num_warps"], config["num_stages"])
    head = config if config["kernel"] == "head" else config_table.head_kernel_config(
        kernel, config_table.dtype_name(dtype), dim_class, tile)
    return Spec(head_fn, dict(meta, H=heads, D=head_dim, CLASS=cls, TILE=tile, BLOCK_D=block_d(head_dim)),
                head["num_warps"], head["num_stages"])


def choose_spec(kernel: str, make_spec, q: torch.Tensor, tile, grid, tensors: dict) -> Spec:
    """The spec of ``kernel`` for q's dtype / head dim / device: ``make_spec(config)`` of the
    config :func:`configs.choose` picks (which, with NT_KERNELS_TRITON_AUTOTUNE=1 on CUDA,
    times each candidate by launching it with ``tensors`` on ``grid``)."""
    def time_config(config):
        from triton.testing import do_bench
        return do_bench(lambda: launch(make_spec(config), grid, **tensors), warmup=5, rep=20)

    on_gpu = q.device.type == "cuda" and not INTERPRET
    config = config_table.choose(kernel, q.dtype, q.shape[2], tile, device_arch(q.device), q.shape[1],
                                 time_config if on_gpu else None)
    return make_spec(config)


def exact_launches(q: torch.Tensor, work, packed_kernel: str, packed_spec_of, multi_kernels: dict,
                   args: dict, blocks: bool = False) -> list[tuple[str, Spec, tuple]]:
    """(kernel, spec, grid) of one pass of the exact kernels for q's dtype, head dim and device:
    ``packed_kernel`` for each packed class the plan can hold (``packed_spec_of(config, cls, tile)``),
    with ``blocks`` (a plan with row blocks, plan.py) also for the row blocks (class BLOCK_CLASS, 64-row
    tiles, table size ``rows``), then the multi-tile kernels (``multi_kernels``: name -> spec_of(config)).
    With ``work`` (tiles per packed class, then multi-tile items, known on the host:
    ``ntconv_plan.Chunk.exact_work``; such plans have no row blocks) only those with work, on grids no
    larger than it.  ``args``: each kernel's launch arguments, read only when NT_KERNELS_TRITON_AUTOTUNE=1
    times the configs."""
    _, heads, head_dim = q.shape
    out = []
    classes = packed_classes(q.dtype, head_dim, shared_memory_per_block(q.device))
    if blocks and work is None:
        classes.append((plan_layout.BLOCK_CLASS, plan_layout.PLAN_BLOCK))
    for c, tile in classes:
        if work is None or work[c]:
            grid = persistent_grid(q.device, None if work is None else work[c], heads)
            spec = choose_spec(packed_kernel, lambda cfg: packed_spec_of(cfg, c, tile), q,  # row blocks: "rows" key
                               config_table.ROWS if c == plan_layout.BLOCK_CLASS else tile, grid, args[packed_kernel])
            out.append((packed_kernel, spec, grid))
    if work is None or work[-1]:
        grid = persistent_grid(q.device, None if work is None else work[-1], heads)
        out += [(name, choose_spec(name, spec_of, q, None, grid, args[name]), grid)
                for name, spec_of in multi_kernels.items()]
    return out


def num_programs(device: torch.device, per_sm: int = 32) -> int:
    """Persistent grid size: a few waves of programs per SM (4 under the interpreter)."""
    if INTERPRET or device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count * per_sm


def persistent_grid(device: torch.device, work: int | None, heads: int) -> tuple[int]:
    """Grid of a persistent kernel: :func:`num_programs`, or fewer when the host knows the work items
    (``work``, times ``heads``) and they are fewer."""
    programs = num_programs(device)
    return (programs if work is None else max(1, min(programs, work * heads)),)


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


def packed_classes(dtype: torch.dtype, d: int, shared_memory: int = SM90_SHARED_MEMORY) -> list[tuple[int, int]]:
    """(class, tile height) of the packed classes a plan for this dtype, head
    dim and shared memory per block can hold (``max_packed_tile``); the
    launchers run only these."""
    limit = max_packed_tile(dtype, d, shared_memory)
    return [(c, t) for c, t in enumerate(TILE_HEIGHTS) if t <= limit]


def block_d(d: int) -> int:
    """Head dim padded (in registers only) to a power of two >= 16."""
    return max(16, triton.next_power_of_2(d))


@triton.jit
def tile_table(plan, CLASS: tl.constexpr):
    """(tiles, offset of the first tile's entry) of packed class CLASS, or of the row blocks (BLOCK_CLASS)."""
    if CLASS == BLOCK_CLASS:
        return tl.load(plan + H_BLOCKS), tl.load(plan + H_BLOCK_OFF)
    return tl.load(plan + H_TILES + CLASS), tl.load(plan + H_TILE_OFF + CLASS)


@triton.jit
def block_rows(plan, first, nrows, r):
    """Rows first + r of a row block (r < nrows): (row index, local segment id, valid mask).  The row's key (its
    segment start, -1 outside the plan's small segments) comes with one load beside the rows themselves; the
    block holds whole segments, so key - first (0..63) is the local id, and -1 marks the rows it skips."""
    inside = r < nrows
    key = tl.load(plan + tl.load(plan + H_KEYS_OFF) + first + r, mask=inside, other=-1)
    valid = key >= 0
    return first + r, tl.where(valid, key - first, -1).to(tl.int32), valid


@triton.jit
def packed_rows(plan, t, tab, TILE: tl.constexpr, CLASS: tl.constexpr):
    """Rows of packed tile t: (row index, local segment id, valid mask) per tile row (the row blocks:
    CLASS == BLOCK_CLASS, block_rows)."""
    entry = tab + 3 * t
    if CLASS == BLOCK_CLASS:
        return block_rows(plan, tl.load(plan + entry), tl.load(plan + entry + 1), tl.arange(0, TILE))
    first = tl.load(plan + entry)
    count = tl.load(plan + entry + 1).to(tl.int32)
    n = tl.load(plan + entry + 2).to(tl.int32)
    r = tl.arange(0, TILE)
    seg = r // n
    valid = seg < count
    start = tl.load(plan + first + seg, mask=valid, other=0)
    return start + (r - seg * n), seg, valid


@triton.jit
def round_tf32(x):
    """float32 x rounded to TF32 (10 mantissa bits), to nearest with ties away from zero, as cuBLAS's
    TF32 GEMMs convert their operands.  Fed to a TF32 dot unrounded, the tensor cores drop the low 13 bits:
    a truncation whose one-sided error the sums over keys accumulate (the H200 run of 2026-11-27 measured
    the TF32 output's error at 2.8x that of PyTorch's TF32 matmuls, above the 2x rule)."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def mm(a, b, DOT_PREC: tl.constexpr, BF16_EMU: tl.constexpr):
    """a @ b with float32 accumulation (float32 operands rounded to TF32 first where DOT_PREC is "tf32")."""
    if BF16_EMU:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    if DOT_PREC == "tf32":
        if a.dtype == tl.float32:
            a = round_tf32(a)
        if b.dtype == tl.float32:
            b = round_tf32(b)
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
def key_block(q, k_ptr, v_ptr, start, n, j0, h, H, D, d, qk_scale,
              BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, BF16_EMU: tl.constexpr):
    """Key block j0 of a multi-tile segment against a query block: its keys, values, which of them are in
    the segment, and the scaled scores S = Q Kᵀ (base-2)."""
    kj = j0 + tl.arange(0, BLOCK_N)
    k_valid = kj < n
    kv_offs = (start + kj) * (H * D) + h * D
    k = load_rows(k_ptr, kv_offs, k_valid, d, D)
    v = load_rows(v_ptr, kv_offs, k_valid, d, D)
    return k, v, k_valid, mm(q, tl.trans(k), DOT_PREC, BF16_EMU) * qk_scale


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
