// A process-wide buffer for an op's per-call transients (the fused layer's
// (E, C) message and gradient buffers), kept between calls.
//
// A fresh large allocation costs one page fault per 4 KiB page when it is first
// written (and the pages are returned on free), which on small VMs takes as long
// as a good part of the op; successive layers and steps reuse this buffer
// instead.  One call at a time holds it (a lease); a call that finds it held,
// e.g. from another Python thread, allocates its own transients as usual.  The
// buffer keeps the largest size requested so far.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <mutex>

namespace nt_kernels::cpu {

class TransientLease {
 public:
  // Reserves `bytes` (the sum of every take() of this lease, each rounded up to 64 bytes).
  explicit TransientLease(int64_t bytes) : bytes_(bytes) {
    std::lock_guard<std::mutex> lock(state().mutex);
    if (state().held) return;
    state().held = held_ = true;
    if (state().buffer.numel() < bytes) state().buffer = at::empty({bytes}, at::kByte);
  }
  TransientLease(const TransientLease&) = delete;
  TransientLease& operator=(const TransientLease&) = delete;
  ~TransientLease() {
    if (!held_) return;
    std::lock_guard<std::mutex> lock(state().mutex);
    state().held = false;
  }

  // An uninitialised contiguous tensor of `shape` and `dtype` from the buffer
  // (or freshly allocated when the buffer is held elsewhere).  Valid while the lease lives.
  at::Tensor take(at::IntArrayRef shape, at::ScalarType dtype) {
    if (!held_) return at::empty(shape, at::TensorOptions().dtype(dtype));
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    const int64_t size = numel * static_cast<int64_t>(c10::elementSize(dtype));
    TORCH_CHECK(offset_ + size <= bytes_, "TransientLease: reserved ", bytes_, " bytes, asked for ",
                offset_ + size);
    at::Tensor t = state().buffer.narrow(0, offset_, size).view(dtype).view(shape);
    offset_ += (size + ALIGN - 1) / ALIGN * ALIGN;
    return t;
  }

  // The bytes a take() of `numel` elements of `dtype` uses.
  static int64_t bytes_of(int64_t numel, at::ScalarType dtype) {
    const int64_t size = numel * static_cast<int64_t>(c10::elementSize(dtype));
    return (size + ALIGN - 1) / ALIGN * ALIGN;
  }

 private:
  static constexpr int64_t ALIGN = 64;
  struct State {
    std::mutex mutex;
    bool held = false;
    at::Tensor buffer = at::empty({0}, at::kByte);
  };
  static State& state() {
    static State* s = new State;  // never destroyed: no tensor freed during static destruction
    return *s;
  }

  int64_t bytes_;
  int64_t offset_ = 0;
  bool held_ = false;
};

}  // namespace nt_kernels::cpu
