"""The fused NT layer on CUDA: ``nt_kernels::ntconv_fwd`` / ``ntconv_bwd`` (docs/design.md §9).

Per chunk of whole neighbourhoods (ntconv_plan.py), the forward runs

1. the prologue (ntconv_gemm.py): gathered node terms (+ edge term), GELU,
   counter dropout, z · w_qkvᵀ + b_qkv -> the chunk's q, k, v;
2. attention in place: the Triton exact kernels on the chunk's work list and,
   for segments above the threshold, ``nt_kernels::performer_fwd_into`` (the
   CUDA Performer kernel; the dispatcher picks it by device);
3. the output projection y = o · w_outᵀ + b_out (message m = GELU(y)); where
   the sm_90 paths apply, on the message gradient's tiles (ntconv_project.py),
   with the gated aggregators' gates from the same tiles;
4. gates (gated aggregators) and the receiver reduction (ntconv_reduce.py),
   merged into per-receiver running state in chunk order; ``out``, ``stats``
   are finished from that state at the end.  The attention's lse is a per-chunk
   transient: the op returns an empty (0, H) ``lse`` and keeps none for the backward.

The backward recomputes 1-3 per chunk (the attention with its lse; with the flash Performer kernels,
``NT_KERNELS_PERFORMER=flash``, keeping the Performer's per-segment state so that its backward skips
the keys pass; with ``NT_KERNELS_PERFORMER=gemm``, the Performer rows go through the library-GEMM
yardstick instead, nt_kernels/backends/performer_gemm.py), gets dy and do = dy · w_out from the
saved (out, stats) in one kernel (ntconv_grad.py; where ``split_width``
allows, that kernel recomputes y from o itself and also sums dW_out and
db_out, so y and dy are never stored), then the attention
backward, and du = (dqkv · w_qkv) · dz/du with d_centre (per-segment sums of
the same tiles, ntconv_gemm._du_kernel); weight and bias gradients are split-K
tensor-core reductions over fixed row blocks (ntconv_wgrad.py) added to fp32
accumulators in chunk order, d_receiver_term a receiver reduction like the
forward's.  No float atomics anywhere.

Dtypes (as the CPU op): node terms and edge features in one dtype, the
parameters in another (autocast casts only the parameters), each float32,
bfloat16 or float16; q, k, v, o and ``out`` are in the parameters' dtype, the
per-message GEMMs and the weight gradients run on that dtype's tensor cores
with fp32 accumulation (fp32 at full precision unless
``torch.backends.cuda.matmul.allow_tf32``).  The per-row intermediates y, dz/du,
dy and du are stored in the parameters' dtype too (the autocast dtype under
autocast: half the bytes of fp32); the arithmetic on them (GELU, dropout, gates, reductions, the
gradient accumulators) is fp32.

The backward has three designs (``NT_KERNELS_NTCONV_RECOMPUTE``).  The default,
``stream`` (issue 40; 16-bit parameters on any device, where its tiles fit): the
streaming kernels of ntconv_stream.py, which recompute y and z per tile with
nothing carried across tiles and store dy and z once for the split-K weight
gradients; on the H200 (2026-11-28c, tolokers, bf16) its step took 49.8 ms in
1,566 MiB against the stored path's 53.5 ms in 1,950 MiB.  ``0``: the stored
path (y, dy, z and dz/du stored), what every other configuration (float32
parameters, shapes the streaming tiles do not fit) runs.  ``1``, opt-in: the
recompute paths (sm_90, 16-bit parameters: the forward's projection with the
gates, the message gradient from o, the one-pass input gradients; y, dy, z and
dz/du never stored), 0.68x the stored path's peak memory but a 7 % slower
tolokers step on their first GPU run (one H200, docs/results.md).

The implementations are plain functions (registered for CUDA by
:func:`register`).  On CPU tensors under ``TRITON_INTERPRET=1`` the tests call
them directly: the Triton stages run in the interpreter and the Performer
stage dispatches to the CPU C++ kernel (the CUDA Performer kernel itself is
not exercised there).
"""
from __future__ import annotations

