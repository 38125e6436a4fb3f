// Which CUDA Performer kernels run a call (SIMT, tensor cores or flash): the policy
// of the CUDA binding (csrc/cuda/segment_performer_binding.cpp), kept free of
// CUDA so that every build, the CPU-only one included, exposes it as the op
// nt_kernels::performer_cuda_kernels and CI pins the defaults on CPU
// (tests/test_performer_cuda.py, test_cuda_performer_defaults).
#pragma once
#include <string>

#include <c10/core/ScalarType.h>

namespace nt_kernels {

enum class PerformerKernels : int { Simt = 0, TensorCore = 1, Flash = 2 };

// With NT_KERNELS_PERFORMER unset, whether `dtype` runs the flash kernels where
// its shape fits them.  Defaults follow the GPU measurement (issue 43): a dtype
// gets the flash kernels once a GPU has passed them (every check row, test and
// sanitizer) and timed them faster than SIMT, the tensor cores and
// performer-gemm in that dtype.  bfloat16 since the H200 run of 2026-11-28
// (docs/runs/h200-2026-11-28b.md); float16 and float32 stay on SIMT until a run
// times them.  tests/test_performer_cuda.py (DEFAULT_KERNELS) pins the table.
bool performer_flash_by_default(c10::ScalarType dtype);

// The kernels for a call: `mode` is NT_KERNELS_PERFORMER ("" when unset: the
// flash kernels where performer_flash_by_default and the shape fits, else SIMT; "tc":
// the tensor cores of issue 27 for every dtype whose shape fits; "flash": the
// FlashAttention-2-style kernels of issue 39 where the shape fits; "simt": SIMT
// for every dtype; anything else fails with a message naming the variable and
// `op`), `tc_fits` / `flash_fits` whether those kernels can run this shape
// (performer_tensor_cores_fit, performer_flash_fit).  A shape the asked-for
// kernels cannot run takes SIMT.
PerformerKernels choose_performer_kernels(const char* op, c10::ScalarType dtype,
                                          const std::string& mode, bool tc_fits, bool flash_fits);

// NT_KERNELS_PERFORMER's value, "" when unset (read at every call).
std::string performer_kernels_mode();

}  // namespace nt_kernels
