"""Op-level benchmarks: forward and forward+backward per backend per graph.

Every round takes the next of several input sets (so caches do not flatter a
backend) and, on CUDA, synchronises inside the timed callable.
"""
from __future__ import annotations

import itertools

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rotating(sets):
    """pytest-benchmark ``setup``: the next input set, gradients cleared."""
    cycle = itertools.cycle(sets)

    def setup():
        q, k, v, grad = next(cycle)
        for t in (q, k, v):
            t.grad = None
        return (q, k, v, grad), {}

    return setup


def _info(benchmark, ctx) -> None:
    benchmark.extra_info.update(num_edges=ctx.num_edges, max_degree=ctx.csr.max_degree, heads=ctx.heads,
                                head_dim=ctx.head_dim, dtype=str(ctx.dtype), device=str(ctx.device))


def test_forward(benchmark, case, rounds):
    fn, ctx, sets = case

    def forward(q, k, v, grad):
        out = fn(q, k, v)
        _sync(ctx.device)
        return out

    _info(benchmark, ctx)
    benchmark.pedantic(forward, setup=_rotating(sets), rounds=rounds, warmup_rounds=1)


def test_forward_backward(benchmark, case, rounds):
    fn, ctx, sets = case

    def forward_backward(q, k, v, grad):
        fn(q, k, v).backward(grad)
        _sync(ctx.device)

    _info(benchmark, ctx)
    benchmark.pedantic(forward_backward, setup=_rotating(sets), rounds=rounds, warmup_rounds=1)
