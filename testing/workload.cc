#include "workload.h"

#include <omp.h>

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

std::string first_difference(const char* name, const std::vector<std::byte>& got,
                             const std::byte* expected, std::size_t expected_bytes) {
  if (got.size() != expected_bytes) {
    return std::string(name) + ": " + std::to_string(got.size()) + " bytes, expected " +
           std::to_string(expected_bytes);
  }
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (got[i] != expected[i]) {
      return std::string(name) + ": byte " + std::to_string(i) + " is " +
             std::to_string(std::to_integer<int>(got[i])) + ", expected " +
             std::to_string(std::to_integer<int>(expected[i]));
    }
  }
  return "";
}

std::string rows_difference(const char* name, const std::byte* got, std::size_t got_bytes,
                            const std::vector<std::byte>& expected, std::int64_t specified_rows,
                            std::int64_t row_bytes) {
  if (got_bytes != expected.size()) {
    return std::string(name) + ": " + std::to_string(got_bytes) + " bytes, expected " +
           std::to_string(expected.size());
  }
  const std::size_t specified = size(specified_rows * row_bytes);
  for (std::size_t i = 0; i < got_bytes; ++i) {
    const std::byte want = i < specified ? expected[i] : kPoison;
    if (got[i] != want) {
      return std::string(name) + ": byte " + std::to_string(i) + " (row " +
             std::to_string(static_cast<std::int64_t>(i) / row_bytes) + ") is " +
             std::to_string(std::to_integer<int>(got[i])) + ", expected " +
             std::to_string(std::to_integer<int>(want)) + (i < specified ? "" : " (unwritten)");
    }
  }
  return "";
}

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

void for_each_thread(int num_threads, const std::function<void(int)>& body) {
  // libgomp's region costs a futex syscall even for a team of one.
  if (num_threads <= 1) {
    body(0);
    return;
  }
#pragma omp parallel for num_threads(num_threads) schedule(static, 1)
  for (int t = 0; t < num_threads; ++t) body(t);
}

namespace {

// Runs body(begin, end) on `num_threads` threads over equal contiguous slices
// of [0, bytes), one each.
template <typename Body>
void for_each_slice(std::size_t bytes, int num_threads, const Body& body) {
  const std::size_t threads = static_cast<std::size_t>(std::max(1, num_threads));
  for_each_thread(num_threads, [&](int thread) {
    const auto t = static_cast<std::size_t>(thread);
    body(bytes / threads * t + std::min(t, bytes % threads),
         bytes / threads * (t + 1) + std::min(t + 1, bytes % threads));
  });
}

}  // namespace

void parallel_copy(void* dst, const void* src, std::size_t bytes, int num_threads) {
  for_each_slice(bytes, num_threads, [&](std::size_t begin, std::size_t end) {
    std::memcpy(static_cast<std::byte*>(dst) + begin, static_cast<const std::byte*>(src) + begin,
                end - begin);
  });
}

void parallel_zero(void* dst, std::size_t bytes, int num_threads) {
  for_each_slice(bytes, num_threads, [&](std::size_t begin, std::size_t end) {
    std::memset(static_cast<std::byte*>(dst) + begin, 0, end - begin);
  });
}

void per_row_gather(std::byte* dst, const std::byte* src, const std::int32_t* index,
                    std::int64_t num_rows, std::int64_t row_bytes) {
  for (std::int64_t i = 0; i < num_rows; ++i) {
    std::memcpy(dst + i * row_bytes, src + std::int64_t{index[i]} * row_bytes, size(row_bytes));
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

ReferenceInputs Workload::reference_inputs() const {
  ReferenceInputs in;
  in.num_ranks = config_.num_ranks;
  in.num_experts = config_.num_experts;
  in.counts = counts;
  in.tokens = tokens.data();
  in.token_row_bytes = dtype_bytes(config_.token_dtype, config_.hidden);
  // Null means absent to the reference, so A = 0 points at a byte it never reads.
  static const std::byte kNoRows{};
  const auto rows_of = [](const std::vector<std::byte>& v) { return v.empty() ? &kNoRows : v.data(); };
  if (config_.has_scales) {
    in.scales = rows_of(scales);
    in.scale_row_bytes = scale_row_bytes();
  }
  if (config_.has_weight) in.weight = rows_of(weight);
  in.num_tokens = config_.num_tokens;
  in.expert_alignment = config_.attributes.expert_alignment;
  return in;
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

std::string Workload::compare(const ReferenceOutputs& expected) const {
  std::vector<std::byte> expected_num(expert_token_num.size());
  const std::size_t count_bytes = size(dtype_bytes(config_.count_dtype, 1));
  for (std::size_t e = 0; e < expected.expert_token_num.size(); ++e) {
    const auto value32 = static_cast<std::int32_t>(expected.expert_token_num[e]);
    std::memcpy(expected_num.data() + e * count_bytes,
                count_bytes == 4 ? static_cast<const void*>(&value32) : &expected.expert_token_num[e],
                count_bytes);
  }
  const std::int64_t rows = expected.specified_rows;
  for (const std::string& diff :
       {rows_difference("permute_tokens", permute_tokens.data(), permute_tokens.size(),
                        expected.tokens, rows, dtype_bytes(config_.token_dtype, config_.hidden)),
        rows_difference("permute_per_token_scales", permute_scales.data(), permute_scales.size(),
                        expected.scales, rows, scale_row_bytes()),
        rows_difference("permute_topk_weight", permute_weight.data(), permute_weight.size(),
                        expected.weight, rows, 4),
        first_difference("permute_token_idx", token_idx,
                         reinterpret_cast<const std::byte*>(expected.token_idx.data()),
                         expected.token_idx.size() * 4),
        first_difference("expert_token_num", expert_token_num, expected_num.data(),
                         expected_num.size())}) {
    if (!diff.empty()) return diff;
  }
  return "";
}

}  // namespace moe_reroute::testing
