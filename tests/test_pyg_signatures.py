"""PyG signatures (issue 44): positional construction as PyG's BasicGNN / Polynormer, forward(x, edge_index,
edge_attr=None) with every form of PyG's Adj, the modules inside PyG's wrappers (GPSConv, Sequential), the
refusal of bipartite input and to_hetero, reset_parameters() and the PyG-style repr."""
import pytest
import torch
from torch import nn
from torch_geometric import EdgeIndex
from torch_geometric.nn import GPSConv, Sequential, to_hetero

from helpers import DIRECTED_GRAPH_NODES, adj_t_forms, assert_close, directed_graph
from nt_kernels.csr import NeighbourhoodCSR
from nt_kernels.nn import NT, DirNT, NTConv, NTStar

pytestmark = pytest.mark.usefixtures("single_thread")

N, IN, HIDDEN, OUT, EDGE_DIM = DIRECTED_GRAPH_NODES, 10, 8, 5, 3
MODULES = ["NTConv", "DirNT", "NT", "NTStar"]


def features(width=IN, seed=1):
    return torch.randn(N, width, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def build(name, seed=0, dtype=torch.float64, **kwargs):
    """A small module of each kind, built after torch.manual_seed(seed) and cast to ``dtype``."""
    torch.manual_seed(seed)
    if name == "NTConv":
        return NTConv(IN, HIDDEN, heads=2, aggr="weighted_mean", **kwargs).to(dtype)
    if name == "DirNT":
        return DirNT(IN, HIDDEN, heads=2, aggr="max", **kwargs).to(dtype)
    if name == "NT":
        return NT(IN, HIDDEN, 2, OUT, heads=2, sep=True, aggr="sum", **kwargs).to(dtype)
    model = NTStar(IN, HIDDEN, OUT, 2, 1, heads=2, aggr="gated_sum", **kwargs).to(dtype)
    model.stage = "global"
    return model


# ------------------------------------------------------------------ positional construction
SHAPES = [
    pytest.param(lambda: NT(10, 64, 2), dict(hidden_channels=64, num_layers=2, out_channels=64), 64,
                 id="NT(10,64,2)-out-is-hidden"),
    pytest.param(lambda: NT(10, 64, 2, 5), dict(hidden_channels=64, num_layers=2, out_channels=5), 5,
                 id="NT(10,64,2,5)"),
    pytest.param(lambda: NT(10, 64, 0, 5), dict(hidden_channels=64, num_layers=0, out_channels=5), 5,
                 id="NT(10,64,0,5)-no-layers"),
    pytest.param(lambda: NTStar(10, 64, 5), dict(hidden_channels=64, out_channels=5, local_layers=7, global_layers=2),
                 5, id="NTStar(10,64,5)-polynormer-defaults"),
    pytest.param(lambda: NTStar(10, 64, 5, 2, 1), dict(hidden_channels=64, out_channels=5, local_layers=2,
                                                       global_layers=1), 5, id="NTStar(10,64,5,2,1)"),
]


@pytest.mark.parametrize("make,attributes,width", SHAPES)
def test_positional_construction_gives_the_pyg_shapes(make, attributes, width):
    torch.manual_seed(0)
    model = make()
    assert model.in_channels == 10
    for name, value in attributes.items():
        assert getattr(model, name) == value, name
    layers = attributes.get("num_layers", attributes.get("local_layers"))
    assert len(model.convs) == layers
    assert all((conv.in_channels, conv.out_channels) == (64, 64) for conv in model.convs)
    if isinstance(model, NTStar):
        assert len(model.global_attn) == attributes["global_layers"]
        assert model.lin_in.out_features == 64 and model.pred_local.out_features == width
    else:
        assert model.encoder[0].out_features == 64 and model.predictor[-1].out_features == width
    out = model(torch.randn(N, 10), directed_graph())
    assert out.shape == (N, width)
    if isinstance(model, NTStar):
        model.stage = "global"
        assert model(torch.randn(N, 10), directed_graph()).shape == (N, width)


KEYWORD_ONLY = [
    pytest.param(lambda: NT(10, 64, 2, 5, 2), id="NT-heads"),
    pytest.param(lambda: NTStar(10, 64, 5, 2, 1, 0.1), id="NTStar-in_dropout"),
]


@pytest.mark.parametrize("make", KEYWORD_ONLY)
def test_options_after_the_pyg_positionals_are_keyword_only(make):
    with pytest.raises(TypeError, match="positional argument"):
        make()


BAD_MODELS = [
    pytest.param(lambda: NT(10, 63, 2, heads=2), r"NT: hidden_channels \(63\) must be divisible by heads \(2\)",
                 id="NT-hidden-heads"),
    pytest.param(lambda: NT(10, 64, 2, 0), "NT: out_channels must be an int >= 1, got 0", id="NT-out_channels"),
    pytest.param(lambda: NT(10, 64, 2.0), "NT: num_layers must be an int >= 0, got 2.0", id="NT-num_layers"),
    pytest.param(lambda: NT(-1, 64, 2), "NT: in_channels must be an int >= 1, got -1", id="NT-lazy-in_channels"),
    pytest.param(lambda: NTStar(10, 64, 5, 0), "NTStar: local_layers must be an int >= 1, got 0",
                 id="NTStar-local_layers"),
    pytest.param(lambda: NTStar(10, 64, 5, 2, -1), "NTStar: global_layers must be an int >= 0, got -1",
                 id="NTStar-global_layers"),
    pytest.param(lambda: NTStar(10, 64, None), "NTStar: out_channels must be an int >= 1, got None",
                 id="NTStar-out_channels"),
]


@pytest.mark.parametrize("make,message", BAD_MODELS)
def test_bad_model_arguments_name_themselves(make, message):
    with pytest.raises(ValueError, match=message):
        make()


# ------------------------------------------------------------------ forward(x, edge_index, edge_attr=None)
@pytest.mark.parametrize("name", MODULES)
def test_edge_index_and_edge_attr_by_keyword(name):
    model = build(name, edge_dim=EDGE_DIM).eval()
    x, edge_index = features(), directed_graph()
    edge_attr = torch.randn(edge_index.shape[1], EDGE_DIM, dtype=torch.float64,
                            generator=torch.Generator().manual_seed(2))
    want = model(x, edge_index, edge_attr)
    assert_close(model(x, edge_index=edge_index, edge_attr=edge_attr), want)
    assert_close(model(x=x, edge_index=edge_index, edge_attr=edge_attr), want)
    csr = model.prepare(edge_index=edge_index, num_nodes=N)
    assert_close(model(x, edge_index=csr, edge_attr=edge_attr), want)
    # The edge features reach the output.
    assert (model(x, edge_index, edge_attr + 1) - want).abs().max() > 1e-6


def adj_forms(edge_index):
    """Every form of PyG's Adj (and our NeighbourhoodCSR) of ``edge_index``, by name."""
    forms = {name: adj for name, (adj, _) in adj_t_forms(edge_index, N).items()}
    forms["edge_index-int32"] = edge_index.int()
    forms["EdgeIndex"] = EdgeIndex(edge_index, sparse_size=(N, N))
    forms["NeighbourhoodCSR"] = NeighbourhoodCSR.from_edge_index(edge_index, N)
    return forms


ADJ_FORMS = ["coo", "csr", "csc", "coo-uncoalesced", "SparseTensor", "edge_index-int32", "EdgeIndex",
             "NeighbourhoodCSR"]


@pytest.mark.parametrize("form", ADJ_FORMS)
@pytest.mark.parametrize("name", MODULES)
def test_every_adj_form_gives_the_edge_index_output(name, form):
    edge_index = directed_graph()
    forms = adj_forms(edge_index)
    if form not in forms:
        pytest.skip("torch_sparse is not installed")
    model = build(name).eval()
    x = features()
    want = model(x, edge_index)
    assert_close(model(x, edge_index=forms[form]), want)
    # On this directed graph the transposed reading gives another output, so the comparison has teeth.
    assert (model(x, edge_index.flip(0)) - want).abs().max() > 1e-3


# ------------------------------------------------------------------ PyG's wrappers
@pytest.mark.parametrize("attn_type", ["multihead", "performer"])
@pytest.mark.parametrize("conv_name", ["NTConv", "DirNT"])
def test_inside_gpsconv(conv_name, attn_type):
    torch.manual_seed(0)
    cls = NTConv if conv_name == "NTConv" else DirNT
    gps = GPSConv(HIDDEN, conv=cls(HIDDEN, HIDDEN, heads=2, aggr="sum"), heads=2, attn_type=attn_type).double()
    x, edge_index = features(HIDDEN), directed_graph()
    seen = []
    gps.conv.register_forward_hook(lambda module, args, out: seen.append((args, out)))
    out = gps(x, edge_index)
    assert out.shape == (N, HIDDEN) and torch.isfinite(out).all()
    (args, conv_out), = seen
    assert args[1] is edge_index
    assert_close(conv_out, gps.conv(x, edge_index))                 # GPSConv's local part is our layer's output
    out.square().sum().backward()
    grads = [param.grad for name, param in gps.named_parameters() if name.startswith("conv.")]
    assert grads and all(grad is not None and grad.abs().sum() > 0 for grad in grads)
    gps.eval()
    want = gps(x, edge_index)
    assert_close(gps(x, EdgeIndex(edge_index, sparse_size=(N, N))), want)
    # GPSConv.reset_parameters() resets the NT layer too.
    before = {name: value.clone() for name, value in gps.conv.state_dict().items()}
    gps.reset_parameters()
    assert all(not torch.equal(value, before[name]) for name, value in gps.conv.state_dict().items())


def test_inside_pyg_sequential():
    torch.manual_seed(0)
    conv, dirnt, nt = NTConv(IN, HIDDEN, heads=2, aggr="sum"), DirNT(HIDDEN, HIDDEN, heads=2), NT(HIDDEN, 4, 1, OUT)
    model = Sequential("x, edge_index", [
        (conv, "x, edge_index -> x"),
        nn.ReLU(),
        (dirnt, "x, edge_index -> x"),
        (nt, "x, edge_index -> x"),
    ]).double()
    x, edge_index = features(), directed_graph()
    out = model(x, edge_index)
    assert out.shape == (N, OUT)
    assert_close(out, nt(dirnt(torch.relu(conv(x, edge_index)), edge_index), edge_index))
    with_edges = Sequential("x, edge_index, edge_attr", [
        (NTConv(IN, HIDDEN, edge_dim=EDGE_DIM), "x, edge_index, edge_attr -> x"),
    ]).double()
    edge_attr = torch.randn(edge_index.shape[1], EDGE_DIM, dtype=torch.float64)
    assert_close(with_edges(x, edge_index, edge_attr), with_edges[0](x, edge_index, edge_attr))
    before = [param.clone() for param in model.parameters()]
    model.reset_parameters()
    assert all(not torch.equal(param, old) for param, old in zip(model.parameters(), before) if param.dim() == 2)


# ------------------------------------------------------------------ bipartite input and to_hetero: refused
BIPARTITE = "NT layers do not support bipartite input \\(x_source, x_target\\)"
METADATA = (["paper", "author"], [("paper", "cites", "paper"), ("author", "writes", "paper"),
                                  ("paper", "written_by", "author")])


@pytest.mark.parametrize("name", MODULES)
def test_to_hetero_of_an_nt_module_is_refused(name):
    model = build(name)
    with pytest.raises(ValueError, match=f"{name}: x is a torch.fx Proxy, but NT modules cannot be traced "
                                         f"symbolically .*to_hetero.*; {BIPARTITE}"):
        to_hetero(model, METADATA)


class TwoLayers(nn.Module):
    """A user model with NT layers as children, the way to_hetero's documentation writes its models."""

    def __init__(self, conv_cls):
        super().__init__()
        self.conv1 = conv_cls(IN, HIDDEN, heads=2)
        self.conv2 = conv_cls(HIDDEN, HIDDEN, heads=2)

    def forward(self, x, edge_index):
        return self.conv2(self.conv1(x, edge_index).relu(), edge_index)


@pytest.mark.parametrize("conv_name", ["NTConv", "DirNT"])
def test_to_hetero_model_with_nt_layers_is_refused_on_bipartite_edges(conv_name):
    torch.manual_seed(0)
    model = TwoLayers(NTConv if conv_name == "NTConv" else DirNT).double()
    x = features()
    edge_index = directed_graph()
    assert model(x, edge_index).shape == (N, HIDDEN)                  # homogeneous: fine
    hetero = to_hetero(model, METADATA)
    x_dict = {"paper": x, "author": features(seed=2)[:6]}
    edge_index_dict = {("paper", "cites", "paper"): edge_index,
                       ("author", "writes", "paper"): torch.tensor([[0, 1, 5], [2, 3, 4]]),
                       ("paper", "written_by", "author"): torch.tensor([[2, 3, 4], [0, 1, 5]])}
    with pytest.raises(ValueError, match=rf"{conv_name}: x must be one \(N, in_channels={IN}\) tensor, got a tuple; "
                                         rf"{BIPARTITE}, so they cannot run on the edge types between two node types"):
        hetero(x_dict, edge_index_dict)


@pytest.mark.parametrize("name", MODULES)
def test_tuple_x_is_refused(name):
    model = build(name)
    x = features()
    with pytest.raises(ValueError, match=rf"{name}: x must be one \(N, in_channels={IN}\) tensor, got a tuple; "
                                         rf"{BIPARTITE}"):
        model((x, x[:5]), directed_graph())


BIPARTITE_CHANNELS = [
    pytest.param(lambda: NTConv((IN, 6), HIDDEN), "NTConv", id="NTConv"),
    pytest.param(lambda: DirNT((IN, 6), HIDDEN), "DirNT", id="DirNT"),
    pytest.param(lambda: NT((IN, 6), HIDDEN, 2), "NT", id="NT"),
    pytest.param(lambda: NTStar((IN, 6), HIDDEN, OUT), "NTStar", id="NTStar"),
]


@pytest.mark.parametrize("make,owner", BIPARTITE_CHANNELS)
def test_bipartite_in_channels_are_refused(make, owner):
    with pytest.raises(ValueError, match=rf"{owner}: in_channels must be an int, got \({IN}, 6\); {BIPARTITE}"):
        make()


# ------------------------------------------------------------------ reset_parameters()
@pytest.mark.parametrize("name", MODULES)
def test_reset_parameters_follows_the_seed(name):
    # In the default dtype: a reset draws in the parameters' dtype, and float64 draws differ from float32 ones.
    model = build(name, seed=0, dtype=torch.float32, edge_dim=EDGE_DIM)
    first = {key: value.clone() for key, value in model.state_dict().items()}
    other = build(name, seed=1, dtype=torch.float32, edge_dim=EDGE_DIM).state_dict()
    random = {key for key in first if not torch.equal(first[key], other[key])}
    # Every weight matrix and every Performer projection is drawn (LayerNorms and the learned betas are not).
    drawn = {key for key, value in first.items() if value.dim() == 2 and key != "betas"}
    assert drawn and drawn <= random
    torch.manual_seed(1)
    model.reset_parameters()
    for key, value in model.state_dict().items():
        assert torch.equal(value, other[key]), key          # a reset under seed 1 is the model built under seed 1
        if key in random:
            assert not torch.equal(value, first[key]), key
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)                                  # every parameter away from its initial value
    torch.manual_seed(0)
    model.reset_parameters()
    for key, value in model.state_dict().items():
        assert torch.equal(value, first[key]), key          # the same seed reproduces the first initialisation


