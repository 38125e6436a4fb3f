"""The GPU-run tooling that can be exercised without a GPU: shell syntax of the
scripts, the bundle's source hash, the Triton autotuning switch, the
measurement / environment scripts on CPU (scripts/gpu/gpu_check.sh runs them on
CUDA), a CPU dry run of scripts/gpu/gpu_check.sh and scripts/gpu/gpu_perf.sh (every
stage's commands on small CPU inputs, so that no shell or Python error waits
for a GPU), and the Triton cache tooling of scripts/gpu/gpu_triton.py: kernels
compiled ahead for sm_90 without a GPU are cache hits for the real launches,
also after the cache is packed and unpacked elsewhere; the fused layer's byte model
(scripts/ntconv_bytes.py) against the row classes of tolokers and the figures the docs quote."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHELL_SCRIPTS = ["gpu/gpu_check.sh", "gpu/gpu_perf.sh", "gpu/gpu_perf_ncu.sh", "gpu/gpu_common.sh", "gpu/gpu_bundle.sh",
                 "gpu/build_extension.sh", "cross_check.sh", "cuda_check.sh", "wheel_smoke.sh"]


def run(args, env=None, **kwargs):
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, **kwargs)


def test_gpu_folder_table_matches_its_files_and_scripts_stay_short():
    """scripts/gpu/README.md has one row per file of the folder and none for a file it lacks; no file
    under scripts/ is longer than 300 lines (issue 42)."""
    folder = ROOT / "scripts" / "gpu"
    rows = set(re.findall(r"^\| `([^`]+)` \|", (folder / "README.md").read_text(), re.M))
    files = {p.name for p in folder.iterdir() if p.is_file() and p.name != "README.md" and p.suffix in (".py", ".sh")}
    assert rows == files
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "scripts").rglob("*") if p.is_file() and p.suffix in (".py", ".sh")
            for n in [len(p.read_text().splitlines())] if n > 300}
    assert long == {}


@pytest.mark.parametrize("script", SHELL_SCRIPTS)
def test_shell_syntax(script):
    result = run(["bash", "-n", f"scripts/{script}"])
    assert result.returncode == 0, result.stderr


def test_bundle_source_hash_is_stable():
    first, second = (run(["bash", "scripts/gpu/gpu_bundle.sh", "--hash"]) for _ in range(2))
    assert first.returncode == 0, first.stderr
    assert re.fullmatch(r"[0-9a-f]{16}\n", first.stdout)
    assert first.stdout == second.stdout


def test_bundle_needs_gpu_python():
    """No interpreter is a default: without GPU_PYTHON the bundle stops at once and says what to set."""
    env = {k: v for k, v in os.environ.items() if k != "GPU_PYTHON"}
    result = run(["bash", "scripts/gpu/gpu_bundle.sh"], env=env)
    assert result.returncode == 2 and "set GPU_PYTHON" in result.stderr, result.stderr


@pytest.mark.parametrize("value, expected", [("0", "pinned"), ("1", "tuned")])
def test_triton_autotune_switch(value, expected):
    """NT_KERNELS_TRITON_AUTOTUNE=0 (what the GPU scripts set) times nothing: the exact kernels take their
    config from the table and the fused layer's GEMMs keep one config; =1 times every candidate."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["NT_KERNELS_TRITON_AUTOTUNE"] = value
    code = ("import torch\n"
            "from nt_kernels.backends.triton import configs, ntconv_gemm\n"
            "timed = []\n"
            "time = lambda config: timed.append(config) or float(len(timed))\n"
            "configs.choose('bwd_dkdv', torch.float32, 64, None, 90, 2, time)\n"
            "print(len(timed), len(ntconv_gemm._rows_gemm_kernel.configs))")
    result = run([sys.executable, "-c", code], env=env)
    assert result.returncode == 0, result.stderr
    timed, gemm_configs = (int(c) for c in result.stdout.split())
    if expected == "pinned":
        assert timed == 0 and gemm_configs == 1
    else:
        assert timed > 1 and gemm_configs > 1


