"""NTConv / DirNT / NT on the fused layer op (issue 13): ``fused=True`` vs ``fused=False``.

``fused=False`` is the composition of nt_kernels ops (the comparison point);
both must agree in float64 for the output and every parameter and input
gradient.  ``fused=None`` (the default) must pick the path measured faster per
device type (the fused op on CPU, the composition on CUDA), ``fused=True`` must
run the fused op wherever a kernel exists and fail loudly where none does.
"""
import inspect
import math

import pytest
import torch

import nt_reference.nn as ref
from helpers import assert_close
from nt_kernels.csr import NeighbourhoodCSR
from nt_kernels.backends import has_fused_kernel
from nt_kernels.nn import NT, DirNT, NTConv
from nt_kernels.nn.conv import FUSED_FASTER, fused_by_default

IN, OUT, HEADS, EDGE_DIM, NB_FEATURES = 6, 8, 2, 3, 4  # D = 4, n* = 4 + sqrt(32) ~ 9.66

AGGRS = [
    pytest.param("sum", "receiver", id="sum"),
    pytest.param("mean", "receiver", id="mean"),
    pytest.param("max", "receiver", id="max"),
    pytest.param("weighted_mean", "receiver", id="weighted_mean-receiver"),
    pytest.param("weighted_mean", "centre", id="weighted_mean-centre"),
    pytest.param("gated_sum", "receiver", id="gated_sum"),
]
ATTENTIONS = {"softmax": dict(attention="softmax"),
              "performer": dict(attention="performer", nb_features=NB_FEATURES),
              "switch": dict(attention="switch", nb_features=NB_FEATURES),
              "switch-t5": dict(attention="switch", nb_features=NB_FEATURES, threshold=5)}
EDGE_ATTR = [pytest.param(None, id="no-edge-attr"), pytest.param(EDGE_DIM, id="edge-attr")]


def graph_from_sizes(sizes, receivers, seed=0):
    """Centre j sends sizes[j] edges to distinct nodes of ``receivers`` (repeats only when
    sizes[j] > len(receivers)); columns shuffled."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.tensor(receivers)
    parts = []
    for j, size in enumerate(sizes):
        if size <= len(receivers):
            picked = pool[torch.randperm(len(receivers), generator=gen)[:size]]
        else:
            picked = pool[torch.randint(len(receivers), (size,), generator=gen)]
        parts.append(torch.stack([torch.full_like(picked, j), picked]))
    edge_index = torch.cat(parts, dim=1)
    return edge_index[:, torch.randperm(edge_index.shape[1], generator=gen)]


# Sizes 4, 5, 6 around threshold 5 and 9, 10 around n*; centres 0, 9, 14, 15 send nothing,
# nodes 14..17 receive nothing, several one-row neighbourhoods.
GRAPHS = {
    "mixed": lambda: (graph_from_sizes([0, 1, 1, 2, 4, 5, 6, 9, 10, 0, 3, 2, 1, 7, 0, 0, 3, 1], list(range(14))),
                      18),
    "hub-3000": lambda: (graph_from_sizes([3000, 1, 2, 5, 0, 3, 1, 0], list(range(7)), seed=1), 8),
}


def features(num_nodes, num_edges, edge_dim, dtype=torch.float64, seed=3):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_nodes, IN, generator=gen, dtype=torch.float64).to(dtype)
    edge_attr = None if edge_dim is None else torch.randn(num_edges, edge_dim, generator=gen,
                                                          dtype=torch.float64).to(dtype)
    return x, edge_attr


def make_pair(cls, *args, **kwargs):
    """(fused=True, fused=False) modules with the same weights, float64."""
    torch.manual_seed(0)
    fused = cls(*args, fused=True, **kwargs).double()
    composed = cls(*args, fused=False, **kwargs).double()
    composed.load_state_dict(fused.state_dict())
    return fused, composed


def run(module, x, graph, edge_attr):
    """Output and the gradients of <output, g> w.r.t. every parameter, x and edge_attr, by name."""
    x = x.detach().clone().requires_grad_()
    edge_attr = None if edge_attr is None else edge_attr.detach().clone().requires_grad_()
    module.zero_grad()
    out = module(x, graph, edge_attr)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(out.dtype)
    out.backward(g)
    grads = {name: p.grad for name, p in module.named_parameters()}
    grads["x"] = x.grad
    if edge_attr is not None:
        grads["edge_attr"] = edge_attr.grad
    return out.detach(), grads


def check(got, want, name):
    """float64 ``got`` vs ``want`` with the project's tolerance (tests/helpers.py: 1e-10), finite."""
    assert got is not None and want is not None, f"{name}: missing gradient"
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.isfinite(got).all() and torch.isfinite(want).all(), f"{name}: non-finite values"
    assert_close(got, want, msg=name)


