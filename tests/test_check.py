"""``nt-kernels check`` (nt_kernels/apps/check.py): it passes on this machine's
CPU build, and it fails (exit status 1, a FAIL row) when a kernel is wrong,
non-deterministic or leaks a NaN into other segments."""
import json
import math

import pytest
import torch

import nt_kernels
from nt_kernels.apps import check, tolerance
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
            assert math.isfinite(r["tolerance"]) and r["baseline"] == r["dtype"]
            assert 0 < r["bound_ratio"] <= tolerance.CAP and r["bound_worst"] in ("o", "dq", "dk", "dv")
        assert r["seconds"] >= 0
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
    status, doc = run_check(tmp_path, "--dims", "9,23", "--dtypes", "float32", "--suites", "determinism")
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
    status, doc = run_check(tmp_path, "--dims", "9,23", "--dtypes", "float32", "--suites", "nan")
    assert status == 1
    assert [(r["path"], r["dim"]) for r in doc["rows"] if r["status"] == "FAIL"] == [("exact", 9), ("exact", 23)]


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


def test_every_tolerance_is_finite(tmp_path, capsys):
    """No row's tolerance is infinite or NaN, float16 included: where PyTorch's float16 baseline
    overflows (the Performer reference on the ntconv hub graph here), the float32 rule takes over
    and the table marks it."""
    status, doc = run_check(tmp_path, "--dims", "9", "--dtypes", "float16", "--suites", "exact,performer,switch,ntconv")
    assert status == 0, capsys.readouterr().out
    checked = [r for r in doc["rows"] if r["status"] != "skip"]
    assert len(checked) > 10
    assert all(math.isfinite(r["tolerance"]) and r["tolerance"] > 0 for r in checked if r["note"] == "")
    substituted = {b for r in checked for b in (r["baseline"], r["bound_baseline"]) if b.startswith("float32 x")}
    assert substituted == {"float32 x 8192"}
    assert check.SUBSTITUTED + " tolerance from the float32 baseline" in capsys.readouterr().out


def overflowing_performer_row(s, factor=1.0, monkeypatch=None):
    """The float16 Performer on one 300-row segment (D = 64, one head): PyTorch's float16 reference
    overflows there on the CPU; ``factor`` scales the kernel's output (1.25: a wrong kernel)."""
    if factor != 1.0:
        true_op = nt_kernels.segment_performer_attention
        monkeypatch.setattr(nt_kernels, "segment_performer_attention", lambda *a, **k: true_op(*a, **k) * factor)
    graph = check.make_graph([300], s.device)
    return check.accuracy(check.PATHS["performer"], "overflow", graph, 64, "float16", s, heads=1)


def test_overflowing_baseline_uses_the_float32_rule(monkeypatch):
    s = check.Settings(torch.device("cpu"), (64,), ("float16",), None)
    row = overflowing_performer_row(s)
    assert row.bound_baseline == "float32 x 8192" and row.status == "pass"  # on the gradients
    assert math.isfinite(row.tolerance) and row.bound_ratio <= tolerance.CAP
    wrong = overflowing_performer_row(s, 1.25, monkeypatch)
    assert wrong.status == "FAIL" and wrong.bound_baseline == "float32 x 8192" and math.isfinite(wrong.tolerance)


@pytest.mark.parametrize("fault", [0.0, 1.1], ids=["zeroed", "x1.1"])
def test_float16_performer_at_d53_fails_a_broken_kernel(fault, monkeypatch):
    """Issue 32: PyTorch's float16 Performer at D = 53 is finite but so coarse (its error on o was
    1.8 for max|o| = 3.4) that a zeroed output passed; the rule now takes the float32 baseline x 8192
    there, the bound is within 10 % of max|reference|, and a zeroed or scaled output fails."""
    s = check.Settings(torch.device("cpu"), (53,), ("float16",), None)
    graph = check.make_graph(check.PERFORMER_CASES["chunk edges"], s.device)
    clean = check.accuracy(check.PATHS["performer"], "chunk edges", graph, 53, "float16", s)
    assert clean.status == "pass" and clean.bound_ratio <= tolerance.CAP
    assert "float32 x 8192" in (clean.baseline, clean.bound_baseline)
    true_op = nt_kernels.segment_performer_attention
    monkeypatch.setattr(nt_kernels, "segment_performer_attention", lambda *a, **k: true_op(*a, **k) * fault)
    assert check.accuracy(check.PATHS["performer"], "chunk edges", graph, 53, "float16", s).status == "FAIL"