import math
import os

import torch
from torch.library import register_kernel

from nt_kernels.backends import performer_gemm
from nt_kernels.backends.triton.common import device_arch
from nt_kernels.backends.triton.ntconv_checks import ARG_NAMES, Problem, problem
from nt_kernels.backends.triton.ntconv_gemm import du_and_centre, fused_centre, gemm_shape, prologue, rows_gemm
from nt_kernels.backends.triton.ntconv_igrad import input_grad_split, input_split_ok
from nt_kernels.backends.triton.ntconv_grad import (GRAD_CENTRE_A, GRAD_CENTRE_B, GRAD_GATED_SUM, GRAD_MAX,
                                                    GRAD_MEAN, GRAD_SOFTMAX, GRAD_SUM, SPLIT_MIN_ARCH, SPLIT_WARPS,
                                                    grad_tiles, message_grad, message_grad_split, split_width)
from nt_kernels.backends.triton.ntconv_project import project_forward
from nt_kernels.backends.triton.ntconv_reduce import (AGG_GATED, AGG_MAX, AGG_SOFTMAX, AGG_SUM, State, gate_values,
                                                      receive, segment_softmax, segment_sum)
from nt_kernels.backends.triton.ntconv_stream import du_stream, du_stream_ok, dy_stream, project_stream, stream_width
from nt_kernels.backends.triton.ntconv_wgrad import weight_grad
from nt_kernels.backends.triton.softmax_bwd import softmax_bwd
from nt_kernels.backends.triton.softmax_fwd import softmax_fwd

__all__ = ["ARG_NAMES", "ntconv_bwd", "ntconv_fwd", "problem", "prologue", "register", "segment_of_rows"]


class Saved:
    """What the backward reads of the forward: grad_out, out and stats."""

    def __init__(self, grad_out, out, stats):
        self.grad_out, self.out, self.stats = grad_out, out, stats


def _aggregation_mode(p: Problem) -> int:
    if p.aggr == "max":
        return AGG_MAX
    if p.aggr == "gated_sum" or (p.aggr == "weighted_mean" and p.gate_group == "centre"):
        return AGG_GATED
    return AGG_SOFTMAX if p.aggr == "weighted_mean" else AGG_SUM


def segment_of_rows(chunk) -> torch.Tensor:
    """(rows,) int64 centre node (segment id) of each of the chunk's rows (kept in the plan)."""
    return chunk.seg_of_row


def _uncovered_zeros(p: Problem, shape, dtype) -> torch.Tensor:
    """An attention buffer of a chunk: uninitialised when the segment lists hold every row (the
    kernels write each one), else zeros (rows of a segment in neither list stay 0)."""
    return (torch.empty if p.plan.rows_covered else torch.zeros)(shape, dtype=dtype, device=p.device)


def qkv_buffer(p: Problem, chunk, dtype, fill: bool = False) -> torch.Tensor:
    """A chunk's (3, part_rows, H, D) buffer of q, k, v (or of their gradients): each part padded to
    ``chunk.part_rows`` rows, so that q, k and v start 16-byte aligned whatever the chunk (the exact
    kernels compile once); rows past ``chunk.rows`` are never read.  Zero-filled where ``fill``."""
    shape = (3, chunk.part_rows, p.heads, p.head_dim)
    return (torch.zeros if fill else torch.empty)(shape, dtype=dtype, device=p.device)


def _keeps_performer_state(q: torch.Tensor) -> bool:
    """Whether the backward keeps the Performer's per-segment state from its recomputed forward, so that
    the Performer backward skips the keys pass (issue 39: the keys pass once per backward, twice per
    layer): on CUDA, in a build that has the state ops.  The binding decides per call: it keeps a state
    where it runs the flash kernels (bfloat16 by default, any dtype with NT_KERNELS_PERFORMER=flash) and
    returns an empty one elsewhere, which its backward then ignores (the same kernels as without)."""
    return q.is_cuda and hasattr(torch.ops.nt_kernels, "performer_fwd_state_table")


