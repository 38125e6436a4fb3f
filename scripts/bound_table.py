"""The table of docs/runs/cpu-2026-11-27-bounds.md (low-precision bounds): bound / max|reference| of every low-precision
check row and test comparison, grouped, with the worst case named.

Inputs: ``nt-kernels check --json`` files (their bfloat16 and float16 rows) and the JSON lines that
tests/helpers.py::assert_low_precision appends to ``$NT_KERNELS_BOUND_LOG`` during a pytest run.

    NT_KERNELS_BOUND_LOG=/tmp/bounds.jsonl python -m pytest -q tests
    python -m nt_kernels.cli check --device cpu --dtypes bfloat16,float16 --json /tmp/check.json
    python scripts/bound_table.py --check /tmp/check.json --tests /tmp/bounds.jsonl
"""
from __future__ import annotations

import argparse
import collections
import json
import re

CAP = 0.10


def check_groups(paths):
    """{(path, case, dtype): [(ratio, D, tensor, status, baseline)]} over the low-precision rows."""
    groups = collections.defaultdict(list)
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        for r in doc["rows"]:
            if r["dtype"] in ("bfloat16", "float16") and r.get("bound_worst"):
                case = "default n* +- 1 (n* per D)" if r["case"].startswith("default n* =") else r["case"]
                groups[(r["path"], case, r["dtype"])].append(
                    (r["bound_ratio"], r["dim"], r["bound_worst"], r["status"], r["bound_baseline"]))
    return groups


def test_groups(path):
    """{(test function, dtype): [(ratio, parameters, tensor)]} over the logged comparisons."""
    groups = collections.defaultdict(list)
    with open(path) as f:
        for line in f:
            e = json.loads(line)
            if e["dtype"] not in ("bfloat16", "float16"):
                continue
            match = re.match(r"(.*?)(?:\[(.*)\])?$", e["test"])
            function, params = match.group(1), match.group(2) or ""
            groups[(function, e["dtype"])].append((e["ratio"], params, e["tensor"].split(" (")[0]))
    return groups


def table(check_paths, tests_path) -> str:
    lines = ["| check row (path, case) | dtype | rows | max bound / max\\|ref\\| | worst: D, tensor | "
             "its baseline | result |", "|---|---|---:|---:|---|---|---|"]
    worst_all = 0.0
    for (path, case, dtype), rows in sorted(check_groups(check_paths).items()):
        ratio, dim, tensor, _, baseline = max(rows)
        worst_all = max(worst_all, ratio)
        status = "pass" if all(s == "pass" for _, _, _, s, _ in rows) else "FAIL"
        lines.append(f"| {path}, {case} | {dtype} | {len(rows)} | {ratio:.4f} | D={dim}, {tensor} | {baseline} | "
                     f"{status} |")
    lines += ["", "| test (tests/...) | dtype | comparisons | max bound / max\\|ref\\| | worst: parameters, tensor |",
              "|---|---|---:|---:|---|"]
    if tests_path:
        for (function, dtype), entries in sorted(test_groups(tests_path).items()):
            ratio, params, tensor = max(entries)
            worst_all = max(worst_all, ratio)
            lines.append(f"| {function} | {dtype} | {len(entries)} | {ratio:.4f} | {params or '-'}, {tensor} |")
    lines.append("")
    lines.append(f"Largest bound / max|reference| over every row and comparison: {worst_all:.4f} "
                 f"({'within' if worst_all <= CAP else 'ABOVE'} the cap of {CAP:.2f}).")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", nargs="*", default=[], help="nt-kernels check --json files")
    p.add_argument("--tests", default=None, help="the $NT_KERNELS_BOUND_LOG file of a pytest run")
    args = p.parse_args()
    print(table(args.check, args.tests))


if __name__ == "__main__":
    main()
