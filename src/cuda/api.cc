// The host side of a CUDA call: the core's validation of shapes, dtypes and
// outputs, the alignment the kernels rely on, then two launches. Never
// synchronises and never reads device memory.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "../check.h"
#include "kernels.h"
#include "launch.h"
#include "moe_reroute/cuda.h"

namespace moe_reroute::cuda {
namespace {

using moe_reroute::detail::fail;
using moe_reroute::detail::input_specs;
using moe_reroute::detail::named_inputs;
using moe_reroute::detail::named_outputs;
using moe_reroute::detail::NamedView;
using moe_reroute::detail::row_bytes;

void check_aligned(const void* data, std::int64_t alignment, const std::string& name) {
  if (reinterpret_cast<std::uintptr_t>(data) % static_cast<std::uintptr_t>(alignment) != 0) {
    fail(ErrorCode::kInvalidArgument, name + ": data must be " + std::to_string(alignment) +
                                          "-byte aligned for the CUDA backend");
  }
}

// Counts, indices and expert_token_num are read and written as whole ints.
void check_element_aligned(const TensorView& view, const char* name) {
  check_aligned(view.data, dtype_info(view.dtype()).bits / 8, name);
}

// The status word and the workspace as views, so that the core's output
// checks also reject them null or overlapping a tensor.
struct ContextViews {
  TensorView status;
  TensorView workspace;
};

ContextViews context_views(const DeviceContext& context, const TensorView& counts) {
  const std::int64_t num_ranks = counts.shape()[0];
  const std::int64_t num_experts = counts.shape()[1];
  const std::size_t needed = required_workspace_bytes(num_ranks, num_experts);
  if (context.workspace_bytes < needed) {
    fail(ErrorCode::kInvalidArgument,
         "workspace: counts " + counts.shape().to_string() + " need " + std::to_string(needed) +
             " bytes, got " + std::to_string(context.workspace_bytes));
  }
  check_aligned(context.status, sizeof(std::int32_t), "status");
  check_aligned(context.workspace, sizeof(std::int64_t), "workspace");
  return {TensorView(context.status, DType::kInt32, {1}),
          TensorView(context.workspace, DType::kUInt8, {static_cast<std::int64_t>(needed)})};
}

// The outputs followed by the status word and the workspace.
std::vector<NamedView> with_context(std::vector<NamedView> outputs, const ContextViews& views) {
  outputs.insert(outputs.end(), {{"status", &views.status}, {"workspace", &views.workspace}});
  return outputs;
}

void check_cuda(cudaError_t error, const char* what) {
  if (error != cudaSuccess) {
    fail(ErrorCode::kBackend, std::string("cuda: ") + what + ": " + cudaGetErrorString(error));
  }
}

const std::byte* bytes(const TensorView& view) { return static_cast<const std::byte*>(view.data); }
std::byte* mutable_bytes(const TensorView& view) { return static_cast<std::byte*>(view.data); }

detail::RowMove rows(const std::optional<TensorView>& src, const std::optional<TensorView>& dst) {
  if (!src) return {};
  return {bytes(*src), mutable_bytes(*dst), row_bytes(src->spec)};
}

// Points the launches at the workspace and the status word and enqueues them.
void enqueue(const DeviceContext& context, Direction direction, detail::OffsetsParams offsets,
             detail::MoveParams move) {
  auto* rank_begin = static_cast<std::int64_t*>(context.workspace);
  offsets.rank_begin = rank_begin;
  offsets.expert_begin = rank_begin + offsets.num_ranks * offsets.num_experts;
  offsets.status = context.status;
  move.tables = detail::block_tables(direction, offsets.rank_begin, offsets.expert_begin,
                                     offsets.num_ranks, offsets.num_experts);
  move.status = context.status;
  int device = 0;
  int num_sms = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device),
             "cudaDeviceGetAttribute");
  const detail::MoveLaunch launch =
      detail::move_launch(offsets.num_tokens, move.tokens.row_bytes, num_sms);
  move.segments_per_row = launch.segments_per_row;
  move.num_tasks = launch.num_tasks;
  const auto stream = static_cast<cudaStream_t>(context.stream);
  check_cuda(detail::launch_offsets(offsets, stream), "offsets kernel launch");
  check_cuda(detail::launch_move(move, launch, stream), "move kernel launch");
}

