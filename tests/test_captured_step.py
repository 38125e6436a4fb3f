"""The captured training step (nt_kernels.train, issue 41) on the CPU: its replay path against eager steps, fresh
dropout masks, the refusals and their messages, and when ``nt-kernels train`` captures."""
import copy

import pytest
import torch
import torch.nn.functional as F

from nt_kernels.apps.fullbatch import capture_decision
from nt_kernels.data.datasets import monophily_graph
from nt_kernels.nn import NT, NTConv, NTStar
from nt_kernels.ops import ntconv
from nt_kernels.train import CapturedCall, CapturedStep, HostReadError, HostReads

pytestmark = pytest.mark.usefixtures("single_thread")

DATA = monophily_graph(num_nodes=90, degree=4, seed=1)
TRAIN = DATA.train_mask[0].nonzero().flatten()
TRAIN_Y = DATA.y[TRAIN]


def loss_fn(out, target):
    return F.cross_entropy(out.index_select(0, TRAIN), target)


def dirnt_with_conv_dropout(dropout):
    """DirNT layers whose fused ops draw their own dropout (on Z), besides NT's."""
    model = NT(8, 8, 1, 3, heads=2, directed=True, aggr="max", dropout=dropout)
    for layer in model.convs:
        layer.conv.dropout = layer.conv_reversed.dropout = dropout
    return model


MODELS = {
    "NT-fused": lambda dropout: NT(8, 8, 2, 3, heads=2, dropout=dropout, aggr="weighted_mean"),
    "NT-composition": lambda dropout: NT(8, 8, 2, 3, heads=2, dropout=dropout, aggr="sum", fused=False),
    "DirNT-conv-dropout": dirnt_with_conv_dropout,
    "NTStar-local": lambda dropout: NTStar(8, 8, 3, 2, 1, heads=2, dropout=dropout, aggr="gated_sum"),
    "NT-checkpoint": lambda dropout: NT(8, 8, 2, 3, heads=2, dropout=dropout, sep=True, checkpoint=True),
}
OPTIMIZERS = {
    "Adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "Adam-fused-capturable": lambda params: torch.optim.Adam(params, lr=1e-2, fused=True, capturable=True),
}


def twins(name, dropout, optimizer="Adam"):
    """The same model twice (same weights), its CSR and an optimizer for each."""
    torch.manual_seed(0)
    model = MODELS[name](dropout)
    csr = model.prepare(DATA.edge_index, DATA.num_nodes)
    other = copy.deepcopy(model)
    return (model, OPTIMIZERS[optimizer](model.parameters())), (other, OPTIMIZERS[optimizer](other.parameters())), csr


def eager_step(model, optimizer, x, csr):
    optimizer.zero_grad()
    loss = loss_fn(model(x, csr), TRAIN_Y)
    loss.backward()
    optimizer.step()
    return loss.detach()


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("warmup", [0, 2], ids=["no-warmup", "warmup-2"])
@pytest.mark.parametrize("dropout", [0.0, 0.3], ids=["dropout-0", "dropout-0.3"])
@pytest.mark.parametrize("name", list(MODELS))
def test_replay_path_gives_the_eager_steps_bitwise(name, dropout, warmup, optimizer):
    """Static buffers, copy-in and a call per step: 5 steps give the eager steps' losses and parameters bitwise
    (the warm-up is undone: parameters, optimizer state and the CPU generator go back in place, so even dropout
    draws the eager run's masks)."""
    (eager, opt_eager), (model, opt), csr = twins(name, dropout, optimizer)
    model.train(), eager.train()
    step = CapturedStep(model, opt, loss_fn, warmup=warmup)
    x = DATA.x.clone()
    torch.manual_seed(7)
    want = [eager_step(eager, opt_eager, DATA.x, csr) for _ in range(5)]
    torch.manual_seed(7)
    got = [step(x, csr, target=TRAIN_Y).clone() for _ in range(5)]
    assert not step.captured
    assert [v.item() for v in got] == [v.item() for v in want]
    for (key, a), b in zip(eager.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), key


@pytest.mark.parametrize("name", list(MODELS))
def test_fresh_dropout_masks_at_every_replay(name):
    """With the learning rate at 0 the parameters stay put: with dropout every call draws new masks (new losses),
    without dropout every call gives the same loss."""
    for dropout, fresh in ((0.3, True), (0.0, False)):
        torch.manual_seed(0)
        model = MODELS[name](dropout).train()
        csr = model.prepare(DATA.edge_index, DATA.num_nodes)
        step = CapturedStep(model, torch.optim.Adam(model.parameters(), lr=0.0), loss_fn)
        losses = [step(DATA.x, csr, target=TRAIN_Y).item() for _ in range(3)]
        assert (len(set(losses)) == 3) if fresh else (len(set(losses)) == 1), (dropout, losses)


