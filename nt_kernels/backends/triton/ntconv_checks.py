"""Argument checks and the per-call problem description of the fused NT layer on CUDA.

The public op (``nt_kernels.ops.ntconv``) checks its arguments first with
friendlier messages; these checks guard direct ``torch.ops`` callers of
``ntconv_fwd`` / ``ntconv_bwd`` on CUDA, naming the op and the argument.
They need no host sync; the values of the graph tensors (rowptr, the
segment ids, receivers) are checked once per graph when the plan is built
(ntconv_plan.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nt_kernels.backends.triton.common import bf16_emulation, dot_precision
from nt_kernels.backends.triton.ntconv_plan import Plan, build_ntconv_plan, default_chunk_rows, read_plan
from nt_kernels.backends.triton.plan import max_packed_tile, shared_memory_per_block
from nt_reference.dropout import drop_threshold, seed_key

__all__ = ["AGGREGATORS", "ARG_NAMES", "GATE_GROUPS", "MAX_HEAD_DIM", "Problem", "problem", "signed_word"]

# The arguments of nt_kernels::ntconv_fwd in schema order (ntconv_bwd: grad_out, out, lse, stats, these, input_mask).
ARG_NAMES = ("centre", "receiver_term", "edge_attr", "w_edge", "w_qkv", "b_qkv", "w_out", "b_out", "rowptr",
             "receiver", "perm", "recv_rowptr", "recv_perm", "exact_segments", "performer_segments", "exact_plan",
             "projection", "seed", "heads", "aggr", "gate_group", "dropout", "scale", "eps")

AGGREGATORS = ("sum", "mean", "max", "weighted_mean", "gated_sum")
GATE_GROUPS = ("receiver", "centre")
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


@dataclass
class Problem:
    """Everything a fused-layer call needs, checked, with its plan read (ntconv_plan.Plan)."""

    centre: torch.Tensor
    receiver_term: torch.Tensor
    edge_attr: torch.Tensor | None
    w_edge: torch.Tensor | None
    w_qkv: torch.Tensor
    b_qkv: torch.Tensor
    w_out: torch.Tensor
    b_out: torch.Tensor
    rowptr: torch.Tensor
    receiver: torch.Tensor
    perm: torch.Tensor
    recv_rowptr: torch.Tensor
    projection: torch.Tensor | None
    heads: int
    aggr: str
    gate_group: str
    dropout: float
    seed_word: int
    seed_cell: torch.Tensor | None  # the seed word in an int64 device cell, for a seed drawn on the device
    drop_threshold: int
    drop_scale: float
    scale: float
    eps: float
    plan: Plan = None

    @property
    def device(self) -> torch.device:
        return self.centre.device

    @property
    def seed_on_device(self) -> bool:
        """Whether the kernels read the seed word from ``seed_cell`` (SEED_ON_DEVICE) rather than ``seed_word``."""
        return self.seed_cell is not None

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: the parameters' (q, k, v, o and ``out`` are in it)."""
        return self.w_qkv.dtype

    @property
    def channels(self) -> int:
        return self.centre.shape[1]

    @property
    def head_dim(self) -> int:
        return self.channels // self.heads

    @property
    def out_channels(self) -> int:
        return self.w_out.shape[0]

    @property
    def edge_dim(self) -> int:
        return 0 if self.edge_attr is None else self.edge_attr.shape[1]

    @property
    def num_rows(self) -> int:
        return self.receiver.numel()

    @property
    def num_nodes(self) -> int:
        return self.centre.shape[0]

    @property
    def num_out(self) -> int:
        return self.recv_rowptr.numel() - 1

    @property
    def allow_tf32(self) -> bool:
        return torch.backends.cuda.matmul.allow_tf32

    @property
    def dot_prec(self) -> str:
        return dot_precision(self.dtype, self.allow_tf32)

    @property
    def bf16_emu(self) -> bool:
        return bf16_emulation(self.dtype)


