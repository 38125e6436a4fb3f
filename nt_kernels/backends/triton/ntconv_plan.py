"""Work plan of the fused NT layer on CUDA (``nt_kernels::ntconv_fwd`` / ``ntconv_bwd``).

The fused op never holds per-message activations for the whole graph: it
walks the graph in *chunks* of whole neighbourhoods (consecutive centre
segments) of about ``chunk_rows`` packed rows, and every per-message buffer
(q, k, v, o, the messages, their gradients) is sized by one chunk.  Chunk
boundaries depend only on the graph and ``chunk_rows`` (never on the device
or a thread count), so results are reproducible.

Chunking: chunk c starts at the first segment whose first row is at or after
``c * chunk_rows`` (repeated starts merged, chunks without rows dropped).  A
chunk therefore holds fewer than ``chunk_rows + max_degree`` rows, and a
neighbourhood is never split between chunks.

The plan is one int64 tensor on the graph's device (it travels in the op's
``exact_plan`` slot and is cached on the CSR by :func:`cached_plan`):

  header[0..15]     FUSED_MAGIC and the sizes it was built for (H_* below)
  chunk table       CHUNK_FIELDS words per chunk (C_* below)
  per chunk         the exact kernel's work list for the chunk's exact segments
                    (``plan.build_plan`` over the chunk-local rowptr), the
                    chunk's Performer segment ids (chunk-local), and the
                    chunk-local rowptr (``rowptr[s0:s1+1] - row0``)
  groups            int32 triples (receiver, first, end): the chunk's rows
                    grouped by receiver, positions into ``rrow``
  rrow              int32, per chunk: its local rows ordered by (receiver,
                    row); chunk c occupies positions row0..row1 of it

The receiver groups let one program per (chunk, receiver) reduce the chunk's
messages for that receiver in a fixed order and merge them into the running
result (docs/kernels.md, "Fused NT layer").  Building a plan syncs with the
host a few times (once per graph when cached); the op reads the header and the
chunk table once per call (:func:`read_plan`, one small device-to-host copy).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nt_kernels.backends.triton.plan import build_plan

__all__ = ["Chunk", "FUSED_MAGIC", "Plan", "build_ntconv_plan", "cached_plan", "default_chunk_rows", "read_plan"]

FUSED_MAGIC = 0x4E54_4631  # "NTF1"
HEADER = 16
(H_MAGIC, H_CHUNKS, H_CHUNK_ROWS, H_ROWS, H_SEGMENTS, H_OUT, H_MAX_TILE, H_EXACT, H_PERF,
 H_GROUPS_OFF, H_RROW_OFF, H_GROUPS, H_RECV_BOUND) = range(13)
CHUNK_FIELDS = 12
(C_ROW0, C_ROW1, C_SEG0, C_SEG1, C_EXACT_OFF, C_EXACT_LEN, C_EXACT, C_PERF_OFF, C_PERF,
 C_RPTR_OFF, C_GROUP0, C_GROUP1) = range(CHUNK_FIELDS)
CHUNK_BYTES = 4 << 30  # transient per-chunk buffers of the backward, about 64 B per row and channel


def default_chunk_rows(channels: int) -> int:
    """Rows per chunk for a layer of C = ``channels``: a power of two near
    CHUNK_BYTES / (64 C), in [1024, 2**24] (2**20 for C = 64)."""
    rows = CHUNK_BYTES // (64 * max(int(channels), 1))
    return min(max(1 << (rows.bit_length() - 1), 1024), 1 << 24)


@dataclass(frozen=True)
class Chunk:
    """One chunk as the host sees it: rows ``row0:row1``, segments ``seg0:seg1``
    and views into the plan (None where the chunk has no such segments)."""

    row0: int
    row1: int
    seg0: int
    seg1: int
    exact_plan: torch.Tensor | None   # work list of the exact kernel, chunk-local rows
    performer: torch.Tensor | None    # chunk-local Performer segment ids (int64)
    rowptr: torch.Tensor              # chunk-local rowptr (seg1 - seg0 + 1,) int64
    group0: int                       # first receiver group (index into the group triples)
    num_groups: int
    rrow: torch.Tensor                # (row1 - row0,) int32 local rows in receiver order

    @property
    def rows(self) -> int:
        return self.row1 - self.row0


@dataclass(frozen=True)
class Plan:
    """The host's view of a fused plan: its chunks and the int32 group triples of all chunks."""

    chunks: list[Chunk]
    groups: torch.Tensor


