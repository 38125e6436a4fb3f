"""PyG interoperability: sparse adjacency inputs (PyG's adj_t, row = receiver) and NT layers inside GPSConv."""
import pytest
import torch
from torch_geometric.nn import GPSConv
from torch_geometric.utils import to_torch_csr_tensor

from helpers import DIRECTED_GRAPH_NODES, adj_t_forms, assert_close, directed_graph
from nt_kernels.nn import NT, DirNT, NTConv, NTStar
from nt_kernels.nn.adjacency import adjacency_edge_index

pytestmark = pytest.mark.usefixtures("single_thread")

NUM_NODES, IN, HIDDEN, EDGE_DIM = DIRECTED_GRAPH_NODES, 5, 8, 3


FORMS = ["coo", "csr", "csc", "coo-uncoalesced", "SparseTensor"]


def build(name, **kwargs):
    torch.manual_seed(0)
    if name == "NTConv":
        return NTConv(IN, HIDDEN, heads=2, aggr="weighted_mean", **kwargs)
    if name == "DirNT":
        return DirNT(IN, HIDDEN, heads=2, aggr="max", **kwargs)
    if name == "NT":
        return NT(IN, HIDDEN, 2, 3, heads=2, sep=True, aggr="sum", **kwargs)
    model = NTStar(IN, HIDDEN, 3, 2, 1, heads=2, aggr="gated_sum", **kwargs)
    model.stage = "global"
    return model


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("module", ["NTConv", "DirNT", "NT", "NTStar"])
def test_every_adjacency_form_equals_edge_index(module, form):
    edge_index = directed_graph()
    forms = adj_t_forms(edge_index, NUM_NODES)
    if form not in forms:
        pytest.skip("torch_sparse is not installed")
    adj, _ = forms[form]
    model = build(module).double().eval()
    x = torch.randn(NUM_NODES, IN, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = model(x, edge_index)
    assert_close(model(x, adj), want)
    assert_close(model(x, model.prepare(adj, NUM_NODES)), want)
    # The convention matters on a directed graph: reading the adjacency untransposed gives another output.
    assert (model(x, edge_index.flip(0)) - want).abs().max() > 1e-3


@pytest.mark.parametrize("form", FORMS)
def test_edge_attr_follows_the_adjacency_order(form):
    edge_index = directed_graph()
    forms = adj_t_forms(edge_index, NUM_NODES)
    if form not in forms:
        pytest.skip("torch_sparse is not installed")
    adj, order = forms[form]
    torch.testing.assert_close(adjacency_edge_index("test", adj, NUM_NODES), edge_index[:, order], rtol=0, atol=0)
    model = build("NTConv", edge_dim=EDGE_DIM).double()
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(NUM_NODES, IN, dtype=torch.float64, generator=gen)
    edge_attr = torch.randn(edge_index.shape[1], EDGE_DIM, dtype=torch.float64, generator=gen)
    assert_close(model(x, adj, edge_attr[order]), model(x, edge_index, edge_attr))


def sparse(size, indices=((0, 1), (1, 0))):
    index = torch.tensor(indices)
    return torch.sparse_coo_tensor(index, torch.ones(index.shape[1]), size)


@pytest.mark.parametrize("module", ["NTConv", "DirNT", "NT", "NTStar"])
def test_bad_adjacency_is_rejected_naming_the_argument(module):
    model = build(module)
    x = torch.randn(NUM_NODES, IN)
    with pytest.raises(ValueError, match=rf"{module}: edge_index must be a square adjacency .* got size 24 x 25"):
        model(x, sparse((NUM_NODES, NUM_NODES + 1)))
    with pytest.raises(ValueError, match=rf"{module}: edge_index is a 25 x 25 adjacency but x has 24 rows"):
        model(x, sparse((NUM_NODES + 1, NUM_NODES + 1)))
    with pytest.raises(ValueError, match=rf"{module}: edge_index must be a 2-D sparse adjacency"):
        model(x, torch.sparse_coo_tensor(torch.zeros(3, 1, dtype=torch.long), torch.ones(1), (NUM_NODES,) * 3))
    with pytest.raises(ValueError, match=rf"{module}.prepare: edge_index is a 25 x 25 adjacency but x has 24 rows"):
        model.prepare(sparse((NUM_NODES + 1, NUM_NODES + 1)), NUM_NODES)


def gps_inputs():
    edge_index = directed_graph()
    edge_index = torch.cat([edge_index, edge_index.flip(0)], dim=1)
    x = torch.randn(NUM_NODES, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    return x, edge_index


@pytest.mark.parametrize("attn_type", ["multihead", "performer"])
@pytest.mark.parametrize("conv_cls", [NTConv, DirNT], ids=["NTConv", "DirNT"])
def test_gpsconv_with_an_nt_layer(conv_cls, attn_type):
    torch.manual_seed(0)
    gps = GPSConv(HIDDEN, conv_cls(HIDDEN, HIDDEN, heads=2, aggr="sum"), heads=2, attn_type=attn_type).double()
    x, edge_index = gps_inputs()
    out = gps(x, edge_index)                                   # training mode: dropout 0, batch statistics
    out.square().sum().backward()
    assert out.shape == (NUM_NODES, HIDDEN) and torch.isfinite(out).all()
    for name, param in gps.named_parameters():
        if name.startswith("conv.") or name.startswith("attn."):
            assert param.grad is not None and torch.isfinite(param.grad).all(), name
    nt_grads = [p.grad.abs().sum() for n, p in gps.named_parameters() if n.startswith("conv.")]
    assert min(nt_grads) > 0
    gps.eval()
    want = gps(x, edge_index)
    # GPSConv hands the adjacency through to the NT layer; PyG's adj_t gives the same output.
    assert_close(gps(x, to_torch_csr_tensor(edge_index.flip(0), size=(NUM_NODES, NUM_NODES))), want)
    # The NT layer inside GPSConv computes what the reference composition computes...
    gps.conv.backend, gps.conv.fused = "reference", False
    assert_close(gps(x, edge_index), want)
    # ...and its output reaches GPSConv's output.
    for lin in ([gps.conv.lin_out] if conv_cls is NTConv else [gps.conv.conv.lin_out, gps.conv.conv_reversed.lin_out]):
        torch.nn.init.zeros_(lin.weight)
        torch.nn.init.zeros_(lin.bias)
    assert (gps(x, edge_index) - want).abs().max() > 1e-3
