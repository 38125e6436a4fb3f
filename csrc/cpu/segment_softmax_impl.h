// Kernel bodies of the exact (softmax) CPU segment attention.
//
// Included once per ISA namespace (cpu/isa.h) by every file that runs these
// kernels (segment_softmax_kernel.cpp, ntconv_kernel.cpp), so it has no include
// guard; the including file provides <ATen/ATen.h>, simd_math.h, small_gemm.h,
// simd_vec.h, segment_softmax_args.h and, in the same namespace before this
// file, the per-ISA gemm_dispatch.h.
//
// Every function handles one *run*: rows [r0, r1) of one segment (rows
// relative to the segment start `start`, segment size n), for all heads.
// A row's result depends only on the row, never on the run it belongs to,
// which makes the kernels deterministic for any split among threads: the
// run is cut into chunks of SOFTMAX_CHUNK rows, and every product is a small
// GEMM (mm_acc) whose elements are each accumulated in a fixed order,
// whatever rows share the chunk.
//
// Layout: element (row, head, d) of a packed tensor sits at (row * H + head) * D + d.
// The block on the other side (keys in the forward and pass A, queries in
// pass B) is copied transposed (D x block) into scratch for the score GEMMs;
// the GEMMs that sum over the block read its rows in place (float32) or a
// converted copy (other types).

// x (rows x D, row stride `stride`) times `mul`, transposed into out (D x rows).
template <typename scalar_t, typename acc_t>
NT_INLINE void load_transposed(const scalar_t* x, int64_t stride, int64_t rows, int64_t D,
                               acc_t mul, acc_t* out) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t d = 0; d < D; ++d) out[d * rows + r] = mul * to_acc(x[r * stride + d]);
  }
}

// x (rows x D, row stride `stride`) times `mul`, into out (rows x D).
template <typename scalar_t, typename acc_t>
NT_INLINE void load_scaled_rows(const scalar_t* x, int64_t stride, int64_t rows, int64_t D, acc_t mul,
                                acc_t* out) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t d = 0; d < D; ++d) out[r * D + d] = mul * to_acc(x[r * stride + d]);
  }
}

// out (rows x nb) = x (rows x D, row stride ldx) times the block's rows
// [src, src + nb) of one head (row stride HD) scaled by `mul` and transposed
// into t (D x nb) first.
template <typename scalar_t, typename acc_t>
NT_INLINE void block_products(const acc_t* x, int64_t ldx, int64_t rows, const scalar_t* src,
                              int64_t HD, int64_t nb, int64_t D, acc_t mul, acc_t* t, acc_t* out) {
  load_transposed(src, HD, nb, D, mul, t);
  fill(out, rows * nb, acc_t(0));
  mm_acc(x, ldx, t, nb, out, nb, rows, D, nb);
}