def assert_same_run(fused, composed, x, graph, edge_attr=None):
    out_f, grads_f = run(fused, x, graph, edge_attr)
    out_c, grads_c = run(composed, x, graph, edge_attr)
    check(out_f, out_c, "output")
    assert grads_f.keys() == grads_c.keys()
    for name in grads_c:
        check(grads_f[name], grads_c[name], f"gradient of {name}")


def ran_fused_op(fn) -> bool:
    """Whether ``fn()`` dispatched nt_kernels::ntconv_fwd."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return any(event.name == "nt_kernels::ntconv_fwd" for event in prof.events())


# ----------------------------------------------------- fused vs fused=False
@pytest.mark.parametrize("attention", list(ATTENTIONS))
@pytest.mark.parametrize("edge_dim", EDGE_ATTR)
@pytest.mark.parametrize("aggr, gate_group", AGGRS)
def test_ntconv_fused_matches_composition(aggr, gate_group, edge_dim, attention):
    edge_index, n = GRAPHS["mixed"]()
    fused, composed = make_pair(NTConv, IN, OUT, heads=HEADS, edge_dim=edge_dim, aggr=aggr, gate_group=gate_group,
                                **ATTENTIONS[attention])
    x, edge_attr = features(n, edge_index.shape[1], edge_dim)
    assert_same_run(fused, composed, x, edge_index, edge_attr)


@pytest.mark.parametrize("attention", ["switch", "softmax"])
@pytest.mark.parametrize("aggr, gate_group", AGGRS)
def test_ntconv_fused_matches_composition_on_3000_row_hub(aggr, gate_group, attention):
    edge_index, n = GRAPHS["hub-3000"]()
    fused, composed = make_pair(NTConv, IN, OUT, heads=HEADS, edge_dim=EDGE_DIM, aggr=aggr, gate_group=gate_group,
                                **ATTENTIONS[attention])
    x, edge_attr = features(n, edge_index.shape[1], EDGE_DIM)
    assert_same_run(fused, composed, x, edge_index, edge_attr)


@pytest.mark.parametrize("edge_dim", EDGE_ATTR)
@pytest.mark.parametrize("aggr, gate_group", AGGRS)
def test_dirnt_fused_matches_composition(aggr, gate_group, edge_dim):
    edge_index, n = GRAPHS["mixed"]()
    fused, composed = make_pair(DirNT, IN, OUT, heads=HEADS, edge_dim=edge_dim, aggr=aggr, gate_group=gate_group,
                                nb_features=NB_FEATURES)
    x, edge_attr = features(n, edge_index.shape[1], edge_dim)
    assert_same_run(fused, composed, x, edge_index, edge_attr)


@pytest.mark.parametrize("sep", [False, True], ids=["plain", "sep"])
@pytest.mark.parametrize("directed", [False, True], ids=["NT", "DirNT"])
def test_nt_model_fused_matches_composition_in_eval(directed, sep):
    edge_index, n = GRAPHS["mixed"]()
    fused, composed = make_pair(NT, IN, OUT, 2, 3, heads=HEADS, dropout=0.2, directed=directed, sep=sep,
                                nb_features=NB_FEATURES, aggr="weighted_mean")
    x, _ = features(n, edge_index.shape[1], None)
    assert_same_run(fused.eval(), composed.eval(), x, edge_index)


@pytest.mark.parametrize("attention", ["softmax", "switch-t5"])
def test_max_ties_match_the_reference_layer(attention):
    """With half of W_out's rows zero, every message ties in those channels at each receiver;
    the gradient is split evenly among ties (torch.amax), as in nt_reference.nn.NTConv."""
    edge_index, n = GRAPHS["mixed"]()
    kwargs = dict(heads=HEADS, aggr="max", **ATTENTIONS[attention])
    torch.manual_seed(0)
    fused = NTConv(IN, OUT, fused=True, **kwargs).double()
    with torch.no_grad():
        fused.lin_out.weight[::2] = 0.0
    reference = ref.NTConv(IN, OUT, **kwargs).double()
    reference.load_state_dict(fused.state_dict())
    x, _ = features(n, edge_index.shape[1], None)
    assert_same_run(fused, reference, x, edge_index)


# ------------------------------------------------------- choosing the path
def test_fused_none_picks_the_fused_op_on_cpu():
    edge_index, n = GRAPHS["mixed"]()
    x, _ = features(n, edge_index.shape[1], None, dtype=torch.float32)
    default = NTConv(IN, OUT, heads=HEADS, nb_features=NB_FEATURES)
    assert inspect.signature(NTConv.__init__).parameters["fused"].default is None
    assert ran_fused_op(lambda: default(x, edge_index))
    assert ran_fused_op(lambda: NTConv(IN, OUT, heads=HEADS, fused=True)(x, edge_index))
    assert not ran_fused_op(lambda: NTConv(IN, OUT, heads=HEADS, fused=False)(x, edge_index))
    model = NT(IN, OUT, 2, 3, heads=HEADS, nb_features=NB_FEATURES, directed=True)
    assert ran_fused_op(lambda: model(x, edge_index))


def test_fused_default_rule_per_device_type():
    """The rule of docs/nn.md ("Fused layer"): fused=None runs the path measured faster on the device
    type: the fused op on CPU, the composition on CUDA (asked of the rule, no GPU needed) and on device
    types without a measurement; fused=True still runs the fused op on CUDA where its kernel exists."""
    assert FUSED_FASTER == {"cpu": True, "cuda": False}
    assert has_fused_kernel("cpu") and fused_by_default("cpu") is True
    assert fused_by_default("cuda") is False
    assert fused_by_default("meta") is False and fused_by_default("xpu") is False
    default = NTConv(IN, OUT, heads=HEADS, nb_features=NB_FEATURES)
    assert default.uses_fused(torch.device("cpu")) and not default.uses_fused(torch.device("cuda"))
    model = NT(IN, OUT, 2, 3, heads=HEADS, nb_features=NB_FEATURES, directed=True)
    assert not any(conv.uses_fused(torch.device("cuda")) for conv in model.modules() if isinstance(conv, NTConv))
    forced = NTConv(IN, OUT, heads=HEADS, nb_features=NB_FEATURES, fused=True)
    if has_fused_kernel("cuda"):  # registered when triton imports (nt_kernels.backends.register_backends)
        assert forced.uses_fused(torch.device("cuda"))
    else:
        with pytest.raises(ValueError, match="fused=True"):
            forced.uses_fused(torch.device("cuda"))


def test_fused_true_without_a_kernel_is_an_error():
    """Meta tensors have no fused kernel: fused=True must refuse, never fall back silently."""
    edge_index, n = GRAPHS["mixed"]()
    csr = NeighbourhoodCSR.from_edge_index(edge_index, n).to("meta")
    conv = NTConv(IN, OUT, heads=HEADS, nb_features=NB_FEATURES, fused=True).to("meta")
    x = torch.empty(n, IN, device="meta")
    with pytest.raises((ValueError, RuntimeError, NotImplementedError), match="fused"):
        conv(x, csr)


@pytest.mark.parametrize("value", ["yes", "cpu"])
def test_fused_must_be_a_bool_or_none(value):
    with pytest.raises((ValueError, TypeError), match="fused"):
        NTConv(IN, OUT, fused=value)


# ------------------------------------------------------- compile, autocast
def test_compile_fullgraph_nt_fused_on_prebuilt_csr():
    edge_index, n = GRAPHS["mixed"]()
    torch.manual_seed(0)
    model = NT(IN, OUT, 2, 3, heads=HEADS, nb_features=NB_FEATURES, aggr="gated_sum", edge_dim=EDGE_DIM,
               fused=True).double().eval()
    csr = model.prepare(edge_index, n)
    x, edge_attr = features(n, edge_index.shape[1], EDGE_DIM)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out_c, out_e = compiled(x, csr, edge_attr), model(x, csr, edge_attr)
    check(out_c, out_e, "output")
    params = list(model.parameters())
    for (name, _), grad_c, grad_e in zip(model.named_parameters(),
                                         torch.autograd.grad(out_c.square().sum(), params),
                                         torch.autograd.grad(out_e.square().sum(), params)):
        check(grad_c, grad_e, f"gradient of {name}")


def test_compile_fullgraph_nt_fused_training_with_dropout():
    """Training mode draws a dropout seed per call; the compiled graph still has no break."""
    edge_index, n = GRAPHS["mixed"]()
    torch.manual_seed(0)
    model = NT(IN, OUT, 2, 3, heads=HEADS, nb_features=NB_FEATURES, dropout=0.1, fused=True).train()
    for conv in model.convs:
        conv.dropout = 0.2
    csr = model.prepare(edge_index, n)
    x, _ = features(n, edge_index.shape[1], None, dtype=torch.float32)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(x, csr)
    out.square().sum().backward()
    assert torch.isfinite(out).all()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_dropout_training_is_reproducible_under_the_global_seed():
    edge_index, n = GRAPHS["mixed"]()
    x, _ = features(n, edge_index.shape[1], None)
    torch.manual_seed(0)
    conv = NTConv(IN, OUT, heads=HEADS, nb_features=NB_FEATURES, dropout=0.3, fused=True).double().train()
    runs = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        runs.append(run(conv, x, edge_index, None))
    (out_a, grads_a), (out_b, grads_b), (out_c, _) = runs
    assert torch.equal(out_a, out_b) and all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a)
    assert not torch.equal(out_a, out_c)


def test_nt_training_step_under_bf16_autocast():
    edge_index, n = GRAPHS["mixed"]()
    torch.manual_seed(0)
    model = NT(IN, OUT, 2, 3, heads=HEADS, nb_features=NB_FEATURES, dropout=0.1, aggr="weighted_mean",
               edge_dim=EDGE_DIM, fused=True).train()
    for conv in model.convs:
        conv.dropout = 0.1
    optimiser = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, edge_attr = features(n, edge_index.shape[1], EDGE_DIM, dtype=torch.float32)
    target = torch.randint(0, 3, (n,), generator=torch.Generator().manual_seed(4))
    before = [p.detach().clone() for p in model.parameters()]

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x, edge_index, edge_attr).float(), target)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        return loss

    assert ran_fused_op(lambda: step())
    loss = step()
    assert math.isfinite(loss.item())
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("dropout, capturing, device", [(0.2, True, "cuda"), (0.2, False, "cuda"),
                                                      (0.2, True, "cpu"), (0.0, True, "cuda")],
                         ids=["capturing-cuda", "eager-cuda", "cpu", "no-dropout"])
def test_fused_dropout_seed_is_drawn_on_the_device_only_in_a_capture(dropout, capturing, device, monkeypatch):
    """Inside a CUDA graph capture the fused op's dropout seed comes from the device's generator (a host value
    would be replayed as captured); elsewhere from the global CPU generator (torch.manual_seed reproduces it).
    torch.cuda.is_current_stream_capturing and torch.randint stand in for a capture and the draw."""
    from nt_kernels.nn import conv as conv_module

    draws = []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    monkeypatch.setattr(torch, "randint", lambda high, size, dtype, device=None: draws.append(device) or
                        torch.zeros((), dtype=dtype))
    seed = conv_module._draw_seed(dropout, torch.device(device))
    if dropout == 0:
        assert seed is None and draws == []
    else:
        assert draws == [torch.device("cuda") if capturing and device == "cuda" else None]
