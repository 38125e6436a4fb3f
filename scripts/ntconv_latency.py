"""The latency bound of the fused NT layer's kernels (issue 40), next to the byte bound of scripts/ntconv_bytes.py.

The bound is the larger of two terms:

* Little's law: a kernel streams at most (bytes in flight per SM) x SMS / LATENCY, so its reads take at least
  reads / that.  In flight per SM = resident CTAs (sm_90, from ptxas: `make triton-check`, Triton 3.9, the
  tolokers shape in bf16; the reductions' from Triton 3.6, the GPU machines', where it has fewer: the
  H200's ncu profile for one block per program, ptxas for the pipelined design) x the bytes a CTA has
  issued before it first waits on them: one tile's loads, and
  the next tiles' where it prefetches (by hand, or the compiler's cp.async pipeline);
* the waits: a tile whose loads form a chain (indices, then the rows they address) not prefetched waits
  LATENCY per link, and only the CTAs resident on an SM overlap those waits: tiles / (SMS x CTAs) x waits x
  LATENCY.  (One CTA per SM with a serial tile loop: every wait is exposed.)

It assumes a CTA's loads overlap its math, which one CTA per SM does not do: there it is a lower bound.
Arithmetic, unverified on GPU.
"""
from __future__ import annotations

__all__ = ["LATENCY", "LATENCY_MODEL", "SMS", "latency_time"]

SMS = 132            # H100 SXM
LATENCY = 1.0e-6     # s, DRAM latency under load: 3.0 TB/s x 1 us / 132 SMs = 23 KB per SM in flight to stream
# kernel -> (resident CTAs per SM, rows per tile, waits per tile, what is issued before the first wait)
LATENCY_MODEL = {
    "prologue": (7, 32, 2, "a tile's indices, then its gathered node rows (no prefetch)"),
    "rows_gemm": (5, 32, 0, "2 cp.async stages of 32-column K steps of A and of W (the layer's shape constexpr; "
                            "with run-time strides ptxas issued no cp.async: 239 registers, 2 CTAs)"),
    "gate": (7, 16, 1, "a tile of gate halves"),
    "reduce": (2, 64, 4, "an item's entries, then its rows through rrow, then its gathers, then its destinations' "
                         "running state (one block per program; 94 registers on the H200, 2026-11-28b)"),
    "reduce_pipe": (1, 64, 1, "its gathers, beside the next block's rows and running state and the entries two "
                              "blocks ahead (NT_KERNELS_NTCONV_REDUCE=pipe; gated, Triton 3.6: 245 registers)"),
    "message_grad": (6, 16, 2, "a tile's y and receivers, then g gathered"),
    "weight_grad": (7, 32, 0, "2 cp.async stages of A and B rows"),
    "du": (2, 32, 1, "2 cp.async stages of 32-column K steps of dq, dk, dv, then dz/du"),
    "message_grad_split": (1, 16, 2, "a tile's o and receivers, then g (serial tile loop, one CTA)"),
    "input_grad_split": (1, 32, 2, "a tile's indices, then its gathers and dq, dk, dv (serial tile loop, one CTA)"),
    "project": (2, 16, 1, "a tile's o (serial tile loop)"),
    "project_stream": (5, 16, 0, "o of the tile after next (two tiles ahead)"),
    "dy_stream": (5, 16, 1, "o two tiles ahead, the next tile's receivers; g gathered per head (L2)"),
    "du_stream": (5, 16, 0, "the next tile's dq, dk, dv (cp.async) and gathered node rows, indices two ahead"),
}


def latency_time(model: str, rows: int, reads: float, inflight_row: float) -> tuple[float, float]:
    """(bytes in flight per SM, the latency bound of ``reads`` bytes over ``rows`` rows) of kernel ``model`` of
    LATENCY_MODEL issuing ``inflight_row`` bytes per row of a tile before its first wait."""
    ctas, tile, waits, _ = LATENCY_MODEL[model]
    inflight = ctas * tile * inflight_row
    little = reads / (inflight * SMS / LATENCY)
    serial = -(-rows // tile) / (SMS * ctas) * waits * LATENCY
    return inflight, max(little, serial)
