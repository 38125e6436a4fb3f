// Entry points of the fused NT layer CPU kernel (ntconv_kernel.cpp), called
// by the op registration (ntconv_op.cpp) with the arguments set up.
#pragma once
#include "cpu/ntconv_args.h"
#include "cpu/ntconv_plan.h"

namespace nt_kernels::cpu {

// Forward of every item, then the reduction at every receiver: out
// (N_out x C) and stats (docs/design.md §9).  Needs a.lse, a.messages and,
// for weighted_mean over receivers, a.gates.
void ntconv_run_forward(const NtconvArgs<float>& a, const NtconvPlan& plan, float* out, float* stats);
void ntconv_run_forward(const NtconvArgs<double>& a, const NtconvPlan& plan, double* out,
                        double* stats);

// Backward of every item (d_centre, du, d_edge_attr as set in a), then
// d_receiver (nullptr: not wanted) rows [0, min(N, N_out)) from a.du, and the
// weight gradients d_weights (a.partial_size() elements, the partial layout)
// summed over the chunk partials in chunk order; `partials` is scratch of
// plan.num_chunks() * a.partial_size() elements.
void ntconv_run_backward(const NtconvArgs<float>& a, const NtconvPlan& plan, float* partials,
                         float* d_receiver, float* d_weights);
void ntconv_run_backward(const NtconvArgs<double>& a, const NtconvPlan& plan, double* partials,
                         double* d_receiver, double* d_weights);

}  // namespace nt_kernels::cpu