def _sorted_ids(op: str, name: str, ids: torch.Tensor, num_segments: int) -> torch.Tensor:
    ids = torch.sort(ids.reshape(-1).to(torch.int64)).values
    if ids.numel():
        lo, hi, dup = torch.stack([ids[0], ids[-1], (torch.diff(ids) == 0).sum()]).tolist()
        if lo < 0 or hi >= num_segments:
            raise ValueError(f"{op}: {name} holds segment id {lo if lo < 0 else hi} outside [0, {num_segments})")
        if dup:
            raise ValueError(f"{op}: {name} lists a segment twice")
    return ids


def _check_graph(op: str, rowptr: torch.Tensor, num_rows: int, perm: torch.Tensor | None) -> None:
    steps = torch.diff(rowptr)
    first, last, min_step = torch.stack([rowptr[0], rowptr[-1], steps.min() if steps.numel() else rowptr[0] * 0]
                                        ).tolist()
    if first != 0 or last != num_rows or min_step < 0:
        raise ValueError(f"{op}: rowptr must start at 0, never decrease and end at E = {num_rows} "
                         f"(got first {first}, last {last})")
    if perm is not None and num_rows:
        lo, hi = torch.stack([perm.min(), perm.max()]).tolist()
        if lo < 0 or hi >= num_rows:
            raise ValueError(f"{op}: perm holds edge {lo if lo < 0 else hi} outside [0, {num_rows})")


def _chunk_bounds(rowptr: torch.Tensor, num_rows: int, chunk_rows: int) -> tuple[list[int], list[int]]:
    """Segment and row boundaries of the chunks (host lists, one sync)."""
    num_segments = rowptr.numel() - 1
    marks = torch.arange(0, num_rows, chunk_rows, device=rowptr.device)
    first = torch.searchsorted(rowptr, marks)
    seg = torch.unique(torch.cat([first, first.new_tensor([num_segments])]))
    seg_bounds = seg.tolist()
    row_bounds = rowptr[seg].tolist()
    keep = [0] + [i for i in range(1, len(seg_bounds)) if row_bounds[i] > row_bounds[i - 1]]
    return [seg_bounds[i] for i in keep], [row_bounds[i] for i in keep]


def _receiver_groups(receiver: torch.Tensor, row_starts: torch.Tensor, num_out: int):
    """(rrow, group triples, group start positions): rows ordered by (chunk, receiver, row)."""
    num_rows = receiver.numel()
    rows = torch.arange(num_rows, device=receiver.device)
    chunk_of = torch.searchsorted(row_starts, rows, right=True) - 1
    key = chunk_of * max(num_out, 1) + receiver
    order = torch.argsort(key, stable=True)
    rrow = (order - row_starts[chunk_of]).to(torch.int32)   # position i lies in the chunk of row i
    sorted_key = key[order]
    is_first = torch.ones(num_rows, dtype=torch.bool, device=receiver.device)
    is_first[1:] = sorted_key[1:] != sorted_key[:-1]
    starts = torch.nonzero(is_first).squeeze(1)
    ends = torch.cat([starts[1:], starts.new_tensor([num_rows])])
    base = row_starts[chunk_of[starts]]
    groups = torch.stack([receiver[order[starts]], starts - base, ends - base], 1).to(torch.int32)
    return rrow, groups.reshape(-1), starts


def _as_words(x: torch.Tensor) -> torch.Tensor:
    """An int32 tensor packed into int64 words (zero-padded to an even length)."""
    if x.numel() % 2:
        x = torch.cat([x, x.new_zeros(1)])
    return x.view(torch.int64)


