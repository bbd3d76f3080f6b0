// The workload flags shared by `bench` and `gen`.

#include <string>

#include "commands.h"
#include "moe_reroute/error.h"

namespace moe_reroute::tools {
namespace {

[[noreturn]] void fail(const std::string& message) {
  throw Error(ErrorCode::kInvalidArgument, message);
}

DType named_dtype(const std::string& name, const char* flag) {
  const std::optional<DType> dtype = dtype_from_name(name);
  if (!dtype) fail(std::string(flag) + ": unknown dtype name '" + name + "'");
  return *dtype;
}

[[noreturn]] void bad_scales(const std::string& value) {
  fail("--scales: '" + value +
       "' must be none, f32, f32xS, f32k2, e8m0a, e8m0xS or e8m0 with S >= 1");
}

// "f32x4" -> 4 for prefix "f32x"; throws for anything but a positive integer.
std::int64_t columns_after(const std::string& value, const std::string& prefix) {
  const std::string digits = value.substr(prefix.size());
  if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos ||
      digits.size() > 9 || std::stoll(digits) < 1) {
    bad_scales(value);
  }
  return std::stoll(digits);
}

}  // namespace

testing::WorkloadConfig workload_config(const WorkloadOptions& o) {
  testing::WorkloadConfig config;
  config.num_tokens = o.tokens;
  config.hidden = o.hidden;
  config.num_ranks = o.ranks;
  config.num_experts = o.experts;
  config.token_dtype = named_dtype(o.tokens_dtype, "--tokens-dtype");
  config.count_dtype = named_dtype(o.counts_dtype, "--counts-dtype");
  config.has_weight = o.topk_weight;
  config.skew = o.skew;
  config.seed = o.seed;
  config.attributes = {o.expert_token_num_type, o.idx_type, o.expert_alignment,
                       o.valid_tokens >= 0};
  config.num_valid_tokens = o.valid_tokens;
  if (o.tokens < 0 || o.hidden < 1 || o.ranks < 1 || o.experts < 1) {
    fail("--tokens >= 0, --hidden >= 1, --ranks >= 1 and --experts >= 1 are required");
  }
  if (o.valid_tokens < -1) {
    fail("--valid-tokens: must be -1 (all) or 0 to --tokens, got " +
         std::to_string(o.valid_tokens));
  }
  if (o.valid_tokens > o.tokens) {
    fail("--valid-tokens: " + std::to_string(o.valid_tokens) + " exceeds --tokens " +
         std::to_string(o.tokens));
  }
  config.has_scales = o.scales != "none";
  if (o.scales == "f32") {
    config.scale_dtype = DType::kFloat32;
  } else if (o.scales.starts_with("f32x")) {
    config.scale_dtype = DType::kFloat32;
    config.scale_tail = {columns_after(o.scales, "f32x")};
  } else if (o.scales == "f32k2") {
    config.scale_dtype = DType::kFloat32;
    config.scale_tail = {(o.hidden + 63) / 64, 2};
  } else if (o.scales == "e8m0a") {
    config.scale_dtype = DType::kFloat8E8M0;
  } else if (o.scales == "e8m0") {
    config.scale_dtype = DType::kFloat8E8M0;
    config.scale_tail = {(o.hidden + 63) / 64, 2};
  } else if (o.scales.starts_with("e8m0x")) {
    config.scale_dtype = DType::kFloat8E8M0;
    config.scale_tail = {columns_after(o.scales, "e8m0x")};
  } else if (config.has_scales) {
    bad_scales(o.scales);
  }
  // The core's own checks of shapes, dtypes and attributes, before the
  // workload allocates outputs by them (an expert_alignment of 0 would size
  // them negative).
  infer_reroute(testing::meta_inputs(config), config.attributes);
  return config;
}

}  // namespace moe_reroute::tools