def test_roofline_script_on_cpu(tmp_path):
    out = tmp_path / "roofline.json"
    result = run([sys.executable, "scripts/gpu/gpu_measure.py", "roofline", "--device", "cpu", "--edges", "3000",
                  "--heads", "2", "--head-dim", "8", "--reps", "2", "--warmup", "1", "--out", str(out)])
    assert result.returncode == 0, result.stderr
    doc = json.loads(out.read_text())
    assert doc["num_edges"] == 3000 and 1 <= doc["max_degree"] <= 8
    assert doc["forward_bytes"] == 4 * 3000 * 2 * 8 * 4 + 3000 * 2 * 4
    assert doc["forward_ms"] > 0 and doc["copy_gb_per_s"] > 0 and doc["peak_over_essential"] is None


def test_roofline_skips_without_cuda(tmp_path):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("has a CUDA device")
    result = run([sys.executable, "scripts/gpu/gpu_measure.py", "roofline", "--out", str(tmp_path / "r.json")])
    assert result.returncode == 0 and "SKIP (no CUDA device)" in result.stdout


def test_env_script_on_cpu(tmp_path):
    out = tmp_path / "env.json"
    result = run([sys.executable, "scripts/gpu/gpu_env.py", "--json", str(out)])
    assert result.returncode == 0, result.stdout + result.stderr
    doc = json.loads(out.read_text())
    assert doc["versions"]["torch"] and doc["extension"]["torch"]
    assert set(doc["data"]) == {"tolokers", "minesweeper"}
    assert "exact" in doc["kernels"] and "performer" in doc["kernels"]


def shell_value(script: str, name: str) -> str:
    match = re.search(rf"^\s*{name}=(\S+)", (ROOT / "scripts" / "gpu" / script).read_text(), re.M)
    assert match, f"{name} not set in {script}"
    return match.group(1)


def test_warm_workload_covers_the_check():
    """The warm (and the ahead-of-time cache) compile every head dim and dtype the check runs."""
    from nt_kernels.apps import check

    dims = {int(d) for d in shell_value("gpu_common.sh", "WARM_DIMS").split(",")}
    assert set(check.DIMS) <= dims
    assert shell_value("gpu_common.sh", "WARM_DTYPES").split(",") == list(check.DTYPES)
    assert shell_value("gpu_check.sh", "CHECK_DTYPES").split(",") == list(check.DTYPES)
    suites = set(shell_value("gpu_common.sh", "WARM_SUITES").split(","))
    assert suites == set(check.SUITES) - {"performer"}  # the Performer path is CUDA C++: nothing to compile


def dry_env(tmp_path, name):
    env = dict(os.environ, OUT=str(tmp_path / f"{name}-out"), GPU_WORK=str(tmp_path / f"{name}-work"),
               GPU_SITE="installed", GPU_PYTHON=sys.executable, GPU_TRITON_CACHE=str(tmp_path / "triton-cache"))
    return env


@pytest.fixture(scope="module")
def check_dry_run(tmp_path_factory):
    """scripts/gpu/gpu_check.sh without a GPU (stages 1-3 and 5), once for the tests below; the sanitize stage
    beside stages 2-3, as it runs on CUDA (GPU_SANITIZE_PARALLEL=force)."""
    pytest.importorskip("triton")
    tmp = tmp_path_factory.mktemp("gpu-check")
    result = run(["bash", "scripts/gpu/gpu_check.sh"], env=dict(dry_env(tmp, "check"), GPU_SANITIZE_PARALLEL="force"))
    return tmp, result


HUNG_TESTS = """
import time
import pytest

@pytest.mark.parametrize("i", range(4))
def test_rows(i):
    if i == 1:
        time.sleep(120)  # a hung kernel
    assert i >= 0

def test_long_message():
    raise RuntimeError("HEAD " + "x" * 5000 + " TAIL")
"""


