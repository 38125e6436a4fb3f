"""The loop reference and the FAVOR+ helpers against independent formulas."""
import math

import pytest
import torch

from nt_kernels import default_nb_features, orthogonal_random_features, switch_threshold
from nt_reference import ops as ref


def performer_pytorch_formula(q, k, v, projection, eps):
    """performer-pytorch's softmax_kernel + linear_attention, written out for (B, H, n, D) inputs."""
    m, d = projection.shape
    normalizer, ratio = d ** -0.25, m ** -0.5

    def features(x, is_query):
        dash = torch.einsum("bhnd,md->bhnm", normalizer * x, projection)
        diag = ((x ** 2).sum(-1) / 2.0 * normalizer ** 2).unsqueeze(-1)
        stab = dash.amax(-1, keepdim=True) if is_query else dash.amax((-1, -2), keepdim=True)
        return ratio * (torch.exp(dash - diag - stab) + eps)

    fq, fk = features(q, True), features(k, False)
    d_inv = 1.0 / torch.einsum("bhnm,bhm->bhn", fq, fk.sum(-2))
    context = torch.einsum("bhnm,bhne->bhme", fk, v)
    return torch.einsum("bhme,bhnm,bhn->bhne", context, fq, d_inv)


@pytest.mark.parametrize("n, heads, dim, m", [(1, 1, 4, 3), (7, 2, 8, 16), (40, 3, 9, 19)],
                         ids=["one-row", "small", "odd-dim"])
def test_reference_performer_matches_performer_pytorch_formulas(n, heads, dim, m):
    gen = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(n, heads, dim, generator=gen, dtype=torch.float64) for _ in range(3))
    projection = orthogonal_random_features(m, dim, generator=gen, dtype=torch.float64)
    ours = ref.segment_performer_attention(q, k, v, torch.tensor([0, n]), projection)
    theirs = performer_pytorch_formula(*(t.permute(1, 0, 2).unsqueeze(0) for t in (q, k, v)),
                                       projection, 1e-4)
    torch.testing.assert_close(ours, theirs[0].permute(1, 0, 2), rtol=1e-12, atol=1e-12)


def test_performer_approximates_softmax_with_many_features():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (0.5 * torch.randn(32, 1, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    rowptr = torch.tensor([0, 32])
    exact = ref.segment_softmax_attention(q, k, v, rowptr)
    projection = orthogonal_random_features(2048, 4, generator=gen, dtype=torch.float64)
    approx = ref.segment_performer_attention(q, k, v, rowptr, projection, eps=0.0)
    # FAVOR+ is unbiased for exp(q.k / sqrt(D)); 2048 features leave a Monte-Carlo
    # error well below how far attention moves the outputs from the plain mean of v.
    error = (approx - exact).abs().max()
    assert error < 0.05
    assert error < 0.5 * (exact - v.mean(0)).abs().max()


def test_reference_single_row_and_empty_segments():
    q, k, v = (torch.randn(3, 2, 5, dtype=torch.float64) for _ in range(3))
    rowptr = torch.tensor([0, 0, 1, 3, 3])
    out = ref.segment_softmax_attention(q, k, v, rowptr)
    torch.testing.assert_close(out[0], v[0])  # a one-row segment returns its value
    projection = orthogonal_random_features(6, 5, dtype=torch.float64)
    torch.testing.assert_close(ref.segment_performer_attention(q, k, v, rowptr, projection)[0], v[0])


def test_switch_uses_threshold_inclusively():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(9, 1, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    rowptr = torch.tensor([0, 4, 9])  # sizes 4 and 5
    projection = orthogonal_random_features(5, 4, generator=gen, dtype=torch.float64)
    switched = ref.neighbourhood_attention(q, k, v, rowptr, projection=projection, threshold=4)
    exact = ref.segment_softmax_attention(q, k, v, rowptr)
    performer = ref.segment_performer_attention(q, k, v, rowptr, projection)
    torch.testing.assert_close(switched[:4], exact[:4])
    torch.testing.assert_close(switched[4:], performer[4:])


def test_orthogonal_random_features_blocks_are_orthogonal():
    gen = torch.Generator().manual_seed(3)
    projection = orthogonal_random_features(20, 8, generator=gen, dtype=torch.float64)
    assert projection.shape == (20, 8)
    for start in (0, 8):
        block = projection[start:start + 8]
        gram = block @ block.T
        torch.testing.assert_close(gram, torch.diag(torch.diagonal(gram)), atol=1e-10, rtol=0)
    again = orthogonal_random_features(20, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    assert torch.equal(projection, again)


def test_threshold_and_default_features():
    assert default_nb_features(8) == int(8 * math.log(8)) == 16
    assert default_nb_features(1) == 1
    assert switch_threshold(16, 8) == pytest.approx(16 + math.sqrt(16 ** 2 + 8 * 16))
    n = switch_threshold(16, 8)
    assert n * n == pytest.approx(2 * n * 16 + 8 * 16)  # solves n^2 = 2 n p + h p (paper §4.1)


@pytest.mark.parametrize("call, match", [
    (lambda: orthogonal_random_features(0, 4), "m must be >= 1"),
    (lambda: orthogonal_random_features(4, 0), "head_dim must be >= 1"),
    (lambda: switch_threshold(0, 4), "m .* must be >= 1"),
    (lambda: default_nb_features(0), "head_dim must be >= 1"),
], ids=["features-m", "features-dim", "threshold-m", "default-dim"])
def test_feature_helper_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