// Forward: online softmax over key blocks for each chunk of query rows.
template <typename scalar_t>
void softmax_fwd_run(const SoftmaxArgs<scalar_t>& a, int64_t start, int64_t n, int64_t r0,
                     int64_t r1, acc_type_t<scalar_t>* scratch) {
  using acc_t = acc_type_t<scalar_t>;
  const int64_t H = a.H, D = a.D, HD = H * D;
  acc_t* kt = scratch;                         // D x BLOCK: transposed key block
  acc_t* vbuf = kt + D * SOFTMAX_BLOCK;        // BLOCK x D: value rows (converted types)
  acc_t* qs = vbuf + SOFTMAX_BLOCK * D;        // CHUNK x D: scaled query rows
  acc_t* s = qs + SOFTMAX_CHUNK * D;           // CHUNK x BLOCK: scores, then probabilities
  acc_t* run_max = s + SOFTMAX_CHUNK * SOFTMAX_BLOCK;  // CHUNK: running max of each row
  acc_t* run_sum = run_max + SOFTMAX_CHUNK;    // CHUNK: running sum of exp
  acc_t* out = run_sum + SOFTMAX_CHUNK;        // CHUNK x D: running (unnormalised) outputs
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t c0 = r0; c0 < r1; c0 += SOFTMAX_CHUNK) {
      const int64_t nc = std::min<int64_t>(SOFTMAX_CHUNK, r1 - c0);
      fill(run_max, nc, acc_t(-INFINITY));
      fill(run_sum, nc, acc_t(0));
      fill(out, nc * D, acc_t(0));
      load_scaled_rows(a.q + ((start + c0) * H + h) * D, HD, nc, D, a.scale, qs);
      for (int64_t kb = 0; kb < n; kb += SOFTMAX_BLOCK) {
        const int64_t nk = std::min<int64_t>(SOFTMAX_BLOCK, n - kb);
        const int64_t key0 = (start + kb) * H + h;
        // 1. scaled scores of the chunk against the block: s = qs K^T.
        block_products(qs, D, nc, a.k + key0 * D, HD, nk, D, acc_t(1), kt, s);
        for (int64_t i = 0; i < nc; ++i) {
          acc_t* si = s + i * nk;
          // 2. new running max; rescale the old sum and output by exp(old - new).
          const acc_t new_max = max_of(si, nk, run_max[i]);
          const acc_t alpha = exp_acc(run_max[i] - new_max);
          run_max[i] = new_max;
          // 3. probabilities (unnormalised) of the block and their sum.
          for (int64_t j = 0; j < nk; ++j) si[j] = exp_acc(si[j] - new_max);
          run_sum[i] = run_sum[i] * alpha + sum_of(si, nk);
          for (int64_t d = 0; d < D; ++d) out[i * D + d] *= alpha;
        }
        // 4. out += P V over the block's value rows.
        int64_t ldv;
        const acc_t* vb = view_rows(a.v + key0 * D, HD, nk, D, vbuf, ldv);
        mm_acc(s, nk, vb, ldv, out, D, nc, nk, D);
      }
      // 5. normalise and store o and lse = max + log(sum).
      for (int64_t i = 0; i < nc; ++i) {
        const int64_t row = (start + c0 + i) * H + h;
        const acc_t inv = acc_t(1) / run_sum[i];
        for (int64_t d = 0; d < D; ++d) a.out[row * D + d] = static_cast<scalar_t>(out[i * D + d] * inv);
        a.lse[row] = static_cast<float>(run_max[i] + std::log(run_sum[i]));
      }
    }
  }
}

