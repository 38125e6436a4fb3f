"""A training step without the host: CUDA graph capture of the whole step, and the checks that make it possible.

PyTorch's whole-network capture recipe (static inputs, warm-up on a side
stream, then ``torch.cuda.graph``), packaged for full-batch node
classification (docs/training.md, "Training with and without capture"):

* :class:`CapturedStep` -- forward, loss, backward and optimizer step
  captured in one CUDA graph at the first call and replayed at every later
  call.  The optimizer must be capturable (``torch.optim.Adam(...,
  fused=True, capturable=True)``).
* :class:`CapturedCall` -- any function of static inputs (the evaluation
  forward and its metric) captured and replayed the same way.
* :class:`HostReads` -- the dispatch mode that refuses, inside a step, every
  op that reads a device value on the host (``.item()``, ``.tolist()``,
  ``nonzero``, boolean-mask indexing, a copy to the host) or that would bake
  a host value into a capture (a dropout seed drawn by the CPU generator).
  Both helpers run their first step under it, so a step that cannot be
  captured is refused with a message naming the op and the line.
* :func:`score_tensor` (:func:`roc_auc_tensor`, :func:`accuracy_tensor`) --
  the paper's metrics computed on the device, so that an epoch needs one host
  read at most (the early-stopping metric).

On a device without CUDA graphs (the CPU) both helpers take their *replay
path*: the same static buffers and copy-in, the step function called instead
of a graph replayed.  It gives the eager step's results bitwise.

A step is refused (``ValueError``) when it cannot be replayed: an argument
whose shape, dtype or device differs from the captured one (mini-batches whose
shapes change, e.g. NeighborLoader batches), another non-tensor argument (a
different graph), a host read, a host-side seed, or a model wrapped in
DistributedDataParallel (its gradient all-reduce is launched from Python
hooks; data-parallel training stays eager).
"""
from __future__ import annotations

import contextlib
import math
import os
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_unflatten

__all__ = ["CapturedCall", "CapturedStep", "HostReadError", "HostReads", "accuracy_tensor", "autocast_context",
           "roc_auc_tensor", "score_tensor"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_FILE = os.path.abspath(__file__)
_MASK_INDEX_OPS = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}
_COPIES = {"aten::_to_copy", "aten::copy_", "aten::_copy_from", "aten::_copy_from_and_resize"}
_NO_TARGET = object()


def autocast_context(device_type: str, dtype: torch.dtype | None):
    """``torch.autocast(device_type, dtype)``, or no context for ``dtype`` None (an outer autocast stays on)."""
    return contextlib.nullcontext() if dtype is None else torch.autocast(device_type, dtype=dtype)


