// CUDA Performer launchers for float, and the scratch size both dtypes share
// (the launch sequence is in segment_performer_launch.cuh).
#include "cuda/segment_performer_launch.cuh"

namespace nt_kernels {
namespace cuda {

size_t performer_scratch_floats(const PerformerProblem& p, bool backward) {
  return scratch_layout(p, backward).total;
}

NT_PERFORMER_INSTANTIATE(float)

}  // namespace cuda
}  // namespace nt_kernels
