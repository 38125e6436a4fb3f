"""Launch configs of the exact-attention Triton kernels: a table chosen ahead per GPU architecture.

A first call on a GPU compiles exactly one config per kernel: the launchers
ask :func:`choose` and pass its constexprs, ``num_warps`` and ``num_stages`` to
the plain ``@triton.jit`` kernel.  :func:`choose` looks the kernel up in the
shipped table (``config_table.py``, written by ``nt-kernels tune``) under

    (architecture, kernel, dtype, head-dim class, size class)

* architecture: ``sm_80``, ``sm_89``, ``sm_90`` ... (the device's compute capability);
* kernel: ``fwd_packed``, ``bwd_packed`` (packed tiles), ``fwd_multi``,
  ``bwd_dq``, ``bwd_dkdv`` (multi-tile segments);
* dtype: ``fp32``, ``bf16``, ``fp16``;
* head-dim class: D rounded up to a power of two (``d1`` ... ``d256``);
* size class: the packed tile height ``t16`` / ``t32`` / ``t64``, or ``multi``.

A key the table does not hold gets :func:`heuristic` (documented there and in
docs/kernels-exact-cuda.md).  ``NT_KERNELS_TRITON_AUTOTUNE=1`` instead times every
candidate (:func:`candidates`) on the first call of each key in the process
and keeps the fastest (on-line autotuning, opt-in); ``=0`` or unset uses the
table.  ``NT_KERNELS_TRITON_CONFIGS=<file>`` reads another table (the format
``nt-kernels tune`` writes) instead of the shipped one.

This module imports neither triton nor CUDA state: the tuner, the compile
check (scripts/triton_check.py) and the tests use it on any machine.
"""
from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import torch

__all__ = ["ARCH_SHARED_MEMORY", "KERNELS", "PACKED_HEIGHTS", "PACKED_SIZES", "ROWS", "TABLE_VERSION", "candidates",
           "choose", "clear_cache", "dtype_name", "head_dim_class", "heads_tiles", "heuristic", "load_table", "lookup",
           "read_table", "size_class", "size_tile", "table_key", "validate_table", "write_table"]

TABLE_VERSION = 1
TABLE_PATH = Path(__file__).with_name("config_table.py")
# Opt-in shared memory per block (bytes) of the architectures the table targets.
ARCH_SHARED_MEMORY = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448}
PACKED_HEIGHTS = (16, 32, 64)       # plan.TILE_HEIGHTS (kept here so this module imports no triton code)
# The opt-in row blocks of the packed kernels (plan.py, NT_KERNELS_EXACT_BLOCKS=1): 64-row tiles of contiguous rows,
# a size class of their own ("rows"); a table without a "rows" entry gives them its "t64" entry.
ROWS, ROWS_TILE = "rows", 64
PACKED_SIZES = tuple(f"t{t}" for t in PACKED_HEIGHTS) + (ROWS,)
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
HEAD_DIM_CLASSES = tuple(1 << i for i in range(9))  # 1 .. 256

# kernel -> (size classes, config parameters besides num_warps / num_stages and their allowed values)
KERNELS = {
    "fwd_packed": ("packed", {"kernel": ("head", "heads"), "tile_elems": (1024, 2048, 4096, 8192), "dot": (0, 1)}),
    "bwd_packed": ("packed", {"kernel": ("head", "heads"), "tile_elems": (1024, 2048, 4096, 8192), "dot": (0, 1)}),
    "fwd_multi": ("multi", {"BLOCK_N": (32, 64)}),
    "bwd_dq": ("multi", {"BLOCK_N": (32, 64)}),
    "bwd_dkdv": ("multi", {"BLOCK_M": (32, 64)}),
}
WARPS = (2, 4, 8)
STAGES = (1, 2, 3)



# ------------------------------------------------------------------ keys

def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"Triton exact kernels: unsupported dtype {dtype}")
    return DTYPE_NAMES[dtype]


def head_dim_class(head_dim: int) -> int:
    """D rounded up to a power of two (1 .. 256 for the table; larger head dims have no entries)."""
    return 1 << max(0, int(head_dim) - 1).bit_length()


def size_class(kernel: str, tile: int | str | None) -> str:
    """``t16`` / ``t32`` / ``t64`` for the packed kernels (the tile height), ``rows`` for their row blocks
    (``tile`` = ROWS), ``multi`` otherwise."""
    if KERNELS[kernel][0] == "packed":
        if tile == ROWS:
            return ROWS
        if tile not in PACKED_HEIGHTS:
            raise ValueError(f"{kernel}: tile height must be one of {PACKED_HEIGHTS}, got {tile}")
        return f"t{tile}"
    return "multi"


