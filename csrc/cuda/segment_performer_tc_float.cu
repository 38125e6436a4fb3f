// Tensor-core CUDA Performer launchers for float: 3xTF32 products (segment_performer_tc_device.cuh),
// run when NT_KERNELS_PERFORMER=tc asks for them (the launch sequence is in segment_performer_tc_launch.cuh).
#include "cuda/segment_performer_tc_launch.cuh"

namespace nt_kernels {
namespace cuda {

NT_PERFORMER_TC_INSTANTIATE(float)

}  // namespace cuda
}  // namespace nt_kernels
