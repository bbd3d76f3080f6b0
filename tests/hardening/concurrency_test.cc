// Concurrent calls: many threads running the operator at once on their own
// buffers, and one plan run from several threads at once; every result must
// equal the naive reference byte for byte (the inverse: the original inputs).

#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "workload.h"

namespace moe_reroute {
namespace {

using testing::Workload;
using testing::WorkloadConfig;

constexpr int kNumCallers = 8;
constexpr int kRepeats = 4;

// A different mid-sized case per caller: dtypes, scales, attributes and skew vary.
WorkloadConfig caller_config(int caller) {
  static constexpr DType kTokenDTypes[] = {DType::kInt8, DType::kBFloat16, DType::kFloat4E2M1,
                                           DType::kFloat32};
  WorkloadConfig config;
  config.num_tokens = 3000 + 517 * caller;
  config.hidden = 256 + 64 * caller;
  config.token_dtype = kTokenDTypes[caller % 4];
  config.num_ranks = 1 + caller % 5;
  config.num_experts = 2 + caller % 7;
  config.count_dtype = caller % 2 ? DType::kInt64 : DType::kInt32;
  config.has_scales = caller % 3 != 0;
  config.scale_tail = caller % 3 == 2 ? std::vector<std::int64_t>{4} : std::vector<std::int64_t>{};
  config.has_weight = caller % 2 == 0;
  config.skew = 0.5 * (caller % 3);
  config.zero_fraction = caller % 4 == 1 ? 0.3 : 0.0;
  config.seed = 100 + static_cast<std::uint64_t>(caller);
  config.attributes = {caller % 2, (caller / 2) % 2};
  return config;
}

testing::ReferenceOutputs reference_of(const Workload& w) {
  return testing::reference_reroute(w.reference_inputs(),
                                    w.config().attributes.expert_token_num_type,
                                    w.config().attributes.idx_type);
}

TEST(Concurrency, ManyCallersOnSeparateBuffers) {
  std::vector<Workload> workloads;
  std::vector<testing::ReferenceOutputs> expected;
  for (int caller = 0; caller < kNumCallers; ++caller) {
    workloads.emplace_back(caller_config(caller));
    expected.push_back(reference_of(workloads.back()));
  }
  std::vector<std::vector<std::string>> differences(kNumCallers);
  std::vector<std::thread> callers;
  for (int caller = 0; caller < kNumCallers; ++caller) {
    callers.emplace_back([&, caller] {
      const auto c = static_cast<std::size_t>(caller);
      Workload& w = workloads[c];
      for (int repeat = 0; repeat < kRepeats; ++repeat) {
        w.poison_outputs();
        // 0 (all hardware threads) and 1 to 3: OpenMP teams inside every caller.
        moe_re_routing(w.inputs(), w.outputs(), w.config().attributes, repeat);
        differences[c].push_back(w.compare(expected[c]));
      }
    });
  }
  for (std::thread& t : callers) t.join();
  for (int caller = 0; caller < kNumCallers; ++caller) {
    for (int repeat = 0; repeat < kRepeats; ++repeat) {
      EXPECT_EQ(differences[static_cast<std::size_t>(caller)][static_cast<std::size_t>(repeat)], "")
          << "caller " << caller << " repeat " << repeat;
    }
  }
}

TEST(Concurrency, OnePlanFromManyThreads) {
  WorkloadConfig config = caller_config(2);  // has scales [A, 4] and a weight
  config.num_tokens = 20000;
  const Workload shared(config);
  const testing::ReferenceOutputs expected = reference_of(shared);

  const Plan plan = plan_reroute(shared.inputs(), config.attributes, 2);
  const Plan inverse_plan =
      plan_inverse({shared.inputs().tokens, shared.inputs().expert_token_num_per_rank,
                    shared.inputs().per_token_scales, shared.inputs().expert_topk_weight},
                   {}, 2);
  std::vector<Workload> own(kNumCallers, shared);
  std::vector<std::string> failures(kNumCallers);
  std::vector<std::thread> callers;
  for (int caller = 0; caller < kNumCallers; ++caller) {
    callers.emplace_back([&, caller] {
      Workload& w = own[static_cast<std::size_t>(caller)];
      for (int repeat = 0; repeat < kRepeats; ++repeat) {
        w.poison_outputs();
        // Inputs from the shared workload, outputs of this caller.
        run_reroute(plan, shared.inputs(), w.outputs());
        const std::string forward = w.compare(expected);
        if (!forward.empty()) failures[static_cast<std::size_t>(caller)] = forward;
        // And back: the forward's outputs through the shared inverse plan.
        std::vector<std::byte> restored(shared.tokens.size(), std::byte{0x5A});
        RerouteOutputs out = w.outputs();
        InverseInputs back{out.permute_tokens, shared.inputs().expert_token_num_per_rank,
                           std::nullopt, std::nullopt};
        if (shared.config().has_scales) back.per_token_scales = out.permute_per_token_scales;
        if (shared.config().has_weight) back.expert_topk_weight = out.permute_topk_weight;
        InverseOutputs restore{TensorView(restored.data(), shared.inputs().tokens.dtype(),
                                          shared.inputs().tokens.shape()),
                               std::nullopt, std::nullopt};
        std::vector<std::byte> restored_scales(shared.scales.size());
        std::vector<std::byte> restored_weight(shared.weight.size());
        if (back.per_token_scales) {
          restore.restored_per_token_scales =
              TensorView(restored_scales.data(), back.per_token_scales->dtype(),
                         back.per_token_scales->shape());
        }
        if (back.expert_topk_weight) {
          restore.restored_topk_weight =
              TensorView(restored_weight.data(), DType::kFloat32, back.expert_topk_weight->shape());
        }
        run_inverse(inverse_plan, back, restore);
        if (restored != shared.tokens || restored_scales != shared.scales ||
            restored_weight != shared.weight) {
          failures[static_cast<std::size_t>(caller)] = "inverse";
        }
      }
    });
  }
  for (std::thread& t : callers) t.join();
  for (int caller = 0; caller < kNumCallers; ++caller) {
    EXPECT_EQ(failures[static_cast<std::size_t>(caller)], "") << "caller " << caller;
  }
}

}  // namespace
}  // namespace moe_reroute
