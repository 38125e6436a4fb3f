"""NT on PyG NeighborLoader batches: sampling direction, exactness with whole neighbourhoods, layer-wise
evaluation, graph caching, mini-batch training, checkpoints and the train CLI's batch options."""
import argparse
import gc
import json
import weakref

import pytest
import torch
import torch.nn.functional as F
import torch_geometric.typing as pyg_typing
from torch_geometric.loader import NeighborLoader

import nt_kernels.apps.train as train_module
from nt_kernels.apps.distributed import World
from nt_kernels.apps.minibatch import eval_loader, layerwise_logits, pyg_data
from nt_kernels.apps.sampling import TorchNeighborSampler, loader_hops, neighbor_sampler, nt_loader
from nt_kernels.apps.train import TrainConfig, add_parser, train_split
from nt_kernels.data.datasets import monophily_graph
from nt_kernels.nn import NT, NTConv

pytestmark = pytest.mark.usefixtures("single_thread")


def small_graph(num_nodes=90, degree=4, seed=1):
    return monophily_graph(num_nodes=num_nodes, degree=degree, seed=seed)


def as_pyg(graph, dtype=torch.float64):
    return pyg_data(graph.edge_index, graph.num_nodes, graph.x.to(dtype), graph.y)


def edge_set(edge_index):
    return set(map(tuple, edge_index.t().tolist()))


def in_edges(edge_index, nodes):
    return edge_set(edge_index[:, torch.isin(edge_index[1], nodes)])


def test_loader_hops_and_sampler_choice():
    assert loader_hops([15, 10]) == [15, 15, 10, 10]
    # PyG's own sampler needs pyg-lib or torch-sparse (no PyPI wheel for this torch); else the PyTorch one.
    has_pyg_sampler = pyg_typing.WITH_PYG_LIB or pyg_typing.WITH_TORCH_SPARSE
    assert isinstance(neighbor_sampler(as_pyg(small_graph()), [2]), TorchNeighborSampler) == (not has_pyg_sampler)


def test_pyg_loader_samples_in_edges_so_centres_are_cut():
    """PyG's NeighborLoader (directional) takes in-edges u -> v of the seeds: seeds are receivers (row 1) and a
    sampled centre's segment holds only the seeds that sampled it, even with -1."""
    graph = small_graph()
    data = as_pyg(graph)
    seeds = torch.arange(0, 90, 9)
    loader = NeighborLoader(data, [-1], input_nodes=seeds, batch_size=seeds.numel(),
                            neighbor_sampler=TorchNeighborSampler(data, [-1]))
    batch = next(iter(loader))
    assert batch.batch_size == seeds.numel() and torch.equal(batch.n_id[:batch.batch_size], seeds)
    global_edges = batch.n_id[batch.edge_index]
    assert (batch.edge_index[1] < batch.batch_size).all()                 # every receiver is a seed
    assert edge_set(global_edges) == in_edges(graph.edge_index, seeds)    # all in-edges of the seeds, nothing else
    centre = batch.n_id[batch.batch_size]                                  # first sampled (non-seed) node
    full_segment = graph.edge_index[1][graph.edge_index[0] == centre]
    batch_segment = global_edges[1][global_edges[0] == centre]
    assert set(batch_segment.tolist()) == set(full_segment.tolist()) & set(seeds.tolist())
    assert batch_segment.numel() < full_segment.numel()


def test_torch_sampler_fanout_and_uniformity():
    graph = small_graph()
    data = as_pyg(graph)
    sampler = TorchNeighborSampler(data, [3, 2])
    torch.manual_seed(0)
    seeds = torch.tensor([5, 17, 40])
    out = sampler._sample(seeds)
    assert torch.equal(out.node[:3], seeds) and out.node.unique().numel() == out.node.numel()
    assert out.num_sampled_edges[0] == int(sum(min(3, int((graph.edge_index[1] == s).sum())) for s in seeds))
    sampled = edge_set(out.node[torch.stack([out.row, out.col])])
    assert sampled <= edge_set(graph.edge_index)
    hop1 = torch.stack([out.row, out.col])[:, :out.num_sampled_edges[0]]
    assert torch.bincount(hop1[1], minlength=3)[:3].le(3).all()
    # Every in-neighbour of a node is drawn equally often (seeded: 2000 draws of 2 out of its in-edges).
    node = 7
    neighbours = graph.edge_index[0][graph.edge_index[1] == node]
    one_hop = TorchNeighborSampler(data, [2])
    counts = torch.zeros(graph.num_nodes)
    for _ in range(2000):
        drawn = one_hop._sample(torch.tensor([node]))
        counts[drawn.node[1:]] += 1
    expected = 2000 * 2 / neighbours.numel()
    assert counts.sum() == 4000 and ((counts[neighbours] - expected).abs() < 0.1 * expected).all()
    with pytest.raises(ValueError, match="TorchNeighborSampler: the seed nodes of a batch must be distinct"):
        sampler._sample(torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="TorchNeighborSampler: replace=True is not supported"):
        TorchNeighborSampler(data, [2], replace=True)


