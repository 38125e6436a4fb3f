"""The bench peers (what a user would write instead of our op) against the loop reference.

Forward and gradients of pyg-pairs, nested and performer-pytorch-sizes; the
forward of flex (no FlexAttention backward on the CPU), its block mask against
``create_block_mask``; the padded performer-pytorch peer reproduces the padding
leak exactly; the skip / unsupported statuses; the memory estimates of the peers,
and a peer over the memory cap skipped with its estimate, by the CLI and by the
in-process pytest-benchmark suites (bench/).
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest
import torch

from nt_kernels.bench import backends as bb
from nt_kernels.bench import peers
from nt_kernels.csr import NeighbourhoodCSR
from nt_kernels.performer import orthogonal_random_features
from nt_reference import ops as ref

pytestmark = pytest.mark.usefixtures("single_thread")

H, D, M = 2, 4, 6
SIZES = [3, 0, 1, 7, 2, 5]          # an empty segment and a single-row one


def make_csr(sizes, device="cpu"):
    sizes = torch.tensor(sizes)
    rowptr = torch.zeros(sizes.numel() + 1, dtype=torch.long)
    torch.cumsum(sizes, 0, out=rowptr[1:])
    rows = int(rowptr[-1])
    csr = NeighbourhoodCSR(rowptr, torch.arange(rows), torch.zeros(rows, dtype=torch.long), sizes.numel(),
                           int(sizes.max()))
    return csr if device == "cpu" else csr.to(device)


def make_context(csr, *, dtype=torch.float64, projection=None, threshold=math.inf, cap=1e9, head_dim=D):
    return bb.Context(csr=csr, projection=projection, threshold=threshold, heads=H, head_dim=head_dim, dtype=dtype,
                      device=csr.rowptr.device, reference_max_edges=10_000, memory_cap_bytes=int(cap))


def inputs(rows, dtype=torch.float64, device="cpu", seed=0, head_dim=D):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, H, head_dim, generator=gen, dtype=dtype).to(device).requires_grad_(True)
            for _ in range(3)]


def check_against(fn, expected_fn, q, k, v, *, atol):
    out = fn(q, k, v)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    expected = expected_fn(q, k, v)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad)
    torch.testing.assert_close(out, expected, atol=atol, rtol=0)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, atol=atol, rtol=0)


def exact_reference(csr):
    return lambda q, k, v: ref.neighbourhood_attention(q, k, v, csr.rowptr)


@pytest.mark.parametrize("name", ["pyg-pairs", "nested"])
def test_exact_peers_match_the_reference(name):
    csr = make_csr(SIZES)
    ctx = make_context(csr)
    backend = bb.Backend(name, name)
    assert backend.semantics == "exact" and backend.is_peer and bb.skip_reason(backend, ctx) is None
    check_against(bb.prepare(backend, ctx), exact_reference(csr), *inputs(csr.num_edges), atol=1e-12)


def test_pair_index_lists_every_pair_of_a_segment():
    csr = make_csr(SIZES)
    query, key = peers.pair_index(csr.rowptr)
    expected = [(a, b) for s in range(len(SIZES)) for a in range(int(csr.rowptr[s]), int(csr.rowptr[s + 1]))
                for b in range(int(csr.rowptr[s]), int(csr.rowptr[s + 1]))]
    assert list(zip(query.tolist(), key.tolist())) == expected
    assert peers.sum_squared_sizes(make_context(csr)) == len(expected) == sum(n * n for n in SIZES)


def test_flex_block_mask_equals_create_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    for sizes in (SIZES, [130, 0, 1, 300, 7, 128], [128, 128, 256]):
        csr = make_csr(sizes)
        doc = csr.centre
        expected = create_block_mask(lambda b, h, q, k: doc[q] == doc[k], None, None, csr.num_edges,
                                     csr.num_edges, device="cpu")
        mask = peers.document_block_mask(csr)
        assert torch.equal(mask.to_dense(), expected.to_dense())
        assert torch.equal(mask.full_kv_num_blocks, expected.full_kv_num_blocks)
        assert torch.equal(mask.kv_num_blocks, expected.kv_num_blocks)


def test_flex_forward_matches_the_reference():
    csr = make_csr([130, 0, 1, 300, 7, 128])
    ctx = make_context(csr, dtype=torch.float32)
    backend = bb.Backend("flex", "flex")
    if bb.skip_reason(backend, ctx) is not None:
        pytest.skip(bb.skip_reason(backend, ctx))
    reason = bb.forward_only_reason(backend, ctx)
    q, k, v = inputs(csr.num_edges, dtype=torch.float32, seed=1)
    fn = bb.prepare(backend, ctx)
    expected = ref.neighbourhood_attention(*(t.detach().double() for t in (q, k, v)), csr.rowptr)
    if reason is not None:   # CPU in torch 2.13: FlexAttention has no backward there
        assert "backward" in reason
        out = fn(*(t.detach() for t in (q, k, v)))
    else:
        out = fn(q, k, v)
        out.sum().backward()
        assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name, head_dim", [("pyg-pairs", D), ("nested", D), ("flex", 16)],
                         ids=["pyg-pairs", "nested", "flex"])
def test_exact_peers_on_cuda(name, head_dim):
    """flex at D = 16, the least its CUDA template takes (test_flex_peer_says_why_it_cannot_run)."""
    csr = make_csr([130, 0, 1, 300, 7, 128], device="cuda")
    ctx = make_context(csr, dtype=torch.float32, head_dim=head_dim)
    backend = bb.Backend(name, name)
    if bb.skip_reason(backend, ctx) is not None:
        pytest.skip(bb.skip_reason(backend, ctx))
    assert bb.forward_only_reason(backend, ctx) is None
    q, k, v = inputs(csr.num_edges, dtype=torch.float32, device="cuda", seed=2, head_dim=head_dim)
    check_against(bb.prepare(backend, ctx),
                  lambda q, k, v: ref.neighbourhood_attention(q, k, v, csr.rowptr), q, k, v, atol=1e-5)


def test_flex_peer_says_why_it_cannot_run_small_head_dims_on_cuda():
    """The H200 run of 2026-11-28 met Inductor's NotImplementedError at D = 4; the bench now says so
    before it compiles (the context says cuda; nothing runs)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    backend = bb.Backend("flex", "flex")
    ctx = make_context(make_csr(SIZES), dtype=torch.bfloat16, head_dim=8)
    ctx.device = torch.device("cuda")
    assert bb.skip_reason(backend, ctx) == ("unsupported: flex on cuda needs a head dim of at least 16 "
                                            "(Inductor's Triton template: tl.dot), not 8")
    ctx.head_dim = 16
    assert bb.skip_reason(backend, ctx) is None


