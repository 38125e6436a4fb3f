// CUDA Performer launchers for float, the scratch size both implementations
// share and the tensor-core support check (the SIMT launch sequence is in
// segment_performer_launch.cuh, the tensor-core one in segment_performer_tc_launch.cuh).
#include "cuda/segment_performer_launch.cuh"
#include "cuda/segment_performer_tc_layout.cuh"

namespace nt_kernels {
namespace cuda {

size_t performer_scratch_floats(const PerformerProblem& p, bool backward) {
  if (p.impl == PerformerImpl::TensorCore) return performer_tc::tc_scratch_layout(p, backward).total;
  return scratch_layout(p, backward).total;
}

bool performer_tensor_cores_fit(const PerformerProblem& p, size_t elem_bytes) {
  return performer_tc::tc_fit(p, elem_bytes);
}

NT_PERFORMER_INSTANTIATE(float)

}  // namespace cuda
}  // namespace nt_kernels
