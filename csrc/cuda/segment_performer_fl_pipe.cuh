// Work walk, row staging and row-fragment I/O of the FlashAttention-2-style
// Performer kernels (issue 39).
//
// Work: the binding sorts the listed segments longest first, so chunk slots
// run from the longest segment's chunks to the shortest's.  A persistent CTA
// of the (chunk slots, heads) grid takes runs of FL_RUN consecutive slots
// (run r: slots r * FL_RUN ..), strided by the grid: consecutive chunks of one
// segment stay in one CTA, which stages W' / C' once for them.
// Rows: 16-byte cp.async vectors covering each row wherever it starts (any D),
// 2 threads per row, into a raw ring of fl_stages tiles; fragments are read
// from the raw rows with the row's element offset (no repack, except in the
// keys pass, whose k / v' tiles every warp reads).
#pragma once
#include <climits>

#include "cuda/segment_performer_fl_frag.cuh"
#include "cuda/segment_performer_fl_layout.cuh"

namespace nt_kernels {
namespace cuda {
namespace performer_fl {

using performer::chunk_end;
using performer::Geometry;
using performer_tc::cp_async16;
using performer_tc::cp_async_commit;
using performer_tc::vec_offset;

// The tensors of the passes (which ones a kernel reads or writes depends on the kernel).
template <typename T>
struct FlPass {
  const T* x = nullptr;          // q (queries) or k (keys, key gradients)
  const T* y = nullptr;          // v (keys, key gradients) or grad_o (query backward)
  const T* proj = nullptr;       // (m, D)
  T* out_x = nullptr;            // o, dq or dk
  T* out_y = nullptr;            // dv
  float* part = nullptr;         // (slot, head, row group) mp x dh partial sums: A (B in row m), then C
  float* part_max = nullptr;     // (slot, head, row group) mp per-feature maxima of A
  T* wmat = nullptr;             // (segment, head) mp x dh: W' = sigma W (state)
  float* wvec = nullptr;         // (segment, head) dh: sigma sum_f W_f (state)
  float* seg_stab = nullptr;     // (segment, head) key stabiliser M (state)
  float* wscale = nullptr;       // (segment, head) sigma (state)
  T* cmat = nullptr;             // (segment, head) mp x dh: C' = tau C
  float* cvec = nullptr;         // (segment, head) dh: tau sum_f C_f
  float* cscale = nullptr;       // (segment, head) tau
  unsigned* counters = nullptr;  // (segment, head) chunk tickets, zeroed before the launch
  int64_t elems = 0;             // E * H * D
  bool vec_x = false, vec_y = false;  // 16-byte aligned: rows staged with cp.async
};

template <typename T>
struct FlSmem {
  T *ps, *ws, *xs, *hs, *raw, *es, *gs;
  float *zs, *diag, *red;
  int *le, *flag;
};

template <typename T>
__device__ __forceinline__ FlSmem<T> fl_carve(unsigned char* base, const FlLayout& l) {
  FlSmem<T> s;
  s.ps = reinterpret_cast<T*>(base + l.ps);
  s.ws = reinterpret_cast<T*>(base + l.ws);
  s.zs = reinterpret_cast<float*>(base + l.zs);
  s.xs = reinterpret_cast<T*>(base + l.xs);
  s.hs = reinterpret_cast<T*>(base + l.hs);
  s.diag = reinterpret_cast<float*>(base + l.diag);
  s.raw = reinterpret_cast<T*>(base + l.raw);
  s.es = reinterpret_cast<T*>(base + l.es);
  s.gs = reinterpret_cast<T*>(base + l.gs);
  s.le = reinterpret_cast<int*>(base + l.le);
  s.red = reinterpret_cast<float*>(base + l.red);
  s.flag = reinterpret_cast<int*>(base + l.flag);
  return s;
}

__device__ __forceinline__ int fl_warp() { return performer_tc::thread_index() >> 5; }
__device__ __forceinline__ int fl_lane() { return performer_tc::thread_index() & 31; }

// Max over the CTA's FL_WARPS warps (NaN ignored); every thread gets it.
__device__ __forceinline__ float fl_block_max(float v, float* red) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(performer::FULL_MASK, v, off));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  v = red[0];
#pragma unroll
  for (int w = 1; w < FL_WARPS; ++w) v = fmaxf(v, red[w]);
  return v;
}

// ---- work walk ----

// A row-tile position inside a run, kept small (it lives in registers through every tile): the
// chunk's first row and row count, the tile's offset in it, the listed segment (sorted order) and
// the chunk slot; slot < 0 once past the run.  Slots and segment indices fit in 32 bits (the
// binding checks), rows do not need to.
struct Cursor {
  int64_t begin;
  int count, t0, index, slot, run_end;
  __device__ __forceinline__ bool live() const { return slot >= 0; }
  __device__ __forceinline__ int64_t row0() const { return begin + t0; }
  // The tile is the chunk's last one.
  __device__ __forceinline__ bool last_tile() const { return t0 + FL_TILE_ROWS >= count; }
};

// Points c at chunk `slot` of listed segment `index`.
__device__ __forceinline__ void seek(const Geometry& g, Cursor& c, int index, int slot) {
  const int64_t seg = g.segments[index];
  const int64_t first = g.chunk_offsets[index];
  c.index = index;
  c.slot = slot;
  c.t0 = 0;
  c.begin = g.rowptr[seg] + (slot - first) * PERFORMER_CHUNK_ROWS;
  c.count = (int)min((int64_t)PERFORMER_CHUNK_ROWS, g.rowptr[seg + 1] - c.begin);
}

// The first tile of the run of chunk slots [first, end) (warp-wide: the 32-way chunk search).
__device__ __forceinline__ Cursor first_tile(const Geometry& g, int64_t first, int64_t end) {
  Cursor c;
  c.run_end = (int)end;
  seek(g, c, (int)performer_tc::find_chunk_wide(g, first).index, (int)first);
  return c;
}

// The next tile of the run: the chunk's next one, or the next chunk slot's first (skipping
// empty segments), or none.
__device__ __forceinline__ void advance(const Geometry& g, Cursor& c) {
  if (!c.live()) return;
  c.t0 += FL_TILE_ROWS;
  if (c.t0 < c.count) return;
  const int slot = c.slot + 1;
  if (slot >= c.run_end) {
    c.slot = -1;
    return;
  }
  int index = c.index;
  while (g.chunk_offsets[index + 1] <= slot) ++index;
  seek(g, c, index, slot);
}

// Rows of the tile at c that fall to rows [first, first + span) of the tile, clipped to the chunk.
__device__ __forceinline__ int tile_rows(const Cursor& c, int first, int span) {
  return c.live() ? max(0, min(span, c.count - c.t0 - first)) : 0;
}

// Chunk slots of listed segment `index` ([first, end), end clipped to the scratch capacity).
__device__ __forceinline__ int64_t first_slot(const Geometry& g, int index) { return g.chunk_offsets[index]; }

// ---- portions: a segment's consecutive chunks inside one run ----
//
// A CTA sums the chunks of one segment it takes in a run into one partial record, kept in the
// slot of the portion's first chunk: the segment's first slot, then every run start inside the
// segment (slots r * FL_RUN).  The combine walks exactly those slots (next_portion), so no slot
// needs a mark.

// The portion ends with chunk c: the run ends or the segment's next chunk belongs to the next run.
__device__ __forceinline__ bool portion_ends(const Geometry& g, const Cursor& c) {
  return c.slot + 1 >= c.run_end || c.slot + 1 >= chunk_end(g, c.index);
}

// The slot of the next portion's record after the one at `slot`: the next run start.
__device__ __forceinline__ int64_t next_portion(int64_t slot) { return (slot & ~(int64_t)(FL_RUN - 1)) + FL_RUN; }

// Counts a portion of `n` chunks in `counter` (called by every thread after the record is
// written): whether it completed its segment and head, whose combine this CTA then runs.
// Integer atomic only; as performer_tc::last_chunk, for portions.
__device__ __forceinline__ bool last_portion(unsigned* counter, int n, int64_t nchunks, int* flag) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) *flag = atomicAdd(counter, (unsigned)n) + (unsigned)n == (unsigned)nchunks;
  __syncthreads();
  const bool last = *flag != 0;
  if (last) __threadfence();
  return last;
}

