"""Triton's cache key and the packed cache of scripts/gpu/gpu_triton.py (fingerprint, compare, pack,
unpack; that module's docstring says why a cache built elsewhere can hit, and its CLI calls these)."""
from __future__ import annotations

import glob
import hashlib
import json
import os
import sys
import tarfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_triton_warm import SM90  # noqa: E402

CACHE_MARK = "@TRITON_CACHE@"  # group files in a packed cache name their files relative to it


# ------------------------------------------------------------------------------------- fingerprint
def fingerprint() -> dict:
    """The parts of Triton's cache key that do not come from the kernel or its launch, for sm_90."""
    import triton
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.cache import triton_key

    backend = make_backend(GPUTarget("cuda", SM90["arch"], SM90["warp_size"]))
    options = backend.parse_options({"num_warps": 4, "num_stages": 2})
    ptxas = backend.hash()
    release = [line for line in ptxas.splitlines() if "release" in line]
    return {"triton": triton.__version__, "triton_key": hashlib.sha256(triton_key().encode()).hexdigest()[:16],
            "ptxas": release[0].strip() if release else ptxas.strip()[:80],
            "backend": hashlib.sha256(ptxas.encode()).hexdigest()[:16], "options": options.hash()[:16],
            "env": {k: v for k, v in sorted(get_cache_invalidating_env_vars().items())}}


def compare(mine: dict, theirs: dict) -> list[str]:
    return [f"{k}: here {mine.get(k)!r}, cache {theirs.get(k)!r}" for k in sorted(set(mine) | set(theirs))
            if mine.get(k) != theirs.get(k)]


# ------------------------------------------------------------------------------------- sources
def sources() -> dict:
    """Per ``@triton.jit`` function of nt_kernels/backends/triton, a digest of what Triton's cache key takes
    from it (its source and starting line; the key of a kernel also holds those of the functions it calls),
    for any Triton version or the interpreter: a bundle's cache is stale where the tree's digests differ."""
    import importlib
    import pkgutil

    import nt_kernels.backends.triton as package

    out = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, obj in vars(module).items():
            fn = getattr(obj, "fn", None)
            if type(obj).__name__ in ("JITFunction", "InterpretedFunction") and fn.__module__ == module.__name__:
                out[f"{info.name}.{name}"] = digest(fn)
    return dict(sorted(out.items()))


def digest(fn) -> str:
    """A function's source and starting line, hashed."""
    import inspect

    lines, start = inspect.getsourcelines(fn)
    return hashlib.sha256(f"{start}\n{''.join(lines)}".encode()).hexdigest()[:16]


def stale(mine: dict, theirs: dict) -> list[str]:
    """The jit functions whose digest differs between this tree and a bundle's (added, removed or changed)."""
    return [k for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]


# ---------------------------------------------------------------------------------------- pack
KEEP = (".json", ".cubin", ".so")


def pack(cache: str, tar_path: str, hashes: set | None = None) -> int:
    """Cache entries (metadata, cubin, group file; launcher modules) into a tar (xz-compressed for a
    ``.xz`` name: half gzip's size on cubins, so that the bundle and the working tree fit the device
    tool's 64 MiB; else gzip) whose group files name paths relative to CACHE_MARK.  ``hashes``: only
    those kernels' entries (and all launchers)."""
    count = 0
    with tarfile.open(tar_path, "w:xz" if tar_path.endswith(".xz") else "w:gz") as tar:
        for entry in sorted(os.listdir(cache)):
            folder = os.path.join(cache, entry)
            names = [n for n in os.listdir(folder) if n.endswith(KEEP) and not n.startswith("tmp")]
            groups = [n for n in names if n.startswith("__grp__")]
            if groups and hashes is not None and not _group_hash(folder, groups[0]) in hashes:
                continue
            for name in names:
                path = os.path.join(folder, name)
                if name.startswith("__grp__"):
                    data = json.load(open(path))
                    data["child_paths"] = {k: os.path.join(CACHE_MARK, entry, os.path.basename(v))
                                           for k, v in data["child_paths"].items()
                                           if k.endswith(KEEP) and os.path.exists(v)}
                    _add_bytes(tar, f"{entry}/{name}", json.dumps(data).encode())
                else:
                    tar.add(path, f"{entry}/{name}")
            count += bool(groups)
    return count


def _group_hash(folder: str, group: str) -> str | None:
    name = group[len("__grp__"):]
    path = os.path.join(folder, name)
    return json.load(open(path)).get("hash") if os.path.exists(path) else None


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    import io

    info = tarfile.TarInfo(name)
    info.size, info.mtime = len(data), int(time.time())
    tar.addfile(info, io.BytesIO(data))


def unpack(tar_path: str, cache: str) -> int:
    """Extract a packed cache (xz or gzip: tarfile detects which) into ``cache``, pointing its group files
    at their new place."""
    os.makedirs(cache, exist_ok=True)
    with tarfile.open(tar_path) as tar:
        tar.extractall(cache, filter="data") if hasattr(tarfile, "data_filter") else tar.extractall(cache)
    groups = glob.glob(os.path.join(cache, "*", "__grp__*"))
    for path in groups:
        text = open(path).read().replace(CACHE_MARK, os.path.abspath(cache))
        with open(path, "w") as f:
            f.write(text)
    return len(groups)


