#pragma once

/// The toy MoE layer that both expert-parallel paths (main.cc: moe_reroute::ep,
/// and --baseline's three steps) and their single-process reference compute:
/// seeded inputs and routing per rank, and one deterministic float32 map per
/// expert.

#include <cstdint>
#include <vector>

namespace toy {

struct LayerConfig {
  int num_ranks = 1;         // P
  int tokens_per_rank = 0;   // T
  int hidden = 0;            // H, int8 elements per input row
  int out_hidden = 0;        // O, float32 elements per output row
  int experts_per_rank = 0;  // E; global expert g lives on rank g / E as local expert g % E
  int topk = 0;              // K distinct experts per token
  std::uint64_t seed = 0;

  int num_experts() const { return num_ranks * experts_per_rank; }
};

/// One rank's layer input: int8 tokens [T, H] with a float32 scale per token,
/// and each token's top-k global experts [T, K] with float32 weights [T, K].
struct RankInput {
  std::vector<std::int8_t> tokens;
  std::vector<float> scales;
  std::vector<std::int32_t> topk_expert;
  std::vector<float> topk_weight;
};

/// The input of `rank`, a function of the config and the rank only, so every
/// process can regenerate any rank's input. Routing is skewed: low-numbered
/// experts are more popular, so the count matrix is uneven.
RankInput make_rank_input(const LayerConfig& config, int rank);

/// Global expert `expert` applied to one dispatched row:
/// out[o] = a[o] * (tokens[o % H] * scale) + b[o], with coefficients a, b
/// fixed per (expert, o). Writes O floats.
void expert_row(const LayerConfig& config, int expert, const std::int8_t* token, float scale,
                float* out);

/// The layer output of `rank` computed in one process, all experts local:
/// out[t] = 0 + w[t][0] * y[t][0] + ... + w[t][K-1] * y[t][K-1], each step
/// rounded in float32 in that order (moe_finalize_routing's arithmetic), where
/// y[t][k] = expert_row(topk_expert[t][k], ...). Returns [T, O] float32.
std::vector<float> reference_output(const LayerConfig& config, const RankInput& input);

}  // namespace toy