def _gemm_rows(p: Problem, chunk, dtype) -> performer_gemm.SegmentRows:
    """The chunk's Performer rows and their performer-gemm plan (host reads once per plan, chunk and dtype)."""
    return p.plan.memo(("performer-gemm", chunk.seg0, p.heads, dtype),
                       lambda: performer_gemm.SegmentRows(chunk.rowptr, chunk.performer, p.heads, dtype))


def _attention_fwd(p: Problem, chunk, o, lse, q, k, v, keep_state: bool = False):
    """Exact kernels with work in this chunk (their launch list kept on the plan), then the Performer
    kernels through the trusted table the plan checked when it was built (no sync, no check here).
    With ``keep_state`` (the backward's recompute) returns the Performer's per-segment state for
    _attention_bwd (None where there is none to keep)."""
    if chunk.exact_plan is not None:
        softmax_fwd(o, lse, q, k, v, chunk.exact_plan, p.scale, p.allow_tf32, work=chunk.exact_work,
                    memo=p.plan.memo)
    if chunk.performer is None:
        return None
    if performer_gemm.selected():  # the backward's recompute keeps the recorded forward as the state
        rows = _gemm_rows(p, chunk, q.dtype)
        out, state = performer_gemm.recorded_rows(q, k, v, rows, p.projection, p.eps, keep=keep_state)
        o.index_copy_(0, rows.rows, out)
        return state
    if keep_state and _keeps_performer_state(q):
        return torch.ops.nt_kernels.performer_fwd_state_table(o, q, k, v, chunk.rowptr, chunk.performer,
                                                              chunk.performer_table, p.projection, p.eps)
    torch.ops.nt_kernels.performer_fwd_table_into(o, q, k, v, chunk.rowptr, chunk.performer,
                                                  chunk.performer_table, p.projection, p.eps)
    return None


def _attention_bwd(p: Problem, chunk, dq, dk, dv, do, q, k, v, o, lse, state=None) -> None:
    if chunk.exact_plan is not None:
        softmax_bwd(dq, dk, dv, do, q, k, v, o, lse, chunk.exact_plan, p.scale, p.allow_tf32, work=chunk.exact_work,
                    memo=p.plan.memo)
    if chunk.performer is None:
        return
    if performer_gemm.selected():
        performer_gemm.backward_rows(dq, dk, dv, do, q, k, v, _gemm_rows(p, chunk, q.dtype), p.projection, p.eps,
                                     state)
        return
    if state is not None:
        torch.ops.nt_kernels.performer_bwd_state_table_into(dq, dk, dv, do, q, k, v, chunk.rowptr, chunk.performer,
                                                            chunk.performer_table, p.projection, p.eps, state)
    else:
        torch.ops.nt_kernels.performer_bwd_table_into(dq, dk, dv, do, q, k, v, chunk.rowptr, chunk.performer,
                                                      chunk.performer_table, p.projection, p.eps)


def _messages(p: Problem, chunk, seg_of_row, lse, *, store_z: bool, project: bool = True,
              keep_state: bool = False):
    """Steps 1-3 for one chunk: (y, o, q, k, v, z, dz/du, Performer state), every per-row buffer in the
    parameters' dtype (the autocast dtype under autocast); z and dz/du only if ``store_z``, y only if
    ``project``, the state (_attention_fwd) only if ``keep_state``."""
    rows, prec, emu = chunk.rows, p.dot_prec, p.bf16_emu
    qkv = qkv_buffer(p, chunk, p.dtype)
    z = torch.empty((rows, p.channels), dtype=p.dtype, device=p.device) if store_z else None
    jac = torch.empty((rows, p.channels), dtype=p.dtype, device=p.device) if store_z else None
    prologue(qkv, z, jac, p, chunk, seg_of_row, prec, emu)
    q, k, v = qkv[:, :rows].unbind(0)
    o = _uncovered_zeros(p, q.shape, q.dtype)
    state = _attention_fwd(p, chunk, o, lse, q, k, v, keep_state)
    if not project:
        return None, o, q, k, v, z, jac, state
    y = torch.empty((rows, p.out_channels), dtype=p.dtype, device=p.device)
    c = p.channels
    rows_gemm(y, o, p.w_out, rows=rows, a_part=0, **gemm_shape("y", c, p.out_channels), bias=p.b_out,
              dot_prec=prec, bf16_emu=emu)
    return y, o, q, k, v, z, jac, state


