"""Training presets: the released recipe (``paper``), the appendix table (``appendix``), the CLI and the seeding."""
import argparse
import json

import pytest
import torch
from helpers import write_npz

from nt_kernels.apps import presets, train
from nt_kernels.apps.presets import APPENDIX_PRESETS, PAPER_PRESETS, TrainConfig, preset, reported
from nt_kernels.data.datasets import DATASETS, HETEROPHILOUS, monophily_graph

pytestmark = pytest.mark.usefixtures("single_thread")

# The released reproduce.sh, transcribed from the table: run -> (sep, self-loops, epochs, patience).
RELEASED_FLAGS = {
    "roman-empire": (True, "add", 2500, 500),
    "amazon-ratings": (True, "remove", 2500, 500),
    "minesweeper": (True, "remove", 2500, 500),
    "tolokers": (True, "keep", 2500, 500),
    "questions": (True, "remove", 2500, 500),
    "roman-empire-directed": (True, "keep", 2500, 500),
    "amazon-ratings-directed": (True, "keep", 1000, 200),
    "minesweeper-directed": (True, "add", 1000, 200),
    "tolokers-directed": (True, "remove", 1000, 200),
    "questions-directed": (True, "remove", 1000, 200),
    "amazon-computers": (False, "add", 2500, 500),
    "amazon-photo": (True, "add", 2500, 500),
    "coauthor-cs": (False, "keep", 1000, 200),
    "coauthor-physics": (False, "remove", 2500, 500),
    "wikics": (False, "add", 2500, 500),
}


def test_every_dataset_has_both_kinds():
    keys = set(DATASETS) | {f"{name}-directed" for name in HETEROPHILOUS}
    assert set(PAPER_PRESETS) == set(APPENDIX_PRESETS) == set(RELEASED_FLAGS) == keys


@pytest.mark.parametrize("key", sorted(RELEASED_FLAGS))
def test_paper_preset_sets_the_released_flags(key):
    sep, loops, epochs, patience = RELEASED_FLAGS[key]
    dataset, directed = key.removesuffix("-directed"), key.endswith("-directed")
    paper, appendix = preset(dataset, directed), preset(dataset, directed, kind="appendix")
    assert (paper.sep, paper.self_loops, paper.epochs, paper.patience) == (sep, loops, epochs, patience)
    assert paper.lr == 1e-3 and paper.directed == directed
    # The hyperparameters of the appendix table are shared; only the released flags differ.
    assert (paper.aggr, paper.head_dim, paper.heads, paper.num_layers, paper.dropout) == \
           (appendix.aggr, appendix.head_dim, appendix.heads, appendix.num_layers, appendix.dropout)
    assert paper.attention == appendix.attention == "switch"
    assert paper.gate_group == appendix.gate_group == "receiver"


def test_appendix_preset_is_the_table_only():
    assert preset("minesweeper", kind="appendix") == TrainConfig("sum", 53, 1, 5, 0.2)
    assert preset("tolokers", directed=True, kind="appendix") == TrainConfig("gated_sum", 9, 4, 4, 0.2,
                                                                              directed=True)
    assert preset("wikics", kind="appendix") == TrainConfig("mean", 38, 1, 3, 0.2)
    for config in APPENDIX_PRESETS.values():
        assert (config.sep, config.self_loops, config.epochs, config.patience, config.lr) == \
               (False, "keep", 2500, 500, 1e-3)


def test_roman_empire_keeps_both_variants():
    undirected, directed = preset("roman-empire"), preset("roman-empire", directed=True)
    assert (undirected.aggr, undirected.head_dim, undirected.heads, undirected.directed) == ("sum", 32, 6, False)
    assert (directed.aggr, directed.head_dim, directed.heads, directed.directed) == ("max", 36, 5, True)
    assert reported("roman-empire") == (91.71, 0.57)
    assert reported("roman-empire", directed=True) == (94.77, 0.31)   # the paper's main-table number
    assert reported("minesweeper") == (97.42, 0.50)