@pytest.mark.parametrize("dtype, device, head_dim, says", [
    (torch.bfloat16, "cpu", 8, "runs on CUDA only, not cpu"),
    (torch.float32, "meta", 8, "takes bfloat16 and float16 only, not float32"),
    (torch.float16, "meta", 12, "head dim that is a multiple of 8 and at most 256, not 12"),
], ids=["cpu", "float32", "d12"])
def test_varlen_peer_says_why_it_cannot_run(dtype, device, head_dim, says):
    ctx = make_context(make_csr(SIZES), dtype=dtype)
    ctx.device, ctx.head_dim = torch.device("cuda" if device == "meta" else device), head_dim
    reason = bb.skip_reason(bb.Backend("varlen", "varlen"), ctx)
    assert reason.startswith("unsupported: varlen_attn") and says in reason


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_varlen_peer_on_cuda_within_twice_pytorchs_error(dtype):
    """FlashAttention-2 varlen on the packed rows (empty and one-row segments included) against the float64
    loop reference: its error at most twice that of the same loop in the low dtype, forward and gradients."""
    csr = make_csr([130, 0, 1, 300, 7, 128], device="cuda")
    ctx = make_context(csr, dtype=dtype)
    ctx.head_dim = 8  # FlashAttention-2 takes head dims that are multiples of 8
    backend = bb.Backend("varlen", "varlen")
    if bb.skip_reason(backend, ctx) is not None:
        pytest.skip(bb.skip_reason(backend, ctx))
    gen = torch.Generator().manual_seed(4)
    q64, k64, v64 = (torch.randn(csr.num_edges, H, 8, generator=gen, dtype=torch.float64, device="cpu").cuda()
                     for _ in range(3))
    grad = torch.randn(csr.num_edges, H, 8, generator=gen, dtype=torch.float64).cuda()

    def run(fn, dt):
        q, k, v = (t.to(dt).requires_grad_(True) for t in (q64, k64, v64))
        out = fn(q, k, v)
        return [out.double(), *(g.double() for g in torch.autograd.grad(out, (q, k, v), grad.to(dt)))]
    loop = lambda q, k, v: ref.neighbourhood_attention(q, k, v, csr.rowptr)  # noqa: E731
    want, low, got = run(loop, torch.float64), run(loop, dtype), run(bb.prepare(backend, ctx), dtype)
    for name, w, l, g in zip(("o", "dq", "dk", "dv"), want, low, got):
        assert (g - w).abs().max() <= 2 * (l - w).abs().max() + 1e-6, name


