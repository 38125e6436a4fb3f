// Tensor-core CUDA Performer launchers for __nv_bfloat16 (the launch sequence is in segment_performer_tc_launch.cuh).
#include "cuda/segment_performer_tc_launch.cuh"

namespace nt_kernels {
namespace cuda {

NT_PERFORMER_TC_INSTANTIATE(__nv_bfloat16)

}  // namespace cuda
}  // namespace nt_kernels
