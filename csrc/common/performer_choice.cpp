// The CUDA Performer kernel choice (performer_choice.h) and the op
// nt_kernels::performer_cuda_kernels(dtype, mode, fits) -> 'simt' | 'tc' | 'flash'
// that exposes it on every build (`fits`: whether the asked-for kernels fit the shape).
#include "common/performer_choice.h"

#include <cstdlib>

#include <c10/util/Exception.h>
#include <torch/library.h>

namespace nt_kernels {

bool performer_tensor_cores_by_default(c10::ScalarType dtype) {
  // Every dtype: SIMT, the kernels that passed on the H100 (2026-11-26).  The
  // tensor-core kernels (bfloat16 / float16, float32 as 3xTF32) have compiled
  // but never run; NT_KERNELS_PERFORMER=tc asks for them.
  (void)dtype;
  return false;
}

PerformerKernels choose_performer_kernels(const char* op, c10::ScalarType dtype,
                                          const std::string& mode, bool tc_fits, bool flash_fits) {
  TORCH_CHECK(mode.empty() || mode == "tc" || mode == "flash" || mode == "simt", op,
              ": NT_KERNELS_PERFORMER must be 'tc', 'flash' or 'simt', got '", mode, "'");
  // The flash kernels (issue 39) have never run on a GPU: opt-in only, never a default.
  if (mode == "flash") return flash_fits ? PerformerKernels::Flash : PerformerKernels::Simt;
  const bool want_tc = mode == "tc" || (mode.empty() && performer_tensor_cores_by_default(dtype));
  return want_tc && tc_fits ? PerformerKernels::TensorCore : PerformerKernels::Simt;
}

std::string performer_kernels_mode() {
  const char* env = std::getenv("NT_KERNELS_PERFORMER");
  return env != nullptr ? env : "";
}

namespace {

std::string performer_cuda_kernels_op(c10::ScalarType dtype, const std::string& mode, bool fits) {
  TORCH_CHECK(dtype == c10::kFloat || dtype == c10::kHalf || dtype == c10::kBFloat16,
              "performer_cuda_kernels: dtype must be float32, float16 or bfloat16, got ", dtype);
  const auto kernels = choose_performer_kernels("performer_cuda_kernels", dtype, mode, fits, fits);
  if (kernels == PerformerKernels::Flash) return "flash";
  return kernels == PerformerKernels::TensorCore ? "tc" : "simt";
}

}  // namespace

// No tensor arguments: a catch-all kernel, callable on every build.
TORCH_LIBRARY_FRAGMENT(nt_kernels, m) {
  m.def("performer_cuda_kernels(ScalarType dtype, str mode, bool fits) -> str",
        &performer_cuda_kernels_op);
}

}  // namespace nt_kernels
