// Validation, shape inference, offsets and the work split: everything that
// reads shapes, attributes and the counts but no token data.

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>

#include "check.h"
#include "moe_reroute/reroute.h"

namespace moe_reroute {
namespace {

using detail::fail;

constexpr std::int64_t kIndexLimit = std::numeric_limits<std::int32_t>::max();
// Below this many bytes per thread, starting another thread costs more than it saves.
constexpr std::int64_t kMinBytesPerThread = 256 * 1024;

std::string spec_string(const TensorView& view) { return view.spec.to_string(); }

// Rule 1, 2 and 6: [A, H] with a row length that fits in bytes.
void check_tokens(const TensorView& tokens, bool token_dtypes_only, bool index_limit) {
  const DTypeInfo& info = dtype_info(tokens.dtype());
  if (token_dtypes_only && !(info.roles & kRoleToken)) {
    fail(ErrorCode::kUnsupported, "tokens: dtype " + std::string(info.name) +
                                      " is not a token dtype (float16, bfloat16, int8, "
                                      "float8_e5m2, float8_e4m3fn, hifloat8, float4_e2m1, "
                                      "float4_e1m2, float32, uint8)");
  }
  const Shape& shape = tokens.shape();
  if (shape.ndim != 2) {
    fail(ErrorCode::kInvalidArgument, "tokens: must be 2-D [A, H], got " + spec_string(tokens));
  }
  if (shape[0] < 0) {
    fail(ErrorCode::kInvalidArgument, "tokens: A must be >= 0, got " + std::to_string(shape[0]));
  }
  if (shape[1] < 1) {
    fail(ErrorCode::kInvalidArgument, "tokens: H must be >= 1, got " + std::to_string(shape[1]));
  }
  if (info.bits < 8 && shape[1] % 2 != 0) {
    fail(ErrorCode::kInvalidArgument, "tokens: " + std::string(info.name) +
                                          " packs two elements per byte, so H must be even, got " +
                                          std::to_string(shape[1]));
  }
  if (index_limit && shape[0] > kIndexLimit) {
    fail(ErrorCode::kOutOfRange, "tokens: A = " + std::to_string(shape[0]) +
                                     " exceeds the int32 index limit 2147483647");
  }
  detail::checked_nbytes(tokens.spec, "tokens");
}

// Rule 3.
void check_counts_spec(const TensorView& counts) {
  const char* name = "expert_token_num_per_rank";
  if (!(dtype_info(counts.dtype()).roles & kRoleCount)) {
    fail(ErrorCode::kUnsupported, std::string(name) + ": dtype " +
                                      std::string(dtype_name(counts.dtype())) +
                                      " must be int32 or int64");
  }
  const Shape& shape = counts.shape();
  if (shape.ndim != 2) {
    fail(ErrorCode::kInvalidArgument,
         std::string(name) + ": must be 2-D [N, E], got " + spec_string(counts));
  }
  if (shape[0] < 1 || shape[1] < 1) {
    fail(ErrorCode::kInvalidArgument, std::string(name) + ": N and E must be >= 1, got " +
                                          shape.to_string());
  }
  detail::checked_nbytes(counts.spec, name);
}

// Rule 7.
void check_scales(const TensorView& scales, std::int64_t num_tokens) {
  const char* name = "per_token_scales";
  const Shape& shape = scales.shape();
  switch (scales.dtype()) {
    case DType::kFloat32:
      if (shape.ndim != 1 && shape.ndim != 2) {
        fail(ErrorCode::kInvalidArgument, std::string(name) +
                                              ": float32 scales must be [A] or [A, S], got " +
                                              spec_string(scales));
      }
      break;
    case DType::kFloat8E8M0:
      if (shape.ndim != 2 && !(shape.ndim == 3 && shape[2] == 2)) {
        fail(ErrorCode::kInvalidArgument, std::string(name) +
                                              ": float8_e8m0 scales must be [A, K, 2] or [A, S], "
                                              "got " + spec_string(scales));
      }
      break;
    default:
      fail(ErrorCode::kUnsupported,
           std::string(name) + ": dtype " + std::string(dtype_name(scales.dtype())) +
               " must be float32 or float8_e8m0 (name uint8 storage as float8_e8m0)");
  }
  for (int d = 1; d < shape.ndim; ++d) {
    if (shape[d] < 1) {
      fail(ErrorCode::kInvalidArgument, std::string(name) + ": dim " + std::to_string(d) +
                                            " must be >= 1, got " + shape.to_string());
    }
  }
  if (shape[0] != num_tokens) {
    fail(ErrorCode::kInvalidArgument, std::string(name) + ": dim 0 is " +
                                          std::to_string(shape[0]) + " but tokens has " +
                                          std::to_string(num_tokens) + " rows");
  }
  detail::checked_nbytes(scales.spec, name);
}

// Rule 8.
void check_weight(const TensorView& weight, std::int64_t num_tokens) {
  const char* name = "expert_topk_weight";
  const Shape& shape = weight.shape();
  if (weight.dtype() != DType::kFloat32) {
    fail(ErrorCode::kUnsupported, std::string(name) + ": dtype " +
                                      std::string(dtype_name(weight.dtype())) +
                                      " must be float32");
  }
  if (shape.ndim != 1 && shape.ndim != 2) {
    fail(ErrorCode::kInvalidArgument,
         std::string(name) + ": must be [A, 1] or [A], got " + spec_string(weight));
  }
  if (shape.ndim == 2 && shape[1] != 1) {
    fail(ErrorCode::kInvalidArgument, std::string(name) + ": dim 1 must be 1, got " +
                                          std::to_string(shape[1]) + " in " + shape.to_string());
  }
  if (shape[0] != num_tokens) {
    fail(ErrorCode::kInvalidArgument, std::string(name) + ": dim 0 is " +
                                          std::to_string(shape[0]) + " but tokens has " +
                                          std::to_string(num_tokens) + " rows");
  }
}

// Rule 9.
void check_attributes(const Attributes& attributes) {
  if (attributes.expert_token_num_type != kExpertTokenNumCumsum &&
      attributes.expert_token_num_type != kExpertTokenNumCount) {
    fail(ErrorCode::kInvalidArgument,
         "expert_token_num_type: must be 0 (cumsum) or 1 (count), got " +
             std::to_string(attributes.expert_token_num_type));
  }
  if (attributes.idx_type != kIdxGather && attributes.idx_type != kIdxScatter) {
    fail(ErrorCode::kInvalidArgument, "idx_type: must be 0 (gather) or 1 (scatter), got " +
                                          std::to_string(attributes.idx_type));
  }
}

// Rules 4 and 5: reads the counts as int64.
std::vector<std::int64_t> read_counts(const TensorView& counts, std::int64_t num_tokens) {
  const char* name = "expert_token_num_per_rank";
  const std::int64_t num_experts = counts.shape()[1];
  const std::int64_t size = counts.shape().numel();
  if (counts.data == nullptr) fail(ErrorCode::kInvalidArgument, std::string(name) + ": data is null");
  std::vector<std::int64_t> values(static_cast<std::size_t>(size));
  for (std::int64_t i = 0; i < size; ++i) {
    values[i] = counts.dtype() == DType::kInt32 ? static_cast<const std::int32_t*>(counts.data)[i]
                                                : static_cast<const std::int64_t*>(counts.data)[i];
  }
  std::int64_t sum = 0;
  for (std::int64_t i = 0; i < size; ++i) {
    if (values[i] < 0) {
      fail(ErrorCode::kInvalidArgument, std::string(name) + ": count[" +
                                            std::to_string(i / num_experts) + "][" +
                                            std::to_string(i % num_experts) + "] = " +
                                            std::to_string(values[i]) + " is negative");
    }
    if (__builtin_add_overflow(sum, values[i], &sum)) {
      fail(ErrorCode::kOutOfRange, std::string(name) + ": counts overflow int64 when summed");
    }
  }
  if (sum != num_tokens) {
    fail(ErrorCode::kInvalidArgument, std::string(name) + ": counts sum to " +
                                          std::to_string(sum) + " but tokens has " +
                                          std::to_string(num_tokens) + " rows");
  }
  return values;
}

// Fills the offsets, expert_token_num and the chunks: the blocks in destination
// order, cut into one contiguous row range per thread. Every row costs the same
// bytes, so equal row ranges are equal byte shares however skewed the counts.
void finish_plan(Plan& plan, const std::vector<std::int64_t>& counts, int num_threads) {
  const std::int64_t num_ranks = plan.num_ranks;
  const std::int64_t num_experts = plan.num_experts;
  const auto block = [num_experts](std::int64_t rank, std::int64_t expert) {
    return static_cast<std::size_t>(rank * num_experts + expert);
  };
  plan.src_offset.assign(counts.size(), 0);
  plan.dst_offset.assign(counts.size(), 0);
  plan.expert_token_num.assign(static_cast<std::size_t>(num_experts), 0);
  std::int64_t row = 0;
  for (std::int64_t r = 0; r < num_ranks; ++r) {
    for (std::int64_t e = 0; e < num_experts; ++e) {
      plan.src_offset[block(r, e)] = row;
      row += counts[block(r, e)];
    }
  }
  row = 0;
  for (std::int64_t e = 0; e < num_experts; ++e) {
    for (std::int64_t r = 0; r < num_ranks; ++r) {
      plan.dst_offset[block(r, e)] = row;
      row += counts[block(r, e)];
    }
    const bool cumsum = plan.attributes.expert_token_num_type == kExpertTokenNumCumsum;
    plan.expert_token_num[static_cast<std::size_t>(e)] =
        cumsum ? row : row - plan.dst_offset[block(0, e)];
  }

  const std::int64_t num_tokens = plan.num_tokens;
  const std::int64_t total_bytes = num_tokens * plan.bytes_per_row();
  const std::int64_t requested = num_threads > 0 ? num_threads : hardware_threads();
  const std::int64_t useful = std::max<std::int64_t>(1, total_bytes / kMinBytesPerThread);
  const std::int64_t threads = std::max<std::int64_t>(
      1, std::min({requested, useful, std::max<std::int64_t>(num_tokens, 1)}));
  const auto end_row = [num_tokens, threads](std::int64_t t) {
    return num_tokens / threads * (t + 1) + std::min<std::int64_t>(t + 1, num_tokens % threads);
  };

  // One pass over the blocks in the order their destination rows are written,
  // cutting a block wherever a thread's row range ends.
  plan.chunks.clear();
  plan.chunks.reserve(counts.size() + static_cast<std::size_t>(threads));
  plan.thread_begin.reserve(static_cast<std::size_t>(threads) + 1);
  plan.thread_begin.assign(1, 0);
  const bool forward = plan.direction == Direction::kForward;
  const std::int64_t outer = forward ? num_experts : num_ranks;
  const std::int64_t inner = forward ? num_ranks : num_experts;
  std::int64_t thread_end = end_row(0);
  for (std::int64_t o = 0; o < outer; ++o) {
    for (std::int64_t i = 0; i < inner; ++i) {
      const std::size_t b = forward ? block(i, o) : block(o, i);
      const std::int64_t expert_row = plan.dst_offset[b];
      const std::int64_t rank_row = plan.src_offset[b];
      const std::int64_t src_row = forward ? rank_row : expert_row;
      const std::int64_t dst_row = forward ? expert_row : rank_row;
      for (std::int64_t taken = 0; taken < counts[b];) {
        const std::int64_t rows = std::min(counts[b] - taken, thread_end - (dst_row + taken));
        plan.chunks.push_back({src_row + taken, dst_row + taken, rows});
        taken += rows;
        if (dst_row + taken == thread_end) {
          plan.thread_begin.push_back(static_cast<std::int64_t>(plan.chunks.size()));
          thread_end = end_row(static_cast<std::int64_t>(plan.thread_begin.size()) - 1);
        }
      }
    }
  }
  // A = 0: the one thread has no chunks.
  plan.thread_begin.resize(static_cast<std::size_t>(threads) + 1,
                           static_cast<std::int64_t>(plan.chunks.size()));
}

// The part of planning shared by both directions, once inference has passed.
template <typename Inputs>
Plan make_plan(Direction direction, const Inputs& inputs, const Attributes& attributes,
               std::vector<TensorSpec> output_specs, int num_threads) {
  Plan plan;
  plan.direction = direction;
  plan.attributes = attributes;
  plan.num_tokens = inputs.tokens.shape()[0];
  plan.num_ranks = inputs.expert_token_num_per_rank.shape()[0];
  plan.num_experts = inputs.expert_token_num_per_rank.shape()[1];
  const std::vector<std::int64_t> counts =
      read_counts(inputs.expert_token_num_per_rank, plan.num_tokens);
  plan.token_row_bytes = dtype_bytes(inputs.tokens.dtype(), inputs.tokens.shape()[1]);
  if (inputs.per_token_scales) plan.scale_row_bytes = detail::row_bytes(inputs.per_token_scales->spec);
  if (inputs.expert_topk_weight) plan.weight_row_bytes = sizeof(float);
  plan.input_specs = detail::input_specs(inputs);
  plan.output_specs = std::move(output_specs);
  finish_plan(plan, counts, num_threads);
  return plan;
}

}  // namespace

namespace detail {

std::int64_t checked_nbytes(const TensorSpec& spec, const char* name) {
  // The product of the non-zero dims: a zero dim (A = 0) must not hide a row
  // whose bytes overflow, since row bytes are computed on their own.
  std::int64_t elements = 1;
  for (int d = 0; d < spec.shape.ndim; ++d) {
    if (spec.shape[d] < 0) {
      fail(ErrorCode::kInvalidArgument,
           std::string(name) + ": negative dim in " + spec.shape.to_string());
    }
    if (spec.shape[d] == 0) continue;
    if (__builtin_mul_overflow(elements, spec.shape[d], &elements) ||
        elements > std::numeric_limits<std::int64_t>::max() / 64) {
      fail(ErrorCode::kOutOfRange,
           std::string(name) + ": " + spec.shape.to_string() + " overflows int64 bytes");
    }
  }
  return spec.nbytes();
}

}  // namespace detail

int hardware_threads() { return std::max(1, omp_get_max_threads()); }

std::int64_t Plan::bytes_per_row() const {
  const std::int64_t index_bytes = direction == Direction::kForward ? 4 : 0;
  // Without scales the forward still writes a zero float32 per row.
  const std::int64_t scale_bytes =
      direction == Direction::kForward && scale_row_bytes == 0 ? 4 : scale_row_bytes;
  return token_row_bytes + scale_bytes + weight_row_bytes + index_bytes;
}

std::string Plan::to_string() const {
  std::string s = direction == Direction::kForward ? "reroute" : "inverse";
  s += " plan: A=" + std::to_string(num_tokens) + " N=" + std::to_string(num_ranks) +
       " E=" + std::to_string(num_experts) + " row_bytes tokens=" +
       std::to_string(token_row_bytes) + " scales=" + std::to_string(scale_row_bytes) +
       " weight=" + std::to_string(weight_row_bytes) + " threads=" +
       std::to_string(num_threads()) + "\n";
  for (int t = 0; t < num_threads(); ++t) {
    std::int64_t rows = 0;
    for (std::int64_t c = thread_begin[t]; c < thread_begin[t + 1]; ++c) rows += chunks[c].num_rows;
    s += "  thread " + std::to_string(t) + ": " +
         std::to_string(thread_begin[t + 1] - thread_begin[t]) + " chunks, " +
         std::to_string(rows) + " rows, " + std::to_string(rows * bytes_per_row()) + " bytes\n";
  }
  return s;
}

RerouteOutputSpecs infer_reroute(const RerouteInputs& inputs, const Attributes& attributes) {
  check_tokens(inputs.tokens, /*token_dtypes_only=*/true, /*index_limit=*/true);
  check_counts_spec(inputs.expert_token_num_per_rank);
  const std::int64_t num_tokens = inputs.tokens.shape()[0];
  if (inputs.per_token_scales) check_scales(*inputs.per_token_scales, num_tokens);
  if (inputs.expert_topk_weight) check_weight(*inputs.expert_topk_weight, num_tokens);
  check_attributes(attributes);

  RerouteOutputSpecs specs;
  specs.permute_tokens = inputs.tokens.spec;
  specs.permute_per_token_scales = inputs.per_token_scales
                                       ? inputs.per_token_scales->spec
                                       : TensorSpec{DType::kFloat32, {num_tokens}};
  specs.permute_token_idx = {DType::kInt32, {num_tokens}};
  specs.expert_token_num = {inputs.expert_token_num_per_rank.dtype(),
                            {inputs.expert_token_num_per_rank.shape()[1]}};
  specs.permute_topk_weight = inputs.expert_topk_weight ? inputs.expert_topk_weight->spec
                                                        : TensorSpec{DType::kFloat32, {0}};
  return specs;
}

InverseOutputSpecs infer_inverse(const InverseInputs& inputs, const Attributes& attributes) {
  check_tokens(inputs.tokens, /*token_dtypes_only=*/false, /*index_limit=*/false);
  check_counts_spec(inputs.expert_token_num_per_rank);
  const std::int64_t num_tokens = inputs.tokens.shape()[0];
  if (inputs.per_token_scales) check_scales(*inputs.per_token_scales, num_tokens);
  if (inputs.expert_topk_weight) check_weight(*inputs.expert_topk_weight, num_tokens);

  InverseOutputSpecs specs;
  specs.restored_tokens = inputs.tokens.spec;
  if (inputs.per_token_scales) specs.restored_per_token_scales = inputs.per_token_scales->spec;
  if (inputs.expert_topk_weight) specs.restored_topk_weight = inputs.expert_topk_weight->spec;
  return specs;
}

Plan plan_reroute(const RerouteInputs& inputs, const Attributes& attributes, int num_threads) {
  const RerouteOutputSpecs specs = infer_reroute(inputs, attributes);
  return make_plan(Direction::kForward, inputs, attributes,
                   {specs.permute_tokens, specs.permute_per_token_scales, specs.permute_token_idx,
                    specs.expert_token_num, specs.permute_topk_weight},
                   num_threads);
}

Plan plan_inverse(const InverseInputs& inputs, const Attributes& attributes, int num_threads) {
  const InverseOutputSpecs specs = infer_inverse(inputs, attributes);
  std::vector<TensorSpec> output_specs = {specs.restored_tokens};
  if (specs.restored_per_token_scales) output_specs.push_back(*specs.restored_per_token_scales);
  if (specs.restored_topk_weight) output_specs.push_back(*specs.restored_topk_weight);
  return make_plan(Direction::kInverse, inputs, attributes, std::move(output_specs), num_threads);
}

}  // namespace moe_reroute