// Backward pass A (query rows): delta_i = dO_i . O_i, the row's lse in the
// accumulation type, and dq_i = scale * sum_j p_ij (dO_i . v_j - delta_i) k_j.
template <typename scalar_t>
void softmax_bwd_query_run(const SoftmaxArgs<scalar_t>& a, int64_t start, int64_t n, int64_t r0,
                           int64_t r1, acc_type_t<scalar_t>* scratch) {
  using acc_t = acc_type_t<scalar_t>;
  const int64_t H = a.H, D = a.D, HD = H * D;
  acc_t* kt = scratch;                     // D x BLOCK: transposed key block
  acc_t* vt = kt + D * SOFTMAX_BLOCK;      // D x BLOCK: transposed value block
  acc_t* kbuf = vt + D * SOFTMAX_BLOCK;    // BLOCK x D: key rows (converted types)
  acc_t* qs = kbuf + SOFTMAX_BLOCK * D;    // CHUNK x D: scaled query rows
  acc_t* gbuf = qs + SOFTMAX_CHUNK * D;    // CHUNK x D: dO rows (converted types)
  acc_t* dq = gbuf + SOFTMAX_CHUNK * D;    // CHUNK x D
  acc_t* s = dq + SOFTMAX_CHUNK * D;       // CHUNK x BLOCK: scores -> ds
  acc_t* dp = s + SOFTMAX_CHUNK * SOFTMAX_BLOCK;  // CHUNK x BLOCK: dO_i . v_j
  acc_t* lse = dp + SOFTMAX_CHUNK * SOFTMAX_BLOCK;  // CHUNK
  acc_t* delta = lse + SOFTMAX_CHUNK;      // CHUNK
  acc_t* corr = delta + SOFTMAX_CHUNK;     // CHUNK: float64 lse refinement
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t c0 = r0; c0 < r1; c0 += SOFTMAX_CHUNK) {
      const int64_t nc = std::min<int64_t>(SOFTMAX_CHUNK, r1 - c0);
      const int64_t row0 = (start + c0) * H + h;
      // 1. delta and the saved lse of each row; the chunk's scaled q and dO.
      for (int64_t i = 0; i < nc; ++i) {
        const int64_t row = row0 + i * H;
        acc_t dot = 0;
        for (int64_t d = 0; d < D; ++d) dot += to_acc(a.grad_o[row * D + d]) * to_acc(a.o[row * D + d]);
        delta[i] = dot;
        lse[i] = a.lse_in[row];
      }
      load_scaled_rows(a.q + row0 * D, HD, nc, D, a.scale, qs);
      int64_t ldg;
      const acc_t* g = view_rows(a.grad_o + row0 * D, HD, nc, D, gbuf, ldg);
      fill(dq, nc * D, acc_t(0));
      // 2. float64 only: the saved lse is float32, refine it to float64 with
      //    lse += log(sum_j exp(s_ij - lse)) (one extra pass over the keys).
      if constexpr (std::is_same_v<acc_t, double>) {
        fill(corr, nc, acc_t(0));
        for (int64_t kb = 0; kb < n; kb += SOFTMAX_BLOCK) {
          const int64_t nk = std::min<int64_t>(SOFTMAX_BLOCK, n - kb);
          block_products(qs, D, nc, a.k + ((start + kb) * H + h) * D, HD, nk, D, acc_t(1), kt, s);
          for (int64_t i = 0; i < nc; ++i) {
            for (int64_t j = 0; j < nk; ++j) corr[i] += exp_acc(s[i * nk + j] - lse[i]);
          }
        }
        for (int64_t i = 0; i < nc; ++i) lse[i] += std::log(corr[i]);
      }
      // 3. dq accumulates ds k with ds_ij = p_ij (dp_ij - delta_i).
      for (int64_t kb = 0; kb < n; kb += SOFTMAX_BLOCK) {
        const int64_t nk = std::min<int64_t>(SOFTMAX_BLOCK, n - kb);
        const int64_t key0 = (start + kb) * H + h;
        block_products(qs, D, nc, a.k + key0 * D, HD, nk, D, acc_t(1), kt, s);
        block_products(g, ldg, nc, a.v + key0 * D, HD, nk, D, acc_t(1), vt, dp);
        for (int64_t i = 0; i < nc; ++i) {
          acc_t* si = s + i * nk;
          const acc_t* dpi = dp + i * nk;
          for (int64_t j = 0; j < nk; ++j) si[j] = exp_acc(si[j] - lse[i]) * (dpi[j] - delta[i]);
        }
        int64_t ldk;
        const acc_t* kr = view_rows(a.k + key0 * D, HD, nk, D, kbuf, ldk);
        mm_acc(s, nk, kr, ldk, dq, D, nc, nk, D);
      }
      // 4. store dq (times scale) and the row statistics for pass B.
      for (int64_t i = 0; i < nc; ++i) {
        const int64_t row = row0 + i * H;
        for (int64_t d = 0; d < D; ++d) a.dq[row * D + d] = static_cast<scalar_t>(a.scale * dq[i * D + d]);
        a.row_lse[row] = lse[i];
        a.row_delta[row] = delta[i];
      }
    }
  }
}

