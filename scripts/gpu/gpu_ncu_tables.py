"""The tables of the ncu stage (scripts/gpu/gpu_ncu.py table): one Markdown section per variant from
the CSV pages that ``ncu --csv`` exports (the raw page, one row per kernel and a column per metric, and the
source page), read plain or gzipped."""
from __future__ import annotations

import csv
import gzip
import io
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# ------------------------------------------------------------------------------------ the tables
THEORETICAL = "sm__maximum_warps_per_active_cycle_pct"
ACHIEVED = "sm__warps_active.avg.pct_of_peak_sustained_active"
# (label, metric) per table; a metric that a CSV lacks is shown as "-".
LAUNCH = [("grid", "launch__grid_size"), ("block", "launch__block_size"),
          ("registers", "launch__registers_per_thread"),
          ("static shared KB/block", "launch__shared_mem_per_block_static"),
          ("dynamic shared KB/block", "launch__shared_mem_per_block_dynamic"),
          ("waves/SM", "launch__waves_per_multiprocessor"),
          ("theoretical occupancy %", THEORETICAL), ("achieved occupancy %", ACHIEVED),
          ("limit: registers", "launch__occupancy_limit_registers"),
          ("limit: shared", "launch__occupancy_limit_shared_mem"),
          ("limit: warps", "launch__occupancy_limit_warps"),
          ("limit: blocks", "launch__occupancy_limit_blocks")]