# ------------------------------------------------------------------ PyG-style repr
REPRS = [
    pytest.param(lambda: NTConv(30, 30, heads=2, aggr="gated_sum"), "NTConv(30, 30, heads=2, aggr=gated_sum)",
                 id="NTConv-issue-example"),
    pytest.param(lambda: NTConv(16, 32), "NTConv(16, 32, heads=1, aggr=weighted_mean)", id="NTConv-defaults"),
    pytest.param(lambda: NTConv(16, 32, heads=4, edge_dim=3, aggr="weighted_mean", dropout=0.1, attention="performer",
                                nb_features=7, gate_group="centre", backend="reference", fused=False),
                 "NTConv(16, 32, heads=4, aggr=weighted_mean, edge_dim=3, dropout=0.1, attention=performer, "
                 "nb_features=7, gate_group=centre, backend=reference, fused=False)", id="NTConv-every-option"),
    pytest.param(lambda: NTConv(16, 32, heads=4, attention="softmax"),
                 "NTConv(16, 32, heads=4, aggr=weighted_mean, attention=softmax)", id="NTConv-softmax"),
    pytest.param(lambda: NTConv(16, 32, heads=4, threshold=12.5), "NTConv(16, 32, heads=4, aggr=weighted_mean, "
                 "threshold=12.5)", id="NTConv-threshold"),
    pytest.param(lambda: DirNT(30, 30, heads=2, aggr="max", fused=True), "DirNT(30, 30, heads=2, aggr=max, fused=True)",
                 id="DirNT"),
    pytest.param(lambda: NT(10, 64, 2), "NT(10, 64, num_layers=2, heads=1, aggr=weighted_mean)", id="NT-defaults"),
    pytest.param(lambda: NT(10, 64, 2, 5, heads=2, dropout=0.2, directed=True, sep=True, aggr="sum"),
                 "NT(10, 64, num_layers=2, out_channels=5, heads=2, dropout=0.2, directed=True, sep=True, aggr=sum)",
                 id="NT-options"),
    pytest.param(lambda: NT(10, 64, 0, 5), "NT(10, 64, num_layers=0, out_channels=5, heads=1)", id="NT-no-layers"),
    pytest.param(lambda: NTStar(10, 64, 5), "NTStar(10, 64, 5, local_layers=7, global_layers=2, heads=1, "
                 "beta=learned, stage=local, aggr=weighted_mean)", id="NTStar-defaults"),
    pytest.param(lambda: NTStar(10, 64, 5, 2, 1, in_dropout=0.1, dropout=0.2, global_dropout=0.3, heads=2, beta=0.4,
                                global_beta=0.6, directed=True, aggr="gated_sum"),
                 "NTStar(10, 64, 5, local_layers=2, global_layers=1, in_dropout=0.1, dropout=0.2, global_dropout=0.3, "
                 "heads=2, beta=0.4, global_beta=0.6, directed=True, stage=local, aggr=gated_sum)", id="NTStar-options"),
    pytest.param(lambda: GPSConv(32, conv=NTConv(32, 32, heads=4, aggr="sum"), heads=4),
                 "GPSConv(32, conv=NTConv(32, 32, heads=4, aggr=sum), heads=4, attn_type=multihead)",
                 id="inside-GPSConv"),
]


@pytest.mark.parametrize("make,text", REPRS)
def test_repr_in_pyg_style(make, text):
    assert repr(make()) == text
