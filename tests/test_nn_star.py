"""NT* (NTStar): the forward against a float64 composition of its modules, the two-stage training (stage
switch, seeded loss, resume), its presets and CLI, and the runs it refuses."""
import argparse
import copy
import dataclasses
import json
import os
from statistics import fmean

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import assert_close, write_npz
from test_distributed import free_port
from nt_kernels.apps import presets, train
from nt_kernels.apps.distributed import World
from nt_kernels.apps.presets import StarConfig, preset, reported
from nt_kernels.apps.stages import TwoStages
from nt_kernels.apps.train import train_split
from nt_kernels.data.datasets import monophily_graph
from nt_kernels.nn import DirNT, NTConv, NTStar

pytestmark = pytest.mark.usefixtures("single_thread")

IN, HIDDEN, CLASSES = 8, 8, 3  # monophily_graph: 8 features, 3 classes


def graph(num_nodes=40, degree=3, seed=0):
    return monophily_graph(num_nodes=num_nodes, degree=degree, seed=seed)


def composition(model, x, edge_index):
    """NT* written out from its modules (docs/nn.md, "NT*"), with the NT layers on the reference backend."""
    for conv in model.convs:
        conv.backend, conv.fused = "reference", False
    x = model.lin_in(x)
    x_local = torch.zeros_like(x)
    for i, conv in enumerate(model.convs):
        h = torch.relu(model.h_lins[i](x))
        y = torch.relu(conv(x, edge_index) + model.lins[i](x))
        beta = torch.sigmoid(model.betas[i]) if model.beta is None else model.beta
        x = (1 - beta) * model.lns[i](h * y) + beta * y
        x_local = x_local + x
    if model.stage == "local":
        return model.pred_local(x_local)
    z = model.ln(x_local)[None]
    for attention in model.global_attn:
        z = attention(z)
    return model.pred_global(z[0])


@pytest.mark.parametrize("beta", [None, 0.3], ids=["learned-beta", "fixed-beta"])
@pytest.mark.parametrize("directed", [False, True], ids=["NTConv", "DirNT"])
@pytest.mark.parametrize("stage", ["local", "global"])
def test_forward_and_backward_match_a_float64_composition(stage, directed, beta):
    torch.manual_seed(0)
    model = NTStar(IN, HIDDEN, CLASSES, 2, 2, heads=2, beta=beta, directed=directed, aggr="weighted_mean")
    assert all(isinstance(conv, DirNT if directed else NTConv) for conv in model.convs)
    if beta is None:
        torch.nn.init.normal_(model.betas)               # away from the initial 0.5, so that beta matters
    model.stage = stage
    reference = copy.deepcopy(model).double()
    data = graph()
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(data.num_nodes, CLASSES, dtype=torch.float64, generator=gen)
    out = model(data.x.float(), data.edge_index)            # float32, the fused NT layer on CPU
    (out * weight.float()).sum().backward()
    want = composition(reference, data.x.double(), data.edge_index)
    (want * weight).sum().backward()
    assert_close(out, want)
    want_grads = dict(reference.named_parameters())
    used = 0
    for name, param in model.named_parameters():
        in_use = not ((stage == "local" and name.startswith(("global_attn.", "ln.", "pred_global.")))
                      or (stage == "global" and name.startswith("pred_local.")))
        assert param.requires_grad == in_use, name
        if not in_use:
            assert param.grad is None and want_grads[name].grad is None, name
            continue
        assert_close(param.grad, want_grads[name].grad, msg=f"gradient of {name}")
        used += param.grad.abs().sum() > 0
    assert used > 10


def star_config(**kwargs):
    fields = dict(aggr="sum", head_dim=4, heads=2, num_layers=2, dropout=0.1, lr=1e-2, epochs=12, patience=12,
                  local_epochs=6, global_layers=1, in_dropout=0.1, global_dropout=0.1)
    return StarConfig(**{**fields, **kwargs})


def test_seeded_training_loss_decreases_in_both_stages():
    data, config = graph(num_nodes=80), star_config(epochs=20, patience=20, local_epochs=10, lr=3e-2)
    first = train_split(data, 0, config, seed=3)
    losses = first["losses"]
    assert losses == train_split(data, 0, config, seed=3)["losses"]     # seeded: the same run twice
    assert len(losses) == 20 and {stage: value["epochs"] for stage, value in first["stages"].items()} == \
        {"local": 10, "global": 10}
    assert fmean(losses[7:10]) < 0.85 * losses[0]                          # local stage
    assert fmean(losses[17:20]) < 0.85 * losses[10]                        # global stage (a fresh head at 10)


