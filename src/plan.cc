// Validation, shape inference, offsets and the work split: everything that
// reads shapes, attributes and the counts but no token data.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "call.h"
#include "check.h"
#include "moe_reroute/reroute.h"
#include "plan_builder.h"

namespace moe_reroute {
namespace {

using detail::fail;

constexpr std::int64_t kIndexLimit = std::numeric_limits<std::int32_t>::max();

std::string spec_string(const TensorView& view) { return view.spec.to_string(); }

// Rule 1, 2 and 6: [A, H] with a row length that fits in bytes.
void check_tokens(const TensorView& tokens, bool token_dtypes_only, bool index_limit) {
  detail::check_dtype_value(tokens, "tokens");
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
  detail::check_dtype_value(counts, name);
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

// The scale forms of rule 7: [A], [A, S] and, for FP8 tokens, [A, K, 2].
enum ScaleForms : unsigned { kScaleRows = 1, kScaleMatrix = 2, kScaleBlocks = 4 };

std::string forms_string(unsigned forms) {
  std::string s;
  for (const auto& [form, text] : {std::pair{kScaleRows, "[A]"}, std::pair{kScaleMatrix, "[A, S]"},
                                   std::pair{kScaleBlocks, "[A, K, 2]"}}) {
    if (forms & form) s += (s.empty() ? "" : ", ") + std::string(text);
  }
  return s;
}

bool is_fp8(DType dtype) { return dtype == DType::kFloat8E5M2 || dtype == DType::kFloat8E4M3FN; }
bool is_fp4(DType dtype) { return dtype == DType::kFloat4E2M1 || dtype == DType::kFloat4E1M2; }

// Rule 7: the forms that scales of `scales_dtype` may take beside tokens of
// `tokens_dtype` (the pairing table; nullopt: the inverse, whose rows may be
// of any dtype, takes every form); throws for a dtype that cannot pair.
unsigned scale_forms(DType scales_dtype, std::optional<DType> tokens_dtype) {
  const char* name = "per_token_scales";
  if (scales_dtype != DType::kFloat32 && scales_dtype != DType::kFloat8E8M0) {
    fail(ErrorCode::kUnsupported,
         std::string(name) + ": dtype " + std::string(dtype_name(scales_dtype)) +
             " must be float32 or float8_e8m0 (name uint8 storage as float8_e8m0)");
  }
  if (!tokens_dtype || is_fp8(*tokens_dtype)) return kScaleRows | kScaleMatrix | kScaleBlocks;
  if (scales_dtype == DType::kFloat8E8M0 && !is_fp4(*tokens_dtype)) {
    fail(ErrorCode::kUnsupported,
         std::string(name) + ": float8_e8m0 scales pair only with float8_e5m2, float8_e4m3fn, "
                             "float4_e2m1 or float4_e1m2 tokens, got " +
             std::string(dtype_name(*tokens_dtype)) + " tokens");
  }
  return kScaleRows | kScaleMatrix;
}

void check_scales(const TensorView& scales, std::int64_t num_rows,
                  std::optional<DType> tokens_dtype) {
  const char* name = "per_token_scales";
  detail::check_dtype_value(scales, name);
  const Shape& shape = scales.shape();
  const unsigned forms = scale_forms(scales.dtype(), tokens_dtype);
  const unsigned form = shape.ndim == 1                     ? kScaleRows
                        : shape.ndim == 2                   ? kScaleMatrix
                        : shape.ndim == 3 && shape[2] == 2 ? kScaleBlocks
                                                            : 0u;
  if (!(forms & form)) {
    const std::string with =
        tokens_dtype ? " with " + std::string(dtype_name(*tokens_dtype)) + " tokens" : "";
    fail(ErrorCode::kInvalidArgument, std::string(name) + ": " +
                                          std::string(dtype_name(scales.dtype())) +
                                          " scales" + with + " must be " + forms_string(forms) +
                                          ", got " + spec_string(scales));
  }
  for (int d = 1; d < shape.ndim; ++d) {
    if (shape[d] < 1) {
      fail(ErrorCode::kInvalidArgument, std::string(name) + ": dim " + std::to_string(d) +
                                            " must be >= 1, got " + shape.to_string());
    }
  }
  if (shape[0] != num_rows) {
    fail(ErrorCode::kInvalidArgument, std::string(name) + ": dim 0 is " +
                                          std::to_string(shape[0]) + " but tokens has " +
                                          std::to_string(num_rows) + " rows");
  }
  detail::checked_nbytes(scales.spec, name);
}

// Rule 8.
void check_weight(const TensorView& weight, std::int64_t num_rows) {
  const char* name = "expert_topk_weight";
  detail::check_dtype_value(weight, name);
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
  if (shape[0] != num_rows) {
    fail(ErrorCode::kInvalidArgument, std::string(name) + ": dim 0 is " +
                                          std::to_string(shape[0]) + " but tokens has " +
                                          std::to_string(num_rows) + " rows");
  }
}

// Rule 9 (the forward's attributes) and section 9's expert_alignment.
void check_attributes(const Attributes& attributes, Direction direction) {
  if (attributes.expert_alignment < 1) {
    fail(ErrorCode::kInvalidArgument, "expert_alignment: must be >= 1, got " +
                                          std::to_string(attributes.expert_alignment));
  }
  if (direction == Direction::kInverse) return;
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

// The rows the E segments can gain from padding: E * (k - 1), 0 when k = 1.
std::int64_t pad_capacity(const Attributes& attributes, std::int64_t num_experts) {
  std::int64_t rows = 0;
  if (__builtin_mul_overflow(num_experts, attributes.expert_alignment - 1, &rows)) {
    fail(ErrorCode::kOutOfRange, "expert_alignment: " +
                                     std::to_string(attributes.expert_alignment) + " with E = " +
                                     std::to_string(num_experts) + " experts overflows int64 rows");
  }
  return rows;
}

// R, the forward's output rows: A, plus E * (k - 1) when k > 1; R and every
// destination row must fit the int32 index.
std::int64_t expert_rows(const Attributes& attributes, std::int64_t num_tokens,
                         std::int64_t num_experts) {
  std::int64_t rows = num_tokens;
  if (__builtin_add_overflow(num_tokens, pad_capacity(attributes, num_experts), &rows) ||
      rows > kIndexLimit) {
    fail(ErrorCode::kOutOfRange,
         "expert_alignment: " + std::to_string(attributes.expert_alignment) + " pads A = " +
             std::to_string(num_tokens) + " tokens of E = " + std::to_string(num_experts) +
             " experts past the int32 index limit 2147483647");
  }
  return rows;
}

// The inverse's A: its R input rows less the E * (k - 1) rows of padding room.
std::int64_t rank_rows(const Attributes& attributes, std::int64_t num_rows,
                       std::int64_t num_experts) {
  const std::int64_t room = pad_capacity(attributes, num_experts);
  if (num_rows < room) {
    fail(ErrorCode::kInvalidArgument,
         "tokens: " + std::to_string(num_rows) + " rows cannot hold E = " +
             std::to_string(num_experts) + " experts padded to expert_alignment " +
             std::to_string(attributes.expert_alignment) + " (at least " + std::to_string(room) +
             " rows)");
  }
  return num_rows - room;
}

// Dim 0 of `spec` set to `rows`.
TensorSpec with_rows(TensorSpec spec, std::int64_t rows) {
  spec.shape.dims[0] = rows;
  return spec;
}

[[noreturn, gnu::cold]] void fail_negative_count(std::size_t block, std::int64_t num_experts,
                                                  std::int64_t value) {
  const auto b = static_cast<std::int64_t>(block);
  fail(ErrorCode::kInvalidArgument,
       "expert_token_num_per_rank: count[" + std::to_string(b / num_experts) + "][" +
           std::to_string(b % num_experts) + "] = " + std::to_string(value) + " is negative");
}

// Rules 4 and 5: the counts as int64, into `values`. `num_tokens` is A, which
// the inverse derives from its `num_rows` = R input rows.
void read_counts(const TensorView& counts, std::int64_t num_tokens, std::int64_t num_rows,
                 bool allow_spare_rows, std::vector<std::int64_t>& values) {
  const char* name = "expert_token_num_per_rank";
  const std::int64_t num_experts = counts.shape()[1];
  if (counts.data == nullptr) fail(ErrorCode::kInvalidArgument, std::string(name) + ": data is null");
  values.resize(static_cast<std::size_t>(counts.shape().numel()));
  std::int64_t sum = 0;
  detail::for_each_count(counts, values.size(), [&](std::size_t i, std::int64_t value) {
    if (value < 0) fail_negative_count(i, num_experts, value);
    if (__builtin_add_overflow(sum, value, &sum)) {
      fail(ErrorCode::kOutOfRange, std::string(name) + ": counts overflow int64 when summed");
    }
    values[i] = value;
  });
  if (allow_spare_rows ? sum > num_tokens : sum != num_tokens) {
    fail(ErrorCode::kInvalidArgument,
         std::string(name) + ": counts sum to " + std::to_string(sum) + " but tokens has " +
             std::to_string(num_tokens) + " rows" +
             (num_rows != num_tokens
                  ? " (its " + std::to_string(num_rows) + " rows less E * (k - 1) = " +
                        std::to_string(num_rows - num_tokens) + " rows of padding room)"
                  : "") +
             (allow_spare_rows ? " (with allow_spare_rows the sum may be less, never more)" : ""));
  }
}

}  // namespace

namespace detail {

void PlanBuilder::make(Plan& plan, const Call& call, const TensorView& counts, int num_threads) {
  check_num_threads(num_threads);
  plan.direction_ = call.direction;
  plan.attributes_ = call.attributes;
  plan.num_tokens_ = call.num_tokens;
  plan.num_ranks_ = call.num_ranks;
  plan.num_experts_ = call.num_experts;
  const std::int64_t tokens_rows = call.direction == Direction::kForward ? call.num_tokens
                                                                          : call.num_rows;
  read_counts(counts, call.num_tokens, tokens_rows, call.attributes.allow_spare_rows,
              plan.counts_);
  plan.token_row_bytes_ = call.token_row_bytes;
  plan.scale_row_bytes_ = call.scale_row_bytes;
  plan.weight_row_bytes_ = call.weight_row_bytes;
  plan.input_specs_.assign(call.input_specs().begin(), call.input_specs().end());
  plan.output_specs_.assign(call.output_specs().begin(), call.output_specs().end());
  offsets(plan);
  schedule(plan, num_threads);
}

// src_offset, dst_offset (expert segments padded to multiples of k) and expert_token_num.
void PlanBuilder::offsets(Plan& plan) {
  const std::int64_t num_ranks = plan.num_ranks_;
  const std::int64_t num_experts = plan.num_experts_;
  const std::int64_t k = plan.attributes_.expert_alignment;
  const std::int64_t* counts = plan.counts_.data();
  const std::size_t size = plan.counts_.size();
  plan.src_offset_.resize(size);
  plan.dst_offset_.resize(size);
  plan.expert_token_num_.resize(static_cast<std::size_t>(num_experts));
  std::int64_t* src_offset = plan.src_offset_.data();
  std::int64_t* dst_offset = plan.dst_offset_.data();
  std::int64_t row = 0;
  for (std::size_t b = 0; b < size; ++b) {
    src_offset[b] = row;
    row += counts[b];
  }
  plan.num_valid_rows_ = row;
  row = 0;
  const bool cumsum = plan.attributes_.expert_token_num_type == kExpertTokenNumCumsum;
  for (std::int64_t e = 0; e < num_experts; ++e) {
    const std::int64_t segment = row;
    for (std::int64_t b = e; b < num_ranks * num_experts; b += num_experts) {
      dst_offset[b] = row;
      row += counts[b];
    }
    const std::int64_t total = row - segment;
    row = segment + (total + k - 1) / k * k;
    plan.expert_token_num_[static_cast<std::size_t>(e)] = cumsum ? row : total;
  }
  plan.num_padded_rows_ = row;
}

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

std::int64_t Plan::bytes_per_row() const {
  const std::int64_t index_bytes = direction_ == Direction::kForward ? 4 : 0;
  // Without scales the forward still writes a zero float32 per row.
  const std::int64_t scale_bytes =
      direction_ == Direction::kForward && scale_row_bytes_ == 0 ? 4 : scale_row_bytes_;
  return token_row_bytes_ + scale_bytes + weight_row_bytes_ + index_bytes;
}

std::string Plan::to_string() const {
  std::string s = direction_ == Direction::kForward ? "reroute" : "inverse";
  s += " plan: A=" + std::to_string(num_tokens_) + " N=" + std::to_string(num_ranks_) +
       " E=" + std::to_string(num_experts_) + " row_bytes tokens=" +
       std::to_string(token_row_bytes_) + " scales=" + std::to_string(scale_row_bytes_) +
       " weight=" + std::to_string(weight_row_bytes_) + " threads=" +
       std::to_string(num_threads());
  if (attributes_.expert_alignment != 1) {
    s += " expert_alignment=" + std::to_string(attributes_.expert_alignment);
  }
  if (attributes_.allow_spare_rows) s += " allow_spare_rows";
  s += "\n";
  for (int t = 0; t < num_threads(); ++t) {
    std::int64_t rows = 0;
    for (std::int64_t c = thread_begin_[t]; c < thread_begin_[t + 1]; ++c) {
      rows += chunks_[c].num_rows;
    }
    s += "  thread " + std::to_string(t) + ": " +
         std::to_string(thread_begin_[t + 1] - thread_begin_[t]) + " chunks, " +
         std::to_string(rows) + " rows, " + std::to_string(rows * bytes_per_row()) + " bytes\n";
  }
  return s;
}

RerouteOutputSpecs infer_reroute(const RerouteInputs& inputs, const Attributes& attributes) {
  check_tokens(inputs.tokens, /*token_dtypes_only=*/true, /*index_limit=*/true);
  check_counts_spec(inputs.expert_token_num_per_rank);
  const std::int64_t num_tokens = inputs.tokens.shape()[0];
  if (inputs.per_token_scales) {
    check_scales(*inputs.per_token_scales, num_tokens, inputs.tokens.dtype());
  }
  if (inputs.expert_topk_weight) check_weight(*inputs.expert_topk_weight, num_tokens);
  check_attributes(attributes, Direction::kForward);
  const std::int64_t num_experts = inputs.expert_token_num_per_rank.shape()[1];
  const std::int64_t rows = expert_rows(attributes, num_tokens, num_experts);

  RerouteOutputSpecs specs;
  specs.permute_tokens = with_rows(inputs.tokens.spec, rows);
  specs.permute_per_token_scales = inputs.per_token_scales
                                       ? with_rows(inputs.per_token_scales->spec, rows)
                                       : TensorSpec{DType::kFloat32, {rows}};
  specs.permute_token_idx = {DType::kInt32,
                             {attributes.idx_type == kIdxGather ? rows : num_tokens}};
  specs.expert_token_num = {inputs.expert_token_num_per_rank.dtype(), {num_experts}};
  specs.permute_topk_weight = inputs.expert_topk_weight
                                  ? with_rows(inputs.expert_topk_weight->spec, rows)
                                  : TensorSpec{DType::kFloat32, {0}};
  detail::checked_nbytes(specs.permute_tokens, "expert_alignment");
  detail::checked_nbytes(specs.permute_per_token_scales, "expert_alignment");
  return specs;
}

InverseOutputSpecs infer_inverse(const InverseInputs& inputs, const Attributes& attributes) {
  check_tokens(inputs.tokens, /*token_dtypes_only=*/false, /*index_limit=*/false);
  check_counts_spec(inputs.expert_token_num_per_rank);
  const std::int64_t num_rows = inputs.tokens.shape()[0];
  if (inputs.per_token_scales) check_scales(*inputs.per_token_scales, num_rows, std::nullopt);
  if (inputs.expert_topk_weight) check_weight(*inputs.expert_topk_weight, num_rows);
  check_attributes(attributes, Direction::kInverse);
  const std::int64_t num_tokens =
      rank_rows(attributes, num_rows, inputs.expert_token_num_per_rank.shape()[1]);

  InverseOutputSpecs specs;
  specs.restored_tokens = with_rows(inputs.tokens.spec, num_tokens);
  if (inputs.per_token_scales) {
    specs.restored_per_token_scales = with_rows(inputs.per_token_scales->spec, num_tokens);
  }
  if (inputs.expert_topk_weight) {
    specs.restored_topk_weight = with_rows(inputs.expert_topk_weight->spec, num_tokens);
  }
  return specs;
}

namespace detail {
namespace {

// The parts of a call both directions share: the inputs' specs and row bytes.
template <typename Inputs>
Call call_of(Direction direction, const Inputs& inputs, const Attributes& attributes) {
  Call call;
  call.direction = direction;
  call.attributes = attributes;
  call.num_ranks = inputs.expert_token_num_per_rank.shape()[0];
  call.num_experts = inputs.expert_token_num_per_rank.shape()[1];
  call.token_row_bytes = dtype_bytes(inputs.tokens.dtype(), inputs.tokens.shape()[1]);
  call.scale_row_bytes = inputs.per_token_scales ? row_bytes(inputs.per_token_scales->spec) : 0;
  call.weight_row_bytes = inputs.expert_topk_weight ? std::int64_t{sizeof(float)} : 0;
  const auto add = [&call](const TensorSpec& spec) {
    call.input_specs_storage[call.num_inputs++] = spec;
  };
  add(inputs.tokens.spec);
  add(inputs.expert_token_num_per_rank.spec);
  if (inputs.per_token_scales) add(inputs.per_token_scales->spec);
  if (inputs.expert_topk_weight) add(inputs.expert_topk_weight->spec);
  return call;
}

}  // namespace

Call validate(const RerouteInputs& inputs, const Attributes& attributes) {
  const RerouteOutputSpecs specs = infer_reroute(inputs, attributes);
  Call call = call_of(Direction::kForward, inputs, attributes);
  call.num_tokens = inputs.tokens.shape()[0];
  call.num_rows = specs.permute_tokens.shape[0];
  call.output_specs_storage = {specs.permute_tokens, specs.permute_per_token_scales,
                               specs.permute_token_idx, specs.expert_token_num,
                               specs.permute_topk_weight};
  call.num_outputs = call.output_specs_storage.size();
  return call;
}

Call validate(const InverseInputs& inputs, const Attributes& attributes) {
  const InverseOutputSpecs specs = infer_inverse(inputs, attributes);
  Call call = call_of(Direction::kInverse, inputs, attributes);
  call.num_tokens = specs.restored_tokens.shape[0];
  call.num_rows = inputs.tokens.shape()[0];
  call.output_specs_storage[call.num_outputs++] = specs.restored_tokens;
  if (specs.restored_per_token_scales) {
    call.output_specs_storage[call.num_outputs++] = *specs.restored_per_token_scales;
  }
  if (specs.restored_topk_weight) {
    call.output_specs_storage[call.num_outputs++] = *specs.restored_topk_weight;
  }
  return call;
}

void plan_reroute(Plan& plan, const RerouteInputs& inputs, const Attributes& attributes,
                  int num_threads) {
  PlanBuilder::make(plan, validate(inputs, attributes), inputs.expert_token_num_per_rank,
                    num_threads);
}

void plan_inverse(Plan& plan, const InverseInputs& inputs, const Attributes& attributes,
                  int num_threads) {
  PlanBuilder::make(plan, validate(inputs, attributes), inputs.expert_token_num_per_rank,
                    num_threads);
}

}  // namespace detail

Plan plan_reroute(const RerouteInputs& inputs, const Attributes& attributes, int num_threads) {
  Plan plan;
  detail::plan_reroute(plan, inputs, attributes, num_threads);
  return plan;
}

Plan plan_inverse(const InverseInputs& inputs, const Attributes& attributes, int num_threads) {
  Plan plan;
  detail::plan_inverse(plan, inputs, attributes, num_threads);
  return plan;
}

}  // namespace moe_reroute
