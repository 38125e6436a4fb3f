"""Nothing in a warm training step reads the host (DESIGN §11, docs/design.md §10 and §11; issue 41).

:class:`nt_kernels.train.HostReads` refuses every op that would read a device
value on the host: ``aten::_local_scalar_dense`` (``.item()``, ``int()``,
``float()``, ``bool()``), ``.tolist()``, ``.numpy()``, ops whose output shape
depends on values (``nonzero``, ``unique``, ...), boolean-mask indexing and
``torch.equal``.  On the CPU every tensor counts as the device's, so the
whole step of ``nt-kernels train`` -- the training step (forward, loss,
backward, Adam as it runs on CUDA: fused and capturable), the evaluation
forward and both scores -- runs under it here, for NT (fused and composition),
DirNT and NT*'s local stage (also with their node-level blocks checkpointed),
two-class (ROC-AUC) and multi-class (accuracy) labels, float32 and bf16
autocast.  The one host read of an epoch
(:func:`nt_kernels.apps.fullbatch.read_epoch`) comes after it.  What this
cannot see: syncs inside a kernel's own implementation (a CUDA library
copying a count back); the GPU run's ``torch.cuda.set_sync_debug_mode`` check
(scripts/gpu/gpu_step_checks.py) covers those.
"""
import pytest
import torch

from nt_kernels.apps.fullbatch import FullBatch, read_epoch
from nt_kernels.data.datasets import monophily_graph
from nt_kernels.nn import NT, NTStar
from nt_kernels.train import HostReadError, HostReads, roc_auc_tensor, score_tensor

pytestmark = pytest.mark.usefixtures("single_thread")

X = torch.randn(12)
MASK = X > 0


@pytest.mark.parametrize("read, message", [
    (lambda: X.sum().item(), r"reads a device value on the host \(\.item\(\), int\(\), float\(\) or bool\(\)"),
    (lambda: int(X.argmax()), r"aten::_local_scalar_dense"),
    (lambda: bool(X.sum() > 0), r"aten::_local_scalar_dense"),
    (lambda: X.tolist(), r"reads a device tensor on the host \(\.tolist\(\)\)"),
    (lambda: X.numpy(), r"reads a device tensor on the host \(\.numpy\(\)\)"),
    (lambda: X.nonzero(), r"runs aten::nonzero, whose output shape depends on the values"),
    (lambda: torch.unique(X), r"runs aten::_unique2, whose output shape depends on the values"),
    (lambda: X[MASK], r"indexes with a boolean mask \(aten::index"),
    (lambda: X.clone().__setitem__(MASK, 0.0), r"indexes with a boolean mask \(aten::index_put_"),
    (lambda: torch.equal(X, X), r"reads a device value on the host \(aten::equal's result is a host value\)"),
    (lambda: torch.repeat_interleave(torch.tensor([1, 2])), r"runs aten::repeat_interleave"),
], ids=["item", "int", "bool", "tolist", "numpy", "nonzero", "unique", "mask-index", "mask-setitem",
        "equal", "repeat-interleave"])
def test_every_host_read_is_refused_with_its_line(read, message):
    with pytest.raises(HostReadError, match=r"^step: .*" + message + r".*, at .*test_host_reads\.py:\d+"):
        with HostReads("cpu"):
            read()
    assert torch.Tensor.tolist is not None and X.tolist()  # the patched methods are restored


@pytest.mark.parametrize("compute", [
    lambda: X[torch.tensor([1, 3])], lambda: X.index_select(0, torch.tensor([0, 2])),
    lambda: roc_auc_tensor(MASK, X), lambda: score_tensor(torch.randn(12, 3), torch.randint(0, 3, (12,))),
    lambda: X.masked_fill(MASK, 0), lambda: torch.where(MASK, X, 0.0),
], ids=["int-index", "index-select", "roc-auc", "accuracy", "masked-fill", "where"])
def test_device_side_computations_pass(compute):
    with HostReads("cpu"):
        compute()


def test_a_cpu_value_is_a_host_value_for_an_accelerator_step():
    """Reading a CPU tensor syncs nothing in a CUDA step (Adam's CPU step counters, a CPU seed read by the op)."""
    with HostReads(torch.device("cuda")):
        X.sum().item()
        X.tolist()


def graph(classes):
    return monophily_graph(num_nodes=120, num_classes=classes, degree=4, seed=3)


def star(**kwargs):
    return NTStar(8, 8, kwargs.pop("classes"), 2, 1, heads=2, dropout=0.2, **kwargs)


MODELS = {
    "NT-fused": lambda classes: NT(8, 8, 2, classes, heads=2, dropout=0.2, sep=True, aggr="weighted_mean"),
    "NT-composition": lambda classes: NT(8, 8, 2, classes, heads=2, dropout=0.2, aggr="gated_sum", fused=False,
                                         attention="performer"),
    "DirNT-fused": lambda classes: NT(8, 8, 2, classes, heads=2, dropout=0.2, directed=True, aggr="max"),
    "DirNT-composition": lambda classes: NT(8, 8, 2, classes, heads=2, dropout=0.2, directed=True, aggr="mean",
                                            fused=False),
    "NTStar-local-fused": lambda classes: star(classes=classes, aggr="sum"),
    "NTStar-local-composition": lambda classes: star(classes=classes, aggr="weighted_mean", gate_group="centre",
                                                     fused=False),
    "NT-checkpoint": lambda classes: NT(8, 8, 2, classes, heads=2, dropout=0.2, sep=True, checkpoint=True),
    "NTStar-local-checkpoint": lambda classes: star(classes=classes, aggr="sum", checkpoint=True),
}


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["float32", "bf16-autocast"])
@pytest.mark.parametrize("classes", [2, 3], ids=["roc-auc", "accuracy"])
@pytest.mark.parametrize("name", list(MODELS))
def test_the_warm_training_step_reads_nothing_on_the_host(name, classes, autocast):
    """Training step (Adam as on CUDA), evaluation forward and both scores of a warm epoch of nt-kernels train
    under HostReads; then the epoch's one read."""
    data = graph(classes)
    torch.manual_seed(0)
    model = MODELS[name](classes)
    csr = model.prepare(data.edge_index, data.num_nodes)
    nodes = {name: mask[0].nonzero().flatten()
             for name, mask in (("train", data.train_mask), ("val", data.val_mask), ("test", data.test_mask))}
    epoch = FullBatch(model, data.x, csr, data.y, nodes, autocast=autocast, capture=False, required=False, note="")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True, capturable=True)

    def one_epoch():
        model.train()
        loss = epoch(model, optimizer, 0)
        return (loss, *epoch.evaluate())

    one_epoch()  # builds what a first step builds (plans, optimizer state)
    with HostReads("cpu", name):
        loss, val, test = one_epoch()
    values = read_epoch(loss, val, test)
    assert all(isinstance(v, float) for v in values) and 0 <= values[1] <= 1 and 0 <= values[2] <= 1
