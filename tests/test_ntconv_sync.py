"""Host syncs, launches and compiles of one step of the fused NT layer's CUDA implementation.

What the Triton implementation (nt_kernels/backends/triton/ntconv_op.py) would do
on CUDA is recorded on CPU tensors under ``TRITON_INTERPRET=1`` by
:class:`Recorder` (docs/design.md, "Host syncs"; docs/kernels-ntconv-cuda-checks.md,
"Launches"):

* every Triton launch, with Triton's own specialisation of its arguments (the
  binder a compiled ``JITFunction`` runs, built from the interpreted kernel's
  ``do_not_specialize`` lists): its *configuration* (kernel, constexprs,
  warps, stages), its *signature* (type and specialisation of every runtime
  argument: a new signature is a new compile) and its *site* (the calls in
  nt_kernels/ that made it: the row GEMMs of y, do and du are three sites);
* every aten op that launches a kernel on CUDA: one per op, except views,
  allocations without a fill, and ops whose outputs are empty;
* every Performer op, as the launches of the CUDA SIMT launcher
  (csrc/cuda/segment_performer_launch.cuh: 4 per forward, 7 per backward),
  split into trusted-table calls (performer_*_table_into) and checking ones;
* every host sync: ``aten::_local_scalar_dense`` (``.item()``, ``int()``,
  ``bool()``), ops whose output depends on data (``nonzero``, ``equal`` ...:
  their tags), ``.tolist()`` and ``.numpy()``, except on the tensors named
  ``host`` (the seed: a CPU tensor on CUDA too).

The interpreter's own copies around a launch are not counted.  With
``execute=False`` neither the Triton kernels nor the Performer run (their
outputs stay uninitialised): launches, signatures and syncs do not depend on
values (test_recorded_launches_do_not_depend_on_running_the_kernels).
"""
import collections
import gc
import random
import traceback
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import nt_kernels as nk
from nt_kernels import NeighbourhoodCSR
from nt_kernels.nn.aggregate import receiver_csr
from nt_reference.dropout import counter_dropout_mask, seed_key

triton = pytest.importorskip("triton")
from triton.backends.compiler import BaseBackend  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from nt_kernels.backends.triton import ntconv_checks, ntconv_op  # noqa: E402
from nt_kernels.backends.triton.ntconv_gemm import fused_centre  # noqa: E402
from nt_kernels.backends.triton.ntconv_plan import cached_plan, read_plan  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="records the CUDA path on CPU tensors under the "
                                "Triton interpreter")
MAX_LAUNCHES = 60  # per NTConv forward + backward on tolokers (issue 27)


# Kernels the CUDA SIMT Performer launcher runs per call (launch_key_sums: feature sums, combine, column sums;
# then the row pass in the forward; the query pass, feature sums of the gradients, combine and key pass in the
# backward).
PERFORMER_LAUNCHES = {"fwd": 4, "bwd": 7}
NO_KERNEL = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty", "aten::new_empty_strided",
             "aten::set_", "aten::lift_fresh", "aten::detach", "aten::alias", "aten::_unsafe_view"}
SYNC_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)
_BINDERS: dict = {}


def specialization(fn: InterpretedFunction, args, kwargs) -> tuple[tuple, tuple]:
    """(configuration, signature) of a launch of ``fn``, as the compiled kernel would specialise it."""
    if fn.fn not in _BINDERS:
        jit = JITFunction(fn.fn, **fn.kwargs)
        _BINDERS[fn.fn] = jit, create_function_from_signature(jit.signature, jit.params, BaseBackend)
    jit, binder = _BINDERS[fn.fn]
    _, spec, options = binder(*args, **kwargs)
    constexprs = tuple((p.name, str(s[1])) for p, s in zip(jit.params, spec) if p.is_constexpr)
    signature = tuple((p.name, s) for p, s in zip(jit.params, spec) if not p.is_constexpr)
    return (fn.fn.__name__, constexprs, tuple(sorted(options.items()))), signature


