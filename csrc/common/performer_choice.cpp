// The CUDA Performer kernel choice (performer_choice.h) and the op
// nt_kernels::performer_cuda_kernels(dtype, mode, fits) -> 'simt' | 'tc' | 'flash'
// that exposes it on every build (`fits`: whether the asked-for kernels fit the shape).
#include "common/performer_choice.h"

#include <cstdlib>

#include <c10/util/Exception.h>
#include <torch/library.h>

namespace nt_kernels {

bool performer_flash_by_default(c10::ScalarType dtype) {
  // bfloat16: on the H200 (2026-11-28b) the flash kernels passed every test and all three
  // sanitizers and ran the tolokers layer's Performer (H = 2, D = 30, m = 102) fwd+bwd in
  // 5.26 ms against 5.91 (tensor cores), 16.55 (SIMT) and 344.55 (performer-gemm).
  return dtype == c10::kBFloat16;
}

PerformerKernels choose_performer_kernels(const char* op, c10::ScalarType dtype,
                                          const std::string& mode, bool tc_fits, bool flash_fits) {
  TORCH_CHECK(mode.empty() || mode == "tc" || mode == "flash" || mode == "simt", op,
              ": NT_KERNELS_PERFORMER must be 'tc', 'flash' or 'simt', got '", mode, "'");
  const bool want_flash = mode == "flash" || (mode.empty() && performer_flash_by_default(dtype));
  if (want_flash) return flash_fits ? PerformerKernels::Flash : PerformerKernels::Simt;
  return mode == "tc" && tc_fits ? PerformerKernels::TensorCore : PerformerKernels::Simt;
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
