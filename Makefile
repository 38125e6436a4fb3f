# nt-kernels developer targets.  `make demo` and `make test` install the package
# (editable, compiled extension) first when it is missing or its sources changed.
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
STAMP := build/.installed-$(shell $(PYTHON) -c "import sys; print(sys.implementation.cache_tag)")
SOURCES := $(shell find csrc -type f) CMakeLists.txt pyproject.toml
# Real graphs (tests, bench, train): $NT_KERNELS_DATA, by default the shared data next to the checkout.
export NT_KERNELS_DATA ?= $(abspath ../shared/data/heterophilous)

.PHONY: install demo test bench cuda-check cross-check triton-check clean

install: $(STAMP)

$(STAMP): $(SOURCES)
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install "torch==$(TORCH_VERSION)"
	$(PYTHON) -m pip install "scikit-build-core>=0.10" ninja pybind11 "cmake>=3.24"
	$(PYTHON) -m pip install --no-build-isolation -e ".[test,plot,triton,peers]"
	mkdir -p build && touch $@

demo: $(STAMP)
	$(PYTHON) -m nt_kernels.cli demo

test: $(STAMP)
	$(PYTHON) -m pytest -q tests

bench: $(STAMP)
	$(PYTHON) -m nt_kernels.cli bench --graph minesweeper --out bench/results

# Compile every csrc/cuda/*.cu for sm_80 and sm_90 (no GPU needed) and
# syntax-check the torch bindings; fails on a compile error or a register spill.
cuda-check:
	bash scripts/cuda_check.sh

# Syntax-check the CPU extension with the aarch64 cross compiler (no ARM
# machine needed): x86-only code outside its guards fails.  Needs
# g++-aarch64-linux-gnu (CI installs it) and torch's headers.
cross-check:
	PYTHON=$(PYTHON) bash scripts/cross_check.sh

# Compile every Triton kernel with every autotuning config for sm_90 (no GPU
# needed); fails on a compile error or when no config of a setting fits the
# shared memory or avoids spills.  TRITON_CHECK_ARGS narrows it (CI: the
# largest head dim only); see scripts/triton_check.py --help.
TRITON_CHECK_ARGS ?=
triton-check: $(STAMP)
	env -u TRITON_INTERPRET $(PYTHON) scripts/triton_check.py $(TRITON_CHECK_ARGS)

clean:
	rm -rf build