def test_stage_3_watchdog_ends_a_hung_test_and_the_rest_run(tmp_path):
    """gpu_pytest_stream.py: a test past GPU_TEST_TIMEOUT has its worker ended with every thread's stack
    in hang-<worker>.log; xdist reports it as crashed and a fresh worker runs the rest; a long failure
    message keeps its head (the error's name) as well as its tail (gpu_check_summary.py reads both)."""
    pytest.importorskip("xdist")
    (tmp_path / "test_hung.py").write_text(HUNG_TESTS)
    (tmp_path / "json").mkdir()
    env = dict(os.environ, GPU_TEST_TIMEOUT="4", GPU_TESTS_STREAM=str(tmp_path / "stream.log"),
               GPU_TESTS_JSON=str(tmp_path / "json" / "tests.jsonl"),
               PYTHONPATH=os.pathsep.join([str(ROOT / "scripts" / "gpu"), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "gpu_pytest_stream", "-p", "no:cacheprovider",
                             "-q", "-n", "2", "--dist", "worksteal", "test_hung.py"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert result.returncode == 1, result.stdout[-2000:]
    outcomes = {r["id"].split("::")[1]: r for r in map(json.loads, (tmp_path / "json" / "tests.jsonl").open())}
    assert {k: r["outcome"] for k, r in outcomes.items()} == {
        "test_rows[0]": "passed", "test_rows[1]": "crashed", "test_rows[2]": "passed", "test_rows[3]": "passed",
        "test_long_message": "failed"}
    assert "crashed while running" in outcomes["test_rows[1]"]["message"]
    message = outcomes["test_long_message"]["message"]
    assert "RuntimeError: HEAD" in message and "TAIL" in message and len(message) <= 3000
    hangs = [p.read_text() for p in (tmp_path / "json").glob("hang-*.log")]
    assert sum("Timeout (0:00:04)!" in h and "test_hung.py\", line 8 in test_rows" in h for h in hangs) == 1
    sys.path.insert(0, str(ROOT / "scripts" / "gpu"))
    try:
        import gpu_check_summary
    finally:
        sys.path.pop(0)
    summary = gpu_check_summary.test_outcomes(str(tmp_path))
    assert summary["outcomes"] == {"passed": 3, "crashed": 1, "failed": 1}
    assert len(summary["hang_logs"]) == 1
    assert sum(f.startswith("[crashed] test_hung.py::test_rows[1]") for f in summary["failed"]) == 1


def test_sanitizer_summaries_count_reports_not_summary_lines(tmp_path):
    """gpu_check_summary.sanitizer_runs: racecheck's summary line ("RACECHECK SUMMARY", H200 2026-11-28c) is its
    summary, not an error report; a hazard line is one."""
    (tmp_path / "logs").mkdir()
    banner = "========= COMPUTE-SANITIZER\n"
    (tmp_path / "logs" / "sanitize-racecheck.log").write_text(
        banner + "performer flash torch.bfloat16: segments of [0, 1] rows\n"
        "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n")
    (tmp_path / "logs" / "sanitize-memcheck.log").write_text(
        banner + "========= Invalid __global__ read of size 4 bytes\n========= ERROR SUMMARY: 1 error\n")
    sys.path.insert(0, str(ROOT / "scripts" / "gpu"))
    try:
        import gpu_check_summary
    finally:
        sys.path.pop(0)
    runs = gpu_check_summary.sanitizer_runs(str(tmp_path))
    assert runs["racecheck"]["summary"].startswith("========= RACECHECK SUMMARY: 0 hazards")
    assert runs["racecheck"]["errors_reported"] == 0
    assert runs["racecheck"]["workloads_started"] == ["performer flash torch.bfloat16: segments of [0, 1] rows"]
    assert runs["memcheck"] == {"summary": "========= ERROR SUMMARY: 1 error", "errors_reported": 1,
                                "workloads_started": []}


def test_stage_3_runs_the_tests_longest_first_by_earlier_runs(tmp_path):
    """gpu_pytest_stream.py with GPU_TESTS_DURATIONS: the recorded seconds order the tests (later files win);
    a test no run recorded counts 100 s in test_mutants.py, 1 s elsewhere; the sort is stable."""
    (tmp_path / "test_a.py").write_text("".join(f"def test_{n}():\n    pass\n" for n in "pqrs"))
    (tmp_path / "test_mutants.py").write_text("def test_m():\n    pass\n")
    old, new = tmp_path / "old.jsonl", tmp_path / "new.jsonl"
    old.write_text(json.dumps({"id": "test_a.py::test_q", "seconds": 500.0}) + "\n")
    new.write_text("".join(json.dumps({"id": f"test_a.py::test_{n}", "seconds": t}) + "\n"
                           for n, t in [("q", 2.0), ("r", 300.0)]))
    env = dict(os.environ, GPU_TESTS_DURATIONS=f"{old} {new} {tmp_path / 'missing.jsonl'}",
               PYTHONPATH=os.pathsep.join([str(ROOT / "scripts" / "gpu"), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "gpu_pytest_stream", "-p", "no:cacheprovider",
                             "--collect-only", "-q", "test_a.py", "test_mutants.py"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    order = [line.split("::")[1] for line in result.stdout.splitlines() if "::" in line]
    assert order == ["test_r", "test_m", "test_q", "test_p", "test_s"], result.stdout


PROFILE_WITH_HANG = """
import sys, time
sys.path.insert(0, sys.argv[1])
import gpu_profile
def fake(args, variant, device):
    if variant == sys.argv[2]:
        time.sleep(120)  # a hung kernel
    return {"variant": variant, "status": "ok", "step_ms": 1.0}
gpu_profile.profile_variant = fake
gpu_profile.print_variant = lambda entry, device: None
sys.exit(gpu_profile.main(["--device", "cpu", "--variants", "fused,fused:flash,unfused", "--json", sys.argv[3],
                           "--resume", "--variant-timeout", "3"]))
"""


def test_layer_stage_records_a_hung_variant_and_resumes_after_it(tmp_path):
    """gpu_profile.py --variant-timeout: a variant that hangs is in the JSON as a timeout and ends the
    process; --resume (the next process of gpu_perf.sh's layer stage) runs only the variants after it."""
    script, out = tmp_path / "hang.py", tmp_path / "layer.json"
    script.write_text(PROFILE_WITH_HANG)
    first = run([sys.executable, str(script), str(ROOT / "scripts" / "gpu"), "fused:flash", str(out)])
    assert first.returncode != 0 and "Timeout (0:00:03)!" in first.stderr
    assert [(e["variant"], e["status"]) for e in json.loads(out.read_text())["variants"]] == [
        ("fused", "ok"), ("fused:flash", "timeout: not finished in 3 s")]
    second = run([sys.executable, str(script), str(ROOT / "scripts" / "gpu"), "none", str(out)])
    assert second.returncode == 1, second.stderr[-2000:]  # not every variant is ok
    assert [(e["variant"], e["status"]) for e in json.loads(out.read_text())["variants"]] == [
        ("fused", "ok"), ("fused:flash", "timeout: not finished in 3 s"), ("unfused", "ok")]


@pytest.mark.xdist_group("check_dry_run")  # the module fixture check_dry_run once, on one worker
def test_gpu_check_dry_run(check_dry_run):
    tmp, result = check_dry_run
    out = tmp / "check-out"
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert {p.name for p in out.iterdir()} == {"1-env.log", "2-check.log", "3-tests.log", "5-sanitize.log",
                                              "summary.json", "results.tar.gz"}
    summary = json.loads((out / "summary.json").read_text())
    assert {name: s["status"] for name, s in summary["stages"].items()} == {"env": "ok", "check": "ok", "tests": "ok",
                                                                           "sanitize": "ok"}
    sanitize_log = (out / "5-sanitize.log").read_text()  # the workloads ran on CPU: no tool, no summary line
    assert "SKIP compute-sanitizer" in sanitize_log and "gpu_sanitize: OK" in sanitize_log
    assert summary["sanitize"] == {}
    check = summary["check"]
    assert check["rows"] > 10 and check["passed"] == check["rows"] and not check["unfinished"]
    rows = [line for line in (out / "2-check.log").read_text().splitlines() if line.startswith("[d8] exact")]
    assert len(rows) == 5                                           # streamed with their shard's name
    tests = summary["tests"]
    assert tests["outcomes"].get("passed", 0) > 5 and not tests["failed"] and tests["unfinished"] == []
    assert tests["collected"] == sum(tests["outcomes"].values())
    assert "PASSED   tests/test_segment_table.py::" in (out / "3-tests.log").read_text()
    warm = summary["triton"]["warm"]                                # compiled for sm_90 without a GPU
    assert warm["compiled"] >= 5 and warm["loads"] == warm["compiled"]
    check_log = (out / "2-check.log").read_text()
    assert "triton (warm):" in check_log and "0 compiled twice" in check_log


@pytest.mark.xdist_group("check_dry_run")  # the module fixture check_dry_run once, on one worker
def test_compiled_ahead_kernels_are_cache_hits(check_dry_run, tmp_path):
    """The kernels the dry run's warm compiled (check --kernels-only, sm_90, no GPU) are what the real
    check's launches load: every load a hit, from the cache as it is and after pack (xz, as the bundle) + unpack
    elsewhere."""
    tmp, _ = check_dry_run
    cache, log = tmp / "triton-cache", tmp / "check-work" / "logs" / "triton.jsonl"
    moved = tmp_path / "moved-cache"
    for args in (["pack", str(cache), str(tmp_path / "cache.tar.xz"), "--log", str(log)],
                 ["unpack", str(tmp_path / "cache.tar.xz"), str(moved)]):
        result = run([sys.executable, "scripts/gpu/gpu_triton.py", *args])
        assert result.returncode == 0, result.stderr
    for where in (cache, moved):
        consumer = tmp_path / f"{where.name}.jsonl"
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.update(TRITON_CACHE_DIR=str(where), NT_KERNELS_TRITON_AUTOTUNE="0")
        result = run([sys.executable, "-P", "scripts/gpu/gpu_triton.py", "worker", "--fake-target", "--log", str(consumer),
                      "--tag", "real", "--", "check", "--device", "cpu", "--dims", "8", "--dtypes", "float32",
                      "--suites", "exact"], env=env)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        counts = json.loads(run([sys.executable, "scripts/gpu/gpu_triton.py", "summary", str(consumer), "--json"]).stdout)
        assert counts["loads"] >= 5 and counts["hits"] == counts["loads"], (where, counts)


@pytest.mark.xdist_group("check_dry_run")  # the module fixture check_dry_run once, on one worker
def test_logged_specialisations_replay_into_cache_hits(check_dry_run, tmp_path):
    """The specialisations the dry run logged (JITFunctions, autotuned ones included), replayed into an empty
    cache with the compile-only target (what make gpu-bundle does with earlier GPU runs' triton-specs.jsonl.gz),
    are every one compiled, and the real check's launches then load them all as cache hits."""
    tmp, _ = check_dry_run
    log = tmp / "check-work" / "logs" / "triton.jsonl"
    cache, replay_log = tmp_path / "replayed", tmp_path / "replay.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(cache), NT_KERNELS_TRITON_AUTOTUNE="0", NT_TRITON_LOG=str(replay_log),
               NT_TRITON_TAG="replay")
    result = run([sys.executable, "-P", "scripts/gpu/gpu_triton.py", "replay", "--fake-target", "--shard", "0/1", str(log)],
                 env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    specs = {json.loads(line)["spec"] for line in log.read_text().splitlines() if '"event": "spec"' in line}
    assert f"{len(specs)} of {len(specs)} specialisations compiled or found" in result.stdout and len(specs) >= 5
    consumer = tmp_path / "consumer.jsonl"
    env.pop("NT_TRITON_LOG")
    result = run([sys.executable, "-P", "scripts/gpu/gpu_triton.py", "worker", "--fake-target", "--log", str(consumer),
                  "--tag", "real", "--", "check", "--device", "cpu", "--dims", "8", "--dtypes", "float32",
                  "--suites", "exact"], env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    counts = json.loads(run([sys.executable, "scripts/gpu/gpu_triton.py", "summary", str(consumer), "--json"]).stdout)
    assert counts["loads"] >= 5 and counts["hits"] == counts["loads"], counts


def doc_stage_order(stdout: str) -> list[str]:
    """The stages a GPU script's output says it started, in order."""
    return re.findall(r"^== stage \S+ (\w+) \(limit", stdout, re.M)


def test_gpu_perf_dry_run(tmp_path):
    pytest.importorskip("triton")
    result = run(["bash", "scripts/gpu/gpu_perf.sh"], env=dict(
        dry_env(tmp_path, "perf"), GPU_PERF_BLOCKS="1", GPU_NCU_VARIANTS="fused,fused:pipe@^_reduce_kernel$",
        GPU_PERF_LAYER_VARIANTS="fused,fused:recompute,fused:stream,fused:stream:pipe,unfused"))
    out = tmp_path / "perf-out"
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert {p.name for p in out.iterdir()} == {"0-env.log", "1-layer.log", "2-steps.log", "3-powerlaw.log",
                                              "4-roofline.log", "7-tune.log", "5-op.log", "6-ncu.log", "perf.json",
                                              "results.tar.gz"}
    tune = (out / "7-tune.log").read_text()  # the tuner's candidates of one key compiled for sm_90, untimed
    assert "tune --compile-only: 6 of 6 candidates of 1 keys launched" in tune, tune[-2000:]
    assert doc_stage_order(result.stdout) == ["env", "layer", "steps", "powerlaw", "roofline", "tune", "op", "ncu"]
    doc = json.loads((out / "perf.json").read_text())
    assert {v["variant"]: v["status"] for v in doc["layer"]["variants"]} == {
        "fused": "ok", "fused:recompute": "ok", "fused:stream": "ok", "fused:stream:pipe": "ok", "unfused": "ok"}
    assert doc["steps"]["compiles"]["steps"] == 2 and doc["steps"]["cuda_graph"] == {"skipped": "needs CUDA"}
    assert all(len(v["top_kernels"]) == 15 for v in doc["layer"]["variants"])
    assert doc["op_exact"]["backends"]["fused"]["status"] == "ok"
    assert doc["op_performer"]["backends"]["fused"]["status"] == "ok"
    assert doc["roofline"]["forward_ms"] > 0
    # GPU_PERF_BLOCKS=1: the exact subset and the roofline again with NT_KERNELS_EXACT_BLOCKS=1 (the CPU kernels
    # take no plan, so here this runs the commands only)
    assert doc["op_exact_blocks"]["backends"]["fused"]["status"] == "ok" and doc["roofline_blocks"]["forward_ms"] > 0
    assert "op exact blocks" in result.stdout and "roofline (row blocks)" in result.stdout
    assert doc["powerlaw"]["results"][0]["status"] == "ok" and len(doc["powerlaw"]["results"][0]["step_ms_runs"]) == 2
    assert "== gpu_perf summary" in result.stdout and "layer tolokers: fused" in result.stdout
    ncu = (out / "6-ncu.log").read_text()  # the profiled program ran, and the fixture became tables
    assert "SKIP ncu" in ncu and "gpu_ncu layer: tolokers fused on cpu" in ncu and "3 launches" in ncu
    # each variant's kernel filter: the project's kernels, or the variant's own regex (VARIANT@REGEX)
    assert "  fused: nt_kernels::|" in ncu and "  fused:pipe: ^_reduce_kernel$" in ncu


def test_fingerprint_and_compare(tmp_path):
    """The fingerprint names what Triton's cache key holds besides the kernel; --compare fails on a difference."""
    pytest.importorskip("triton")
    mine = tmp_path / "mine.json"
    result = run([sys.executable, "scripts/gpu/gpu_triton.py", "fingerprint", "--out", str(mine)])
    assert result.returncode == 0, result.stderr
    doc = json.loads(mine.read_text())
    assert set(doc) == {"triton", "triton_key", "ptxas", "backend", "options", "env"}
    assert run([sys.executable, "scripts/gpu/gpu_triton.py", "fingerprint", "--compare", str(mine)]).returncode == 0
    other = tmp_path / "other.json"
    other.write_text(json.dumps(dict(doc, triton_key="0" * 16)))
    result = run([sys.executable, "scripts/gpu/gpu_triton.py", "fingerprint", "--compare", str(other)])
    assert result.returncode == 3 and "triton_key" in result.stdout


def _bytes_model():
    """scripts/ntconv_bytes.py as a module (it is a script, not part of the package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("ntconv_bytes", ROOT / "scripts" / "ntconv_bytes.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_bytes_model_counts_tolokers_and_docs_quote_it():
    """The byte model's built-in row classes are tolokers' (packed / multi-tile exact, Performer), and the
    totals the pages docs/kernels-ntconv-cuda*.md quote for issue 19's code, the stored path and the sm_90 path are the
    model's (so the page cannot keep a figure the script no longer gives)."""
    m = _bytes_model()
    assert m.graph_classes("tolokers", 30, 102) == m.Classes()
    att = m.attention(m.Classes(), 60, 2, 2, 102)
    totals = []
    for before, stored in ((True, False), (False, True), (False, False)):
        rows = m.kernels(m.Classes().rows, m.Classes().nodes, 60, 120, 2, 0, 2, 2, 4 if before else 2, not before, True, att,
                         rows_in_plan=not before, sm90=not (before or stored))
        totals.append(f"**{sum(r[2] for r in rows) / 1e9:.2f} GB**")
    page = "\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("kernels-ntconv-cuda*.md")))
    assert f"| | **total** | {' | '.join(totals)} |" in page
    floor = sum(b for _, _, b in m.floor(m.Classes().rows, 60, 2, 2, att))
    assert f"**{floor / 1e9:.2f} GB**" in page
    # issue 40: the streaming design's bytes and each design's layer bound (the larger of bytes and latency per
    # kernel) as the page's table of the three designs quotes them
    bounds = []
    for stored, stream in ((True, False), (False, False), (False, True)):
        rows = m.kernels(m.Classes().rows, m.Classes().nodes, 60, 120, 2, 0, 2, 2, 2, True, True, att,
                         sm90=not (stored or stream), stream=stream)
        if stream:
            assert f"**{sum(r[2] for r in rows) / 1e9:.2f} GB**" in page
        bound = 0.0
        for r in rows:
            t = max(r[2] / m.BANDWIDTH, r[3] / m.TENSOR_FLOPS)
            bound += t if r[6] is None else max(t, m.latency_time(r[6], m.Classes().rows, r[5], r[7])[1])
        bounds.append(f"{bound * 1e3:.2f} ms")
    assert f"| layer bound (larger per kernel) | {' | '.join(bounds)} |" in page


def test_bundle_staleness_follows_kernel_sources_and_lines(tmp_path):
    """`gpu_triton.py sources` digests each jit function's source and starting line (what Triton's cache key
    takes from it): a line moved above a function changes its digest, and --compare (gpu_bundle.sh --check)
    names the functions whose digests differ from a bundle's."""
    pytest.importorskip("triton")
    sys.path.insert(0, str(ROOT / "scripts" / "gpu"))
    import importlib.util

    import gpu_triton
    import gpu_triton_cache

    digests = []
    for i, prefix in enumerate(("", "", "\n")):
        path = tmp_path / f"kernel{i}.py"
        path.write_text(prefix + "def kernel(x):\n    return x + 1\n")
        spec = importlib.util.spec_from_file_location(f"kernel{i}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        digests.append(gpu_triton_cache.digest(module.kernel))
    assert digests[0] == digests[1] != digests[2], "same source and line: same digest; a moved line: another"
    mine = gpu_triton_cache.sources()
    assert {"softmax_fwd._fwd_packed_kernel", "common.packed_rows", "common.block_rows"} <= set(mine)
    out = tmp_path / "sources.json"
    assert gpu_triton.main(["sources", "--out", str(out)]) == 0
    assert gpu_triton.main(["sources", "--compare", str(out)]) == 0
    old = json.loads(out.read_text())
    old["common.packed_rows"] = "0" * 16
    out.write_text(json.dumps(old))
    assert gpu_triton.main(["sources", "--compare", str(out)]) == 3
    assert gpu_triton_cache.stale(mine, old) == ["common.packed_rows"]
