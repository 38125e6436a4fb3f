"""Helpers shared by the forward and backward Triton kernels.

Host side: the interpreter switch, autotuning configs, persistent grid size,
dot precision, the bf16 emulation under the interpreter, the packed tile
classes a launch runs and the padded head dim.  Device side (``@triton.jit``):
reading a packed tile's rows from the plan, the matrix product and casts
(emulated for bf16 under the interpreter), row loads and the non-finite row
masks that keep a NaN/inf inside its own segment.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from nt_kernels.backends.triton import plan as plan_layout
from nt_kernels.backends.triton.plan import PLAN_BLOCK, SM90_SHARED_MEMORY, TILE_HEIGHTS, max_packed_tile

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# NT_KERNELS_TRITON_AUTOTUNE=0 pins every kernel to its first config (the one
# with the least shared memory) instead of autotuning over all of them: a
# handful of compiles instead of dozens, for time-boxed GPU runs (scripts/gpu_check.sh).
AUTOTUNE = os.environ.get("NT_KERNELS_TRITON_AUTOTUNE", "1") != "0"
LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)
LOG2E_C = tl.constexpr(LOG2E)
H_TILES = tl.constexpr(plan_layout.H_TILES)
H_TILE_OFF = tl.constexpr(plan_layout.H_TILE_OFF)
H_MULTI = tl.constexpr(plan_layout.H_MULTI)
H_MULTI_OFF = tl.constexpr(plan_layout.H_MULTI_OFF)


def configs(inner_blocks=(32, 64), warps=(4, 8), inner_name="BLOCK_N"):
    """A small autotuning set; one fixed config under the interpreter or with autotuning off."""
    if INTERPRET:
        return [triton.Config({inner_name: PLAN_BLOCK} if inner_name else {}, num_warps=4)]
    tuned = [
        triton.Config({inner_name: b} if inner_name else {}, num_warps=w, num_stages=s)
        for b in (inner_blocks if inner_name else (None,))
        for w in warps
        for s in (1, 2)
    ]
    return tuned if AUTOTUNE else tuned[:1]


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
