"""Activation checkpointing of the node-level blocks (``checkpoint=`` of NT and NT*; issue 41): the same loss and
gradients bitwise, fewer kept activations, the memory model's default, and bad values."""
import pytest
import torch

import nt_kernels.nn.checkpoint as ckpt
from nt_kernels.data.datasets import monophily_graph
from nt_kernels.nn import NT, NTStar

pytestmark = pytest.mark.usefixtures("single_thread")

DATA = monophily_graph(num_nodes=120, degree=4, seed=2)


def dirnt(**kwargs):
    model = NT(8, 8, 2, 3, heads=2, directed=True, aggr="max", **kwargs)
    for layer in model.convs:  # the layers' own dropout too (the fused op's seed)
        layer.conv.dropout = layer.conv_reversed.dropout = model.dropout
    return model


MODELS = {
    "NT-fused": lambda **kw: NT(8, 8, 2, 3, heads=2, aggr="weighted_mean", **kw),
    "NT-sep-fused": lambda **kw: NT(8, 8, 2, 3, heads=2, sep=True, aggr="sum", **kw),
    "NT-sep-composition": lambda **kw: NT(8, 8, 2, 3, heads=2, sep=True, aggr="gated_sum", fused=False, **kw),
    "DirNT": dirnt,
    "NTStar-local": lambda **kw: NTStar(8, 8, 3, 2, 1, heads=2, in_dropout=kw.get("dropout", 0.0), aggr="sum", **kw),
    "NTStar-global-composition": lambda **kw: NTStar(8, 8, 3, 2, 1, heads=2, aggr="mean", fused=False, **kw),
}


def gradients(name, checkpoint, dropout, autocast=False):
    torch.manual_seed(0)
    model = MODELS[name](dropout=dropout, checkpoint=checkpoint).train()
    if name.startswith("NTStar-global"):
        model.stage = "global"
    csr = model.prepare(DATA.edge_index, DATA.num_nodes)
    torch.manual_seed(1)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = torch.nn.functional.cross_entropy(model(DATA.x, csr), DATA.y)
    loss.backward()
    return loss.detach(), {key: p.grad for key, p in model.named_parameters() if p.grad is not None}, torch.rand(3)


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
@pytest.mark.parametrize("dropout", [0.0, 0.3], ids=["dropout-0", "dropout-0.3"])
@pytest.mark.parametrize("name", list(MODELS))
def test_checkpointing_gives_the_same_loss_and_gradients_bitwise(name, dropout, autocast):
    """Same ops in the same order (the recompute reuses the forward's dropout noise): loss, every gradient and the
    generator's state after the step are bitwise those of the run without checkpointing."""
    loss, grads, after = gradients(name, False, dropout, autocast)
    loss_ck, grads_ck, after_ck = gradients(name, True, dropout, autocast)
    assert torch.equal(loss, loss_ck)
    assert grads.keys() == grads_ck.keys() and len(grads) > 5
    for key in grads:
        assert torch.equal(grads[key], grads_ck[key]), key
    assert torch.equal(after, after_ck)