def build_ntconv_plan(rowptr: torch.Tensor, receiver: torch.Tensor, exact_segments: torch.Tensor,
                      performer_segments: torch.Tensor, num_out: int, chunk_rows: int,
                      max_tile: int, op: str = "ntconv", num_nodes: int | None = None,
                      perm: torch.Tensor | None = None) -> torch.Tensor:
    """Build the fused op's plan (module docstring) on ``rowptr``'s device.

    ``receiver`` (E,) is the receiver of every packed row, ``num_out`` the
    number of output rows; the segment lists are those of the op call, checked
    here (ids in range, none twice), like the receivers (< ``num_out`` and, when
    given, < ``num_nodes``, the rows of the receiver term), the row pointer
    (0 first, non-decreasing, E last) and, when given, ``perm`` (values in
    [0, E)).  Syncs with the host a few times.
    """
    device = rowptr.device
    rowptr = rowptr.to(torch.int64)
    num_rows, num_segments = receiver.numel(), rowptr.numel() - 1
    if num_rows and not 0 <= num_out < 2 ** 31:
        raise ValueError(f"{op}: the number of output rows must be in [0, 2**31), got {num_out}")
    _check_graph(op, rowptr, num_rows, perm)
    recv_bound = 0
    if num_rows:
        lo, hi = torch.stack([receiver.min(), receiver.max()]).tolist()
        limit = num_out if num_nodes is None else min(num_out, num_nodes)
        if lo < 0 or hi >= limit:
            raise ValueError(f"{op}: receiver holds node {lo if lo < 0 else hi} outside [0, {limit})")
        recv_bound = hi + 1
    exact = _sorted_ids(op, "exact_segments", exact_segments.to(device), num_segments)
    perf = _sorted_ids(op, "performer_segments", performer_segments.to(device), num_segments)
    seg_bounds, row_bounds = _chunk_bounds(rowptr, num_rows, chunk_rows) if num_rows else ([], [])
    num_chunks = max(len(seg_bounds) - 1, 0)
    row_starts = torch.tensor(row_bounds[:-1] or [0], dtype=torch.int64, device=device)
    rrow, groups, starts = _receiver_groups(receiver.to(torch.int64), row_starts, num_out)
    group_bounds = torch.searchsorted(starts, torch.tensor(row_bounds, dtype=torch.int64, device=device)).tolist()
    bounds = torch.tensor(seg_bounds, dtype=torch.int64, device=device)
    exact_bounds = torch.searchsorted(exact, bounds).tolist()
    perf_bounds = torch.searchsorted(perf, bounds).tolist()

    table, regions = [], []
    offset = HEADER + CHUNK_FIELDS * num_chunks
    for c in range(num_chunks):
        s0, s1, r0, r1 = seg_bounds[c], seg_bounds[c + 1], row_bounds[c], row_bounds[c + 1]
        local_rowptr = rowptr[s0:s1 + 1] - r0
        e0, e1 = exact_bounds[c], exact_bounds[c + 1]
        sub = build_plan(local_rowptr, exact[e0:e1] - s0, r1 - r0, max_tile) if e1 > e0 else rowptr.new_zeros(0)
        p0, p1 = perf_bounds[c], perf_bounds[c + 1]
        row = [r0, r1, s0, s1, offset, sub.numel(), e1 - e0, offset + sub.numel(), p1 - p0,
               offset + sub.numel() + (p1 - p0), group_bounds[c], group_bounds[c + 1]]
        table += row
        regions += [sub, perf[p0:p1] - s0, local_rowptr]
        offset += sub.numel() + (p1 - p0) + local_rowptr.numel()
    group_words, rrow_words = _as_words(groups), _as_words(rrow)
    header = [FUSED_MAGIC, num_chunks, chunk_rows, num_rows, num_segments, num_out, max_tile,
              exact.numel(), perf.numel(), offset, offset + group_words.numel(), groups.numel() // 3, recv_bound]
    head = torch.tensor(header + [0] * (HEADER - len(header)) + table, dtype=torch.int64, device=device)
    return torch.cat([head, *regions, group_words, rrow_words])


def read_plan(op: str, plan: torch.Tensor, *, num_rows: int, num_segments: int, num_out: int, chunk_rows: int,
              max_tile: int, num_exact: int, num_performer: int, num_nodes: int) -> Plan | None:
    """The chunks of a plan built for exactly these sizes and a packed-tile cap at most
    ``max_tile`` (one small device-to-host copy), or None when ``plan`` is not a fused plan
    (e.g. the exact kernel's own work list).  ``num_nodes`` (rows of the receiver term) must
    exceed every receiver."""
    bound = HEADER + CHUNK_FIELDS * -(-num_rows // chunk_rows)
    head = plan[:min(bound, plan.numel())].tolist()
    if len(head) < HEADER or head[H_MAGIC] != FUSED_MAGIC:
        return None
    want = {H_CHUNK_ROWS: chunk_rows, H_ROWS: num_rows, H_SEGMENTS: num_segments, H_OUT: num_out,
            H_EXACT: num_exact, H_PERF: num_performer}
    wrong = [(i, head[i], v) for i, v in want.items() if head[i] != v]
    if head[H_MAX_TILE] > max_tile:  # lower caps are fine: the launchers run every class up to max_tile
        wrong.append((H_MAX_TILE, head[H_MAX_TILE], max_tile))
    if wrong:
        raise ValueError(f"{op}: exact_plan was built for another graph, segment split or layer "
                         f"(header word, plan, call): {wrong}")
    if head[H_RECV_BOUND] > num_nodes:
        raise ValueError(f"{op}: the graph has receiver {head[H_RECV_BOUND] - 1} but receiver_term has "
                         f"{num_nodes} rows")
    groups = plan[head[H_GROUPS_OFF]:head[H_RROW_OFF]].view(torch.int32)
    rrow = plan[head[H_RROW_OFF]:].view(torch.int32)
    chunks = []
    for c in range(head[H_CHUNKS]):
        t = head[HEADER + CHUNK_FIELDS * c: HEADER + CHUNK_FIELDS * (c + 1)]
        exact = plan[t[C_EXACT_OFF]:t[C_EXACT_OFF] + t[C_EXACT_LEN]] if t[C_EXACT] else None
        perf = plan[t[C_PERF_OFF]:t[C_PERF_OFF] + t[C_PERF]] if t[C_PERF] else None
        chunks.append(Chunk(t[C_ROW0], t[C_ROW1], t[C_SEG0], t[C_SEG1], exact, perf,
                            plan[t[C_RPTR_OFF]:t[C_RPTR_OFF] + t[C_SEG1] - t[C_SEG0] + 1],
                            t[C_GROUP0], t[C_GROUP1] - t[C_GROUP0], rrow[t[C_ROW0]:t[C_ROW1]]))
    return Plan(chunks, groups)


def cached_plan(csr, receiver_csr, threshold: float, dtype: torch.dtype, channels: int, heads: int,
                chunk_rows: int | None = None) -> torch.Tensor:
    """The fused plan of ``csr`` for this segment split and layer shape, cached on ``csr``.

    What the public op passes as ``exact_plan`` on CUDA, so that a call reads
    its plan instead of building it (docs/design.md §9).
    """
    from nt_kernels.backends.triton.plan import max_packed_tile, shared_memory_per_block

    rows = default_chunk_rows(channels) if chunk_rows is None else int(chunk_rows)
    max_tile = max_packed_tile(dtype, channels // heads, shared_memory_per_block(csr.device))
    num_out = receiver_csr.rowptr.numel() - 1
    key = ("ntconv-plan", float(threshold), num_out, rows, max_tile)

    def build():
        exact, performer = csr.segment_split(threshold)
        return build_ntconv_plan(csr.rowptr, csr.receiver, exact, performer, num_out, rows, max_tile,
                                 perm=csr.perm)
    return csr.plan(key, build)
