"""pytest plugin of scripts/gpu/gpu_check.sh (``-p gpu_pytest_stream``): every test's outcome written as
the test finishes, so that a run killed at any point keeps what it did.

* ``$GPU_TESTS_STREAM``: one line per test (seconds since the start, outcome, id, duration,
  xdist worker), followed for a failure by its message and the end of its traceback; first the
  number of tests collected, last the totals.
* ``$GPU_TESTS_JSON``: the same as JSON lines (id, outcome, seconds, message); the collected ids
  go to ``tests-collected.txt`` beside it, so that the tests a kill left unfinished can be listed.
* ``$GPU_TESTS_WHOLE_FILES`` (file names): only the tests of these files, and tests marked
  ``cuda`` in the other files given, are run; the rest are deselected.
* ``$GPU_TESTS_DURATIONS`` (tests.jsonl files of earlier GPU runs, space-separated, later ones win): the
  tests are run longest first, by the seconds those runs took (a test they lack: 100 s in the files of
  ``$GPU_TEST_SLOW_FILES``, else 1 s), so that with ``--dist load`` the long tests start at once, side by
  side, instead of last (the 2026-11-28 run's 139 s mutation test started at 40 s and most of the
  others after the stage's end).
* ``$GPU_TEST_TIMEOUT`` (seconds, default 90; ``$GPU_TEST_TIMEOUT_SLOW``, default 240, for the files of
  ``$GPU_TEST_SLOW_FILES``, default test_mutants.py; 0: none): a watchdog per test in each xdist worker.
  A test past its limit (a hung kernel: in the H200 run of 2026-11-28 hung flash Performer tests held
  several workers until the stage's end, and 41 tests never ran) gets every thread's Python stack
  written to ``hang-<worker>.log`` beside ``$GPU_TESTS_JSON`` and its worker ends (``faulthandler``,
  which needs no GIL); xdist reports the test as crashed and starts a fresh worker for the rest.

Lines are appended with one write each (O_APPEND), from the xdist controller only.
"""
from __future__ import annotations

import faulthandler
import json
import os
import time

import pytest

START = time.time()
_STATE = {"config": None, "collected": False, "counts": {}, "phases": {}, "hang_log": None}


def _append(path: str | None, text: str) -> None:
    if not path:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config):
    _STATE["config"] = config


def pytest_collection_modifyitems(config, items):
    whole = os.environ.get("GPU_TESTS_WHOLE_FILES")
    if whole is not None:
        names = set(whole.split())
        keep, drop = [], []
        for item in items:
            in_whole = os.path.basename(str(item.path)) in names
            (keep if in_whole or item.get_closest_marker("cuda") else drop).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep
    paths = os.environ.get("GPU_TESTS_DURATIONS", "").split()
    if paths:  # the same order in every xdist worker: a stable sort on committed numbers
        seconds = recorded_seconds(paths)
        items.sort(key=lambda item: -seconds.get(item.nodeid, guessed_seconds(item.nodeid)))


def recorded_seconds(paths: list[str]) -> dict[str, float]:
    """Test id -> seconds, from tests.jsonl files of earlier runs (later files win; missing files skipped)."""
    seconds = {}
    for path in paths:
        if os.path.exists(path):
            with open(path) as f:
                seconds.update((r["id"], float(r["seconds"])) for r in map(json.loads, f) if r.get("seconds"))
    return seconds


def in_slow_files(nodeid: str) -> bool:
    """Whether the test is in one of $GPU_TEST_SLOW_FILES (default test_mutants.py)."""
    return os.path.basename(nodeid.split("::")[0]) in os.environ.get("GPU_TEST_SLOW_FILES", "test_mutants.py").split()


def guessed_seconds(nodeid: str) -> float:
    """A test no earlier run recorded: long in the slow files, else short."""
    return 100.0 if in_slow_files(nodeid) else 1.0


def _collected(ids) -> None:
    if _STATE["collected"]:
        return
    _STATE["collected"] = True
    _append(os.environ.get("GPU_TESTS_STREAM"), f"+{time.time() - START:6.1f}s collected {len(ids)} tests\n")
    target = os.environ.get("GPU_TESTS_JSON")
    if target:
        with open(os.path.join(os.path.dirname(target), "tests-collected.txt"), "w") as f:
            f.write("".join(f"{i}\n" for i in ids))