def size_tile(size: str) -> int:
    """The tile height of a packed size class (``t16`` -> 16, ``rows`` -> 64), 0 for ``multi``."""
    return ROWS_TILE if size == ROWS else (int(size[1:]) if size.startswith("t") else 0)


def table_key(kernel: str, dtype: str, dim_class: int, size: str) -> str:
    """The table's key string, e.g. ``fwd_packed/bf16/d8/t16``."""
    return f"{kernel}/{dtype}/d{dim_class}/{size}"


def parse_key(key: str) -> tuple[str, str, int, str]:
    kernel, dtype, dim, size = key.split("/")
    if not dim.startswith("d"):
        raise ValueError(f"bad head-dim class {dim!r}")
    return kernel, dtype, int(dim[1:]), size


def arch_name(arch: int) -> str:
    return f"sm_{arch}"


# ---------------------------------------------------------- heuristic and candidates

def padded_head_dim(dim_class: int, dot: bool) -> int:
    """Register width of a head: the class itself, at least 16 where tl.dot contracts over it."""
    return max(16, dim_class) if dot else dim_class


def heads_tiles(config: dict, heads: int, dim_class: int, tile: int) -> int:
    """Tiles per work item of the "heads" kernel (0: one tile's heads do not fit ``tile_elems``).

    A work item holds ``TILES`` packed tiles x every head (H padded to a power
    of two, HP): operands of TILES * HP * TILE * DP elements (DP: the padded
    head dim) and scores of TILES * HP * TILE * TILE.  ``TILES`` is the largest
    power of two with TILES * HP * TILE * max(TILE, DP) <= ``tile_elems``, so
    the largest register tensor of a config has the same size for every head
    count: an entry tuned for one H stays within its registers for another.
    """
    hp = 1 << max(0, heads - 1).bit_length()
    per_tile = hp * tile * max(tile, padded_head_dim(dim_class, bool(config["dot"])))
    return config["tile_elems"] // per_tile if per_tile <= config["tile_elems"] else 0


def heuristic(kernel: str, dtype: str, dim_class: int, size: str, arch: int) -> dict:
    """The config a key without a table entry gets.

    * Multi-tile kernels (``fwd_multi``, ``bwd_dq``, ``bwd_dkdv``): inner block
      32, 4 warps, 1 stage: the first config of the autotuning set, pinned by
      ``NT_KERNELS_TRITON_AUTOTUNE=0`` in the first H100 run (all checks passed).
    * Packed kernels: the per-head kernel (:func:`head_kernel_config`), the one
      the first H100 run passed and timed.  The whole-row "heads" kernel (every
      head of several tiles in one work item) is a candidate only: on its first
      run, as the default for head-dim classes <= 32 (one H200, 2026-11-27), the
      tolokers exact subset (H = 4, D = 32, bf16) took 3.03 ms forward +
      backward against the per-head kernels' 2.28 ms on the H100, and the
      roofline graph reached 21 % of the copy bandwidth against 27 %; its
      GPU tests did not finish.  ``nt-kernels tune`` puts it back per key
      where it times faster.
    ``arch`` is kept for tables tuned per architecture (the heuristic is the same on all).
    """
    if KERNELS[kernel][0] == "multi":
        inner = "BLOCK_M" if kernel == "bwd_dkdv" else "BLOCK_N"
        return {inner: 32, "num_warps": 4, "num_stages": 1}
    return head_kernel_config(kernel, dtype, dim_class, size_tile(size))


def head_kernel_config(kernel: str, dtype: str, dim_class: int, tile: int) -> dict:
    """The per-head packed kernel's config: 4 warps, 1 stage (the pinned config of the H100 run)
    for tiles of up to 32 rows and head-dim classes up to 32, 8 warps (fewer registers per
    thread) for 64-row tiles, larger head dims and the float32 backward of 32-row tiles."""
    big = tile == 64 or dim_class >= 64 or (kernel == "bwd_packed" and dtype == "fp32" and tile >= 32)
    return {"kernel": "head", "num_warps": 8 if big else 4, "num_stages": 1}


