// The kernel bodies of the fused NT layer (ntconv_kernel.cpp), in the order
// they build on each other: the exact and Performer attention bodies, then
// the layer's rows, attention, aggregation and item steps.  Included once per
// ISA namespace by cpu/isa_builds.h; no include guard.
#include "cpu/segment_softmax_impl.h"
#include "cpu/segment_performer_impl.h"
#include "cpu/ntconv_rows_impl.h"
#include "cpu/ntconv_attention_impl.h"
#include "cpu/ntconv_aggregate_impl.h"
#include "cpu/ntconv_item_impl.h"
