"""scripts/gpu_ncu.py: the tables of the ncu stage from CSV pages, without a GPU.

The raw page of the committed fixture (tests/data/ncu, ncu's layout with invented values) becomes one
summary row and one table per kernel with its values in their units; a source page becomes the lines
with the most stall samples; a page without kernels is an error, not an empty table.
"""
from __future__ import annotations

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "data" / "ncu" / "raw-fixture.csv"
_spec = importlib.util.spec_from_file_location("gpu_ncu", ROOT / "scripts" / "gpu_ncu.py")
gpu_ncu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_ncu)


def test_raw_page_becomes_one_table_per_kernel(tmp_path):
    kernels = gpu_ncu.read_raw(FIXTURE.read_text())
    assert [gpu_ncu.short_name(k["Kernel Name"]) for k in kernels] == [
        "_prologue_kernel", "nt_kernels::performer_simt_keys",
        "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn"]
    first = kernels[0]
    assert gpu_ncu.number(first, "gpu__time_duration.sum") == pytest.approx(1500.0)  # 1.5 us in ns
    assert gpu_ncu.number(first, "dram__bytes_read.sum") == pytest.approx(1.5e6)     # 1.5 Mbyte
    assert gpu_ncu.cell(first, "sectors/request ld", gpu_ncu.MEMORY[3][1]) == "4.0"
    out = tmp_path / "tables.md"
    assert gpu_ncu.main(["table", str(FIXTURE), "--out", str(out)]) == 0
    text = out.read_text()
    assert "| 1 | `nt_kernels::performer_simt_keys` | 2.5 | 17 | 17 | 17 / 17 |" in text
    assert "3 kernels, 0.007 ms in all" in text and text.count("#### ") == 3
    assert "DRAM read MB 3.5" in text and "warp stalls" in text


def test_missing_metric_reads_as_a_dash_and_an_empty_page_fails(tmp_path):
    kernels = gpu_ncu.read_raw(FIXTURE.read_text())
    assert gpu_ncu.cell(kernels[0], "x", "no__such_metric.sum") == "-"
    empty = tmp_path / "raw-empty.csv"
    empty.write_text("==PROF== no kernels were profiled\n")
    assert gpu_ncu.main(["table", str(empty)]) == 1


def test_source_page_gives_the_lines_that_stall_most():
    page = "\n".join([
        '"Kernel Name","_fwd_kernel"',
        '"#","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)"',
        '"10","acc += tl.dot(p, v)","600","500"',
        '"11","m_new = tl.maximum(m, s)","300","250"',
        '"12","tl.store(o_ptr, acc)","100","90"',
        '"13","# a comment","0","0"',
    ])
    lines = gpu_ncu.top_source_lines(page, count=2)["_fwd_kernel"]
    assert lines == ["60.0 %  acc += tl.dot(p, v) (line 10)", "30.0 %  m_new = tl.maximum(m, s) (line 11)"]
