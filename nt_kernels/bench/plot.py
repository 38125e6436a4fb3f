"""The paper's efficiency figure re-drawn for bench results, and the tables of a results page.

:func:`publish` takes result documents of ``nt-kernels bench`` and, in the
docs directory it is given (``--docs-dir``; the repository's docs/ when run
from the checkout as ``make bench`` does),

* draws one PNG per result document (efficiency-<result name>.png): bars are peak
  memory (log scale), the curve is forward+backward time, across the paper's
  parallel, by-size, partitioned(alpha) and sequential strategies, with our
  fused op as its own bar and a dashed line at its time;
* writes or replaces one marked block per result file in results.md, the
  summary block that lists every result file of the results directory (by
  default the one holding the published documents), and the peers block
  ("ours vs what you would write instead": fused against the fastest peer).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from nt_kernels.bench.measure import FORWARD_ONLY

PLOT_ORDER_FAMILIES = ("parallel", "by-size", "partitioned", "sequential", "fused")
SUMMARY_KEY = "summary"
PEERS_KEY = "peers"


def _label(entry: dict) -> str:
    if entry["family"] == "partitioned":
        return f"α={entry['alpha']:g}"
    return entry["backend"]


def _plotted(doc: dict) -> list[dict]:
    entries = [e for e in doc["results"] if e["family"] in PLOT_ORDER_FAMILIES]
    return sorted(entries, key=lambda e: (PLOT_ORDER_FAMILIES.index(e["family"]), e.get("alpha") or 0))


def _settings_text(doc: dict) -> str:
    s = doc["settings"]
    text = f"H={s['heads']}, D={s['head_dim']}, {s['dtype']}"
    if s["subset"] == "exact":
        return text + ", exact-path segments only"
    if s["subset"] == "performer":
        return text + ", Performer-path segments only"
    return text + (", exact attention everywhere" if s["threshold"] == "inf" else "")


def plot_efficiency(docs: list[dict], path: Path) -> Path:
    """One panel per graph: memory bars (log) and fwd+bwd time curve per strategy, fused highlighted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    def log_axis(axis) -> None:
        axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        axis.set_minor_formatter(NullFormatter())

    fig, axes = plt.subplots(1, len(docs), figsize=(max(6.0, 4.8 * len(docs)), 4.2), squeeze=False)
    for ax, doc in zip(axes[0], docs):
        entries = _plotted(doc)
        ok = [e.get("status") == "ok" for e in entries]
        mem = [e["peak_memory_bytes"] / 2**20 if good else None for e, good in zip(entries, ok)]
        known = [x for x in mem if x]
        top = max(known) * 4 if known else 1.0
        floor = min(known) / 4 if known else 0.1
        for i, (e, good, value) in enumerate(zip(entries, ok, mem)):
            if not good:
                ax.bar(i, top, color="#f4c7c3", edgecolor="#c0392b")
                word = "OOM" if e["status"].startswith("OOM") else e["status"].split(":")[0]
                ax.text(i, floor * 1.5, word, rotation=90, ha="center", va="bottom", fontsize=7,
                        color="#c0392b")
            elif e["family"] == "fused":
                ax.bar(i, value, color="#2e86c1")
            elif e["family"] == "partitioned":
                ax.bar(i, value, facecolor="none", edgecolor="#7f8c8d", hatch="//")
            else:
                ax.bar(i, value, color="#95a5a6")
        ax.set_yscale("log")
        ax.set_ylim(floor, top * 1.2)
        ax.set_ylabel("peak memory (MiB, bars)")
        log_axis(ax.yaxis)
        ax.set_xticks(range(len(entries)), [_label(e) for e in entries], rotation=60, fontsize=7)
        twin = ax.twinx()
        xs = [i for i, (e, good) in enumerate(zip(entries, ok)) if good and e["family"] != "fused"]
        twin.plot(xs, [entries[i]["forward_backward_ms"] / 1e3 for i in xs], "o-", color="#e67e22",
                  label="paper strategies")
        for i, e in enumerate(entries):
            if e["family"] == "fused" and ok[i]:
                seconds = e["forward_backward_ms"] / 1e3
                twin.axhline(seconds, color="#2e86c1", ls="--", lw=1)
                twin.plot([i], [seconds], "D", color="#f1c40f", markeredgecolor="black", markersize=8,
                          label="fused (ours)")
        twin.set_yscale("log")
        twin.set_ylabel("forward+backward time (s, curve)")
        log_axis(twin.yaxis)
        twin.legend(loc="upper left", fontsize=7, framealpha=0.8)
        g = doc["graph"]
        ax.set_title(f"{g['name']} (E={g['num_edges']:,}, max deg {g['max_degree']})", fontsize=9)
    fig.suptitle(f"{docs[0]['device']['name']} — {_settings_text(docs[0])}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ------------------------------------------------------------ markdown
def _fmt(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _ratio_sentence(doc: dict) -> str:
    sm = doc.get("summary", {})
    if "speedup_fwd_bwd_vs_best" not in sm:
        why = sm.get("fused", "not run")
        return f"Fused op: {why}; no ratio." if why != "ok" else "No paper strategy completed; no ratio."
    text = (f"**Fused vs the fastest paper strategy ({sm['best_strategy']}): "
            f"{_fmt(sm['speedup_fwd_bwd_vs_best'], '.2f')}× faster forward+backward "
            f"({_fmt(sm['speedup_fwd_vs_best'], '.2f')}× forward), {_fmt(sm['memory_ratio_vs_best'], '.3f')}× "
            f"its peak memory; {_fmt(sm['memory_ratio_vs_lowest'], '.3f')}× the lowest strategy peak "
            f"({sm['lowest_memory_strategy']}).**")
    if "speedup_fwd_bwd_vs_partitioned_0.4" in sm:
        text += (f" Vs partitioned α=0.4: {_fmt(sm['speedup_fwd_bwd_vs_partitioned_0.4'], '.2f')}× faster, "
                 f"{_fmt(sm['memory_ratio_vs_partitioned_0.4'], '.3f')}× its peak memory.")
    return text


def _load_text(doc: dict) -> str:
    if "load_average" not in doc:
        return ""
    load = doc["load_average"]
    return f", 1-min load average {load['start'][0]:.1f} at start, {load['end'][0]:.1f} at end"


def result_block(doc: dict, json_path: Path) -> str:
    g, s = doc["graph"], doc["settings"]
    threshold = s["threshold"] if isinstance(s["threshold"], str) else round(s["threshold"], 2)
    lines = [f"#### {g['name']} · {_settings_text(doc)} · {doc['device']['name']}", "",
             f"`{doc['command']}` — {doc['created']}, {s['threads']} threads, torch {doc['versions']['torch']}, "
             f"{s['repeats']} timed runs (median), workers: {s['isolation']}{_load_text(doc)}. "
             f"Graph: N={g['num_nodes']:,}, "
             f"E={g['num_edges']:,} messages, max degree {g['max_degree']}, segments {g['segments']}, "
             f"m={s['nb_features']}, threshold {threshold}."
             f" Raw: `{json_path.name}`.", "",
             "| backend | forward ms | fwd+bwd ms | peak MiB | max abs err | status |",
             "|---|---:|---:|---:|---:|---|"]
    for e in doc["results"]:
        good = e.get("status") == "ok"
        ran = good or e.get("status") == FORWARD_ONLY
        status = f"{e['status']}: {e['forward_only']}" if "forward_only" in e else e["status"]
        lines.append(f"| {e['backend']} | {_fmt(e.get('forward_ms') if ran else None, '.1f')} | "
                     f"{_fmt(e.get('forward_backward_ms') if good else None, '.1f')} | "
                     f"{_fmt(e['peak_memory_bytes'] / 2**20 if ran else None, '.1f')} | "
                     f"{_fmt(e.get('max_abs_error') if ran else None, '.1e')} | {status} |")
    lines += ["", _ratio_sentence(doc)]
    return "\n".join(lines)


def summary_block(results_dir: Path) -> str:
    lines = ["| device | graph | settings | fused fwd+bwd ms | fastest strategy | its fwd+bwd ms | speed-up "
             "| memory ratio (fused / fastest) | memory ratio (fused / α=0.4) |",
             "|---|---|---|---:|---|---:|---:|---:|---:|"]
    for path in sorted(results_dir.glob("*.json")):
        doc = json.loads(path.read_text())
        sm, by_name = doc.get("summary", {}), {e["backend"]: e for e in doc["results"]}
        if "speedup_fwd_bwd_vs_best" not in sm:
            continue
        best = by_name[sm["best_strategy"]]
        lines.append(f"| {doc['device']['name']} | {doc['graph']['name']} | {_settings_text(doc)} | "
                     f"{by_name['fused']['forward_backward_ms']:.1f} | {sm['best_strategy']} | "
                     f"{best['forward_backward_ms']:.1f} | {_fmt(sm['speedup_fwd_bwd_vs_best'], '.2f')}× | "
                     f"{_fmt(sm['memory_ratio_vs_best'], '.3f')} | "
                     f"{_fmt(sm.get('memory_ratio_vs_partitioned_0.4'), '.3f')} |")
    return "\n".join(lines)


def peers_block(results_dir: Path) -> str:
    """Table "ours vs what you would write instead": fused against the fastest peer of every result file."""
    lines = ["| device | graph | settings | fused fwd+bwd ms | fastest peer (fwd+bwd) | its fwd+bwd ms | speed-up "
             "| memory ratio (fused / peer) | fastest peer (forward) | speed-up forward |",
             "|---|---|---|---:|---|---:|---:|---:|---|---:|"]
    for path in sorted(results_dir.glob("*.json")):
        doc = json.loads(path.read_text())
        sm, by_name = doc.get("summary", {}), {e["backend"]: e for e in doc["results"]}
        if "speedup_fwd_vs_fastest_peer_forward" not in sm:
            continue
        peer = by_name.get(sm.get("fastest_peer"), {})
        forward_peer = sm["fastest_peer_forward"]
        if by_name[forward_peer].get("status") == FORWARD_ONLY:
            forward_peer += " (forward only)"
        lines.append(f"| {doc['device']['name']} | {doc['graph']['name']} | {_settings_text(doc)} | "
                     f"{by_name['fused']['forward_backward_ms']:.1f} | {sm.get('fastest_peer', '–')} | "
                     f"{_fmt(peer.get('forward_backward_ms'), '.1f')} | "
                     f"{_fmt(sm.get('speedup_fwd_bwd_vs_fastest_peer'), '.2f')}× | "
                     f"{_fmt(sm.get('memory_ratio_vs_fastest_peer'), '.3f')} | {forward_peer} | "
                     f"{_fmt(sm['speedup_fwd_vs_fastest_peer_forward'], '.2f')}× |")
    return "\n".join(lines)


def replace_block(text: str, key: str, body: str) -> str:
    """Replace the block between ``<!-- bench:key -->`` markers, or append it."""
    start, end = f"<!-- bench:{key} -->", f"<!-- /bench:{key} -->"
    block = f"{start}\n{body}\n{end}"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if pattern.search(text):
        return pattern.sub(lambda _: block, text)
    return text.rstrip("\n") + "\n\n" + block + "\n"


def publish(docs: list[tuple[dict, Path]], docs_dir: Path, results_dir: Path | None = None) -> list[Path]:
    """Draw the figures and update ``docs_dir``/results.md; returns the paths written.

    The summary block lists the result files of ``results_dir`` (default: the
    directory of the first published document).
    """
    if results_dir is None:
        results_dir = docs[0][1].parent if docs else Path(".")
    docs_dir.mkdir(parents=True, exist_ok=True)
    written = [plot_efficiency([doc], docs_dir / f"efficiency-{path.stem}.png") for doc, path in docs]
    md = docs_dir / "results.md"
    text = md.read_text() if md.is_file() else "# Results\n"
    text = replace_block(text, SUMMARY_KEY, summary_block(results_dir))
    text = replace_block(text, PEERS_KEY, peers_block(results_dir))
    for doc, path in docs:
        body = result_block(doc, path)
        body += f"\n\n![efficiency figure: {doc['graph']['name']}](efficiency-{path.stem}.png)"
        text = replace_block(text, path.stem, body)
    md.write_text(text)
    written.append(md)
    return written