def _site() -> tuple:
    """Where a launch comes from: the chain of calls inside nt_kernels/ that made it (each use of a
    kernel, e.g. the row GEMM of y, do and du, is its own site)."""
    return tuple((f.filename.rsplit("nt_kernels/", 1)[-1], f.lineno) for f in traceback.extract_stack()[:-2]
                 if "/nt_kernels/" in f.filename)


def _outputs(out):
    return [t for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)]


class Recorder(TorchDispatchMode):
    """Context manager recording launches and syncs (module docstring)."""

    def __init__(self, *, execute: bool = True, host=()):
        super().__init__()
        self.execute = execute
        self.host = {t.untyped_storage().data_ptr() for t in host}
        self.triton: list[tuple[tuple, tuple, tuple]] = []  # (configuration, signature, site) per launch
        self.tags: list = []  # ``tag`` at each launch (the test sets it: e.g. the layer shape of the call)
        self.tag = None
        self.aten: collections.Counter = collections.Counter()
        self.performer: collections.Counter = collections.Counter()
        self.syncs: list[str] = []
        self._inside = 0

    # -- totals
    @property
    def performer_launches(self) -> int:
        return sum(PERFORMER_LAUNCHES["bwd" if "bwd" in op else "fwd"] * n for op, n in self.performer.items())

    @property
    def launches(self) -> int:
        return len(self.triton) + sum(self.aten.values()) + self.performer_launches

    def summary(self) -> str:
        kernels = collections.Counter(config[0] for config, _, _ in self.triton)
        return (f"{self.launches} launches: Triton {dict(kernels)}, aten {dict(self.aten)}, "
                f"Performer {dict(self.performer)} ({self.performer_launches}); syncs {self.syncs}")

    # -- hooks
    def _is_host(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.host

    def _sync(self, what: str, t) -> None:
        if not self._inside and not self._is_host(t):
            self.syncs.append(what)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._inside:  # the interpreter's copies around a launch
            return func(*args, **kwargs)
        name = func._schema.name
        if name.startswith("nt_kernels::performer_") and name.endswith("_into"):
            self.performer[name.split("::")[1]] += 1
            return func(*args, **kwargs) if self.execute else None
        out = func(*args, **kwargs)
        if any(tag in func.tags for tag in SYNC_TAGS):
            self._sync(name, args[0] if args else None)
        elif not func.is_view and name not in NO_KERNEL and any(t.numel() for t in _outputs(out)):
            self.aten[name] += 1
        return out

    def __enter__(self):
        recorder, run = self, InterpretedFunction.run
        self._saved = run, torch.Tensor.tolist, torch.Tensor.numpy

        def launch(fn, *args, grid, warmup, **kwargs):
            if warmup:
                return run(fn, *args, grid=grid, warmup=warmup, **kwargs)
            recorder.triton.append((*specialization(fn, args, kwargs), _site()))
            recorder.tags.append(recorder.tag)
            if not recorder.execute:
                return None
            recorder._inside += 1
            try:
                return run(fn, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                recorder._inside -= 1

        def host_read(method):
            def read(t, *a, **kw):
                recorder._sync(f"Tensor.{method.__name__}", t)
                return method(t, *a, **kw)
            return read

        InterpretedFunction.run = launch
        torch.Tensor.tolist, torch.Tensor.numpy = host_read(torch.Tensor.tolist), host_read(torch.Tensor.numpy)
        return super().__enter__()

    def __exit__(self, *exc):
        InterpretedFunction.run, torch.Tensor.tolist, torch.Tensor.numpy = self._saved
        return super().__exit__(*exc)


# ------------------------------------------------------------------- inputs
class Layer:
    """One fused layer on a random graph (centre j sends sizes[j] messages to random receivers):
    CPU tensors, node terms in float32, parameters in ``dtype`` (bfloat16: the autocast case),
    and the CSR's cached plan."""

    def __init__(self, sizes, *, aggr="gated_sum", gate_group="receiver", heads=2, dim=3, edge_dim=3,
                 threshold=5, chunk_rows=12, dtype=torch.bfloat16, seed=0):
        gen = torch.Generator().manual_seed(seed)
        n = len(sizes)
        parts = [torch.stack([torch.full((k,), j), torch.randint(0, n, (k,), generator=gen)])
                 for j, k in enumerate(sizes)]
        self.csr = NeighbourhoodCSR.from_edge_index(torch.cat(parts, 1), n)
        self.rcsr = receiver_csr(self.csr, n)
        c, e = heads * dim, self.csr.num_edges
        c_out = 2 * c if aggr in ("weighted_mean", "gated_sum") else c

        def rand(*shape, dt=dtype, scale=1.0):
            return (torch.randn(*shape, generator=gen) * scale).to(dt)
        self.chunk_rows = chunk_rows
        self.shape = (aggr, gate_group, heads, dim, edge_dim, threshold, dtype)
        self.plan = cached_plan(self.csr, self.rcsr, threshold, dtype, c, heads, chunk_rows=chunk_rows)
        exact, performer = self.csr.segment_split(threshold)
        edge = edge_dim > 0
        self.args = [rand(n, c, dt=torch.float32), rand(n, c, dt=torch.float32),
                     rand(e, edge_dim, dt=torch.float32) if edge else None,
                     rand(c, edge_dim, scale=0.5) if edge else None, rand(3 * c, c, scale=c ** -0.5),
                     rand(3 * c, scale=0.1), rand(c_out, c, scale=c ** -0.5), rand(c_out, scale=0.1),
                     self.csr.rowptr, self.csr.receiver, self.csr.perm, self.rcsr.rowptr, self.rcsr.perm, exact,
                     performer, self.plan, nk.orthogonal_random_features(4, dim, generator=gen, dtype=dtype),
                     None, heads, aggr, gate_group, 0.3, dim ** -0.5, 1e-4]
        self.grad_out = rand(n, c)

    def step(self, seed: torch.Tensor, plan="cached"):
        """ntconv_fwd + ntconv_bwd with the CPU ``seed`` tensor; ``plan``: "cached" (the CSR's),
        None (built per call) or another tensor.  Returns the output and the eight gradients."""
        args = list(self.args)
        args[15] = self.plan if isinstance(plan, str) else plan
        args[17] = seed
        out, lse, stats = ntconv_op.ntconv_fwd(*args, chunk_rows=self.chunk_rows)
        grads = ntconv_op.ntconv_bwd(self.grad_out, out, lse, stats, *args, [True, True, True],
                                     chunk_rows=self.chunk_rows)
        return (out, *grads)


# Sizes 0 to 14 around the threshold (exact <= 5 < Performer) and a 40-row hub: four chunks of at least 12
# rows (starting at odd rows too).
SIZES = [0, 1, 1, 2, 4, 5, 6, 3, 0, 2, 1, 14, 0, 40, 7, 3]
OTHER_SIZES = [3, 9, 0, 1, 22, 2, 5, 6, 1, 4]


# -------------------------------------------------------------------- syncs
@pytest.mark.parametrize("aggr, gate_group, edge_dim", [
    pytest.param("gated_sum", "receiver", 3, id="gated_sum-edge_attr"),
    pytest.param("weighted_mean", "centre", 0, id="weighted_mean-centre"),
    pytest.param("max", "receiver", 0, id="max")])
def test_fused_step_makes_no_host_sync_after_the_first_call(aggr, gate_group, edge_dim):
    """Forward and backward on the CSR's cached plan (exact and Performer neighbourhoods, several
    chunks, dropout): no read of a tensor on the host but the CPU seed's, every Performer call on
    the plan's trusted table, and the same result as the first call, bit for bit."""
    layer = Layer(SIZES, aggr=aggr, gate_group=gate_group, edge_dim=edge_dim)
    seed = torch.tensor(2 ** 40 + 7)
    first = layer.step(seed)
    with Recorder(host=[seed]) as rec:
        again = layer.step(seed)
    assert rec.syncs == [], rec.summary()
    assert set(rec.performer) == {"performer_fwd_table_into", "performer_bwd_table_into"}, rec.summary()
    assert len([c for c, _, _ in rec.triton if c[0] == "_prologue_kernel"]) >= 6, "several chunks, run twice"
    for a, b in zip(first, again):
        assert torch.equal(a, b)


def test_the_recorder_sees_the_syncs_of_a_plan_built_or_parsed_per_call():
    """The same step without a plan builds one per call (its checks and chunk boundaries sync), and
    a copy of the cached plan carries no parsed view: the forward parses it (one read of its
    header), the backward then finds the view on the copy."""
    layer = Layer(SIZES)
    seed = torch.tensor(3)
    with Recorder(execute=False, host=[seed]) as built:
        layer.step(seed, plan=None)
    with Recorder(execute=False, host=[seed]) as copied:
        layer.step(seed, plan=layer.plan.clone())
    assert len(built.syncs) > 10
    assert copied.syncs == ["Tensor.tolist"]


# ------------------------------------------------------------------ launches
@pytest.mark.parametrize("design", ["stream", "0"], ids=["stream", "stored"])
def test_launches_per_forward_and_backward_on_tolokers(design, monkeypatch):
    """tolokers (1,038,000 messages, one chunk) with its preset (gated_sum, 2 heads of 30, the
    paper's threshold and m, dropout 0.1) under bfloat16 autocast, on the default streaming backward and
    on the stored path: at most MAX_LAUNCHES launches per forward + backward, one per reduction (the merge
    only for lists with split groups), the exact kernels of non-empty classes only, no sync.  The kernels
    do not run (they would take hours in the interpreter); what launches does not depend on their values."""
    monkeypatch.setenv("NT_KERNELS_NTCONV_RECOMPUTE", design)
    from nt_kernels.data import load_dataset
    from nt_kernels.performer import default_nb_features, switch_threshold

    try:
        data = load_dataset("tolokers", directed=False, self_loops="keep")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    n, heads, dim = data.num_nodes, 2, 30
    c, m = heads * dim, default_nb_features(dim)
    csr = NeighbourhoodCSR.from_edge_index(data.edge_index, n)
    rcsr = receiver_csr(csr, n)
    threshold = switch_threshold(m, dim)
    plan = cached_plan(csr, rcsr, threshold, torch.bfloat16, c, heads)
    exact, performer = csr.segment_split(threshold)
    host = read_plan("test", plan, num_rows=csr.num_edges, num_segments=n, num_out=n, chunk_rows=1 << 20,
                     max_tile=64, num_exact=exact.numel(), num_performer=performer.numel(), num_nodes=n)
    assert len(host.chunks) == 1 and performer.numel() > 0
    bf16 = torch.bfloat16
    args = (torch.zeros(n, c), torch.zeros(n, c), None, None, torch.zeros(3 * c, c, dtype=bf16),
            torch.zeros(3 * c, dtype=bf16), torch.zeros(2 * c, c, dtype=bf16), torch.zeros(2 * c, dtype=bf16),
            csr.rowptr, csr.receiver, csr.perm, rcsr.rowptr, rcsr.perm, exact, performer, plan,
            torch.zeros(m, dim, dtype=bf16), torch.tensor(1), heads, "gated_sum", "receiver", 0.1, dim ** -0.5, 1e-4)
    grad_out = torch.zeros(n, c, dtype=bf16)
    with Recorder(execute=False, host=[args[17]]) as rec:
        out, lse, stats = ntconv_op.ntconv_fwd(*args)
        forward = rec.launches
        ntconv_op.ntconv_bwd(grad_out, out, lse, stats, *args, [True, True, True])
    print(f"tolokers: forward {forward}, forward + backward {rec.summary()}")
    kernels = collections.Counter(config[0] for config, _, _ in rec.triton)
    assert rec.launches <= MAX_LAUNCHES and rec.syncs == []
    # receivers (forward) and d_receiver_term; d_centre too where du's kernel does not sum it (C > 64 on the
    # stored path; the streaming design's du kernel never does)
    assert kernels["_reduce_kernel"] == (2 if fused_centre(c) and design == "0" else 3)
    assert kernels["_merge_kernel"] <= kernels["_reduce_kernel"]
    work = host.chunks[0].exact_work
    assert kernels["_fwd_packed_kernel"] + kernels["_fwd_heads_kernel"] + kernels["_fwd_multi_kernel"] == \
        2 * sum(map(bool, work))
    assert rec.performer == {"performer_fwd_table_into": 2, "performer_bwd_table_into": 1}


def test_recorded_launches_do_not_depend_on_running_the_kernels():
    """The same step recorded with and without running the kernels: the same launches, signatures,
    aten ops and Performer calls (so the tolokers count above is what a run launches)."""
    layer = Layer(SIZES, aggr="weighted_mean", gate_group="centre")
    seed = torch.tensor(5)
    layer.step(seed)
    recs = []
    for execute in (True, False):
        with Recorder(execute=execute, host=[seed]) as rec:
            layer.step(seed)
        recs.append(rec)
    ran, recorded = recs
    assert ran.triton == recorded.triton and ran.aten == recorded.aten and ran.performer == recorded.performer
    assert ran.launches == recorded.launches > 0


@pytest.mark.parametrize("design, per_chunk", [("stream", 3), ("0", 2)], ids=["stream", "stored"])
def test_one_reduce_launch_per_reduction_and_none_for_an_empty_list(design, per_chunk, monkeypatch):
    """Chunks whose receiver lists hold items of several size classes each: one reduce launch per
    chunk and reduction, none for a graph without rows.  Per chunk: receivers and d_receiver_term, and
    d_centre on the streaming design (on the stored path du's kernel sums it)."""
    monkeypatch.setenv("NT_KERNELS_NTCONV_RECOMPUTE", design)
    layer = Layer(SIZES, aggr="sum", edge_dim=0)
    seed = torch.tensor(1)
    with Recorder(execute=False, host=[seed]) as rec:
        layer.step(seed)
    host = _host(layer)
    assert any(len(chunk.receivers.classes()) > 2 for chunk in host.chunks)
    reduces = sum(config[0] == "_reduce_kernel" for config, _, _ in rec.triton)
    assert reduces == per_chunk * len(host.chunks)
    empty = Layer([0, 0, 0], aggr="sum", edge_dim=0)
    with Recorder(execute=False, host=[seed]) as rec:
        empty.step(seed)
    assert not any(config[0] in ("_reduce_kernel", "_merge_kernel") for config, _, _ in rec.triton)


# ---------------------------------------------------------------- compiles
def _signatures(rec) -> dict:
    """(layer shape, site, exact kernel class) -> the (configuration, signature) pairs its launches had: one
    means one compile, whatever the graph, chunk or call (the exact kernels' packed classes, launched from
    one site with one configuration each, are told apart by their CLASS)."""
    seen = collections.defaultdict(set)
    for (config, signature, site), tag in zip(rec.triton, rec.tags):
        cls = dict(config[1]).get("CLASS")
        seen[tag, site, config[0], cls].add((config, signature))
    return seen


def _fifty_calls(calls=50):
    """50 forward + backward calls (kernels not run): random seeds over the whole int64 range (half
    of them give seed words >= 2**31), two graphs, chunks starting at odd rows and of odd sizes,
    three aggregators, every kind of launch (exact multi-tile blocks, split reduction groups)."""
    rng = random.Random(0)
    graphs = [(SIZES + [150, 80], 12), (OTHER_SIZES + [70, 120], 7)]  # exact multi-tile and split groups too
    layers = [Layer(sizes, aggr=aggr, gate_group=group, edge_dim=edge, chunk_rows=rows, threshold=100, seed=i)
              for i, (sizes, rows) in enumerate(graphs)
              for aggr, group, edge in [("gated_sum", "receiver", 3), ("max", "receiver", 0),
                                        ("weighted_mean", "centre", 0)]]
    seeds = [torch.tensor(rng.randrange(-2 ** 63, 2 ** 63)) for _ in range(calls)]
    with Recorder(execute=False, host=seeds) as rec:
        for i, seed in enumerate(seeds):
            layer = layers[i % len(layers)]
            rec.tag = layer.shape
            layer.step(seed)
    return rec, seeds


def test_one_signature_per_kernel_configuration_and_site_over_fifty_calls():
    """Every kernel launched from one site on one layer shape has one configuration (constexprs,
    warps, stages) and specialises its arguments one way, over both graphs, every chunk and every
    call: nothing compiles after the first call on a layer shape."""
    rec, seeds = _fifty_calls()
    assert sum(seed_key(int(s)) >= 2 ** 31 for s in seeds) >= 10
    many = {key: sigs for key, sigs in _signatures(rec).items() if len(sigs) > 1}
    assert not many, "\n".join(f"{key[2]} at {key[1][-1]} ({key[0]}): {sorted(sigs)}" for key, sigs in many.items())
    kernels = {config[0] for config, _, _ in rec.triton}
    assert {"_prologue_kernel", "_fwd_multi_kernel", "_bwd_dq_kernel", "_merge_kernel", "_normalize_kernel",
            "_weight_grad_kernel", "_message_grad_kernel"} <= kernels and len(kernels) >= 14


def test_combine_has_one_signature_whatever_the_weight_and_split_counts():
    """The weight-gradient combine's sizes (S splits of M x N partials) are not specialised (issue 40,
    item 4): weights of 16 and 17 rows, 32 and 30 columns, 1 to 5 splits compile once per HAS_BIAS.
    Each result is the split-order sum."""
    from nt_kernels.backends.triton import ntconv_wgrad

    gen = torch.Generator().manual_seed(0)
    with Recorder() as rec:
        for splits, m, n in [(1, 16, 32), (3, 17, 30), (5, 48, 64), (2, 1, 1)]:
            for bias in (False, True):
                partials = torch.randn(splits, m, n + bias, generator=gen)
                w_acc, b_acc = torch.ones(m, n), torch.ones(m) if bias else None
                ntconv_wgrad.combine(partials, w_acc, b_acc)
                assert torch.allclose(w_acc, 1 + partials[..., :n].sum(0), atol=1e-6)
                assert b_acc is None or torch.allclose(b_acc, 1 + partials[..., n].sum(0), atol=1e-6)
    seen = {(config, signature) for config, signature, _ in rec.triton}
    assert len(rec.triton) == 8 and len(seen) == 2, sorted(seen)


def test_combine_gives_the_same_bits_whatever_its_block(monkeypatch):
    """The combine's elements per program (64 on GPUs, COMBINE_BLOCK_INTERPRETED under the interpreter)
    change how its outputs are cut into programs, not what each sums: the same bits with 64 (here 49 programs,
    the last partial) as with the interpreter's block."""
    from nt_kernels.backends.triton import ntconv_wgrad

    gen = torch.Generator().manual_seed(1)
    partials = torch.randn(7, 48, 65, generator=gen)
    results = []
    for block in (ntconv_wgrad.COMBINE_BLOCK_INTERPRETED, ntconv_wgrad.COMBINE_BLOCK):
        monkeypatch.setattr(ntconv_wgrad, "COMBINE_BLOCK_INTERPRETED", block)
        w_acc, b_acc = torch.ones(48, 64), torch.ones(48)
        ntconv_wgrad.combine(partials, w_acc, b_acc)
        results.append((w_acc, b_acc))
    (w_wide, b_wide), (w_64, b_64) = results
    assert torch.allclose(w_wide, 1 + partials[..., :64].sum(0), atol=1e-5)
    assert torch.equal(w_wide, w_64) and torch.equal(b_wide, b_64)


def test_the_signature_check_sees_an_unsigned_seed(monkeypatch):
    """With the seed word passed unsigned (as before issue 27) the prologue gets a second signature
    (i64 for words >= 2**31): the check above can fail."""
    monkeypatch.setattr(ntconv_checks, "signed_word", lambda word: word)
    rec, _ = _fifty_calls(calls=12)
    prologue = {key: sigs for key, sigs in _signatures(rec).items() if key[2] == "_prologue_kernel"}
    assert any(len(sigs) > 1 for sigs in prologue.values())


def test_a_seed_word_above_two_to_the_31_keeps_the_reference_mask():
    """The prologue takes the seed word as a signed int32: a seed whose word is >= 2**31 still draws
    the reference dropout mask (z = GELU(u) * mask with u > 0: zero exactly where dropped)."""
    seed = next(s for s in range(100) if seed_key(s) >= 2 ** 31)
    layer = Layer(SIZES, edge_dim=0, dtype=torch.float32)
    layer.args[0], layer.args[1] = layer.args[0].abs() + 1.0, layer.args[1].abs()
    args = list(layer.args)
    args[17], args[21] = torch.tensor(seed), 0.4
    p = ntconv_op.problem("test", dict(zip(ntconv_op.ARG_NAMES, args), chunk_rows=layer.chunk_rows))
    assert p.seed_word < 0
    kept = []
    for chunk in p.plan.chunks:
        qkv = ntconv_op.qkv_buffer(p, chunk, p.dtype)
        z = torch.empty((chunk.rows, p.channels))
        ntconv_op.prologue(qkv, z, torch.empty_like(z), p, chunk, ntconv_op.segment_of_rows(chunk), "ieee", False)
        kept.append(z != 0)
    assert torch.equal(torch.cat(kept), counter_dropout_mask(seed, layer.csr.num_edges, p.channels, 0.4) != 0)


# -------------------------------------------------------------------- the plan
def _host(layer):
    a = layer.args
    return read_plan("test", layer.plan, num_rows=layer.csr.num_edges, num_segments=layer.csr.num_nodes,
                     num_out=layer.csr.num_nodes, chunk_rows=layer.chunk_rows, max_tile=64,
                     num_exact=a[13].numel(), num_performer=a[14].numel(), num_nodes=layer.csr.num_nodes)


def test_the_plan_is_parsed_once_and_again_after_an_in_place_change():
    layer = Layer(SIZES)
    with Recorder(execute=False) as rec:
        first = _host(layer)
        assert _host(layer) is first
    assert rec.syncs == []
    layer.plan.add_(0)  # bumps the version: the view is parsed again
    with Recorder(execute=False) as rec:
        assert _host(layer) is not first
    assert rec.syncs == ["Tensor.tolist"]


def test_plan_regions_are_aligned_and_hold_the_checked_performer_tables():
    """Every region a kernel reads starts 16 bytes into the plan's storage or a multiple of it, and each
    chunk's Performer table is what performer_segment_table returns for its list."""
    layer = Layer(SIZES, chunk_rows=7)
    host = _host(layer)
    base = layer.plan.data_ptr()
    assert any(chunk.performer is not None for chunk in host.chunks) and len(host.chunks) >= 4
    for chunk in host.chunks:
        regions = [chunk.exact_plan, chunk.performer, chunk.performer_table, chunk.rowptr, chunk.seg_of_row,
                   chunk.rrow, chunk.receivers.device_bounds, chunk.segments.device_bounds]
        assert all((t.data_ptr() - base) % 16 == 0 for t in regions if t is not None)
        assert chunk.part_rows % 8 == 0 and chunk.part_rows >= chunk.rows
        want = torch.repeat_interleave(torch.arange(chunk.seg0, chunk.seg1), torch.diff(chunk.rowptr))
        assert torch.equal(chunk.seg_of_row, want)
        if chunk.performer is not None:
            table = torch.ops.nt_kernels.performer_segment_table(chunk.rowptr, chunk.performer, chunk.rows)
            assert torch.equal(chunk.performer_table, table)


def test_a_plan_and_its_parsed_view_are_freed_with_the_csr():
    """The parsed view lives on the plan tensor and holds storage aliases, not views, so dropping the
    CSR frees the plan (a view's reference to its base would be a cycle the collector cannot see)."""
    layer = Layer(SIZES)
    _host(layer)
    plan = weakref.ref(layer.plan)
    del layer
    gc.collect()
    assert plan() is None
