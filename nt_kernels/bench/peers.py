"""What a user would write instead of our op: the peer backends of ``nt-kernels bench``.

Each peer computes the same packed (E, H, D) output from the same packed q, k, v:

* ``pyg-pairs`` — the PyG way: expand every neighbourhood into its n² (query,
  key) pairs, score each pair, ``torch_geometric.utils.softmax`` over each
  query's pairs, weighted ``scatter`` of the gathered v.  Exact attention on
  every segment; its memory is O(Σ n²), estimated before the run
  (:func:`pairs_estimate_bytes`) so that a graph over the cap is skipped.
* ``nested`` — ``scaled_dot_product_attention`` on jagged nested tensors
  (S, H, j, D), one component per non-empty segment.  Exact everywhere.  On the
  CPU torch runs it on its math path, which pads every segment to the longest:
  memory O(S · L_max²), estimated before the run (:func:`nested_estimate_bytes`).
* ``flex`` — compiled FlexAttention over the whole packed sequence with a
  document mask (query and key in the same segment).  The block mask is built
  from the CSR in O(E / 128) (:func:`document_block_mask`) instead of by
  evaluating the mask on all E² positions (``create_block_mask``), which a
  graph with a million messages could not afford; its index tensors are still
  (E / 128)², estimated with the rest (:func:`flex_estimate_bytes`).  Exact everywhere.  Where
  the torch build has no FlexAttention backward on the device (CPU in torch
  2.13) it is measured forward only.
* ``varlen`` — ``torch.nn.attention.varlen.varlen_attn``, FlashAttention-2 inside
  torch, on the packed rows with the CSR's row pointer as ``cu_seq_q`` and
  ``cu_seq_k`` (non-causal).  Exact everywhere; CUDA, bfloat16 and float16 only
  (head dims a multiple of 8, at most 256).
* ``performer-pytorch`` / ``performer-pytorch-sizes`` — performer-pytorch's
  ``FastAttention`` (FAVOR+, our projection copied into its buffer) on the
  segments above the switch threshold, for graphs whose every segment is
  there (``--subset performer``).  ``performer-pytorch`` pads Algorithm 1's
  groups (α = 0.4, as the released code does) with zero rows, the way
  ``to_dense_batch`` does: FastAttention has no key mask, so the padded keys'
  features enter its normaliser, and its error against the reference shows
  that leak.  ``performer-pytorch-sizes`` makes one call per distinct segment
  size, with no padding and so no leak.  Optional: skipped with a clear status
  when performer-pytorch is not installed (``pip install 'nt-kernels[peers]'``).

A peer whose estimate (:func:`estimate_bytes`) exceeds the memory cap
(``--memory-cap-gb``; ``NT_BENCH_MEMORY_CAP_GB`` in the pytest-benchmark suites,
which run in-process) is skipped with the estimate in its status, so that no
run, in a worker or in-process, meets the OOM killer.

A peer's ``prepare`` builds everything per graph (pair indices, offsets, block
mask, compiled kernels, groups) outside the timed region, like the other
backends (:mod:`nt_kernels.bench.backends`).
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from nt_kernels.bench.context import Backend, Context

PERFORMER_ALPHA = 0.4
FLEX_BLOCK = 128
# pyg-pairs memory per (query, key) pair and head: c_d * D elements (gathered q, k and v, the products and
# their gradients) plus c_s score-sized elements (scores, softmax, gradients); plus two int64 indices per pair.
EST_PAIRS_C_D, EST_PAIRS_C_S = 8, 6
# nested and flex: c_d * D elements per row and head (as the strategies' padded rows, backends.EST_C_D).
EST_ROW_C_D = 8
# nested on the CPU (torch's math path pads every segment to the longest): bytes per padded score element
# (segment, head, query, key).  Measured with torch 2.13 on the CPU, forward+backward, H = 2 and 4, D = 8
# and 32: 21 (bfloat16, float16), 23-26 (float32) and 28 (float64) bytes.
EST_NESTED_SCORE_BYTES = 32
# flex: besides the rows, the block mask's index tensors,
# (E / FLEX_BLOCK)² int32 each, four of them (kv and q indices, partial and full) and the temporaries of
# building them: measured 37 bytes per block pair (torch 2.13, CPU, E = 0.4 and 0.8 million).
EST_FLEX_BLOCK_PAIR_BYTES = 40


def peer_backends() -> list[Backend]:
    """The peers in table order."""
    return [Backend("pyg-pairs", "pyg-pairs"), Backend("nested", "nested"), Backend("flex", "flex"),
            Backend("varlen", "varlen"),
            Backend("performer-pytorch", "performer-pytorch"),
            Backend("performer-pytorch-sizes", "performer-pytorch")]


# ---------------------------------------------------------------- applicability
def sum_squared_sizes(ctx: Context) -> int:
    """Σ n² over the segments: the number of (query, key) pairs."""
    return sum(n * n * c for n, c in zip(*ctx.hist))


def pairs_estimate_bytes(backend: Backend, ctx: Context) -> int | None:
    """Rough size of pyg-pairs' pair tensors for one forward+backward (None for other backends)."""
    if backend.family != "pyg-pairs":
        return None
    item = torch.empty(0, dtype=ctx.dtype).element_size()
    per_pair = 2 * 8 + ctx.heads * (EST_PAIRS_C_D * ctx.head_dim + EST_PAIRS_C_S) * item
    return sum_squared_sizes(ctx) * per_pair