def pytest_collection_finish(session):
    if not _is_worker(session.config) and not getattr(session.config.option, "numprocesses", None):
        _collected([item.nodeid for item in session.items])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    _collected(ids)


def test_timeout(nodeid: str) -> float:
    """The watchdog's limit for a test (0: none)."""
    if in_slow_files(nodeid):
        return float(os.environ.get("GPU_TEST_TIMEOUT_SLOW", "240"))
    return float(os.environ.get("GPU_TEST_TIMEOUT", "90"))


def _hang_log(config):
    """The worker's file for the stacks of a test past its limit (opened once, kept open)."""
    if _STATE["hang_log"] is None:
        target = os.environ.get("GPU_TESTS_JSON")
        worker = config.workerinput.get("workerid", "main") if _is_worker(config) else "main"
        folder = os.path.dirname(target) if target else "."
        _STATE["hang_log"] = open(os.path.join(folder, f"hang-{worker}.log"), "a")
    return _STATE["hang_log"]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    limit = test_timeout(item.nodeid)
    if limit <= 0:
        yield
        return
    log = _hang_log(item.config)
    log.write(f"{time.strftime('%H:%M:%S')} start {item.nodeid} (limit {limit:.0f} s)\n")
    log.flush()
    faulthandler.dump_traceback_later(limit, exit=True, file=log)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def _message(report) -> str:
    """The failure's first line (exception and message, at most 800 characters: a long message's
    head names the error) and the end of its traceback, at most 3,000 characters in all."""
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    head = f"{crash.path}:{crash.lineno}: {crash.message}"[:800] if crash else ""
    tail = "\n".join(report.longreprtext.splitlines()[-15:]) if report.longrepr else ""
    return (head + "\n" + tail[-(2999 - len(head)):]).strip()


def pytest_runtest_logreport(report):
    config = _STATE["config"]
    if config is None or _is_worker(config):
        return
    phases = _STATE["phases"].setdefault(report.nodeid, {"seconds": 0.0})
    phases["seconds"] += report.duration
    outcome = None
    if report.when == "call":
        outcome = "xfailed" if hasattr(report, "wasxfail") and report.skipped else report.outcome
    elif report.when == "setup" and not report.passed:
        outcome = "error" if report.failed else "skipped"
    elif report.when == "teardown" and report.failed:
        outcome = "error"
    elif report.when not in ("setup", "call", "teardown") and report.failed:
        outcome = "crashed"  # xdist's report of a test whose worker died (the watchdog, a fault)
    if outcome is None:
        return
    _STATE["counts"][outcome] = _STATE["counts"].get(outcome, 0) + 1
    worker = getattr(getattr(getattr(report, "node", None), "gateway", None), "id", "")
    message = _message(report) if outcome in ("failed", "error", "crashed") else ""
    if outcome == "skipped" and isinstance(report.longrepr, tuple):
        message = str(report.longrepr[2])
    line = (f"+{time.time() - START:6.1f}s {outcome.upper():8s} {report.nodeid}  ({phases['seconds']:.2f} s)"
            f"{' [' + worker + ']' if worker else ''}\n")
    if outcome in ("failed", "error", "crashed"):
        line += "".join(f"    | {text}\n" for text in message.splitlines())
    _append(os.environ.get("GPU_TESTS_STREAM"), line)
    _append(os.environ.get("GPU_TESTS_JSON"), json.dumps({"id": report.nodeid, "outcome": outcome,
                                                          "seconds": round(phases["seconds"], 3),
                                                          "message": message}) + "\n")


def pytest_sessionfinish(session, exitstatus):
    if _is_worker(session.config):
        return
    totals = ", ".join(f"{n} {k}" for k, n in sorted(_STATE["counts"].items())) or "no tests ran"
    _append(os.environ.get("GPU_TESTS_STREAM"),
            f"+{time.time() - START:6.1f}s pytest finished (exit {int(exitstatus)}): {totals}\n")