def test_nt_loader_keeps_whole_neighbourhoods_of_expanded_nodes():
    graph = small_graph()
    layers = 1
    seeds = torch.tensor([3, 30, 60])
    batch = next(iter(nt_loader(as_pyg(graph), [-1] * layers, batch_size=3, input_nodes=seeds)))
    global_edges = batch.n_id[batch.edge_index]
    assert edge_set(global_edges) <= edge_set(graph.edge_index)
    degree = torch.bincount(graph.edge_index[0], minlength=graph.num_nodes)
    # One layer = two hops: the seeds and their in-neighbours are expanded, so their segments are whole.
    expanded = torch.cat([seeds, graph.edge_index[0][torch.isin(graph.edge_index[1], seeds)]]).unique()
    assert torch.isin(expanded, batch.n_id).all()
    batch_degree = torch.bincount(global_edges[0], minlength=graph.num_nodes)
    assert torch.equal(batch_degree[expanded], degree[expanded])
    outer = batch.n_id[~torch.isin(batch.n_id, expanded)]
    assert outer.numel() and (batch_degree[outer] < degree[outer]).any()   # the second hop's nodes are cut
    with pytest.raises(ValueError, match="nt_loader: the graph must be symmetric"):
        nt_loader(pyg_data(torch.tensor([[0, 1], [1, 2]]), 3), [-1], batch_size=1)
    with pytest.raises(ValueError, match="nt_loader: batch_size must be an int >= 1, got 0"):
        nt_loader(as_pyg(graph), [-1], batch_size=0)
    with pytest.raises(ValueError, match="each count must be an int >= 1 or -1"):
        nt_loader(as_pyg(graph), [0], batch_size=2)


def nt_model(directed=False, sep=False, seed=0):
    """Two layers, head dim 4; segments of more than 2 messages take the Performer path."""
    torch.manual_seed(seed)
    return NT(8, 8, 2, 3, heads=2, directed=directed, sep=sep, aggr="weighted_mean", threshold=2.0).double()


@pytest.mark.parametrize("directed,sep", [(False, False), (False, True), (True, False)], ids=["NT", "sep", "DirNT"])
def test_minibatch_with_whole_neighbourhoods_equals_full_batch(directed, sep):
    """num_neighbors = [-1] * layers and one batch holding every training seed: same loss and gradients."""
    graph = small_graph(num_nodes=600, degree=1)       # sparse: the seeds' 4-hop ball is a fifth of the graph
    seeds = torch.nonzero(graph.train_mask[0]).flatten()[:12]
    model = nt_model(directed, sep)
    x = graph.x.double()
    full_loss = F.cross_entropy(model(x, graph.edge_index)[seeds], graph.y[seeds])
    full_loss.backward()
    full_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    batch = next(iter(nt_loader(as_pyg(graph), [-1, -1], batch_size=seeds.numel(), input_nodes=seeds)))
    assert batch.batch_size == seeds.numel() and batch.num_nodes < graph.num_nodes
    model.zero_grad()
    loss = F.cross_entropy(model(batch.x, batch.edge_index)[:batch.batch_size], batch.y[:batch.batch_size])
    loss.backward()
    torch.testing.assert_close(loss, full_loss.detach(), rtol=0, atol=1e-8)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, full_grads[name], rtol=0, atol=1e-8, msg=name)


