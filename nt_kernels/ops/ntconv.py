"""The fused NT layer op: a whole NTConv message pipeline per neighbourhood (docs/design.md §9).

:func:`ntconv` checks its arguments and calls ``nt_kernels::ntconv_fwd``
(schema in csrc/ops/ntconv.cpp, CPU kernel in csrc/cpu/ntconv_*); this module
gives the op pair ``ntconv_fwd`` / ``ntconv_bwd`` its fake kernels and autograd.
Nothing per message is kept between forward and backward: the backward
recomputes each neighbourhood from the saved node terms, weights, ``out``,
the exact rows' log-sum-exp and the per-receiver statistics.
"""
from __future__ import annotations

import numbers

import torch

from nt_kernels import backends
from nt_kernels.csr import NeighbourhoodCSR, receiver_csr
from nt_kernels.ops import _checks
from nt_kernels.performer import switch_threshold

__all__ = ["ntconv"]

DEFAULT_EPS = 1e-4
_AGGREGATORS = ("sum", "mean", "max", "weighted_mean", "gated_sum")
_GATED = ("weighted_mean", "gated_sum")
_GATE_GROUPS = ("receiver", "centre")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_OPS = torch.ops.nt_kernels


# --------------------------------------------------------------- fake kernels
def _stats_shape(aggr: str, gate_group: str, num_out: int, channels: int, heads: int) -> tuple:
    if aggr == "max":
        return (2, num_out, channels)  # tie counts, then tie keys
    if aggr == "weighted_mean" and gate_group == "receiver":
        return (num_out, heads)
    return (0,)


def _lse_rows(centre: torch.Tensor, receiver: torch.Tensor) -> int:
    """Rows of ntconv_fwd's lse: E, or 0 on CUDA, whose backward recomputes the attention's lse and so
    keeps none (docs/design.md §9)."""
    return 0 if centre.device.type == "cuda" else receiver.shape[0]


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.register_fake("nt_kernels::ntconv_fwd")
def _ntconv_fwd_fake(centre, receiver_term, edge_attr, w_edge, w_qkv, b_qkv, w_out, b_out, rowptr, receiver,
                     perm, recv_rowptr, recv_perm, exact_segments, performer_segments, exact_plan, projection,
                     seed, heads, aggr, gate_group, dropout, scale, eps):
    num_out, channels = recv_rowptr.shape[0] - 1, centre.shape[1]
    out = centre.new_empty((num_out, channels), dtype=w_qkv.dtype)
    lse = centre.new_empty((_lse_rows(centre, receiver), heads), dtype=torch.float32)
    stats = centre.new_empty(_stats_shape(aggr, gate_group, num_out, channels, heads),
                             dtype=_stats_dtype(centre.dtype))
    return out, lse, stats


@torch.library.register_fake("nt_kernels::ntconv_bwd")
def _ntconv_bwd_fake(grad_out, out, lse, stats, centre, receiver_term, edge_attr, w_edge, w_qkv, b_qkv, w_out,
                     b_out, rowptr, receiver, perm, recv_rowptr, recv_perm, exact_segments, performer_segments,
                     exact_plan, projection, seed, heads, aggr, gate_group, dropout, scale, eps, input_mask):
    def like(t, wanted):
        return t.new_empty(t.shape) if wanted and t is not None else centre.new_empty((0,))

    return (like(centre, input_mask[0]), like(receiver_term, input_mask[1]), like(edge_attr, input_mask[2]),
            like(w_edge, True), like(w_qkv, True), like(b_qkv, True), like(w_out, True), like(b_out, True))


# ------------------------------------------------------------------- autograd
_NUM_TENSOR_INPUTS = 18  # centre ... seed, in schema order


def _setup_context(ctx, inputs, output):
    out, lse, stats = output
    ctx.save_for_backward(*inputs[:_NUM_TENSOR_INPUTS], out, lse, stats)
    ctx.options = tuple(inputs[_NUM_TENSOR_INPUTS:])  # heads, aggr, gate_group, dropout, scale, eps
    ctx.mark_non_differentiable(lse, stats)


def _backward(ctx, grad_out, grad_lse, grad_stats):
    *tensors, out, lse, stats = ctx.saved_tensors
    needs = ctx.needs_input_grad
    mask = [bool(needs[0]), bool(needs[1]), bool(needs[2])]
    grads = _OPS.ntconv_bwd(grad_out, out, lse, stats, *tensors, *ctx.options, mask)
    # grads: d_centre, d_receiver_term, d_edge_attr, d_w_edge, d_w_qkv, d_b_qkv, d_w_out, d_b_out;
    # an input without a gradient (not wanted, or absent) gets None.
    return tuple(g if needs[i] and tensors[i] is not None else None for i, g in enumerate(grads)) + (None,) * (
        _NUM_TENSOR_INPUTS + 6 - len(grads))


torch.library.register_autograd("nt_kernels::ntconv_fwd", _backward, setup_context=_setup_context)


