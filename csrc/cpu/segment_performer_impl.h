// Kernel bodies of the Performer (FAVOR+) CPU segment attention.
//
// Included once per ISA namespace (cpu/isa.h) by every file that runs these
// kernels (segment_performer_kernel.cpp, ntconv_kernel.cpp), so it has no
// include guard; the including file provides simd_math.h, small_gemm.h,
// simd_vec.h, segment_performer_args.h and, in the same namespace before this
// file, the per-ISA gemm_dispatch.h.
//
// Notation (DESIGN §4), per head: Pc = c P (m x D) and its transpose PcT,
// c = D^-1/4, u = x Pc^T, diag = c^2 |x|^2 / 2, w = u - diag,
// e = exp(w - stab), phi = fs (e + eps) with fs = m^-1/2.
// A key block's statistics are kept *without* fs and eps and relative to the
// block's own max M_b:  S'_b = sum_j e_j v_j^T, z'_b = sum_j e_j, vsum_b = sum_j v_j,
// so blocks of one segment combine exactly into
//   S = fs (sum_b exp(M_b - M) S'_b + eps vsum),  z = fs (sum_b exp(M_b - M) z'_b + eps n).
// Statistics layout per head (stats_size = 1 + m D + m + D):
//   [M | S or S' or dS (m x D) | z or z' or dz (m) | vsum (D)].

// Rows are processed in groups of PERFORMER_GROUP so that every product is a
// small GEMM (small_gemm.h).  Group scratch (acc_t), see GroupScratch below.
template <typename acc_t>
struct GroupScratch {
  acc_t *x, *g, *out;  // GROUP x D: input rows, dO or v rows, products
  acc_t *e, *phi, *t;  // GROUP x m: exp parts, features, U / S g / dw
  acc_t *diag, *aux;   // GROUP: c^2 |x|^2 / 2; den or sum(dw)
  acc_t* st;           // D x m: S or dS transposed
  // The current group's input rows (x) and dO or v rows (g) as acc_t: views of
  // the packed tensors when they are acc_t already, else converted copies in x, g.
  const acc_t* xr = nullptr;
  const acc_t* gr = nullptr;
  int64_t ldx = 0, ldg = 0;
  GroupScratch(acc_t* p, int64_t D, int64_t m) {
    x = p; g = x + PERFORMER_GROUP * D; out = g + PERFORMER_GROUP * D;
    e = out + PERFORMER_GROUP * D; phi = e + PERFORMER_GROUP * m; t = phi + PERFORMER_GROUP * m;
    diag = t + PERFORMER_GROUP * m; aux = diag + PERFORMER_GROUP; st = aux + PERFORMER_GROUP;
  }
};

// Prefetches the head's D elements of rows [first, last) of x (row stride
// `stride`), clipped to the nr rows of the current run: the next group's rows
// are requested while this group computes.
template <typename scalar_t>
NT_INLINE void prefetch_rows(const scalar_t* x, int64_t stride, int64_t first, int64_t last, int64_t nr,
                             int64_t D) {
  constexpr int64_t LINE = 64;
  last = last < nr ? last : nr;
  for (int64_t r = first; r < last; ++r) {
    const char* row = reinterpret_cast<const char*>(x + r * stride);
    for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(scalar_t)); b += LINE) __builtin_prefetch(row + b);
  }
}

// u = x Pc^T for ng rows (viewed in sc.xr), into u (ng x m); diag per row into sc.diag.
template <typename scalar_t, typename acc_t>
NT_INLINE void project_group(const PerformerArgs<scalar_t>& a, const scalar_t* x, int64_t ng,
                             acc_t* u, GroupScratch<acc_t>& sc) {
  const int64_t m = a.m, D = a.D;
  sc.xr = view_rows(x, a.H * D, ng, D, sc.x, sc.ldx);
  fill(u, ng * m, acc_t(0));
  mm_acc(sc.xr, sc.ldx, a.proj_t, m, u, m, ng, D, m);
  for (int64_t r = 0; r < ng; ++r) {
    const acc_t* xr = sc.xr + r * sc.ldx;
    sc.diag[r] = a.half_c2 * dot_of(xr, xr, D);
  }
}

