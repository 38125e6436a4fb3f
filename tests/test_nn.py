"""NTConv / DirNT / NT: fused vs reference, Theorem 1, graph caching, torch.compile, bad input."""
import math

import pytest
import torch
import torch.nn.functional as F

import nt_reference.nn as ref
from nt_kernels.nn.aggregate import aggregate
from nt_kernels.csr import NeighbourhoodCSR
from nt_kernels.nn import NT, DirNT, NTConv


pytestmark = pytest.mark.usefixtures("single_thread")


AGGRS = ["sum", "mean", "max", "weighted_mean", "gated_sum"]
NUM_NODES = 40
ATOL = 1e-8


def hub_graph(directed: bool) -> torch.Tensor:
    """40 nodes: hub 0 with 25 neighbours (over the switch threshold), a chain, isolated nodes 36..39."""
    gen = torch.Generator().manual_seed(1)
    hub = torch.stack([torch.zeros(25, dtype=torch.long), torch.arange(1, 26)])
    chain = torch.stack([torch.arange(26, 35), torch.arange(27, 36)])
    extra = torch.randint(1, 36, (2, 30), generator=gen)
    edges = torch.cat([hub, chain, extra[:, extra[0] != extra[1]]], dim=1)
    if not directed:
        edges = torch.cat([edges, edges.flip(0)], dim=1)
    return edges[:, torch.randperm(edges.shape[1], generator=gen)]


def make_pair(cls, ref_cls, *args, **kwargs):
    torch.manual_seed(0)
    fused = cls(*args, **kwargs).double()
    reference = ref_cls(*args, **kwargs).double()
    reference.load_state_dict(fused.state_dict())
    return fused, reference


