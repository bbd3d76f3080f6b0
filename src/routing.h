#pragma once

// moe_init_routing and moe_finalize_routing validated, as the backends
// consume them: sizes, the output specs, and, for init, the layout the ids
// give (the sort by expert), computed on the host.

#include <cstdint>
#include <vector>

#include "check.h"
#include "moe_reroute/routing.h"

namespace moe_reroute::detail {

struct InitRoutingCall {
  InitRoutingAttributes attributes;
  std::int64_t num_tokens = 0;  // T
  std::int64_t top_k = 0;       // k
  std::int64_t row_bytes = 0;   // of x's rows
  InitRoutingOutputSpecs specs;
};

/// Every rule that needs no values; throws Error naming the argument.
InitRoutingCall validate(const InitRoutingInputs& inputs, const InitRoutingAttributes& attributes);

/// Where each row of expanded_x comes from, from the ids' stable sort.
struct InitRoutingLayout {
  std::vector<std::int64_t> source_token;  // per row of expanded_x: x's row, or -1 (a zero slot)
  std::vector<std::int32_t> row_idx;       // expanded_row_idx
  std::vector<std::int32_t> expert_tokens;           // expert_tokens_count_or_cumsum
  std::vector<std::int32_t> tokens_before_capacity;  // expert_tokens_before_capacity
};

/// Reads the ids (refusing one out of range, naming expert_idx) and lays out
/// the call.
InitRoutingLayout init_routing_layout(const InitRoutingCall& call, const TensorView& expert_idx);

struct FinalizeRoutingCall {
  FinalizeRoutingAttributes attributes;
  std::int64_t num_tokens = 0;     // T
  std::int64_t top_k = 0;          // k
  std::int64_t hidden = 0;         // H
  std::int64_t expanded_rows = 0;  // rows of expanded_x: T * k, or E * C
  std::int64_t bias_rows = 0;      // E of bias, where given
  FinalizeRoutingOutputSpecs specs;
};

/// Every rule that needs no values; throws Error naming the argument.
FinalizeRoutingCall validate(const FinalizeRoutingInputs& inputs,
                             const FinalizeRoutingAttributes& attributes);

/// The rules on values: expanded_row_idx's rows and, with bias, expert_idx's
/// ids. Throws Error naming the argument.
void check_finalize_values(const FinalizeRoutingCall& call, const FinalizeRoutingInputs& inputs);

/// Rule 8 of section 12, 9 of 13: every input and given output has its spec
/// and data, and no output overlaps an input or another output; `extra` are
/// further outputs a backend writes (the CUDA status word and workspace).
/// Throws Error naming the argument.
void check_arguments(const InitRoutingCall& call, const InitRoutingInputs& inputs,
                     const InitRoutingOutputs& outputs, const std::vector<NamedView>& extra = {});
void check_arguments(const FinalizeRoutingCall& call, const FinalizeRoutingInputs& inputs,
                     const FinalizeRoutingOutputs& outputs,
                     const std::vector<NamedView>& extra = {});

namespace cpu {

void init_routing(const InitRoutingCall& call, const InitRoutingLayout& layout,
                  const InitRoutingInputs& inputs, const InitRoutingOutputs& outputs,
                  int num_threads);
void finalize_routing(const FinalizeRoutingCall& call, const FinalizeRoutingInputs& inputs,
                      const FinalizeRoutingOutputs& outputs, int num_threads);

}  // namespace cpu
}  // namespace moe_reroute::detail