// Keys of one block: w = u - diag into w (nr x m); returns the block's max of u.
template <typename scalar_t, typename acc_t>
NT_INLINE acc_t key_features(const PerformerArgs<scalar_t>& a, const scalar_t* k, int64_t nr,
                             acc_t* w, GroupScratch<acc_t>& sc) {
  const int64_t m = a.m, HD = a.H * a.D;
  acc_t umax = -INFINITY;
  for (int64_t g0 = 0; g0 < nr; g0 += PERFORMER_GROUP) {
    const int64_t ng = std::min<int64_t>(PERFORMER_GROUP, nr - g0);
    acc_t* wg = w + g0 * m;
    prefetch_rows(k, HD, g0 + PERFORMER_GROUP, g0 + 2 * PERFORMER_GROUP, nr, a.D);
    project_group(a, k + g0 * HD, ng, wg, sc);
    umax = max_of(wg, ng * m, umax);
    for (int64_t r = 0; r < ng; ++r) {
      const acc_t diag = sc.diag[r];
      for (int64_t f = 0; f < m; ++f) wg[r * m + f] -= diag;
    }
  }
  return umax;
}

// Statistics [M_b | S'_b | z'_b | vsum_b] of one head's key block into st;
// leaves e = exp(w - M_b) in w (nr x m).
template <typename scalar_t, typename acc_t>
NT_INLINE void key_block_stats(const PerformerArgs<scalar_t>& a, const scalar_t* k,
                               const scalar_t* v, int64_t nr, acc_t* w, acc_t* st,
                               GroupScratch<acc_t>& sc) {
  const int64_t m = a.m, D = a.D, HD = a.H * a.D;
  acc_t* s = st + 1;
  acc_t* z = s + m * D;
  acc_t* vsum = z + m;
  const acc_t block_max = key_features(a, k, nr, w, sc);
  st[0] = block_max;
  fill(s, m * D + m + D, acc_t(0));
  for (int64_t g0 = 0; g0 < nr; g0 += PERFORMER_GROUP) {
    const int64_t ng = std::min<int64_t>(PERFORMER_GROUP, nr - g0);
    acc_t* eg = w + g0 * m;
    prefetch_rows(v, HD, g0 + PERFORMER_GROUP, g0 + 2 * PERFORMER_GROUP, nr, D);
    for (int64_t i = 0; i < ng * m; ++i) eg[i] = exp_acc(eg[i] - block_max);
    sc.gr = view_rows(v + g0 * HD, HD, ng, D, sc.g, sc.ldg);
    // S'[f][:] += sum_r e[r][f] v[r][:];  z'[f] += sum_r e[r][f];  vsum += sum_r v[r].
    mm_acc<true>(eg, m, sc.gr, sc.ldg, s, D, m, ng, D);
    for (int64_t r = 0; r < ng; ++r) {
      for (int64_t f = 0; f < m; ++f) z[f] += eg[r * m + f];
      for (int64_t d = 0; d < D; ++d) vsum[d] += sc.gr[r * sc.ldg + d];
    }
  }
}

// Combines nb block statistics (stride `stride` between blocks) of one head
// into the segment's [M | S | z] in out.
template <typename scalar_t, typename acc_t>
NT_INLINE void combine_key_stats(const PerformerArgs<scalar_t>& a, const acc_t* parts,
                                 int64_t stride, int64_t nb, int64_t n, acc_t* out) {
  const int64_t m = a.m, D = a.D, SD = m * D;
  acc_t seg_max = -INFINITY;
  for (int64_t b = 0; b < nb; ++b) seg_max = parts[b * stride] > seg_max ? parts[b * stride] : seg_max;
  acc_t* s = out + 1;
  acc_t* z = s + SD;
  fill(s, SD + m, acc_t(0));
  for (int64_t b = 0; b < nb; ++b) {
    const acc_t* p = parts + b * stride;
    const acc_t rescale = nb == 1 ? acc_t(1) : exp_acc(p[0] - seg_max);
    for (int64_t i = 0; i < SD + m; ++i) s[i] += rescale * p[1 + i];
  }
  for (int64_t f = 0; f < m; ++f) {
    for (int64_t d = 0; d < D; ++d) {
      acc_t vsum = 0;
      for (int64_t b = 0; b < nb; ++b) vsum += parts[b * stride + 1 + SD + m + d];
      s[f * D + d] = a.feat_scale * (s[f * D + d] + a.eps * vsum);
    }
    z[f] = a.feat_scale * (z[f] + a.eps * static_cast<acc_t>(n));
  }
  out[0] = seg_max;
}

