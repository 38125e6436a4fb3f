"""scripts/gpu/gpu_ncu.py table (scripts/gpu/gpu_ncu_tables.py): the tables of the ncu stage from CSV pages,
without a GPU.

The raw page of the committed fixture (tests/data/ncu, ncu's layout with invented values) becomes one
summary row and one table per kernel with its values in their units; a source page becomes the lines
with the most stall samples; a page without kernels is an error, not an empty table.
"""
from __future__ import annotations

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "data" / "ncu" / "raw-fixture.csv"
sys.path.insert(0, str(ROOT / "scripts" / "gpu"))
import gpu_ncu  # noqa: E402
import gpu_ncu_tables as tables  # noqa: E402


def test_raw_page_becomes_one_table_per_kernel(tmp_path):
    kernels = tables.read_raw(FIXTURE.read_text())
    assert [tables.short_name(k["Kernel Name"]) for k in kernels] == [
        "_prologue_kernel", "nt_kernels::performer_simt_keys",
        "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn"]
    first = kernels[0]
    assert tables.number(first, "gpu__time_duration.sum") == pytest.approx(1500.0)  # 1.5 us in ns
    assert tables.number(first, "dram__bytes_read.sum") == pytest.approx(1.5e6)     # 1.5 Mbyte
    assert tables.cell(first, "sectors/request ld", tables.MEMORY[3][1]) == "4.0"
    out = tmp_path / "tables.md"
    assert gpu_ncu.main(["table", str(FIXTURE), "--out", str(out)]) == 0
    text = out.read_text()
    assert "| 1 | `nt_kernels::performer_simt_keys` | 2.5 | 17 | 17 | 17 / 17 |" in text
    assert "3 launches, 0.007 ms in all" in text and text.count("#### ") == 3  # each above 1 % of the time
    assert "DRAM read MB 3.5" in text and "warp stalls" in text


def test_missing_metric_reads_as_a_dash_and_an_empty_page_fails(tmp_path):
    kernels = tables.read_raw(FIXTURE.read_text())
    assert tables.cell(kernels[0], "x", "no__such_metric.sum") == "-"
    empty = tmp_path / "raw-empty.csv"
    empty.write_text("==PROF== no kernels were profiled\n")
    assert gpu_ncu.main(["table", str(empty)]) == 1


def test_source_page_gives_the_lines_that_stall_most():
    """ncu's source page: per (file, function) block a header, then one row per source line; a function's
    samples are summed over its blocks, and a line the GPU machine could not open is read from this checkout."""
    page = "\n".join([
        '"File Path","/elsewhere/site/nt_kernels/backends/triton/common.py"',
        '"Function Name","_fwd_kernel"',
        '"Line No","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)"',
        '"1","<Unable to open source file>","100","90"',
        '"File Path","/gpu-machine/checkout/nt_kernels/backends/triton/softmax_fwd.py"',
        '"Function Name","_fwd_kernel"',
        '"Line No","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)"',
        '"10","acc += tl.dot(p, v)","600","500"',
        '"11","m_new = tl.maximum(m, s)","300","250"',
        '"13","# a comment","0","0"',
        '"File Path","/x/segment_performer_rows.cuh"',
        '"Function Name","void nt_kernels::cuda::performer::row_kernel<__nv_bfloat16, (int)1>(Geometry)"',
        '"Line No","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)"',
        '"90","const float u = group_sum(x);","5","5"',
    ])
    found = tables.top_source_lines(page, count=3)
    first_line = (ROOT / "nt_kernels" / "backends" / "triton" / "common.py").read_text().splitlines()[0].strip()
    assert found["_fwd_kernel"] == ["60.0 %  softmax_fwd.py:10  acc += tl.dot(p, v)",
                                    "30.0 %  softmax_fwd.py:11  m_new = tl.maximum(m, s)",
                                    f"10.0 %  common.py:1  {first_line}"[:len("10.0 %  common.py:1  ") + 100]]
    assert found["row_kernel"] == ["100.0 %  segment_performer_rows.cuh:90  const float u = group_sum(x);"]
    assert tables.base_name("void nt_kernels::cuda::performer::row_kernel<__nv_bfloat16, 1>(Geometry, Args)") \
        == "row_kernel"


def _profiled_names() -> set[str]:
    """Every kernel name in the committed ncu runs' raw pages (each profiled without a filter)."""
    names = set()
    for path in sorted((ROOT / "bench" / "results" / "gpu-runs").glob("*/ncu/raw-*.csv.gz")):
        names |= {k["Kernel Name"] for k in tables.read_raw(tables._read(str(path)))}
    return names


def test_kernel_filter_keeps_the_projects_and_cublas_kernels_and_drops_the_glue():
    """The stage's --kernel-name regex (searched in demangled names, as ncu does) against the kernels of the
    committed runs: the CUDA and Triton kernels, cuBLAS / CUTLASS and the calibration's add are profiled;
    ATen's glue (fills, arange, scatters, sorts, scans, casts) is not."""
    import re

    pattern = re.compile(gpu_ncu.KERNELS)
    names = _profiled_names()
    ours = {n for n in names if "nt_kernels::" in n or re.fullmatch(r"_[a-z_]+_kernel", n)}
    blas = {n for n in names if any(s in n for s in ("nvjet", "cutlass", "cublas"))}
    calibration = {n for n in names if "CUDAFunctorOnSelf_add<float>" in n}
    glue = names - ours - blas - calibration
    assert len(ours) >= 15 and blas and calibration and len(glue) >= 8
    assert {"_prologue_kernel", "_weight_grad_kernel", "_dy_stream_kernel"} <= ours
    assert any("fl_keys_kernel" in n for n in ours) and any("radixSortKVInPlace" in n for n in glue)
    missed = sorted(n for n in ours | blas | calibration if not pattern.search(n))
    assert not missed, missed
    kept = sorted(n for n in glue if pattern.search(n))
    assert not kept, kept
