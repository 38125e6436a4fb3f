"""The ``train`` command (JSON output, split selection) and the demo's training run."""
import argparse
import json

import pytest

from helpers import write_npz
from nt_kernels.apps.train import add_parser, demo_training

pytestmark = pytest.mark.usefixtures("single_thread")


def parse(argv):
    parser = argparse.ArgumentParser(prog="nt-kernels")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


@pytest.mark.parametrize("backend, fused", [("kernels", "auto"), ("kernels", "off"), ("reference", "auto")])
def test_train_cli_writes_json(tmp_path, backend, fused, capsys):
    write_npz(tmp_path / "roman-empire.npz", splits=3)
    out = tmp_path / "result.json"
    args = parse(["train", "--dataset", "roman-empire", "--data-root", str(tmp_path), "--splits", "0,2",
                  "--epochs", "3", "--patience", "2", "--layers", "1", "--head-dim", "4", "--heads", "2",
                  "--dtype", "float64", "--backend", backend, "--fused", fused, "--out", str(out), "--no-progress"])
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    assert result["metric"] == "accuracy" and [r["split"] for r in result["splits"]] == [0, 2]
    assert result["backend"] == backend and result["fused"] == fused
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