// Query features of ng rows: e = exp(u - diag - max u) into sc.e, phi = fs (e + eps) into sc.phi.
template <typename scalar_t, typename acc_t>
NT_INLINE void query_features(const PerformerArgs<scalar_t>& a, const scalar_t* q, int64_t ng,
                              GroupScratch<acc_t>& sc) {
  const int64_t m = a.m;
  const acc_t fs = a.feat_scale, eps = a.eps;
  project_group(a, q, ng, sc.e, sc);
  for (int64_t r = 0; r < ng; ++r) {
    acc_t* __restrict e = sc.e + r * m;
    acc_t* __restrict phi = sc.phi + r * m;
    const acc_t stab = max_of(e, m, acc_t(-INFINITY));
    const acc_t diag = sc.diag[r];
    for (int64_t f = 0; f < m; ++f) e[f] = exp_acc(e[f] - diag - stab);
    for (int64_t f = 0; f < m; ++f) phi[f] = fs * (e[f] + eps);
  }
}

// Query features of ng rows from their e kept by query_forward (keep_e):
// sc.e, phi = fs (e + eps) into sc.phi, and the rows viewed in sc.xr.
template <typename scalar_t, typename acc_t>
NT_INLINE void kept_query_features(const PerformerArgs<scalar_t>& a, const scalar_t* q, int64_t ng,
                                   const acc_t* e, GroupScratch<acc_t>& sc) {
  const acc_t fs = a.feat_scale, eps = a.eps;
  sc.xr = view_rows(q, a.H * a.D, ng, a.D, sc.x, sc.ldx);
  for (int64_t i = 0; i < ng * a.m; ++i) {
    sc.e[i] = e[i];
    sc.phi[i] = fs * (e[i] + eps);
  }
}

// o_r = phi_r^T S / (phi_r . z) for nr query rows of one head from row0
// (packed row * H + head), seg = [M | S | z].  keep_e (nr x m), if given,
// receives the rows' e for query_backward.
template <typename scalar_t, typename acc_t>
NT_INLINE void query_forward(const PerformerArgs<scalar_t>& a, int64_t row0, int64_t nr,
                             const acc_t* seg, GroupScratch<acc_t>& sc, acc_t* keep_e = nullptr) {
  const int64_t m = a.m, D = a.D, HD = a.H * a.D;
  const acc_t* s = seg + 1;
  const acc_t* z = s + m * D;
  for (int64_t g0 = 0; g0 < nr; g0 += PERFORMER_GROUP) {
    const int64_t ng = std::min<int64_t>(PERFORMER_GROUP, nr - g0);
    const int64_t off = row0 * D + g0 * HD;
    prefetch_rows(a.q + off, HD, PERFORMER_GROUP, 2 * PERFORMER_GROUP, nr - g0, D);
    query_features(a, a.q + off, ng, sc);
    if (keep_e != nullptr) std::copy(sc.e, sc.e + ng * m, keep_e + g0 * m);
    fill(sc.out, ng * D, acc_t(0));
    mm_acc(sc.phi, m, s, D, sc.out, D, ng, m, D);
    for (int64_t r = 0; r < ng; ++r) {
      const acc_t inv_den = acc_t(1) / dot_of(sc.phi + r * m, z, m);
      for (int64_t d = 0; d < D; ++d) a.out[off + r * HD + d] = static_cast<scalar_t>(sc.out[r * D + d] * inv_den);
    }
  }
}

// dx = Pc^T dw - c^2 x sum(dw) for ng rows (dw in sc.t, x viewed in sc.xr), stored at out.
template <typename scalar_t, typename acc_t>
NT_INLINE void input_grad(const PerformerArgs<scalar_t>& a, int64_t ng, GroupScratch<acc_t>& sc,
                          scalar_t* out) {
  const int64_t m = a.m, D = a.D, HD = a.H * a.D;
  fill(sc.out, ng * D, acc_t(0));
  mm_acc(sc.t, m, a.proj, D, sc.out, D, ng, m, D);
  for (int64_t r = 0; r < ng; ++r) {
    const acc_t c2 = 2 * a.half_c2 * sum_of(sc.t + r * m, m);
    const acc_t* xr = sc.xr + r * sc.ldx;
    for (int64_t d = 0; d < D; ++d) out[r * HD + d] = static_cast<scalar_t>(sc.out[r * D + d] - c2 * xr[d]);
  }
}

