"""Bytes, FLOPs and latency model of the FlashAttention-2-style Performer kernels (issue 39).

Used by scripts/performer_tc_roofline.py (``--kernels flash``, its default).  Per kernel of
csrc/cuda/segment_performer_fl_*.cuh, for the tiles the code walks (64-row tiles inside 256-row
chunks, 16 rows per warp, 16-feature tiles, padded D, D + 1 and m + 1):

* throughput: tensor-core FLOPs (m16n8k16 steps, 3xTF32 as six m16n8k8), exp2 calls, device
  bytes (rows once per pass, the 16-byte windows over each row, one partial record per portion --
  a segment's chunks inside a CTA's run of 4 slots -- the per-segment state and its staging once
  per portion), shared-memory bytes;
* latency: issue slots per tile (a count per step of the code, constants below), barriers per
  tile, resident warps (registers from make cuda-check, sm_90; shared memory from the layout) and
  the bytes in flight per SM the cp.async stages keep (Little's law against the HBM latency).

Nothing here is measured: it is the estimate docs/kernels-performer-cuda.md quotes.
"""
from __future__ import annotations

import math

CHUNK, TILE, WARP_ROWS, FRAG, RUN = 256, 64, 16, 16, 4
WARPS, SKEW, FWD_BLOCK = 4, 8, 4
MMA_FLOP = 2 * 16 * 8 * 16  # one m16n8k16 step
# H100 SXM: 132 SMs at 1.755 GHz, 4 warp-instructions issued per clock per SM, 228 KB of shared
# memory per SM (1 KB reserved per CTA), 64K registers, HBM latency under load (ns).
SMS, CLOCK, ISSUE, SMEM_SM, HBM_NS = 132, 1.755e9, 4, 228 * 1024, 800
# Registers per thread of the tolokers variants (DHT = 2, FT = 2) on sm_90 (make cuda-check).
REGS = {("bfloat16", "keys"): 147, ("bfloat16", "queries fwd"): 123, ("bfloat16", "queries bwd"): 208,
        ("bfloat16", "key grad"): 122, ("float32", "keys"): 162, ("float32", "queries fwd"): 151,
        ("float32", "queries bwd"): 241, ("float32", "key grad"): 158}
# Issue slots per lane (estimates from the code): exp2 step per element (FFMA, FADD, MUFU, mask),
# running max per element, C -> A conversion per fragment, row-fragment build per k16 step from
# the raw rows (8 loads, masks, packing), a row's store per C tile, staging per tensor and tile.
EXP_ELEM, MAX_ELEM, CVT_FRAG, ROWFRAG, STORE_TILE, STAGE = 5, 2, 6, 24, 8, 20


