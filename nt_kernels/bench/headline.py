"""The headline tables of docs/results.md: ours against the peers, one table per device class, every number
a link to the JSON file it was read from.

The tables are read from the committed result files under one results directory (``bench/results``):

* the op bench (``nt-kernels bench``): ``*.json`` and the GPU runs' ``gpu-runs/*/perf/*.json`` that are op
  bench documents (a run committed in both places counts once): :func:`op_table`.  Ours is the
  fused op; the peers are what a user would write instead (``pyg-pairs``, nested-tensor SDPA,
  FlexAttention, ``varlen_attn``, performer-pytorch), and the paper's strategies are beside them; the ratios
  are those of each document's ``summary`` (:func:`nt_kernels.bench.cli.summarize`).
* the training step (``nt-kernels bench --layer``): ``layer/*.json`` and the GPU runs'
  ``gpu-runs/*/perf/*.json`` that are layer documents, ``gpu_profile.py``'s read through
  :func:`nt_kernels.bench.layer_report.normalise`: :func:`layer_table`.  Ours is the fused layer
  (``fused``, and its opt-in variants ``fused:tc``, ``fused:recompute``, ...); the peers are the unfused
  composition (``unfused``, ``unfused:tc``) and the paper's released layer (``released``).

The training table (against the paper's scores) is :mod:`nt_kernels.apps.train_report`'s; ``nt-kernels
results`` (:mod:`nt_kernels.apps.results_page`) writes all five into docs/results.md and checks them.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from nt_kernels.bench.layer_report import is_profile_run, normalise
from nt_kernels.bench.plot import _settings_text, block_page

DEVICE_TYPES = {"cpu": "CPU", "cuda": "GPU"}


# ------------------------------------------------------------- documents
def _gpu_run_files(results_dir: Path) -> list[Path]:
    return sorted(results_dir.glob("gpu-runs/*/perf/*.json"))


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def is_op_run(doc) -> bool:
    """A result document of the op bench (``nt-kernels bench`` without ``--layer``)."""
    return (isinstance(doc, dict) and "kind" not in doc and isinstance(doc.get("graph"), dict)
            and "segments" in doc["graph"] and isinstance(doc.get("results"), list))


def op_documents(results_dir: Path) -> list[tuple[dict, Path]]:
    """The op bench documents of ``results_dir``, oldest first; a copy of one (the same run: device, time
    and command) counts once, under its first path (``*.json`` before ``gpu-runs/``)."""
    found, seen = [], set()
    for path in sorted(results_dir.glob("*.json")) + _gpu_run_files(results_dir):
        doc = _load(path)
        if not is_op_run(doc):
            continue
        key = (doc["device"]["name"], doc["created"], doc["command"])
        if key not in seen:
            seen.add(key)
            found.append((doc, path))
    return sorted(found, key=lambda item: (item[0]["created"], str(item[1])))


def layer_documents(results_dir: Path) -> list[tuple[dict, Path]]:
    """The training-step documents of ``results_dir`` (normalised), in path order."""
    found = []
    for path in sorted(results_dir.glob("layer/*.json")) + _gpu_run_files(results_dir):
        doc = _load(path)
        if isinstance(doc, dict) and (doc.get("kind") == "layer" or is_profile_run(doc)) and \
                not doc.get("settings", {}).get("dry_run"):
            found.append((normalise(doc), path))
    return found


# ---------------------------------------------------------------- cells
def link(text: str, path: Path, page_dir: Path) -> str:
    """``text`` as a markdown link to ``path``, relative to the page's folder."""
    return f"[{text}]({Path(os.path.relpath(path, page_dir)).as_posix()})"


def ms(value: float) -> str:
    return f"{value:,.2f} ms" if value < 10 else f"{value:,.1f} ms"


def faster(ratio) -> str:
    """A speed ratio (their time / ours) in words: "**2.63× faster**" or "**2.95× slower**"."""
    if ratio is None:
        return "–"
    return f"**{ratio:.2f}× faster**" if ratio >= 1 else f"**{1 / ratio:.2f}× slower**"


def memory(ratio) -> str:
    return "" if ratio is None else f", memory {ratio:.3f}×"


