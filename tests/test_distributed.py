"""Data-parallel training: two gloo processes with batch B take the step of one process with batch 2B, and
``torchrun --nproc-per-node 2`` of the train CLI on minesweeper writes one results file."""
import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nt_kernels.apps.distributed import World, current, shard_sampler, wrap
from nt_kernels.apps.minibatch import MiniBatchEpoch, pyg_data
from nt_kernels.apps.train import TrainConfig, train_split
from nt_kernels.data import default_data_root
from nt_kernels.data.datasets import monophily_graph
from nt_kernels.nn import NT

BATCH = 8
SEEDS = 2 * BATCH          # one batch per rank with two ranks, one batch of 2B with one


def graph():
    data = monophily_graph(num_nodes=120, degree=2, seed=4)
    train = torch.zeros_like(data.train_mask)
    train[0, torch.nonzero(data.train_mask[0]).flatten()[:SEEDS]] = True
    data.train_mask = train
    return data


def sgd_step(world: World, batch_size: int, seed_positions=None) -> dict:
    """One SGD step of NT (float64, whole neighbourhoods) on this rank's shard of the seeds."""
    data = graph()
    seeds = torch.nonzero(data.train_mask[0]).flatten()
    if seed_positions is not None:
        seeds = seeds[seed_positions]
    torch.manual_seed(0)
    model = NT(8, 8, 2, 3, heads=2, aggr="weighted_mean", threshold=2.0).double()
    epoch = MiniBatchEpoch(pyg_data(data.edge_index, data.num_nodes, data.x.double(), data.y), seeds, (-1, -1),
                           batch_size, world, seed=5, device="cpu")
    assert len(epoch) == 1
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    epoch(wrap(model, world), optimizer, 0)
    return {name: value.clone() for name, value in model.state_dict().items()}


def adam_run(checkpoint, batch_size: int) -> None:
    config = TrainConfig(aggr="weighted_mean", head_dim=4, heads=2, num_layers=2, dropout=0.0, lr=1e-2, epochs=1,
                         patience=1)
    train_split(graph(), 0, config, dtype=torch.float64, batch_size=batch_size, save=checkpoint)


def worker(rank: int, port: int, folder: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        world = current()
        assert world == World(rank=rank, size=2, local_rank=rank, backend="gloo")
        params = sgd_step(world, BATCH)
        if world.is_main:
            torch.save(params, os.path.join(folder, "sgd.pt"))
        adam_run(os.path.join(folder, "adam.pt"), BATCH)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.usefixtures("single_thread")
def test_two_gloo_processes_take_the_step_of_one_with_twice_the_batch(tmp_path, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    mp.spawn(worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    ddp = torch.load(tmp_path / "sgd.pt", weights_only=True)
    single = sgd_step(World(), 2 * BATCH)
    for name, value in single.items():
        torch.testing.assert_close(ddp[name], value, rtol=0, atol=1e-8, msg=name)
    torch.manual_seed(0)
    start = NT(8, 8, 2, 3, heads=2, aggr="weighted_mean", threshold=2.0).double().state_dict()
    moved = [name for name in single if not torch.equal(single[name], start[name])]
    assert len(moved) == sum(1 for name in single if "projection" not in name)   # every weight took the step
    # Without the gradient averaging, rank 0 alone would step on its half of the seeds: a different step.
    half = list(shard_sampler(SEEDS, World(rank=0, size=2), seed=5))
    alone = sgd_step(World(), BATCH, seed_positions=torch.tensor(half))
    assert max((alone[name] - single[name]).abs().max() for name in single) > 1e-4
    # The same through train_split (Adam, checkpoint written by rank 0 only).
    adam_run(tmp_path / "adam-single.pt", 2 * BATCH)
    saved = [torch.load(tmp_path / name, weights_only=True) for name in ("adam.pt", "adam-single.pt")]
    assert saved[0]["epoch"] == saved[1]["epoch"] == 0
    for name, value in saved[1]["model"].items():
        torch.testing.assert_close(saved[0]["model"][name], value, rtol=0, atol=1e-8, msg=name)
    assert not list(tmp_path.glob("*.tmp"))


def test_torchrun_two_processes_train_minesweeper(tmp_path):
    """The CLI under torchrun (gloo): two ranks, two epochs, one results file from rank 0."""
    out = tmp_path / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NT_KERNELS_DATA": str(default_data_root())}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), "-m", "nt_kernels.cli", "train", "--dataset", "minesweeper", "--splits", "0",
               "--epochs", "2", "--layers", "2", "--head-dim", "16", "--batch-size", "1250", "--num-neighbors",
               "6,6", "--no-progress", "--out", str(out)]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert list(tmp_path.iterdir()) == [out]
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and result["distributed_backend"] == "gloo"
    assert result["batch_size"] == 1250 and result["num_neighbors"] == [6, 6]
    assert result["splits"][0]["epochs"] == 2 and result["splits"][0]["batches_per_epoch"] == 2
    assert 0 < result["val_mean"] <= 1 and result["epochs_per_second"] > 0
    assert done.stdout.count("minesweeper split 0:") == 1
