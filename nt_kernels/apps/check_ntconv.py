"""``nt-kernels check`` suite of the fused NT layer op ``nt_kernels.ops.ntconv`` (docs/design.md §9).

Every aggregator (``weighted_mean`` with both gate groups) on two graphs:
neighbourhoods one below, at and one above a switch threshold of 10 with a
3,000-row Performer hub, and an exact-only graph with packed tiles and 65- and
130-row multi-tile neighbourhoods; edge features and dropout 0.1 (the counter
mask, so the reference draws the same one).  The output and all eight
gradients (node terms, edge features and every weight) follow the accuracy
rule of :mod:`nt_kernels.apps.check` against ``nt_reference.nn.ntconv_messages``
in float64.  Plus: two runs bitwise identical.  On CUDA this runs the Triton
implementation, on CPU the C++ one.  ``max`` runs with one message per
receiver: with several, messages closer than the rounding step of a half type
swap places as the maximum and its gradient moves by O(1), so no error rule
applies.

float16: the plain-PyTorch reference itself overflows on the Performer
graph and in weighted_mean's dense masked softmax (non-finite gradients);
there the rule's baseline error is the float32 reference's times
eps(float16) / eps(float32), as in :mod:`nt_kernels.apps.check` (the
tolerance is marked "*"), so no tolerance is infinite.
"""
from __future__ import annotations

from typing import Iterator

import torch

from nt_kernels import NeighbourhoodCSR, default_nb_features, orthogonal_random_features
from nt_kernels.apps.check import DTYPES, Row, Settings, verdict
from nt_reference.nn import ntconv_messages

__all__ = ["ntconv_suite"]

HEADS, EDGE_DIM, DROPOUT, SEED = 2, 3, 0.1, 12345
MAX_DIM = 64  # the hub's float64 reference
AGGRS = (("sum", "receiver"), ("mean", "receiver"), ("max", "receiver"), ("weighted_mean", "receiver"),
         ("weighted_mean", "centre"), ("gated_sum", "receiver"))
GRAPHS = {  # name -> (neighbourhood sizes, switch threshold or None for exact attention only)
    "threshold 10 +- 1, 3,000-row hub": ([0, 1, 2, 3, 5, 9, 10, 11, 12, 1, 0, 3000, 4, 2], 10.0),
    "exact: packed + multi-tile": ([1, 3, 3, 5, 9, 12, 20, 64, 65, 130, 0, 2], None),
}
NAMES = ("out", "centre", "receiver_term", "edge_attr", "w_edge", "w_qkv", "b_qkv", "w_out", "b_out")


def _graph(sizes, device, seed, distinct_receivers=False):
    """(edge_index, num_nodes): centre j sends sizes[j] messages to random receivers, or with
    ``distinct_receivers`` each message to a receiver of its own (num_nodes grows to E)."""
    gen = torch.Generator().manual_seed(seed)
    centre = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    n = max(len(sizes), centre.numel()) if distinct_receivers else len(sizes)
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


def _callers(edge_index, n, projection, threshold, aggr, gate_group):
    from nt_kernels.ops.ntconv import ntconv

    csr = NeighbourhoodCSR.from_edge_index(edge_index, n)
    kw = dict(heads=HEADS, aggr=aggr, gate_group=gate_group, dropout=DROPOUT, seed=SEED)

    def ours(t, dtype):
        p = None if threshold is None else projection.to(dtype)
        return ntconv(t["centre"], t["receiver_term"], csr, t["w_qkv"], t["b_qkv"], t["w_out"], t["b_out"],
                      edge_attr=t["edge_attr"], w_edge=t["w_edge"], projection=p, threshold=threshold, **kw)

    def reference(t, dtype):
        p = None if threshold is None else projection.to(dtype)
        return ntconv_messages(t["centre"], t["receiver_term"], edge_index, t["w_qkv"], t["b_qkv"], t["w_out"],
                               t["b_out"], edge_attr=t["edge_attr"], w_edge=t["w_edge"], projection=p,
                               threshold=threshold, **kw)
    return ours, reference


def _row(case, dtype_name, dim, ours, torch_low, exact, float32_run) -> Row:
    """The accuracy rule over the output and every gradient (the worst ratio is reported)."""
    return verdict(Row("ntconv", case, dtype_name, dim), NAMES, ours, torch_low, exact, DTYPES[dtype_name],
                   float32_run, same_dtype=False)


def ntconv_suite(s: Settings) -> Iterator[Row]:
    try:
        import nt_kernels.ops.ntconv  # noqa: F401
    except ImportError as exc:
        yield Row("ntconv", "fused NT layer", "-", None, status="skip", note=f"op not available: {exc}")
        return
    for graph_name, (sizes, threshold) in GRAPHS.items():
        for dim in (d for d in s.dims if d <= MAX_DIM):
            for aggr, gate_group in AGGRS:
                edge_index, n = _graph(sizes, s.device, s.seed, distinct_receivers=aggr == "max")
                case = f"{graph_name}, {aggr}" + (" (centre)" if gate_group == "centre" else "")
                tensors, projection, grad_out = _inputs(n, edge_index.shape[1], dim, aggr, s.device, s.seed + dim)
                ours, reference = _callers(edge_index, n, projection, threshold, aggr, gate_group)
                if s.kernels_only:
                    for dtype_name in s.dtypes:
                        _run(ours, tensors, grad_out, DTYPES[dtype_name])
                        yield Row("ntconv", case, dtype_name, dim, status="skip", note="kernels only")
                    continue
                exact = _run(reference, tensors, grad_out, torch.float64)
                for dtype_name in s.dtypes:
                    dtype = DTYPES[dtype_name]
                    yield _row(case, dtype_name, dim, _run(ours, tensors, grad_out, dtype),
                               _run(reference, tensors, grad_out, dtype), exact,
                               lambda: _run(reference, tensors, grad_out, torch.float32))
    yield from _determinism(s)


def _determinism(s: Settings) -> Iterator[Row]:
    sizes, threshold = GRAPHS["threshold 10 +- 1, 3,000-row hub"]
    edge_index, n = _graph(sizes, s.device, s.seed)
    dim = 23
    tensors, projection, grad_out = _inputs(n, edge_index.shape[1], dim, "weighted_mean", s.device, s.seed)
    ours, _ = _callers(edge_index, n, projection, threshold, "weighted_mean", "receiver")
    for dtype_name in s.dtypes:
        first, second = (_run(ours, tensors, grad_out, DTYPES[dtype_name]) for _ in range(2))
        differing = sum(int((a != b).sum()) - int((a.isnan() & b.isnan()).sum()) for a, b in zip(first, second))
        yield Row("ntconv", "bitwise determinism, 2 runs", dtype_name, dim, "out,grads", float(differing), 0.0,
                  "pass" if differing == 0 else "FAIL", "differing elements")