def test_later_calls_copy_their_inputs_into_the_static_buffers():
    """A later call with other tensors of the same shape trains on their values (copied into the first call's)."""
    (eager, opt_eager), (model, opt), csr = twins("NT-fused", 0.0)
    step = CapturedStep(model, opt, loss_fn)
    first, second = DATA.x.clone(), DATA.x.flip(0).clone()
    step(first, csr, target=TRAIN_Y)
    got = step(second, csr, target=TRAIN_Y)
    eager_step(eager, opt_eager, DATA.x, csr)
    assert torch.equal(got, eager_step(eager, opt_eager, DATA.x.flip(0), csr))
    assert torch.equal(first, DATA.x.flip(0))  # the static buffer holds the last inputs


def test_autocast_step_matches_eager_autocast():
    (eager, opt_eager), (model, opt), csr = twins("NT-fused", 0.0)
    step = CapturedStep(model, opt, loss_fn, autocast=torch.bfloat16)
    for _ in range(2):
        got = step(DATA.x, csr, target=TRAIN_Y)
        opt_eager.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = loss_fn(eager(DATA.x, csr), TRAIN_Y)
        want.backward()
        opt_eager.step()
        assert torch.equal(got, want.detach())


def refused_step(step_loss=loss_fn):
    torch.manual_seed(0)
    model = NT(8, 8, 1, 3, heads=2)
    csr = model.prepare(DATA.edge_index, DATA.num_nodes)
    return model, csr, CapturedStep(model, torch.optim.Adam(model.parameters(), lr=1e-2), step_loss)


@pytest.mark.parametrize("change, message", [
    ("fewer-rows", r"argument\[0\]\[0\] was \(90, 8\) torch.float32 on cpu when the step was captured and is "
                   r"\(60, 8\) torch.float32 on cpu now: a captured step replays fixed shapes, so mini-batches whose "
                   r"shapes change \(e.g. NeighborLoader batches\) must train eagerly"),
    ("other-dtype", r"argument\[0\]\[0\] was \(90, 8\) torch.float32 .* is \(90, 8\) torch.float64"),
    ("other-graph", r"argument\[0\]\[1\] is another object than at the capture \(NeighbourhoodCSR\); a captured step "
                    r"replays one graph and its plans"),
    ("other-target-shape", r"argument\[1\] was \(45,\) torch.int64 .* is \(44,\) torch.int64"),
], ids=["fewer-rows", "other-dtype", "other-graph", "other-target-shape"])
def test_a_later_call_that_cannot_replay_is_refused(change, message):
    model, csr, step = refused_step()
    step(DATA.x, csr, target=TRAIN_Y)
    x, graph, target = DATA.x, csr, TRAIN_Y
    if change == "fewer-rows":
        x = DATA.x[:60]
    elif change == "other-dtype":
        x = DATA.x.double()
    elif change == "other-graph":
        graph = model.prepare(DATA.edge_index.flip(0), DATA.num_nodes)
    else:
        target = TRAIN_Y[:44]
    with pytest.raises(ValueError, match=message):
        step(x, graph, target=target)


