# nt-kernels developer targets.  `make demo` and `make test` install the package
# (editable, compiled extension) first when it is missing or its sources changed.
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
STAMP := build/.installed-$(shell $(PYTHON) -c "import sys; print(sys.implementation.cache_tag)")
SOURCES := $(shell find csrc -type f) CMakeLists.txt pyproject.toml scripts/wheel_version.py
# Real graphs (tests, bench, train): $NT_KERNELS_DATA, by default the shared data next to the checkout.
export NT_KERNELS_DATA ?= $(abspath ../shared/data/heterophilous)

.PHONY: install wheel wheel-check sdist demo test bench check cuda-check cross-check triton-check gpu-bundle \
	gpu-dry-run clean

# What a build needs besides the compiler: torch (the pinned CPU build when none is installed;
# the extension compiles against the torch it will run with) and the build backend.
define build_env
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install "torch==$(TORCH_VERSION)"
	$(PYTHON) -m pip install -q "scikit-build-core>=1.1" ninja pybind11 "cmake>=3.24"
endef

install: $(STAMP)

$(STAMP): $(SOURCES)
	$(build_env)
	$(PYTHON) -m pip install --no-build-isolation -e ".[test,plot,triton,peers]"
	mkdir -p build && touch $@

# dist/nt_kernels-<release>+pt<torch><cuNNN|cpu>-<python>-<platform>.whl for PYTHON and its torch
# (scripts/wheel_version.py names the tag): CUDA kernels (SASS for sm_80 and sm_90, PTX for newer
# GPUs) when that torch has CUDA and nvcc is found, no GPU needed; NT_KERNELS_CUDA=OFF for a CPU
# wheel.  build/<wheel tag> is the CMake build folder of `make install` too, so after it only
# the packaging runs.
wheel:
	$(build_env)
	$(PYTHON) -m pip wheel --no-build-isolation --no-deps --wheel-dir dist .

# The wheel of dist/ for PYTHON, checked: its files (scripts/wheel_check.py), then installed with
# --no-deps into a fresh venv outside the checkout (torch and the runtime dependencies first), where
# `nt-kernels check --quick` and a 2-epoch `nt-kernels train` on minesweeper run
# (scripts/wheel_smoke.sh; WHEEL_VENV keeps the venv there).
wheel-check:
	PYTHON=$(PYTHON) TORCH_VERSION=$(TORCH_VERSION) bash scripts/wheel_smoke.sh

# dist/nt_kernels-<release>.tar.gz; it builds against the torch of whoever installs it
# (`pip install --no-build-isolation dist/nt_kernels-<release>.tar.gz` with torch present).
sdist:
	$(PYTHON) -m pip install -q build
	$(PYTHON) -m build --sdist --outdir dist .

demo: $(STAMP)
	$(PYTHON) -m nt_kernels.cli demo

# The suite on every core (pytest-xdist, a test extra: -n auto; --dist loadgroup keeps the tests of
# an xdist_group, which share a module fixture, on one worker; each worker takes cores / workers torch
# threads, tests/conftest.py); PYTEST_WORKERS=0 runs it in this
# process (as pytest without -n does).
PYTEST_WORKERS ?= auto
test: $(STAMP)
	$(PYTHON) -m pytest -q tests $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadgroup)

bench: $(STAMP)
	$(PYTHON) -m nt_kernels.cli bench --graph minesweeper --out bench/results

# Self-test of every kernel path against the PyTorch reference on this machine's
# device (`nt-kernels check`; CHECK_ARGS="--quick" for the CI subset).
CHECK_ARGS ?=
check: $(STAMP)
	$(PYTHON) -m nt_kernels.cli check $(CHECK_ARGS)

# What scripts/gpu/gpu_check.sh and scripts/gpu/gpu_perf.sh need on a GPU machine besides
# the working tree, in .gpu-bundle/ (git-ignored, <= 60 MiB): the CUDA wheel built
# with GPU_PYTHON (required: a Python with the GPU machine's Python and torch, e.g.
# 3.12 + torch 2.11.0+cu130, in a venv of its own), the real graphs and (TRITON_AOT=1,
# the default) the Triton cache for sm_90 compiled ahead with GPU_PYTHON's Triton.
# docs/running.md, "GPU: how to run".
TRITON_AOT ?= 1
gpu-bundle:
	GPU_PYTHON="$(GPU_PYTHON)" TRITON_AOT=$(TRITON_AOT) bash scripts/gpu/gpu_bundle.sh

# Both GPU scripts on this machine's CPU (their CUDA stages run cut-down CPU
# versions of the same commands): no shell or Python error waits for a GPU.
# tests/test_gpu_scripts.py runs the same.
gpu-dry-run: $(STAMP)
	OUT=gpu-out/check GPU_SITE=installed GPU_PYTHON=$(PYTHON) bash scripts/gpu/gpu_check.sh
	OUT=gpu-out/perf GPU_SITE=installed GPU_PYTHON=$(PYTHON) bash scripts/gpu/gpu_perf.sh

# Compile every csrc/cuda/*.cu for sm_80, sm_89 and sm_90 (no GPU needed) and
# syntax-check the torch bindings; fails on a compile error, a register spill,
# a tensor-core or flash Performer kernel without tensor-core instructions or
# with an integer divide, or a flash kernel under 8 resident warps per SM on
# sm_90 (per-kernel table: scripts/cuda_check.sh).
cuda-check:
	bash scripts/cuda_check.sh

# Syntax-check the CPU extension with the aarch64 cross compiler (no ARM
# machine needed): x86-only code outside its guards fails.  Needs
# g++-aarch64-linux-gnu (CI installs it) and torch's headers.
cross-check:
	PYTHON=$(PYTHON) bash scripts/cross_check.sh

# Compile the exact-path Triton kernels as launched (no GPU needed): every entry
# of the config table for its architecture, and each launch's config for sm_80,
# 89 and 90 at the head dims of --block-d; fails on a compile error, a config
# over the shared memory, or register spills of a table entry or of the
# whole-row kernel.  TRITON_CHECK_ARGS narrows it (CI: one head dim); see
# scripts/triton_check.py --help.
# TRITON_TARGET=<dir> runs it with the triton installed there instead of this
# environment's (`pip install --no-deps --target <dir> triton==3.6.0`: the GPU
# machines' version).
# Then the fused NT layer's kernels (scripts/ntconv_triton_check.py: the launch
# shapes of ntconv_specs.compile_specs for sm_80, 89 and 90); NTCONV_CHECK_ARGS
# narrows it (e.g. --arch 90 --no-spills).
TRITON_CHECK_ARGS ?=
NTCONV_CHECK_ARGS ?=
TRITON_TARGET ?=
triton-check: $(STAMP)
	env -u TRITON_INTERPRET $(if $(TRITON_TARGET),PYTHONPATH=$(TRITON_TARGET)) $(PYTHON) scripts/triton_check.py $(TRITON_CHECK_ARGS)
	env -u TRITON_INTERPRET $(if $(TRITON_TARGET),PYTHONPATH=$(TRITON_TARGET)) $(PYTHON) scripts/ntconv_triton_check.py $(NTCONV_CHECK_ARGS)

clean:
	rm -rf build dist
