"""Datasets, the training loop (fused vs reference), metrics, the train CLI and the demo (presets: test_presets.py)."""
import argparse
import itertools
import json
import math

import numpy as np
import pytest
import torch

import nt_reference.nn as ref
from nt_kernels.data import default_data_root
from nt_kernels.data.datasets import load_dataset, monophily_graph
from nt_kernels.nn import NT
from nt_kernels.apps.train import TrainConfig, add_parser, demo_training, roc_auc, score, train_split


pytestmark = pytest.mark.usefixtures("single_thread")


DATA = default_data_root()


def is_symmetric(edge_index):
    forward = set(map(tuple, edge_index.t().tolist()))
    return all((b, a) in forward for a, b in forward)


@pytest.mark.parametrize("name,nodes,features", [("minesweeper", 10_000, 7), ("tolokers", 11_758, 10)])
def test_load_heterophilous(name, nodes, features):
    data = load_dataset(name, DATA)
    assert (data.num_nodes, data.x.shape[1]) == (nodes, features)
    assert data.train_mask.shape == data.val_mask.shape == data.test_mask.shape == (10, nodes)
    assert not (data.train_mask & data.val_mask).any() and not (data.val_mask & data.test_mask).any()
    assert int(data.y.max()) == 1
    directed = load_dataset(name, DATA, directed=True)
    assert data.num_edges == 2 * directed.num_edges
    if name == "minesweeper":
        assert is_symmetric(data.edge_index) and not is_symmetric(directed.edge_index)
        looped = load_dataset(name, DATA, self_loops="add")
        assert looped.num_edges == data.num_edges + nodes
        assert (looped.edge_index[0] == looped.edge_index[1]).sum() == nodes


def write_npz(path, num_nodes=30, num_classes=3, splits=2, seed=0):
    rng = np.random.default_rng(seed)
    masks = rng.integers(0, 3, size=(splits, num_nodes))
    np.savez(path, node_features=rng.standard_normal((num_nodes, 5)).astype(np.float32),
             node_labels=np.arange(num_nodes) % num_classes,
             edges=np.stack([np.arange(num_nodes), (np.arange(num_nodes) + 1) % num_nodes], axis=1),
             train_masks=masks == 0, val_masks=masks == 1, test_masks=masks == 2)


def test_pyg_layout_self_loops_and_missing_files(tmp_path):
    (tmp_path / "roman_empire" / "raw").mkdir(parents=True)
    write_npz(tmp_path / "roman_empire" / "raw" / "roman_empire.npz")
    data = load_dataset("roman-empire", tmp_path, directed=True, self_loops="add")
    assert data.name == "roman-empire" and data.num_edges == 60
    assert load_dataset("roman-empire", tmp_path, self_loops="remove").num_edges == 60
    with pytest.raises(FileNotFoundError, match=r"no file for 'questions' under .*questions\.npz.*downloaded"):
        load_dataset("questions", tmp_path)
    with pytest.raises(FileNotFoundError, match=r"Computers/raw/amazon_electronics_computers\.npz not found; put "
                                                r"PyG's Amazon raw file there"):
        load_dataset("amazon-computers", tmp_path)
    with pytest.raises(FileNotFoundError, match=r"WikiCS/raw/data\.json not found"):
        load_dataset("wikics", tmp_path)
    with pytest.raises(ValueError, match="load_dataset: unknown dataset 'cora'"):
        load_dataset("cora", tmp_path)
    with pytest.raises(ValueError, match="load_dataset: self_loops must be one of"):
        load_dataset("roman-empire", tmp_path, self_loops="double")


def test_monophily_graph_has_monophily():
    data = monophily_graph(seed=3)
    src, dst = data.edge_index
    assert (data.y[src] == data.y[dst]).float().mean() < 0.1
    adjacency = torch.zeros(data.num_nodes, data.num_nodes)
    adjacency[src, dst] = 1
    two_hop = (adjacency @ adjacency > 0).fill_diagonal_(False)
    same = data.y.unsqueeze(0) == data.y.unsqueeze(1)
    assert (two_hop & same).sum() / two_hop.sum() > 0.45
    assert torch.equal(monophily_graph(seed=3).edge_index, data.edge_index)
    with pytest.raises(ValueError, match="monophily_graph: need num_classes >= 2"):
        monophily_graph(num_classes=1)


@pytest.mark.parametrize("directed", [False, True], ids=["NT", "DirNT"])
def test_training_losses_fused_vs_reference(directed):
    data = monophily_graph(num_nodes=90, degree=4, seed=1)
    config = TrainConfig(aggr="weighted_mean", head_dim=4, heads=2, num_layers=2, dropout=0.2, directed=directed,
                         lr=1e-2, epochs=10, patience=10)
    runs = {}
    for backend in ("fused", "reference"):
        runs[backend] = train_split(data, 0, config, dtype=torch.float64, backend=backend)["losses"]
    torch.manual_seed(0)
    model = NT(8, 3, 8, 2, heads=2, dropout=0.2, directed=directed, aggr="weighted_mean").double()
    plain = ref.NT(8, 3, 8, 2, heads=2, dropout=0.2, directed=directed, aggr="weighted_mean").double()
    plain.load_state_dict(model.state_dict())
    runs["nt_reference"] = train_split(data, 0, config, dtype=torch.float64, model=plain)["losses"]
    runs["fused-prebuilt"] = train_split(data, 0, config, dtype=torch.float64, model=model)["losses"]
    assert len(runs["fused"]) == 10 and runs["fused"][-1] < runs["fused"][0]
    for name in ("reference", "nt_reference", "fused-prebuilt"):
        np.testing.assert_allclose(runs[name], runs["fused"], rtol=0, atol=1e-8, err_msg=name)


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


def parse(argv):
    parser = argparse.ArgumentParser(prog="nt-kernels")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_train_cli_writes_json(tmp_path, backend, capsys):
    write_npz(tmp_path / "roman-empire.npz", splits=3)
    out = tmp_path / "result.json"
    args = parse(["train", "--dataset", "roman-empire", "--data-root", str(tmp_path), "--splits", "0,2",
                  "--epochs", "3", "--patience", "2", "--layers", "1", "--head-dim", "4", "--heads", "2",
                  "--dtype", "float64", "--backend", backend, "--out", str(out), "--no-progress"])
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    assert result["metric"] == "accuracy" and [r["split"] for r in result["splits"]] == [0, 2]
    assert result["config"]["aggr"] == "sum" and result["config"]["num_layers"] == 1
    assert all(r["epochs"] <= 3 for r in result["splits"]) and 0 <= result["test_mean"] <= 1
    assert "roman-empire: test accuracy" in capsys.readouterr().out
    bad = parse(["train", "--dataset", "roman-empire", "--data-root", str(tmp_path), "--splits", "5"])
    with pytest.raises(ValueError, match=r"train: --splits must name split ids in 0\.\.2, got '5'"):
        bad.func(bad)


def test_demo_training_nt_beats_mlp():
    result = demo_training()
    assert set(result) >= {"nt_val", "mlp_val", "metric", "epochs"}
    assert result["nt_val"] > result["mlp_val"] + 0.1
