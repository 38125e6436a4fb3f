// C += A B for float32 with W-lane vectors (simd_vec.h), W a template
// parameter: the one vector GEMM of every x86 ISA build (cpu/isa_builds.h;
// included by gemm_dispatch.h inside the build's namespace and under its
// target options, so no include guard).
//
// Columns are walked in panels of up to PANEL_VECS vectors (the last vector
// masked when N is not a multiple of W), and a tile of rows x the panel stays
// in registers while K is walked; every A element is a broadcast load, so no
// shuffles are needed for either layout of A.  Rows go in tiles of
// tile_rows<W, NV>() (the register file of the ISA), the rest in tiles of
// half, a quarter, ... that size.  Each C element is accumulated over
// i = 0..K-1 in order with one FMA per step whatever the tile shape, so a
// row's result does not depend on how rows were grouped (nor on W).

namespace simd_gemm {

constexpr int PANEL_VECS = 4;  // vectors per column panel

// Rows per full tile of NV vectors: ROWS x NV accumulators plus the NV B
// vectors and the broadcast A fit the ISA's vector registers.
template <int W, int NV>
constexpr int tile_rows() {
  constexpr int AVX2_ROWS[PANEL_VECS] = {8, 6, 4, 3};     // 16 registers
  constexpr int AVX512_ROWS[PANEL_VECS] = {16, 12, 8, 6};  // 32 registers
  return SimdVec<W>::REGS >= 32 ? AVX512_ROWS[NV - 1] : AVX2_ROWS[NV - 1];
}

// Vector v of NV at p: masked when it is the last one of a MASKED panel.
template <int W, int NV, bool MASKED>
NT_INLINE typename SimdVec<W>::Reg load_vec(const float* p, int v, typename SimdVec<W>::Mask mask) {
  return MASKED && v == NV - 1 ? SimdVec<W>::load(p, mask) : SimdVec<W>::load(p);
}

template <int W, int NV, bool MASKED>
NT_INLINE void store_vec(float* p, int v, typename SimdVec<W>::Mask mask, typename SimdVec<W>::Reg x) {
  if (MASKED && v == NV - 1) {
    SimdVec<W>::store(p, mask, x);
  } else {
    SimdVec<W>::store(p, x);
  }
}

// One tile: ROWS rows of C, NV vectors wide (the last one masked when MASKED).
template <int W, int ROWS, int NV, bool MASKED, bool A_T>
NT_INLINE void gemm_tile(const float* __restrict A, int64_t lda, const float* __restrict B, int64_t ldb,
                         float* __restrict C, int64_t ldc, int64_t K, typename SimdVec<W>::Mask mask) {
  using V = SimdVec<W>;
  typename V::Reg acc[ROWS][NV];
#pragma GCC unroll 16
  for (int t = 0; t < ROWS; ++t) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[t][v] = load_vec<W, NV, MASKED>(C + t * ldc + v * W, v, mask);
  }
  for (int64_t i = 0; i < K; ++i) {
    const float* b_row = B + i * ldb;
    typename V::Reg b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = load_vec<W, NV, MASKED>(b_row + v * W, v, mask);
#pragma GCC unroll 16
    for (int t = 0; t < ROWS; ++t) {
      const typename V::Reg a = V::broadcast(A_T ? A + i * lda + t : A + t * lda + i);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[t][v] = V::fmadd(a, b[v], acc[t][v]);
    }
  }
#pragma GCC unroll 16
  for (int t = 0; t < ROWS; ++t) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) store_vec<W, NV, MASKED>(C + t * ldc + v * W, v, mask, acc[t][v]);
  }
}

// Rows [0, rows) of one column panel NV vectors wide in tiles of ROWS rows;
// fewer than ROWS left over go to tiles of ROWS / 2, and so on down to 1.
template <int W, int ROWS, int NV, bool MASKED, bool A_T>
void gemm_rows(const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc, int64_t rows,
               int64_t K, typename SimdVec<W>::Mask mask) {
  const auto row_a = [&](int64_t r) { return A_T ? A + r : A + r * lda; };
  int64_t r = 0;
  for (; r + ROWS <= rows; r += ROWS) {
    gemm_tile<W, ROWS, NV, MASKED, A_T>(row_a(r), lda, B, ldb, C + r * ldc, ldc, K, mask);
  }
  if constexpr (ROWS > 1) {
    if (r < rows) gemm_rows<W, ROWS / 2, NV, MASKED, A_T>(row_a(r), lda, B, ldb, C + r * ldc, ldc, rows - r, K, mask);
  }
}

template <int W, bool MASKED, bool A_T>
void gemm_panel(int vecs, const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc,
                int64_t rows, int64_t K, typename SimdVec<W>::Mask mask) {
  switch (vecs) {
    case 1: return gemm_rows<W, tile_rows<W, 1>(), 1, MASKED, A_T>(A, lda, B, ldb, C, ldc, rows, K, mask);
    case 2: return gemm_rows<W, tile_rows<W, 2>(), 2, MASKED, A_T>(A, lda, B, ldb, C, ldc, rows, K, mask);
    case 3: return gemm_rows<W, tile_rows<W, 3>(), 3, MASKED, A_T>(A, lda, B, ldb, C, ldc, rows, K, mask);
    default: return gemm_rows<W, tile_rows<W, 4>(), 4, MASKED, A_T>(A, lda, B, ldb, C, ldc, rows, K, mask);
  }
}

// C (rows x N, stride ldc) += A (rows x K, or K x rows when A_T) times B (K x N, stride ldb).
template <int W, bool A_T>
void gemm_acc(const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc, int64_t rows,
              int64_t K, int64_t N) {
  using V = SimdVec<W>;
  if (rows <= 0 || N <= 0) return;
  constexpr int64_t PANEL = PANEL_VECS * W;
  for (int64_t col = 0; col < N; col += PANEL) {
    const int64_t width = N - col < PANEL ? N - col : PANEL;
    const int vecs = static_cast<int>((width + W - 1) / W);
    const int tail = static_cast<int>(width - (vecs - 1) * W);
    if (tail == W) {
      gemm_panel<W, false, A_T>(vecs, A, lda, B + col, ldb, C + col, ldc, rows, K, typename V::Mask{});
    } else {
      gemm_panel<W, true, A_T>(vecs, A, lda, B + col, ldb, C + col, ldc, rows, K, V::mask_of(tail));
    }
  }
}

}  // namespace simd_gemm
