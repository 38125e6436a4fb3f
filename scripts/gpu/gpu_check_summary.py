"""summary.json of scripts/gpu/gpu_check.sh, rewritten after every stage.

    STAGES="check=ok=81 ..." TOTAL=359 python gpu_check_summary.py WORK OUT_JSON

From the work folder: the stage times; every check row's verdict (the failed rows in full, the shards
that did not finish); the CUDA tests' outcomes (failures with their messages, the tests never reached,
the slowest); per stage the Triton kernels loaded, cache hits and compiles (gpu_triton.py's log); and per
compute-sanitizer tool its ERROR SUMMARY line, or, for a run cut by its limit, the errors it reported
before that and the workloads it had started.
"""
from __future__ import annotations

import glob
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_triton  # noqa: E402

# a report line of a sanitizer; not its banner, its summary (racecheck: "RACECHECK SUMMARY") or its target line
SUMMARY_LINE = re.compile(r"^========= (ERROR|RACECHECK) SUMMARY")
ERROR_LINE = re.compile(r"^========= (?!COMPUTE-SANITIZER|ERROR SUMMARY|RACECHECK SUMMARY|Target application)[A-Z]")
WORKLOAD_LINE = re.compile(r"^(performer|fused) \S")


def check_rows(work: str) -> dict:
    check = {"rows": 0, "passed": 0, "failed": [], "skipped": 0, "substituted_tolerance": 0, "unfinished": [],
             "seconds_by_shard": {}}
    for path in sorted(glob.glob(f"{work}/json/check-*.json")):
        doc = json.load(open(path))
        shard = os.path.basename(path)[len("check-"):-len(".json")]
        check["seconds_by_shard"][shard] = doc.get("seconds")
        if not doc.get("finished"):
            check["unfinished"].append(shard)
        for r in doc["rows"]:
            check["rows"] += 1
            check["passed"] += r["status"] == "pass"
            check["skipped"] += r["status"] == "skip"
            check["substituted_tolerance"] += r.get("baseline", "").startswith("float32 x")
            if r["status"] == "FAIL":
                check["failed"].append(f"{r['path']} | {r['case']} | {r['dtype']} | D={r['dim']} | {r['worst']} "
                                       f"{r['error']:.3e} > {r['tolerance']:.3e}")
    return check


def test_outcomes(work: str) -> dict:
    tests = {"collected": None, "outcomes": {}, "failed": [], "unfinished": [], "slowest": []}
    done = {}
    if os.path.exists(f"{work}/json/tests.jsonl"):
        for line in open(f"{work}/json/tests.jsonl"):
            r = json.loads(line)
            done[r["id"]] = r
            tests["outcomes"][r["outcome"]] = tests["outcomes"].get(r["outcome"], 0) + 1
            if r["outcome"] in ("failed", "error", "crashed"):  # crashed: the watchdog ended its worker
                tag = "" if r["outcome"] == "failed" else f"[{r['outcome']}] "
                tests["failed"].append(f"{tag}{r['id']}: {r.get('message', '')[:300]}")
        tests["slowest"] = [f"{r['id']} {r['seconds']:.1f} s"
                            for r in sorted(done.values(), key=lambda r: -r["seconds"])[:10]]
    collected = f"{work}/json/tests-collected.txt"
    if os.path.exists(collected):
        ids = [line.strip() for line in open(collected) if line.strip()]
        tests["collected"] = len(ids)
        tests["unfinished"] = [i for i in ids if i not in done]
    # the watchdog's Python stacks of tests past their limit (gpu_pytest_stream.py), per worker
    tests["hang_logs"] = sorted(os.path.basename(p) for p in glob.glob(f"{work}/json/hang-*.log")
                                if "Thread 0x" in open(p).read())
    return tests


def sanitizer_runs(work: str) -> dict:
    """tool -> {"summary": its ERROR SUMMARY line or None (cut by the limit), "errors_reported": the error
    reports printed, "workloads_started": the workload headers gpu_sanitize.py printed}."""
    sanitize = {}
    for path in sorted(glob.glob(f"{work}/logs/sanitize-*.log")):
        lines = open(path, errors="replace").read().splitlines()
        summary = [line.strip() for line in lines if SUMMARY_LINE.match(line)]
        sanitize[os.path.basename(path)[len("sanitize-"):-len(".log")]] = {
            "summary": summary[-1] if summary else None,
            "errors_reported": sum(bool(ERROR_LINE.match(line)) for line in lines),
            "workloads_started": [line for line in lines if WORKLOAD_LINE.match(line)]}
    return sanitize


def main(argv=None) -> int:
    work, out = (argv or sys.argv[1:])[:2]
    stages = {}
    for line in os.environ["STAGES"].split():
        name, status, seconds = line.split("=")
        stages[name] = {"status": status, "seconds": int(seconds)}
    records = gpu_triton.read_log([f"{work}/logs/triton.jsonl"])
    env = json.load(open(f"{work}/json/env.json")) if os.path.exists(f"{work}/json/env.json") else {}
    part = f"{out}.part.{os.getpid()}"  # then renamed: the sanitize stage may write it beside the others
    with open(part, "w") as f:
        json.dump({"total_seconds": int(os.environ["TOTAL"]), "env": env, "stages": stages,
                   "check": check_rows(work), "tests": test_outcomes(work), "sanitize": sanitizer_runs(work),
                   "triton": {name: gpu_triton.counts(records, name) for name in ["warm", *stages]}}, f, indent=1)
    os.replace(part, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
