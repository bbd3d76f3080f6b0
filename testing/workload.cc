#include "workload.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>

namespace moe_reroute::testing {
namespace {

std::size_t size(std::int64_t n) { return static_cast<std::size_t>(n); }

}  // namespace

std::vector<std::int64_t> random_counts(std::int64_t num_ranks, std::int64_t num_experts,
                                        std::int64_t num_tokens, double skew,
                                        double zero_fraction, std::uint64_t seed) {
  const std::size_t num_blocks = size(num_ranks * num_experts);
  std::mt19937_64 rng(seed);
  std::vector<std::size_t> order(num_blocks);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<double> weights(num_blocks, 0.0);
  const std::size_t num_zero = std::min(
      num_blocks - 1, static_cast<std::size_t>(zero_fraction * static_cast<double>(num_blocks)));
  for (std::size_t i = num_zero; i < num_blocks; ++i) {
    weights[order[i]] = 1.0 / std::pow(1.0 + static_cast<double>(i - num_zero), skew);
  }
  std::discrete_distribution<std::size_t> pick(weights.begin(), weights.end());
  std::vector<std::int64_t> counts(num_blocks, 0);
  for (std::int64_t t = 0; t < num_tokens; ++t) ++counts[pick(rng)];
  return counts;
}

void fill_random(void* data, std::size_t bytes, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto* out = static_cast<unsigned char*>(data);
  std::size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    const std::uint64_t word = rng();
    std::memcpy(out + i, &word, 8);
  }
  if (i < bytes) {  // memcpy may not be given a null pointer, even for 0 bytes
    const std::uint64_t word = rng();
    std::memcpy(out + i, &word, bytes - i);
  }
}

Workload::Workload(const WorkloadConfig& config) : config_(config) {
  const std::int64_t a = config.num_tokens;
  counts = random_counts(config.num_ranks, config.num_experts,
                         config.num_valid_tokens < 0 ? a : config.num_valid_tokens, config.skew,
                         config.zero_fraction, config.seed);
  const std::size_t count_bytes = size(dtype_bytes(config.count_dtype, 1));
  counts_storage.resize(counts.size() * count_bytes);
  for (std::size_t i = 0; i < counts.size(); ++i) {
    const auto value32 = static_cast<std::int32_t>(counts[i]);
    std::memcpy(counts_storage.data() + i * count_bytes,
                count_bytes == 4 ? static_cast<const void*>(&value32) : &counts[i], count_bytes);
  }
  tokens.resize(size(dtype_bytes(config.token_dtype, a * config.hidden)));
  fill_random(tokens.data(), tokens.size(), config.seed + 1);
  if (config.has_scales) {
    scales.resize(size(meta_inputs(config).per_token_scales->nbytes()));
    fill_random(scales.data(), scales.size(), config.seed + 2);
  }
  if (config.has_weight) {
    weight.resize(size(a * 4));
    fill_random(weight.data(), weight.size(), config.seed + 3);
  }
  const std::int64_t rows = num_output_rows();
  permute_tokens.resize(size(dtype_bytes(config.token_dtype, rows * config.hidden)));
  permute_scales.resize(size(rows * scale_row_bytes()));
  permute_weight.resize(size(config.has_weight ? rows * 4 : 0));
  token_idx.resize(size((config.attributes.idx_type == kIdxGather ? rows : a) * 4));
  expert_token_num.resize(size(config.num_experts) * count_bytes);
  poison_outputs();
}

RerouteInputs meta_inputs(const WorkloadConfig& c) {
  RerouteInputs in;
  in.tokens = TensorView(nullptr, c.token_dtype, {c.num_tokens, c.hidden});
  in.expert_token_num_per_rank = TensorView(nullptr, c.count_dtype, {c.num_ranks, c.num_experts});
  if (c.has_scales) {
    std::vector<std::int64_t> dims = {c.num_tokens};
    dims.insert(dims.end(), c.scale_tail.begin(), c.scale_tail.end());
    in.per_token_scales = TensorView(nullptr, c.scale_dtype, Shape(dims));
  }
  if (c.has_weight) in.expert_topk_weight = TensorView(nullptr, DType::kFloat32, {c.num_tokens, 1});
  return in;
}

RerouteInputs Workload::inputs() const {
  const auto on = [](const TensorView& view, const std::vector<std::byte>& bytes) {
    return TensorView(bytes.data(), view.dtype(), view.shape());
  };
  RerouteInputs in = meta_inputs(config_);
  in.tokens = on(in.tokens, tokens);
  in.expert_token_num_per_rank = on(in.expert_token_num_per_rank, counts_storage);
  if (in.per_token_scales) in.per_token_scales = on(*in.per_token_scales, scales);
  if (in.expert_topk_weight) in.expert_topk_weight = on(*in.expert_topk_weight, weight);
  return in;
}

std::int64_t Workload::num_output_rows() const {
  const std::int64_t k = config_.attributes.expert_alignment;
  return k == 1 ? config_.num_tokens : config_.num_tokens + config_.num_experts * (k - 1);
}

std::int64_t Workload::scale_row_bytes() const {
  if (!config_.has_scales) return 4;  // the forward's zero float32 per row
  TensorSpec one_row = meta_inputs(config_).per_token_scales->spec;
  one_row.shape.dims[0] = 1;
  return one_row.nbytes();
}

RerouteOutputs Workload::outputs() {
  const WorkloadConfig& c = config_;
  const std::int64_t rows = num_output_rows();
  RerouteOutputs out;
  out.permute_tokens = TensorView(permute_tokens.data(), c.token_dtype, {rows, c.hidden});
  const std::optional<TensorView> scales_in = meta_inputs(c).per_token_scales;
  Shape scale_shape = scales_in ? scales_in->shape() : Shape{rows};
  scale_shape.dims[0] = rows;
  out.permute_per_token_scales = TensorView(
      permute_scales.data(), scales_in ? scales_in->dtype() : DType::kFloat32, scale_shape);
  out.permute_token_idx = TensorView(token_idx.data(), DType::kInt32,
                                     {c.attributes.idx_type == kIdxGather ? rows : c.num_tokens});
  out.expert_token_num = TensorView(expert_token_num.data(), c.count_dtype, {c.num_experts});
  out.permute_topk_weight = c.has_weight
                                ? TensorView(permute_weight.data(), DType::kFloat32, {rows, 1})
                                : TensorView(nullptr, DType::kFloat32, {0});
  return out;
}

void Workload::poison_outputs() {
  for (auto* buffer : {&permute_tokens, &permute_scales, &permute_weight, &token_idx, &expert_token_num}) {
    std::fill(buffer->begin(), buffer->end(), kPoison);
  }
}

std::int64_t Workload::bytes_moved() const {
  const auto read = static_cast<std::int64_t>(tokens.size() + scales.size() + weight.size() +
                                              counts_storage.size());
  const auto written = static_cast<std::int64_t>(permute_tokens.size() + permute_scales.size() +
                                                 permute_weight.size() + token_idx.size() +
                                                 expert_token_num.size());
  return read + written;
}

}  // namespace moe_reroute::testing
