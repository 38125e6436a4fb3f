"""What a wheel is built for, and the error when it meets another torch (issue 30): the local
version tag (scripts/wheel_version.py, nt_kernels._extension.local_tag), the build's record
nt_kernels._build_info, and TorchVersionError, raised at ``import nt_kernels`` (before the
extension is loaded) instead of an undefined-symbol error.  The wheel itself is built and
installed in a fresh venv by `make wheel wheel-check` (CI), not here."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nt_kernels import _extension as ext

ROOT = Path(__file__).resolve().parents[1]


def load_wheel_version():
    spec = importlib.util.spec_from_file_location("wheel_version", ROOT / "scripts" / "wheel_version.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("torch_version, cuda, tag", [
    ("2.11.0+cu130", "13.0", "pt211cu130"), ("2.13.0+cpu", None, "pt213cpu"), ("2.9.1", "12.8", "pt29cu128"),
    ("2.10.0a0+git123", None, "pt210cpu")], ids=["cuda", "cpu", "one-digit-minor", "pre-release"])
def test_local_tag(torch_version, cuda, tag):
    assert ext.local_tag(torch_version, cuda) == tag


@pytest.mark.parametrize("built, running, fits", [
    (("2.11.0+cu130", "13.0"), ("2.11.0+cu130", "13.0"), True),
    (("2.11.0+cu130", "13.0"), ("2.11.1+cu130", "13.0"), True),        # a patch release: same ABI
    (("2.11.0+cu130", "13.0"), ("2.11.0+cu132", "13.2"), True),        # newer CUDA minor: runtime-compatible
    (("2.13.0+cpu", None), ("2.13.0+cu130", "13.0"), True),            # CPU kernels under a CUDA torch
    (("2.11.0+cu130", "13.0"), ("2.13.0+cpu", None), False),           # another torch release
    (("2.11.0+cu130", "13.0"), ("2.11.0+cpu", None), False),           # CUDA kernels, torch without CUDA
    (("2.11.0+cu130", "13.0"), ("2.11.0+cu128", "12.8"), False),       # another CUDA major
    (("2.11.0+cu132", "13.2"), ("2.11.0+cu130", "13.0"), False),       # older CUDA minor than built for
    (("2.13.0+cpu", None), ("2.12.0+cpu", None), False),
], ids=["same", "patch", "cuda-minor-newer", "cpu-under-cuda", "release", "no-cuda", "cuda-major",
        "cuda-minor-older", "older-release"])
def test_torch_mismatch(built, running, fits):
    assert (ext.torch_mismatch(*built, *running) is None) == fits


class FakeInfo:
    VERSION = "0.1.0+pt211cu130"
    TORCH = "2.11.0+cu130"
    CUDA = "13.0"
    CUDA_ARCHS = "8.0;9.0+PTX"


def test_mismatch_message_names_both_versions_and_the_wheel():
    with pytest.raises(ext.TorchVersionError) as err:
        ext.check_torch(FakeInfo, running=("2.13.0+cpu", None))
    message = str(err.value)
    for part in ("0.1.0+pt211cu130", "torch 2.11.0+cu130", "CUDA 13.0 kernels", "torch 2.13.0+cpu",
                 "ends in +pt213cpu", "install torch 2.11.0+cu130"):
        assert part in message, (part, message)
    ext.check_torch(FakeInfo, running=("2.11.0+cu130", "13.0"))  # fits: no error


def test_this_build_records_this_torch():
    """The extension of this environment was built for its torch, and its version says so."""
    info = ext.build_info()
    assert info is not None, "nt_kernels._build_info missing: rebuild with `make install`"
    assert info.TORCH == torch.__version__
    assert info.VERSION.endswith("+" + ext.local_tag(info.TORCH, info.CUDA))
    import nt_kernels

    assert nt_kernels.__version__ == info.VERSION
    assert info.VERSION.split("+")[0] == load_wheel_version().release()


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_import_under_another_torch_raises_before_loading_the_extension():
    """The installed extension imported under a faked torch version: a TorchVersionError naming
    both versions and the wheel to use, and nt_kernels._C never loaded."""
    proc = run_python("""
