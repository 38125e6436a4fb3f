"""A CPU model of the FlashAttention-2-style CUDA Performer kernels' arithmetic (issue 39).

``flash_model(q, k, v, rowptr, projection, grad_o)`` returns (o, dq, dk, dv) as
csrc/cuda/segment_performer_fl_*.cuh compute them, in float32 with the kernels' roundings to
q.dtype at the tensor-core operands, their tiles and their order of sums:

* chunks of 256 rows, tiles of 64 rows, 16 rows per warp, features in tiles of 16; the segments
  sorted longest first (stable) give the chunk slots, and a segment's chunks inside one run of 4
  slots (a CTA's visit) form a portion, summed into one partial record;
* keys: per-feature running maxima per 16-row step, kept per row group (the warps that split a
  tile's rows when the features need fewer than four warps), A += e^T (v, 1) with e rounded, B as
  A's row m (e = 1); the combine in chunk and row-group order, W' = T(sigma W), its column sums;
* queries: the online row maximum over blocks of 64 features (o' rescaled when it rises), o' =
  sum rnd(e) W' + eps sum_f W'_f, o = o'[:D] (1 / o'[D]);
* query backward: h' = T((g, -g.o) sc), lambda = 1 / (sc o'[D]); per 16-feature tile t = (h' W'^T)
  lambda e with h's last column unrounded (h'[:, :D] W'[:, :D]^T + (-g.o sc) W'[:, D] in float32: the
  two cancel, exactly for m = 1), t' = T(t tau) with the row's power of two tau of that tile, dq from
  t' P / tau; the
  gradient sums from a = T((e + eps) lambda / 2^le) (le per warp) and T(h' 2^(le - L)) with L the
  chunk's running exponent per tile; C' = T(tau_C C) and its column sums;
* key gradients: dv = (rnd(e) C' + eps sum_f C'_f)[:D] / tau_C, t = (v' C'^T) e / tau_C, dk as dq.

Products of rounded operands accumulate in float32 (float32 inputs: 3xTF32, as the kernels).
``MUTANTS`` names faults the model can be run with (``flash_model(..., mutant=name)``): each
breaks one step, and the accuracy tests must catch every one.  ``ROUNDED_GO`` (not a mutant: it passes
the rule on most inputs) is the kernels' query backward before the H200 run of 2026-11-28c, with h'
rounded whole into dp.
"""
from __future__ import annotations

import math

import torch

from test_performer_cuda import pow2_scale, product  # the tensor-core model's, shared

CHUNK, TILE, WARP_ROWS, FRAG, RUN = 256, 64, 16, 16, 4
FWD_BLOCK = 4   # feature tiles per block of the online query maximum
EPS = 1e-4
MUTANTS = ("keys: no rescale when a feature max rises", "keys: B (eps term) dropped",
           "queries: o' not rescaled by the online max", "queries: eps sum_f W' dropped",
           "backward: C not rescaled when L rises", "backward: h' not scaled by 2^(le - L)",
           "gradients: -c^2 (sum t) x term dropped", "key gradients: eps part of dv dropped")
ROUNDED_GO = "backward: -g.o rounded to the dtype in dp"


def rescale(a, b):
    """exp2(a - b) for maxima a <= b, 1 where they are equal (both -inf included), elementwise."""
    return torch.where(a == b, torch.ones_like(a), torch.exp2(a - b))


