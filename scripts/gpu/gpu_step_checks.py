"""Stage "steps" of scripts/gpu/gpu_perf.sh: issue 28's training-step targets that are not times.

On a bench graph's preset (default tolokers), fused layers, bf16 autocast, one process:

1. **compiles after warm-up**: after ``--warmup`` steps, the Triton specialisations this
   process meets for the first time (Triton's post-compile hook: a compile or a disk-cache
   load) during ``--steps`` more steps, each drawing a fresh dropout seed;
2. **host syncs**: one warm step under ``torch.cuda.set_sync_debug_mode("warn")``: how many
   synchronising calls it makes and the Python lines that made them (each warning's location);
3. **CUDA graph** (issue 41's helper, ``nt_kernels.train.CapturedStep``): the whole step
   (forward, loss, backward, fused capturable Adam) captured and replayed ``--replays`` times,
   against the same steps run eagerly on a twin model from the same state (both with
   dropout 0: the losses must agree bitwise, ``bitwise``); the replays under
   ``torch.cuda.set_sync_debug_mode("error")`` (``replay_syncs``: none allowed); with the
   preset's dropout, the whole step captured and replayed (finite losses), with the node-level
   blocks checkpointed too (``checkpoint_losses``), and the first fused NTConv's forward captured
   (``CapturedCall``) and replayed twice, which must draw two different dropout masks (NTConv
   draws the seed on the device in a capture).

On a machine without CUDA (a dry run of the GPU script) only step 1 runs, on the CPU
with a cut-down graph; 2 and 3 are recorded as ``skipped``.

    python scripts/gpu/gpu_step_checks.py --graph tolokers --json perf-steps.json
"""
from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import functools
import json
import math
import sys
import warnings

import torch

from nt_kernels.bench.layer import LEARNING_RATE, _model, _step
from nt_kernels.bench.layer_graphs import PRESETS, build_graph
from nt_kernels.csr import NeighbourhoodCSR


class CompileCounter:
    """Counts Triton's post-compile hook calls (chained to the one the GPU scripts' log installed)."""

    def __init__(self):
        from triton import knobs

        self.count, self.kernels = 0, []
        self._knobs, self._previous = knobs, knobs.runtime.jit_post_compile_hook
        knobs.runtime.jit_post_compile_hook = self._hook

    def _hook(self, **kwargs):
        self.count += 1
        self.kernels.append(kwargs["fn"].name)
        if self._previous is not None:
            return self._previous(**kwargs)
        return None


def setup(args, device, dropout=None):
    graph = build_graph(args.graph, messages=None, seed=0, device=device, dry_run=device.type != "cuda")
    csr = NeighbourhoodCSR.from_edge_index(graph.edge_index, graph.x.shape[0])
    preset = PRESETS[args.graph]
    if dropout is not None:
        preset = dataclasses.replace(preset, dropout=dropout)
    torch.manual_seed(0)
    model = _model(preset, graph, fused=True).to(device).train()
    model.prepare(csr, graph.x.shape[0])
    return graph, csr, model


def step_fn(model, optimizer, graph, csr):
    return _step(model, optimizer, graph.x, graph.y, graph.loss_nodes, csr, autocast=True)


class WarmStep:
    """The preset's fused model after ``--warmup`` training steps; calling it runs one more.  One is shared by
    the compile and the sync checks (built on first use)."""

    def __init__(self, args, device):
        self.graph, self.csr, self.model = setup(args, device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=LEARNING_RATE)
        for _ in range(args.warmup):
            self()

    def __call__(self):
        return step_fn(self.model, self.optimizer, self.graph, self.csr)


def compiles(args, device, warm) -> dict:
    run = warm()
    counter = CompileCounter()
    for _ in range(args.steps):
        run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"steps": args.steps, "compiles": counter.count, "kernels": sorted(set(counter.kernels))}


def syncs(args, device, warm) -> dict:
    run = warm()
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("warn")  # every sync warns; the warning names the Python line that made it
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize(device)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    where = collections.Counter(f"{w.filename}:{w.lineno}" for w in syncs)
    return {"syncs": len(syncs), "where": dict(where.most_common(10)),
            "message": str(syncs[0].message)[:300] if syncs else None}