def test_the_bool_mask_dropout_of_other_devices_is_recomputed_bitwise(monkeypatch):
    """Off the CPU (CUDA) a checkpointed dropout keeps a bool mask, as native_dropout does; forced here on the CPU:
    the checkpointed block's gradients are bitwise those of the same block run plain, and the kept mask is
    one byte per element."""
    monkeypatch.setattr(ckpt, "FLOAT_NOISE_DEVICES", ())
    torch.manual_seed(0)
    ffn = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.4), torch.nn.GELU(), torch.nn.Linear(16, 8))
    x = torch.randn(50, 8, requires_grad=True)
    grads, plain = [], ckpt.Dropouts()
    for checkpointed in (False, True):
        ffn.zero_grad()
        x.grad = None
        torch.manual_seed(3)
        out = (ckpt.checkpointed(lambda drop, x: ckpt.run_blocks(ffn, drop, x), x) if checkpointed
               else ckpt.run_blocks(ffn, plain, x))
        (out * torch.arange(8.0)).sum().backward()
        grads.append([x.grad.clone()] + [p.grad.clone() for p in ffn.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert plain._noise[0].dtype == torch.bool and 0.45 < plain._noise[0].float().mean() < 0.75


def kept_bytes(model, csr) -> int:
    """Bytes of the distinct storages that autograd keeps for backward outside checkpointed blocks."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(DATA.x, csr).sum().backward()
    return sum(storages.values())


@pytest.mark.parametrize("name", ["NT-sep-fused", "NT-sep-composition", "NTStar-local"])
def test_checkpointing_frees_what_the_memory_model_says(name):
    """Without dropout (whose noise is kept either way, and which a checkpointed block holds outside autograd's
    saved tensors)."""
    kept = {}
    for setting in (False, True):
        torch.manual_seed(0)
        model = MODELS[name](dropout=0.0, checkpoint=setting).train()
        csr = model.prepare(DATA.edge_index, DATA.num_nodes)
        kept[setting] = kept_bytes(model, csr)
    freed = kept[False] - kept[True]
    estimate = model.checkpoint_saving(DATA.num_nodes)
    assert 0.8 * estimate <= freed <= 1.25 * estimate, (freed, estimate, kept)


def test_the_default_checkpoints_where_the_memory_model_says_it_pays(monkeypatch):
    torch.manual_seed(0)
    model = NT(8, 8, 2, 3, heads=2, sep=True).train()
    x = DATA.x
    saving = model.checkpoint_saving(x.shape[0])
    assert not model.uses_checkpoint(x)  # 120 nodes: a few hundred KB
    monkeypatch.setattr(ckpt, "CHECKPOINT_MIN_BYTES", saving)
    assert model.uses_checkpoint(x)
    with torch.no_grad():
        assert not model.uses_checkpoint(x)  # nothing to keep without autograd
    assert not model.eval().uses_checkpoint(x)
    model.train().checkpoint = False
    assert not model.uses_checkpoint(x)
    monkeypatch.setattr(ckpt, "CHECKPOINT_MIN_BYTES", saving + 1)
    model.checkpoint = True
    assert model.uses_checkpoint(x)


@pytest.mark.parametrize("model, kwargs, mib, on", [
    (lambda: NT(16, 64, 3, 2, heads=4, sep=True, aggr="weighted_mean"), {"activation": 2}, (5_000_000, 5_050, 5_100),
     True),
    (lambda: NT(7, 53, 5, 2, heads=1, sep=True, aggr="sum"), {}, (10_000, 44, 45), False),
    (lambda: NT(10, 60, 5, 2, heads=2, sep=True, aggr="gated_sum"), {"activation": 2}, (11_758, 16, 17), False),
], ids=["powerlaw-5M-bf16", "minesweeper-float32", "tolokers-bf16"])
def test_the_memory_model_on_the_bench_graphs(model, kwargs, mib, on):
    """docs/nn.md quotes these: about 5.0 GiB freed on the 5M-node power-law step (bf16 autocast, so on by
    default), 45 MiB on minesweeper (float32) and 16 MiB on tolokers (bf16): off."""
    nodes, low, high = mib
    saving = model().checkpoint_saving(nodes, **kwargs)
    assert low <= saving / 2 ** 20 <= high
    assert (saving >= ckpt.CHECKPOINT_MIN_BYTES) == on


@pytest.mark.parametrize("build, message", [
    (lambda: NT(8, 8, 1, checkpoint="yes"), r"NT: checkpoint must be None \(a memory model decides\), True or False, "
                                            r"got 'yes'"),
    (lambda: NTStar(8, 8, 3, 1, 0, checkpoint=1), r"NTStar: checkpoint must be None .* got 1"),
], ids=["NT", "NTStar"])
def test_bad_checkpoint_values_are_refused(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_repr_shows_a_forced_setting():
    assert "checkpoint=True" in repr(NT(8, 8, 1, checkpoint=True))
    assert "checkpoint" not in repr(NT(8, 8, 1))
    assert "checkpoint=False" in repr(NTStar(8, 8, 3, 1, 0, checkpoint=False))
