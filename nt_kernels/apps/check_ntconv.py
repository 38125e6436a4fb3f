"""``nt-kernels check`` suite of the fused NT layer op ``nt_kernels.ops.ntconv`` (docs/design.md §9).

Every aggregator (``weighted_mean`` with both gate groups) on two graphs:
neighbourhoods one below, at and one above a switch threshold of 10 with a
3,000-row Performer hub, and an exact-only graph with packed tiles and 65- and
130-row multi-tile neighbourhoods, messages sent to random receivers among E / 8
nodes; edge features and dropout 0.1 (the counter
mask, so the reference draws the same one).  The output and all eight
gradients (node terms, edge features and every weight) follow the accuracy
rule (nt_kernels/apps/tolerance.py) against ``nt_reference.nn.ntconv_messages``
in float64.  Plus, per head dim and dtype: two runs bitwise identical, and a NaN
in one edge feature reaches only its neighbourhood's receivers.  On CUDA this runs the Triton
implementation, on CPU the C++ one.  ``max`` runs with one message per
receiver: with several, messages closer than the rounding step of a half type
swap places as the maximum and its gradient moves by O(1), so no error rule
applies.

Where PyTorch's own low-precision run is not finite (float16: the plain-PyTorch
reference overflows on the Performer graph and in weighted_mean's dense masked
softmax) or far coarser than the float32 run scaled by the eps ratio, the rule's
baseline is the float32 reference's error times eps(dtype) / eps(float32)
(nt_kernels/apps/tolerance.py; the tolerance is marked "*").
"""
from __future__ import annotations

from typing import Iterator

import torch

from nt_kernels import NeighbourhoodCSR, default_nb_features, orthogonal_random_features
from nt_kernels.apps.check_common import (DTYPES, LOW_PRECISION, Row, Settings, cached_reference, differing_elements,
                                          verdict)
from nt_kernels.ops.ntconv import ntconv
from nt_reference.nn import ntconv_messages

__all__ = ["GRAPHS", "accuracy_rows", "ntconv_suite", "property_rows"]

HEADS, EDGE_DIM, DROPOUT, SEED = 2, 3, 0.1, 12345
MAX_DIM = 64  # the hub's float64 reference
AGGRS = (("sum", "receiver"), ("mean", "receiver"), ("max", "receiver"), ("weighted_mean", "receiver"),
         ("weighted_mean", "centre"), ("gated_sum", "receiver"))
GRAPHS = {  # name -> (neighbourhood sizes, switch threshold or None for exact attention only)
    "threshold 10 +- 1, 3,000-row hub": ([0, 1, 2, 3, 5, 9, 10, 11, 12, 1, 0, 3000, 4, 2], 10.0),
    "exact: packed + multi-tile": ([1, 3, 3, 5, 9, 12, 20, 64, 65, 130, 0, 2], None),
}
NAMES = ("out", "centre", "receiver_term", "edge_attr", "w_edge", "w_qkv", "b_qkv", "w_out", "b_out")
MESSAGES_PER_RECEIVER = 8  # on average: receivers' outputs differ (a swap shows) and low-precision sums stay short