// D x m transpose of an m x D matrix.
template <typename acc_t>
NT_INLINE void transpose_md(const acc_t* s, int64_t m, int64_t D, acc_t* t) {
  for (int64_t f = 0; f < m; ++f) {
    for (int64_t d = 0; d < D; ++d) t[d * m + f] = s[f * D + d];
  }
}

// Backward of nr query rows of one head: writes dq and accumulates
// dS += phi_r dnum_r^T, dz += phi_r dden_r into grad = [. | dS | dz].
// With g = dO_r: Sg = S g, den = phi.z, g.o = phi.Sg / den,
// dnum = g / den, dden = -g.o / den, dphi = (Sg - z g.o) / den, dw = dphi fs e.
// kept_e (nr x m), if given, holds the rows' e from query_forward, which then
// are not recomputed.
template <typename scalar_t, typename acc_t>
NT_INLINE void query_backward(const PerformerArgs<scalar_t>& a, int64_t row0, int64_t nr,
                              const acc_t* seg, acc_t* grad, GroupScratch<acc_t>& sc,
                              const acc_t* kept_e = nullptr) {
  const int64_t m = a.m, D = a.D, HD = a.H * a.D;
  const acc_t* z = seg + 1 + m * D;
  acc_t* ds = grad + 1;
  acc_t* dz = ds + m * D;
  transpose_md(seg + 1, m, D, sc.st);
  for (int64_t g0 = 0; g0 < nr; g0 += PERFORMER_GROUP) {
    const int64_t ng = std::min<int64_t>(PERFORMER_GROUP, nr - g0);
    const int64_t off = row0 * D + g0 * HD;
    prefetch_rows(a.q + off, HD, PERFORMER_GROUP, 2 * PERFORMER_GROUP, nr - g0, D);
    prefetch_rows(a.grad_o + off, HD, PERFORMER_GROUP, 2 * PERFORMER_GROUP, nr - g0, D);
    if (kept_e != nullptr) {
      kept_query_features(a, a.q + off, ng, kept_e + g0 * m, sc);
    } else {
      query_features(a, a.q + off, ng, sc);
    }
    sc.gr = view_rows(a.grad_o + off, HD, ng, D, sc.g, sc.ldg);
    fill(sc.t, ng * m, acc_t(0));
    mm_acc(sc.gr, sc.ldg, sc.st, m, sc.t, m, ng, D, m);  // S g per row
    for (int64_t r = 0; r < ng; ++r) {
      acc_t* phi = sc.phi + r * m;
      acc_t* sg = sc.t + r * m;
      const acc_t* e = sc.e + r * m;
      const acc_t inv_den = acc_t(1) / dot_of(phi, z, m);
      const acc_t g_o = dot_of(phi, sg, m) * inv_den;
      const acc_t dw_scale = inv_den * a.feat_scale;
      for (int64_t f = 0; f < m; ++f) {
        phi[f] *= inv_den;  // phi / den: the weight of g in dS
        dz[f] -= phi[f] * g_o;
        sg[f] = (sg[f] - z[f] * g_o) * dw_scale * e[f];  // dw
      }
    }
    mm_acc<true>(sc.phi, m, sc.gr, sc.ldg, ds, D, m, ng, D);  // dS[f][:] += sum_r phi[r][f] / den_r g_r
    input_grad(a, ng, sc, a.dq + off);
  }
}

