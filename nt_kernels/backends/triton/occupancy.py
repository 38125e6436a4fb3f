"""Resident CTAs and warps per SM of a compiled kernel, and the occupancy gates of the compile checks (issue 40).

Pure arithmetic on what ``ptxas -v`` and Triton's metadata report (registers per thread, shared memory
per CTA, warps per CTA), so that scripts/ntconv_triton_check.py and scripts/triton_check.py can print
and gate the occupancy of every launch without a GPU.  The limits per SM are NVIDIA's (CUDA occupancy
calculator, compute capabilities 8.0, 8.9 and 9.0):

* registers: 65,536 per SM in four sub-partitions of 16,384; a warp takes its registers per thread
  rounded up to a multiple of 8 (units of 256 per warp), and the warps of a sub-partition must fit its
  16,384 (so 104 registers give 4 warps per sub-partition, 16 per SM: ncu's "limit: registers" of the
  H200 run for ``_message_grad_split_kernel``, 101 registers at 16 warps: 1 CTA);
* shared memory: 228 KB (sm_90), 164 KB (sm_80), 100 KB (sm_89) per SM, each CTA taking its own plus
  1 KB the driver reserves;
* warps: 64 per SM (48 on sm_89); CTAs: 32 per SM (24 on sm_89).

The driver picks the shared-memory carve-out per kernel (ncu reports the limit under the carve-out it
chose), so the count here uses the largest carve-out: the most CTAs the kernel can have.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ARCH_LIMITS", "DOT_MIN_WARPS", "Occupancy", "STREAM_MAX_REGISTERS", "STREAM_MIN_CTAS", "STREAM_WARPS",
           "SIMT_MIN_WARPS", "GATED_ARCH", "gate", "occupancy"]


@dataclass(frozen=True)
class ArchLimits:
    registers: int = 65536      # per SM
    partitions: int = 4         # sub-partitions sharing them
    shared: int = 233472        # bytes per SM at the largest carve-out
    reserved: int = 1024        # bytes the driver reserves per CTA
    warps: int = 64
    ctas: int = 32


ARCH_LIMITS = {80: ArchLimits(shared=167936), 86: ArchLimits(shared=102400, warps=48, ctas=16),
               89: ArchLimits(shared=102400, warps=48, ctas=24), 90: ArchLimits()}

# The gates (issue 40, "Must show"), on sm_90: no spills; at least SIMT_MIN_WARPS resident warps per SM for a
# kernel without tl.dot and DOT_MIN_WARPS for one with; the per-row streaming kernels of the backward at most
# STREAM_MAX_REGISTERS registers and at least STREAM_MIN_CTAS CTAs of STREAM_WARPS warps per SM.
GATED_ARCH = 90
SIMT_MIN_WARPS = 16
DOT_MIN_WARPS = 8
STREAM_MAX_REGISTERS = 96
STREAM_MIN_CTAS = 4
STREAM_WARPS = 4


@dataclass(frozen=True)
class Occupancy:
    """CTAs per SM and what limits them ("registers", "shared", "warps" or "ctas"), resident warps per SM."""

    ctas: int
    warps: int
    limit: str


def occupancy(arch: int, registers: int, shared: int, num_warps: int) -> Occupancy:
    """Resident CTAs and warps per SM of a kernel of ``registers`` per thread, ``shared`` bytes of shared
    memory per CTA and ``num_warps`` warps per CTA on compute capability ``arch``."""
    a = ARCH_LIMITS[arch]
    per_warp = -(-max(registers, 1) // 8) * 8 * 32
    warps_by_registers = a.partitions * (a.registers // a.partitions // per_warp)
    limits = {"registers": warps_by_registers // num_warps, "shared": a.shared // (shared + a.reserved),
              "warps": a.warps // num_warps, "ctas": a.ctas}
    limit = min(limits, key=lambda k: limits[k])
    ctas = limits[limit]
    return Occupancy(ctas, ctas * num_warps, limit)


def gate(arch: int, registers: int, spills: int, shared: int, num_warps: int, has_dot: bool,
         streaming: bool = False) -> list[str]:
    """The gates a launch fails (empty: it passes); only ``GATED_ARCH`` is gated."""
    if arch != GATED_ARCH:
        return []
    occ = occupancy(arch, registers, shared, num_warps)
    failed = []
    if spills:
        failed.append(f"spills {spills} B")
    floor = DOT_MIN_WARPS if has_dot else SIMT_MIN_WARPS
    if occ.warps < floor:
        failed.append(f"{occ.warps} resident warps < {floor}")
    if streaming:
        if registers > STREAM_MAX_REGISTERS:
            failed.append(f"streaming: {registers} registers > {STREAM_MAX_REGISTERS}")
        if num_warps != STREAM_WARPS or occ.ctas < STREAM_MIN_CTAS:
            failed.append(f"streaming: {occ.ctas} CTAs of {num_warps} warps < {STREAM_MIN_CTAS} of {STREAM_WARPS}")
    return failed