// ---- row staging ----

// Starts loading rows [row0, row0 + nrows) of head h of packed x into raw (rows of raw_ld
// elements), 2 threads per row (thread `tid` of the group: row tid >> 1).  With `vec` (x 16-byte
// aligned) the 16-byte vectors covering each row go by cp.async (the one past the tensor's end
// zero-filled, never read) and a row starts at its vec_offset; else element loads at offset 0.
template <typename T>
__device__ __forceinline__ void stage_rows(const T* __restrict__ x, int64_t elems, int64_t row0, int nrows,
                                           int64_t heads, int64_t h, int dim, int raw_ld, bool vec, T* raw,
                                           int tid) {
  const int r = tid >> 1, part = tid & 1;
  if (r >= nrows) return;
  const T* src = x + ((row0 + r) * heads + h) * dim;
  T* dst = raw + r * raw_ld;
  if (!vec) {
#pragma unroll 1
    for (int c = part; c < dim; c += 2) dst[c] = src[c];
    return;
  }
  const char* first = reinterpret_cast<const char*>(src - vec_offset(src));
  const char* end = reinterpret_cast<const char*>(src + dim);
  const char* stop = reinterpret_cast<const char*>(x + elems);
#pragma unroll 1
  for (const char* p = first + FL_VEC * part; p < end; p += 2 * FL_VEC) {
    const int bytes = (int)min((int64_t)FL_VEC, (int64_t)(stop - p));
    cp_async16(reinterpret_cast<char*>(dst) + (p - first), p, bytes);
  }
}