@pytest.mark.parametrize("loss, message", [
    (lambda out, target: F.cross_entropy(out[DATA.train_mask[0]], target),
     r"CapturedStep: indexes with a boolean mask \(aten::index"),
    (lambda out, target: loss_fn(out, target) * (1 + 0 * float(out.detach().sum())),
     r"CapturedStep: reads a device value on the host \(\.item\(\), int\(\), float\(\) or bool\(\)"),
    (lambda out, target: loss_fn(out, target) + 0 * len(out.detach().sum(1).tolist()),
     r"CapturedStep: reads a device tensor on the host \(\.tolist\(\)\)"),
], ids=["boolean-mask", "float", "tolist"])
def test_a_step_that_reads_the_host_is_refused_and_leaves_the_model_as_it_was(loss, message):
    model, csr, step = refused_step(loss)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.raises(HostReadError, match=message + r".*test_captured_step.py:\d+"):
        step(DATA.x, csr, target=TRAIN_Y)
    assert all(torch.equal(before[key], value) for key, value in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_a_host_side_seed_is_refused_for_an_accelerator():
    """A capture on an accelerator records host values once: a dropout seed drawn by the CPU generator (here the
    fused op's seed, as NTConv drew it before it drew seeds on the device inside a capture) or given as a CPU
    tensor would give every replay the same mask.  HostReads (which the capture runs under) refuses both; the
    CPU tensors stand in for the host side of a CUDA run."""
    conv = NTConv(8, 8, heads=2, dropout=0.5, fused=True).train()
    csr = conv.prepare(DATA.edge_index, DATA.num_nodes)
    with pytest.raises(HostReadError, match=r"draws random numbers with the CPU generator \(aten::randint\): a "
                                            r"host-side seed, recorded once by a capture and reused by every replay"):
        with HostReads(torch.device("cuda"), "CapturedStep"):
            conv(DATA.x, csr)
    centre, receiver = conv.lin_centre(DATA.x), conv.lin_receiver(DATA.x)
    args = (centre, receiver, csr, conv.lin_qkv.weight, conv.lin_qkv.bias, conv.lin_out.weight, conv.lin_out.bias)
    with pytest.raises(HostReadError, match=r"passes a CPU tensor as nt_kernels::ntconv_fwd's dropout seed: a "
                                            r"host-side seed"):
        with HostReads(torch.device("cuda"), "CapturedStep"):
            ntconv(*args, heads=2, dropout=0.5, seed=7, projection=conv.projection, threshold=conv.threshold)
    with HostReads(torch.device("cuda"), "CapturedStep"):  # no dropout: no seed, nothing to refuse
        ntconv(*args, heads=2, projection=conv.projection, threshold=conv.threshold)


def test_captured_call_replay_path_and_refusal():
    torch.manual_seed(0)
    model = NT(8, 8, 1, 3, heads=2).eval()
    csr = model.prepare(DATA.edge_index, DATA.num_nodes)
    call = CapturedCall(lambda x, graph: model(x, graph).sum(1))
    with torch.no_grad():
        assert torch.equal(call(DATA.x, csr), model(DATA.x, csr).sum(1))
        x = DATA.x.flip(0).clone()
        assert torch.equal(call(x, csr), model(x, csr).sum(1)) and not call.captured
        with pytest.raises(ValueError, match=r"CapturedCall: argument\[0\] was \(90, 8\)"):
            call(DATA.x[:10], csr)
    with pytest.raises(HostReadError, match=r"CapturedCall: runs aten::nonzero"):
        CapturedCall(lambda x: x.nonzero())(DATA.x)


@pytest.mark.parametrize("kwargs, message", [
    ({"capture": "yes"}, r"CapturedStep: capture must be None, True or False, got 'yes'"),
    ({"warmup": -1}, r"CapturedStep: warmup must be None or an int >= 0, got -1"),
    ({"autocast": torch.int32}, r"CapturedStep: autocast must be None or a floating dtype, got torch.int32"),
    ({"loss_fn": 3}, r"CapturedStep: loss_fn must be callable, got int"),
    ({"optimizer": "adam"}, r"CapturedStep: optimizer must be a torch.optim.Optimizer, got str"),
], ids=["capture", "warmup", "autocast", "loss_fn", "optimizer"])
def test_bad_arguments_name_the_argument(kwargs, message):
    model = NT(8, 8, 1, 3)
    arguments = {"model": model, "optimizer": torch.optim.Adam(model.parameters()), "loss_fn": loss_fn, **kwargs}
    with pytest.raises(ValueError, match=message):
        CapturedStep(**arguments)


def test_capture_true_needs_cuda():
    model, csr, _ = refused_step()
    step = CapturedStep(model, torch.optim.Adam(model.parameters()), loss_fn, capture=True)
    with pytest.raises(ValueError, match=r"CapturedStep: capture=True needs a CUDA device, the step runs on cpu"):
        step(DATA.x, csr, target=TRAIN_Y)


@pytest.mark.parametrize("request_, device, minibatch, world, expect", [
    (None, "cpu", False, 1, (False, "not used, eager steps: CUDA graphs need a CUDA device, the run is on cpu")),
    (None, "cuda", False, 1, (True, "the training step and the evaluation forward are captured and replayed")),
    (None, "cuda", True, 1, (False, "not used, eager steps: NeighborLoader mini-batches (--batch-size) give "
                                    "every batch another shape")),
    (None, "cuda", True, 2, (False, "not used, eager steps: data-parallel ranks (torchrun) all-reduce gradients "
                                    "from DDP's Python hooks during backward, which a graph cannot replay")),
    (False, "cuda", False, 1, (False, "off (--cuda-graph off), eager steps")),
], ids=["auto-cpu", "auto-cuda", "auto-minibatch", "auto-ddp", "off"])
def test_when_train_captures(request_, device, minibatch, world, expect):
    assert capture_decision(request_, device, minibatch=minibatch, world_size=world) == expect


@pytest.mark.parametrize("device, minibatch, world, reason", [
    ("cpu", False, 1, "CUDA graphs need a CUDA device"),
    ("cuda", True, 1, "NeighborLoader mini-batches"),
    ("cuda", False, 2, "data-parallel ranks"),
], ids=["cpu", "minibatch", "ddp"])
def test_cuda_graph_on_where_it_cannot_is_an_error(device, minibatch, world, reason):
    with pytest.raises(ValueError, match=rf"train: --cuda-graph on, but {reason}.*use --cuda-graph auto or off"):
        capture_decision(True, device, minibatch=minibatch, world_size=world)