// Backward pass B (key rows): dv_j = sum_i p_ij dO_i and
// dk_j = scale * sum_i p_ij (dO_i . v_j - delta_i) q_i, using pass A's lse and delta.
template <typename scalar_t>
void softmax_bwd_key_run(const SoftmaxArgs<scalar_t>& a, int64_t start, int64_t n, int64_t r0,
                         int64_t r1, acc_type_t<scalar_t>* scratch) {
  using acc_t = acc_type_t<scalar_t>;
  const int64_t H = a.H, D = a.D, HD = H * D;
  acc_t* qt = scratch;                     // D x BLOCK: transposed scaled query block
  acc_t* gt = qt + D * SOFTMAX_BLOCK;      // D x BLOCK: transposed dO block
  acc_t* qbuf = gt + D * SOFTMAX_BLOCK;    // BLOCK x D: query rows (converted types)
  acc_t* gbuf = qbuf + SOFTMAX_BLOCK * D;  // BLOCK x D: dO rows (converted types)
  acc_t* kbuf = gbuf + SOFTMAX_BLOCK * D;  // CHUNK x D: key rows (converted types)
  acc_t* vbuf = kbuf + SOFTMAX_CHUNK * D;  // CHUNK x D: value rows (converted types)
  acc_t* dk = vbuf + SOFTMAX_CHUNK * D;    // CHUNK x D
  acc_t* dv = dk + SOFTMAX_CHUNK * D;      // CHUNK x D
  acc_t* s = dv + SOFTMAX_CHUNK * D;       // CHUNK x BLOCK: scores -> p -> ds
  acc_t* dp = s + SOFTMAX_CHUNK * SOFTMAX_BLOCK;  // CHUNK x BLOCK: dO_i . v_j
  acc_t* lse = dp + SOFTMAX_CHUNK * SOFTMAX_BLOCK;  // BLOCK: lse of the query block
  acc_t* delta = lse + SOFTMAX_BLOCK;      // BLOCK: delta of the query block
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t c0 = r0; c0 < r1; c0 += SOFTMAX_CHUNK) {
      const int64_t nc = std::min<int64_t>(SOFTMAX_CHUNK, r1 - c0);
      const int64_t key_row0 = (start + c0) * H + h;
      int64_t ldk, ldv;
      const acc_t* kc = view_rows(a.k + key_row0 * D, HD, nc, D, kbuf, ldk);
      const acc_t* vc = view_rows(a.v + key_row0 * D, HD, nc, D, vbuf, ldv);
      fill(dk, nc * D, acc_t(0));
      fill(dv, nc * D, acc_t(0));
      for (int64_t qb = 0; qb < n; qb += SOFTMAX_BLOCK) {
        // 1. the query block: scaled q and dO transposed, and its row statistics.
        const int64_t nq = std::min<int64_t>(SOFTMAX_BLOCK, n - qb);
        const int64_t query0 = (start + qb) * H + h;
        for (int64_t i = 0; i < nq; ++i) {
          lse[i] = a.row_lse[query0 + i * H];
          delta[i] = a.row_delta[query0 + i * H];
        }
        // 2. p_ij and dp_ij of the chunk's keys against every query of the block.
        block_products(kc, ldk, nc, a.q + query0 * D, HD, nq, D, a.scale, qt, s);
        block_products(vc, ldv, nc, a.grad_o + query0 * D, HD, nq, D, acc_t(1), gt, dp);
        for (int64_t j = 0; j < nc; ++j) {
          acc_t* sj = s + j * nq;
          for (int64_t i = 0; i < nq; ++i) sj[i] = exp_acc(sj[i] - lse[i]);
        }
        // 3. dv += p dO, then dk += p (dp - delta) q.
        int64_t ldg, ldq;
        const acc_t* gb = view_rows(a.grad_o + query0 * D, HD, nq, D, gbuf, ldg);
        mm_acc(s, nq, gb, ldg, dv, D, nc, nq, D);
        for (int64_t j = 0; j < nc; ++j) {
          acc_t* sj = s + j * nq;
          const acc_t* dpj = dp + j * nq;
          for (int64_t i = 0; i < nq; ++i) sj[i] *= dpj[i] - delta[i];
        }
        const acc_t* qr = view_rows(a.q + query0 * D, HD, nq, D, qbuf, ldq);
        mm_acc(s, nq, qr, ldq, dk, D, nc, nq, D);
      }
      // 4. store dk (times scale) and dv.
      for (int64_t j = 0; j < nc; ++j) {
        const int64_t key = key_row0 + j * H;
        for (int64_t d = 0; d < D; ++d) {
          a.dk[key * D + d] = static_cast<scalar_t>(a.scale * dk[j * D + d]);
          a.dv[key * D + d] = static_cast<scalar_t>(dv[j * D + d]);
        }
      }
    }
  }
}