def _tensor(op, name, t, *, dim=None, dtype=None, device=None, shape=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{op}: {name} must be {dim}-D, got shape {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if dtype is not None and t.dtype not in (dtype if isinstance(dtype, tuple) else (dtype,)):
        raise ValueError(f"{op}: {name} must have dtype {dtype}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device}, expected {device} (centre's device)")
    return t.contiguous()


def _index(op, name, t, device, length=None):
    t = _tensor(op, name, t, dim=1, dtype=(torch.int64, torch.int32), device=device)
    if length is not None and t.numel() != length:
        raise ValueError(f"{op}: {name} must have {length} entries (one per packed row), got {t.numel()}")
    return t.to(torch.int64)


def _node_terms_and_weights(op, a):
    """Node terms and edge features share one dtype, the parameters another (they differ under
    autocast, which casts only the parameters): float32, bfloat16 or float16 each."""
    centre = _tensor(op, "centre", a["centre"], dim=2, dtype=FLOATS)
    dev, (num_nodes, c) = centre.device, centre.shape
    heads = a["heads"]
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1 or c % heads:
        raise ValueError(f"{op}: heads must be a positive divisor of C = {c}, got {heads!r}")
    if c // heads > MAX_HEAD_DIM:
        raise ValueError(f"{op}: head dim C / heads = {c // heads} exceeds {MAX_HEAD_DIM}")
    if a["aggr"] not in AGGREGATORS:
        raise ValueError(f"{op}: aggr must be one of {AGGREGATORS}, got {a['aggr']!r}")
    c_out = 2 * c if a["aggr"] in ("weighted_mean", "gated_sum") else c
    nodes = dict(dtype=centre.dtype, device=dev)
    w_qkv = _tensor(op, "w_qkv", a["w_qkv"], shape=(3 * c, c), dtype=FLOATS, device=dev)
    params = dict(dtype=w_qkv.dtype, device=dev)
    out = dict(centre=centre, receiver_term=_tensor(op, "receiver_term", a["receiver_term"], shape=(num_nodes, c),
                                                    **nodes),
               w_qkv=w_qkv, b_qkv=_tensor(op, "b_qkv", a["b_qkv"], shape=(3 * c,), **params),
               w_out=_tensor(op, "w_out", a["w_out"], shape=(c_out, c), **params),
               b_out=_tensor(op, "b_out", a["b_out"], shape=(c_out,), **params))
    if (a["edge_attr"] is None) != (a["w_edge"] is None):
        raise ValueError(f"{op}: edge_attr and w_edge must be given together")
    out["edge_attr"] = out["w_edge"] = None
    if a["edge_attr"] is not None:
        edge_attr = _tensor(op, "edge_attr", a["edge_attr"], dim=2, **nodes)
        out["edge_attr"] = edge_attr
        out["w_edge"] = _tensor(op, "w_edge", a["w_edge"], shape=(c, edge_attr.shape[1]), **params)
    return out


def signed_word(word: int) -> int:
    """A 32-bit word as the signed int32 with the same bits: what the prologue takes as ``seed_word``
    (every seed then launches the same i32 argument; a word >= 2**31 passed as is would be an i64
    and compile the prologue a second time)."""
    return word - (1 << 32) if word >= 1 << 31 else word


def device_seed_cell(seed: torch.Tensor) -> torch.Tensor:
    """The seed word of an int64 seed tensor, computed where the seed is (``seed_key`` on the tensor, no host
    read) and held as its signed int32 value in a one-element int64 tensor: what the kernels load
    with SEED_ON_DEVICE."""
    word = seed_key(seed.reshape(1))
    return torch.where(word >= 1 << 31, word - (1 << 32), word)


def _options(op, a, device):
    if a["gate_group"] not in GATE_GROUPS:
        raise ValueError(f"{op}: gate_group must be one of {GATE_GROUPS}, got {a['gate_group']!r}")
    p = float(a["dropout"])
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{op}: dropout must be in [0, 1), got {p}")
    seed = a["seed"]
    if (not isinstance(seed, torch.Tensor) or seed.numel() != 1 or seed.dtype != torch.int64
            or seed.device not in (torch.device("cpu"), device)):
        raise ValueError(f"{op}: seed must be a one-element int64 tensor on the CPU or on centre's device "
                         f"({device})")
    scale, eps = float(a["scale"]), float(a["eps"])
    if not math.isfinite(scale) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"{op}: scale must be finite and eps finite and >= 0, got {scale}, {eps}")
    # A seed on the device (drawn there inside a CUDA graph capture) is read by the kernels from a device cell; a
    # CPU seed is a scalar argument.  Tests force the cell with a CPU seed (``device_seed``) under the interpreter.
    on_device = p > 0 and (seed.device != torch.device("cpu") or a.get("device_seed", False))
    cell = device_seed_cell(seed.to(device)) if on_device else None
    word = 0 if on_device else signed_word(seed_key(int(seed)))
    return dict(aggr=a["aggr"], gate_group=a["gate_group"], dropout=p, seed_word=word, seed_cell=cell,
                drop_threshold=drop_threshold(p), drop_scale=1.0 / (1.0 - p), scale=scale, eps=eps)


def _graph(op, a, device, num_nodes, num_rows):
    rowptr = _index(op, "rowptr", a["rowptr"], device)
    if rowptr.numel() < 1 or rowptr.numel() - 1 > num_nodes:
        raise ValueError(f"{op}: rowptr must have S + 1 entries with 1 <= S + 1 <= N + 1 = {num_nodes + 1} "
                         f"(centre has N rows), got {rowptr.numel()}")
    recv_rowptr = _index(op, "recv_rowptr", a["recv_rowptr"], device)
    if recv_rowptr.numel() < 1:
        raise ValueError(f"{op}: recv_rowptr must have N_out + 1 >= 1 entries")
    return dict(rowptr=rowptr, receiver=_index(op, "receiver", a["receiver"], device, num_rows),
                perm=_index(op, "perm", a["perm"], device, num_rows), recv_rowptr=recv_rowptr)


def problem(op: str, a: dict) -> Problem:
    """Check the arguments of one call (a dict by schema name) and read or build its plan."""
    terms = _node_terms_and_weights(op, a)
    centre = terms["centre"]
    dev, dt, num_nodes = centre.device, terms["w_qkv"].dtype, centre.shape[0]
    receiver = a["receiver"]
    num_rows = receiver.numel() if isinstance(receiver, torch.Tensor) else -1
    graph = _graph(op, a, dev, num_nodes, num_rows)
    if terms["edge_attr"] is not None and terms["edge_attr"].shape[0] != num_rows:
        raise ValueError(f"{op}: edge_attr must have E = {num_rows} rows, got {terms['edge_attr'].shape[0]}")
    _index(op, "recv_perm", a["recv_perm"], dev, num_rows)
    head_dim = centre.shape[1] // a["heads"]
    exact = _index(op, "exact_segments", a["exact_segments"], dev)
    performer = _index(op, "performer_segments", a["performer_segments"], dev)
    projection = a["projection"]
    if projection is not None:
        projection = _tensor(op, "projection", projection, dim=2, dtype=dt, device=dev)
        if projection.shape[1] != head_dim or projection.shape[0] < 1:
            raise ValueError(f"{op}: projection must be (m >= 1, D = {head_dim}), got {tuple(projection.shape)}")
    elif performer.numel():
        raise ValueError(f"{op}: performer_segments is not empty but no projection was given")
    p = Problem(**terms, **graph, projection=projection, heads=a["heads"], **_options(op, a, dev))
    p.plan = _plan(op, p, a, exact, performer)
    return p


def _plan(op: str, p: Problem, a: dict, exact: torch.Tensor, performer: torch.Tensor) -> Plan:
    """The call's plan: the given fused plan (checked against the call), else one built here."""
    rows = default_chunk_rows(p.channels) if a.get("chunk_rows") is None else int(a["chunk_rows"])
    max_tile = max_packed_tile(p.dtype, p.head_dim, shared_memory_per_block(p.device))
    sizes = dict(num_rows=p.num_rows, num_segments=p.rowptr.numel() - 1, num_out=p.num_out, chunk_rows=rows,
                 max_tile=max_tile, num_exact=exact.numel(), num_performer=performer.numel(),
                 num_nodes=p.num_nodes)
    given = a["exact_plan"]
    if given is not None:
        given = _tensor(op, "exact_plan", given, dim=1, dtype=torch.int64, device=p.device)
        plan = read_plan(op, given, **sizes)
        if plan is not None:
            return plan
    built = build_ntconv_plan(p.rowptr, p.receiver, exact, performer, p.num_out, rows, max_tile, op=op,
                              num_nodes=p.num_nodes, perm=p.perm)
    return read_plan(op, built, **sizes)
