// CPU execution: each thread memcpys its planned chunks of token, scale and
// weight rows and writes the matching index entries. No dtype dispatch: rows
// are bytes.

#include <omp.h>

#include <cstdint>
#include <cstring>
#include <optional>

#include "../check.h"
#include "copy.h"
#include "moe_reroute/reroute.h"

namespace moe_reroute {
namespace {

// Rows of `row_bytes` bytes moved from `src` (null: zeros) to `dst`; a
// stream of 0-byte rows moves nothing.
struct RowStream {
  const void* src = nullptr;
  void* dst = nullptr;
  std::int64_t row_bytes = 0;
  bool streaming = false;  // write around the cache (see copy_bytes)

  void move(const Chunk& chunk) const {
    if (row_bytes == 0) return;
    std::byte* to = static_cast<std::byte*>(dst) + chunk.dst_row * row_bytes;
    const std::size_t bytes = static_cast<std::size_t>(chunk.num_rows * row_bytes);
    if (src == nullptr) {
      std::memset(to, 0, bytes);
    } else {
      detail::copy_bytes(to, static_cast<const std::byte*>(src) + chunk.src_row * row_bytes, bytes,
                         streaming);
    }
  }
};

// Streams once the rows read plus written outgrow the last-level cache: then
// the output would not be in the cache for its reader anyway.
bool streaming(const Plan& plan) {
  return 2 * plan.num_tokens * plan.bytes_per_row() > detail::last_level_cache_bytes();
}

void* data_of(const std::optional<TensorView>& view) { return view ? view->data : nullptr; }

// Runs `body(chunk)` over every chunk of the plan, one planned slice per thread.
template <typename Body>
void for_each_chunk(const Plan& plan, const Body& body) {
  const int num_threads = plan.num_threads();
#pragma omp parallel for num_threads(num_threads) schedule(static, 1) if (num_threads > 1)
  for (int t = 0; t < num_threads; ++t) {
    for (std::int64_t c = plan.thread_begin[t]; c < plan.thread_begin[t + 1]; ++c) {
      body(plan.chunks[static_cast<std::size_t>(c)]);
    }
    detail::stream_fence();
  }
}

void check_direction(const Plan& plan, Direction direction) {
  if (plan.direction != direction) {
    detail::fail(ErrorCode::kInvalidArgument,
                 direction == Direction::kForward
                     ? "plan: made by plan_inverse, run with run_reroute"
                     : "plan: made by plan_reroute, run with run_inverse");
  }
}

}  // namespace

void run_reroute(const Plan& plan, const RerouteInputs& inputs, const RerouteOutputs& outputs) {
  check_direction(plan, Direction::kForward);
  detail::check_run_arguments(plan.input_specs, detail::named_inputs(inputs), plan.output_specs,
                              detail::named_outputs(outputs));

  const bool stream = streaming(plan);
  const RowStream tokens{inputs.tokens.data, outputs.permute_tokens.data, plan.token_row_bytes,
                         stream};
  // Without scales the output is [A] float32 zeros.
  const RowStream scales{data_of(inputs.per_token_scales), outputs.permute_per_token_scales.data,
                         inputs.per_token_scales ? plan.scale_row_bytes
                                                 : std::int64_t{sizeof(float)},
                         stream};
  const RowStream weight{data_of(inputs.expert_topk_weight), outputs.permute_topk_weight.data,
                         plan.weight_row_bytes, stream};
  auto* index = static_cast<std::int32_t*>(outputs.permute_token_idx.data);
  const bool gather = plan.attributes.idx_type == kIdxGather;

  for_each_chunk(plan, [&](const Chunk& chunk) {
    tokens.move(chunk);
    scales.move(chunk);
    weight.move(chunk);
    const std::int64_t from = gather ? chunk.src_row : chunk.dst_row;
    std::int32_t* to = index + (gather ? chunk.dst_row : chunk.src_row);
    for (std::int64_t k = 0; k < chunk.num_rows; ++k) to[k] = static_cast<std::int32_t>(from + k);
  });

  void* expert_token_num = outputs.expert_token_num.data;
  for (std::size_t e = 0; e < plan.expert_token_num.size(); ++e) {
    if (outputs.expert_token_num.dtype() == DType::kInt32) {
      static_cast<std::int32_t*>(expert_token_num)[e] =
          static_cast<std::int32_t>(plan.expert_token_num[e]);
    } else {
      static_cast<std::int64_t*>(expert_token_num)[e] = plan.expert_token_num[e];
    }
  }
}

void run_inverse(const Plan& plan, const InverseInputs& inputs, const InverseOutputs& outputs) {
  check_direction(plan, Direction::kInverse);
  detail::check_run_arguments(plan.input_specs, detail::named_inputs(inputs), plan.output_specs,
                              detail::named_outputs(inputs, outputs));

  const bool stream = streaming(plan);
  const RowStream tokens{inputs.tokens.data, outputs.restored_tokens.data, plan.token_row_bytes,
                         stream};
  const RowStream scales{data_of(inputs.per_token_scales),
                         data_of(outputs.restored_per_token_scales), plan.scale_row_bytes,
                         stream};
  const RowStream weight{data_of(inputs.expert_topk_weight),
                         data_of(outputs.restored_topk_weight), plan.weight_row_bytes, stream};
  for_each_chunk(plan, [&](const Chunk& chunk) {
    tokens.move(chunk);
    scales.move(chunk);
    weight.move(chunk);
  });
}

void moe_re_routing(const RerouteInputs& inputs, const RerouteOutputs& outputs,
                    const Attributes& attributes, int num_threads) {
  run_reroute(plan_reroute(inputs, attributes, num_threads), inputs, outputs);
}

void moe_re_routing_inverse(const InverseInputs& inputs, const InverseOutputs& outputs,
                            const Attributes& attributes, int num_threads) {
  run_inverse(plan_inverse(inputs, attributes, num_threads), inputs, outputs);
}

}  // namespace moe_reroute
