"""Modelled bytes and FLOPs per kernel of one fused NT layer on CUDA (forward + backward), no GPU needed.

Counts what each kernel of nt_kernels/backends/triton/ntconv_op.py must read and write for one layer of R packed rows
(each value once; 32-byte sectors, L2 hits and the plan's small tables not counted) and the tensor-core FLOPs of its
products, and the time each implies at the H100 roofline: 3.0 TB/s copy bandwidth (docs/runs/h100-2026-11-26.md,
roofline run) and 989 TFLOP/s dense bf16; next to it the latency bound (issue 40, LATENCY_MODEL): the bytes in flight
per SM and the time the reads take at the bandwidth Little's law allows with them; the larger of the two bounds per
kernel, summed per layer. Arithmetic, unverified on GPU. The default shape is the tolokers preset under bf16 autocast
(R = 1,038,000 rows in one chunk, N = 11,758 nodes, C = 60, gated_sum: C_out = 120, H = 2, node terms bf16 from
autocast's nn.Linear, no edge features), its rows in the classes the attention kernels see (packed exact tiles,
multi-tile exact segments, Performer segments: built in, or recounted from the graph with ``--graph``); each attention
kernel is counted as written (:func:`attention`).

    python scripts/ntconv_bytes.py                  # the recompute path (NT_KERNELS_NTCONV_RECOMPUTE=1, sm_90)
    python scripts/ntconv_bytes.py --stored-y       # the default: y, dy, z, dz/du stored (and sm_80 / 89, fp32)
    python scripts/ntconv_bytes.py --stream         # the streaming design (NT_KERNELS_NTCONV_RECOMPUTE=stream)
    python scripts/ntconv_bytes.py --stream --pipe  # with the pipelined reductions (NT_KERNELS_NTCONV_REDUCE=pipe)
    python scripts/ntconv_bytes.py --before         # issue 19's code: fp32 intermediates, unfused do, d_centre
    python scripts/ntconv_bytes.py --floor          # the fewest bytes with recompute and these attention kernels
    NT_KERNELS_DATA=../shared/data/heterophilous python scripts/ntconv_bytes.py --graph tolokers
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ntconv_latency import LATENCY, LATENCY_MODEL, SMS, latency_time  # noqa: E402,F401  (issue 40's latency bound)

BANDWIDTH = 3.0e12   # bytes/s, H100 copy (measured, docs/runs/h100-2026-11-26.md)
TENSOR_FLOPS = 989e12  # dense bf16, H100 SXM
PERFORMER_CHUNK = 256  # rows per chunk of the CUDA Performer kernels (csrc/cuda/segment_performer_*.cuh)


@dataclass(frozen=True)
class Classes:
    """Where one layer's rows go: packed exact tiles (segments of at most the tallest packed tile), multi-tile
    exact segments, and the Performer segments (n > n*: their rows, count and 256-row chunks); and the graph's
    nodes.  The defaults are tolokers' (`--graph tolokers`: H = 2, D = 30, m = 102, n* = 218, bf16 packed tiles
    up to 64 rows)."""

    nodes: int = 11_758
    packed: int = 160_670
    multi: int = 298_992
    performer: int = 578_338
    performer_segments: int = 1_272
    performer_chunks: int = 2_889

    @property
    def rows(self) -> int:
        return self.packed + self.multi + self.performer


def graph_classes(graph: str, dim: int, features: int) -> Classes:
    """The row classes of a real graph (needs NT_KERNELS_DATA or ../shared/data/heterophilous)."""
    import torch

    from nt_kernels.backends.triton.plan import max_packed_tile
    from nt_kernels.csr import NeighbourhoodCSR
    from nt_kernels.data.datasets import load_dataset
    from nt_kernels.performer import switch_threshold

    data = load_dataset(graph, None)
    sizes = torch.diff(NeighbourhoodCSR.from_edge_index(data.edge_index, data.num_nodes).rowptr)
    big = sizes > switch_threshold(features, dim)
    tall = sizes > max_packed_tile(torch.bfloat16, dim)
    perf = sizes[big]
    return Classes(data.num_nodes, int(sizes[~big & ~tall].sum()), int(sizes[~big & tall].sum()), int(perf.sum()),
                   int(perf.numel()), int(((perf + PERFORMER_CHUNK - 1) // PERFORMER_CHUNK).sum()))


def attention(cl: Classes, c: int, heads: int, s: int, features: int) -> dict[str, list[tuple[str, int]]]:
    """Device bytes of the attention kernels per pass ("fwd", "bwd": the backward's attention backward; the
    backward's forward again is "fwd" once more), each value once.  Exact kernels (softmax_fwd.py,
    softmax_bwd.py): q, k, v read, o and lse written; the packed backward reads q, k, v, do and lse (delta from
    P and dP, no o) and writes dq, dk, dv; the multi-tile backward also reads o and writes and reads delta.  The
    CUDA Performer (docs/kernels-performer-cuda.md): the keys pass reads k, v and writes fp32 chunk partials
    (m x (D + 1) and D + 2 per head and chunk) that its combine reads back into W per segment; the query pass
    reads q and W, writes o; the backward runs the keys pass again, the query pass (q, do read, dq written, the
    C partials written, combined and read) and the key-gradient pass (k, v and W, C read, dk, dv written).
    W and C are read once per segment here (scripts/performer_tc_roofline.py counts them per chunk: L2 hits)."""
    row, lse = c * s, 4 * heads
    mat = features * (c // heads + 1) * 4 * heads  # W (or C) of one segment, fp32
    part = cl.performer_chunks * (mat + heads * (c // heads + 2) * 4)
    seg = cl.performer_segments * mat
    x = cl.performer * row
    keys = ("Performer keys pass + combine (k, v -> W)", 2 * x + 2 * part + seg)
    return {
        "fwd": [("exact, packed tiles: q, k, v -> o, lse", cl.packed * (4 * row + lse)),
                ("exact, multi-tile segments: q, k, v -> o, lse", cl.multi * (4 * row + lse)),
                keys, ("Performer query pass (q, W -> o)", 2 * x + seg)],
        "bwd": [("exact, packed tiles: q, k, v, do, lse -> dq, dk, dv", cl.packed * (7 * row + lse)),
                ("exact, multi-tile: q, k, v, o, do, lse -> delta, dq, dk, dv", cl.multi * (8 * row + 3 * lse)),
                keys, ("Performer query gradients (q, do, W -> dq, C)", 3 * x + 2 * part + 2 * seg),
                ("Performer key gradients (k, v, W, C -> dk, dv)", 4 * x + 2 * seg)],
    }


def kernels(rows, nodes, c, c_out, heads, edge_dim, node_size, param_size, inter_size, fused_do, gated, att,
            rows_in_plan=True, sm90=False, stream=False):
    """[(pass, kernel, bytes, tensor-core FLOPs, owner note, bytes read, LATENCY_MODEL key, bytes in flight
    per tile row)] of one layer; the last three None where no latency is modelled (the attention kernels,
    plan plumbing).  ``att``: :func:`attention`'s kernels (their tensor-core FLOPs are not listed:
    docs/kernels-performer-cuda.md has the Performer's, the exact kernels' are small); ``rows_in_plan``: the
    segment of every row is read from the plan (issue 27), not computed per call (``segment_of_rows``,
    before); ``sm90``: the recompute path of sm_90 with 16-bit parameters: the forward's projection writes only
    what the reduction reads, the gates from the same tiles (``_project_kernel``), the backward's message
    gradient recomputes y from o and sums dW_out itself (``_message_grad_split_kernel``: y and dy never
    stored), and the input gradients recompute z and dz/du and sum dW_qkv with du and d_centre in one pass over
    dqkv (``_input_grad_split_kernel``: z and dz/du never stored); ``stream`` (issue 40,
    NT_KERNELS_NTCONV_RECOMPUTE=stream): the streaming kernels (ntconv_stream.py): the forward's projection as
    on sm_90, the message gradient from o storing dy once, the input gradients from the gathered node terms
    storing z once, both weight gradients by the split-K GEMM, d_centre by the segment reduction of du."""
    r, s, i = rows, param_size, inter_size
    index = 8  # int64 per row: receiver, centre segment (seg_of_row), perm
    edge = (index + edge_dim * node_size) * r if edge_dim else 0
    gathers = (2 * index + c * node_size) * r + edge  # what the prologue reads per row
    gather_row = 2 * index + 2 * c * node_size + (index + edge_dim * node_size if edge_dim else 0)
    prologue = gathers + 3 * c * s * r + nodes * c * node_size
    prologue_flops = 2 * r * c * 3 * c + 2 * r * edge_dim * c
    none = (None, None, None)
    att_fwd = [("fwd", f"attention: {name}", nbytes, 0, "", *none) for name, nbytes in att["fwd"]]
    att_again = [("bwd", f"attention again: {name}", nbytes, 0, "", *none) for name, nbytes in att["fwd"]]
    att_bwd = [("bwd", f"attention backward: {name}", nbytes, 0, "", *none) for name, nbytes in att["bwd"]]
    values = c if gated else c_out  # the columns a receiver reduction reads
    gate = 4 * heads * r if gated else 0
    y_gemm = (c * s + c_out * i) * r
    splits = 512
    from_o = sm90 or stream
    gemm_inflight = 2 * (32 * s + 128 * s)  # per tile row: 2 stages of a 32-column A step and a 32 x 128 W step
    reduce_row = 4 + values * i + (4 if gated else 0)
    out = [] if rows_in_plan else [("fwd", "segment_of_rows (torch.searchsorted)", index * r, 0, "plan plumbing",
                                    *none)]
    out += [("fwd", "_prologue_kernel", prologue, prologue_flops, "", gathers, "prologue", gather_row)] + att_fwd
    if from_o:  # o read; y written (gated: the value halves) with the gates
        name = "project_stream" if stream else "project"
        out.append(("fwd", f"_{name}_kernel: y (value halves) and gates from o", (c * s + values * i) * r + gate,
                    2 * r * c * c_out, "", c * s * r, name, c * s * (2 if stream else 1)))
    else:
        out.append(("fwd", "_rows_gemm_kernel: y = o w_outᵀ + b", y_gemm, 2 * r * c * c_out, "", c * s * r,
                    "rows_gemm", gemm_inflight))
        if gated:
            out.append(("fwd", "_gate_kernel", (c * i) * r + gate, 0, "", c * i * r, "gate", c * i))
    out.append(("fwd", "_reduce_kernel (receivers) + merge", (4 + values * i) * r + gate + 2 * 2 * nodes * c * 4,
                0, "", reduce_row * r, "reduce", reduce_row))
    if not rows_in_plan:
        out.append(("bwd", "segment_of_rows", index * r, 0, "plan plumbing", *none))
    wgrad_inflight = 2 * (64 * s + 64 * s)  # per row: 2 stages of a 64-column A and B step
    w_out_grad = ("bwd", "_weight_grad_kernel: w_out (dyᵀ o) + combine", (c_out * i + c * s) * r
                  + 2 * splits * c_out * (c + 1) * 4, 2 * r * c_out * (c + 16), "", (c_out * i + c * s) * r,
                  "weight_grad", wgrad_inflight)
    w_qkv_grad = ("bwd", "_weight_grad_kernel: w_qkv (dqkvᵀ z) + combine", (3 * c * s + c * s) * r
                  + 2 * splits * 3 * c * (c + 1) * 4, 2 * r * 3 * c * (c + 16), "", (3 * c * s + c * s) * r,
                  "weight_grad", wgrad_inflight)
    if sm90:
        out += [("bwd", "_prologue_kernel", prologue, prologue_flops, "", gathers, "prologue", gather_row)]
        out += att_again + [
                # o, receiver and g = grad_out[receiver] read, do written, dW_out / db_out partials
                ("bwd", "_message_grad_split_kernel: y from o, do, dW_out + combine",
                 (c * s + index + c * s + c * s) * r + 2 * splits * c_out * (c + 1) * 4, 3 * 2 * r * c * c_out, "",
                 (c * s + index + c * s) * r, "message_grad_split", c * s + index + c * s)
                ] + att_bwd + [
                # the prologue's gathers again, dqkv read once, du written, dW_qkv / db_qkv partials (d_centre: the
                # segment reduction of du since issue 40: the fused tile sums spilled)
                ("bwd", "_input_grad_split_kernel: z, dz/du again, du, dW_qkv + combine",
                 gathers + (3 * c * s + c * i) * r + 2 * splits * 3 * c * (c + 1) * 4,
                 2 * 2 * r * 3 * c * c + 2 * r * edge_dim * c, "", gathers + 3 * c * s * r, "input_grad_split",
                 gather_row + 3 * c * s),
                ("bwd", "_reduce_kernel: d_centre (segment sums of du)", c * i * r + 2 * nodes * c * 4, 0, "",
                 c * i * r, "reduce", c * i)]
    elif stream:
        out += [("bwd", "_prologue_kernel", prologue, prologue_flops, "", gathers, "prologue", gather_row)]
        out += att_again + [
                # o, receiver and g read; dy (bf16, once) and do written
                ("bwd", "_dy_stream_kernel: y from o, dy, do", (c * s + index + c * s + c_out * i + c * s) * r,
                 2 * 2 * r * c * c_out, "", (c * s + index + c * s) * r, "dy_stream",
                 2 * c * s + index + c * s // heads),
                w_out_grad] + att_bwd + [
                # the prologue's gathers again, dqkv read once, du and z written
                ("bwd", "_du_stream_kernel: z, dz/du again, du, z", gathers + (3 * c * s + c * i + c * s) * r,
                 2 * r * 3 * c * c, "", gathers + 3 * c * s * r, "du_stream", gather_row + 3 * c * s),
                w_qkv_grad,
                ("bwd", "_reduce_kernel: d_centre (segment sums of du)", c * i * r + 2 * nodes * c * 4, 0, "",
                 c * i * r, "reduce", c * i)]
    else:
        grad_in = (c_out * i + index + c * s) * r  # y, receiver, g = grad_out[receiver]
        out += [("bwd", "_prologue_kernel (+ z, dz/du)", prologue + (c * s + c * i) * r, prologue_flops, "", gathers,
                 "prologue", gather_row)]
        out += att_again + [("bwd", "_rows_gemm_kernel: y", y_gemm, 2 * r * c * c_out, "", c * s * r, "rows_gemm",
                             gemm_inflight)]
        grad_row = c_out * i + index + c * s
        if fused_do:
            out.append(("bwd", "_message_grad_kernel: dy, do = dy w_out", grad_in + (c_out * i + c * s) * r,
                        2 * r * c_out * c, "", grad_in, "message_grad", grad_row))
        else:
            out += [("bwd", "_message_grad_kernel: dy", grad_in + c_out * i * r, 0, "", grad_in, "message_grad",
                     grad_row),
                    ("bwd", "_rows_gemm_kernel: do = dy w_out", (c_out * i + c * s) * r, 2 * r * c_out * c, "",
                     c_out * i * r, "rows_gemm", gemm_inflight)]
        out += [w_out_grad] + att_bwd + [w_qkv_grad]
        du = (3 * c * s + 2 * c * i + (index if fused_do else 0)) * r
        du_reads = (3 * c * s + c * i + (index if fused_do else 0)) * r
        if fused_do:  # the tile's segment sums ride along (one-hot products), crossing segments' partials fixed up
            out.append(("bwd", "_du_kernel: du = (dqkv w_qkv) dz/du, d_centre", du + 2 * nodes * c * 4,
                        2 * r * 3 * c * c + 2 * r * 32 * c, "", du_reads, "du", 2 * (32 * s + 32 * s)))
        else:
            out += [("bwd", "_rows_gemm_kernel: du = (dqkv w_qkv) dz/du", du, 2 * r * 3 * c * c, "", du_reads,
                     "rows_gemm", gemm_inflight),
                    ("bwd", "_reduce_kernel: d_centre", c * i * r, 0, "", c * i * r, "reduce", c * i)]
    out.append(("bwd", "_reduce_kernel: d_receiver_term", (4 + c * i) * r, 0, "", (4 + c * i) * r, "reduce",
                4 + c * i))
    if edge_dim:
        out += [("bwd", "_weight_grad_kernel: w_edge", (c * i + index + edge_dim * node_size) * r,
                 2 * r * c * edge_dim, "", (c * i + index + edge_dim * node_size) * r, "weight_grad", wgrad_inflight),
                ("bwd", "_rows_gemm_kernel: d_edge_attr", (c * i + edge_dim * node_size) * r, 2 * r * c * edge_dim,
                 "", c * i * r, "rows_gemm", gemm_inflight)]
    return out


def floor(rows, c, node_size, param_size, att):
    """The fewest bytes one layer can move while the backward recomputes q, k, v and o (this design) and
    the attention kernels (``att``, :func:`attention`) read and write what they do now: every kernel outside
    attention fused as far as it can be (y, gates and the receiver reduction from o; the w_qkv gradient and du
    in one pass over dqkv, z and dz/du recomputed from the gathered node terms), each per-row value once.
    [(pass, stage, bytes)]"""
    r, s, index = rows, param_size, 8
    gather = 2 * index + c * node_size            # receiver and segment ids, the receiver-term row
    qkv, o = 3 * c * s, c * s
    attention_fwd = sum(b for _, b in att["fwd"])
    return [("fwd", "prologue: gathers -> q, k, v", (gather + qkv) * r),
            ("fwd", "attention forward (the kernels as they are)", attention_fwd),
            ("fwd", "y, gates and the receiver reduction from o", (o + index) * r),
            ("bwd", "prologue again: gathers -> q, k, v", (gather + qkv) * r),
            ("bwd", "attention forward again", attention_fwd),
            ("bwd", "message gradient from o: o, g -> do, dW_out", (o + index + c * s + c * s) * r),
            ("bwd", "attention backward (the kernels as they are)", sum(b for _, b in att["bwd"])),
            ("bwd", "w_qkv gradient and du: dqkv, gathers -> du, dW_qkv, d_centre", (qkv + gather + c * s) * r),
            ("bwd", "d_receiver_term: du", (c * s + 4) * r)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--graph", default=None, help="take the row classes (packed exact tiles, multi-tile exact, "
                        "Performer), the rows and the nodes from this graph (needs its npz; default: tolokers', built in)")
    parser.add_argument("--features", type=int, default=102, help="Performer features m")
    for name, default in (("--channels", 60), ("--heads", 2), ("--edge-dim", 0)):
        parser.add_argument(name, type=int, default=default)
    parser.add_argument("--aggr-gated", dest="gated", action=argparse.BooleanOptionalAction, default=True,
                        help="a gated aggregator (C_out = 2C; tolokers: gated_sum)")
    parser.add_argument("--node-bytes", type=int, default=2, help="bytes per node-term value (bf16 under autocast)")
    parser.add_argument("--before", action="store_true",
                        help="issue 19's code: fp32 y, dy, du, dz/du; do by a row GEMM; d_centre a reduction of du")
    parser.add_argument("--stored-y", action="store_true",
                        help="the backward stores y, dy, z and dz/du (fp32 parameters, sm_80 / sm_89, "
                             "the default until NT_KERNELS_NTCONV_RECOMPUTE=1; y and dy also for max and the centre softmax)")
    parser.add_argument("--stream", action="store_true",
                        help="the streaming design (issue 40, NT_KERNELS_NTCONV_RECOMPUTE=stream): dy and z stored once, "
                             "the weight gradients by the split-K GEMM")
    parser.add_argument("--pipe", action="store_true", help="NT_KERNELS_NTCONV_REDUCE=pipe (issue 40): latency model reduce_pipe")
    parser.add_argument("--floor", action="store_true",
                        help="the fewest bytes this design allows with the attention kernels as they are")
    args = parser.parse_args()
    c = args.channels
    classes = graph_classes(args.graph, c // args.heads, args.features) if args.graph else Classes()
    att = attention(classes, c, args.heads, 2, args.features)
    rows_total = classes.rows
    if args.floor:
        stages = floor(rows_total, c, args.node_bytes, 2, att)
        print("| pass | stage | bytes |\n|---|---|---:|")
        for phase, name, nbytes in stages:
            print(f"| {phase} | {name} | {nbytes / 1e6:,.0f} MB |")
        print(f"| | **total** | **{sum(b for _, _, b in stages) / 1e9:.2f} GB** |")
        return
    rows = kernels(rows_total, classes.nodes, c, 2 * c if args.gated else c, args.heads, args.edge_dim, args.node_bytes,
                   2, 4 if args.before else 2, not args.before, args.gated, att, rows_in_plan=not args.before,
                   sm90=not (args.before or args.stored_y or args.stream), stream=args.stream)
    rows = [(*r[:6], "reduce_pipe" if args.pipe and r[6] == "reduce" else r[6], r[7]) for r in rows]
    print("| pass | kernel | bytes | tensor-core FLOP | time at roofline | in flight / SM | latency bound | bound |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    total_bytes = total_time = total_bound = 0.0
    for phase, name, nbytes, flops, note, reads, model, inflight_row in rows:
        t = max(nbytes / BANDWIDTH, flops / TENSOR_FLOPS)
        total_bytes, total_time = total_bytes + nbytes, total_time + t
        if model is None:
            lat_text, bound = "– | –", t
        else:
            inflight, t_lat = latency_time(model, rows_total, reads, inflight_row)
            lat_text, bound = f"{inflight / 1024:.1f} KB | {t_lat * 1e3:.3f} ms", max(t, t_lat)
        total_bound += bound
        which = "latency" if bound > t else "bytes"
        print(f"| {phase} | {name} | {nbytes / 1e6:,.0f} MB | {flops / 1e9:,.0f} G | {t * 1e3:.3f} ms | {lat_text} | "
              f"{which}{' (' + note + ')' if note else ''} |")
    print(f"| | **total** | **{total_bytes / 1e9:.2f} GB** | | **{total_time * 1e3:.2f} ms** | | "
          f"**{total_bound * 1e3:.2f} ms** (the larger bound per kernel) | |")


if __name__ == "__main__":
    main()
