// The host side of a CUDA call: the core's validation of shapes, dtypes and
// outputs, the alignment the kernels rely on, then one launch (two past
// kMaxFusedBlocks blocks) on the stream's device. Never synchronises,
// allocates or reads device memory; the device's limits are queried once per
// device.

#include "api.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../call.h"
#include "../check.h"
#include "host.h"
#include "kernels.h"
#include "launch.h"
#include "moe_reroute/cuda.h"

namespace moe_reroute::cuda {
namespace {

using moe_reroute::detail::fail;
using moe_reroute::detail::named_inputs;
using moe_reroute::detail::named_outputs;
using moe_reroute::detail::NamedView;
using moe_reroute::detail::row_bytes;
using detail::CallDevice;
using detail::check_aligned;
using detail::check_cuda;
using detail::check_element_aligned;

static_assert(detail::kBitNegative == kStatusNegativeCount);
static_assert(detail::kBitSum == kStatusCountSumMismatch);

// The kernels index blocks and rows in int32 (the core bounds the forward's
// R rows by the int32 index; the inverse's R input rows are bounded here).
void check_int32(std::int64_t value, const char* name, const char* what) {
  if (value > detail::kInt32Max) {
    fail(ErrorCode::kOutOfRange, std::string(name) + ": " + std::to_string(value) + " " + what +
                                     " are past what the CUDA backend indexes (2^31 - 1)");
  }
}

// The status word and the workspace as views, so that the core's output
// checks also reject them null or overlapping a tensor.
struct ContextViews {
  TensorView status;
  TensorView workspace;
};

ContextViews context_views(const DeviceContext& context, const TensorView& counts,
                           detail::Path path) {
  const std::size_t needed = detail::workspace_bytes(counts.shape()[0], counts.shape()[1], path);
  if (context.workspace_bytes < needed) {
    fail(ErrorCode::kInvalidArgument, "workspace: counts " + counts.shape().to_string() + " need " +
                                          std::to_string(needed) + " bytes, got " +
                                          std::to_string(context.workspace_bytes));
  }
  check_aligned(context.status, sizeof(std::int32_t), "status");
  check_aligned(context.workspace, sizeof(std::int64_t), "workspace");
  return {TensorView(context.status, DType::kInt32, {1}),
          TensorView(context.workspace, DType::kUInt8, {static_cast<std::int64_t>(needed)})};
}

// The core's run checks of `call`'s arguments (rule 10), with the status word
// and the workspace as outputs too, then the counts' alignment.
template <typename Inputs>
void check_arguments(const moe_reroute::detail::Call& call, const Inputs& inputs,
                     std::vector<NamedView> outputs, const DeviceContext& context,
                     detail::Path path) {
  const ContextViews views = context_views(context, inputs.expert_token_num_per_rank, path);
  outputs.insert(outputs.end(), {{"status", &views.status}, {"workspace", &views.workspace}});
  std::vector<TensorSpec> output_specs(call.output_specs().begin(), call.output_specs().end());
  output_specs.insert(output_specs.end(), {views.status.spec, views.workspace.spec});
  moe_reroute::detail::check_run_arguments(call.input_specs(), named_inputs(inputs), output_specs,
                                           outputs);
  check_element_aligned(inputs.expert_token_num_per_rank, "expert_token_num_per_rank");
}

// Each device's limits, queried the first time a call runs there.
struct DeviceSlot {
  std::once_flag once;
  cudaError_t error = cudaSuccess;
  detail::DeviceLimits limits;
};

// The limits of `device`, the current device.
const detail::DeviceLimits& device_limits(int device) {
  static int num_devices = -1;
  static std::unique_ptr<DeviceSlot[]> slots;
  static std::once_flag counted;
  static cudaError_t count_error = cudaSuccess;
  std::call_once(counted, [] {
    count_error = cudaGetDeviceCount(&num_devices);
    if (count_error == cudaSuccess)
      slots = std::make_unique<DeviceSlot[]>(static_cast<std::size_t>(num_devices));
  });
  check_cuda(count_error, "cudaGetDeviceCount");
  if (device < 0 || device >= num_devices) check_cuda(cudaErrorInvalidDevice, "device limits");
  DeviceSlot& slot = slots[static_cast<std::size_t>(device)];
  std::call_once(slot.once,
                 [&slot, device] { slot.error = detail::query_limits(device, slot.limits); });
  check_cuda(slot.error, "device limits");
  return slot.limits;
}

const std::byte* bytes(const TensorView& view) { return static_cast<const std::byte*>(view.data); }
std::byte* mutable_bytes(const TensorView& view) { return static_cast<std::byte*>(view.data); }

// Scale and weight rows are moved by one thread each: their words must fit
// in int32. (Token rows go by tiles; their words are not used.)
detail::RowMove rows(const std::byte* src, const TensorView& dst, std::int64_t row_bytes,
                     const char* name) {
  const int width = detail::word_width(src, dst.data, row_bytes);
  if (row_bytes / width > detail::kInt32Max) {
    fail(ErrorCode::kOutOfRange, std::string(name) + ": rows of " + std::to_string(row_bytes) +
                                     " bytes are past what the CUDA backend moves");
  }
  return {src, mutable_bytes(dst), row_bytes, width, static_cast<std::int32_t>(row_bytes / width)};
}

detail::RowMove rows(const std::optional<TensorView>& src, const std::optional<TensorView>& dst,
                     const char* name) {
  if (!src) return {};
  return rows(bytes(*src), *dst, row_bytes(src->spec), name);
}

// The parts of a call both directions share: counts, rows and tiles.
detail::KernelParams params_for(const moe_reroute::detail::Call& call, const TensorView& counts,
                                const void* tokens, const TensorView& out_tokens,
                                const DeviceContext& context) {
  check_int32(call.num_ranks * call.num_experts, "expert_token_num_per_rank", "blocks");
  detail::KernelParams p;
  p.layout.num_ranks = static_cast<std::int32_t>(call.num_ranks);
  p.layout.num_experts = static_cast<std::int32_t>(call.num_experts);
  p.layout.num_tokens = call.num_tokens;
  p.layout.expert_alignment = call.attributes.expert_alignment;
  p.layout.allow_spare_rows = call.attributes.allow_spare_rows;
  p.layout.forward = call.direction == Direction::kForward;
  p.counts = counts.data;
  p.status = context.status;
  p.workspace = context.workspace;
  p.tokens = {static_cast<const std::byte*>(tokens), mutable_bytes(out_tokens),
              call.token_row_bytes};
  return p;
}

void enqueue(detail::KernelParams& p, DType count_dtype, std::int64_t output_rows,
             const DeviceContext& context, detail::Path path) {
  const auto stream = static_cast<cudaStream_t>(context.stream);
  const CallDevice device(stream);
  // The most small tasks any counts can ask for (small_tasks in layout.h).
  const std::int64_t max_small = !p.index.present ? output_rows
                                 : p.index.gather ? p.index.output_rows
                                                  : p.index.output_rows + p.index.input_rows;
  const detail::LaunchPlan plan = detail::plan_launch(
      p.layout.num_ranks, p.layout.num_experts, count_dtype == DType::kInt64, output_rows,
      p.tokens.row_bytes, max_small, device_limits(device.device()), path);
  p.tiles = plan.tiles;
  p.streaming = plan.streaming;
  check_cuda(detail::launch(p, plan, stream), "kernel launch");
}

}  // namespace

bool stream_is_capturing(void* stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status),
             "cudaStreamIsCapturing");
  return status != cudaStreamCaptureStatusNone;
}

