// Python module nt_kernels._C: importing it loads the op registrations
// (TORCH_LIBRARY blocks in csrc/ops, csrc/cpu, csrc/cuda); build_info() tells
// `nt-kernels info` what this build contains; cpu_isa() the CPU kernels' ISA
// path in this process (cpu/isa.h); cpu_stage_profile() / cpu_stage_times()
// the fused layer's CPU stage clocks (cpu/stage_profile.h); MAX_HEAD_DIM is the head-dim
// limit of every kernel, shared with the Python checks.
#include <pybind11/pybind11.h>
#include <torch/version.h>

#include "cpu/cpu_bench.h"
#include "cpu/isa.h"
#include "cpu/stage_profile.h"
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
        "The CPU kernels' ISA path in this process: 'avx512', 'avx2' or 'base' (NT_KERNELS_CPU_ISA forces one).");
  m.def("cpu_isa_paths", []() {
    nt_kernels::cpu::CpuIsa paths[3];
    py::list names;
    for (int i = 0, n = nt_kernels::cpu::cpu_isa_paths(paths); i < n; ++i) {
      names.append(nt_kernels::cpu::cpu_isa_name(paths[i]));
    }
    return names;
  }, "The CPU kernels' ISA paths this CPU and this build can run, narrowest first.");
  m.def("cpu_features", []() {
    const auto f = nt_kernels::cpu::cpu_features();
    py::dict d;
    d["avx2_fma"] = f.avx2_fma;
    d["avx512"] = f.avx512;
    return d;
  }, "Vector extensions of this CPU: avx2_fma (the avx2 path), avx512 (F+BW+DQ+VL: the avx512 path, torch's "
     "AVX512 kernels).");
  m.def("cpu_stage_profile", [](bool on) { nt_kernels::cpu::stage_profile_start(on); }, py::arg("on"),
        "Zero the fused layer's CPU stage counters and turn its stage clocks on or off (cpu/stage_profile.h).");
  m.def("cpu_stage_times", []() {
    const auto& c = nt_kernels::cpu::stage_counters();
    py::dict stages;
    for (int s = 0; s < nt_kernels::cpu::STAGE_COUNT; ++s) {
      stages[nt_kernels::cpu::stage_name(s)] = static_cast<double>(c.thread_ns[s].load()) * 1e-9;
    }
    py::dict d;
    d["thread_s"] = stages;
    d["forward_wall_s"] = static_cast<double>(c.fwd_wall_ns.load()) * 1e-9;
    d["backward_wall_s"] = static_cast<double>(c.bwd_wall_ns.load()) * 1e-9;
    d["forward_calls"] = c.fwd_calls.load();
    d["backward_calls"] = c.bwd_calls.load();
    return d;
  }, "Since cpu_stage_profile(True): thread seconds per stage of the fused layer's CPU kernels, and the wall "
     "seconds and calls of its forward and backward.");
  m.def("cpu_gemm_bench", &nt_kernels::cpu::gemm_bench, py::arg("impl"), py::arg("rows"), py::arg("K"),
        py::arg("N"), py::arg("a_transposed"), py::arg("iterations"),
        "Seconds per call of a float32 C += A B: impl 'ours' (this process's ISA path), 'cpublas' or 'brgemm' "
        "(torch's CPU BLAS); for scripts/cpu_gemm_compare.py (cpu/cpu_bench.cpp).");
  m.def("cpu_clock_ghz", &nt_kernels::cpu::clock_ghz, py::arg("ms") = 20.0, py::arg("trials") = 5,
        "The running core's clock in GHz from a timed chain of dependent adds (best of the trials); 0 off x86.");
}
