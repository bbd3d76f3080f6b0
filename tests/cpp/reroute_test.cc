// The forward and the inverse against the naive reference, byte for byte,
// over random cases of every dtype and layout, the edge shapes and 1 to 8
// threads.

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <tuple>

#include "reference.h"
#include "sweep.h"

namespace moe_reroute::test {
namespace {

using ::testing::Combine;
using ::testing::Range;
using ::testing::Values;
using ::testing::ValuesIn;

std::uint64_t seed_of(DType dtype, std::size_t variant) {
  return (static_cast<std::uint64_t>(dtype) + 1) * 1000 + variant * 37;
}

using SweepParam = std::tuple<Direction, DType, ScaleForm>;

class RandomCases : public ::testing::TestWithParam<SweepParam> {};

// Forward: every count dtype x weight layout x idx_type x expert_token_num_type;
// inverse: every count dtype x weight layout.
TEST_P(RandomCases, MatchNaiveReference) {
  const auto [direction, token_dtype, scales] = GetParam();
  const std::vector<Case> cases =
      sweep_cases(token_dtype, scales, direction == Direction::kForward,
                  seed_of(token_dtype, static_cast<std::size_t>(scales)));
  for (std::size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(cases[i].to_string());
    EXPECT_EQ(difference(direction, cases[i], 1 + static_cast<int>(i % 4)), "");
  }
}

std::string sweep_name(const ::testing::TestParamInfo<SweepParam>& info) {
  const auto [direction, dtype, scales] = info.param;
  return direction_name(direction) + "_" + std::string(dtype_name(dtype)) + "_scales_" +
         scale_form_name(scales);
}

// The forward over every pairing of rule 7's table it accepts.
std::vector<SweepParam> forward_params() {
  std::vector<SweepParam> params;
  for (const auto& [dtype, form] : scale_pairings(/*accepted=*/true)) {
    params.emplace_back(Direction::kForward, dtype, form);
  }
  return params;
}

INSTANTIATE_TEST_SUITE_P(EveryTokenDType, RandomCases, ValuesIn(forward_params()), sweep_name);
INSTANTIATE_TEST_SUITE_P(EveryDType, RandomCases,
                         Combine(Values(Direction::kInverse), ValuesIn(all_dtypes()),
                                 ValuesIn(kScaleForms)),
                         sweep_name);

using EdgeParam = std::tuple<Direction, int, DType>;

class EdgeShapes : public ::testing::TestWithParam<EdgeParam> {};

TEST_P(EdgeShapes, MatchNaiveReference) {
  const auto [direction, edge_index, token_dtype] = GetParam();
  const Case base = edge_case(edges()[static_cast<std::size_t>(edge_index)], token_dtype,
                              seed_of(token_dtype, static_cast<std::size_t>(edge_index)));
  const std::vector<Attributes> attributes =
      direction == Direction::kForward
          ? std::vector<Attributes>{{kExpertTokenNumCount, kIdxGather},
                                    {kExpertTokenNumCumsum, kIdxScatter}}
          : std::vector<Attributes>{{}};
  for (const Attributes& attribute : attributes) {
    Case c = base;
    c.config.attributes = attribute;
    SCOPED_TRACE(c.to_string());
    EXPECT_EQ(difference(direction, c, 2), "");
  }
}

std::string edge_name(const ::testing::TestParamInfo<EdgeParam>& info) {
  const auto [direction, edge_index, dtype] = info.param;
  return direction_name(direction) + "_" + edges()[static_cast<std::size_t>(edge_index)].name +
         "_" + std::string(dtype_name(dtype));
}

const int kNumEdges = static_cast<int>(edges().size());

INSTANTIATE_TEST_SUITE_P(EveryTokenDType, EdgeShapes,
                         Combine(Values(Direction::kForward), Range(0, kNumEdges),
                                 ValuesIn(token_dtypes())),
                         edge_name);
INSTANTIATE_TEST_SUITE_P(EveryDType, EdgeShapes,
                         Combine(Values(Direction::kInverse), Range(0, kNumEdges),
                                 ValuesIn(all_dtypes())),
                         edge_name);

// 4 MiB of skewed rows (2048 bf16 rows of H = 1024 over 4 x 8 blocks): enough
// bytes that every requested thread, up to 8, gets a share.
Case threaded_case(std::uint64_t seed) {
  Case c;
  c.config.num_tokens = 2048;
  c.config.hidden = 1024;
  c.config.token_dtype = DType::kBFloat16;
  c.config.num_ranks = 4;
  c.config.num_experts = 8;
  c.config.skew = 1.5;
  c.config.seed = seed;
  return c;
}

class ThreadCounts : public ::testing::TestWithParam<Direction> {};

TEST_P(ThreadCounts, SameBytesForOneToEightThreads) {
  Case c = threaded_case(7);
  c.config.attributes.idx_type = kIdxScatter;
  set_scale_form(c.config, ScaleForm::kFloat32AS, 2);
  testing::Workload workload(c.config);
  for (int num_threads = 1; num_threads <= 8; ++num_threads) {
    SCOPED_TRACE("num_threads=" + std::to_string(num_threads));
    const Plan plan = GetParam() == Direction::kForward
                          ? plan_reroute(workload.inputs(), c.config.attributes, num_threads)
                          : plan_inverse(inverse_call(workload, c.weight).inputs, {}, num_threads);
    EXPECT_EQ(plan.num_threads(), num_threads);
    EXPECT_EQ(difference(GetParam(), c, num_threads), "");
  }
}

INSTANTIATE_TEST_SUITE_P(BothDirections, ThreadCounts,
                         Values(Direction::kForward, Direction::kInverse),
                         [](const ::testing::TestParamInfo<Direction>& info) {
                           return direction_name(info.param);
                         });

// Without scales each thread writes the [R] float32 zeros of its rows at
// once, pad rows included: 1-8 threads over expert segments padded to 16
// rows, with spare rows, whose tail the zeros must leave unwritten.
TEST(ThreadSlices, ZeroScalesForOneToEightThreads) {
  Case c = threaded_case(11);
  c.config.num_valid_tokens = 2000;
  c.config.attributes.expert_alignment = 16;
  c.config.attributes.allow_spare_rows = true;
  set_scale_form(c.config, ScaleForm::kNone, 0);
  const Attributes& attributes = c.config.attributes;
  for (int num_threads = 1; num_threads <= 8; ++num_threads) {
    SCOPED_TRACE("num_threads=" + std::to_string(num_threads));
    testing::Workload workload(c.config);
    const Plan plan = plan_reroute(workload.inputs(), attributes, num_threads);
    EXPECT_EQ(plan.num_threads(), num_threads);
    run_reroute(plan, workload.inputs(), workload.outputs());
    EXPECT_EQ(workload.compare(testing::reference_reroute(workload.reference_inputs(),
                                                          attributes.expert_token_num_type,
                                                          attributes.idx_type)),
              "");
  }
}

class RoundTrip : public ::testing::TestWithParam<DType> {};

TEST_P(RoundTrip, InverseOfForwardRestoresEveryInputByte) {
  Case c = random_case(GetParam(), ScaleForm::kFloat32AS, seed_of(GetParam(), 99));
  c.config.num_tokens = 257;
  c.config.attributes.idx_type = kIdxScatter;
  testing::Workload forward(c.config);
  const ForwardCall call = forward_call(forward, c.weight);
  moe_re_routing(call.inputs, call.outputs, c.config.attributes, 3);

  testing::Workload back(c.config);
  std::memcpy(back.tokens.data(), forward.permute_tokens.data(), back.tokens.size());
  std::memcpy(back.scales.data(), forward.permute_scales.data(), back.scales.size());
  std::memcpy(back.weight.data(), forward.permute_weight.data(), back.weight.size());
  const InverseCall inverse = inverse_call(back, c.weight);
  moe_re_routing_inverse(inverse.inputs, inverse.outputs, {}, 3);
  EXPECT_EQ(testing::first_difference("restored_tokens", back.permute_tokens,
                                      forward.tokens.data(), forward.tokens.size()),
            "");
  EXPECT_EQ(testing::first_difference("restored_per_token_scales", back.permute_scales,
                                      forward.scales.data(), forward.scales.size()),
            "");
  EXPECT_EQ(testing::first_difference("restored_topk_weight", back.permute_weight,
                                      forward.weight.data(), forward.weight.size()),
            "");
}

INSTANTIATE_TEST_SUITE_P(EveryTokenDType, RoundTrip, ValuesIn(token_dtypes()),
                         DTypeParamName());

// The one-shot calls plan into one plan kept per thread: each call after a
// bigger one (4096 blocks, scales, weights, 4 threads) or a differently
// shaped one must carry nothing over from it, in either direction.
TEST(OneShotCalls, CarryNothingFromTheCallBefore) {
  const std::vector<Edge> shapes = edges();
  const auto edge = [&](const std::string& name) {
    for (const Edge& e : shapes) {
      if (e.name == name) return e;
    }
    ADD_FAILURE() << "no edge shape " << name;
    return shapes.front();
  };
  Case bare = random_case(DType::kBFloat16, ScaleForm::kNone, 5);
  bare.config.has_weight = false;
  bare.weight = WeightForm::kNone;
  const std::vector<std::tuple<Direction, Case, int>> calls = {
      {Direction::kForward, edge_case(edge("sparse_64x64_counts"), DType::kInt8, 1), 4},
      {Direction::kForward, bare, 1},
      {Direction::kInverse, edge_case(edge("skewed_counts"), DType::kFloat32, 2), 2},
      {Direction::kForward, edge_case(edge("one_rank_one_expert"), DType::kFloat16, 3), 2},
      {Direction::kInverse, bare, 1},
      {Direction::kForward, random_case(DType::kFloat8E4M3FN, ScaleForm::kE8m0A, 6), 3}};
  for (int round = 0; round < 2; ++round) {
    for (const auto& [direction, c, threads] : calls) {
      SCOPED_TRACE(direction_name(direction) + " " + c.to_string());
      EXPECT_EQ(difference(direction, c, threads), "");
    }
  }
}

// GNU OpenMP hangs in a child forked after a parallel region; the operator
// runs a forked child's calls on its one thread. The child gets 30 s (SIGALRM)
// and reports by its exit status.
TEST(ForkedChild, RunsOnItsOneThreadInsteadOfHanging) {
  Case c = random_case(DType::kBFloat16, ScaleForm::kFloat32A, 11);
  c.config.num_tokens = 2048;
  c.config.hidden = 1024;
  ASSERT_EQ(difference(Direction::kForward, c, 4), "");  // the parent's team exists now
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    alarm(30);
    const bool same = difference(Direction::kForward, c, 4).empty() &&
                      difference(Direction::kInverse, c, 4).empty();
    _exit(same ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "the child was killed by signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the child's bytes differ from the reference";
  EXPECT_EQ(difference(Direction::kForward, c, 4), "");  // the parent still runs its team
}

}  // namespace
}  // namespace moe_reroute::test
