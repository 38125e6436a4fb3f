// Value checks of a segment table (rowptr + the segment ids a kernel is asked
// to process) computed with tensor ops on the tensors' own device, so that a
// CUDA binding can check without copying the table to the host: one small
// device-to-host copy of the summary, and none for a table already checked
// (ValidatedTables).  Messages match the CPU kernels' host checks.
#pragma once
#include <cstdint>
#include <mutex>
#include <vector>

#include <ATen/ATen.h>

namespace nt_kernels {

// Fails (c10::Error naming `op` and the argument) unless rowptr[0] == 0,
// rowptr is non-decreasing, rowptr[-1] == num_rows, every segment id is in
// [0, S) and no id is listed twice.  rowptr and segments: 1-D int64 on one device.
void check_segment_table(const char* op, const at::Tensor& rowptr, const at::Tensor& segments,
                         int64_t num_rows);

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