def test_bad_preset_requests():
    with pytest.raises(ValueError, match="preset: no paper preset for 'wikics-directed'"):
        preset("wikics", directed=True)
    with pytest.raises(ValueError, match=r"preset: kind must be one of \('paper', 'appendix'\), got 'table'"):
        preset("minesweeper", kind="table")
    assert reported("wikics", directed=True) is None


def parse(argv):
    parser = argparse.ArgumentParser(prog="nt-kernels")
    train.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["train", *argv])


def test_cli_flags_pick_and_override_the_preset():
    config = presets.config_from_args(parse(["--dataset", "minesweeper"]))
    assert config == PAPER_PRESETS["minesweeper"] and config.sep and config.self_loops == "remove"
    assert presets.config_from_args(parse(["--dataset", "minesweeper", "--preset", "appendix"])) == \
        APPENDIX_PRESETS["minesweeper"]
    config = presets.config_from_args(parse(["--dataset", "minesweeper", "--directed"]))
    assert config == PAPER_PRESETS["minesweeper-directed"] and config.self_loops == "add"
    config = presets.config_from_args(parse(["--dataset", "minesweeper", "--no-sep", "--self-loops", "keep",
                                             "--gate-group", "centre", "--epochs", "500", "--patience", "100",
                                             "--aggr", "max", "--heads", "2"]))
    assert (config.sep, config.self_loops, config.gate_group, config.epochs, config.patience, config.aggr,
            config.heads, config.head_dim) == (False, "keep", "centre", 500, 100, "max", 2, 53)
    config = presets.config_from_args(parse(["--dataset", "tolokers", "--preset", "appendix", "--sep"]))
    assert config.sep and config.aggr == "gated_sum"
    assert presets.config_from_args(parse(["--dataset", "tolokers", "--preset", "none"])) == TrainConfig()
    with pytest.raises(SystemExit):
        parse(["--dataset", "minesweeper", "--aggr", "median"])


def test_cli_paper_run_seeds_each_split_with_its_index(tmp_path, monkeypatch, capsys):
    write_npz(tmp_path / "roman-empire.npz", splits=3)
    seeds, loads = [], []
    manual_seed, load_dataset = torch.manual_seed, train.load_dataset

    def record_seed(seed):
        seeds.append(seed)
        return manual_seed(seed)

    def record_load(*args, **kwargs):
        loads.append(kwargs)
        return load_dataset(*args, **kwargs)

    monkeypatch.setattr(torch, "manual_seed", record_seed)
    monkeypatch.setattr(train, "load_dataset", record_load)
    out = tmp_path / "run.json"
    args = parse(["--dataset", "roman-empire", "--data-root", str(tmp_path), "--splits", "1,2", "--epochs", "2",
                  "--layers", "1", "--head-dim", "4", "--heads", "2", "--dtype", "float64", "--out", str(out),
                  "--no-progress"])
    assert args.func(args) == 0
    assert seeds == [1, 1, 2, 2]           # model init and training run of each split: the split index
    assert loads == [{"directed": False, "self_loops": "add"}]
    result = json.loads(out.read_text())
    assert result["preset"] == "paper" and result["self_loops"] == "add" and result["seed"] == 0
    assert result["config"]["sep"] is True and result["config"]["patience"] == 500
    assert result["reported"] == [91.71, 0.57]
    assert "released script reports 91.71 ± 0.57" in capsys.readouterr().out


class _ModeRecorder(torch.nn.Module):
    """A linear model that records (training mode, grad mode) at every forward."""

    def __init__(self, features, classes):
        super().__init__()
        self.lin = torch.nn.Linear(features, classes)
        self.calls = []

    def forward(self, x, edge_index=None):
        self.calls.append((self.training, torch.is_grad_enabled()))
        return self.lin(x)


def test_scored_in_eval_mode_after_every_training_step():
    data = monophily_graph(num_nodes=60, degree=3, seed=0)
    model = _ModeRecorder(data.x.shape[1], int(data.y.max()) + 1)
    config = TrainConfig(lr=1e-2, epochs=4, patience=4)
    result = train.train_split(data, 0, config, model=model)
    assert result["epochs"] == 4
    assert model.calls == [(True, True), (False, False)] * 4