def captured(model, graph, csr):
    """A CapturedStep of the bench step (bf16 autocast) on ``model`` with fused capturable Adam, and its call."""
    from nt_kernels.train import CapturedStep

    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE, fused=True, capturable=True)
    nodes = graph.loss_nodes
    target = graph.y if nodes is None else graph.y.index_select(0, nodes)

    def loss_fn(out, target):
        return torch.nn.functional.cross_entropy(out if nodes is None else out.index_select(0, nodes), target)

    step = CapturedStep(model, optimizer, loss_fn, autocast=torch.bfloat16)
    return step, lambda: step(graph.x, csr, target=target)


def cuda_graph(args, device, warm) -> dict:  # its own models: one without dropout, one with
    from nt_kernels.train import CapturedCall

    result = {}
    # 1. The whole step without dropout: replays against the same steps run eagerly on a twin model.
    graph, csr, eager = setup(args, device, dropout=0.0)
    twin = copy.deepcopy(eager)
    opt_eager = torch.optim.Adam(eager.parameters(), lr=LEARNING_RATE, fused=True, capturable=True)
    step, call = captured(twin, graph, csr)
    try:
        replayed = [float(call())]
    except Exception as exc:  # noqa: BLE001  (recorded: the target is that capture works)
        return {"captured": False, "error": f"{type(exc).__name__}: {exc}"[:600]}
    expected = [float(step_fn(eager, opt_eager, graph, csr))]
    for _ in range(args.replays - 1):
        replayed.append(float(call()))
        expected.append(float(step_fn(eager, opt_eager, graph, csr)))
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(replayed, expected))
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
        replay_syncs = 0
    except RuntimeError as exc:
        replay_syncs = f"{exc}"[:300]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    result.update(captured=step.captured, replay_losses=replayed, eager_losses=expected, max_rel_diff=worst,
                  bitwise=replayed == expected, same_loss=worst <= 1e-3, replay_syncs=replay_syncs)
    # 2. With the preset's dropout (and then with checkpointed node-level blocks): the whole step captures, and
    # a captured forward draws a new mask per replay (NTConv draws the seed on the device inside a capture).
    try:
        for key, checkpoint in (("dropout_step_losses", None), ("checkpoint_losses", True)):
            graph, csr, model = setup(args, device)
            model.checkpoint = checkpoint
            _, call = captured(model, graph, csr)
            result[key] = [float(call()) for _ in range(args.replays)]
        conv = model.convs[0]
        conv.dropout = 0.2  # NT's layers have no dropout of their own in the presets (it is on the FFNs)
        x = torch.randn(graph.x.shape[0], conv.in_channels, device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            forward = CapturedCall(lambda x, csr: conv(x, csr).clone())
            first = forward(x, csr).clone()
            second = forward(x, csr)
        result.update(dropout_finite=all(map(math.isfinite, result["dropout_step_losses"])),
                      fresh_mask_per_replay=not torch.equal(first, second), forward_captured=forward.captured)
    except Exception as exc:  # noqa: BLE001
        result.update(dropout_error=f"{type(exc).__name__}: {exc}"[:600])
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--graph", default="tolokers", choices=sorted(PRESETS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--replays", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    doc = {"graph": args.graph, "device": str(device), "torch": torch.__version__,
           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    checks = [("compiles", compiles)] + ([("syncs", syncs), ("cuda_graph", cuda_graph)] if device.type == "cuda" else [])
    warm = functools.cache(lambda: WarmStep(args, device))
    for name, fn in checks:
        try:
            doc[name] = fn(args, device, warm)
        except Exception as exc:  # noqa: BLE001  (recorded; the next check still runs)
            doc[name] = {"error": f"{type(exc).__name__}: {exc}"[:600]}
        print(f"{name}: {json.dumps(doc[name])[:700]}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)
    for name in ("syncs", "cuda_graph"):
        doc.setdefault(name, {"skipped": "needs CUDA"})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0 if all("error" not in doc[n] for n, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
