// The host side of moe_init_routing and moe_finalize_routing on CUDA: the
// core's validation and output checks (src/routing.cc), the CUDA backend's
// own limits and alignment, then the launches on the stream's device. Never
// synchronises, allocates or reads device memory.

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "../check.h"
#include "../routing.h"
#include "host.h"
#include "launch.h"
#include "moe_reroute/cuda.h"
#include "routing_kernels.h"

namespace moe_reroute::cuda {
namespace detail {

InitRoutingWorkspace init_routing_workspace(std::int64_t positions, std::int64_t expert_num,
                                            std::int64_t expanded_rows) {
  constexpr std::int64_t kMinChunk = 128;
  const auto aligned = [](std::size_t bytes) { return (bytes + 15) / 16 * 16; };
  const auto ints = [](std::int64_t count) { return static_cast<std::size_t>(count) * 4; };
  InitRoutingWorkspace w;
  w.chunk = std::max(kMinChunk, ((expert_num + 3) / 4 + kWarpSize - 1) / kWarpSize * kWarpSize);
  w.num_chunks = (positions + w.chunk - 1) / w.chunk;
  w.begins = kFlagBytes;
  w.table = aligned(w.begins + ints(expert_num));
  w.source = aligned(w.table + ints(w.num_chunks * expert_num));
  w.bytes = aligned(w.source + ints(expanded_rows));
  return w;
}

}  // namespace detail

namespace {

using moe_reroute::detail::fail;
using moe_reroute::detail::NamedView;

static_assert(detail::kBitExpertId == kStatusExpertIdOutOfRange);
static_assert(detail::kBitRowIndex == kStatusRowIndexOutOfRange);
static_assert(detail::kBitBiasRow == kStatusBiasRowOutOfRange);

// The status word and the workspace, checked by the core as outputs too (not
// null, overlapping nothing), after the size and alignment CUDA needs.
struct ContextViews {
  TensorView status;
  TensorView workspace;
  std::vector<NamedView> named() const { return {{"status", &status}, {"workspace", &workspace}}; }
};

ContextViews context_views(const DeviceContext& context, std::size_t needed, const char* op) {
  if (context.workspace_bytes < needed) {
    fail(ErrorCode::kInvalidArgument, std::string("workspace: ") + op + " needs " +
                                          std::to_string(needed) + " bytes, got " +
                                          std::to_string(context.workspace_bytes));
  }
  detail::check_aligned(context.status, sizeof(std::int32_t), "status");
  detail::check_aligned(context.workspace, sizeof(std::int64_t), "workspace");
  return {TensorView(context.status, DType::kInt32, {1}),
          TensorView(context.workspace, DType::kUInt8, {static_cast<std::int64_t>(needed)})};
}

// The ids' histogram needs a bound, and the kernels index experts in int32.
void check_expert_num(const moe_reroute::detail::InitRoutingCall& call) {
  const std::int64_t experts = call.attributes.expert_num;
  if (experts < 1) {
    fail(ErrorCode::kInvalidArgument,
         "expert_num: must be >= 1 for the CUDA backend (it bounds the histogram of the ids), "
         "got " +
             std::to_string(experts));
  }
  if (experts > detail::kInt32Max) {
    fail(ErrorCode::kOutOfRange, "expert_num: " + std::to_string(experts) +
                                     " experts are past what the CUDA backend indexes (2^31 - 1)");
  }
}

// Rows of expanded_x: n, or E * C of [E, C, H].
std::int64_t expanded_rows(const moe_reroute::detail::InitRoutingCall& call) {
  const Shape& shape = call.specs.expanded_x.shape;
  return shape.ndim == 3 ? shape[0] * shape[1] : shape[0];
}

detail::InitRoutingWorkspace workspace_of(const moe_reroute::detail::InitRoutingCall& call) {
  return detail::init_routing_workspace(call.num_tokens * call.top_k, call.attributes.expert_num,
                                        expanded_rows(call));
}

detail::FloatKind float_kind(DType dtype) {
  if (dtype == DType::kFloat16) return detail::FloatKind::kFloat16;
  return dtype == DType::kBFloat16 ? detail::FloatKind::kBFloat16 : detail::FloatKind::kFloat32;
}

void check_element_aligned(const std::optional<TensorView>& view, const char* name) {
  if (view) detail::check_element_aligned(*view, name);
}

}  // namespace

std::size_t init_routing_workspace_bytes(const InitRoutingInputs& inputs,
                                         const InitRoutingAttributes& attributes) {
  const moe_reroute::detail::InitRoutingCall call =
      moe_reroute::detail::validate(inputs, attributes);
  check_expert_num(call);
  return workspace_of(call).bytes;
}

std::size_t finalize_routing_workspace_bytes(const FinalizeRoutingInputs& inputs,
                                             const FinalizeRoutingAttributes& attributes) {
  moe_reroute::detail::validate(inputs, attributes);
  return detail::kFlagBytes;
}

void moe_init_routing(const InitRoutingInputs& inputs, const InitRoutingOutputs& outputs,
                      const InitRoutingAttributes& attributes, const DeviceContext& context) {
  const moe_reroute::detail::InitRoutingCall call =
      moe_reroute::detail::validate(inputs, attributes);
  check_expert_num(call);
  const detail::InitRoutingWorkspace layout = workspace_of(call);
  const ContextViews views = context_views(context, layout.bytes, "moe_init_routing");
  moe_reroute::detail::check_arguments(call, inputs, outputs, views.named());
  detail::check_element_aligned(inputs.expert_idx, "expert_idx");
  detail::check_element_aligned(outputs.expanded_row_idx, "expanded_row_idx");
  detail::check_element_aligned(outputs.expert_tokens_count_or_cumsum,
                                "expert_tokens_count_or_cumsum");
  detail::check_element_aligned(outputs.expert_tokens_before_capacity,
                                "expert_tokens_before_capacity");

  const InitRoutingAttributes& a = call.attributes;
  detail::InitRoutingParams p;
  p.x = static_cast<const std::byte*>(inputs.x.data);
  p.expanded_x = static_cast<std::byte*>(outputs.expanded_x.data);
  p.row_bytes = call.row_bytes;
  p.width = detail::word_width(p.x, p.expanded_x, p.row_bytes);
  p.expert_idx = inputs.expert_idx.data;
  p.int64_ids = inputs.expert_idx.dtype() == DType::kInt64;
  p.positions = call.num_tokens * call.top_k;
  p.top_k = call.top_k;
  p.expert_num = static_cast<std::int32_t>(a.expert_num);
  p.expanded_rows = expanded_rows(call);
  p.capacity = a.drop_pad_mode == kDropPad ? static_cast<std::int32_t>(a.expert_capacity) : 0;
  p.expanded_row_idx = static_cast<std::int32_t*>(outputs.expanded_row_idx.data);
  if (call.specs.expert_tokens_count_or_cumsum.shape[0] > 0) {
    p.count_or_cumsum = static_cast<std::int32_t*>(outputs.expert_tokens_count_or_cumsum.data);
    p.cumsum = a.expert_tokens_count_or_cumsum_flag == kExpertTokensCumsum;
  }
  if (call.specs.expert_tokens_before_capacity.shape[0] > 0) {
    p.before_capacity = static_cast<std::int32_t*>(outputs.expert_tokens_before_capacity.data);
  }
  p.status = context.status;
  p.workspace = static_cast<std::byte*>(context.workspace);
  p.layout = layout;
  const auto stream = static_cast<cudaStream_t>(context.stream);
  const detail::CallDevice device(stream);
  detail::check_cuda(detail::launch_init_routing(p, stream), "moe_init_routing launch");
}

void moe_finalize_routing(const FinalizeRoutingInputs& inputs,
                          const FinalizeRoutingOutputs& outputs,
                          const FinalizeRoutingAttributes& attributes,
                          const DeviceContext& context) {
  const moe_reroute::detail::FinalizeRoutingCall call =
      moe_reroute::detail::validate(inputs, attributes);
  const ContextViews views = context_views(context, detail::kFlagBytes, "moe_finalize_routing");
  moe_reroute::detail::check_arguments(call, inputs, outputs, views.named());
  // Every element is loaded and stored whole.
  detail::check_element_aligned(inputs.expanded_x, "expanded_x");
  detail::check_element_aligned(inputs.expanded_row_idx, "expanded_row_idx");
  check_element_aligned(inputs.x1, "x1");
  check_element_aligned(inputs.x2, "x2");
  check_element_aligned(inputs.bias, "bias");
  check_element_aligned(inputs.scales, "scales");
  check_element_aligned(inputs.expert_idx, "expert_idx");
  detail::check_element_aligned(outputs.out, "out");

  const std::int64_t mode = call.attributes.drop_pad_mode;
  detail::FinalizeRoutingParams p;
  p.dtype = float_kind(inputs.expanded_x.dtype());
  if (inputs.scales) p.scales_dtype = float_kind(inputs.scales->dtype());
  p.expanded_x = inputs.expanded_x.data;
  p.expanded_rows = call.expanded_rows;
  p.expanded_row_idx = static_cast<const std::int32_t*>(inputs.expanded_row_idx.data);
  const auto data = [](const std::optional<TensorView>& view) {
    return view ? view->data : nullptr;
  };
  p.x1 = data(inputs.x1);
  p.x2 = data(inputs.x2);
  p.bias = data(inputs.bias);
  p.bias_rows = call.bias_rows;
  p.scales = data(inputs.scales);
  p.expert_idx = static_cast<const std::int32_t*>(data(inputs.expert_idx));
  p.out = outputs.out.data;
  p.num_tokens = call.num_tokens;
  p.top_k = call.top_k;
  p.hidden = call.hidden;
  p.row_major = mode == kFinalizeRowMajor || mode == kFinalizeRowMajorCapacity;
  p.capacity = mode == kFinalizeColumnMajorCapacity || mode == kFinalizeRowMajorCapacity;
  p.status = context.status;
  p.workspace = static_cast<std::byte*>(context.workspace);
  const auto stream = static_cast<cudaStream_t>(context.stream);
  const detail::CallDevice device(stream);
  detail::check_cuda(detail::launch_finalize_routing(p, stream), "moe_finalize_routing launch");
}

}  // namespace moe_reroute::cuda
