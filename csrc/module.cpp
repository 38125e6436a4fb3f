// Python module nt_kernels._C: importing it loads the op registrations
// (TORCH_LIBRARY blocks in csrc/ops, csrc/cpu, csrc/cuda); build_info() tells
// `nt-kernels info` what this build contains; cpu_isa() the CPU kernels' ISA
// path in this process (cpu/isa.h); MAX_HEAD_DIM is the head-dim
// limit of every kernel, shared with the Python checks.
#include <pybind11/pybind11.h>
#include <torch/version.h>

#include "cpu/isa.h"
#include "ops/checks.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "nt-kernels compiled ops (registered under torch.ops.nt_kernels)";
  m.attr("MAX_HEAD_DIM") = nt_kernels::MAX_HEAD_DIM;
  m.def("build_info", []() {
    py::dict info;
#ifdef NT_WITH_CUDA
    info["cuda"] = true;
#else
    info["cuda"] = false;
#endif
#ifdef _OPENMP
    info["openmp"] = _OPENMP;
#else
    info["openmp"] = py::none();
#endif
    info["torch"] = TORCH_VERSION;
    info["compiler"] = __VERSION__;
    return info;
  });
  m.def("cpu_isa", []() { return nt_kernels::cpu::cpu_isa_name(nt_kernels::cpu::cpu_isa()); },
        "The CPU kernels' ISA path in this process: 'avx2' or 'base' (NT_KERNELS_CPU_ISA forces one).");
  m.def("cpu_features", []() {
    const auto f = nt_kernels::cpu::cpu_features();
    py::dict d;
    d["avx2_fma"] = f.avx2_fma;
    d["avx512"] = f.avx512;
    return d;
  }, "Vector extensions of this CPU: avx2_fma (the avx2 path), avx512 (F+BW+DQ+VL, torch's AVX512 kernels).");
}
