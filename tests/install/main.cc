// Runs docs/spec.md section 3's worked example through the installed library and
// checks every output; exits non-zero on any difference.

#include <cstdint>
#include <cstdio>
#include <vector>

#include "moe_reroute/moe_reroute.h"

namespace mr = moe_reroute;

template <typename T>
bool expect_equal(const char* name, const std::vector<T>& got, const std::vector<T>& expected) {
  if (got == expected) return true;
  std::fprintf(stderr, "%s differs from the worked example\n", name);
  return false;
}

int main() {
  const std::int64_t rows = 6;
  const std::vector<std::int32_t> counts = {1, 0, 2, 2, 1, 0};
  std::vector<std::uint8_t> tokens;
  for (std::uint8_t i = 0; i < rows; ++i) tokens.insert(tokens.end(), {i, std::uint8_t(100 + i)});
  std::vector<std::uint8_t> permute_tokens(tokens.size(), 0xA5);
  std::vector<float> permute_scales(rows, -1.0f), permute_weight;
  std::vector<std::int32_t> token_idx(rows, -1), expert_token_num(3, -1);

  const mr::RerouteInputs inputs = {mr::TensorView(tokens.data(), mr::DType::kUInt8, {rows, 2}),
                                    mr::TensorView(counts.data(), mr::DType::kInt32, {2, 3}),
                                    std::nullopt, std::nullopt};
  const mr::Attributes scatter_cumsum = {mr::kExpertTokenNumCumsum, mr::kIdxScatter};
  const mr::Plan plan = mr::plan_reroute(inputs, scatter_cumsum);
  mr::run_reroute(plan, inputs,
                  {mr::TensorView(permute_tokens.data(), mr::DType::kUInt8, {rows, 2}),
                   mr::TensorView(permute_scales.data(), mr::DType::kFloat32, {rows}),
                   mr::TensorView(token_idx.data(), mr::DType::kInt32, {rows}),
                   mr::TensorView(expert_token_num.data(), mr::DType::kInt32, {3}),
                   mr::TensorView(nullptr, mr::DType::kFloat32, {0})});

  bool ok = expect_equal("permute_tokens", permute_tokens,
                         {0, 100, 3, 103, 4, 104, 5, 105, 1, 101, 2, 102});
  ok &= expect_equal("permute_per_token_scales", permute_scales, std::vector<float>(rows, 0.0f));
  ok &= expect_equal("permute_token_idx", token_idx, {0, 4, 5, 1, 2, 3});
  ok &= expect_equal("expert_token_num", expert_token_num, {3, 4, 6});

  // Errors cross the library boundary as moe_reroute::Error with their code.
  try {
    mr::infer_reroute({mr::TensorView(nullptr, mr::DType::kUInt8, {rows}), inputs.expert_token_num_per_rank,
                       std::nullopt, std::nullopt});
    std::fprintf(stderr, "1-D tokens were accepted\n");
    ok = false;
  } catch (const mr::Error& error) {
    ok &= error.code() == mr::ErrorCode::kInvalidArgument;
  }
  if (!ok) return 1;
  std::printf("moe_reroute %s: worked example ok\n", MOE_REROUTE_VERSION_STRING);
  return 0;
}