def _graph(sizes, device, seed, distinct_receivers=False):
    """(edge_index, num_nodes): centre j sends sizes[j] messages to random receivers among
    E / MESSAGES_PER_RECEIVER nodes, or with ``distinct_receivers`` each message to a receiver of
    its own (num_nodes grows to E)."""
    gen = torch.Generator().manual_seed(seed)
    centre = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    n = max(len(sizes), centre.numel() if distinct_receivers else centre.numel() // MESSAGES_PER_RECEIVER)
    receiver = torch.randperm(n, generator=gen)[:centre.numel()] if distinct_receivers else \
        torch.randint(0, n, centre.shape, generator=gen)
    edge_index = torch.stack([centre, receiver])
    return edge_index[:, torch.randperm(centre.numel(), generator=gen)].to(device), n


def _inputs(n, e, dim, aggr, device, seed):
    gen = torch.Generator().manual_seed(seed)
    c = HEADS * dim
    c_out = 2 * c if aggr in ("weighted_mean", "gated_sum") else c

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(device)
    tensors = dict(centre=rand(n, c), receiver_term=rand(n, c), edge_attr=rand(e, EDGE_DIM),
                   w_edge=rand(c, EDGE_DIM, scale=EDGE_DIM ** -0.5), w_qkv=rand(3 * c, c, scale=c ** -0.5),
                   b_qkv=rand(3 * c, scale=0.1), w_out=rand(c_out, c, scale=c ** -0.5), b_out=rand(c_out, scale=0.1))
    projection = orthogonal_random_features(default_nb_features(dim), dim, generator=gen,
                                            dtype=torch.float64).to(device)
    return tensors, projection, rand(n, c)


def _run(fn, tensors, grad_out, dtype):
    """[out, gradients in NAMES order] of fn(**leaves) in ``dtype``."""
    leaves = {k: v.to(dtype).requires_grad_() for k, v in tensors.items()}
    out = fn(leaves, dtype)
    grads = torch.autograd.grad(out, list(leaves.values()), grad_out.to(out.dtype))
    return [out.detach()] + list(grads)


def _run_mixed(reference, tensors, grad_out, dtype):
    """_run's outputs of the reference computed in float32 on the inputs (projection included) rounded
    to ``dtype``, rounded to ``dtype``: the better-conditioned baseline of nt_kernels/apps/tolerance.py."""
    leaves = {k: v.to(dtype).float().requires_grad_() for k, v in tensors.items()}
    out = reference(leaves, torch.float32, rounding=dtype)
    grads = torch.autograd.grad(out, list(leaves.values()), grad_out.to(dtype).float())
    return [t.to(dtype) for t in (out.detach(), *grads)]


def _callers(edge_index, n, projection, threshold, aggr, gate_group):
    csr = NeighbourhoodCSR.from_edge_index(edge_index, n)
    kw = dict(heads=HEADS, aggr=aggr, gate_group=gate_group, dropout=DROPOUT, seed=SEED)

    def ours(t, dtype):
        p = None if threshold is None else projection.to(dtype)
        return ntconv(t["centre"], t["receiver_term"], csr, t["w_qkv"], t["b_qkv"], t["w_out"], t["b_out"],
                      edge_attr=t["edge_attr"], w_edge=t["w_edge"], projection=p, threshold=threshold, **kw)

    def reference(t, dtype, rounding=None):
        p = None if threshold is None else projection.to(rounding or dtype).to(dtype)
        return ntconv_messages(t["centre"], t["receiver_term"], edge_index, t["w_qkv"], t["b_qkv"], t["w_out"],
                               t["b_out"], edge_attr=t["edge_attr"], w_edge=t["w_edge"], projection=p,
                               threshold=threshold, **kw)
    return ours, reference


def ntconv_suite(s: Settings) -> Iterator[Row]:
    for graph_name in GRAPHS:
        for dim in (d for d in s.dims if d <= MAX_DIM):
            for aggr, gate_group in AGGRS:
                yield from accuracy_rows(graph_name, aggr, gate_group, dim, s)
    for dim in (d for d in s.dims if d <= MAX_DIM):
        for dtype_name in s.dtypes:
            yield from property_rows(dim, dtype_name, s)


def accuracy_rows(graph_name: str, aggr: str, gate_group: str, dim: int, s: Settings,
                  dtypes: tuple[str, ...] | None = None) -> Iterator[Row]:
    """The accuracy rule over the output and all eight gradients, one row per dtype (default: those of ``s``)."""
    dtypes = s.dtypes if dtypes is None else dtypes
    sizes, threshold = GRAPHS[graph_name]
    edge_index, n = _graph(sizes, s.device, s.seed, distinct_receivers=aggr == "max")
    case = f"{graph_name}, {aggr}" + (" (centre)" if gate_group == "centre" else "")
    key = ("ntconv", graph_name, aggr, gate_group, dim, str(s.device), s.seed)
    tensors, projection, grad_out = cached_reference(
        s, key, "inputs", lambda _: _inputs(n, edge_index.shape[1], dim, aggr, s.device, s.seed + dim))
    ours, reference = _callers(edge_index, n, projection, threshold, aggr, gate_group)
    if s.kernels_only:
        for dtype_name in dtypes:
            _run(ours, tensors, grad_out, DTYPES[dtype_name])
            yield Row("ntconv", case, dtype_name, dim, status="skip", note="kernels only")
        return
    reference_in = lambda dt: cached_reference(s, key, dt, lambda dt: _run(reference, tensors, grad_out, dt))  # noqa
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        float32 = reference_in(torch.float32) if dtype in LOW_PRECISION else None
        yield verdict(Row("ntconv", case, dtype_name, dim), NAMES, _run(ours, tensors, grad_out, dtype),
                      reference_in(dtype), reference_in(torch.float64), dtype, float32,
                      lambda: cached_reference(s, key, ("mixed", dtype),
                                               lambda dt: _run_mixed(reference, tensors, grad_out, dt[1])))


def property_rows(dim: int, dtype_name: str, s: Settings) -> Iterator[Row]:
    """On the hub graph (weighted_mean): two runs bitwise identical, and a NaN in one edge_attr row of
    the 5-row neighbourhood makes its receivers' rows NaN and changes no other row."""
    sizes, threshold = GRAPHS["threshold 10 +- 1, 3,000-row hub"]
    edge_index, n = _graph(sizes, s.device, s.seed)
    own = (edge_index[0] == sizes.index(5)).nonzero().flatten()
    reached = torch.zeros(n, dtype=torch.bool, device=s.device)
    reached[edge_index[1, own]] = True
    tensors, projection, grad_out = cached_reference(
        s, ("ntconv properties", dim, str(s.device), s.seed), "inputs",
        lambda _: _inputs(n, edge_index.shape[1], dim, "weighted_mean", s.device, s.seed))
    ours, _ = _callers(edge_index, n, projection, threshold, "weighted_mean", "receiver")
    poisoned = dict(tensors, edge_attr=tensors["edge_attr"].clone())
    poisoned["edge_attr"][own[0], 1] = float("nan")
    dtype = DTYPES[dtype_name]
    first, second = (_run(ours, tensors, grad_out, dtype) for _ in range(2))
    differing = differing_elements(first, second)
    yield Row("ntconv", "bitwise determinism, 2 runs", dtype_name, dim, "out,grads", float(differing), 0.0,
              "pass" if differing == 0 else "FAIL", "differing elements")
    out = _run(ours, poisoned, grad_out, dtype)[0]
    bad = int((~out[reached].isnan().any(1)).sum()) + int((out[~reached] != first[0][~reached]).sum())
    yield Row("ntconv", "NaN stays at its receivers", dtype_name, dim, "out", float(bad), 0.0,
              "pass" if bad == 0 else "FAIL", "rows changed outside / not NaN at the receivers")