// ---- whole segments with kept probabilities (the fused layer) -------------
// For a segment of n <= SOFTMAX_KEEP_MAX rows done by one thread that runs
// the forward and then the backward (the fused layer's recompute), all heads:
// the forward keeps P (n x n per head, at p + h n n); the backward needs no
// second score product and no exponential.  acc_t inputs only (scalar_t ==
// acc_t); scratch: softmax_keep_scratch_size(n, D).

// Forward: S = scale Q K^T, P = the row softmax of S (kept), o = P V, and lse.
template <typename acc_t>
void softmax_segment_fwd_keep(const SoftmaxArgs<acc_t>& a, int64_t start, int64_t n, acc_t* p,
                              acc_t* scratch) {
  const int64_t H = a.H, D = a.D, HD = H * D;
  acc_t* qs = scratch;     // n x D: scaled query rows
  acc_t* kt = qs + n * D;  // D x n: key rows transposed
  for (int64_t i = 0; i < n; ++i) fill(a.out + (start + i) * HD, HD, acc_t(0));
  for (int64_t h = 0; h < H; ++h) {
    const int64_t row0 = start * H + h;
    acc_t* ph = p + h * n * n;
    load_scaled_rows(a.q + row0 * D, HD, n, D, a.scale, qs);
    load_transposed(a.k + row0 * D, HD, n, D, acc_t(1), kt);
    fill(ph, n * n, acc_t(0));
    mm_acc(qs, D, kt, n, ph, n, n, D, n);
    for (int64_t i = 0; i < n; ++i) {
      acc_t* pi = ph + i * n;
      const acc_t peak = max_of(pi, n, acc_t(-INFINITY));
      for (int64_t j = 0; j < n; ++j) pi[j] = exp_acc(pi[j] - peak);
      const acc_t total = sum_of(pi, n);
      const acc_t inv = acc_t(1) / total;
      for (int64_t j = 0; j < n; ++j) pi[j] *= inv;
      a.lse[row0 + i * H] = static_cast<float>(peak + std::log(total));
    }
    mm_acc(ph, n, a.v + row0 * D, HD, a.out + row0 * D, HD, n, n, D);
  }
}

// Backward from the kept P: dP = dO V^T, dS = scale P (dP - rowsum(P dP)),
// dq = dS K, dk = dS^T Q, dv = P^T dO.
template <typename acc_t>
void softmax_segment_bwd_kept(const SoftmaxArgs<acc_t>& a, int64_t start, int64_t n, const acc_t* p,
                              acc_t* scratch) {
  const int64_t H = a.H, D = a.D, HD = H * D;
  acc_t* vt = scratch;     // D x n: value rows transposed
  acc_t* ds = vt + D * n;  // n x n: dP, then dS
  for (int64_t i = 0; i < n; ++i) {
    for (acc_t* d : {a.dq, a.dk, a.dv}) fill(d + (start + i) * HD, HD, acc_t(0));
  }
  for (int64_t h = 0; h < H; ++h) {
    const int64_t row0 = start * H + h;
    const acc_t* ph = p + h * n * n;
    const acc_t* go = a.grad_o + row0 * D;
    load_transposed(a.v + row0 * D, HD, n, D, acc_t(1), vt);
    fill(ds, n * n, acc_t(0));
    mm_acc(go, HD, vt, n, ds, n, n, D, n);
    for (int64_t i = 0; i < n; ++i) {
      const acc_t* pi = ph + i * n;
      acc_t* di = ds + i * n;
      const acc_t delta = dot_of(pi, di, n);
      for (int64_t j = 0; j < n; ++j) di[j] = a.scale * pi[j] * (di[j] - delta);
    }
    mm_acc(ds, n, a.k + row0 * D, HD, a.dq + row0 * D, HD, n, n, D);
    mm_acc<true>(ds, n, a.q + row0 * D, HD, a.dk + row0 * D, HD, n, n, D);
    mm_acc<true>(ph, n, go, HD, a.dv + row0 * D, HD, n, n, D);
  }
}