SPEED = [("time us", "gpu__time_duration.sum"),
         ("DRAM %", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"),
         ("memory %", "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"),
         ("SM %", "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
         ("tensor pipe %", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"),
         ("issue active %", "sm__inst_issued.avg.pct_of_peak_sustained_active")]
MEMORY = [("DRAM read MB", "dram__bytes_read.sum"), ("DRAM write MB", "dram__bytes_write.sum"),
          ("L2 hit %", "lts__t_sector_hit_rate.pct"),
          ("sectors/request ld", ("l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum",
                                  "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum")),
          ("sectors/request st", ("l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum",
                                  "l1tex__t_requests_pipe_lsu_mem_global_op_st.sum")),
          ("shared ld bank conflicts", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum"),
          ("shared st bank conflicts", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum")]
STALLS = ["barrier", "long_scoreboard", "short_scoreboard", "mio_throttle", "lg_throttle", "wait",
          "math_pipe_throttle", "not_selected", "selected", "no_instruction", "dispatch_stall", "membar",
          "branch_resolving", "drain", "imc_miss", "tex_throttle", "sleeping", "misc"]
STALL_METRIC = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
EXTRA_METRICS = sorted({m for _, m in LAUNCH + SPEED} | {x for _, m in MEMORY for x in (m if isinstance(m, tuple)
                       else (m,))} | {STALL_METRIC.format(s) for s in STALLS})


def read_raw(text: str) -> list[dict]:
    """The kernels of a ``--page raw --csv`` export: a header row of metric names, a row of units,
    then one row per kernel (values with thousands separators).  Lines before the header
    (the program's output, ``==PROF==`` lines) are skipped."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header, units, body = rows[0], rows[1], rows[2:]
    kernels = []
    for row in body:
        if len(row) != len(header):
            continue
        record = dict(zip(header, row))
        record["_units"] = dict(zip(header, units))
        kernels.append(record)
    return kernels


def number(record: dict, metric: str) -> float | None:
    """The metric's value in base units (bytes, ns, %), or None where the export lacks it."""
    value = record.get(metric, "").replace(",", "").strip()
    if not value or value == "n/a":
        return None
    try:
        x = float(value)
    except ValueError:
        return None
    unit = record["_units"].get(metric, "").strip().lower().split("/")[0]  # "Kbyte/block" is Kbyte
    scale = {"kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "usecond": 1e3, "msecond": 1e6, "second": 1e9,
             "kb": 1e3, "mb": 1e6, "gb": 1e9, "us": 1e3, "ms": 1e6, "s": 1e9}.get(unit, 1.0)
    return x * scale


def cell(record: dict, label: str, metric) -> str:
    if isinstance(metric, tuple):
        num, den = (number(record, m) for m in metric)
        return "-" if num is None or not den else f"{num / den:.1f}"
    x = number(record, metric)
    if x is None:
        return "-"
    if label == "time us":
        return f"{x / 1e3:.1f}"
    if label.endswith(" MB"):
        return f"{x / 1e6:.1f}"
    if label.endswith("shared KB/block"):
        return f"{x / 1e3:.1f}"
    return f"{x:.3g}" if isinstance(x, float) and not x.is_integer() else f"{int(x):,}"


def short_name(name: str) -> str:
    """A kernel's name without template arguments and parameter lists, at most 60 characters."""
    name = re.sub(r"\(.*", "", name)
    depth, out = 0, []
    for ch in name:
        depth += ch == "<"
        if depth == 0:
            out.append(ch)
        depth -= ch == ">" and depth > 0
    text = "".join(out).replace("void ", "").strip()
    return text[:60]


def base_name(name: str) -> str:
    """A kernel's bare function name (no return type, namespaces, template arguments or parameters), the key
    that joins the raw page's kernels to the source page's functions."""
    return short_name(name).split("::")[-1]


def _local_source(path: str, line: int) -> str | None:
    """A line of a file the GPU machine could not open (a Triton kernel's path from the machine that compiled
    the bundle's cache), read from this checkout: the path from its ``nt_kernels/`` or ``csrc/`` on."""
    for marker in ("nt_kernels/", "csrc/"):
        if marker in path:
            local = os.path.join(ROOT, marker + path.split(marker, 1)[1])
            if os.path.exists(local):
                with open(local, errors="replace") as f:
                    lines = f.read().splitlines()
                return lines[line - 1].strip() if 0 < line <= len(lines) else None
    return None


def top_source_lines(text: str, count: int = 5) -> dict[str, list[str]]:
    """Per kernel (its base name), the ``count`` source lines with the most warp-stall samples, from a
    ``--page source --csv --print-source cuda,sass`` export: blocks of a "File Path" row, a "Function Name"
    row, a header row ("Line No", "Source", ..., "Warp Stall Sampling (All Samples)", ...), then one row per
    source line (its "Line No" set) followed by its SASS rows (no line number, not counted here).  Samples
    are summed over every block of a function (its files and launches); shares are of those samples."""
    samples: dict[str, dict[tuple[str, int], float]] = {}
    texts: dict[tuple[str, int], str] = {}
    path = function = header = None
    col = None
    for row in csv.reader(io.StringIO(text)):
        if not row:
            continue
        if row[0] == "File Path" and len(row) > 1:
            path, header = row[1], None
        elif row[0] == "Function Name" and len(row) > 1:
            function, header = base_name(row[1]), None
        elif row[0] == "Line No":
            header = row
            col = next((i for i, h in enumerate(row) if h.startswith("Warp Stall Sampling (All")), None)
        elif header is not None and col is not None and function and row[0].strip():
            try:
                line, value = int(row[0]), float(row[col].replace(",", "") or 0)
            except (ValueError, IndexError):
                continue
            key = (path or "?", line)
            by_line = samples.setdefault(function, {})
            by_line[key] = by_line.get(key, 0.0) + value
            if not row[1].startswith("<"):
                texts[key] = " ".join(row[1].split())
    found = {}
    for function, by_line in samples.items():
        total = sum(by_line.values()) or 1.0
        best = sorted(by_line.items(), key=lambda kv: -kv[1])[:count]
        found[function] = [
            f"{100 * value / total:4.1f} %  {os.path.basename(file)}:{line}  "
            + (texts.get((file, line)) or _local_source(file, line) or "(source not available)")[:100]
            for (file, line), value in best if value > 0]
    return found


def render(label: str, kernels: list[dict], sources: dict[str, list[str]], share: float = 0.01) -> str:
    """One Markdown section: a summary row per launch, then the details of each kernel that takes at least
    ``share`` of the section's time (its longest launch)."""
    out = [f"### {label}", "", "| # | kernel | time us | DRAM % | SM % | achieved / theoretical occupancy % |",
           "|---|---|---|---|---|---|"]
    times = [number(k, "gpu__time_duration.sum") or 0.0 for k in kernels]
    total = sum(times)
    for i, k in enumerate(kernels):
        out.append(f"| {i} | `{short_name(k.get('Kernel Name', '?'))}` | {cell(k, 'time us', SPEED[0][1])} | "
                   f"{cell(k, 'DRAM %', SPEED[1][1])} | {cell(k, 'SM %', SPEED[3][1])} | "
                   f"{cell(k, '', ACHIEVED)} / {cell(k, '', THEORETICAL)} |")
    out += ["", f"{len(kernels)} launches, {total / 1e6:.3f} ms in all (each kernel alone under ncu's replay: "
            "caches flushed, clocks as found).", ""]
    longest: dict[str, int] = {}
    for i, k in enumerate(kernels):
        key = short_name(k.get("Kernel Name", "?"))
        if key not in longest or times[i] > times[longest[key]]:
            longest[key] = i
    shown = sorted((i for i in longest.values() if total and times[i] >= share * total), key=lambda i: -times[i])
    out += [f"Details of the {len(shown)} kernels with a launch of at least {100 * share:g} % of that time "
            "(their longest launch):", ""]
    for i in shown:
        k = kernels[i]
        name = k.get("Kernel Name", "?")
        out += [f"#### {i}. `{short_name(name)}`", ""]
        for title, rows in (("launch and occupancy", LAUNCH), ("speed of light", SPEED), ("memory", MEMORY)):
            out.append(f"- **{title}:** " + "; ".join(f"{lab} {cell(k, lab, m)}" for lab, m in rows))
        stalls = sorted(((number(k, STALL_METRIC.format(s)) or 0.0, s) for s in STALLS), reverse=True)
        out.append("- **warp stalls (cycles per issued instruction):** "
                   + "; ".join(f"{s} {v:.2f}" for v, s in stalls[:6] if v > 0))
        lines = sources.get(base_name(name))
        if lines:
            out.append("- **source lines with the most stall samples** (all launches of the kernel):")
            out += [f"  - `{line}`" for line in lines]
        out.append("")
    return "\n".join(out)


def _read(path: str) -> str:
    """A CSV page, plain or gzipped (as committed under bench/results/gpu-runs/)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", errors="replace") as f:
        return f.read()


def table(args) -> int:
    sections = []
    for path in args.raw:
        label = os.path.basename(path).removeprefix("raw-").removesuffix(".gz").removesuffix(".csv")
        kernels = read_raw(_read(path))
        sources = {}
        for suffix in (".csv", ".csv.gz"):
            source_path = os.path.join(os.path.dirname(path), f"source-{label}{suffix}")
            if os.path.exists(source_path):
                sources = top_source_lines(_read(source_path))
        if not kernels:
            print(f"gpu_ncu table: no kernel rows in {path}", file=sys.stderr)
            return 1
        sections.append(render(label, kernels, sources))
    text = "\n".join(sections) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return 0