# ---------------------------------------------------------------------------------------------- metrics
def roc_auc_tensor(labels: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Area under the ROC curve of binary ``labels`` for ``scores`` (ties count one half), as a float64 0-d
    tensor on their device (NaN without both classes), computed with no host read: the mean rank of each
    score is found with ``searchsorted`` on the sorted scores (static shapes, no ``unique``)."""
    labels = labels.flatten().bool()
    scores = scores.detach().double().flatten().contiguous()
    ordered = torch.sort(scores).values
    below = torch.searchsorted(ordered, scores, right=False).double()
    upto = torch.searchsorted(ordered, scores, right=True).double()
    mean_rank = (below + upto + 1) / 2
    positives = labels.sum().double()
    negatives = labels.numel() - positives
    rank_sum = (mean_rank * labels).sum()
    pairs = positives * negatives
    auc = (rank_sum - positives * (positives + 1) / 2) / pairs.clamp(min=1)
    return torch.where(pairs > 0, auc, torch.full_like(auc, math.nan))


def accuracy_tensor(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Fraction of rows whose arg-max is the label, a float64 0-d tensor (NaN for no rows)."""
    return (logits.argmax(1) == labels).double().mean()


def score_tensor(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The paper's metric as a 0-d float64 tensor on the device: ROC-AUC of class 1 for two classes, accuracy
    otherwise (no host read)."""
    if logits.shape[1] == 2:
        return roc_auc_tensor(labels, torch.softmax(logits.detach().double(), dim=1)[:, 1])
    return accuracy_tensor(logits, labels)


# ------------------------------------------------------------------------------------------- host reads
class HostReadError(ValueError):
    """A step that reads a device value on the host, or would bake a host value into a CUDA graph."""


def _caller() -> str:
    """The innermost Python line of the step outside torch and this module (where the user can act)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = os.path.abspath(frame.filename)
        if not path.startswith(_TORCH_DIR) and path != _THIS_FILE:
            return f"{frame.filename}:{frame.lineno} ({(frame.line or '').strip()})"
    return "unknown line"


def _tensors(values):
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _tensors(value)


class HostReads(TorchDispatchMode):
    """Raises :class:`HostReadError` at the first op that reads a value of ``device`` on the host.

    Refused on ``device``: ``aten::_local_scalar_dense`` (``.item()``,
    ``int()``, ``float()``, ``bool()``), ops whose result is read on the host
    (``data_dependent_output``: ``torch.equal``, ...), ops whose output shape
    depends on values (``nonzero``, ``unique``, ``masked_select``, ...),
    indexing with a boolean mask, ``.tolist()`` and ``.numpy()``; on an
    accelerator also a copy to the host.  Refused on an accelerator because a
    capture would record a host value once: a random draw of the CPU generator
    (``nondeterministic_seeded`` ops on CPU tensors) and a CPU ``seed``
    argument of an op (the fused NT layer's dropout seed), i.e. a *host-side
    seed*, which every replay would reuse (the same dropout mask every epoch).
    Ops tagged ``cudagraph_unsafe`` are refused everywhere.

    CPU tensors are host tensors when ``device`` is an accelerator (reading
    them syncs nothing); on the CPU every tensor is the device's.  ``owner``
    starts the messages.
    """

    def __init__(self, device, owner: str = "step"):
        super().__init__()
        self.device = torch.device(device)
        self.owner = owner
        self._saved = None

    def _on_device(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.device.type == self.device.type

    def _refuse(self, what: str) -> None:
        raise HostReadError(f"{self.owner}: {what}, at {_caller()}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._check(func, args, kwargs)
        out = func(*args, **kwargs)
        if (self.device.type != "cpu" and torch.Tag.nondeterministic_seeded in func.tags
                and any(t.device.type == "cpu" for t in _tensors(out if isinstance(out, (list, tuple)) else [out]))):
            self._refuse(f"draws random numbers with the CPU generator ({func._schema.name}): a host-side seed, "
                         f"recorded once by a capture and reused by every replay (the same dropout mask every "
                         f"step); draw on the device ({self.device.type})")
        return out

    def _check(self, func, args, kwargs) -> None:
        name = func._schema.name
        tensors = list(_tensors(list(args) + list(kwargs.values())))
        on_device = any(self._on_device(t) for t in tensors)
        if torch.Tag.cudagraph_unsafe in func.tags:
            self._refuse(f"{name} cannot run inside a CUDA graph")
        if name == "aten::_local_scalar_dense":
            if on_device:
                self._refuse("reads a device value on the host (.item(), int(), float() or bool() of a tensor: "
                             "aten::_local_scalar_dense); keep it a tensor, or read it once after the step")
            return
        if name in _MASK_INDEX_OPS:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if on_device and any(t.dtype in (torch.bool, torch.uint8) for t in _tensors(indices)):
                self._refuse(f"indexes with a boolean mask ({name} counts the mask's true entries on the "
                             "host); index with the positions instead (mask.nonzero() once, outside the step)")
            return
        if on_device and torch.Tag.data_dependent_output in func.tags:
            self._refuse(f"reads a device value on the host ({name}'s result is a host value)")
        if on_device and torch.Tag.dynamic_output_shape in func.tags:
            self._refuse(f"runs {name}, whose output shape depends on the values (read on the host)")
        if self.device.type != "cpu":
            self._check_accelerator(func, name, args, kwargs, tensors)

    def _check_accelerator(self, func, name, args, kwargs, tensors) -> None:
        """The checks of an accelerator ``device``: copies to the host, CPU seeds (random draws of the CPU
        generator are checked on their outputs, in ``__torch_dispatch__``)."""
        if name in _COPIES:
            source = next((t for t in tensors if self._on_device(t)), None)
            target_cpu = (kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cpu"
                          if name == "aten::_to_copy" else isinstance(args[0], torch.Tensor)
                          and args[0].device.type == "cpu")
            if source is not None and target_cpu:
                self._refuse(f"copies a device tensor to the host ({name})")
        for index, argument in enumerate(func._schema.arguments):
            if argument.name != "seed":
                continue
            seed = args[index] if index < len(args) else kwargs.get("seed")
            dropout = dict(zip((a.name for a in func._schema.arguments), args)).get("dropout", 1.0)
            if isinstance(seed, torch.Tensor) and seed.device.type == "cpu" and dropout:
                self._refuse(f"passes a CPU tensor as {name}'s dropout seed: a host-side seed, recorded once by a "
                             f"capture and reused by every replay (the same dropout mask every step); draw the "
                             f"seed on the device (NTConv does so inside a capture)")

    def __enter__(self):
        mode = self
        tolist, numpy = torch.Tensor.tolist, torch.Tensor.numpy

        def checked(method, label):
            def wrapper(tensor, *args, **kwargs):
                if mode._on_device(tensor):
                    mode._refuse(f"reads a device tensor on the host (.{label}())")
                return method(tensor, *args, **kwargs)
            return wrapper

        self._saved = (tolist, numpy)
        torch.Tensor.tolist, torch.Tensor.numpy = checked(tolist, "tolist"), checked(numpy, "numpy")
        try:
            return super().__enter__()
        except BaseException:
            torch.Tensor.tolist, torch.Tensor.numpy = self._saved
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            torch.Tensor.tolist, torch.Tensor.numpy = self._saved


# ------------------------------------------------------------------------------------------ static inputs
class _Static:
    """The static buffers of a call's arguments: the tensors of the first call; later calls copy into them."""

    def __init__(self, owner: str, args):
        self.owner = owner
        leaves, self.spec = tree_flatten_with_path(args)
        self.paths = [path for path, _ in leaves]
        self.leaves = [leaf for _, leaf in leaves]

    def _name(self, index: int) -> str:
        return "argument" + keystr(self.paths[index])

    def load(self, args) -> None:
        leaves, spec = tree_flatten_with_path(args)
        if spec != self.spec:
            raise ValueError(f"{self.owner}: the arguments' structure changed since the capture ({spec} vs "
                             f"{self.spec}); a captured call takes the same arguments every time")
        for index, (old, (_, new)) in enumerate(zip(self.leaves, leaves)):
            if isinstance(old, torch.Tensor):
                if not isinstance(new, torch.Tensor) or (new.shape, new.dtype, new.device) != (
                        old.shape, old.dtype, old.device):
                    got = (f"{tuple(new.shape)} {new.dtype} on {new.device}" if isinstance(new, torch.Tensor)
                           else type(new).__name__)
                    raise ValueError(
                        f"{self.owner}: {self._name(index)} was {tuple(old.shape)} {old.dtype} on {old.device} "
                        f"when the step was captured and is {got} now: a captured step replays fixed shapes, so "
                        f"mini-batches whose shapes change (e.g. NeighborLoader batches) must train eagerly")
                if new is not old:
                    with torch.no_grad():
                        old.copy_(new)
            elif new is not old:
                raise ValueError(f"{self.owner}: {self._name(index)} is another object than at the capture "
                                 f"({type(new).__name__}); a captured step replays one graph and its plans: pass "
                                 f"the same one (e.g. the NeighbourhoodCSR of model.prepare) at every call")

    def args(self):
        return tree_unflatten(self.leaves, self.spec)

    def device(self) -> torch.device | None:
        return next((leaf.device for leaf in self.leaves if isinstance(leaf, torch.Tensor)), None)


def _check_flag(owner: str, name: str, value) -> None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{owner}: {name} must be None, True or False, got {value!r}")


def _check_warmup(owner: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{owner}: warmup must be None or an int >= 0, got {value!r}")


def _uses_graph(owner: str, capture, device: torch.device) -> bool:
    """Whether a CUDA graph is captured: ``capture`` None means where the device has CUDA graphs."""
    if capture is False:
        return False
    if device.type == "cuda":
        return True
    if capture:
        raise ValueError(f"{owner}: capture=True needs a CUDA device, the step runs on {device}; use capture=None "
                         f"(the replay path there) or False")
    return False


def _refusal(owner: str, exc: BaseException) -> ValueError:
    """A ValueError for a capture that failed: the guard's own message, or the capture's error with its reason."""
    if isinstance(exc, ValueError):
        return exc
    return ValueError(f"{owner}: the CUDA graph capture failed ({type(exc).__name__}: {str(exc).strip()[:400]})")


class _Graph:
    """One CUDA graph (or none) around a function of no arguments, with the warm-up of PyTorch's recipe."""

    def __init__(self, owner: str, device: torch.device, use_graph: bool, pool=None):
        self.owner, self.device, self.use_graph, self.pool = owner, device, use_graph, pool
        self.graph = None

    @contextlib.contextmanager
    def side_stream(self):
        """Warm-up runs on a side stream when a graph will be captured (torch.cuda.graph's requirement)."""
        if not self.use_graph:
            yield
            return
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            yield
        torch.cuda.current_stream(self.device).wait_stream(side)

    def capture(self, fn):
        """``fn()`` under :class:`HostReads`: recorded into a graph (not run), or run once on the replay path."""
        if not self.use_graph:
            with HostReads(self.device, self.owner):
                return fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            with HostReads(self.device, self.owner):
                out = fn()
        self.graph = graph
        return out


# ------------------------------------------------------------------------------------------------- steps
class CapturedCall:
    """``fn(*args)`` captured in a CUDA graph at its first call and replayed at every later call.

    For the evaluation forward (``model.eval()`` and ``torch.no_grad()`` set by
    ``fn`` or around the first call: a graph keeps the mode it was captured
    in) and its metric.  The first call's tensors become the static inputs;
    later calls copy theirs into them (same shapes, dtypes and devices; every
    non-tensor argument the same object).  Returns ``fn``'s outputs: on a CUDA
    graph the same static tensors every call, overwritten by the next replay.

    ``capture``: ``None`` (default) captures on CUDA devices and takes the
    replay path elsewhere (``fn`` called on the static inputs), ``True``
    requires CUDA, ``False`` always takes the replay path.  ``warmup`` calls
    run on a side stream before the capture (default 1 with a graph, 0
    without).  ``pool``: a memory pool to share with graphs replayed before
    this one in the same order (``CapturedStep.pool``).
    """

    def __init__(self, fn, *, capture: bool | None = None, warmup: int | None = None, pool=None):
        _check_flag("CapturedCall", "capture", capture)
        _check_warmup("CapturedCall", warmup)
        self.fn, self.capture, self.warmup, self._pool = fn, capture, warmup, pool
        self._static = self._graph = self._out = None

    @property
    def captured(self) -> bool:
        """Whether a CUDA graph replays the call (False before the first call and on the replay path)."""
        return self._graph is not None and self._graph.graph is not None

    def __call__(self, *args):
        if self._static is not None:
            self._static.load(args)
            if self.captured:
                self._graph.graph.replay()
                return self._out
            return self.fn(*self._static.args())
        static = _Static("CapturedCall", args)
        device = static.device()
        if device is None:
            raise ValueError("CapturedCall: the arguments hold no tensor, so there is no device to capture on")
        graph = _Graph("CapturedCall", device, _uses_graph("CapturedCall", self.capture, device), self._pool)
        with graph.side_stream():
            for _ in range((1 if graph.use_graph else 0) if self.warmup is None else self.warmup):
                self.fn(*static.args())
        try:
            out = graph.capture(lambda: self.fn(*static.args()))
        except Exception as exc:  # noqa: BLE001  (every failed capture is a refusal with its reason)
            if not graph.use_graph:
                raise
            raise _refusal("CapturedCall", exc) from exc
        self._static, self._graph, self._out = static, graph, out
        if graph.graph is not None:
            graph.graph.replay()
        return out


class _Snapshot:
    """The model's parameters and buffers, the optimizer's state and the RNG states, restored in place (the
    tensors a graph reads stay the same objects)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device):
        self.optimizer, self.device = optimizer, device
        self.tensors = [(t, t.detach().clone()) for t in list(model.parameters()) + list(model.buffers())]
        self.state = {id(p): {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                      for p, s in optimizer.state.items()}
        self.cpu_rng = torch.get_rng_state()
        self.device_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def restore(self) -> None:
        with torch.no_grad():
            for tensor, saved in self.tensors:
                tensor.copy_(saved)
            for param, state in self.optimizer.state.items():
                saved = self.state.get(id(param), {})
                for key, value in state.items():
                    if not isinstance(value, torch.Tensor):
                        state[key] = saved.get(key, value)
                    elif key in saved:
                        value.copy_(saved[key])
                    else:
                        value.zero_()  # state the warm-up created: Adam's, AdamW's, RMSprop's fresh state
        torch.set_rng_state(self.cpu_rng)
        if self.device_rng is not None:
            torch.cuda.set_rng_state(self.device_rng, self.device)


class CapturedStep:
    """One full-batch training step -- forward, loss, backward, optimizer step -- captured in a CUDA graph at the
    first call and replayed at every later call (PyTorch's whole-network capture recipe).

    ``step = CapturedStep(model, optimizer, loss_fn)``; ``loss = step(*inputs,
    target=y)`` runs ``loss_fn(model(*inputs), y)`` (``loss_fn(model(*inputs))``
    without ``target``), its backward and ``optimizer.step()``, and returns the
    loss (a 0-d tensor; on a CUDA graph the same static tensor every call,
    overwritten by the next: read or clone it before).

    * **Static inputs.** The first call's tensors (in ``inputs`` and ``target``)
      are the graph's inputs; later calls copy theirs into them, so they must
      have the same shapes, dtypes and devices, and every non-tensor argument
      (the ``NeighbourhoodCSR`` of ``model.prepare``) must be the same object.
      A tensor ``edge_index`` would be compared with the cached graph at every
      forward (a host read): pass the CSR.
    * **Warm-up.** ``warmup`` steps (default 3 with a graph, 0 on the replay
      path) run on a side stream before the capture, so that lazy state
      (plans, the optimizer's state, kernel compiles) exists; the model's
      parameters and buffers, the optimizer's state and the RNG states are
      then put back in place (state the warm-up created is zeroed: a fresh
      state for Adam, AdamW and RMSprop), so the first replay is the first
      training step, as in an eager run.
    * **Fresh randomness.** Dropout in a graph draws new masks at every
      replay: ``F.dropout`` from the device generator, NTConv's fused op from a
      seed it draws on the device inside a capture.
    * **Refused** (``ValueError``, naming the reason): an argument whose shape
      changes (mini-batches), another graph, a step that reads the host or
      draws a host-side seed (:class:`HostReads` watches the forward, loss and
      backward of the capture), a DDP-wrapped model, and on CUDA an optimizer
      that is not capturable (torch's own check).
    * ``autocast``: a dtype (``torch.bfloat16``) to run forward and loss under
      ``torch.autocast``.  ``capture``: as :class:`CapturedCall`'s.

    On the CPU it takes the replay path: the same static buffers and copy-in,
    the step called instead of replayed; it gives the eager step's loss and
    parameters bitwise (tests/test_captured_step.py).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn, *,
                 autocast: torch.dtype | None = None, capture: bool | None = None, warmup: int | None = None):
        if type(model).__name__ == "DistributedDataParallel":
            raise ValueError("CapturedStep: model is wrapped in DistributedDataParallel, whose gradient all-reduce "
                             "is launched from Python hooks during backward; data-parallel training stays eager")
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"CapturedStep: model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"CapturedStep: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not callable(loss_fn):
            raise ValueError(f"CapturedStep: loss_fn must be callable, got {type(loss_fn).__name__}")
        if autocast is not None and not (isinstance(autocast, torch.dtype) and autocast.is_floating_point):
            raise ValueError(f"CapturedStep: autocast must be None or a floating dtype, got {autocast!r}")
        _check_flag("CapturedStep", "capture", capture)
        _check_warmup("CapturedStep", warmup)
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.autocast, self.capture, self.warmup = autocast, capture, warmup
        self._static = self._graph = self._loss = None

    @property
    def captured(self) -> bool:
        """Whether a CUDA graph replays the step (False before the first call and on the replay path)."""
        return self._graph is not None and self._graph.graph is not None

    @property
    def pool(self):
        """The graph's memory pool (for :class:`CapturedCall`'s ``pool``), None without a graph."""
        return self._graph.graph.pool() if self.captured else None

    def _device(self) -> torch.device:
        tensor = next(iter(self.model.parameters()), None)
        if tensor is None:
            raise ValueError("CapturedStep: model has no parameters to train")
        return tensor.device

    def _step(self, guard=None):
        """Forward, loss and backward (under ``guard``), then the optimizer step; returns the detached loss."""
        inputs, target = self._static.args()
        with guard or contextlib.nullcontext():
            with autocast_context(self._device().type, self.autocast):
                out = self.model(*inputs)
                loss = self.loss_fn(out) if target is _NO_TARGET else self.loss_fn(out, target)
            loss.backward()
        self.optimizer.step()
        return loss.detach()

    def __call__(self, *inputs, target=_NO_TARGET):
        if self._static is not None:
            self._static.load((inputs, target))
            if self.captured:
                self._graph.graph.replay()
                return self._loss
            self.optimizer.zero_grad(set_to_none=True)
            return self._step()
        return self._first((inputs, target))

    def _first(self, args) -> torch.Tensor:
        self._static = _Static("CapturedStep", args)
        device = self._device()
        graph = _Graph("CapturedStep", device, _uses_graph("CapturedStep", self.capture, device))
        snapshot = _Snapshot(self.model, self.optimizer, device)
        warmup = (3 if graph.use_graph else 0) if self.warmup is None else self.warmup
        try:
            with graph.side_stream():
                for _ in range(warmup):
                    self.optimizer.zero_grad(set_to_none=True)
                    self._step()
            if warmup:
                snapshot.restore()
            self.optimizer.zero_grad(set_to_none=True)
            if graph.use_graph:
                graph_step = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph_step):
                    loss = self._step(HostReads(device, "CapturedStep"))
                graph.graph = graph_step
            else:
                loss = self._step(HostReads(device, "CapturedStep"))
        except Exception as exc:  # noqa: BLE001  (the model goes back to its state; the reason is raised)
            snapshot.restore()
            self.optimizer.zero_grad(set_to_none=True)
            self._static = None
            if not graph.use_graph:
                raise
            raise _refusal("CapturedStep", exc) from exc
        self._graph, self._loss = graph, loss
        if graph.graph is not None:
            graph.graph.replay()
        return loss