STORED, SPLIT, STREAM = "stored", "split", "stream"


def _sm90_paths(p: Problem) -> tuple[str, str]:
    """The backward's design for this layer, dtype and device: (the message gradient, the input gradients),
    each STREAM (the streaming kernels of ntconv_stream.py with the split-K weight gradients, where they
    apply: 16-bit parameters on any device; the default, NT_KERNELS_NTCONV_RECOMPUTE=stream: faster than the
    stored path on the H200 of 2026-11-28c), STORED (y, dy, z and dz/du stored: NT_KERNELS_NTCONV_RECOMPUTE=0,
    and wherever STREAM does not apply) or SPLIT (the recompute path's one-pass kernels with their split-K
    sums, ntconv_grad._message_grad_split_kernel and ntconv_igrad.py, where they apply: sm_90, 16-bit
    parameters; NT_KERNELS_NTCONV_RECOMPUTE=1, opt-in: slower than the stored path on the first H200 run).
    SPLIT and STREAM message gradients also give the forward's y from o on their own tiles."""
    design = os.environ.get("NT_KERNELS_NTCONV_RECOMPUTE", STREAM)
    if design not in ("0", "1", STREAM):
        raise ValueError(f"NT_KERNELS_NTCONV_RECOMPUTE={design!r}: choose 0 (stored), 1 (split) or stream")
    size = p.w_out.element_size()
    if design == STREAM:
        return (STREAM if stream_width(p.heads, p.head_dim, _grad_mode(p), size) else STORED,
                STREAM if du_stream_ok(p.channels, size, p.edge_dim if p.edge_attr is not None else 0) else STORED)
    if design == "0":
        return STORED, STORED
    arch = device_arch(p.device)
    return (SPLIT if split_width(p.heads, p.head_dim, _grad_mode(p), size, arch) > 0 else STORED,
            SPLIT if input_split_ok(p.channels, size, arch) else STORED)


def _project_with_gates(p: Problem, chunk, o, design: str):
    """(y, gate) of the forward on the message gradient's tiles of ``design`` (SPLIT or STREAM):
    y = o · w_outᵀ + b_out (gated aggregators: only the value halves written, the gates from the same tiles)."""
    y = torch.empty((chunk.rows, p.out_channels), dtype=p.dtype, device=p.device)
    gated = p.aggr in ("weighted_mean", "gated_sum")
    gate = torch.empty((chunk.rows, p.heads), dtype=torch.float32, device=p.device) if gated else None
    if design == STREAM:
        project_stream(y, gate, o, p, chunk, sigmoid=p.aggr == "gated_sum")
    else:
        project_forward(y, gate, o, p, chunk, grad_tiles(p.heads, p.head_dim),
                        block_c=split_width(p.heads, p.head_dim, _grad_mode(p), 2, SPLIT_MIN_ARCH),
                        num_warps=SPLIT_WARPS, sigmoid=p.aggr == "gated_sum")
    return y, gate


def _gates(p: Problem, chunk, y, seg_of_row):
    """Per-(row, head) gate for the reduction: sigmoid(gamma), gamma, or the centre softmax."""
    if p.aggr not in ("weighted_mean", "gated_sum"):
        return None
    gate = torch.empty((chunk.rows, p.heads), dtype=torch.float32, device=p.device)
    gate_values(gate, y, chunk.rows, p.heads, p.head_dim, sigmoid=p.aggr == "gated_sum")
    if p.aggr == "weighted_mean" and p.gate_group == "centre":
        segment_softmax(gate, chunk, seg_of_row, p.heads)
    return gate


