"""``nt-kernels check`` (nt_kernels/apps/check.py): it passes on this machine's
CPU build, and it fails (exit status 1, a FAIL row) when a kernel is wrong,
non-deterministic or leaks a NaN into other segments."""
import json
import math

import pytest
import torch

import nt_kernels
from nt_kernels.apps import check
from nt_kernels.cli import main


def run_check(tmp_path, *args):
    out = tmp_path / "check.json"
    status = main(["check", "--device", "cpu", "--json", str(out), *args])
    return status, json.loads(out.read_text())


def test_check_passes_on_cpu(tmp_path, capsys):
    status, doc = run_check(tmp_path, "--dims", "9", "--dtypes", "float32,bfloat16",
                            "--suites", "exact,performer,switch,determinism,nan")
    text = capsys.readouterr().out
    assert status == 0, text
    assert doc["finished"] and doc["ok"]
    rows = doc["rows"]
    assert all(r["status"] == "pass" for r in rows)
    properties = {"bitwise determinism, 2 runs", "NaN stays in its segment and head"}
    assert {r["case"] for r in rows if r["path"] == "exact"} == set(check.EXACT_CASES) | properties
    assert {r["case"] for r in rows if r["path"] == "performer"} == set(check.PERFORMER_CASES) | properties
    assert {(r["path"], r["dtype"]) for r in rows} >= {(p, d) for p in check.PATHS for d in ("float32", "bfloat16")}
    for r in rows:
        if r["case"] not in properties:
            assert 0 <= r["error"] <= r["tolerance"] and r["worst"] in ("o", "dq", "dk", "dv")
    assert "check: " in text and ": OK" in text


def test_head_dims_1_and_256_and_float16(tmp_path):
    status, doc = run_check(tmp_path, "--dims", "1,256", "--dtypes", "float16", "--suites", "exact")
    assert status == 0
    assert {r["dim"] for r in doc["rows"]} == {1, 256}


def test_wrong_kernel_fails(tmp_path, monkeypatch, capsys):
    """A kernel off by 1e-3 relative fails the float32 rule and sets the exit status."""
    true_op = nt_kernels.segment_softmax_attention
    monkeypatch.setattr(nt_kernels, "segment_softmax_attention", lambda *a, **k: true_op(*a, **k) * (1 + 1e-3))
    status, doc = run_check(tmp_path, "--dims", "8", "--dtypes", "float32", "--suites", "exact")
    assert status == 1
    assert all(r["status"] == "FAIL" for r in doc["rows"])
    assert "FAILED" in capsys.readouterr().out


def test_nondeterministic_kernel_fails(tmp_path, monkeypatch):
    true_op = nt_kernels.segment_performer_attention
    noisy = lambda *a, **k: (lambda o: o + 1e-7 * torch.rand_like(o))(true_op(*a, **k))  # noqa: E731
    monkeypatch.setattr(nt_kernels, "segment_performer_attention", noisy)
    status, doc = run_check(tmp_path, "--dtypes", "float32", "--suites", "determinism")
    assert status == 1
    failed = {r["path"] for r in doc["rows"] if r["status"] == "FAIL"}
    assert failed == {"performer"}


def test_nan_leak_fails(tmp_path, monkeypatch):
    """A kernel that lets a NaN reach every segment fails the NaN check."""
    true_op = nt_kernels.segment_softmax_attention

    def leaky(q, k, v, csr, **kwargs):
        o = true_op(q, k, v, csr, **kwargs)
        return o + k.sum() * 0
    monkeypatch.setattr(nt_kernels, "segment_softmax_attention", leaky)
    status, doc = run_check(tmp_path, "--dtypes", "float32", "--suites", "nan")
    assert status == 1
    assert [r["path"] for r in doc["rows"] if r["status"] == "FAIL"] == ["exact"]


def test_missing_data_is_a_skip_line(tmp_path, capsys):
    status, doc = run_check(tmp_path, "--dtypes", "float32", "--suites", "tolokers",
                            "--data-root", str(tmp_path / "nowhere"))
    assert status == 0
    (row,) = doc["rows"]
    assert row["status"] == "skip" and "tolokers.npz not found" in row["note"]
    assert "skip" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a CUDA device")
def test_cuda_without_a_device_exits_2(capsys):
    assert main(["check", "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--dtypes", "float64"], "unknown dtype 'float64'"),
    (["--dims", "0"], "head dims must be in 1..256"),
    (["--suites", "exact,speed"], "unknown suite"),
])
def test_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        main(["check", "--device", "cpu", *args])


def test_accuracy_rule_tolerance():
    """The bound is twice PyTorch's own error in the dtype plus the dtype's floor."""
    s = check.Settings(torch.device("cpu"), (8,), ("float32",), None)
    graph = check.make_graph([3, 0, 5], s.device)
    row = check.accuracy(check.PATHS["exact"], "tiny", graph, 8, "float32", s)
    assert row.status == "pass" and math.isfinite(row.tolerance)
    assert row.tolerance >= check.FLOOR[torch.float32]
