"""The GPU-run tooling that can be exercised without a GPU: shell syntax of the
scripts, the bundle's source hash, the Triton autotuning switch, and the
measurement / environment scripts on CPU (scripts/gpu_check.sh runs them on CUDA)."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHELL_SCRIPTS = ["gpu_check.sh", "gpu_bundle.sh", "build_extension.sh", "cross_check.sh", "cuda_check.sh"]


def run(args, env=None, **kwargs):
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, **kwargs)


@pytest.mark.parametrize("script", SHELL_SCRIPTS)
def test_shell_syntax(script):
    result = run(["bash", "-n", f"scripts/{script}"])
    assert result.returncode == 0, result.stderr


def test_bundle_source_hash_is_stable():
    first, second = (run(["bash", "scripts/gpu_bundle.sh", "--hash"]) for _ in range(2))
    assert first.returncode == 0, first.stderr
    assert re.fullmatch(r"[0-9a-f]{16}\n", first.stdout)
    assert first.stdout == second.stdout


@pytest.mark.parametrize("value, expected", [("0", "pinned"), ("1", "tuned")])
def test_triton_autotune_switch(value, expected):
    """NT_KERNELS_TRITON_AUTOTUNE=0 leaves one config per kernel (the first); the default tunes over several."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["NT_KERNELS_TRITON_AUTOTUNE"] = value
    code = ("from nt_kernels.backends.triton import softmax_bwd as b, softmax_fwd as f\n"
            "ks = [f._fwd_packed_kernel, f._fwd_multi_kernel, b._bwd_packed_kernel, b._bwd_dq_kernel, "
            "b._bwd_dkdv_kernel]\n"
            "print(','.join(str(len(k.configs)) for k in ks))")
    result = run([sys.executable, "-c", code], env=env)
    assert result.returncode == 0, result.stderr
    counts = [int(c) for c in result.stdout.strip().split(",")]
    if expected == "pinned":
        assert counts == [1] * 5
    else:
        assert all(c > 1 for c in counts)


def test_roofline_script_on_cpu(tmp_path):
    out = tmp_path / "roofline.json"
    result = run([sys.executable, "scripts/gpu_measure.py", "roofline", "--device", "cpu", "--edges", "3000",
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
    result = run([sys.executable, "scripts/gpu_measure.py", "roofline", "--out", str(tmp_path / "r.json")])
    assert result.returncode == 0 and "SKIP (no CUDA device)" in result.stdout


def test_env_script_on_cpu(tmp_path):
    out = tmp_path / "env.json"
    result = run([sys.executable, "scripts/gpu_env.py", "--json", str(out)])
    assert result.returncode == 0, result.stdout + result.stderr
    doc = json.loads(out.read_text())
    assert doc["versions"]["torch"] and doc["extension"]["torch"]
    assert set(doc["data"]) == {"tolokers", "minesweeper"}
    assert "exact" in doc["kernels"] and "performer" in doc["kernels"]