// Backward of nr key rows of one head, given e = exp(w - M) of the rows
// (nr x m) and grad = [. | dS | dz] of the segment:
// dphi = dS v + dz, dv = dS^T phi, dw = dphi fs e.
template <typename scalar_t, typename acc_t>
NT_INLINE void key_backward(const PerformerArgs<scalar_t>& a, int64_t row0, int64_t nr,
                            const acc_t* ew, const acc_t* grad, GroupScratch<acc_t>& sc) {
  const int64_t m = a.m, D = a.D, HD = a.H * a.D;
  const acc_t* ds = grad + 1;
  const acc_t* dz = ds + m * D;
  transpose_md(ds, m, D, sc.st);
  for (int64_t g0 = 0; g0 < nr; g0 += PERFORMER_GROUP) {
    const int64_t ng = std::min<int64_t>(PERFORMER_GROUP, nr - g0);
    const int64_t off = row0 * D + g0 * HD;
    const acc_t* e = ew + g0 * m;
    sc.gr = view_rows(a.v + off, HD, ng, D, sc.g, sc.ldg);
    sc.xr = view_rows(a.k + off, HD, ng, D, sc.x, sc.ldx);
    const acc_t fs = a.feat_scale, eps = a.eps;
    for (int64_t r = 0; r < ng; ++r) {
      for (int64_t f = 0; f < m; ++f) sc.t[r * m + f] = dz[f];
    }
    for (int64_t i = 0; i < ng * m; ++i) sc.phi[i] = fs * (e[i] + eps);
    mm_acc(sc.gr, sc.ldg, sc.st, m, sc.t, m, ng, D, m);  // dphi = dS v + dz
    fill(sc.out, ng * D, acc_t(0));
    mm_acc(sc.phi, m, ds, D, sc.out, D, ng, m, D);  // dv = dS^T phi
    for (int64_t r = 0; r < ng; ++r) {
      for (int64_t d = 0; d < D; ++d) a.dv[off + r * HD + d] = static_cast<scalar_t>(sc.out[r * D + d]);
    }
    for (int64_t i = 0; i < ng * m; ++i) sc.t[i] *= fs * e[i];  // dw
    input_grad(a, ng, sc, a.dk + off);
  }
}

// ---- per-item entry points (all heads); see segment_performer_kernel.cpp ----
// Item scratch: [part (stats_size) | seg (stats_size) | w (BLOCK x m) | group scratch].

template <typename acc_t, typename Args>
NT_INLINE GroupScratch<acc_t> group_scratch(const Args& a, acc_t* scratch) {
  return GroupScratch<acc_t>(scratch + 2 * a.stats_size + PERFORMER_BLOCK * a.m, a.D, a.m);
}

// Key statistics of rows [row, row + nr) into parts (H x stats_size).
template <typename scalar_t>
void performer_block_stats(const PerformerArgs<scalar_t>& a, int64_t row, int64_t nr,
                           acc_type_t<scalar_t>* parts, acc_type_t<scalar_t>* scratch) {
  auto sc = group_scratch(a, scratch);
  acc_type_t<scalar_t>* w = scratch + 2 * a.stats_size;
  for (int64_t h = 0; h < a.H; ++h) {
    const int64_t off = (row * a.H + h) * a.D;
    key_block_stats(a, a.k + off, a.v + off, nr, w, parts + h * a.stats_size, sc);
  }
}

// Combines nb blocks' statistics per head into seg (H x stats_size).
template <typename scalar_t>
void performer_combine(const PerformerArgs<scalar_t>& a, const acc_type_t<scalar_t>* parts,
                       int64_t nb, int64_t n, acc_type_t<scalar_t>* seg) {
  for (int64_t h = 0; h < a.H; ++h) {
    combine_key_stats(a, parts + h * a.stats_size, a.H * a.stats_size, nb, n,
                      seg + h * a.stats_size);
  }
}

// Sums nb blocks' [dS | dz] per head into seg (keeping seg's M), in block order.
template <typename scalar_t>
void performer_combine_grad(const PerformerArgs<scalar_t>& a, const acc_type_t<scalar_t>* parts,
                            int64_t nb, acc_type_t<scalar_t>* seg) {
  const int64_t len = a.m * a.D + a.m;
  for (int64_t h = 0; h < a.H; ++h) {
    acc_type_t<scalar_t>* out = seg + h * a.stats_size + 1;
    fill(out, len, acc_type_t<scalar_t>(0));
    for (int64_t b = 0; b < nb; ++b) {
      const acc_type_t<scalar_t>* p = parts + (b * a.H + h) * a.stats_size + 1;
      for (int64_t i = 0; i < len; ++i) out[i] += p[i];
    }
  }
}