import sys, torch
built = torch.__version__
torch.__version__ = "2.99.1+cpu"
torch.version.cuda = None
try:
    import nt_kernels
except ImportError as exc:
    assert type(exc).__name__ == "TorchVersionError", repr(exc)
    assert "nt_kernels._C" not in sys.modules
    print(exc)
else:
    raise SystemExit("import nt_kernels under another torch did not raise")
""")
    assert proc.returncode == 0, proc.stderr
    assert f"built for torch {torch.__version__}" in proc.stdout
    assert "this is torch 2.99.1+cpu" in proc.stdout and "ends in +pt299cpu" in proc.stdout


def test_cuda_build_under_a_torch_without_cuda_raises():
    """A build record with CUDA kernels (a CUDA wheel) under this CPU torch: the error, not the loader's."""
    if torch.version.cuda is not None:
        pytest.skip("this torch has CUDA")
    proc = run_python("""
import sys, types, torch
info = types.ModuleType("nt_kernels._build_info")
info.VERSION, info.TORCH, info.CUDA, info.CUDA_ARCHS = "0.1.0+pt213cu130", torch.__version__, "13.0", "8.0;9.0+PTX"
sys.modules["nt_kernels._build_info"] = info
try:
    import nt_kernels
except ImportError as exc:
    assert type(exc).__name__ == "TorchVersionError" and "nt_kernels._C" not in sys.modules, repr(exc)
    print(exc)
else:
    raise SystemExit("no error")
""")
    assert proc.returncode == 0, proc.stderr
    assert "CUDA kernels under a torch without CUDA" in proc.stdout and "+pt213cpu" in proc.stdout


@pytest.mark.parametrize("mode, cuda_torch, builds_cuda", [
    ("OFF", "13.0", False), ("AUTO", None, False), ("ON", None, "error")], ids=["off", "auto-cpu-torch", "on-cpu-torch"])
def test_wheel_version_cuda_choice(monkeypatch, mode, cuda_torch, builds_cuda):
    wheel_version = load_wheel_version()
    monkeypatch.setenv("NT_KERNELS_CUDA", mode)
    if builds_cuda == "error":
        with pytest.raises(RuntimeError, match="NT_KERNELS_CUDA=ON needs a CUDA torch and nvcc"):
            wheel_version.build_cuda(cuda_torch)
    else:
        assert wheel_version.build_cuda(cuda_torch) is builds_cuda


def test_wheel_version_sdist_is_the_release(monkeypatch):
    wheel_version = load_wheel_version()
    monkeypatch.setenv("NT_KERNELS_CUDA", "OFF")
    wheel_version.build_state("sdist")
    assert wheel_version.dynamic_metadata({}, {}) == {"version": wheel_version.release()}
    wheel_version.build_state("wheel")
    assert wheel_version.dynamic_metadata({}, {}) == {
        "version": f"{wheel_version.release()}+{ext.local_tag(torch.__version__, None)}"}


MACHINE_PATHS = re.compile(r"/work/|/home/|/root/|/Users/|~/\.pyenv|/opt/|/mnt/")


def test_no_machine_paths_in_the_project():
    """No file names a particular machine's folder (a default interpreter, a checkout); bench/results
    keeps the provenance of the runs it records (and this file names the patterns)."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if files.returncode != 0:
        pytest.skip("not a git checkout")
    found = []
    for name in files.stdout.splitlines():
        path = ROOT / name
        if name.startswith("bench/results/") or name == "tests/test_wheel.py" or not path.is_file() \
                or path.suffix in (".png", ".npz"):
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if MACHINE_PATHS.search(line):
                found.append(f"{name}:{number}: {line.strip()[:120]}")
    assert not found, "machine paths:\n" + "\n".join(found)
