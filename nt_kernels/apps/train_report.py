"""Training against the paper, from the JSON files of ``nt-kernels train --out`` (bench/results/train/).

Runs of one setting are often split over several files (a split per process, or split 0 first and the
others later): files with the same dataset, model, preset, configuration, device, dtype, batch size and
world size form one group, whose splits are pooled (mean ± sample standard deviation over the splits, as
``nt-kernels train`` computes them).  :func:`paper_table` lists the groups that can be compared with the
paper: a reported score (``"reported"``, the released script's for NT, the paper's table for NT*) and an
epoch budget of at least :data:`MIN_EPOCHS` (shorter runs are speed measurements).
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from nt_kernels.apps import presets
from nt_kernels.bench.headline import link

MIN_EPOCHS = 100
MODEL_NAMES = {"nt": "NT", "nt-star": "NT*"}


def _key(doc: dict) -> str:
    return json.dumps([doc["dataset"], doc.get("model", "nt"), doc["directed"], doc["preset"], doc["config"],
                       doc["device"], doc["dtype"], doc["backend"], doc.get("fused"), doc.get("batch_size"),
                       doc.get("world_size", 1)], sort_keys=True)


def groups(train_dir: Path) -> list[dict]:
    """The groups of ``train_dir``'s result files, each ``{"docs": [(doc, path)], "splits": [run, ...]}``
    with the splits in order, in the order of their first file's name.  A file joins the first group of
    its setting whose splits it does not repeat (a split run twice is two measurements, not one)."""
    found: list[tuple[str, dict]] = []
    for path in sorted(train_dir.glob("*.json")):
        doc = json.loads(path.read_text())
        key, splits = _key(doc), {run["split"] for run in doc["splits"]}
        group = next((g for k, g in found if k == key and not splits & {run["split"] for run in g["splits"]}), None)
        if group is None:
            group = {"docs": [], "splits": []}
            found.append((key, group))
        group["docs"].append((doc, path))
        group["splits"] += doc["splits"]
    for _, group in found:
        group["splits"].sort(key=lambda run: run["split"])
    return [group for _, group in found]


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value), as ``nt-kernels train`` reports them."""
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def _recipe(doc: dict) -> str:
    config = doc["config"]
    model = doc.get("model", "nt")
    text = f"{config['epochs']:,} epochs, patience {config['patience']:,}"
    try:
        full = presets.preset(doc["dataset"], doc["directed"], "paper", model)
    except (KeyError, ValueError):
        return text
    if (config["epochs"], config["patience"]) == (full.epochs, full.patience):
        return f"full recipe: {text}"
    return f"capped: {text} (recipe {full.epochs:,} / {full.patience:,})"


def _splits_cell(group: dict, page_dir: Path) -> str:
    return ", ".join(link(",".join(str(run["split"]) for run in doc["splits"]), path, page_dir)
                     for doc, path in group["docs"])


def comparable(group: dict) -> bool:
    doc = group["docs"][0][0]
    return bool(doc.get("reported")) and doc["config"]["epochs"] >= MIN_EPOCHS


def run_page(group: dict, docs_dir: Path) -> Path | None:
    """The run page under ``docs_dir``/runs that names one of the group's result files."""
    names = [path.name for _, path in group["docs"]]
    for page in sorted(docs_dir.glob("runs/*.md")):
        text = page.read_text()
        if any(name in text for name in names):
            return page
    return None


def paper_table(train_dir: Path, docs_dir: Path, page_dir: Path) -> str:
    """One row per comparable group (by model, then epoch budget): our test score over its splits against
    the paper's."""
    lines = ["| model · dataset | recipe | device, run | splits (JSON) | ours: test score "
             "| paper: 10 splits, full recipe | ours − paper |", "|---|---|---|---|---:|---:|---:|"]
    rows = sorted(filter(comparable, groups(train_dir)),
                  key=lambda g: (g["docs"][0][0].get("model", "nt"), g["docs"][0][0]["config"]["epochs"]))
    for group in rows:
        doc, path = group["docs"][0]
        mean, std = mean_std([run["test"] for run in group["splits"]])
        paper_mean, paper_std = doc["reported"]
        diff = 100 * mean - paper_mean
        within = "within" if abs(diff) <= paper_std else "outside"
        ours, delta = f"{100 * mean:.2f} ± {100 * std:.2f}", f"{diff:+.2f} ({within} the paper's ± {paper_std:.2f})"
        if len(group["docs"]) == 1:
            ours, delta = link(ours, path, page_dir), link(delta, path, page_dir)
        metric = "ROC-AUC" if doc["metric"] == "roc_auc" else doc["metric"]
        device = f"{doc['device']}, {doc['dtype']}"
        page = run_page(group, docs_dir)
        if page is not None:
            device = link(device, page, page_dir)
        lines.append(f"| {MODEL_NAMES.get(doc.get('model', 'nt'), doc.get('model'))} · {doc['dataset']} | "
                     f"{_recipe(doc)} | {device} | {_splits_cell(group, page_dir)} | "
                     f"{ours} ({metric}) | {paper_mean:.2f} ± {paper_std:.2f} | {delta} |")
    return "\n".join(lines) if len(lines) > 2 else "(no training run to compare with the paper yet)"