template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

// Where row r (of a staged tile starting at row0) begins in its raw row.
template <typename T>
__device__ __forceinline__ int raw_offset(const T* x, int64_t row0, int r, int64_t heads, int64_t h, int dim,
                                          bool vec) {
  return vec ? vec_offset(x + ((row0 + r) * heads + h) * dim) : 0;
}

// A warp's view of its 16 staged rows: the rows g and g + 8 of this lane, their raw offsets
// and validity.
template <typename T>
struct WarpRows {
  const T* raw;
  int raw_ld, off0, off1;
  bool ok0, ok1;
};

template <typename T>
__device__ __forceinline__ WarpRows<T> warp_rows(const T* x, const T* raw, int raw_ld, int64_t row0, int nrows,
                                                 int64_t heads, int64_t h, int dim, bool vec) {
  const int g = fl_lane() >> 2;
  WarpRows<T> w;
  w.raw = raw;
  w.raw_ld = raw_ld;
  w.ok0 = g < nrows;
  w.ok1 = g + 8 < nrows;
  w.off0 = w.ok0 ? raw_offset(x, row0, g, heads, h, dim, vec) : 0;
  w.off1 = w.ok1 ? raw_offset(x, row0, g + 8, heads, h, dim, vec) : 0;
  return w;
}

// Elements (A order) of the k16 column step s of the warp's rows: the staged values for columns
// < dim, `one` at column dim (v' = (v, 1)) when `ones`, zero elsewhere and in rows past the tile.
template <typename T>
__device__ __forceinline__ void row_values(const WarpRows<T>& w, int s, int dim, bool ones, T (&v)[8]) {
  const int g = fl_lane() >> 2, t = fl_lane() & 3;
  const T zero = from_float<T>(0.f), one = from_float<T>(1.f);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int hi = (i >> 1) & 1, c = FL_FRAG * s + 2 * t + (i & 1) + 8 * (i >> 2);
    const bool ok = hi ? w.ok1 : w.ok0;
    const int off = hi ? w.off1 : w.off0;
    v[i] = ok && c < dim ? w.raw[(g + 8 * hi) * w.raw_ld + off + c] : (ok && ones && c == dim ? one : zero);
  }
}

// Stores C tiles (columns 8n ..) of the warp's 16 rows to out[row0 + r, h, :dim] for valid rows,
// each value times the row's factor (fac[0]: row g, fac[1]: row g + 8).
template <typename T, int NT>
__device__ __forceinline__ void store_rows(T* out, int64_t row0, int nrows, int64_t heads, int64_t h, int dim,
                                           const float (&c)[NT][4], int tiles, const float (&fac)[2]) {
  const int g = fl_lane() >> 2, t = fl_lane() & 3;
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    const int r = g + 8 * hi;
    if (r >= nrows) continue;
    T* dst = out + ((row0 + r) * heads + h) * dim;
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int col = 8 * n + 2 * t + j;
        if (n < tiles && col < dim) dst[col] = from_float<T>(c[n][2 * hi + j] * fac[hi]);
      }
  }
}

// dst (mp x ld_h) in shared memory = the mp x dh T matrix at src (rows of whole 16-byte vectors),
// 8 threads per row, 16-byte loads.
template <typename T>
__device__ __forceinline__ void stage_matrix(const T* __restrict__ src, const FlDims& d, T* dst) {
  constexpr int PER = FL_VEC / sizeof(T);
  const int vecs = d.dh / PER;
#pragma unroll 1
  for (int f = threadIdx.x >> 3; f < d.mp; f += FL_THREADS >> 3)
#pragma unroll 1
    for (int v = threadIdx.x & 7; v < vecs; v += 8)
      *reinterpret_cast<uint4*>(dst + f * d.ld_h + v * PER) =
          __ldg(reinterpret_cast<const uint4*>(src + f * d.dh + v * PER));
}

}  // namespace performer_fl
}  // namespace cuda
}  // namespace nt_kernels