def _finish(p: Problem, state: State, mode: int):
    """(out, stats) from the running state."""
    acc = state.acc
    stats = torch.zeros(0, dtype=torch.float32, device=p.device)
    if p.aggr == "mean":
        acc = acc / torch.diff(p.recv_rowptr).clamp(min=1).unsqueeze(1).to(acc.dtype)
    elif mode == AGG_MAX:  # as on CPU: 0 without messages; a NaN maximum gets count 0 and key NaN
        count, key = state.count.unbind(0)
        nan, received = torch.isnan(acc), count > 0
        acc = torch.where(nan | received, acc, torch.zeros_like(acc))
        stats = torch.stack([torch.where(nan, torch.zeros_like(count), count),
                             torch.where(nan, acc, torch.where(received, key, torch.zeros_like(key)))])
    elif mode == AGG_SOFTMAX:  # M and L per channel, equal across a head's: the head's first channel for stats
        total = state.run_sum
        acc = torch.where(total == 0, torch.zeros_like(acc), acc / total)
        run_sum, run_max = total[:, ::p.head_dim], state.run_max[:, ::p.head_dim]
        stats = torch.where(run_sum == 0, torch.zeros_like(run_sum),
                            run_max + torch.log(run_sum))  # 0 for empty receivers, as on CPU
    return acc.to(p.dtype), stats


def ntconv_fwd(centre, receiver_term, edge_attr, w_edge, w_qkv, b_qkv, w_out, b_out, rowptr, receiver, perm,
               recv_rowptr, recv_perm, exact_segments, performer_segments, exact_plan, projection, seed, heads,
               aggr, gate_group, dropout, scale, eps, *, chunk_rows=None, device_seed=False):
    """Triton implementation of ``nt_kernels::ntconv_fwd`` -> (out, lse, stats), ``lse`` empty: (0, H).

    The backward reruns each chunk's attention forward, lse included, and never reads a saved one, so
    the exact kernels write each chunk's lse to a transient buffer and the op keeps none (on a
    100M-message graph that is 1.6 GB per layer held from the forward to the backward, and its fill).
    ``chunk_rows`` (tests only) overrides the chunk size of a plan built here; ``device_seed`` (tests only)
    makes the kernels read a CPU seed's word from a device cell, as they do for a seed on the device.
    """
    p = problem("ntconv_fwd", locals())
    mode = _aggregation_mode(p)
    state = State.empty(p.num_out, p.channels, mode, torch.empty(0, dtype=p.dtype, device=p.device))
    design = _sm90_paths(p)[0]
    from_o = design != STORED
    for chunk in p.plan.chunks:
        seg_of_row = segment_of_rows(chunk)
        lse = _uncovered_zeros(p, (chunk.rows, p.heads), torch.float32)  # read by no later kernel
        y, o = _messages(p, chunk, seg_of_row, lse, store_z=False, project=not from_o)[:2]
        if from_o:  # y (gated: value halves) and the gates from the message gradient's tiles
            y, gate = _project_with_gates(p, chunk, o, design)
        else:
            gate = _gates(p, chunk, y, seg_of_row)
        receive(state, y, chunk, channels=p.channels, heads=p.heads, row=p.out_channels, mode=mode,
                apply_gelu=True, gate=gate, bf16_emu=p.bf16_emu)
    out, stats = _finish(p, state, mode)
    return out, torch.empty((0, p.heads), dtype=torch.float32, device=p.device), stats


def _grad_mode(p: Problem) -> int:
    """The message gradient's mode (ntconv_grad.py); GRAD_CENTRE_B: the two passes of the centre softmax."""
    if p.aggr == "weighted_mean" and p.gate_group == "centre":
        return GRAD_CENTRE_B
    return {"sum": GRAD_SUM, "mean": GRAD_MEAN, "max": GRAD_MAX, "gated_sum": GRAD_GATED_SUM,
            "weighted_mean": GRAD_SOFTMAX}[p.aggr]