def row_groups(m: int) -> int:
    """Warps that split a tile's rows in the feature-stationary products (csrc fl_dims)."""
    nft = -(-(m + 1) // FRAG)
    return 4 if nft == 1 else 2 if nft == 2 else 1


class Setup:
    """Per problem: dtype, rounding, product, scales and padded sizes."""

    def __init__(self, dtype, projection, mutant):
        self.dtype, self.mutant = dtype, mutant
        self.mm = product(dtype)
        self.m, self.dim = projection.shape
        self.mp = -(-(self.m + 1) // FRAG) * FRAG
        c = self.dim ** -0.25
        self.c, self.ps, self.dsc = c, 1.4426950408889634 * c, 1.4426950408889634 * 0.5 * c * c
        self.proj = projection.float()
        self.rg = row_groups(self.m)

    def rnd(self, t):
        return t.to(self.dtype).float()

    def u_and_diag(self, x):
        return self.mm(x, self.proj.T), self.dsc * (x * x).sum(1, keepdim=True)


def first_slots(rowptr):
    """Each segment's first chunk slot in the kernels' work list: all segments, longest first (stable)."""
    sizes = torch.diff(rowptr)
    order = torch.sort(sizes, stable=True, descending=True).indices
    chunks = -(-sizes[order] // CHUNK)
    first = torch.zeros_like(sizes)
    first[order] = torch.cumsum(chunks, 0) - chunks
    return first.tolist()


def portions(n: int, first: int):
    """Row ranges of a segment's portions: its chunks (slots first, first + 1, ...) split at run starts."""
    bounds = [c0 for j, c0 in enumerate(range(0, n, CHUNK)) if j == 0 or (first + j) % RUN == 0] + [n]
    return list(zip(bounds[:-1], bounds[1:]))


def portion_tiles(p0: int, p1: int):
    """(tile start, tile end) of the 64-row tiles of the chunks in rows [p0, p1) (chunks of 256 rows)."""
    return [(t0, min(t0 + TILE, c0 + CHUNK, p1)) for c0 in range(p0, p1, CHUNK)
            for t0 in range(c0, min(c0 + CHUNK, p1), TILE)]


def key_records(st: Setup, k, v, first):
    """The keys pass' partial records in (portion, row group) order: (A, per-feature maxima)."""
    n, m = k.shape[0], st.m
    vt = torch.cat([v, torch.ones(n, 1)], 1)
    records = []
    for p0, p1 in portions(n, first):
        for rg in range(st.rg):
            acc = torch.zeros(m + 1, st.dim + 1)
            mrun = torch.full((m,), -math.inf)
            for t0, t1 in portion_tiles(p0, p1):
                for kk in range(rg, 4, st.rg):
                    r0, r1 = t0 + WARP_ROWS * kk, min(t0 + WARP_ROWS * (kk + 1), t1)
                    if r0 >= r1:
                        break
                    u, dg = st.u_and_diag(k[r0:r1])
                    mnew = torch.maximum(mrun, st.ps * u.max(0).values)
                    if st.mutant != MUTANTS[0]:
                        acc[:m] *= rescale(mrun, mnew)[:, None]
                    mrun = mnew
                    e = torch.cat([torch.exp2(st.ps * u - dg - mrun), torch.ones(r1 - r0, 1)], 1)
                    acc = acc + st.mm(st.rnd(e).T, vt[r0:r1])
            records.append((acc, mrun))
    return records


def key_state(st: Setup, k, v, first):
    """The combine: W' (m x D+1, rounded), its column sums, M, sigma."""
    records = key_records(st, k, v, first)
    mseg = torch.stack([mr for _, mr in records]).max()
    w = torch.zeros(st.m, st.dim + 1)
    b = torch.zeros(st.dim + 1)
    for acc, mrun in records:
        w = w + acc[:st.m] * rescale(mrun, mseg)[:, None]
        b = b + acc[st.m]
    if st.mutant != MUTANTS[1]:
        w = w + EPS * b
    sigma = pow2_scale(w.abs().max())
    return st.rnd(sigma * w), sigma * w.sum(0), mseg, sigma


def query_forward(st: Setup, q, wt, zs):
    """o' (rows x D+1), the rows' final maxima and diag2 (online over blocks of 64 features)."""
    u, dg = st.u_and_diag(q)
    o = torch.zeros(q.shape[0], st.dim + 1)
    mrow = torch.full((q.shape[0], 1), -math.inf)
    block = FWD_BLOCK * FRAG
    for f0 in range(0, st.m, block):
        ub = u[:, f0:f0 + block]
        mnew = torch.maximum(mrow, st.ps * ub.max(1, keepdim=True).values)
        if st.mutant != MUTANTS[2]:
            o = o * rescale(mrow, mnew)
        mrow = mnew
        o = o + st.mm(st.rnd(torch.exp2(st.ps * ub - dg - mrow)), wt[f0:f0 + block])
    if st.mutant != MUTANTS[3]:
        o = o + EPS * zs
    return o, mrow, u, dg


def tiled_input_grad(st: Setup, t, x):
    """dx = c (sum over 16-feature tiles of T(t tau) P / tau) - c^2 (sum t) x, tau per row and tile."""
    acc = torch.zeros(x.shape[0], st.dim)
    for f0 in range(0, st.m, FRAG):
        tt = t[:, f0:f0 + FRAG]
        tau = pow2_scale(tt.abs().max(1, keepdim=True).values)
        acc = acc + st.mm(st.rnd(tt * tau), st.proj[f0:f0 + FRAG]) / tau
    diag_term = 0.0 if st.mutant == MUTANTS[6] else st.c * st.c * t.sum(1, keepdim=True) * x
    return st.c * acc - diag_term


def warp_exponents(lam, n):
    """le per row: the exponent above the largest lambda of its warp (16 rows of a 64-row tile)."""
    le = torch.full((n,), -(2 ** 31))
    for r0 in range(0, n, WARP_ROWS):
        lmax = lam[r0:r0 + WARP_ROWS].max().item()
        if lmax > 0 and math.isfinite(lmax):
            le[r0:r0 + WARP_ROWS] = math.frexp(lmax)[1]
    return le


def gradient_sums(st: Setup, a, hp, le, n, first):
    """C of the query pass (records in portion, row-group order), before the combine's scale sigma."""
    cmat = torch.zeros(st.m, st.dim + 1)
    none = -(2 ** 31)
    for p0, p1 in portions(n, first):
        for rg in range(st.rg):
            acc, lrun = torch.zeros(st.m, st.dim + 1), none
            for t0, t1 in portion_tiles(p0, p1):
                warps = [(t0 + WARP_ROWS * kk, min(t0 + WARP_ROWS * (kk + 1), t1)) for kk in range(4)]
                warps = [(r0, r1) for r0, r1 in warps if r0 < r1]
                lnew = max([lrun] + [int(le[r0]) for r0, _ in warps])
                if lnew > lrun and st.mutant != MUTANTS[4]:
                    acc = acc * (0.0 if lrun == none else 2.0 ** (lrun - lnew))
                lrun = max(lnew, lrun)
                for kk, (r0, r1) in enumerate(warps):
                    if kk % st.rg != rg or int(le[r0]) == none:
                        continue
                    fac = 1.0 if st.mutant == MUTANTS[5] else 2.0 ** (int(le[r0]) - lrun)
                    acc = acc + st.mm(a[r0:r1].T, st.rnd(hp[r0:r1] * fac))
            cmat = cmat + (0.0 if lrun == none else 2.0 ** lrun) * acc
    return cmat


def query_backward(st: Setup, q, g, wt, zs, sigma, first):
    """dq and C (m x D+1) from the query pass."""
    o, mrow, u, dg = query_forward(st, q, wt, zs)
    den = o[:, st.dim:]
    go = (g * (o[:, :st.dim] / den)).sum(1, keepdim=True)
    sc = pow2_scale(torch.maximum(g.abs().max(1, keepdim=True).values, go.abs()))
    hp = st.rnd(torch.cat([g, -go], 1) * sc)
    lam = 1.0 / (sc * den)
    e = torch.exp2(st.ps * u - dg - mrow)
    if st.mutant == ROUNDED_GO:
        dp = st.mm(hp, wt.T)
    else:
        dp = st.mm(hp[:, :st.dim], wt[:, :st.dim].T) + (-go * sc) * wt[:, st.dim]
    dq = tiled_input_grad(st, dp * lam * e, q)
    le = warp_exponents(lam[:, 0], q.shape[0])
    inv_l = torch.where(le == -(2 ** 31), 0.0, torch.exp2(-le.clamp(min=-1000).float()))
    a = st.rnd((e + EPS) * lam * inv_l[:, None])
    return dq, sigma * gradient_sums(st, a, hp, le, q.shape[0], first)


def key_grads(st: Setup, k, v, cmat, mseg):
    """dk, dv from C and the key stabiliser."""
    tau = pow2_scale(cmat.abs().max())
    ct = st.rnd(tau * cmat)
    zc = 0.0 if st.mutant == MUTANTS[7] else EPS * tau * cmat.sum(0)
    u, dg = st.u_and_diag(k)
    e = torch.exp2(st.ps * u - dg - mseg)
    dv = (st.mm(st.rnd(e), ct) + zc)[:, :st.dim] / tau
    vt = torch.cat([v, torch.ones(k.shape[0], 1)], 1)
    dk = tiled_input_grad(st, st.mm(vt, ct.T) / tau * e, k)
    return dk, dv


def flash_model(q, k, v, rowptr, projection, grad_o, mutant=None):
    """(o, dq, dk, dv) as the flash kernels compute them (see the module docstring)."""
    dtype, f32 = q.dtype, torch.float32
    st = Setup(dtype, projection, mutant)
    outs = [torch.zeros(q.shape, dtype=f32) for _ in range(4)]
    bounds, first = rowptr.tolist(), first_slots(rowptr)
    for s in range(len(bounds) - 1):
        rows = slice(bounds[s], bounds[s + 1])
        for h in range(q.shape[1]):
            qs, ks, vs, gs = (t[rows, h].to(f32) for t in (q, k, v, grad_o))
            if qs.shape[0] == 0:
                continue
            wt, zs, mseg, sigma = key_state(st, ks, vs, first[s])
            o = query_forward(st, qs, wt, zs)[0]
            dq, cmat = query_backward(st, qs, gs, wt, zs, sigma, first[s])
            dk, dv = key_grads(st, ks, vs, cmat, mseg)
            for out, val in zip(outs, (o[:, :st.dim] * (1.0 / o[:, st.dim:]), dq, dk, dv)):
                out[rows, h] = val
    return [t.to(dtype) for t in outs]