def test_global_stage_starts_from_the_best_local_weights():
    model = NTStar(IN, HIDDEN, CLASSES, 1, 1, heads=2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    stages = TwoStages(model, optimizer, local_epochs=3)
    assert model.stage == "local"
    stages.begin_epoch(0)
    stages.new_best()
    best = copy.deepcopy(model.state_dict())
    with torch.no_grad():
        model.lin_in.weight.add_(1.0)
    stages.begin_epoch(1)
    assert model.stage == "local" and not stages.should_stop(1, best_epoch=0, patience=1)
    stages.begin_epoch(3)
    assert model.stage == "global"
    torch.testing.assert_close(model.state_dict(), best)
    assert not stages.should_stop(3, best_epoch=0, patience=2) and stages.should_stop(4, best_epoch=0, patience=2)


def test_resume_continues_in_the_right_stage(tmp_path):
    data = graph(num_nodes=60)
    path = tmp_path / "star.pt"
    config = star_config(epochs=8, patience=8, local_epochs=4)
    saved = train_split(data, 0, config, save=path)
    state = torch.load(path, weights_only=True)
    assert state["epoch"] == saved["best_epoch"] and state["config"]["local_epochs"] == 4
    model = train.build_model(config, data.x.shape[1], int(data.y.max()) + 1)
    resumed = train_split(data, 0, replace_epochs(config, 10), resume=path, model=model)
    assert resumed["epochs"] == 10 and resumed["losses"][:state["epoch"] + 1] == state["losses"]
    assert model.stage == "global"


def replace_epochs(config, epochs):
    return dataclasses.replace(config, epochs=epochs, patience=epochs)


def test_mini_batches_and_data_parallel_only_without_global_stage():
    data = graph(num_nodes=60)
    message = "NT\\*'s global stage attends over every node of the graph"
    with pytest.raises(ValueError, match=message):
        train_split(data, 0, star_config(), batch_size=16)
    with pytest.raises(ValueError, match=message):
        train._minibatch_epoch(NTStar(IN, HIDDEN, CLASSES, 1), data, data.x, data.train_mask[0].nonzero().flatten(),
                               0, star_config(), World(0, 2), 0, None, None, None)
    with pytest.raises(ValueError, match="--eval-batch-size.* NTStar evaluates full batch"):
        train_split(data, 0, star_config(), eval_batch_size=16)
    local_only = train_split(data, 0, star_config(epochs=3, local_epochs=3), batch_size=16)
    assert local_only["batches_per_epoch"] > 1 and set(local_only["stages"]) == {"local"}


def data_parallel_worker(rank: int, port: int, folder: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        config = star_config(epochs=2, local_epochs=2)
        model = train.build_model(config, IN, CLASSES)
        result = train_split(graph(num_nodes=60), 0, config, batch_size=8, model=model)
        torch.save({"state": model.state_dict(), "batches": result["batches_per_epoch"]},
                   os.path.join(folder, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_data_parallel_local_stage_keeps_the_ranks_in_step(tmp_path, monkeypatch):
    """Two gloo ranks train NT*'s local stage on NeighborLoader batches: DDP takes only the parameters in use
    (the global ones have requires_grad off), so several batches run and the ranks end with equal weights."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    mp.spawn(data_parallel_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(2)]
    assert ranks[0]["batches"] > 1
    torch.testing.assert_close(ranks[0]["state"], ranks[1]["state"], rtol=0, atol=0)


def test_presets_take_nt_locally_and_polynormer_globally():
    nt, star = preset("minesweeper"), preset("minesweeper", model="nt-star")
    assert isinstance(star, StarConfig)
    assert (star.aggr, star.head_dim, star.heads, star.num_layers, star.dropout, star.self_loops) == \
           (nt.aggr, nt.head_dim, nt.heads, nt.num_layers, nt.dropout, nt.self_loops) == \
           ("sum", 53, 1, 5, 0.2, "remove")
    assert not star.sep and (star.local_epochs, star.epochs, star.patience) == (100, 2100, 2000)
    assert (star.global_layers, star.in_dropout, star.global_dropout, star.beta) == (3, 0.2, 0.3, None)
    tolokers = preset("tolokers", model="nt-star")
    assert (tolokers.aggr, tolokers.head_dim, tolokers.heads, tolokers.local_epochs, tolokers.epochs,
            tolokers.global_layers, tolokers.beta) == ("gated_sum", 30, 2, 100, 900, 4, 0.1)
    assert preset("tolokers", directed=True, model="nt-star").head_dim == preset("tolokers", directed=True).head_dim
    assert reported("minesweeper", model="nt-star") == (97.92, 0.28)
    assert reported("tolokers", model="nt-star") == (85.91, 0.83)
    with pytest.raises(ValueError, match="preset: no paper preset of nt-star for 'wikics'"):
        preset("wikics", model="nt-star")


def parse(argv):
    parser = argparse.ArgumentParser(prog="nt-kernels")
    train.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["train", *argv])


def test_cli_trains_nt_star_and_writes_json(tmp_path, capsys):
    write_npz(tmp_path / "tolokers.npz", num_classes=2, splits=2)
    out = tmp_path / "star.json"
    args = parse(["--model", "nt-star", "--dataset", "tolokers", "--data-root", str(tmp_path), "--splits", "0",
                  "--epochs", "4", "--local-epochs", "2", "--layers", "1", "--head-dim", "4", "--heads", "2",
                  "--global-layers", "1", "--beta", "learned", "--out", str(out), "--no-progress"])
    config = presets.config_from_args(args)
    assert isinstance(config, StarConfig) and config.beta is None and config.global_dropout == 0.5
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    assert result["model"] == "nt-star" and result["config"]["local_epochs"] == 2
    assert result["reported"] == [85.91, 0.83] and result["peak_rss_mib"] > 0
    split = result["splits"][0]
    assert set(split["stages"]) == {"local", "global"} and split["cpu_seconds_per_epoch"] > 0
    assert "the paper's NT* table reports 85.91" in capsys.readouterr().out
    with pytest.raises(ValueError, match="train: --local-epochs, --beta only apply to --model nt-star"):
        presets.config_from_args(parse(["--dataset", "tolokers", "--local-epochs", "3", "--beta", "0.2"]))
    with pytest.raises(ValueError, match="train: --sep is NT's"):
        presets.config_from_args(parse(["--model", "nt-star", "--dataset", "tolokers", "--sep"]))
    with pytest.raises(SystemExit):
        parse(["--model", "nt-star", "--dataset", "tolokers", "--beta", "high"])


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match=r"NTStar: hidden_channels \(9\) must be divisible by heads \(2\)"):
        NTStar(IN, 9, CLASSES, 1, heads=2)
    with pytest.raises(ValueError, match="NTStar: beta must be None or a number in \\[0, 1\\], got 1.5"):
        NTStar(IN, HIDDEN, CLASSES, 1, beta=1.5)
    with pytest.raises(ValueError, match="NTStar: local_layers must be an int >= 1"):
        NTStar(IN, HIDDEN, CLASSES, 0)
    model = NTStar(IN, HIDDEN, CLASSES, 1)
    with pytest.raises(ValueError, match="NTStar: stage must be one of \\('local', 'global'\\), got 'both'"):
        model.stage = "both"
    with pytest.raises(ValueError, match="NTStar: x must have shape"):
        model(torch.randn(5, IN + 1), torch.zeros(2, 0, dtype=torch.long))
    assert repr(model) == "NTStar(8, 8, 3, local_layers=1, global_layers=2, heads=1, beta=learned, stage=local, " \
                          "aggr=weighted_mean)"
    before = copy.deepcopy(model.state_dict())
    with torch.no_grad():
        model.betas.fill_(1.0)
    model.reset_parameters()
    changed = [name for name, value in model.state_dict().items() if not torch.equal(value, before[name])]
    assert {"lin_in.weight", "convs.0.lin_qkv.weight", "global_attn.0.k.weight", "pred_global.weight"} <= set(changed)
    assert not model.betas.any()
    with pytest.raises(ValueError, match="train: local_epochs \\(--local-epochs\\) must be an int >= 0"):
        TwoStages(model, torch.optim.Adam(model.parameters()), -1)