def _linear_bytes(ctx: Context) -> int:
    """EST_ROW_C_D * D elements per row and head: the packed inputs' copies, the output and the gradients."""
    return ctx.num_edges * ctx.heads * EST_ROW_C_D * ctx.head_dim * torch.empty(0, dtype=ctx.dtype).element_size()


def nested_estimate_bytes(backend: Backend, ctx: Context) -> int | None:
    """Rough size of the nested peer's tensors for one forward+backward (None for other backends).

    On the CPU every non-empty segment is padded to the longest (S · H · L_max² score elements at
    ``EST_NESTED_SCORE_BYTES`` each); on CUDA the jagged SDPA runs FlashAttention or the
    memory-efficient kernel on the packed rows, with no padding."""
    if backend.family != "nested":
        return None
    linear = _linear_bytes(ctx)
    if ctx.device.type == "cuda":
        return linear
    present = [(n, c) for n, c in zip(*ctx.hist) if n > 0 and c > 0]
    if not present:
        return linear
    segments, longest = sum(c for _, c in present), max(n for n, _ in present)
    return linear + segments * ctx.heads * longest * longest * EST_NESTED_SCORE_BYTES


def flex_estimate_bytes(backend: Backend, ctx: Context) -> int | None:
    """Rough size of the flex peer's tensors (None for other backends): the packed rows' inputs, output
    and gradients, and the block mask of :func:`document_block_mask` ((E / FLEX_BLOCK)² block pairs)."""
    if backend.family != "flex":
        return None
    blocks = -(-ctx.num_edges // FLEX_BLOCK)
    return _linear_bytes(ctx) + blocks * blocks * EST_FLEX_BLOCK_PAIR_BYTES


def estimate_bytes(backend: Backend, ctx: Context) -> int | None:
    """The memory estimate of a peer that has one (pyg-pairs, nested, flex), else None."""
    for estimate in (pairs_estimate_bytes, nested_estimate_bytes, flex_estimate_bytes):
        value = estimate(backend, ctx)
        if value is not None:
            return value
    return None


def _probe_nested(device: torch.device) -> None:
    import torch.nn.functional as F

    q = torch.randn(5, 1, 4, device=device, requires_grad=True)
    offsets = torch.tensor([0, 2, 5], device=device)
    nested = torch.nested.nested_tensor_from_jagged(q, offsets=offsets).transpose(1, 2)
    F.scaled_dot_product_attention(nested, nested, nested).transpose(1, 2).values().sum().backward()


# Inductor lowers FlexAttention on CUDA to a Triton template whose tl.dot needs head dims of 16 or more
# (torch/_inductor/kernel/flex/flex_attention.py raises NotImplementedError below it).
FLEX_CUDA_MIN_HEAD_DIM = 16


def _probe_flex(device: torch.device) -> None:
    from torch.nn.attention.flex_attention import flex_attention  # noqa: F401  (ImportError: no FlexAttention)

    # torch.compile's CPU FlexAttention template needs torch's AVX2 (or wider) kernels: it refuses a CPU
    # without AVX2 and ATEN_CPU_CAPABILITY=default.
    capability = torch.backends.cpu.get_cpu_capability()
    if device.type == "cpu" and not capability.startswith(("AVX2", "AVX512")):
        raise NotImplementedError(f"compiled FlexAttention on CPU needs AVX2 kernels, torch's CPU capability is "
                                  f"{capability}")


def _varlen_unsupported(ctx: Context) -> str | None:
    """Why varlen_attn cannot run this bench (device, dtype, head dim, torch build), else None."""
    if ctx.device.type != "cuda":
        return f"varlen_attn (FlashAttention-2) runs on CUDA only, not {ctx.device.type}"
    if ctx.dtype not in (torch.bfloat16, torch.float16):
        return f"varlen_attn takes bfloat16 and float16 only, not {str(ctx.dtype).removeprefix('torch.')}"
    if ctx.head_dim % 8 or ctx.head_dim > 256:
        return f"varlen_attn needs a head dim that is a multiple of 8 and at most 256, not {ctx.head_dim}"
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError as exc:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen ({exc})"
    return None


_probes: dict[tuple[str, str], str | None] = {}


def _probe(family: str, device: torch.device) -> str | None:
    """None if the torch build runs ``family`` on ``device``, else the reason (cached per family and device)."""
    key = (family, str(device))
    if key not in _probes:
        try:
            {"nested": _probe_nested, "flex": _probe_flex}[family](device)
            _probes[key] = None
        except Exception as exc:  # noqa: BLE001  (any failure means: this build does not support it)
            _probes[key] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    return _probes[key]


def _performer_not_applicable(ctx: Context) -> str | None:
    if ctx.projection is None or math.isinf(ctx.threshold):
        return "n/a: exact mode (Performer-only peer)"
    if any(0 < n <= ctx.threshold and c > 0 for n, c in zip(*ctx.hist)):
        return "n/a: graph has exact-path segments (Performer-only peer; use --subset performer)"
    return None


def skip_reason(backend: Backend, ctx: Context) -> str | None:
    """Why a peer is not run on this graph and device (a ``skipped:`` / ``n/a:`` / ``unsupported:`` status)."""
    if backend.family == "performer-pytorch":
        try:
            import performer_pytorch  # noqa: F401
        except ImportError:
            return "skipped: performer-pytorch not installed (pip install 'nt-kernels[peers]')"
        reason = _performer_not_applicable(ctx)
        if reason is not None:
            return reason
    if backend.family == "varlen":
        reason = _varlen_unsupported(ctx)
        if reason is not None:
            return f"unsupported: {reason}"
    if backend.family in ("nested", "flex"):
        reason = _probe(backend.family, ctx.device)
        if reason is not None:
            return f"unsupported: {backend.family} on {ctx.device.type} in torch {torch.__version__} ({reason})"
    if backend.family == "flex" and ctx.device.type == "cuda" and ctx.head_dim < FLEX_CUDA_MIN_HEAD_DIM:
        return (f"unsupported: flex on cuda needs a head dim of at least {FLEX_CUDA_MIN_HEAD_DIM} (Inductor's "
                f"Triton template: tl.dot), not {ctx.head_dim}")
    estimate = estimate_bytes(backend, ctx)
    if estimate is not None and estimate > ctx.memory_cap_bytes:
        return f"skipped: est. {estimate / 1e9:.1f} GB > cap {ctx.memory_cap_bytes / 1e9:.1f} GB"
    return None


def backward_unsupported(backend: Backend, ctx: Context) -> str | None:
    """Why a peer runs forward only on this device (FlexAttention without a backward), else None."""
    if backend.family != "flex":
        return None
    from torch.nn.attention.flex_attention import flex_attention

    x = torch.zeros(1, 1, 4, 4, device=ctx.device, requires_grad=True)
    try:
        flex_attention(x, x, x)
    except NotImplementedError as exc:
        return str(exc).splitlines()[0][:200]
    return None


def padded_groups(backend: Backend, ctx: Context) -> list[tuple[int, int, bool]] | None:
    """(segments, padded length, performer) of the Performer peers' calls (None for the other peers)."""
    if backend.family != "performer-pytorch" or _performer_not_applicable(ctx):
        return None
    present = [(n, c) for n, c in zip(*ctx.hist) if n > 0 and c > 0]
    if backend.name == "performer-pytorch-sizes":
        return [(c, n, True) for n, c in present]
    from nt_kernels.baselines.partition import partition_by_area

    plan = partition_by_area([n for n, _ in present], [c for _, c in present], alpha=PERFORMER_ALPHA,
                             threshold=ctx.threshold)
    return [(g.count, g.hi, g.performer) for g in plan]


# ---------------------------------------------------------------------- prepare
def prepare(backend: Backend, ctx: Context) -> Callable:
    """Build ``fn(q, k, v) -> o`` for a peer with its per-graph state precomputed."""
    if backend.family == "pyg-pairs":
        return _prepare_pairs(ctx)
    if backend.family == "nested":
        return _prepare_nested(ctx)
    if backend.family == "flex":
        return _prepare_flex(ctx, backward=backward_unsupported(backend, ctx) is None)
    if backend.family == "performer-pytorch":
        return _prepare_performer(backend, ctx)
    if backend.family == "varlen":
        return _prepare_varlen(ctx)
    raise ValueError(f"bench: no peer family {backend.family!r}")


def pair_index(rowptr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(query row, key row) of every pair of rows in the same segment, grouped by query row."""
    sizes = torch.diff(rowptr)
    rows = int(rowptr[-1])
    segment = torch.repeat_interleave(torch.arange(sizes.numel(), device=rowptr.device), sizes)
    keys_per_query = sizes[segment]
    query = torch.repeat_interleave(torch.arange(rows, device=rowptr.device), keys_per_query)
    first_pair = torch.cumsum(keys_per_query, 0) - keys_per_query
    position = torch.arange(query.numel(), device=rowptr.device) - first_pair[query]
    key = rowptr[segment][query] + position
    return query, key


def _prepare_pairs(ctx: Context) -> Callable:
    from torch_geometric.utils import scatter, softmax

    query, key = pair_index(ctx.csr.rowptr)
    num_rows, scale = ctx.num_edges, ctx.head_dim ** -0.5

    def fn(q, k, v):
        scores = (q[query] * k[key]).sum(-1) * scale                        # (P, H)
        weights = softmax(scores, query, num_nodes=num_rows)                # over each query's keys
        return scatter(weights.unsqueeze(-1) * v[key], query, dim=0, dim_size=num_rows, reduce="sum")

    return fn


def _prepare_nested(ctx: Context) -> Callable:
    """SDPA on jagged nested tensors (S, H, j, D) built over the packed rows (empty segments dropped)."""
    import torch.nn.functional as F

    offsets = torch.unique_consecutive(ctx.csr.rowptr)

    def fn(q, k, v):
        q, k, v = (torch.nested.nested_tensor_from_jagged(t, offsets=offsets).transpose(1, 2)
                   for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).values()

    return fn


def _prepare_varlen(ctx: Context) -> Callable:
    """varlen_attn over the packed rows: one sequence per segment (empty ones are zero-length)."""
    from torch.nn.attention.varlen import varlen_attn

    cu_seq = ctx.csr.rowptr.to(torch.int32)
    longest = max((n for n, c in zip(*ctx.hist) if c > 0), default=0)

    def fn(q, k, v):
        return varlen_attn(q, k, v, cu_seq, cu_seq, longest, longest)

    return fn


def document_block_mask(csr, block: int = FLEX_BLOCK):
    """FlexAttention BlockMask of "query and key in the same segment" over the packed rows, built from the CSR.

    Query block b covers rows [b·block, (b+1)·block); the keys it may see are
    the rows of the segments of its first and last row and of every segment in
    between: a contiguous run of key blocks [lo, hi].  A block pair is full
    (no mask needed inside) when both blocks are complete and lie inside one
    and the same segment, otherwise partial (the mask function decides).  O(blocks × run
    length) work; the index tensors are (blocks × blocks) as BlockMask wants.
    """
    from torch.nn.attention.flex_attention import BlockMask

    rows, centre = csr.num_edges, csr.centre
    num_blocks = -(-rows // block)
    first = torch.arange(num_blocks, device=centre.device) * block
    segment = centre[first]
    single = (segment == centre[torch.clamp(first + block, max=rows) - 1]) & (first + block <= rows)
    lo = csr.rowptr[segment] // block
    hi = (csr.rowptr[centre[torch.clamp(first + block, max=rows) - 1] + 1] - 1) // block
    width = int((hi - lo).max()) + 1
    candidate = lo.unsqueeze(1) + torch.arange(width, device=lo.device)
    valid = candidate <= hi.unsqueeze(1)
    candidate = torch.clamp(candidate, max=num_blocks - 1)
    full = valid & single.unsqueeze(1) & single[candidate] & (segment[candidate] == segment.unsqueeze(1))

    def packed(selected):  # the selected candidates first in every row, padded to num_blocks columns
        order = torch.argsort((~selected).to(torch.int8), dim=1, stable=True)
        indices = torch.zeros(num_blocks, num_blocks, dtype=torch.int32, device=lo.device)
        indices[:, :width] = torch.gather(candidate, 1, order).to(torch.int32)
        return selected.sum(1).to(torch.int32)[None, None], indices[None, None]

    def same_segment(b, h, q_idx, kv_idx):
        return centre[q_idx] == centre[kv_idx]

    return BlockMask.from_kv_blocks(*packed(valid & ~full), *packed(full), BLOCK_SIZE=block,
                                    mask_mod=same_segment, seq_lengths=(rows, rows))


def _prepare_flex(ctx: Context, *, backward: bool) -> Callable:
    """Compiled FlexAttention over (1, H, E, D) with the document mask; compiled here, on the graph's shape."""
    from torch.nn.attention.flex_attention import flex_attention

    block_mask = document_block_mask(ctx.csr)
    compiled = torch.compile(flex_attention, dynamic=False)

    def fn(q, k, v):
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        return compiled(q, k, v, block_mask=block_mask).squeeze(0).transpose(0, 1)

    shape = (ctx.num_edges, ctx.heads, ctx.head_dim)
    warm = [torch.zeros(shape, device=ctx.device, dtype=ctx.dtype, requires_grad=backward) for _ in range(3)]
    out = fn(*warm)
    if backward:
        out.sum().backward()
    return fn


def _prepare_performer(backend: Backend, ctx: Context) -> Callable:
    """performer-pytorch FastAttention per group: (G, H, L, D) zero-padded layouts, outputs copied back."""
    from performer_pytorch import FastAttention

    from nt_kernels.baselines.strategies import padded_layout

    attention = FastAttention(ctx.head_dim, nb_features=ctx.nb_features).to(device=ctx.device, dtype=ctx.dtype)
    attention.projection_matrix.copy_(ctx.projection)
    groups = _group_segments(backend, ctx, torch.diff(ctx.csr.rowptr))
    layouts = [padded_layout(ctx.csr.rowptr, segments) for segments in groups]
    flat = torch.cat([index.reshape(-1) for index, _ in layouts])
    numels = [index.numel() for index, _ in layouts]
    rows = torch.cat([index[mask] for index, mask in layouts])

    def fn(q, k, v):
        padded = [t.index_select(0, flat).split(numels) for t in (q, k, v)]
        outs = []
        for (index, mask), qp, kp, vp in zip(layouts, *padded):
            keep = mask[:, :, None, None]
            qp, kp, vp = (torch.where(keep, t.view(*index.shape, *t.shape[1:]), 0.0).transpose(1, 2)
                          for t in (qp, kp, vp))
            outs.append(attention(qp, kp, vp).transpose(1, 2)[mask])
        return torch.zeros_like(v).index_copy(0, rows, torch.cat(outs))

    return fn


def _group_segments(backend: Backend, ctx: Context, sizes: torch.Tensor) -> list[torch.Tensor]:
    """Segment ids of every group of a Performer peer: one per distinct size, or Algorithm 1's groups."""
    if backend.name == "performer-pytorch-sizes":
        return [torch.nonzero(sizes == n).flatten() for n in sorted({n for n in ctx.hist[0] if n > 0})]
    from nt_kernels.baselines.partition import partition_by_area

    present = [(n, c) for n, c in zip(*ctx.hist) if n > 0 and c > 0]
    plan = partition_by_area([n for n, _ in present], [c for _, c in present], alpha=PERFORMER_ALPHA,
                             threshold=ctx.threshold)
    return [torch.nonzero((sizes >= g.lo) & (sizes <= g.hi)).flatten() for g in plan]