def assert_same_run(fused, reference, x, edge_index, edge_attr=None):
    """Forward outputs and every parameter gradient agree to ATOL (float64)."""
    weight = torch.randn(NUM_NODES, fused_width(fused), dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    out_f = fused(x, edge_index, edge_attr)
    out_r = reference(x, edge_index, edge_attr)
    torch.testing.assert_close(out_f, out_r, atol=ATOL, rtol=0)
    (out_f * weight).sum().backward()
    (out_r * weight).sum().backward()
    grads_r = dict(reference.named_parameters())
    for name, param in fused.named_parameters():
        torch.testing.assert_close(param.grad, grads_r[name].grad, atol=ATOL, rtol=0, msg=f"gradient of {name}")


def fused_width(module):
    return module.out_channels if isinstance(module, (NTConv, NT)) else module.conv.out_channels


def inputs(edge_index, in_channels=6, edge_dim=None):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(NUM_NODES, in_channels, dtype=torch.float64, generator=gen)
    edge_attr = None if edge_dim is None else torch.randn(edge_index.shape[1], edge_dim, dtype=torch.float64,
                                                          generator=gen)
    return x, edge_attr


# nb_features=4, D=4 gives the switch threshold 4 + sqrt(32) ~ 9.7: the hub takes Performer, the rest exact.
CONV_KW = dict(heads=2, nb_features=4)


@pytest.mark.parametrize("directed", [False, True], ids=["undirected", "directed"])
@pytest.mark.parametrize("edge_dim", [None, 3], ids=["no-edge-attr", "edge-attr"])
@pytest.mark.parametrize("aggr", AGGRS)
def test_ntconv_fused_matches_reference(aggr, edge_dim, directed):
    edge_index = hub_graph(directed)
    fused, reference = make_pair(NTConv, ref.NTConv, 6, 8, edge_dim=edge_dim, aggr=aggr, **CONV_KW)
    x, edge_attr = inputs(edge_index, edge_dim=edge_dim)
    assert_same_run(fused, reference, x, edge_index, edge_attr)


@pytest.mark.parametrize("aggr", AGGRS)
def test_dirnt_fused_matches_reference(aggr):
    edge_index = hub_graph(directed=True)
    fused, reference = make_pair(DirNT, ref.DirNT, 6, 8, edge_dim=3, aggr=aggr, **CONV_KW)
    x, edge_attr = inputs(edge_index, edge_dim=3)
    assert_same_run(fused, reference, x, edge_index, edge_attr)


@pytest.mark.parametrize("attention", ["switch", "softmax", "performer"])
@pytest.mark.parametrize("gate_group", ["receiver", "centre"])
def test_attention_and_gate_group_match_reference(attention, gate_group):
    edge_index = hub_graph(directed=False)
    kwargs = dict(heads=2, aggr="weighted_mean", attention=attention, gate_group=gate_group)
    if attention != "softmax":
        kwargs["nb_features"] = 4
    fused, reference = make_pair(NTConv, ref.NTConv, 6, 8, **kwargs)
    x, _ = inputs(edge_index)
    assert_same_run(fused, reference, x, edge_index)


@pytest.mark.parametrize("sep", [False, True], ids=["plain", "sep"])
@pytest.mark.parametrize("directed", [False, True], ids=["NT", "DirNT"])
def test_nt_model_matches_reference(directed, sep):
    edge_index = hub_graph(directed)
    fused, reference = make_pair(NT, ref.NT, 6, 8, 2, 3, heads=2, directed=directed, sep=sep, nb_features=4,
                                 aggr="gated_sum")
    x, _ = inputs(edge_index)
    assert_same_run(fused.eval(), reference.eval(), x, edge_index)


@pytest.mark.parametrize("aggr", AGGRS)
def test_backend_switch_keeps_weights(aggr):
    edge_index = hub_graph(directed=False)
    torch.manual_seed(0)
    conv = NTConv(6, 8, aggr=aggr, **CONV_KW).double()
    x, _ = inputs(edge_index)
    fused = conv(x, edge_index)
    conv.backend = "reference"
    assert conv.backend == "reference" and "backend=reference" in repr(conv)
    torch.testing.assert_close(conv(x, edge_index), fused, atol=ATOL, rtol=0)


def explicit_message_passing(conv: NTConv, x, edge_index):
    """Theorem 1's MP layer: m_j = GELU(W_o GELU-combiner(x_j) W_v), aggregated over edges j -> i by loops."""
    z = F.gelu(conv.lin_centre(x))
    value = F.linear(z, conv.lin_qkv.weight[2 * conv.out_channels:], conv.lin_qkv.bias[2 * conv.out_channels:])
    m = F.gelu(conv.lin_out(value))
    out = torch.zeros(x.shape[0], conv.out_channels, dtype=x.dtype)
    for i in range(x.shape[0]):
        senders = edge_index[0, edge_index[1] == i]
        if senders.numel() == 0:
            continue
        msgs = m[senders]
        if conv.aggr == "sum":
            out[i] = msgs.sum(0)
        elif conv.aggr == "mean":
            out[i] = msgs.mean(0)
        elif conv.aggr == "max":
            out[i] = msgs.max(0).values
        else:
            split = msgs.view(len(senders), conv.heads, 2, conv.head_dim)
            gate, val = split[:, :, 0].mean(-1), split[:, :, 1]
            weight = torch.sigmoid(gate) if conv.aggr == "gated_sum" else torch.softmax(gate, dim=0)
            out[i] = (weight.unsqueeze(-1) * val).sum(0).flatten()
    return out


@pytest.mark.parametrize("backend", ["fused", "reference"])
@pytest.mark.parametrize("aggr", AGGRS)
def test_theorem1_centre_only_combiner_is_message_passing(aggr, backend):
    edge_index = hub_graph(directed=True)
    torch.manual_seed(0)
    conv = NTConv(6, 8, aggr=aggr, backend=backend, **CONV_KW).double()
    with torch.no_grad():
        conv.lin_receiver.weight.zero_()
    x, _ = inputs(edge_index)
    torch.testing.assert_close(conv(x, edge_index), explicit_message_passing(conv, x, edge_index), atol=ATOL, rtol=0)


def test_edge_index_cache_is_content_keyed():
    edge_index = hub_graph(directed=False)
    conv = NTConv(6, 8, **CONV_KW).double()
    x, _ = inputs(edge_index)
    conv(x, edge_index)
    csr = conv._graphs.csr
    conv(x, edge_index.clone())
    assert conv._graphs.csr is csr
    conv(x, edge_index[:, 1:])
    assert conv._graphs.csr is not csr and conv._graphs.csr.num_edges == edge_index.shape[1] - 1


def test_prebuilt_csr_holds_plans():
    edge_index = hub_graph(directed=True)
    model = NT(6, 8, 2, 3, heads=2, directed=True, nb_features=4).double()
    csr = model.prepare(edge_index, NUM_NODES)
    assert isinstance(csr, NeighbourhoodCSR)
    keys = set(csr._plans)
    assert ("nn.receiver_csr", NUM_NODES) in keys and ("nn.reversed_csr", NUM_NODES) in keys
    assert ("split", model.convs[0].conv.threshold) in keys
    x, _ = inputs(edge_index)
    torch.testing.assert_close(model(x, csr), model(x, edge_index), atol=0, rtol=0)


def test_csr_with_fewer_centres_than_nodes():
    """A subgraph CSR over the first 36 nodes (no isolated tail) still fills all 40 output rows."""
    edge_index = hub_graph(directed=True)
    torch.manual_seed(0)
    conv = NTConv(6, 8, aggr="mean", **CONV_KW).double()
    x, _ = inputs(edge_index)
    small = NeighbourhoodCSR.from_edge_index(edge_index, 36)
    out = conv(x, small)
    assert out.shape == (NUM_NODES, 8) and not out[36:].any()
    torch.testing.assert_close(out, conv(x, edge_index), atol=ATOL, rtol=0)


def test_empty_graph_gives_zeros():
    conv = NTConv(6, 8, **CONV_KW).double()
    x, _ = inputs(torch.empty(2, 0, dtype=torch.long))
    out = conv(x, torch.empty(2, 0, dtype=torch.long))
    assert out.shape == (NUM_NODES, 8) and not out.any()


def test_reset_parameters_and_buffers():
    conv = NTConv(6, 8, edge_dim=3, **CONV_KW)
    before = {k: v.clone() for k, v in conv.state_dict().items()}
    conv.reset_parameters()
    after = conv.state_dict()
    assert set(before) == {"lin_centre.weight", "lin_centre.bias", "lin_receiver.weight", "lin_edge.weight",
                           "lin_qkv.weight", "lin_qkv.bias", "lin_out.weight", "lin_out.bias", "projection"}
    assert all(not torch.equal(before[k], after[k]) for k in before)
    assert not conv.projection.requires_grad and conv.projection.shape == (4, 4)
    assert "projection" not in dict(conv.named_parameters())
    model = NT(6, 8, 2, 3, heads=2, nb_features=4)
    snapshot = [p.clone() for p in model.parameters()]
    model.reset_parameters()
    assert any(not torch.equal(a, b) for a, b in zip(snapshot, model.parameters()))


def test_repr_names_the_configuration():
    text = repr(NTConv(6, 8, heads=2, edge_dim=3, aggr="weighted_mean", nb_features=4, gate_group="centre"))
    assert text == "NTConv(6, 8, heads=2, aggr=weighted_mean, edge_dim=3, nb_features=4, gate_group=centre)"
    assert repr(NT(6, 8, 1, 3, directed=True)) == "NT(6, 8, num_layers=1, out_channels=3, heads=1, directed=True, " \
                                                  "aggr=weighted_mean)"


@pytest.mark.parametrize("directed", [False, True], ids=["NT", "DirNT"])
def test_compile_fullgraph_on_prebuilt_csr(directed):
    edge_index = hub_graph(directed)
    torch.manual_seed(0)
    model = NT(6, 8, 2, 3, heads=2, nb_features=4, aggr="weighted_mean", directed=directed).double().eval()
    csr = model.prepare(edge_index, NUM_NODES)
    x, _ = inputs(edge_index)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out_c, out_e = compiled(x, csr), model(x, csr)
    torch.testing.assert_close(out_c, out_e, atol=ATOL, rtol=0)
    grads_c = torch.autograd.grad(out_c.square().sum(), list(model.parameters()))
    grads_e = torch.autograd.grad(out_e.square().sum(), list(model.parameters()))
    for grad_c, grad_e in zip(grads_c, grads_e):
        torch.testing.assert_close(grad_c, grad_e, atol=ATOL, rtol=0)


CONV_ERRORS = [
    pytest.param(dict(in_channels=0), "NTConv: in_channels must be an int >= 1", id="in_channels"),
    pytest.param(dict(out_channels=7, heads=2), r"NTConv: out_channels \(7\) must be divisible by heads \(2\)",
                 id="heads-divide-width"),
    pytest.param(dict(heads=0), "NTConv: heads must be an int >= 1", id="heads"),
    pytest.param(dict(edge_dim=0), "NTConv: edge_dim must be an int >= 1", id="edge_dim"),
    pytest.param(dict(aggr="median"), "NTConv: aggr must be one of", id="aggr"),
    pytest.param(dict(dropout=1.0), r"NTConv: dropout must be a number in \[0, 1\)", id="dropout"),
    pytest.param(dict(attention="linear"), "NTConv: attention must be one of", id="attention"),
    pytest.param(dict(nb_features=0), "NTConv: nb_features must be an int >= 1", id="nb_features"),
    pytest.param(dict(threshold=-1.0), "NTConv: threshold must be a non-negative number", id="threshold-negative"),
    pytest.param(dict(threshold=math.nan), "NTConv: threshold must be a non-negative number", id="threshold-nan"),
    pytest.param(dict(attention="softmax", threshold=4), "NTConv: threshold only applies to attention='switch'",
                 id="threshold-without-switch"),
    pytest.param(dict(gate_group="edge"), "NTConv: gate_group must be one of", id="gate_group"),
    pytest.param(dict(backend="cuda"), "NTConv: backend must be one of", id="backend"),
]


@pytest.mark.parametrize("kwargs,message", CONV_ERRORS)
def test_ntconv_constructor_errors(kwargs, message):
    args = dict(in_channels=6, out_channels=8)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        NTConv(**args)


def test_forward_errors():
    edge_index = hub_graph(directed=False)
    x, edge_attr = inputs(edge_index, edge_dim=3)
    conv = NTConv(6, 8, edge_dim=3, **CONV_KW).double()
    plain = NTConv(6, 8, **CONV_KW).double()
    with pytest.raises(ValueError, match=r"NTConv: x must have shape \(N, in_channels=6\), got \(40, 5\)"):
        conv(x[:, :5], edge_index, edge_attr)
    with pytest.raises(ValueError, match="NTConv: edge_attr of shape .* is required"):
        conv(x, edge_index)
    with pytest.raises(ValueError, match=r"NTConv: edge_attr must have shape \(E=\d+, edge_dim=3\), got"):
        conv(x, edge_index, edge_attr[:, :2])
    with pytest.raises(ValueError, match="NTConv: edge_attr given but the layer was built with edge_dim=None"):
        plain(x, edge_index, edge_attr)
    with pytest.raises(ValueError, match=r"NTConv: edge_index must be a \(2, E\) tensor, a sparse adjacency"):
        plain(x, edge_index.tolist())
    with pytest.raises(ValueError, match="NTConv: edge_index is a NeighbourhoodCSR of 40 centre nodes but x has "
                                         "only 10 rows"):
        plain(x[:10], NeighbourhoodCSR.from_edge_index(edge_index, NUM_NODES))
    with pytest.raises(ValueError, match="out of range for num_nodes=10"):
        plain(x[:10], edge_index)
    with pytest.raises(ValueError, match="NTConv: backend must be one of"):
        plain.backend = "triton"


def test_model_and_aggregate_errors():
    with pytest.raises(ValueError, match="NT: hidden_channels must be an int >= 1"):
        NT(6, 0, 2, 3)
    with pytest.raises(ValueError, match="NT: num_layers must be an int >= 0"):
        NT(6, 8, -1, 3)
    with pytest.raises(ValueError, match=r"NT: dropout must be a number in \[0, 1\)"):
        NT(6, 8, 1, 3, dropout=1.5)
    with pytest.raises(ValueError, match="NT: backend must be one of"):
        NT(6, 8, 1, 3).backend = "cpu"
    with pytest.raises(ValueError, match=r"DirNT: x must have shape \(N, in_channels=6\)"):
        DirNT(6, 8)(torch.randn(4, 5), torch.tensor([[0], [1]]))
    csr = NeighbourhoodCSR.from_edge_index(torch.tensor([[0, 1], [1, 0]]))
    with pytest.raises(ValueError, match="aggregate: aggr must be one of"):
        aggregate(torch.randn(2, 4), csr, "median", num_nodes=2)
    with pytest.raises(ValueError, match="aggregate: gate_group must be one of"):
        aggregate(torch.randn(2, 4), csr, "sum", num_nodes=2, gate_group="edge")
    with pytest.raises(ValueError, match=r"aggregate: messages must have shape \(E=2, C\)"):
        aggregate(torch.randn(3, 4), csr, "sum", num_nodes=2)
    with pytest.raises(ValueError, match="aggregate: gated_sum needs C divisible by 2 \\* heads = 4"):
        aggregate(torch.randn(2, 6), csr, "gated_sum", num_nodes=2, heads=2)


def test_max_aggregation_splits_gradient_among_ties_like_amax():
    """Discrete messages (many ties per receiver, as on minesweeper): forward and gradient equal the
    dense reference's amax (gradient split evenly among tied messages), in float64."""
    edge_index = hub_graph(directed=False)
    csr = NeighbourhoodCSR.from_edge_index(edge_index, NUM_NODES)
    gen = torch.Generator().manual_seed(4)
    messages = torch.randint(-2, 3, (csr.num_edges, 5), generator=gen).double().requires_grad_()
    weight = torch.randn(NUM_NODES, 5, dtype=torch.float64, generator=gen)
    out = aggregate(messages, csr, "max", num_nodes=NUM_NODES)
    (grad,) = torch.autograd.grad((out * weight).sum(), messages)
    dense_messages = messages.detach().clone().requires_grad_()
    want = ref.aggregate_dense(dense_messages, csr.centre, csr.receiver, NUM_NODES, "max", 1)
    (want_grad,) = torch.autograd.grad((want * weight).sum(), dense_messages)
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    torch.testing.assert_close(grad, want_grad, atol=1e-15, rtol=0)
    shared = (grad != 0) & (grad != weight.index_select(0, csr.receiver))  # a split gradient: a tie
    assert shared.any()


def test_max_aggregation_empty_and_nan_receivers():
    csr = NeighbourhoodCSR.from_edge_index(torch.tensor([[0, 1, 2], [1, 1, 0]]), 4)
    messages = torch.tensor([[1.0, -math.inf], [1.0, 2.0], [float("nan"), 3.0]], requires_grad=True)
    out = aggregate(messages, csr, "max", num_nodes=4)
    assert torch.isnan(out[0, 0]) and out[0, 1] == 3.0
    torch.testing.assert_close(out[1], torch.tensor([1.0, 2.0]))
    assert not out[2:].any()
    out[1].sum().backward()
    torch.testing.assert_close(messages.grad, torch.tensor([[0.5, 0.0], [0.5, 1.0], [0.0, 0.0]]))


@pytest.mark.parametrize("attention", ["switch", "performer", "softmax"])
def test_ntconv_under_cpu_bfloat16_autocast(attention):
    """Mixed precision: the layer's float32 projection follows q's bfloat16 under autocast."""
    edge_index = hub_graph(directed=False)
    torch.manual_seed(0)
    conv = NTConv(6, 8, attention=attention, **(dict(heads=2) if attention == "softmax" else CONV_KW))
    x = torch.randn(NUM_NODES, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = conv(x, edge_index)
    reference = conv(x, edge_index)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert (out.float() - reference).abs().max() <= 0.05 * reference.abs().max()
    out.float().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in conv.parameters() if p.grad is not None)


def test_nt_training_step_under_cpu_bfloat16_autocast():
    edge_index = hub_graph(directed=False)
    torch.manual_seed(0)
    model = NT(6, 8, 2, 3, heads=2, nb_features=4, aggr="max")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(NUM_NODES, 6), torch.arange(NUM_NODES) % 3
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x, edge_index), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
