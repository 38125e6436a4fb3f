// FlashAttention-2-style CUDA Performer launchers for float, products as 3xTF32 (issue 39; the
// launch sequence is in segment_performer_fl_launch.cuh), run when NT_KERNELS_PERFORMER=flash
// asks for them.
#include "cuda/segment_performer_fl_launch.cuh"

namespace nt_kernels {
namespace cuda {

NT_PERFORMER_FL_INSTANTIATE(float)

}  // namespace cuda
}  // namespace nt_kernels
