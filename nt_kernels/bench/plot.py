"""The paper's efficiency figure re-drawn for bench results, and the tables of a results page.

:func:`publish` takes result documents of ``nt-kernels bench`` and, in the
docs directory it is given (``--docs-dir``; the repository's docs/ when run
from the checkout as ``make bench`` does),

* draws one PNG per result document (efficiency-<result name>.png): bars are peak
  memory (log scale), the curve is forward+backward time, across the paper's
  parallel, by-size, partitioned(alpha) and sequential strategies, with our
  fused op as its own bar and a dashed line at its time;
* writes or replaces one marked block per result file (its table and figure) on
  the page that holds it: results.md or a run page under runs/.

The headline tables of results.md (ours against the peers and the paper's
strategies, every result file) are :mod:`nt_kernels.bench.headline`'s.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from nt_kernels.bench.measure import FORWARD_ONLY

PLOT_ORDER_FAMILIES = ("parallel", "by-size", "partitioned", "sequential", "fused")


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


def replace_block(text: str, key: str, body: str) -> str:
    """Replace the block between ``<!-- bench:key -->`` markers, or append it."""
    start, end = f"<!-- bench:{key} -->", f"<!-- /bench:{key} -->"
    block = f"{start}\n{body}\n{end}"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if pattern.search(text):
        return pattern.sub(lambda _: block, text)
    return text.rstrip("\n") + "\n\n" + block + "\n"


def block_page(docs_dir: Path, key: str, default: str = "results.md") -> Path:
    """The page that holds the block ``key``: the first of ``docs_dir``'s ``*.md`` and ``runs/*.md`` with its
    start marker, else ``docs_dir``/``default`` (where a new block is appended)."""
    marker = f"<!-- bench:{key} -->"
    for page in sorted(docs_dir.glob("*.md")) + sorted(docs_dir.glob("runs/*.md")):
        if marker in page.read_text():
            return page
    return docs_dir / default


def write_block(docs_dir: Path, key: str, body) -> Path:
    """Replace (or append) the block ``key`` in the page that holds it (:func:`block_page`); ``body`` is the
    block's text, or a function of the page's path that returns it.  Returns the page."""
    page = block_page(docs_dir, key)
    text = page.read_text() if page.is_file() else "# Results\n"
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(replace_block(text, key, body(page) if callable(body) else body))
    return page


def figure_link(doc: dict, path: Path, page: Path, docs_dir: Path) -> str:
    """The figure line under a result block, relative to the page that holds it."""
    figure = os.path.relpath(docs_dir / f"efficiency-{path.stem}.png", page.parent)
    return f"![efficiency figure: {doc['graph']['name']}]({Path(figure).as_posix()})"


def result_section(doc: dict, path: Path, page: Path, docs_dir: Path) -> str:
    """The block of one result file as it stands on ``page``: its table and its figure."""
    return result_block(doc, path) + "\n\n" + figure_link(doc, path, page, docs_dir)


def publish(docs: list[tuple[dict, Path]], docs_dir: Path) -> list[Path]:
    """Draw the figures into ``docs_dir`` and write each result file's block where it stands.

    A block stays on the page that holds it (results.md or a run page under runs/, :func:`block_page`); a
    new one is appended to results.md.  The headline tables are ``nt-kernels results``'s.  Returns the paths
    written.
    """
    docs_dir.mkdir(parents=True, exist_ok=True)
    written = [plot_efficiency([doc], docs_dir / f"efficiency-{path.stem}.png") for doc, path in docs]
    for doc, path in docs:
        page = write_block(docs_dir, path.stem, lambda page, doc=doc, path=path: result_section(doc, path, page,
                                                                                               docs_dir))
        if page not in written:
            written.append(page)
    return written