def _message_grad(p: Problem, chunk, y, o, seg_of_row, saved: Saved):
    """(dy (rows, C_out), do (rows, C)) for one chunk, both in the parameters' dtype: do = dy · w_out
    fused into the message gradient (ntconv_grad.py) where a row's heads fit, else a row GEMM."""
    dy = torch.empty_like(y)
    do = torch.empty_like(o)
    fuse = grad_tiles(p.heads, p.head_dim).fuse_do
    grad_do = do if fuse else None
    if _grad_mode(p) == GRAD_CENTRE_B:
        gate = _gates(p, chunk, y, seg_of_row)
        wa = torch.empty((chunk.rows, p.heads), dtype=torch.float32, device=p.device)
        message_grad(dy, y, GRAD_CENTRE_A, p, chunk, saved, seg_of_row, gate=gate, wa=wa)
        seg_sum = torch.zeros((chunk.seg1 - chunk.seg0, p.heads), dtype=torch.float32, device=p.device)
        segment_sum(seg_sum, wa, chunk, p.heads)
        message_grad(dy, y, GRAD_CENTRE_B, p, chunk, saved, seg_of_row, do=grad_do, gate=gate, seg_sum=seg_sum)
    else:
        message_grad(dy, y, _grad_mode(p), p, chunk, saved, seg_of_row, do=grad_do)
    if not fuse:
        c_out = p.out_channels
        rows_gemm(do, dy, p.w_out, rows=chunk.rows, a_part=0, **gemm_shape("do", p.channels, c_out),
                  dot_prec=p.dot_prec, bf16_emu=p.bf16_emu)
    return dy, do