def performer_context(sizes, dtype=torch.float64):
    csr = make_csr(sizes)
    projection = orthogonal_random_features(M, D, generator=torch.Generator().manual_seed(3), dtype=dtype)
    return csr, make_context(csr, dtype=dtype, projection=projection, threshold=2.5)


PERFORMER_SIZES = [3, 0, 7, 4, 4, 9, 3]     # every non-empty segment above the threshold 2.5


def test_performer_sizes_peer_matches_the_reference():
    pytest.importorskip("performer_pytorch", reason="performer-pytorch not installed (pip install 'nt-kernels[peers]')")
    csr, ctx = performer_context(PERFORMER_SIZES)
    backend = bb.Backend("performer-pytorch-sizes", "performer-pytorch")
    assert bb.skip_reason(backend, ctx) is None
    check_against(bb.prepare(backend, ctx),
                  lambda q, k, v: ref.neighbourhood_attention(q, k, v, csr.rowptr, projection=ctx.projection,
                                                              threshold=ctx.threshold),
                  *inputs(csr.num_edges, seed=4), atol=1e-10)


def test_padded_performer_peer_leaks_through_its_padded_keys():
    """FastAttention has no key mask: zero-padded keys enter the normaliser.  The peer equals the reference
    Performer run on the zero-padded segments, and differs from the unpadded reference."""
    pytest.importorskip("performer_pytorch", reason="performer-pytorch not installed (pip install 'nt-kernels[peers]')")
    csr, ctx = performer_context(PERFORMER_SIZES)
    backend = bb.Backend("performer-pytorch", "performer-pytorch")
    groups = peers.padded_groups(backend, ctx)
    assert sum(count for count, _, _ in groups) == 6 and all(performer for _, _, performer in groups)
    q, k, v = inputs(csr.num_edges, seed=5)
    out = bb.prepare(backend, ctx)(q, k, v)
    sizes = torch.diff(csr.rowptr)
    padded_to = torch.zeros_like(sizes)
    for segments in peers._group_segments(backend, ctx, sizes):
        padded_to[segments] = sizes[segments].max()
    assert (padded_to > sizes).any()
    expected = []
    for s in range(len(PERFORMER_SIZES)):
        lo, hi, length = int(csr.rowptr[s]), int(csr.rowptr[s + 1]), int(padded_to[s])
        if hi == lo:
            continue
        pad = [torch.cat([t[lo:hi], t.new_zeros(length - (hi - lo), H, D)]) for t in (q, k, v)]
        expected.append(ref.performer_attention(*pad, ctx.projection, 1e-4)[: hi - lo])
    torch.testing.assert_close(out, torch.cat(expected), atol=1e-10, rtol=0)
    unpadded = ref.neighbourhood_attention(q, k, v, csr.rowptr, projection=ctx.projection, threshold=ctx.threshold)
    assert (out - unpadded).abs().max() > 1e-3


def test_peer_statuses():
    csr = make_csr(SIZES)
    pairs = bb.Backend("pyg-pairs", "pyg-pairs")
    small_cap = make_context(csr, cap=100)
    assert peers.pairs_estimate_bytes(pairs, small_cap) > 100
    assert bb.skip_reason(pairs, small_cap).startswith("skipped: est.")
    assert peers.pairs_estimate_bytes(bb.Backend("nested", "nested"), small_cap) is None
    performer = bb.Backend("performer-pytorch", "performer-pytorch")
    assert bb.skip_reason(performer, make_context(csr)) in (
        "n/a: exact mode (Performer-only peer)",
        "skipped: performer-pytorch not installed (pip install 'nt-kernels[peers]')")
    _, mixed = performer_context([1, 5, 2])
    assert bb.skip_reason(performer, mixed) in (
        "n/a: graph has exact-path segments (Performer-only peer; use --subset performer)",
        "skipped: performer-pytorch not installed (pip install 'nt-kernels[peers]')")
    assert peers.padded_groups(performer, mixed) is None