def candidates(kernel: str, dtype: str, dim_class: int, size: str, heads: int = 4, arch: int = 90) -> list[dict]:
    """Configs the tuner (and on-line autotuning) times for one key, what the heuristic runs at
    ``heads`` first.

    Packed: the heuristic's per-head config, the per-head kernel's pinned
    config (4 warps, 1 stage), the "heads" kernel with ``tl.dot`` at 4096, 2048, 8192 and 1024 elements per
    operand (those whose work item holds at least one tile at ``heads``) and 8
    / 4 warps, the per-head kernel's other warps / stages, and for head-dim
    classes <= 4 the "heads" kernel on CUDA cores (broadcast products summed
    over d, no padding of D to 16).  Multi-tile: inner block 32 / 64, 4 / 8
    warps, 1 / 2 stages.  The likelier configs come first, so a time-boxed
    tuner can keep only the first few (``nt-kernels tune --max-candidates``).
    """
    out = [heuristic(kernel, dtype, dim_class, size, arch)]
    if KERNELS[kernel][0] == "multi":
        inner = "BLOCK_M" if kernel == "bwd_dkdv" else "BLOCK_N"
        out += [{inner: b, "num_warps": w, "num_stages": s} for s in (1, 2) for w in (4, 8) for b in (32, 64)]
    else:
        whole_row = [{"kernel": "heads", "tile_elems": elems, "dot": dot, "num_warps": w, "num_stages": 1}
                     for dot in ((1, 0) if dim_class <= 4 else (1,))
                     for elems in (4096, 2048, 8192, 1024) for w in (8, 4)]
        out += [{"kernel": "head", "num_warps": 4, "num_stages": 1}] + [c for c in whole_row if c["dot"]]
        out += [{"kernel": "head", "num_warps": w, "num_stages": s} for s in (1, 2) for w in (8, 4)]
        out += [c for c in whole_row if not c["dot"]]
        tile = size_tile(size)
        out = [cfg for cfg in out if cfg["kernel"] == "head" or heads_tiles(cfg, heads, dim_class, tile)]
    unique: list[dict] = []
    for cfg in out:
        if cfg not in unique:
            unique.append(cfg)
    return unique


# ------------------------------------------------------------------ the table

def validate_table(table) -> list[str]:
    """Problems of a config table (empty when it is well formed): version, architectures, keys, values.

    Fit in shared memory and registers is checked by compiling every entry
    (scripts/triton_check.py), not here.
    """
    errors = []
    if not isinstance(table, dict) or table.get("version") != TABLE_VERSION:
        return [f"table version must be {TABLE_VERSION}, got "
                f"{table.get('version') if isinstance(table, dict) else type(table).__name__}"]
    archs = table.get("archs")
    if not isinstance(archs, dict):
        return ["table has no 'archs' dict"]
    for arch, section in archs.items():
        if not (isinstance(arch, str) and arch.startswith("sm_") and arch[3:].isdigit()):
            errors.append(f"architecture {arch!r} is not of the form sm_<cc>")
            continue
        if int(arch[3:]) not in ARCH_SHARED_MEMORY:
            errors.append(f"{arch}: unknown architecture (known: {sorted(ARCH_SHARED_MEMORY)})")
        entries = section.get("entries") if isinstance(section, dict) else None
        if not isinstance(entries, dict):
            errors.append(f"{arch}: no 'entries' dict")
            continue
        for key, config in entries.items():
            errors += [f"{arch} {key}: {e}" for e in _entry_errors(key, config)]
    return errors


def _entry_errors(key: str, config) -> list[str]:
    try:
        kernel, dtype, dim_class, size = parse_key(key)
    except ValueError as exc:
        return [f"malformed key ({exc}); expected kernel/dtype/d<class>/<size>"]
    if kernel not in KERNELS:
        return [f"unknown kernel {kernel!r}"]
    errors = []
    if dtype not in DTYPE_NAMES.values():
        errors.append(f"unknown dtype {dtype!r}")
    if dim_class not in HEAD_DIM_CLASSES:
        errors.append(f"head-dim class {dim_class} is not a power of two in 1..256")
    sizes = list(PACKED_SIZES) if KERNELS[kernel][0] == "packed" else ["multi"]
    if size not in sizes:
        errors.append(f"size class {size!r} is not one of {sizes}")
    if not isinstance(config, dict):
        return errors + ["config is not a dict"]
    allowed = dict(KERNELS[kernel][1], num_warps=WARPS, num_stages=STAGES)
    required = set(allowed) - {"kernel", "tile_elems", "dot"} if KERNELS[kernel][0] == "packed" else set(allowed)
    if KERNELS[kernel][0] == "packed":
        required |= {"kernel"} | ({"tile_elems", "dot"} if config.get("kernel") == "heads" else set())
    for name in sorted(required - set(config)):
        errors.append(f"missing {name}")
    for name, value in config.items():
        if name not in allowed:
            errors.append(f"unknown parameter {name}")
        elif value not in allowed[name]:
            errors.append(f"{name} = {value!r} not in {allowed[name]}")
    return errors


