// The CPU backend's two copy paths beside plain memcpy: streaming stores once
// the data outgrows the last-level cache, and the vector loop for chunks whose
// destination sits 1 to 63 bytes past the source modulo 4 KiB.

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "moe_reroute/reroute.h"
#include "reference.h"
#include "workload.h"

namespace moe_reroute {
namespace {

using testing::Workload;
using testing::WorkloadConfig;

// The plan streams exactly when the rows read plus written outgrow the
// measured last-level cache; planning reads only the counts, so sizes on both
// sides of the threshold need no data.
TEST(CopyPath, StreamingThresholdFollowsTheMeasuredCache) {
  const std::int64_t hidden = 7168;
  const std::int64_t bytes_per_row = hidden + 4 + 4;  // tokens, zero scale, index
  const std::int64_t threshold_rows = last_level_cache_bytes() / (2 * bytes_per_row);
  for (const std::int64_t rows : {threshold_rows, threshold_rows + 1}) {
    const std::vector<std::int64_t> counts = {rows};
    const Plan plan = plan_reroute({TensorView(nullptr, DType::kInt8, {rows, hidden}),
                                    TensorView(counts.data(), DType::kInt64, {1, 1})});
    ASSERT_EQ(plan.bytes_per_row(), bytes_per_row);
    EXPECT_EQ(plan.streaming_stores(), rows > threshold_rows) << rows << " rows";
  }
}

TEST(CopyPath, StreamingStoresMoveEveryByteOfAnOutputBiggerThanTheCache) {
  WorkloadConfig config;
  config.hidden = 7168 + 3;  // rows that are not a multiple of 16 or 64 bytes
  // Rows read + written (tokens, f32 scale and weight, index) past this machine's cache.
  config.num_tokens = last_level_cache_bytes() / (2 * (config.hidden + 12)) + 512;
  config.skew = 1.0;
  config.zero_fraction = 0.2;
  Workload workload(config);
  const testing::ReferenceOutputs expected = testing::reference_reroute(
      workload.reference_inputs(), config.attributes.expert_token_num_type,
      config.attributes.idx_type);
  for (int threads : {1, 2}) {
    workload.poison_outputs();
    const Plan plan = plan_reroute(workload.inputs(), config.attributes, threads);
    ASSERT_TRUE(plan.streaming_stores());
    run_reroute(plan, workload.inputs(), workload.outputs());
    EXPECT_EQ(workload.compare(expected), "") << threads << " threads";
  }
}

TEST(CopyPath, FourKAliasedChunksAreCopiedExactly) {
  // N x 1 counts make the forward an identity on rows, so every chunk's
  // destination is (out - in) bytes past its source; put that at 16 mod 4096.
  const std::int64_t num_ranks = 64;
  const std::int64_t hidden = 4096 + 100;
  const std::vector<std::int64_t> counts = testing::random_counts(num_ranks, 1, 640, 0.5, 0.1, 7);
  const std::int64_t num_tokens = 640;
  const std::int64_t token_bytes = num_tokens * hidden;
  const std::int64_t gap = (token_bytes + 4095) / 4096 * 4096 + 16;
  std::vector<std::byte> arena(static_cast<std::size_t>(gap + token_bytes + 4096));
  std::byte* in = arena.data() + (4096 - reinterpret_cast<std::uintptr_t>(arena.data()) % 4096) % 4096;
  std::byte* out = in + gap;
  testing::fill_random(in, static_cast<std::size_t>(token_bytes), 11);
  std::memset(out, 0xA5, static_cast<std::size_t>(token_bytes));
  std::vector<std::int32_t> counts32(counts.begin(), counts.end());
  std::vector<float> scales(num_tokens, 0.0f);
  std::vector<std::int32_t> index(num_tokens), expert_token_num(1);

  RerouteInputs inputs{TensorView(in, DType::kInt8, {num_tokens, hidden}),
                       TensorView(counts32.data(), DType::kInt32, {num_ranks, 1})};
  RerouteOutputs outputs{TensorView(out, DType::kInt8, {num_tokens, hidden}),
                         TensorView(scales.data(), DType::kFloat32, {num_tokens}),
                         TensorView(index.data(), DType::kInt32, {num_tokens}),
                         TensorView(expert_token_num.data(), DType::kInt32, {1}),
                         TensorView(nullptr, DType::kFloat32, {0})};
  moe_re_routing(inputs, outputs, {}, 1);

  testing::ReferenceInputs reference;
  reference.num_ranks = num_ranks;
  reference.num_experts = 1;
  reference.counts = counts;
  reference.tokens = in;
  reference.token_row_bytes = hidden;
  const testing::ReferenceOutputs expected = testing::reference_reroute(reference, 1, 0);
  EXPECT_EQ(std::memcmp(out, expected.tokens.data(), expected.tokens.size()), 0);
  EXPECT_EQ(expert_token_num[0], num_tokens);
}

}  // namespace
}  // namespace moe_reroute
