"""The training loop (composition backends, the fused layer, early stopping) and its metrics."""
import itertools
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

import nt_reference.nn as ref
from nt_kernels.apps.train import TrainConfig, roc_auc, score, train_split
from nt_kernels.data.datasets import monophily_graph
from nt_kernels.nn import NT

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("directed", [False, True], ids=["NT", "DirNT"])
def test_training_losses_composition_kernels_vs_reference(directed):
    """The unfused composition (fused=False) draws dropout with F.dropout, like nt_reference: with the
    same seed, kernels and reference loops and nt_reference's NT follow the same loss curve."""
    data = monophily_graph(num_nodes=90, degree=4, seed=1)
    config = TrainConfig(aggr="weighted_mean", head_dim=4, heads=2, num_layers=2, dropout=0.2, directed=directed,
                         lr=1e-2, epochs=10, patience=10)
    runs = {}
    for backend in ("kernels", "reference"):
        runs[backend] = train_split(data, 0, config, dtype=torch.float64, backend=backend, fused=False)["losses"]
    torch.manual_seed(0)
    model = NT(8, 8, 2, 3, heads=2, dropout=0.2, directed=directed, aggr="weighted_mean", fused=False).double()
    plain = ref.NT(8, 8, 2, 3, heads=2, dropout=0.2, directed=directed, aggr="weighted_mean").double()
    plain.load_state_dict(model.state_dict())
    runs["nt_reference"] = train_split(data, 0, config, dtype=torch.float64, model=plain)["losses"]
    runs["kernels-prebuilt"] = train_split(data, 0, config, dtype=torch.float64, model=model)["losses"]
    assert len(runs["kernels"]) == 10 and runs["kernels"][-1] < runs["kernels"][0]
    for name in ("reference", "nt_reference", "kernels-prebuilt"):
        np.testing.assert_allclose(runs[name], runs["kernels"], rtol=0, atol=1e-8, err_msg=name)


@pytest.mark.parametrize("directed", [False, True], ids=["NT", "DirNT"])
def test_training_losses_fused_layer(directed):
    """Without dropout the fused layer op trains exactly like the composition; with dropout (its own
    counter-based mask) a run is reproducible for the same seed and the loss decreases."""
    data = monophily_graph(num_nodes=90, degree=4, seed=1)
    config = TrainConfig(aggr="weighted_mean", head_dim=4, heads=2, num_layers=2, dropout=0.0, directed=directed,
                         lr=1e-2, epochs=10, patience=10)
    fused = train_split(data, 0, config, dtype=torch.float64, fused=True)["losses"]
    composed = train_split(data, 0, config, dtype=torch.float64, fused=False)["losses"]
    np.testing.assert_allclose(fused, composed, rtol=0, atol=1e-8)
    dropout = replace(config, dropout=0.2)
    first = train_split(data, 0, dropout, dtype=torch.float64, fused=True)["losses"]
    again = train_split(data, 0, dropout, dtype=torch.float64, fused=True)["losses"]
    assert first == again and first[-1] < first[0]


def test_early_stopping_and_best_epoch():
    data = monophily_graph(num_nodes=60, degree=3, seed=2)
    config = TrainConfig(head_dim=4, heads=1, num_layers=1, dropout=0.0, lr=0.0, epochs=50, patience=5)
    result = train_split(data, 0, config, dtype=torch.float64, backend="reference")
    assert result["best_epoch"] == 0 and result["epochs"] == 6 and len(result["losses"]) == 6


def test_roc_auc_matches_pairwise_count():
    gen = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 2, (60,), generator=gen)
    scores = torch.randint(0, 8, (60,), generator=gen).double()
    pos, neg = scores[labels == 1], scores[labels == 0]
    pairs = [(1.0 if p > n else 0.5 if p == n else 0.0) for p, n in itertools.product(pos.tolist(), neg.tolist())]
    assert roc_auc(labels, scores) == pytest.approx(sum(pairs) / len(pairs), abs=1e-12)
    assert math.isnan(roc_auc(torch.ones(3), torch.rand(3)))
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    assert score(logits, torch.tensor([0, 1, 0])) == pytest.approx(2 / 3)
