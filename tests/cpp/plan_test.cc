// The plan as a value: its printout, its offsets, and the work split (chunks
// cover every destination row exactly once, in line with the naive reference;
// thread shares balanced to within one row however skewed the counts).
// Plans read only the counts, so the tokens here are views with null data.

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "reference.h"
#include "sweep.h"

namespace moe_reroute::test {
namespace {

// Counts and their int32 storage, with null-data tokens of `row_elements` int8.
struct CountsOnly {
  std::int64_t num_ranks, num_experts;
  std::vector<std::int64_t> counts;
  std::vector<std::int32_t> storage;

  CountsOnly(std::int64_t ranks, std::int64_t experts, std::vector<std::int64_t> values)
      : num_ranks(ranks), num_experts(experts), counts(std::move(values)),
        storage(counts.begin(), counts.end()) {}

  std::int64_t num_tokens() const {
    std::int64_t sum = 0;
    for (std::int64_t c : counts) sum += c;
    return sum;
  }
  RerouteInputs inputs(DType token_dtype, std::int64_t hidden) const {
    return {TensorView(nullptr, token_dtype, {num_tokens(), hidden}),
            TensorView(storage.data(), DType::kInt32, {num_ranks, num_experts})};
  }
  InverseInputs inverse_inputs(DType token_dtype, std::int64_t hidden) const {
    return {TensorView(nullptr, token_dtype, {num_tokens(), hidden}),
            TensorView(storage.data(), DType::kInt32, {num_ranks, num_experts})};
  }
  // The naive reference's gather index: source row of each destination row.
  std::vector<std::int32_t> gather_index() const {
    testing::ReferenceInputs in;
    in.num_ranks = num_ranks;
    in.num_experts = num_experts;
    in.counts = counts;
    return testing::reference_reroute(in, kExpertTokenNumCount, kIdxGather).token_idx;
  }
};

const CountsOnly kWorkedExample(2, 3, {1, 0, 2, 2, 1, 0});

std::vector<std::int64_t> rows_per_thread(const Plan& plan) {
  std::vector<std::int64_t> rows;
  for (int t = 0; t < plan.num_threads(); ++t) {
    std::int64_t sum = 0;
    for (std::int64_t c = plan.thread_begin()[static_cast<std::size_t>(t)];
         c < plan.thread_begin()[static_cast<std::size_t>(t) + 1]; ++c) {
      sum += plan.chunks()[static_cast<std::size_t>(c)].num_rows;
    }
    rows.push_back(sum);
  }
  return rows;
}

// "" when every destination row is written by exactly one chunk, from the
// source row the naive reference says, threads own consecutive chunks, and
// the chunks run in destination order, each where the last ended (so that a
// thread's chunks are one run of destination rows, which the CPU run zeroes
// at once where a stream has no source).
std::string split_difference(const Plan& plan, const std::vector<std::int32_t>& gather) {
  const bool forward = plan.direction() == Direction::kForward;
  std::vector<int> written(static_cast<std::size_t>(plan.num_tokens()), 0);
  if (plan.thread_begin().front() != 0 ||
      plan.thread_begin().back() != static_cast<std::int64_t>(plan.chunks().size()) ||
      !std::is_sorted(plan.thread_begin().begin(), plan.thread_begin().end())) {
    return "thread_begin does not partition the chunks";
  }
  std::int64_t next_dst = 0;
  for (const Chunk& chunk : plan.chunks()) {
    if (chunk.num_rows <= 0) return "empty chunk at dst_row " + std::to_string(chunk.dst_row);
    if (chunk.dst_row != next_dst) {
      return "chunk at dst_row " + std::to_string(chunk.dst_row) + " after rows up to " +
             std::to_string(next_dst);
    }
    next_dst += chunk.num_rows;
    for (std::int64_t k = 0; k < chunk.num_rows; ++k) {
      const std::int64_t src = chunk.src_row + k;
      const std::int64_t dst = chunk.dst_row + k;
      // The forward's destination is expert order; the inverse's is rank order.
      const std::int64_t expert_row = forward ? dst : src;
      const std::int64_t rank_row = forward ? src : dst;
      if (gather[static_cast<std::size_t>(expert_row)] != rank_row) {
        return "row " + std::to_string(src) + " -> " + std::to_string(dst) +
               " disagrees with the reference";
      }
      ++written[static_cast<std::size_t>(dst)];
    }
  }
  const auto wrong = std::find_if(written.begin(), written.end(), [](int n) { return n != 1; });
  if (wrong != written.end()) {
    return "row " + std::to_string(wrong - written.begin()) + " written " +
           std::to_string(*wrong) + " times";
  }
  return "";
}

TEST(PlanValue, WorkedExampleOffsetsAndChunks) {
  const Plan plan = plan_reroute(kWorkedExample.inputs(DType::kFloat32, 2), {}, 1);
  EXPECT_EQ(plan.src_offset(), (std::vector<std::int64_t>{0, 1, 1, 3, 5, 6}));
  EXPECT_EQ(plan.dst_offset(), (std::vector<std::int64_t>{0, 3, 4, 1, 3, 6}));
  EXPECT_EQ(plan.expert_token_num(), (std::vector<std::int64_t>{3, 1, 2}));
  EXPECT_EQ(plan.chunks(), (std::vector<Chunk>{{0, 0, 1}, {3, 1, 2}, {5, 3, 1}, {1, 4, 2}}));
  EXPECT_EQ(plan.thread_begin(), (std::vector<std::int64_t>{0, 4}));

  const Plan cumsum = plan_reroute(kWorkedExample.inputs(DType::kFloat32, 2),
                                   {kExpertTokenNumCumsum, kIdxGather}, 1);
  EXPECT_EQ(cumsum.expert_token_num(), (std::vector<std::int64_t>{3, 4, 6}));

  const Plan inverse = plan_inverse(kWorkedExample.inverse_inputs(DType::kFloat32, 2), {}, 1);
  EXPECT_EQ(inverse.chunks(), (std::vector<Chunk>{{0, 0, 1}, {4, 1, 2}, {1, 3, 2}, {3, 5, 1}}));
}

TEST(PlanValue, ToStringShowsSizesRowBytesAndEachThreadsShare) {
  EXPECT_EQ(plan_reroute(kWorkedExample.inputs(DType::kFloat32, 2), {}, 1).to_string(),
            "reroute plan: A=6 N=2 E=3 row_bytes tokens=8 scales=0 weight=0 threads=1\n"
            "  thread 0: 4 chunks, 6 rows, 96 bytes\n");
  EXPECT_EQ(plan_inverse(kWorkedExample.inverse_inputs(DType::kFloat32, 2), {}, 1).to_string(),
            "inverse plan: A=6 N=2 E=3 row_bytes tokens=8 scales=0 weight=0 threads=1\n"
            "  thread 0: 4 chunks, 6 rows, 48 bytes\n");
}

TEST(PlanValue, BytesPerRowCountsEveryOutput) {
  std::vector<float> scales(6 * 3), weight(6);
  RerouteInputs inputs = kWorkedExample.inputs(DType::kFloat4E2M1, 10);
  inputs.per_token_scales = TensorView(scales.data(), DType::kFloat32, {6, 3});
  inputs.expert_topk_weight = TensorView(weight.data(), DType::kFloat32, {6, 1});
  const Plan plan = plan_reroute(inputs, {}, 1);
  EXPECT_EQ(plan.token_row_bytes(), 5);
  EXPECT_EQ(plan.scale_row_bytes(), 12);
  EXPECT_EQ(plan.weight_row_bytes(), 4);
  EXPECT_EQ(plan.bytes_per_row(), 5 + 12 + 4 + 4);
}

TEST(PlanValue, EqualForEqualInputsAndDifferentForOtherAttributes) {
  const RerouteInputs inputs = kWorkedExample.inputs(DType::kInt8, 64);
  const Plan plan = plan_reroute(inputs, {}, 1);
  const Plan copy = plan;
  EXPECT_EQ(plan, copy);
  EXPECT_EQ(plan, plan_reroute(inputs, {}, 1));
  EXPECT_NE(plan, plan_reroute(inputs, {kExpertTokenNumCumsum, kIdxGather}, 1));
  EXPECT_NE(plan, plan_reroute(inputs, {kExpertTokenNumCount, kIdxScatter}, 1));
  EXPECT_NE(plan, plan_reroute(kWorkedExample.inputs(DType::kInt8, 32), {}, 1));
}

class WorkSplit : public ::testing::TestWithParam<Direction> {
 protected:
  Plan plan(const CountsOnly& counts, std::int64_t hidden, int num_threads) const {
    return GetParam() == Direction::kForward
               ? plan_reroute(counts.inputs(DType::kInt8, hidden), {}, num_threads)
               : plan_inverse(counts.inverse_inputs(DType::kInt8, hidden), {}, num_threads);
  }
};

// Random, skewed and sparse counts over 1 to 8 threads, with rows wide enough
// that every thread gets a share.
TEST_P(WorkSplit, ChunksCoverEveryRowOnceAndSharesDifferByAtMostOneRow) {
  for (std::uint64_t seed = 0; seed < 24; ++seed) {
    const std::int64_t num_ranks = 1 + static_cast<std::int64_t>(seed % 5);
    const std::int64_t num_experts = 1 + static_cast<std::int64_t>(seed * 7 % 9);
    const CountsOnly counts(num_ranks, num_experts,
                            testing::random_counts(num_ranks, num_experts, 3000,
                                                   static_cast<double>(seed % 4),
                                                   static_cast<double>(seed % 3) * 0.3, seed));
    const std::vector<std::int32_t> gather = counts.gather_index();
    for (int num_threads = 1; num_threads <= 8; ++num_threads) {
      SCOPED_TRACE("seed=" + std::to_string(seed) + " threads=" + std::to_string(num_threads));
      const Plan p = plan(counts, 4096, num_threads);
      EXPECT_EQ(p.num_threads(), num_threads);
      EXPECT_EQ(split_difference(p, gather), "");
      const std::vector<std::int64_t> rows = rows_per_thread(p);
      EXPECT_LE(*std::max_element(rows.begin(), rows.end()) -
                    *std::min_element(rows.begin(), rows.end()),
                1);
    }
  }
}

// One block holds every token: the split cuts it at row boundaries, one
// equal piece per thread, in order.
TEST_P(WorkSplit, OneHugeBlockIsCutIntoEqualConsecutivePieces) {
  const CountsOnly counts(3, 2, {0, 0, 0, 1000, 0, 0});
  const Plan p = plan(counts, 1 << 14, 4);
  ASSERT_EQ(p.num_threads(), 4);
  EXPECT_EQ(p.thread_begin(), (std::vector<std::int64_t>{0, 1, 2, 3, 4}));
  for (std::int64_t t = 0; t < 4; ++t) {
    const Chunk& chunk = p.chunks()[static_cast<std::size_t>(t)];
    EXPECT_EQ(chunk.num_rows, 250);
    EXPECT_EQ(chunk.dst_row, 250 * t);
    EXPECT_EQ(chunk.src_row, 250 * t);
  }
  EXPECT_EQ(split_difference(p, counts.gather_index()), "");
  EXPECT_EQ(rows_per_thread(plan(CountsOnly(1, 1, {1001}), 1 << 14, 4)),
            (std::vector<std::int64_t>{251, 250, 250, 250}));
}

// A block larger than a share is split; blocks smaller than one stay whole.
TEST_P(WorkSplit, ChunkBiggerThanAShareSplitsAtRowBoundaries) {
  const CountsOnly counts(2, 2, {10, 590, 0, 200});
  const Plan p = plan(counts, 1 << 14, 4);
  ASSERT_EQ(p.num_threads(), 4);
  EXPECT_EQ(rows_per_thread(p), (std::vector<std::int64_t>{200, 200, 200, 200}));
  EXPECT_EQ(split_difference(p, counts.gather_index()), "");
  std::int64_t max_rows = 0;
  for (const Chunk& chunk : p.chunks()) max_rows = std::max(max_rows, chunk.num_rows);
  EXPECT_LE(max_rows, 200);
}

TEST_P(WorkSplit, TinyInputsUseOneThread) {
  const Plan tiny = plan(kWorkedExample, 4, 8);
  EXPECT_EQ(tiny.num_threads(), 1);
  EXPECT_EQ(split_difference(tiny, kWorkedExample.gather_index()), "");
}

TEST_P(WorkSplit, NoTokensGiveOneThreadAndNoChunks) {
  const Plan empty = plan(CountsOnly(2, 2, {0, 0, 0, 0}), 64, 8);
  EXPECT_EQ(empty.num_threads(), 1);
  EXPECT_TRUE(empty.chunks().empty());
  EXPECT_EQ(empty.thread_begin(), (std::vector<std::int64_t>{0, 0}));
}

TEST_P(WorkSplit, NeverMoreThreadsThanRows) {
  const Plan two_rows = plan(CountsOnly(1, 2, {1, 1}), std::int64_t{1} << 24, 8);
  EXPECT_EQ(two_rows.num_threads(), 2);
  EXPECT_EQ(rows_per_thread(two_rows), (std::vector<std::int64_t>{1, 1}));
}

TEST_P(WorkSplit, NegativeThreadsAreRefused) {
  EXPECT_EQ(refusal_difference([&] { plan(kWorkedExample, 4, -1); }, ErrorCode::kInvalidArgument,
                               {"num_threads: must be >= 0 (0 = all hardware threads), got -1"}),
            "");
}

TEST_P(WorkSplit, ZeroThreadsMeansEveryHardwareThread) {
  const CountsOnly counts(2, 2, {4096, 0, 4096, 8192});
  EXPECT_EQ(plan(counts, 1 << 14, 0).num_threads(), hardware_threads());
}

INSTANTIATE_TEST_SUITE_P(BothDirections, WorkSplit,
                         ::testing::Values(Direction::kForward, Direction::kInverse),
                         [](const ::testing::TestParamInfo<Direction>& info) {
                           return direction_name(info.param);
                         });

}  // namespace
}  // namespace moe_reroute::test