@pytest.mark.parametrize("base, f32, expected, label", [
    (1e-3, 5.0, 2e-3, "float16"),                     # a finite baseline below 4 x the scaled float32 one
    (math.inf, 1e-7, 2 * 1e-7 * 8192, "float32 x 8192"),  # overflow: float32 error x eps ratio
    (math.nan, 1e-7, 2 * 1e-7 * 8192, "float32 x 8192"),
    (1e-2, 1e-7, 2 * 1e-7 * 8192, "float32 x 8192"),      # finite, but > 4 x float32's x 8192: too coarse
    (math.inf, math.inf, 0.0, "float32 x 8192"),           # both non-finite: the floor alone
], ids=["finite", "inf", "nan", "too-coarse", "both-inf"])
def test_bound_is_always_finite(base, f32, expected, label):
    want = torch.tensor([0.5, -3.0, math.inf])   # the floor and the cap scale with the finite max, here 3
    bound = tolerance.low_precision_bound(torch.float16, want, base, f32)
    assert math.isfinite(bound.value) and bound.baseline == label and bound.substituted == (label != "float16")
    assert bound.value == pytest.approx(expected + tolerance.FLOOR[torch.float16] * 3.0)
    assert bound.scale == 3.0


def test_bound_above_the_cap_fails_and_says_why():
    """A bound above 10 % of max|reference| fails even an exact answer."""
    want = torch.tensor([1.0, -2.0])
    bound = tolerance.low_precision_bound(torch.bfloat16, want, 0.15, 1e-6)  # 0.15 < 4 x 1e-6 x 65536
    assert not bound.within_cap and bound.ratio == pytest.approx((0.3 + 0.032) / 2)
    assert "above the cap of 0.10" in bound.failure(0.0)
    fine = tolerance.low_precision_bound(torch.bfloat16, want, 0.01, 1e-6)
    assert fine.within_cap and fine.failure(0.01) == "" and "error" in fine.failure(0.1)


def test_better_conditioned_baseline_takes_over_above_the_cap():
    """float32 on the rounded inputs is asked for (lazily) only when the other bound is above the cap;
    if its bound is above the cap too, the comparison still fails."""
    want = torch.tensor([1.0, -2.0])
    bound = tolerance.low_precision_bound(torch.bfloat16, want, 0.15, 1e-6, mixed_error=0.01)
    assert bound.within_cap and bound.baseline == "float32 on bfloat16 inputs" and "above the cap" in bound.reason
    assert bound.value == pytest.approx(2 * 0.01 + 0.032)
    asked = []
    fine = tolerance.low_precision_bound(torch.bfloat16, want, 0.01, 1e-6, mixed_error=lambda: asked.append(1) or 0.0)
    assert fine.baseline == "bfloat16" and not asked
    still = tolerance.low_precision_bound(torch.bfloat16, want, 0.15, 1e-6, mixed_error=0.09)
    assert not still.within_cap and "above the cap" in still.failure(0.0)


def test_a_zero_reference_is_measured_against_the_row():
    """dq of the Performer with one feature is zero up to float64 rounding: its bound is relative to
    the row's largest reference, not to 1e-16."""
    want = torch.tensor([4e-16, -1e-17])
    alone = tolerance.low_precision_bound(torch.bfloat16, want, 0.02, 0.02 / 65536)
    assert not alone.within_cap
    in_row = tolerance.low_precision_bound(torch.bfloat16, want, 0.02, 0.02 / 65536, row_scale=3.0)
    assert in_row.scale == 3.0 and in_row.within_cap and in_row.failure(3e-7) == ""
    assert tolerance.reference_scale(torch.tensor([0.5, 1.0]), row_scale=3.0) == 1.0


def test_a_row_whose_bound_is_above_the_cap_fails(monkeypatch):
    """The check's verdict: a row passes only when every tensor's bound is within the cap."""
    monkeypatch.setattr(tolerance, "CAP", 1e-6)
    s = check.Settings(torch.device("cpu"), (8,), ("bfloat16",), None)
    row = check.accuracy(check.PATHS["exact"], "tiny", check.make_graph([3, 0, 5], s.device), 8, "bfloat16", s)
    assert row.status == "FAIL" and "above the cap" in row.note


def test_kernels_only_runs_the_kernels_without_verdicts(tmp_path):
    status, doc = run_check(tmp_path, "--dims", "8", "--dtypes", "float32", "--suites", "exact,nan",
                            "--kernels-only")
    assert status == 0
    assert {r["status"] for r in doc["rows"]} == {"skip"} and {r["note"] for r in doc["rows"]} == {"kernels only"}
    assert len(doc["rows"]) == len(check.EXACT_CASES) + len(check.PATHS)


def test_accuracy_rule_tolerance():
    """The bound is twice PyTorch's own error in the dtype plus the dtype's floor."""
    s = check.Settings(torch.device("cpu"), (8,), ("float32",), None)
    graph = check.make_graph([3, 0, 5], s.device)
    row = check.accuracy(check.PATHS["exact"], "tiny", graph, 8, "float32", s)
    assert row.status == "pass" and 0 < row.tolerance < math.inf
    assert tolerance.FLOOR[torch.float32] <= row.bound_ratio <= tolerance.CAP