def test_one_hop_per_layer_is_not_enough_for_nt():
    """PyG's usual loader (one directional hop per layer, -1) cuts the outer centres' neighbourhoods: the loss
    at the seeds differs from the full-batch one; nt_loader's two hops per layer make it exact."""
    graph = small_graph(num_nodes=600, degree=1)
    seeds = torch.nonzero(graph.train_mask[0]).flatten()[:10]
    model = nt_model()
    x = graph.x.double()
    with torch.no_grad():
        full = F.cross_entropy(model(x, graph.edge_index)[seeds], graph.y[seeds])
        data = as_pyg(graph)
        plain = next(iter(NeighborLoader(data, [-1, -1], input_nodes=seeds, batch_size=10,
                                         neighbor_sampler=TorchNeighborSampler(data, [-1, -1]))))
        cut = F.cross_entropy(model(plain.x, plain.edge_index)[:10], plain.y[:10])
        exact = next(iter(nt_loader(data, [-1, -1], batch_size=10, input_nodes=seeds)))
        whole = F.cross_entropy(model(exact.x, exact.edge_index)[:10], exact.y[:10])
    assert (cut - full).abs() > 1e-4
    torch.testing.assert_close(whole, full, rtol=0, atol=1e-10)


def test_edge_attr_follows_the_batch_edges():
    """Each batch edge carries its own edge's attributes (the bidirectional reversal would reuse the sampled
    edge's id); one NTConv on a whole-neighbourhood batch equals the full graph at the seeds."""
    graph = small_graph()
    attr = torch.randn(graph.num_edges, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    data = as_pyg(graph)
    data.edge_attr = attr
    seeds = torch.tensor([2, 11, 50, 77])
    batch = next(iter(nt_loader(data, [-1], batch_size=4, input_nodes=seeds)))
    assert torch.equal(graph.edge_index[:, batch.e_id], batch.n_id[batch.edge_index])
    assert torch.equal(batch.edge_attr, attr[batch.e_id])
    torch.manual_seed(0)
    conv = NTConv(8, 8, heads=2, edge_dim=3).double()
    full = conv(graph.x.double(), graph.edge_index, attr)[seeds]
    torch.testing.assert_close(conv(batch.x, batch.edge_index, batch.edge_attr)[:4], full, rtol=0, atol=1e-10)


def test_layerwise_evaluation_equals_full_batch():
    graph = small_graph()
    model = nt_model(sep=True).eval()
    x = graph.x.double()
    with torch.no_grad():
        full = model(x, graph.edge_index)
    nodes = eval_loader(graph.edge_index, graph.num_nodes, 16)
    assert len(nodes) == 6
    torch.testing.assert_close(layerwise_logits(model, x, nodes), full, rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="layerwise_logits: needs an NT"):
        layerwise_logits(torch.nn.Linear(8, 3), x, nodes)


def test_graph_cache_keeps_only_the_last_batch():
    """Every batch is a new graph: NT's one-entry cache replaces its CSR, nothing accumulates."""
    graph = small_graph()
    model = nt_model()
    seen = []
    for batch in nt_loader(as_pyg(graph), [3, 3], batch_size=10, input_nodes=torch.arange(60), shuffle=True):
        model(batch.x, batch.edge_index).sum().backward()
        seen.append(weakref.ref(model._graphs.csr))
        assert torch.equal(model._graphs.edge_index, batch.edge_index)
    del batch
    gc.collect()
    assert len(seen) == 6 and [ref() is not None for ref in seen] == [False] * 5 + [True]
    assert all(conv._graphs.csr is None for conv in model.convs)   # NT hands its CSR to the layers
    conv, seen = model.convs[0], []                                 # a lone NTConv keeps one entry as well
    for batch in nt_loader(as_pyg(graph), [3], batch_size=15, input_nodes=torch.arange(45)):
        conv(model.encoder(batch.x), batch.edge_index).sum().backward()
        seen.append(weakref.ref(conv._graphs.csr))
    del batch
    gc.collect()
    assert [ref() is not None for ref in seen] == [False, False, True]


def config(**overrides):
    base = dict(aggr="weighted_mean", head_dim=4, heads=2, num_layers=2, dropout=0.0, lr=1e-2, epochs=4, patience=4)
    return TrainConfig(**{**base, **overrides})


def test_train_split_minibatch_runs_and_learns():
    graph = small_graph(num_nodes=120)
    result = train_split(graph, 0, config(epochs=6, patience=6), dtype=torch.float64, batch_size=16,
                         num_neighbors=(3, 3), eval_batch_size=32)
    assert result["batches_per_epoch"] == 4 and result["epochs"] == 6 == result["epochs_run"]
    assert result["losses"][-1] < result["losses"][0] and result["epochs_per_second"] > 0
    assert 0 <= result["val"] <= 1


def test_train_split_bad_batch_settings(monkeypatch):
    graph = small_graph()
    with pytest.raises(ValueError, match=r"need one count per layer \(2 layers\), got 1: \[5\]"):
        train_split(graph, 0, config(), batch_size=8, num_neighbors=(5,))
    with pytest.raises(ValueError, match=r"train: batch_size \(--batch-size\) must be an int >= 1, got 0"):
        train_split(graph, 0, config(), batch_size=0)
    with pytest.raises(ValueError, match=r"num_neighbors \(--num-neighbors\) needs batch_size"):
        train_split(graph, 0, config(), num_neighbors=(5, 5))
    monkeypatch.setattr(train_module, "current", lambda: World(rank=0, size=100))
    with pytest.raises(ValueError, match=r"train: 100 processes \(torchrun --nproc-per-node\) but split 0 has only "
                                         r"45 training nodes"):
        train_split(graph, 0, config(), batch_size=8)


def test_checkpoint_save_and_resume(tmp_path):
    graph = small_graph()
    path = tmp_path / "best.pt"
    first = train_split(graph, 0, config(epochs=3, patience=3), dtype=torch.float64, batch_size=20, save=path)
    state = torch.load(path, weights_only=True)
    assert state["epoch"] == first["best_epoch"] and state["val"] == first["val"] and state["split"] == 0
    assert state["config"]["num_layers"] == 2 and set(state) >= {"model", "optimizer", "losses", "test"}
    resumed = train_split(graph, 0, config(epochs=5, patience=5), dtype=torch.float64, batch_size=20, resume=path)
    assert resumed["epochs_run"] == 5 - (state["epoch"] + 1)
    assert resumed["losses"][:state["epoch"] + 1] == state["losses"] and resumed["val"] >= state["val"]
    with pytest.raises(ValueError, match=r"--resume: .* was trained with other settings: head_dim 4 \(now 8\)"):
        train_split(graph, 0, config(head_dim=8), batch_size=20, resume=path)
    with pytest.raises(FileNotFoundError, match="--resume: checkpoint .*missing.pt not found"):
        train_split(graph, 0, config(), resume=tmp_path / "missing.pt")


def parse(argv):
    parser = argparse.ArgumentParser(prog="nt-kernels")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def write_npz(path, num_nodes=40, splits=2):
    graph = small_graph(num_nodes=num_nodes)
    import numpy as np
    masks = torch.stack([graph.train_mask[0], graph.val_mask[0], graph.test_mask[0]]).numpy()
    np.savez(path, node_features=graph.x.numpy(), node_labels=graph.y.numpy(), edges=graph.edge_index.t().numpy(),
             train_masks=np.repeat(masks[:1], splits, 0), val_masks=np.repeat(masks[1:2], splits, 0),
             test_masks=np.repeat(masks[2:], splits, 0))


def test_train_cli_batch_options(tmp_path, capsys):
    write_npz(tmp_path / "roman-empire.npz")
    common = ["train", "--dataset", "roman-empire", "--data-root", str(tmp_path), "--preset", "appendix",
              "--epochs", "2", "--layers", "2", "--head-dim", "4", "--heads", "2", "--dtype", "float64",
              "--no-progress"]
    out = tmp_path / "result.json"
    args = parse(common + ["--splits", "0,1", "--batch-size", "8", "--num-neighbors", "4,3", "--eval-batch-size",
                           "16", "--save", str(tmp_path / "ckpt-{split}.pt"), "--out", str(out)])
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    assert result["world_size"] == 1 and result["batch_size"] == 8 and result["num_neighbors"] == [4, 3]
    assert result["eval_batch_size"] == 16 and result["epochs_per_second"] > 0
    assert all(r["batches_per_epoch"] == 3 for r in result["splits"])
    assert (tmp_path / "ckpt-0.pt").is_file() and (tmp_path / "ckpt-1.pt").is_file()
    assert "epochs/s" in capsys.readouterr().out
    for extra, message in ((["--batch-size", "8", "--num-neighbors", "5"], r"need one count per layer"),
                           (["--batch-size", "0"], r"train: --batch-size must be >= 1, got 0"),
                           (["--splits", "0,1", "--save", "x.pt"], r"--save with 2 splits needs \{split\}")):
        bad = parse(common + extra)
        with pytest.raises(ValueError, match=message):
            bad.func(bad)
    with pytest.raises(SystemExit):
        parse(common + ["--num-neighbors", "4,x"])
    assert "--num-neighbors must be comma-separated ints" in capsys.readouterr().err