# --------------------------------------------------------------------- checks
def _check_tensor(name: str, t, *, dim: int | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"ntconv: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"ntconv: {name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"ntconv: {name} must be {dim}-D, got shape {tuple(t.shape)}")


def _check_like(name: str, t, centre: torch.Tensor, shape: tuple, any_dtype: bool = False) -> None:
    """t: a float tensor of `shape` on centre's device, in centre's dtype unless ``any_dtype``
    (under autocast: parameters are cast to the autocast dtype, edge features may differ)."""
    _check_tensor(name, t)
    if tuple(t.shape) != shape:
        raise ValueError(f"ntconv: {name} must have shape {shape}, got {tuple(t.shape)}")
    if t.device != centre.device:
        raise ValueError(f"ntconv: {name} is on {t.device} but centre is on {centre.device}")
    if t.dtype != centre.dtype and not any_dtype:
        raise ValueError(f"ntconv: {name} dtype {t.dtype} does not match centre's {centre.dtype}")


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"ntconv: {name} must be one of {choices}, got {value!r}")


def _check_graph(csr, centre: torch.Tensor, num_nodes) -> int:
    """The number of output rows; the CSR must be a NeighbourhoodCSR whose nodes fit centre's rows."""
    if not isinstance(csr, NeighbourhoodCSR):
        raise TypeError(f"ntconv: csr must be a NeighbourhoodCSR, got {type(csr).__name__}")
    if csr.device != centre.device:
        raise ValueError(f"ntconv: csr is on {csr.device} but centre is on {centre.device}")
    if csr.num_nodes > centre.shape[0]:
        raise ValueError(f"ntconv: the csr has {csr.num_nodes} nodes but centre has only {centre.shape[0]} rows "
                         "(node terms are needed for every centre and receiver)")
    if num_nodes is None:
        return centre.shape[0]
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < csr.num_nodes:
        raise ValueError(f"ntconv: num_nodes must be an int >= the csr's {csr.num_nodes} nodes, got {num_nodes!r}")
    return num_nodes


def _check_weights(centre, w_qkv, b_qkv, w_out, b_out, heads, aggr, autocast) -> None:
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        raise ValueError(f"ntconv: heads must be an int >= 1, got {heads!r}")
    c = centre.shape[1]
    if c % heads:
        raise ValueError(f"ntconv: heads ({heads}) must divide the channels C = {c}")
    c_out = 2 * c if aggr in _GATED else c
    _check_like("w_qkv", w_qkv, centre, (3 * c, c), autocast)
    _check_like("b_qkv", b_qkv, centre, (3 * c,), autocast)
    if isinstance(w_out, torch.Tensor) and w_out.dim() == 2 and w_out.shape != (c_out, c):
        halves = " (2C outputs: gate and value halves per head)" if aggr in _GATED else ""
        raise ValueError(f"ntconv: w_out must have shape ({c_out}, {c}) for aggr={aggr!r}{halves}, "
                         f"got {tuple(w_out.shape)}")
    _check_like("w_out", w_out, centre, (c_out, c), autocast)
    _check_like("b_out", b_out, centre, (c_out,), autocast)


def _check_edges(centre, edge_attr, w_edge, num_edges, autocast) -> None:
    if (edge_attr is None) != (w_edge is None):
        given, missing = ("edge_attr", "w_edge") if w_edge is None else ("w_edge", "edge_attr")
        raise ValueError(f"ntconv: {given} was given without {missing}; pass both or neither")
    if edge_attr is None:
        return
    _check_tensor("edge_attr", edge_attr, dim=2)
    if edge_attr.shape[0] != num_edges or edge_attr.shape[1] < 1:
        raise ValueError(f"ntconv: edge_attr must have shape (E={num_edges}, F >= 1), got {tuple(edge_attr.shape)}")
    _check_like("edge_attr", edge_attr, centre, tuple(edge_attr.shape), autocast)
    _check_like("w_edge", w_edge, centre, (centre.shape[1], edge_attr.shape[1]), autocast)


def _check_projection(projection, centre, head_dim, autocast) -> None:
    _check_tensor("projection", projection, dim=2)
    if projection.shape[0] < 1 or projection.shape[1] != head_dim:
        raise ValueError(f"ntconv: projection must have shape (m, D) with m >= 1 and D = {head_dim}, "
                         f"got {tuple(projection.shape)}")
    _check_like("projection", projection, centre, tuple(projection.shape), autocast)
    if projection.requires_grad and torch.is_grad_enabled():
        raise ValueError("ntconv: projection must not require grad: it is a fixed random feature matrix "
                         "(draw it with orthogonal_random_features and keep it as a buffer)")


def _threshold(projection, threshold, head_dim) -> float:
    threshold = _checks.check_threshold("ntconv", threshold, projection)
    return float(switch_threshold(projection.shape[0], head_dim) if threshold is None else threshold)


