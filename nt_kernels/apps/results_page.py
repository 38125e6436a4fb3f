"""``nt-kernels results``: every generated table of the docs, rebuilt from the committed JSON.

docs/results.md opens with five headline tables (:data:`HEADLINE`); the run pages under docs/runs/ hold
the detail blocks that ``nt-kernels bench ... --plot`` writes (one per op result file, the layer block,
the CPU profile block).  Each sits between ``<!-- bench:KEY -->`` and ``<!-- /bench:KEY -->``, and
:func:`expected` rebuilds each from the result files under the results directory with the functions the
``--from-json`` paths use (:mod:`nt_kernels.bench.headline`, :mod:`nt_kernels.bench.plot`,
:mod:`nt_kernels.bench.layer_report`, :mod:`nt_kernels.bench.layer_profile`,
:mod:`nt_kernels.apps.train_report`).  ``nt-kernels results`` writes them; ``--check`` changes nothing,
lists every block that differs from what the JSON gives and exits 1 (tests/test_results_page.py runs it on
the repository, so a number edited by hand, or a result file changed without its page, fails CI).
"""
from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from pathlib import Path

from nt_kernels.apps import train_report
from nt_kernels.bench import headline, layer_profile, layer_report, plot

HEADLINE = {"headline-cpu-op": ("op", "cpu"), "headline-cpu-layer": ("layer", "cpu"),
            "headline-gpu-op": ("op", "cuda"), "headline-gpu-layer": ("layer", "cuda"),
            "headline-train": ("train", None)}
BLOCK = re.compile(r"<!-- bench:([\w.-]+) -->\n(.*?)\n<!-- /bench:\1 -->", re.S)


def pages(docs_dir: Path) -> list[Path]:
    """The pages that may hold generated blocks: ``docs_dir``'s ``*.md`` and ``runs/*.md``."""
    return sorted(docs_dir.glob("*.md")) + sorted(docs_dir.glob("runs/*.md"))


def blocks(text: str) -> dict[str, str]:
    """The generated blocks of a page: key -> body."""
    return {match.group(1): match.group(2) for match in BLOCK.finditer(text)}


def _profile_doc(results_dir: Path, graph: str) -> dict:
    for path in sorted(results_dir.glob("layer-profile/*.json")):
        doc = json.loads(path.read_text())
        if doc.get("kind") == "layer-profile" and doc.get("graph") == graph and not doc["settings"].get("dry_run"):
            return doc
    raise KeyError(f"no layer-profile result for {graph!r} under {results_dir / 'layer-profile'}")


def generate(key: str, page: Path, results_dir: Path, docs_dir: Path) -> str:
    """The body of block ``key`` on ``page``, from the result files of ``results_dir``."""
    if key in HEADLINE:
        kind, device = HEADLINE[key]
        if kind == "op":
            return headline.op_table(results_dir, device, docs_dir, page.parent)
        if kind == "layer":
            return headline.layer_table(results_dir, device, docs_dir, page.parent)
        return train_report.paper_table(results_dir / "train", docs_dir, page.parent)
    if key == "layer":
        return layer_report.layer_block(results_dir / "layer")
    if key.startswith("layer-profile-"):
        return layer_profile.markdown(_profile_doc(results_dir, key[len("layer-profile-"):]))
    path = results_dir / f"{key}.json"
    if not path.is_file():
        raise KeyError(f"{page}: block {key!r} has no result file {path}")
    return plot.result_section(json.loads(path.read_text()), path, page, docs_dir)


def expected(results_dir: Path, docs_dir: Path) -> dict[Path, dict[str, str]]:
    """Every generated block of every page as the JSON gives it (the headline blocks on results.md even
    where the page lacks them)."""
    found = {}
    for page in pages(docs_dir):
        keys = list(blocks(page.read_text()))
        if page == docs_dir / "results.md":
            keys += [key for key in HEADLINE if key not in keys]
        if keys:
            found[page] = {key: generate(key, page, results_dir, docs_dir) for key in keys}
    if docs_dir / "results.md" not in found:
        page = docs_dir / "results.md"
        found[page] = {key: generate(key, page, results_dir, docs_dir) for key in HEADLINE}
    return found


def stale(results_dir: Path, docs_dir: Path) -> list[tuple[Path, str, str, str | None]]:
    """(page, key, expected body, body on the page or None) of every block that differs."""
    differ = []
    for page, bodies in expected(results_dir, docs_dir).items():
        have = blocks(page.read_text()) if page.is_file() else {}
        differ += [(page, key, body, have.get(key)) for key, body in bodies.items() if have.get(key) != body]
    return differ


def write(results_dir: Path, docs_dir: Path) -> list[Path]:
    """Rewrite every stale block (a missing headline block is appended to results.md); returns the pages."""
    written = []
    for page, key, body, _ in stale(results_dir, docs_dir):
        text = page.read_text() if page.is_file() else "# Results\n"
        page.write_text(plot.replace_block(text, key, body))
        if page not in written:
            written.append(page)
    return written


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "results", help="rebuild the tables of docs/results.md and the run pages from the committed JSON",
        description="Rebuild every generated table of the docs (the headline tables of results.md, the blocks "
                    "of the run pages) from the result files; --check only compares.")
    p.add_argument("--results-dir", default="bench/results", help="the result files (default %(default)s)")
    p.add_argument("--docs-dir", default="docs", help="the pages (default %(default)s)")
    p.add_argument("--check", action="store_true",
                   help="change nothing; list the blocks that differ from the JSON and exit 1 if any")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    results_dir, docs_dir = Path(args.results_dir), Path(args.docs_dir)
    if not args.check:
        for page in write(results_dir, docs_dir):
            print(f"-> {page}")
        return 0
    differ = stale(results_dir, docs_dir)
    for page, key, body, have in differ:
        print(f"{page}: block {key!r} " + ("missing" if have is None else "differs from the JSON:"))
        if have is not None:
            sys.stdout.writelines(difflib.unified_diff(have.splitlines(True), body.splitlines(True), "page", "json",
                                                       n=0))
            print()
    if differ:
        print(f"{len(differ)} block(s) out of date: run `nt-kernels results --results-dir {results_dir} "
              f"--docs-dir {docs_dir}`")
    return 1 if differ else 0