def read_table(path) -> dict:
    """A table file: a Python module holding one literal ``TABLE = {...}`` (read with ast, never executed)."""
    tree = ast.parse(Path(path).read_text(), filename=str(path))
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["TABLE"]:
            return ast.literal_eval(node.value)
    raise ValueError(f"{path}: no 'TABLE = {{...}}' assignment")


def write_table(table: dict, path, header: str = "") -> None:
    """Write ``table`` in the format :func:`read_table` reads (after validating it): one line per entry."""
    errors = validate_table(table)
    if errors:
        raise ValueError("refusing to write an invalid config table:\n  " + "\n  ".join(errors))
    lines = ['"""Launch configs of the exact-attention Triton kernels per GPU architecture (configs.py reads it).',
             "", *header.strip().splitlines(), '"""', "", "TABLE = {", f'    "version": {table["version"]},',
             '    "archs": {']
    for arch in sorted(table["archs"]):
        section = table["archs"][arch]
        lines += [f"        {json.dumps(arch)}: {{"]
        lines += [f"            {json.dumps(k)}: {json.dumps(v)}," for k, v in section.items() if k != "entries"]
        lines += ['            "entries": {']
        lines += [f"                {json.dumps(k)}: {json.dumps(v)}," for k, v in sorted(section["entries"].items())]
        lines += ["            },", "        },"]
    lines += ["    },", "}"]
    Path(path).write_text("\n".join(lines) + "\n")


_TABLE: dict = {}
EMPTY_TABLE = {"version": TABLE_VERSION, "archs": {}}


def load_table() -> dict:
    """The table in use, read once and validated: $NT_KERNELS_TRITON_CONFIGS if set (``none``:
    an empty table, so every key gets the heuristic), else the shipped one."""
    if "table" not in _TABLE:
        path = os.environ.get("NT_KERNELS_TRITON_CONFIGS") or TABLE_PATH
        table = EMPTY_TABLE if str(path).lower() == "none" else read_table(path)
        errors = validate_table(table)
        if errors:
            raise ValueError(f"config table {path} is invalid:\n  " + "\n  ".join(errors))
        _TABLE["table"] = table
    return _TABLE["table"]


def lookup(kernel: str, dtype: str, dim_class: int, size: str, arch: int, table: dict | None = None):
    """(config, source) for one key: the table's entry ("table"; for ``rows`` without one, the ``t64``
    entry) or :func:`heuristic` ("heuristic")."""
    table = load_table() if table is None else table
    entries = table["archs"].get(arch_name(arch), {}).get("entries", {})
    entry = entries.get(table_key(kernel, dtype, dim_class, size))
    if entry is None and size == ROWS:
        entry = entries.get(table_key(kernel, dtype, dim_class, f"t{ROWS_TILE}"))
    if entry is not None:
        return dict(entry), "table"
    return heuristic(kernel, dtype, dim_class, size, arch), "heuristic"


_CHOSEN: dict = {}


def _time_or_inf(time_config, config) -> float:
    """A candidate's time, or infinity when it cannot compile or launch (e.g. out of resources)."""
    try:
        return float(time_config(config))
    except Exception:  # the candidate is skipped, as the tuner skips it
        return float("inf")


def clear_cache() -> None:
    """Forget the table read and the configs chosen in this process (tests, or after changing
    NT_KERNELS_TRITON_CONFIGS / NT_KERNELS_TRITON_AUTOTUNE)."""
    _TABLE.clear()
    _CHOSEN.clear()


def choose(kernel: str, dtype: torch.dtype, head_dim: int, tile: int | str | None, arch: int, heads: int = 4,
           time_config=None) -> dict:
    """The config a launch uses (cached per key in the process).

    With ``NT_KERNELS_TRITON_AUTOTUNE=1`` and a ``time_config(config) ->
    milliseconds`` callable (the launchers pass one on CUDA), every candidate
    is timed on this first call and the fastest kept; otherwise
    :func:`lookup`.
    """
    key = (arch, table_key(kernel, dtype_name(dtype), head_dim_class(head_dim), size_class(kernel, tile)))
    if key not in _CHOSEN:
        name, dim_class, size = dtype_name(dtype), head_dim_class(head_dim), size_class(kernel, tile)
        if os.environ.get("NT_KERNELS_TRITON_AUTOTUNE", "0") == "1" and time_config is not None:
            timed = [(_time_or_inf(time_config, cfg), i, cfg)
                     for i, cfg in enumerate(candidates(kernel, name, dim_class, size, heads, arch))]
            _CHOSEN[key] = min(timed)[2]
        else:
            _CHOSEN[key] = lookup(kernel, name, dim_class, size, arch)[0]
    return _CHOSEN[key]
