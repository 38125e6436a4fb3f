// CUDA Performer launchers for float, the scratch size the implementations
// share and the tensor-core and flash support checks (the SIMT launch sequence is in
// segment_performer_launch.cuh, the tensor-core one in segment_performer_tc_launch.cuh).
#include "cuda/segment_performer_launch.cuh"
#include "cuda/segment_performer_fl_layout.cuh"
#include "cuda/segment_performer_tc_layout.cuh"

namespace nt_kernels {
namespace cuda {

size_t performer_scratch_floats(const PerformerProblem& p, bool backward) {
  if (p.impl == PerformerImpl::TensorCore) return performer_tc::tc_scratch_layout(p, backward).total;
  if (p.impl == PerformerImpl::Flash)  // the state follows the scratch unless the caller keeps it
    return performer_fl::fl_scratch_layout(p, p.elem, backward).total + performer_flash_state_floats(p);
  return scratch_layout(p, backward).total;
}

bool performer_tensor_cores_fit(const PerformerProblem& p, size_t elem_bytes) {
  return performer_tc::tc_fit(p, elem_bytes);
}

bool performer_flash_fit(const PerformerProblem& p, size_t elem_bytes) { return performer_fl::fl_fit(p, elem_bytes); }

size_t performer_flash_state_floats(const PerformerProblem& p) {
  return performer_fl::fl_state_layout(p, p.elem).total;
}

NT_PERFORMER_INSTANTIATE(float)

}  // namespace cuda
}  // namespace nt_kernels