// Forward of query rows [row, row + nr) with the segment's seg.
template <typename scalar_t>
void performer_queries_fwd(const PerformerArgs<scalar_t>& a, int64_t row, int64_t nr,
                           const acc_type_t<scalar_t>* seg, acc_type_t<scalar_t>* scratch) {
  auto sc = group_scratch(a, scratch);
  for (int64_t h = 0; h < a.H; ++h) query_forward(a, row * a.H + h, nr, seg + h * a.stats_size, sc);
}

// Backward of query rows [row, row + nr): dq, and [dS | dz] partials into grad.
template <typename scalar_t>
void performer_queries_bwd(const PerformerArgs<scalar_t>& a, int64_t row, int64_t nr,
                           const acc_type_t<scalar_t>* seg, acc_type_t<scalar_t>* grad,
                           acc_type_t<scalar_t>* scratch) {
  auto sc = group_scratch(a, scratch);
  for (int64_t h = 0; h < a.H; ++h) {
    acc_type_t<scalar_t>* gh = grad + h * a.stats_size;
    fill(gh + 1, a.m * a.D + a.m, acc_type_t<scalar_t>(0));
    query_backward(a, row * a.H + h, nr, seg + h * a.stats_size, gh, sc);
  }
}

// Backward of key rows [row, row + nr): dk, dv, with seg = [M | dS | dz].
template <typename scalar_t>
void performer_keys_bwd(const PerformerArgs<scalar_t>& a, int64_t row, int64_t nr,
                        const acc_type_t<scalar_t>* seg, acc_type_t<scalar_t>* scratch) {
  using acc_t = acc_type_t<scalar_t>;
  auto sc = group_scratch(a, scratch);
  acc_t* ew = scratch + 2 * a.stats_size;
  for (int64_t h = 0; h < a.H; ++h) {
    const acc_t* sh = seg + h * a.stats_size;
    key_features(a, a.k + (row * a.H + h) * a.D, nr, ew, sc);
    for (int64_t i = 0; i < nr * a.m; ++i) ew[i] = exp_acc(ew[i] - sh[0]);
    key_backward(a, row * a.H + h, nr, ew, sh, sc);
  }
}

// A whole segment of n <= PERFORMER_BLOCK rows in one go, forward.
template <typename scalar_t>
void performer_segment_fwd(const PerformerArgs<scalar_t>& a, int64_t row, int64_t n,
                           acc_type_t<scalar_t>* scratch) {
  using acc_t = acc_type_t<scalar_t>;
  auto sc = group_scratch(a, scratch);
  acc_t* part = scratch;
  acc_t* seg = part + a.stats_size;
  acc_t* w = seg + a.stats_size;
  for (int64_t h = 0; h < a.H; ++h) {
    const int64_t off = (row * a.H + h) * a.D;
    key_block_stats(a, a.k + off, a.v + off, n, w, part, sc);
    combine_key_stats(a, part, a.stats_size, 1, n, seg);
    query_forward(a, row * a.H + h, n, seg, sc);
  }
}

// A whole segment of n <= PERFORMER_BLOCK rows in one go, backward; the
// keys' e = exp(w - M) of the statistics step is reused by the key backward.
template <typename scalar_t>
void performer_segment_bwd(const PerformerArgs<scalar_t>& a, int64_t row, int64_t n,
                           acc_type_t<scalar_t>* scratch) {
  using acc_t = acc_type_t<scalar_t>;
  auto sc = group_scratch(a, scratch);
  acc_t* part = scratch;
  acc_t* seg = part + a.stats_size;
  acc_t* ew = seg + a.stats_size;
  for (int64_t h = 0; h < a.H; ++h) {
    const int64_t off = (row * a.H + h) * a.D;
    key_block_stats(a, a.k + off, a.v + off, n, ew, part, sc);
    combine_key_stats(a, part, a.stats_size, 1, n, seg);
    fill(part + 1, a.m * a.D + a.m, acc_t(0));
    query_backward(a, row * a.H + h, n, seg, part, sc);
    key_backward(a, row * a.H + h, n, ew, part, sc);
  }
}

