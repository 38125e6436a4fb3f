"""Datasets and the data root (found through --data-root / data_root= / $NT_KERNELS_DATA only)."""
import os

import pytest
import torch

from helpers import write_npz
from nt_kernels.data import DATA_ROOT_ENV, default_data_root, load_dataset, load_npz, monophily_graph

pytestmark = pytest.mark.usefixtures("single_thread")


def is_symmetric(edge_index):
    forward = set(map(tuple, edge_index.t().tolist()))
    return all((b, a) in forward for a, b in forward)


@pytest.mark.parametrize("name,nodes,features", [("minesweeper", 10_000, 7), ("tolokers", 11_758, 10)])
def test_load_heterophilous(name, nodes, features):
    data = load_dataset(name, default_data_root())
    assert (data.num_nodes, data.x.shape[1]) == (nodes, features)
    assert data.train_mask.shape == data.val_mask.shape == data.test_mask.shape == (10, nodes)
    assert not (data.train_mask & data.val_mask).any() and not (data.val_mask & data.test_mask).any()
    assert int(data.y.max()) == 1
    directed = load_dataset(name, default_data_root(), directed=True)
    assert data.num_edges == 2 * directed.num_edges
    if name == "minesweeper":
        assert is_symmetric(data.edge_index) and not is_symmetric(directed.edge_index)
        looped = load_dataset(name, default_data_root(), self_loops="add")
        assert looped.num_edges == data.num_edges + nodes
        assert (looped.edge_index[0] == looped.edge_index[1]).sum() == nodes


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




def test_data_root_comes_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(DATA_ROOT_ENV, str(tmp_path))
    assert default_data_root() == tmp_path


def test_missing_data_root_is_a_clear_error(monkeypatch):
    monkeypatch.delenv(DATA_ROOT_ENV, raising=False)
    with pytest.raises(FileNotFoundError, match=r"no data root: pass root= / data_root= \(--data-root .*\) or set "
                                                r"\$NT_KERNELS_DATA"):
        default_data_root()
    with pytest.raises(FileNotFoundError, match="no data root"):
        load_npz("minesweeper")
    with pytest.raises(FileNotFoundError, match="no data root"):
        load_dataset("minesweeper")


def test_explicit_root_needs_no_environment(monkeypatch):
    real = os.environ[DATA_ROOT_ENV]  # set by conftest.py when unset
    monkeypatch.delenv(DATA_ROOT_ENV)
    data = load_npz("minesweeper", root=real)
    assert data.num_nodes == 10_000
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        load_npz("minesweeper", root="/nonexistent-nt-kernels-root")