def _seed_tensor(dropout, seed, device: torch.device) -> torch.Tensor:
    """The int64 scalar seed tensor the kernel reads (0 when there is no dropout): on the CPU, or on the op's
    ``device`` (a seed drawn there, e.g. inside a CUDA graph capture: the kernels read it on the device)."""
    if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"ntconv: dropout must be a number in [0, 1), got {dropout!r}")
    if dropout > 0 and seed is None:
        raise ValueError("ntconv: dropout > 0 needs a seed (an int or an int64 scalar tensor)")
    if seed is None:
        return torch.zeros((), dtype=torch.int64)
    if isinstance(seed, torch.Tensor):
        if (seed.numel() != 1 or seed.dtype not in (torch.int32, torch.int64)
                or seed.device not in (torch.device("cpu"), device)):
            raise ValueError(f"ntconv: seed must be an int or a one-element int64 tensor on the CPU or on centre's "
                             f"device ({device}), got a {seed.dtype} tensor of shape {tuple(seed.shape)} on "
                             f"{seed.device}")
        return seed.reshape(()).to(torch.int64)
    if isinstance(seed, bool) or not isinstance(seed, int) or not -2 ** 63 <= seed < 2 ** 64:
        raise ValueError(f"ntconv: seed must be an int in [-2**63, 2**64) or an int64 tensor, got {seed!r}")
    return torch.tensor(seed - 2 ** 64 if seed >= 2 ** 63 else seed, dtype=torch.int64)


# --------------------------------------------------------------------- public
def ntconv(centre, receiver_term, csr, w_qkv, b_qkv, w_out, b_out, *, heads, aggr="weighted_mean",
           gate_group="receiver", edge_attr=None, w_edge=None, projection=None, threshold=None, dropout=0.0,
           seed=None, scale=None, eps=DEFAULT_EPS, num_nodes=None) -> torch.Tensor:
    """One NTConv message pipeline (DESIGN §6 steps 1-4), fused: returns the (num_nodes, C) aggregate.

    For packed row r of ``csr`` (edge centre j -> receiver k, original edge ``csr.perm[r]``)::

        z_r = dropout(GELU(centre[j] + receiver_term[k] + edge_attr[perm[r]] @ w_edge.T))
        q, k, v = z @ w_qkv.T + b_qkv                 (H heads of D = C / H)
        o = attention inside each neighbourhood        (exact up to ``threshold`` rows, Performer above)
        m_r = GELU(o_r @ w_out.T + b_out)

    aggregated at the receivers with ``aggr`` (``sum``, ``mean``, ``max``, ``weighted_mean``,
    ``gated_sum``; the gated ones read m per head as [gate half | value half], so ``w_out`` has 2C
    rows for them, and ``gate_group`` picks the softmax group of ``weighted_mean``).

    ``centre`` = x W_c + b and ``receiver_term`` = x W_r are (N, C) node terms; weights use
    ``nn.Linear`` layouts; the output has the weights' dtype.  ``projection`` (m, D) enables the Performer path (``threshold``
    defaults to the paper's n*); without it every neighbourhood is exact.  ``dropout`` = p
    draws its mask from the counter generator of ``nt_reference.dropout`` keyed by (``seed``,
    packed row, channel); ``seed`` (int, or int64 scalar tensor on the CPU or on centre's device, where the
    kernels read it without a host sync: what ``NTConv`` passes inside a CUDA graph capture) is required
    when p > 0.
    ``scale`` defaults to D^-1/2; ``eps`` is the Performer stabiliser; ``num_nodes`` (default N)
    is the number of output rows.  The kernel accumulates in float32 (float64 for float64
    inputs).  Under ``torch.autocast`` the weights, biases and projection are cast to the autocast
    dtype (as ``nn.Linear``'s are) and so is the output; node terms and edge features keep their
    dtypes (edge features may then differ from the node terms'), and so do their gradients.
    """
    device_type = centre.device.type if isinstance(centre, torch.Tensor) else "cpu"
    autocast = torch.is_autocast_enabled(device_type)
    _check_tensor("centre", centre, dim=2)
    _check_like("receiver_term", receiver_term, centre, tuple(centre.shape))
    _check_choice("aggr", aggr, _AGGREGATORS)
    _check_choice("gate_group", gate_group, _GATE_GROUPS)
    _check_weights(centre, w_qkv, b_qkv, w_out, b_out, heads, aggr, autocast)
    num_out = _check_graph(csr, centre, num_nodes)
    _check_edges(centre, edge_attr, w_edge, csr.num_edges, autocast)
    head_dim = centre.shape[1] // heads
    if projection is not None:
        _check_projection(projection, centre, head_dim, autocast)
    threshold = _threshold(projection, threshold, head_dim)
    seed = _seed_tensor(dropout, seed, centre.device)
    scale = head_dim ** -0.5 if scale is None else float(scale)
    rcsr = receiver_csr(csr, num_out)
    exact, performer = csr.segment_split(threshold)
    plan = backends.ntconv_plan(csr, rcsr, threshold, centre, heads)  # None on CPU
    out, _, _ = _OPS.ntconv_fwd(centre, receiver_term, edge_attr, w_edge, w_qkv, b_qkv, w_out, b_out, csr.rowptr,
                                csr.receiver, csr.perm, rcsr.rowptr, rcsr.perm, exact, performer, plan, projection,
                                seed, heads, aggr, gate_group, float(dropout), scale, float(eps))
    return out