def rup(n: int, k: int = FRAG) -> int:
    return -(-n // k) * k


class Dims:
    """fl_dims of csrc/cuda/segment_performer_fl_layout.cuh."""

    def __init__(self, dim: int, m: int, elem: int):
        self.dim, self.m, self.elem = dim, m, elem
        self.dp, self.dh, self.mp = rup(dim), rup(dim + 1), rup(m + 1)
        self.dpt, self.dht, self.nft = self.dp // FRAG, self.dh // FRAG, self.mp // FRAG
        vecs = (dim * elem + (16 - elem) + 15) // 16
        self.raw_ld = (vecs | 1) * 16 // elem
        ft = 1 if self.nft <= 4 else 2
        groups = -(-self.nft // ft)
        self.rg = 4 if groups <= 1 else 2 if groups <= 2 else 1
        self.mma = 6 if elem == 4 else 1  # m16n8k16-equivalents per step (3xTF32: six m16n8k8)
        self.stages = 2 if elem == 4 else 3  # fl_stages


def smem_bytes(d: Dims, kernel: str) -> int:
    """Dynamic shared memory of one CTA (fl_layout), 128-byte regions."""
    e, keys, qbwd = d.elem, kernel == "keys", kernel == "queries bwd"
    tensors = 1 if kernel == "queries fwd" else 2
    nbuf = 1 if e == 4 else 2
    parts = [e * d.mp * (d.dp + SKEW),
             0 if keys else e * d.mp * (d.dh + SKEW), 0 if keys else 4 * d.dh,
             e * 2 * TILE * (d.dp + SKEW) if keys else 0, e * 2 * TILE * (d.dh + SKEW) if keys else 0,
             4 * 2 * TILE if keys else 0, e * d.stages * tensors * TILE * d.raw_ld,
             e * nbuf * TILE * (d.mp + SKEW) if qbwd else 0, e * nbuf * TILE * (d.dh + SKEW) if qbwd else 0,
             4 * nbuf * WARPS if qbwd else 0, 4 * WARPS, 4]
    return sum(rup(p, 128) for p in parts)


def residency(d: Dims, kernel: str, dtype: str) -> dict:
    """CTAs per SM by registers and by shared memory, and the warps resident."""
    regs = REGS[(dtype, kernel)]
    by_regs = 65536 // (rup(regs, 8) * 32 * WARPS)
    by_smem = SMEM_SM // (smem_bytes(d, kernel) + 1024)
    ctas = max(0, min(by_regs, by_smem, 32))
    return {"regs": regs, "smem": smem_bytes(d, kernel), "ctas": ctas, "warps": WARPS * ctas,
            "by_regs": by_regs, "by_smem": by_smem}


def tile_counts(d: Dims, kernel: str, rows: int) -> dict:
    """Per 64-row tile with `rows` valid rows: MMA steps, exp2, shared bytes, issue slots of one of
    its busy warps (`issue`) and of all its warps (`warp_issue`), barriers."""
    steps = -(-rows // WARP_ROWS)                 # 16-row groups (warps with rows)
    dpt, dht, nft, e = d.dpt, d.dht, d.nft, d.elem
    u, w = 2 * dpt, 2 * dht                       # MMAs of u = x P^T and of a product over D + 1 per tile
    frag = 512 * (2 if e == 4 else 1)             # bytes of one ldmatrix.x4 (fp32: the same as scalar loads)
    elems = 8 * nft                               # exp2 / max elements per lane and 16 rows
    rowfrags = ROWFRAG * (dpt + (dht if kernel in ("queries bwd", "key grad") else 0))
    if kernel == "keys":
        per_warp_steps = -(-steps // d.rg)
        ft = -(-nft // (WARPS // d.rg))
        mma = steps * nft * (u + w)
        smem = 2 * TILE * d.raw_ld * e + TILE * (d.dp + d.dh) * e + steps * nft * (dpt + 2 * dpt + dht) * frag
        issue = per_warp_steps * (ft * (u + w + dpt * 2 + 8 * (EXP_ELEM + MAX_ELEM) + CVT_FRAG + 12) + dpt + dht)
        issue += 2 * STAGE + (d.dp + d.dh) // 2 * 3   # staging and the repack (2 threads per row)
        return dict(mma=mma, exp2=16 * steps * 16 * nft, smem=smem, issue=issue, warp_issue=WARPS * issue,
                    barriers=2)
    fwd = nft * (u + w + elems // nft * (EXP_ELEM + MAX_ELEM) + CVT_FRAG + dpt + dht) + nft // FWD_BLOCK * 24
    out = STAGE + rowfrags + fwd + STORE_TILE * 2 * dht
    if kernel == "queries fwd":
        return dict(mma=steps * nft * (u + w), exp2=16 * steps * 16 * nft,
                    smem=steps * (16 * d.raw_ld * e + nft * (dpt + dht) * frag), issue=out,
                    warp_issue=steps * out, barriers=0)
    if kernel == "key grad":
        mma = steps * nft * (u + w + w + u)
        issue = 2 * STAGE + rowfrags + nft * (2 * u + 2 * w + 8 * (EXP_ELEM + 6) + 2 * CVT_FRAG + dpt + 3 * dht + 12)
        issue += STORE_TILE * 2 * (dht + dpt)
        return dict(mma=mma, exp2=16 * steps * 16 * nft, issue=issue, warp_issue=steps * issue, barriers=0,
                    smem=steps * (32 * d.raw_ld * e + nft * (2 * dpt + 2 * dht) * frag))
    # queries bwd: the forward sweep, h', the gradient sweep, the operand stores and the C product
    mma = steps * nft * (u + w + u + w + u) + steps * nft * w
    grad = nft * (u + w + u + 8 * (EXP_ELEM + 8) + 2 * CVT_FRAG + 2 * dpt + dht + 16)
    csum = -(-steps // d.rg) * (-(-nft // (WARPS // d.rg))) * (w + 2) + 2 * dht
    issue = out + STAGE + 40 + grad + csum
    smem = steps * (32 * d.raw_ld * e + nft * (3 * dpt + 2 * dht) * frag + 16 * (d.mp + d.dh) * e * 2)
    barriers = 2 if e == 4 else 1
    return dict(mma=mma, exp2=2 * 16 * steps * 16 * nft, smem=smem, issue=issue, warp_issue=steps * issue,
                barriers=barriers)


def window_bytes(dim: int, elem: int, heads: int) -> float:
    """Mean bytes the 16-byte cp.async vectors over one row cover (rows start anywhere)."""
    total = 0
    for r in range(16):
        for h in range(heads):
            start = (r * heads + h) * dim * elem
            total += rup(start % 16 + dim * elem, 16)
    return total / (16 * heads)


def work_list(sizes: list[int]) -> tuple[int, int]:
    """(portions, segment stagings) of the work list: the segments longest first, chunk slots in runs of
    RUN; a portion (one partial record; one staging of the segment's W' or C') is a segment's chunks
    inside one run."""
    portions, slot = 0, 0
    for n in sorted(sizes, reverse=True):
        c = -(-n // CHUNK)
        portions += (slot + c - 1) // RUN - slot // RUN + 1 if c else 0
        slot += c
    return portions, portions


def device_bytes(sizes: list[int], heads: int, d: Dims) -> dict:
    """Per kernel: rows read through their windows, rows written, partial records (one per portion and
    row group) written and read by the combines, the state written, and staged once per portion."""
    rows, e = sum(sizes), d.elem
    win = rows * heads * window_bytes(d.dim, e, heads)
    out = rows * heads * d.dim * e
    portions, visits = work_list(sizes)
    records = portions * heads * d.rg * (d.mp * d.dh + d.mp) * 4
    state = len(sizes) * heads * (d.mp * d.dh * e + d.dh * 4 + 8)
    staged = visits * heads * (d.mp * d.dh * e + d.dh * 4)
    return {"keys": 2 * win + 2 * records + state,
            "queries fwd": win + out + staged,
            "queries bwd": 2 * win + out + staged + 2 * portions * heads * d.rg * d.mp * d.dh * 4 + state,
            "key grad": 2 * win + 2 * out + staged}


def in_flight(d: Dims, kernel: str, heads: int, ctas: int) -> float:
    """Bytes the cp.async stages keep in flight per SM: stages - 1 tiles ahead per CTA."""
    tensors = 1 if kernel == "queries fwd" else 2
    return ctas * (d.stages - 1) * TILE * tensors * window_bytes(d.dim, d.elem, heads)


# Calls per tolokers layer, forward + backward, as the fused layer makes them with the flash kernels:
# the forward (keys, queries), the backward's recomputed forward (keys, queries, keeping the state)
# and the Performer backward on that state (queries backward, key gradients; no keys pass).
LAYER_CALLS = {"keys": 2, "queries fwd": 2, "queries bwd": 1, "key grad": 1}


def kernel_report(sizes: list[int], heads: int, d: Dims, dtype: str, roof: dict) -> dict:
    """Per kernel: the throughput times (tensor cores, DRAM, shared memory, exp2), the latency times
    (issue slots, Little's law on the bytes in flight), residency and per-tile counts."""
    tiles = [min(TILE, min(CHUNK, n - c0) - t) for n in sizes for c0 in range(0, n, CHUNK)
             for t in range(0, min(CHUNK, n - c0), TILE)]
    dram = device_bytes(sizes, heads, d)
    tc_roof = roof["tc_tf32"] if d.elem == 4 else roof["tc_bf16"]
    report = {}
    for kernel in LAYER_CALLS:
        acc = dict(mma=0.0, exp2=0.0, smem=0.0, warp_issue=0.0)
        for rows in tiles:
            t = tile_counts(d, kernel, rows)
            for k in acc:
                acc[k] += t[k] * heads
        full = tile_counts(d, kernel, TILE)
        res = residency(d, kernel, dtype)
        flight = in_flight(d, kernel, heads, res["ctas"])
        flop = acc["mma"] * MMA_FLOP * d.mma
        times = {"tc": flop / tc_roof, "dram": dram[kernel] / roof["dram"], "smem": acc["smem"] / roof["smem"],
                 "exp2": acc["exp2"] / roof["exp2"], "issue": acc["warp_issue"] / (SMS * ISSUE * CLOCK),
                 "little": dram[kernel] / (SMS * flight / (HBM_NS * 1e-9)) if flight else math.inf}
        report[kernel] = dict(flop=flop, exp2=acc["exp2"], dram=dram[kernel], smem=acc["smem"], times=times,
                              res=res, flight=flight, issue=full["issue"], barriers=full["barriers"],
                              throughput=max(times[k] for k in ("tc", "dram", "smem", "exp2")),
                              latency=max(times["issue"], times["little"]))
    return report
