#include "layer.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

namespace toy {
namespace {

// A fixed integer hash (splitmix64) so the expert coefficients need no state.
std::uint64_t mix(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A multiple of 1/256 in [-2, 2), exact in float32.
float coefficient(std::uint64_t key) {
  return static_cast<float>(static_cast<int>(mix(key) % 1024) - 512) / 256.0f;
}

}  // namespace

RankInput make_rank_input(const LayerConfig& config, int rank) {
  const auto num_tokens = static_cast<std::size_t>(config.tokens_per_rank);
  const auto hidden = static_cast<std::size_t>(config.hidden);
  const auto topk = static_cast<std::size_t>(config.topk);
  const int num_experts = config.num_experts();
  std::mt19937_64 rng(mix(config.seed * 0x100000001B3ull + static_cast<std::uint64_t>(rank)));
  std::uniform_int_distribution<int> byte(-127, 127);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);

  RankInput input;
  input.tokens.resize(num_tokens * hidden);
  for (auto& v : input.tokens) v = static_cast<std::int8_t>(byte(rng));
  input.scales.resize(num_tokens);
  for (auto& s : input.scales) s = 0.001f + 0.02f * unit(rng);

  // Weighted sampling without replacement (exponential race): expert g has
  // popularity 1 / (1 + g), and a token takes the K smallest keys.
  input.topk_expert.resize(num_tokens * topk);
  input.topk_weight.resize(num_tokens * topk);
  std::vector<float> key(static_cast<std::size_t>(num_experts));
  std::vector<std::int32_t> order(key.size());
  for (std::size_t t = 0; t < num_tokens; ++t) {
    for (int g = 0; g < num_experts; ++g) {
      key[static_cast<std::size_t>(g)] = -std::log(1.0f - unit(rng)) * static_cast<float>(1 + g);
    }
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(topk), order.end(),
                      [&](std::int32_t a, std::int32_t b) {
                        return key[static_cast<std::size_t>(a)] < key[static_cast<std::size_t>(b)];
                      });
    float total = 0.0f;
    for (std::size_t k = 0; k < topk; ++k) {
      input.topk_expert[t * topk + k] = order[k];
      input.topk_weight[t * topk + k] = 0.05f + unit(rng);
      total += input.topk_weight[t * topk + k];
    }
    for (std::size_t k = 0; k < topk; ++k) input.topk_weight[t * topk + k] /= total;
  }
  return input;
}

void expert_row(const LayerConfig& config, int expert, const std::int8_t* token, float scale,
                float* out) {
  const auto base = static_cast<std::uint64_t>(expert) << 32;
  for (int o = 0; o < config.out_hidden; ++o) {
    const auto key = base | static_cast<std::uint64_t>(o);
    const float x = static_cast<float>(token[o % config.hidden]) * scale;
    out[o] = coefficient(2 * key) * x + coefficient(2 * key + 1);
  }
}

std::vector<float> reference_output(const LayerConfig& config, const RankInput& input) {
  const auto out_hidden = static_cast<std::size_t>(config.out_hidden);
  const auto topk = static_cast<std::size_t>(config.topk);
  std::vector<float> out(static_cast<std::size_t>(config.tokens_per_rank) * out_hidden, 0.0f);
  std::vector<float> row(out_hidden);
  for (std::size_t t = 0; t < static_cast<std::size_t>(config.tokens_per_rank); ++t) {
    float* dst = out.data() + t * out_hidden;
    for (std::size_t k = 0; k < topk; ++k) {
      expert_row(config, input.topk_expert[t * topk + k],
                 input.tokens.data() + t * static_cast<std::size_t>(config.hidden),
                 input.scales[t], row.data());
      const float weight = input.topk_weight[t * topk + k];
      for (std::size_t o = 0; o < out_hidden; ++o) dst[o] = dst[o] + row[o] * weight;
    }
  }
  return out;
}

}  // namespace toy
