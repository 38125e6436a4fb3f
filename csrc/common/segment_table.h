// Value checks of a segment table (rowptr + the segment ids a kernel is asked
// to process) computed with tensor ops on the tensors' own device, so that a
// CUDA binding can check without copying the table to the host: one small
// device-to-host copy of the summary, and none for a table already checked
// (ValidatedTables).  Messages match the CPU kernels' host checks.
//
// Trusted tables (docs/design.md, "Host syncs"): performer_segment_table checks
// a table once and returns the Performer kernels' chunk offsets of its
// segments; a caller that holds them (the fused layer's plan, built once per
// graph) passes them to performer_{fwd,bwd}_table_into, whose CUDA kernel
// then neither checks nor recomputes anything: no sync and no launch besides
// the Performer kernels themselves.  On other devices those ops check that the
// offsets are the table's (a false table is an error naming the argument).
#pragma once
#include <cstdint>
#include <mutex>
#include <vector>

#include <ATen/ATen.h>

namespace nt_kernels {

// Rows of one CUDA Performer work item (cuda::PERFORMER_CHUNK_ROWS; the CUDA
// binding asserts at compile time that the two agree).
constexpr int64_t PERFORMER_TABLE_CHUNK_ROWS = 256;

// Fails (c10::Error naming `op` and the argument) unless rowptr[0] == 0,
// rowptr is non-decreasing, rowptr[-1] == num_rows, every segment id is in
// [0, S) and no id is listed twice.  rowptr and segments: 1-D int64 on one device.
void check_segment_table(const char* op, const at::Tensor& rowptr, const at::Tensor& segments,
                         int64_t num_rows);

// The chunk offsets of the listed segments: (K + 1,) int64, the exclusive
// scan of ceil(n_i / chunk_rows) (device ops, no sync, no value checks).
at::Tensor performer_chunk_offsets(const at::Tensor& rowptr, const at::Tensor& segments,
                                   int64_t chunk_rows);

// check_segment_table, then performer_chunk_offsets with PERFORMER_TABLE_CHUNK_ROWS.
at::Tensor performer_segment_table(const char* op, const at::Tensor& rowptr,
                                   const at::Tensor& segments, int64_t num_rows);

// Fails unless `table` is shaped like the chunk offsets of `segments`: 1-D
// int64, K + 1 entries, contiguous, on the segments' device (no value check).
void check_table_shape(const char* op, const at::Tensor& table, const at::Tensor& segments);

// The (rowptr, segments, num_rows) tables that passed check_segment_table,
// identified by tensor object and version counter: an in-place change of
// either tensor bumps its version and the table is checked again.  Holds weak
// references only (a freed tensor's entry never matches a new tensor) and the
// most recent MAX_ENTRIES tables.  Thread-safe.
class ValidatedTables {
 public:
  static constexpr size_t MAX_ENTRIES = 16;

  // check_segment_table unless this exact table passed before.
  void check(const char* op, const at::Tensor& rowptr, const at::Tensor& segments,
             int64_t num_rows);

 private:
  using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  struct Entry {
    WeakImpl rowptr, segments;
    int64_t rowptr_version, segments_version, num_rows;
  };
  bool seen(const at::Tensor& rowptr, const at::Tensor& segments, int64_t num_rows);

  std::mutex mutex_;
  std::vector<Entry> entries_;  // oldest first
};

}  // namespace nt_kernels