detail::OffsetsParams offsets_params(const TensorView& tokens, const TensorView& counts) {
  detail::OffsetsParams offsets;
  offsets.counts = counts.data;
  offsets.count_dtype = counts.dtype();
  offsets.num_ranks = counts.shape()[0];
  offsets.num_experts = counts.shape()[1];
  offsets.num_tokens = tokens.shape()[0];
  return offsets;
}

}  // namespace

void moe_re_routing(const RerouteInputs& inputs, const RerouteOutputs& outputs,
                    const Attributes& attributes, const DeviceContext& context) {
  const RerouteOutputSpecs specs = infer_reroute(inputs, attributes);
  const ContextViews views = context_views(context, inputs.expert_token_num_per_rank);
  moe_reroute::detail::check_run_arguments(
      input_specs(inputs), named_inputs(inputs),
      {specs.permute_tokens, specs.permute_per_token_scales, specs.permute_token_idx,
       specs.expert_token_num, specs.permute_topk_weight, views.status.spec,
       views.workspace.spec},
      with_context(named_outputs(outputs), views));
  check_element_aligned(inputs.expert_token_num_per_rank, "expert_token_num_per_rank");
  check_element_aligned(outputs.permute_token_idx, "permute_token_idx");
  check_element_aligned(outputs.expert_token_num, "expert_token_num");

  detail::OffsetsParams offsets = offsets_params(inputs.tokens, inputs.expert_token_num_per_rank);
  offsets.expert_token_num = outputs.expert_token_num.data;
  offsets.cumsum = attributes.expert_token_num_type == kExpertTokenNumCumsum;
  detail::MoveParams move;
  move.tokens = rows(inputs.tokens, outputs.permute_tokens);
  // Without scales permute_per_token_scales is [A] float32 zeros.
  move.scales = inputs.per_token_scales
                    ? rows(inputs.per_token_scales, outputs.permute_per_token_scales)
                    : detail::RowMove{nullptr, mutable_bytes(outputs.permute_per_token_scales),
                                      sizeof(float)};
  move.weight = rows(inputs.expert_topk_weight, outputs.permute_topk_weight);
  move.index = static_cast<std::int32_t*>(outputs.permute_token_idx.data);
  move.gather = attributes.idx_type == kIdxGather;
  enqueue(context, Direction::kForward, offsets, move);
}

void moe_re_routing_inverse(const InverseInputs& inputs, const InverseOutputs& outputs,
                            const Attributes& attributes, const DeviceContext& context) {
  const InverseOutputSpecs specs = infer_inverse(inputs, attributes);
  std::vector<NamedView> outputs_named = named_outputs(inputs, outputs);
  const ContextViews views = context_views(context, inputs.expert_token_num_per_rank);
  std::vector<TensorSpec> output_specs = {specs.restored_tokens};
  if (specs.restored_per_token_scales) output_specs.push_back(*specs.restored_per_token_scales);
  if (specs.restored_topk_weight) output_specs.push_back(*specs.restored_topk_weight);
  output_specs.insert(output_specs.end(), {views.status.spec, views.workspace.spec});
  moe_reroute::detail::check_run_arguments(input_specs(inputs), named_inputs(inputs),
                                           output_specs, with_context(outputs_named, views));
  check_element_aligned(inputs.expert_token_num_per_rank, "expert_token_num_per_rank");

  detail::MoveParams move;
  move.tokens = rows(inputs.tokens, outputs.restored_tokens);
  move.scales = rows(inputs.per_token_scales, outputs.restored_per_token_scales);
  move.weight = rows(inputs.expert_topk_weight, outputs.restored_topk_weight);
  enqueue(context, Direction::kInverse,
          offsets_params(inputs.tokens, inputs.expert_token_num_per_rank), move);
}

}  // namespace moe_reroute::cuda