// A whole segment of any length in one thread, forward, keeping per head h
// what its backward needs (the fused layer recomputes the forward and then
// runs the backward in the same thread): the keys' e = exp(w - M) at
// key_e + h n m, the queries' e at query_e + h n m (n x m each) and, at
// stats + h (nb + 1) stats_size (performer_keep_stats_size), [M | S | z]
// followed by the nb key blocks' statistics.  As in the multi-thread
// kernels, the keys are summed in blocks of PERFORMER_BLOCK rows, combined in
// block order (the accuracy of long float32 sums), and each block's e is then
// rescaled from its block max to the segment's.
template <typename scalar_t>
void performer_segment_fwd_keep(const PerformerArgs<scalar_t>& a, int64_t row, int64_t n,
                                acc_type_t<scalar_t>* key_e, acc_type_t<scalar_t>* query_e,
                                acc_type_t<scalar_t>* stats, acc_type_t<scalar_t>* scratch) {
  using acc_t = acc_type_t<scalar_t>;
  auto sc = group_scratch(a, scratch);
  const int64_t nb = performer_blocks(n), m = a.m;
  for (int64_t h = 0; h < a.H; ++h) {
    const int64_t off = (row * a.H + h) * a.D;
    acc_t* seg_h = stats + h * (nb + 1) * a.stats_size;
    acc_t* parts = seg_h + a.stats_size;
    acc_t* e_h = key_e + h * n * m;
    for (int64_t b = 0; b < nb; ++b) {  // key statistics per block
      const int64_t r0 = b * PERFORMER_BLOCK, nr = std::min(PERFORMER_BLOCK, n - r0);
      key_block_stats(a, a.k + off + r0 * a.H * a.D, a.v + off + r0 * a.H * a.D, nr, e_h + r0 * m,
                      parts + b * a.stats_size, sc);
    }
    combine_key_stats(a, parts, a.stats_size, nb, n, seg_h);
    for (int64_t b = 0; nb > 1 && b < nb; ++b) {  // e relative to the segment max
      const int64_t r0 = b * PERFORMER_BLOCK, nr = std::min(PERFORMER_BLOCK, n - r0);
      const acc_t rescale = exp_acc(parts[b * a.stats_size] - seg_h[0]);
      for (int64_t i = r0 * m; i < (r0 + nr) * m; ++i) e_h[i] *= rescale;
    }
    query_forward(a, row * a.H + h, n, seg_h, sc, query_e + h * n * m);
  }
}

// The backward of performer_segment_fwd_keep from what it kept: no feature
// map or statistic is recomputed.  The queries' [dS | dz] are summed per key
// block (into the kept blocks' place) and the blocks added in block order.
template <typename scalar_t>
void performer_segment_bwd_kept(const PerformerArgs<scalar_t>& a, int64_t row, int64_t n,
                                const acc_type_t<scalar_t>* key_e,
                                const acc_type_t<scalar_t>* query_e,
                                acc_type_t<scalar_t>* stats, acc_type_t<scalar_t>* scratch) {
  using acc_t = acc_type_t<scalar_t>;
  auto sc = group_scratch(a, scratch);
  const int64_t nb = performer_blocks(n), m = a.m, grad_size = a.m * a.D + a.m;
  for (int64_t h = 0; h < a.H; ++h) {
    const acc_t* seg_h = stats + h * (nb + 1) * a.stats_size;
    acc_t* grads = stats + h * (nb + 1) * a.stats_size + a.stats_size;  // [. | dS | dz] per block
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t r0 = b * PERFORMER_BLOCK, nr = std::min(PERFORMER_BLOCK, n - r0);
      acc_t* grad = grads + b * a.stats_size;
      fill(grad + 1, grad_size, acc_t(0));
      query_backward(a, (row + r0) * a.H + h, nr, seg_h, grad, sc, query_e + h * n * m + r0 * m);
    }
    for (int64_t b = 1; b < nb; ++b) {
      const acc_t* grad = grads + b * a.stats_size;
      for (int64_t i = 1; i <= grad_size; ++i) grads[i] += grad[i];
    }
    key_backward(a, row * a.H + h, n, key_e + h * n * m, grads, sc);
  }
}

template <typename scalar_t>
PerformerKernels<scalar_t> performer_kernels() {
  return {&performer_block_stats<scalar_t>, &performer_combine<scalar_t>,
          &performer_combine_grad<scalar_t>, &performer_queries_fwd<scalar_t>,
          &performer_queries_bwd<scalar_t>, &performer_keys_bwd<scalar_t>,
          &performer_segment_fwd<scalar_t>, &performer_segment_bwd<scalar_t>};
}
