// Torch-free launchers of the CUDA Performer (FAVOR+) kernels over CSR segments.
//
// Tensors are raw pointers into packed (E, H, D) rows (row r, head h starts at
// (r * H + h) * D), rowptr / segments / chunk_offsets are int64 device arrays,
// and every launcher runs on the given stream.  Algorithm and launch
// configuration: docs/kernels-performer-cuda.md ("CUDA Performer (FAVOR+) kernel" and
// "CUDA Performer on tensor cores").
#pragma once
#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace nt_kernels {
namespace cuda {

// Rows of one segment handled by one block (one work item) in every pass; a
// segment of n rows is split into ceil(n / PERFORMER_CHUNK_ROWS) chunks.
constexpr int PERFORMER_CHUNK_ROWS = 256;
// Largest head dimension the kernels support.
constexpr int PERFORMER_MAX_DIM = 256;

// Which kernels run a call: the SIMT kernels (every dtype, fp32 arithmetic),
// the tensor-core kernels of issue 27 (shapes that pass performer_tensor_cores_fit;
// bf16 / fp16, fp32 as 3xTF32) or the FlashAttention-2-style kernels of issue 39
// (shapes that pass performer_flash_fit; the same dtypes).  The binding chooses
// (NT_KERNELS_PERFORMER).
enum class PerformerImpl : int { Simt = 0, TensorCore = 1, Flash = 2 };

struct PerformerProblem {
  int64_t rows = 0;           // E, packed rows of q, k, v
  int heads = 0;              // H
  int dim = 0;                // D, 1..PERFORMER_MAX_DIM
  int features = 0;           // m, rows of the projection, >= 1
  int64_t num_segments = 0;   // K, entries of `segments`
  const int64_t* rowptr = nullptr;         // (S + 1,)
  const int64_t* segments = nullptr;       // (K,) distinct segment ids to process
  const int64_t* chunk_offsets = nullptr;  // (K + 1,) exclusive scan of ceil(n_i / CHUNK)
  int64_t chunk_capacity = 0;  // chunks the scratch has room for (>= chunk_offsets[K])
  float eps = 1e-4f;
  int sm_count = 0;            // multiprocessors of the device (grid sizing)
  size_t smem_optin = 0;       // shared memory bytes a block may opt in to (tensor-core kernels)
  size_t elem = 4;             // bytes of one element of q, k, v (the flash kernels' state holds them)
  PerformerImpl impl = PerformerImpl::Simt;
};

// Upper bound on chunk_offsets[K] for distinct segments over E rows.
inline int64_t performer_chunk_capacity(int64_t rows, int64_t num_segments) {
  return num_segments + (rows + PERFORMER_CHUNK_ROWS - 1) / PERFORMER_CHUNK_ROWS;
}

// float32 scratch elements the forward / backward launcher needs (for p.impl).
size_t performer_scratch_floats(const PerformerProblem& p, bool backward);

// Whether the tensor-core kernels can run p's shape with operand elements of
// `elem_bytes` (2: bf16 / fp16, 4: fp32): the (m x (D+1)) sums fit the
// register-resident accumulators and every kernel's shared memory fits
// p.smem_optin.
bool performer_tensor_cores_fit(const PerformerProblem& p, size_t elem_bytes);

// Whether the flash kernels can run p's shape with elements of `elem_bytes` (2 or 4).
bool performer_flash_fit(const PerformerProblem& p, size_t elem_bytes);

// float32 slots of the per-segment state the flash kernels' forward leaves for their backward
// (W' = sigma W, its column sums, the key stabilisers and sigma; p.elem-byte matrices).
size_t performer_flash_state_floats(const PerformerProblem& p);

// o = Performer attention of every row of the listed segments; other rows of o
// are left untouched.  `scratch` holds performer_scratch_floats(p, false) floats.
// Runs the tensor-core kernels when p.impl says so.
template <typename T>
cudaError_t performer_forward(const PerformerProblem& p, const T* q, const T* k, const T* v,
                              const T* projection, T* o, float* scratch, cudaStream_t stream);

// dq, dk, dv of the listed segments' rows given grad_o (stabilisers constant,
// no gradient for the projection); other rows are left untouched.
template <typename T>
cudaError_t performer_backward(const PerformerProblem& p, const T* grad_o, const T* q, const T* k,
                               const T* v, const T* projection, T* dq, T* dk, T* dv,
                               float* scratch, cudaStream_t stream);

// The tensor-core launchers (T = __half, __nv_bfloat16, float; segment_performer_tc_*.cu).
template <typename T>
cudaError_t performer_forward_tc(const PerformerProblem& p, const T* q, const T* k, const T* v,
                                 const T* projection, T* o, float* scratch, cudaStream_t stream);
template <typename T>
cudaError_t performer_backward_tc(const PerformerProblem& p, const T* grad_o, const T* q,
                                  const T* k, const T* v, const T* projection, T* dq, T* dk,
                                  T* dv, float* scratch, cudaStream_t stream);

// The flash launchers (T = __half, __nv_bfloat16, float; segment_performer_fl_*.cu).  `state`
// (performer_flash_state_floats(p) floats) receives the keys pass' per-segment state in the
// forward; nullptr keeps it in the scratch.  The backward runs the keys pass unless
// `state_ready` says that `state` holds the state of a forward on the same k, v, segments and
// projection (the fused layer's recomputed forward: the keys pass once per backward).
template <typename T>
cudaError_t performer_forward_fl(const PerformerProblem& p, const T* q, const T* k, const T* v,
                                 const T* projection, T* o, float* scratch, float* state, cudaStream_t stream);
template <typename T>
cudaError_t performer_backward_fl(const PerformerProblem& p, const T* grad_o, const T* q,
                                  const T* k, const T* v, const T* projection, T* dq, T* dk,
                                  T* dv, float* scratch, float* state, bool state_ready, cudaStream_t stream);

}  // namespace cuda
}  // namespace nt_kernels