def run_name(doc: dict, path: Path) -> str:
    """The run a document belongs to: its ``gpu-runs/<run>/`` folder, else ``<gpu>-<date>`` on a GPU (the
    name of its run page), else the device and the date."""
    if "gpu-runs" in path.parts:
        return path.parts[path.parts.index("gpu-runs") + 1]
    date = doc.get("created", "")[:10]
    match = re.search(r"\b([A-Z]\d{2,4})\b", doc["device"]["name"])
    if doc["device"].get("type") == "cuda" and match and date:
        return f"{match.group(1).lower()}-{date}"
    return f"{doc['device']['name']}, {date}" if date else doc["device"]["name"]


def run_cell(doc: dict, path: Path, docs_dir: Path, page_dir: Path, block: str | None = None) -> str:
    """The device and the run, linked to the run's page: ``docs/runs/<run>.md`` where it exists, else the
    run page that holds the document's block ``block`` (its per-file block, or the layer block)."""
    name = run_name(doc, path)
    page = docs_dir / "runs" / f"{name}.md"
    if not page.is_file() and block is not None:
        page = block_page(docs_dir, block)
    device = doc["device"]["name"]
    label = name[len(device) + 2:] if name.startswith(device + ", ") else name
    if page.is_file() and page.parent == docs_dir / "runs":
        return f"{device}, {link(label, page, page_dir)}"
    return f"{device}, {label}"


# ------------------------------------------------------------ op tables
def _op_row(doc: dict, path: Path, docs_dir: Path, page_dir: Path) -> str:
    sm, by_name = doc.get("summary", {}), {e["backend"]: e for e in doc["results"]}
    fused = by_name.get("fused", {})

    def cell(text: str) -> str:
        return link(text, path, page_dir)

    ours = cell(ms(fused["forward_backward_ms"])) if fused.get("status") == "ok" else \
        cell(fused.get("status", "not run"))
    if "fastest_peer" in sm:
        peer = by_name[sm["fastest_peer"]]
        forward = sm["fastest_peer_forward"]
        peer_cells = [cell(f"{peer['backend']}: {ms(peer['forward_backward_ms'])}"),
                      cell(faster(sm["speedup_fwd_bwd_vs_fastest_peer"]) + memory(sm["memory_ratio_vs_fastest_peer"])
                           + f"; forward {sm['speedup_fwd_vs_fastest_peer_forward']:.2f}×"
                           + ("" if forward == peer["backend"] else f" vs {forward}"))]
    elif "fastest_peer_forward" in sm:
        peer = by_name[sm["fastest_peer_forward"]]
        ours_forward = ms(fused["forward_ms"])
        peer_cells = [cell(f"{peer['backend']}: {ms(peer['forward_ms'])} forward only (ours {ours_forward})"),
                      cell(faster(sm["speedup_fwd_vs_fastest_peer_forward"]) + " (forward)")]
    else:
        peer_cells = ["not run", "–"]
    if "speedup_fwd_bwd_vs_best" in sm:
        best = by_name[sm["best_strategy"]]
        strategy_cells = [cell(f"{best['backend']}: {ms(best['forward_backward_ms'])}"),
                          cell(faster(sm["speedup_fwd_bwd_vs_best"]) + memory(sm["memory_ratio_vs_best"]))]
    else:
        strategy_cells = ["not run", "–"]
    case = f"{doc['graph']['name']} · {_settings_text(doc)}"
    return "| " + " | ".join([run_cell(doc, path, docs_dir, page_dir, path.stem), case, ours, *peer_cells,
                              *strategy_cells]) + " |"


def op_table(results_dir: Path, device_type: str, docs_dir: Path, page_dir: Path) -> str:
    """Ours (the fused op, forward + backward) against the fastest peer and the fastest paper strategy of
    every op bench document on ``device_type`` (``cpu`` or ``cuda``)."""
    lines = ["| device, run | graph · setting | ours: fused fwd+bwd | fastest peer | ours vs peer "
             "| fastest paper strategy | ours vs strategy |", "|---|---|---:|---|---|---|---|"]
    rows = [_op_row(doc, path, docs_dir, page_dir) for doc, path in op_documents(results_dir)
            if doc["device"]["type"] == device_type]
    return "\n".join(lines + rows) if rows else f"(no {DEVICE_TYPES.get(device_type, device_type)} op run yet)"


# --------------------------------------------------------- layer tables
OURS, PEERS = ("fused",), ("unfused", "released")


GRAPH_ORDER = ("tolokers", "minesweeper", "synthetic", "powerlaw")


def _graph_rank(name: str) -> int:
    return GRAPH_ORDER.index(name) if name in GRAPH_ORDER else len(GRAPH_ORDER)