def test_nested_and_flex_memory_estimates():
    """nested on the CPU pads every non-empty segment to the longest (S x H x L_max² score elements);
    on CUDA it has no padding; flex adds its block mask's (E / 128)² block pairs.  Both are what
    peers.estimate_bytes gives, and pyg-pairs' estimate stays its pairs estimate."""
    csr = make_csr(SIZES)
    ctx = make_context(csr)
    nested, flex, pairs = (bb.Backend(name, name) for name in ("nested", "flex", "pyg-pairs"))
    rows = csr.num_edges * H * peers.EST_ROW_C_D * D * 8      # float64
    segments, longest = sum(n > 0 for n in SIZES), max(SIZES)
    assert peers.nested_estimate_bytes(nested, ctx) == rows + segments * H * longest ** 2 * peers.EST_NESTED_SCORE_BYTES
    assert peers.flex_estimate_bytes(flex, ctx) == rows + peers.EST_FLEX_BLOCK_PAIR_BYTES  # one block of 128 rows
    assert peers.estimate_bytes(nested, ctx) == peers.nested_estimate_bytes(nested, ctx)
    assert peers.estimate_bytes(flex, ctx) == peers.flex_estimate_bytes(flex, ctx)
    assert peers.estimate_bytes(pairs, ctx) == peers.pairs_estimate_bytes(pairs, ctx)
    assert peers.nested_estimate_bytes(flex, ctx) is None and peers.flex_estimate_bytes(nested, ctx) is None
    assert peers.estimate_bytes(bb.Backend("performer-pytorch", "performer-pytorch"), ctx) is None
    one_hub = make_context(make_csr([1] * 99 + [100]))      # one long segment pads the 99 short ones
    assert peers.nested_estimate_bytes(nested, one_hub) > 100 * H * 100 ** 2 * peers.EST_NESTED_SCORE_BYTES
    one_hub.device = torch.device("cuda")                   # the jagged kernels: no padding
    assert peers.nested_estimate_bytes(nested, one_hub) == 199 * H * peers.EST_ROW_C_D * D * 8
    big = make_context(make_csr([128] * 1000))              # 1,000 blocks: 40 MB of block mask
    assert peers.flex_estimate_bytes(flex, big) >= 1000 ** 2 * peers.EST_FLEX_BLOCK_PAIR_BYTES


@pytest.mark.parametrize("name", ["pyg-pairs", "nested", "flex"])
def test_a_peer_over_the_cap_is_skipped_with_its_estimate(name):
    csr = make_csr(SIZES)
    backend = bb.Backend(name, name)
    estimate = peers.estimate_bytes(backend, make_context(csr))
    assert bb.skip_reason(backend, make_context(csr, cap=estimate)) is None
    reason = bb.skip_reason(backend, make_context(csr, cap=estimate - 1))
    assert reason == f"skipped: est. {estimate / 1e9:.1f} GB > cap {(estimate - 1) / 1e9:.1f} GB"


def test_the_benchmark_suites_skip_a_peer_over_the_cap_in_process(tmp_path):
    """bench/ (pytest-benchmark, in-process: no worker's address-space limit) on the graph where the nested
    peer once took 24 GB and the OOM killer: the peer is skipped with its estimate, before any tensor is built."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, NT_BENCH_GRAPHS="synthetic-minesweeper@0.25", NT_BENCH_BACKENDS="nested",
               NT_BENCH_MEMORY_CAP_GB="10")
    report = tmp_path / "report.xml"
    done = subprocess.run([sys.executable, "-m", "pytest", "bench/test_bench_ops.py", "--benchmark-disable", "-q",
                           "-p", "no:cacheprovider", f"--junitxml={report}"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    skipped = {case.get("name"): case.find("skipped").get("message")
               for case in ElementTree.parse(report).iter("testcase") if case.find("skipped") is not None}
    assert set(skipped) == {"test_forward[synthetic-minesweeper@0.25-nested]",
                            "test_forward_backward[synthetic-minesweeper@0.25-nested]"}, done.stdout[-3000:]
    for message in skipped.values():
        assert re.fullmatch(r"skipped: est\. \d+\.\d GB > cap 10\.0 GB", message), message


def test_missing_package_and_unsupported_build_statuses(monkeypatch):
    csr, ctx = performer_context(PERFORMER_SIZES)
    monkeypatch.setitem(sys.modules, "performer_pytorch", None)      # import raises ImportError
    assert bb.skip_reason(bb.Backend("performer-pytorch", "performer-pytorch"), ctx) == \
        "skipped: performer-pytorch not installed (pip install 'nt-kernels[peers]')"

    def no_jagged_sdpa(device):
        raise RuntimeError("jagged SDPA not built")

    monkeypatch.setattr(peers, "_probes", {})
    monkeypatch.setattr(peers, "_probe_nested", no_jagged_sdpa)
    reason = bb.skip_reason(bb.Backend("nested", "nested"), make_context(make_csr(SIZES)))
    assert reason.startswith("unsupported: nested on cpu in torch ") and "RuntimeError: jagged SDPA not built" in reason