namespace detail {

void moe_re_routing(const RerouteInputs& inputs, const RerouteOutputs& outputs,
                    const Attributes& attributes, const DeviceContext& context, Path path) {
  const moe_reroute::detail::Call call = moe_reroute::detail::validate(inputs, attributes);
  check_arguments(call, inputs, named_outputs(outputs), context, path);
  check_element_aligned(outputs.permute_token_idx, "permute_token_idx");
  check_element_aligned(outputs.expert_token_num, "expert_token_num");

  KernelParams p = params_for(call, inputs.expert_token_num_per_rank, inputs.tokens.data,
                              outputs.permute_tokens, context);
  // Without scales permute_per_token_scales is [R] float32 zeros.
  p.scales =
      inputs.per_token_scales
          ? rows(inputs.per_token_scales, outputs.permute_per_token_scales, "per_token_scales")
          : rows(nullptr, outputs.permute_per_token_scales, sizeof(float), "per_token_scales");
  p.weight = rows(inputs.expert_topk_weight, outputs.permute_topk_weight, "expert_topk_weight");
  p.index = {true, call.attributes.idx_type == kIdxGather, static_cast<std::int32_t>(call.num_rows),
             static_cast<std::int32_t>(call.num_tokens)};
  p.index_data = static_cast<std::int32_t*>(outputs.permute_token_idx.data);
  p.expert_token_num = outputs.expert_token_num.data;
  p.cumsum = call.attributes.expert_token_num_type == kExpertTokenNumCumsum;
  enqueue(p, inputs.expert_token_num_per_rank.dtype(), call.num_rows, context, path);
}

void moe_re_routing_inverse(const InverseInputs& inputs, const InverseOutputs& outputs,
                            const Attributes& attributes, const DeviceContext& context, Path path) {
  const moe_reroute::detail::Call call = moe_reroute::detail::validate(inputs, attributes);
  check_arguments(call, inputs, named_outputs(inputs, outputs), context, path);
  KernelParams p = params_for(call, inputs.expert_token_num_per_rank, inputs.tokens.data,
                              outputs.restored_tokens, context);
  check_int32(call.num_rows, "tokens", "rows");
  p.scales = rows(inputs.per_token_scales, outputs.restored_per_token_scales, "per_token_scales");
  p.weight = rows(inputs.expert_topk_weight, outputs.restored_topk_weight, "expert_topk_weight");
  enqueue(p, inputs.expert_token_num_per_rank.dtype(), call.num_tokens, context, path);
}

}  // namespace detail

void moe_re_routing(const RerouteInputs& inputs, const RerouteOutputs& outputs,
                    const Attributes& attributes, const DeviceContext& context) {
  detail::moe_re_routing(inputs, outputs, attributes, context, detail::Path::kAuto);
}

void moe_re_routing_inverse(const InverseInputs& inputs, const InverseOutputs& outputs,
                            const Attributes& attributes, const DeviceContext& context) {
  detail::moe_re_routing_inverse(inputs, outputs, attributes, context, detail::Path::kAuto);
}

}  // namespace moe_reroute::cuda