def _family(variant: str) -> str:
    return variant.split(":")[0]


def _fastest(results: list[dict], families: tuple[str, ...]) -> dict | None:
    ran = [e for e in results if _family(e["variant"]) in families and e.get("status") == "ok"]
    return min(ran, key=lambda e: e["step_ms"]) if ran else None


def _step(entry: dict | None) -> str:
    if entry is None:
        return "not run"
    if entry.get("status") != "ok":
        return entry.get("status", "not run")
    text = ms(entry["step_ms"])
    peak = entry.get("peak_memory_bytes")
    return text + (f", {peak / 2**20:,.0f} MiB" if peak else "")


def _ratio(theirs: dict | None, ours: dict | None):
    if not (theirs and ours) or "ok" != theirs.get("status") or "ok" != ours.get("status"):
        return None
    return theirs["step_ms"] / ours["step_ms"]


def _memory_ratio(ours: dict | None, theirs: dict | None):
    if _ratio(theirs, ours) is None or not theirs.get("peak_memory_bytes"):
        return None
    return ours["peak_memory_bytes"] / theirs["peak_memory_bytes"]


def _case(doc: dict) -> str:
    g = doc["graph"]
    size = f" ({g['num_messages']:,} messages)" if "num_messages" in g and g["name"] not in ("tolokers",
                                                                                             "minesweeper") else ""
    return f"{g['name']}{size} · {doc['settings']['dtype']}"


def _layer_row(doc: dict, path: Path, results_dir: Path, docs_dir: Path, page_dir: Path, variants: bool) -> str:
    by_variant = {e["variant"]: e for e in doc["results"]}
    fused, unfused = by_variant.get("fused"), by_variant.get("unfused")

    def cell(text: str) -> str:
        return link(text, path, page_dir)

    ratio = _ratio(unfused, fused)
    block = "layer" if path.parent == results_dir / "layer" else None
    cells = [run_cell(doc, path, docs_dir, page_dir, block), _case(doc), cell(_step(fused)), cell(_step(unfused)),
             cell(faster(ratio) + memory(_memory_ratio(fused, unfused))) if ratio is not None else "–"]
    if variants and set(by_variant) <= {"fused", "unfused"}:
        cells += ["–", "–", "–"]
    elif variants:
        ours, peer = _fastest(doc["results"], OURS), _fastest(doc["results"], PEERS)
        cells += [cell(f"{ours['variant']}: {ms(ours['step_ms'])}") if ours else "–",
                  cell(f"{peer['variant']}: {ms(peer['step_ms'])}") if peer else "–",
                  cell(faster(_ratio(peer, ours))) if _ratio(peer, ours) is not None else "–"]
    return "| " + " | ".join(cells) + " |"


def _headline(doc: dict) -> bool:
    """Whether a layer document belongs in the headline: it timed a peer, or ran the default configuration
    (runs of ours alone with a forced option, such as the checkpointing measurements, stay on their run
    pages)."""
    forced = doc["settings"].get("checkpoint", "auto") != "auto"
    return any(_family(e["variant"]) in PEERS for e in doc["results"]) or not forced


def layer_table(results_dir: Path, device_type: str, docs_dir: Path, page_dir: Path) -> str:
    """Ours (the fused layer's training step) against the unfused composition, per layer document on
    ``device_type`` (by run, then graph; see _headline); where a run timed more variants, also the fastest
    of ours against the fastest peer."""
    docs = sorted(((doc, path) for doc, path in layer_documents(results_dir) if doc["device"]["type"] == device_type
                   and _headline(doc)),
                  key=lambda item: (run_name(*item), _graph_rank(item[0]["graph"]["name"]), str(item[1])))
    if not docs:
        return f"(no {DEVICE_TYPES.get(device_type, device_type)} layer run yet)"
    variants = any(set(e["variant"] for e in doc["results"]) - {"fused", "unfused"} for doc, _ in docs)
    head = "| device, run | graph · dtype | ours: fused step, peak | peer: unfused step, peak | ours vs unfused |"
    rule = "|---|---|---:|---:|---|"
    if variants:
        head += " fastest of ours | fastest peer | fastest vs fastest |"
        rule += "---|---|---|"
    return "\n".join([head, rule] + [_layer_row(doc, path, results_dir, docs_dir, page_dir, variants)
                                  for doc, path in docs])