def _accumulators(shapes: dict, device, flat: bool) -> dict:
    """fp32 zeros of each named shape (None: not wanted).  ``flat``: views of one buffer, 16-byte
    aligned, filled by one launch, for accumulators the op casts to another dtype before returning
    them (so no two outputs share memory); otherwise one tensor each."""
    shapes = {n: s for n, s in shapes.items() if s is not None}
    if not flat:
        return {n: torch.zeros(s, dtype=torch.float32, device=device) for n, s in shapes.items()}
    sizes = {n: math.prod(s) for n, s in shapes.items()}
    starts = [0]
    for k in sizes.values():
        starts.append(starts[-1] + -(-k // 4) * 4)
    buffer = torch.zeros(starts[-1], dtype=torch.float32, device=device)
    return {n: buffer[at:at + sizes[n]].view(s) for (n, s), at in zip(shapes.items(), starts)}


class Grads:
    """fp32 gradient accumulators of one backward call (None where not asked for): the weights' in
    one buffer (one zero fill) when the parameters are not fp32, the node terms' likewise."""

    def __init__(self, p: Problem, input_mask):
        c, f32 = p.channels, torch.float32
        has_edge = p.edge_attr is not None
        nodes = _accumulators(dict(centre=(p.num_nodes, c) if input_mask[0] else None,
                                   receiver=(p.num_nodes, c) if input_mask[1] else None),
                              p.device, p.centre.dtype != f32)
        self.centre = nodes.get("centre")
        self.receiver = State(nodes["receiver"], out_type=p.centre) if input_mask[1] else None
        self.edge_attr = torch.zeros_like(p.edge_attr) if has_edge and input_mask[2] else None
        weights = _accumulators(dict(w_edge=(c, p.edge_dim) if has_edge else None, w_qkv=(3 * c, c), b_qkv=(3 * c,),
                                     w_out=(p.out_channels, c), b_out=(p.out_channels,)),
                                p.device, p.dtype != f32)
        self.w_edge = weights.get("w_edge")
        self.w_qkv, self.b_qkv, self.w_out, self.b_out = (weights[n] for n in ("w_qkv", "b_qkv", "w_out", "b_out"))


def _weight_grad(p: Problem, w_acc, b_acc, a, b, *, rows, m, n, a_split, a_part, b_row, index=None, row0=0):
    """w_acc += Aᵀ B (and b_acc += column sums of A) on the parameters' tensor cores (ntconv_wgrad.py)."""
    weight_grad(w_acc, b_acc, a, b, rows=rows, m=m, n=n, a_split=a_split, a_part=a_part, a_row=a_split, b_row=b_row,
                dtype=p.dtype, dot_prec=p.dot_prec, bf16_emu=p.bf16_emu, index=index, row0=row0)


def _du(p: Problem, chunk, du, dqkv, jac, seg_of_row, d_centre) -> None:
    """du = (dqkv · w_qkv) · dz/du from a stored dz/du, and d_centre += its per-segment sums."""
    c = p.channels
    if fused_centre(c):
        du_and_centre(du, dqkv, jac, p, chunk, seg_of_row, d_centre)
        return
    rows_gemm(du, dqkv, p.w_qkv, rows=chunk.rows, a_part=chunk.part_rows * c, **gemm_shape("du", c), mul=jac,
              dot_prec=p.dot_prec, bf16_emu=p.bf16_emu)
    if d_centre is not None:
        segment_sum(d_centre, du, chunk, c)


def _input_grads(p: Problem, chunk, g: Grads, dqkv, z, jac, seg_of_row, design: str) -> None:
    """Weight gradients of the prologue and the input gradients for one chunk: du = (dqkv · w_qkv) · dz/du
    in the parameters' dtype with d_centre and dW_qkv: by ``design`` (_sm90_paths) from the same kernel
    (SPLIT, ntconv_igrad.py), by the streaming kernel, which stores z once, then the split-K weight gradient
    (STREAM, ntconv_stream.py), or from the prologue's stored z and dz/du (STORED: the split-K weight
    gradient, then ntconv_gemm._du_kernel; a row GEMM and a segment reduction for C > DU_MAX_CHANNELS);
    then d_receiver_term and the edge gradients from du."""
    c, rows = p.channels, chunk.rows
    du = torch.empty((rows, c), dtype=p.dtype, device=p.device)
    d_centre = None if g.centre is None else g.centre[chunk.seg0:]
    if design == SPLIT:  # one pass over dqkv: z and dz/du recomputed from the node terms
        input_grad_split(du, dqkv, p, chunk, seg_of_row, d_centre, g.w_qkv, g.b_qkv)
    elif design == STREAM:  # z and dz/du recomputed, z stored for the split-K weight gradient
        z = torch.empty((rows, c), dtype=p.dtype, device=p.device)
        du_stream(du, z, dqkv, p, chunk, seg_of_row, d_centre)
        _weight_grad(p, g.w_qkv, g.b_qkv, dqkv, z, rows=rows, m=3 * c, n=c, a_split=c,
                     a_part=chunk.part_rows * c, b_row=c)
    else:
        # dW_qkv += [dq | dk | dv]ᵀ z and db_qkv: the (3, R, C) gradient read as one (R, 3C) operand.
        _weight_grad(p, g.w_qkv, g.b_qkv, dqkv, z, rows=rows, m=3 * c, n=c, a_split=c,
                     a_part=chunk.part_rows * c, b_row=c)
        _du(p, chunk, du, dqkv, jac, seg_of_row, d_centre)
    if g.receiver is not None:
        receive(g.receiver, du, chunk, channels=c, heads=p.heads, row=c, mode=AGG_SUM, apply_gelu=False)
    if p.edge_attr is not None:
        # dW_edge += duᵀ edge_attr[perm[rows]] (gathered in the kernel), then d_edge_attr row by row.
        f = p.edge_dim
        _weight_grad(p, g.w_edge, None, du, p.edge_attr, rows=rows, m=c, n=f, a_split=c, a_part=0, b_row=f,
                     index=p.perm, row0=chunk.row0)
        if g.edge_attr is not None:  # d_edge_attr[perm[r]] = du[r] · w_edge, written once per row
            d_edge = torch.empty((rows, f), dtype=g.edge_attr.dtype, device=p.device)
            rows_gemm(d_edge, du, p.w_edge, rows=rows, a_part=0, **gemm_shape("d_edge", c, edge_dim=f),
                      dot_prec=p.dot_prec, bf16_emu=p.bf16_emu)
            g.edge_attr.index_copy_(0, p.perm[chunk.row0:chunk.row1], d_edge)


def _backward_chunk(p: Problem, chunk, saved: Saved, g: Grads, paths: tuple[str, str]) -> None:
    """One chunk of the backward; ``paths``: _sm90_paths(p), read once per call."""
    rows, c, c_out = chunk.rows, p.channels, p.out_channels
    seg_of_row = segment_of_rows(chunk)
    # lse rows of Performer segments are never read; zeros where a row may belong to no list.
    lse = _uncovered_zeros(p, (rows, p.heads), torch.float32)
    # Recompute steps 1-2 (and 3 unless the message gradient recomputes y from o; z and dz/du unless the input
    # gradients recompute them), then dy from the saved state.
    message, inputs = paths
    y, o, q, k, v, z, jac, state = _messages(p, chunk, seg_of_row, lse, project=message == STORED,
                                             store_z=inputs == STORED, keep_state=True)
    if message == SPLIT:  # do, dW_out and db_out from o in one pass: neither y nor dy is stored
        do = torch.empty_like(o)
        message_grad_split(do, o, _grad_mode(p), p, chunk, saved, g.w_out, g.b_out)
    else:  # dy and do = dy · w_out (from o, or from the stored y), then dW_out += dyᵀ o and db_out
        if message == STREAM:
            dy, do = torch.empty((rows, c_out), dtype=p.dtype, device=p.device), torch.empty_like(o)
            dy_stream(dy, do, o, _grad_mode(p), p, chunk, saved)
        else:
            dy, do = _message_grad(p, chunk, y, o, seg_of_row, saved)
        _weight_grad(p, g.w_out, g.b_out, dy, o, rows=rows, m=c_out, n=c, a_split=c_out, a_part=0, b_row=c)
    # Attention backward, then the prologue's gradients.
    dqkv = qkv_buffer(p, chunk, p.dtype, fill=not p.plan.rows_covered)
    _attention_bwd(p, chunk, *dqkv[:, :rows].unbind(0), do, q, k, v, o, lse, state)
    _input_grads(p, chunk, g, dqkv, z, jac, seg_of_row, inputs)


def ntconv_bwd(grad_out, out, lse, stats, centre, receiver_term, edge_attr, w_edge, w_qkv, b_qkv, w_out, b_out,
               rowptr, receiver, perm, recv_rowptr, recv_perm, exact_segments, performer_segments, exact_plan,
               projection, seed, heads, aggr, gate_group, dropout, scale, eps, input_mask, *, chunk_rows=None,
               device_seed=False):
    """Triton implementation of ``nt_kernels::ntconv_bwd`` -> the eight gradients of docs/design.md §9
    (``chunk_rows``, ``device_seed``: as for ntconv_fwd)."""
    p = problem("ntconv_bwd", locals())
    saved = Saved(grad_out.to(p.dtype).contiguous(), out.contiguous(), stats.contiguous())
    g = Grads(p, input_mask)
    paths = _sm90_paths(p)
    for chunk in p.plan.chunks:
        _backward_chunk(p, chunk, saved, g, paths)
    empty = p.centre.new_zeros(0)  # gradients not asked for, or of absent inputs (as the fake kernel)

    def final(grad, like):
        return empty if grad is None else grad.to(like.dtype)
    d_receiver = None if g.receiver is None else g.receiver.acc
    return (final(g.centre, centre), final(d_receiver, receiver_term),
            empty if g.edge_attr is None else g.edge_attr, final(g.w_edge, p.centre if w_edge is None else w_edge),
            final(g.w_qkv, w_qkv), final(g.b_qkv, b_qkv), final(g.w_out, w_out), final(g.b_out, b_out))


def register() -> bool:
    """Make these functions the CUDA kernels of ``ntconv_fwd`` / ``ntconv_bwd`` once the op
    schemas exist (csrc/ops/ntconv.cpp); returns whether they were registered."""
    if not hasattr(torch.ops.nt_kernels, "ntconv_fwd"):
        return False
    register_kernel("nt_kernels::ntconv_fwd", "cuda", ntconv_fwd)
    register_kernel("nt_kernels::ntconv_bwd", "cuda", ntconv_bwd)
    return True
