// Sizes: the index limit is refused from the shape alone (no data), and a
// call moving more than 2^32 bytes of tokens, so any 32-bit offset or size
// would show. The large one (label `large`) needs about 10 GB and is skipped
// with a message when /proc/meminfo has less than 12 GiB available.

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <random>
#include <sstream>

#include "reference.h"
#include "workload.h"

namespace moe_reroute {
namespace {

constexpr std::int64_t kIndexLimit = std::numeric_limits<std::int32_t>::max();

TEST(IndexLimit, ForwardRefusesPastInt32FromTheShapeAlone) {
  const std::int64_t count = kIndexLimit + 1;
  RerouteInputs inputs;
  inputs.tokens = TensorView(nullptr, DType::kInt8, {kIndexLimit + 1, 16});
  inputs.expert_token_num_per_rank = TensorView(&count, DType::kInt64, {1, 1});
  for (const auto& attempt : {+[](const RerouteInputs& in) { infer_reroute(in); },
                              +[](const RerouteInputs& in) { plan_reroute(in); }}) {
    try {
      attempt(inputs);
      ADD_FAILURE() << "A = 2^31 was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kOutOfRange);
      EXPECT_STREQ(e.what(), "tokens: A = 2147483648 exceeds the int32 index limit 2147483647");
    }
  }
}

TEST(IndexLimit, ForwardAcceptsTheLimitItself) {
  RerouteInputs inputs;
  inputs.tokens = TensorView(nullptr, DType::kInt8, {kIndexLimit, 16});
  inputs.expert_token_num_per_rank = TensorView(nullptr, DType::kInt32, {4, 4});
  const RerouteOutputSpecs specs = infer_reroute(inputs);
  EXPECT_EQ(specs.permute_token_idx, (TensorSpec{DType::kInt32, {kIndexLimit}}));
  EXPECT_EQ(specs.permute_tokens.nbytes(), kIndexLimit * 16);
}

TEST(IndexLimit, InverseHasNoIndexAndTakesMoreRows) {
  InverseInputs inputs;
  inputs.tokens = TensorView(nullptr, DType::kFloat32, {kIndexLimit + 5, 8});
  inputs.expert_token_num_per_rank = TensorView(nullptr, DType::kInt64, {2, 2});
  EXPECT_EQ(infer_inverse(inputs).restored_tokens.shape, (Shape{kIndexLimit + 5, 8}));
}

// Bytes of MemAvailable in /proc/meminfo; 0 when it cannot be read.
std::int64_t available_memory() {
  std::ifstream meminfo("/proc/meminfo");
  std::string line;
  while (std::getline(meminfo, line)) {
    std::istringstream fields(line);
    std::string key;
    std::int64_t kib = 0;
    if (fields >> key >> kib && key == "MemAvailable:") return kib * 1024;
  }
  return 0;
}

constexpr std::int64_t kNumTokens = 300000;
constexpr std::int64_t kHidden = 16384;  // int8: 16 KiB a row, 4.9 GB in all
constexpr std::uint64_t kLastMark = 0x5DEECE66DULL;

// Row `row` of the pattern: its id in the first 8 bytes, id ^ kLastMark in the
// last 8, a byte of the id everywhere between.
void fill_row(std::byte* dst, std::uint64_t row) {
  std::memset(dst, static_cast<int>((row * 131 + 7) & 0xFF), kHidden);
  const std::uint64_t last = row ^ kLastMark;
  std::memcpy(dst, &row, 8);
  std::memcpy(dst + kHidden - 8, &last, 8);
}

// "" when every row of `rows` starts and ends with the marks of source row
// `source[i]` and the sampled rows equal the whole pattern row.
std::string check_rows(const std::byte* rows, const std::vector<std::int64_t>& source,
                       const std::vector<std::int64_t>& sampled) {
  for (std::size_t i = 0; i < source.size(); ++i) {
    const std::byte* row = rows + static_cast<std::int64_t>(i) * kHidden;
    std::uint64_t first = 0;
    std::uint64_t last = 0;
    std::memcpy(&first, row, 8);
    std::memcpy(&last, row + kHidden - 8, 8);
    const auto want = static_cast<std::uint64_t>(source[i]);
    if (first != want || last != (want ^ kLastMark)) {
      return "row " + std::to_string(i) + " holds source row " + std::to_string(first) +
             ", expected " + std::to_string(want);
    }
  }
  std::vector<std::byte> expected(kHidden);
  for (std::int64_t i : sampled) {
    fill_row(expected.data(), static_cast<std::uint64_t>(source[static_cast<std::size_t>(i)]));
    if (std::memcmp(rows + i * kHidden, expected.data(), kHidden) != 0) {
      return "row " + std::to_string(i) + " differs inside";
    }
  }
  return "";
}

std::unique_ptr<std::byte[]> allocate(std::int64_t bytes) {
  return std::unique_ptr<std::byte[]>(new std::byte[static_cast<std::size_t>(bytes)]);
}

TEST(Large, TokensPast4GiBForwardAndBack) {
  const std::int64_t token_bytes = kNumTokens * kHidden;
  const std::int64_t needed = std::int64_t{12} << 30;
  const std::int64_t available = available_memory();
  if (available < needed) {
    GTEST_SKIP() << "needs 12 GiB of available memory, /proc/meminfo has " << available / (1 << 20)
                 << " MiB";
  }
  ASSERT_GT(token_bytes, std::int64_t{1} << 32);

  // Two ranks, four experts, skewed so one block spans more than 2^32 bytes.
  const std::vector<std::int64_t> counts = {1000, 0, 3000, 6000, 275000, 7000, 8000, 0};
  auto tokens = allocate(token_bytes);
  auto permuted = allocate(token_bytes);
  for (std::int64_t r = 0; r < kNumTokens; ++r) fill_row(tokens.get() + r * kHidden, r);
  std::memset(permuted.get(), 0xA5, static_cast<std::size_t>(token_bytes));

  std::vector<std::byte> scales(kNumTokens * 4), weight(kNumTokens * 4);
  testing::fill_random(scales.data(), scales.size(), 1);
  testing::fill_random(weight.data(), weight.size(), 2);
  std::vector<std::byte> permuted_scales(scales.size(), std::byte{0xA5});
  std::vector<std::byte> permuted_weight(weight.size(), std::byte{0xA5});
  std::vector<std::int32_t> token_idx(kNumTokens, -1);
  std::vector<std::int64_t> expert_token_num(4, -1);

  const RerouteInputs inputs{TensorView(tokens.get(), DType::kInt8, {kNumTokens, kHidden}),
                             TensorView(counts.data(), DType::kInt64, {2, 4}),
                             TensorView(scales.data(), DType::kFloat32, {kNumTokens}),
                             TensorView(weight.data(), DType::kFloat32, {kNumTokens, 1})};
  const RerouteOutputs outputs{
      TensorView(permuted.get(), DType::kInt8, {kNumTokens, kHidden}),
      TensorView(permuted_scales.data(), DType::kFloat32, {kNumTokens}),
      TensorView(token_idx.data(), DType::kInt32, {kNumTokens}),
      TensorView(expert_token_num.data(), DType::kInt64, {4}),
      TensorView(permuted_weight.data(), DType::kFloat32, {kNumTokens, 1})};
  moe_re_routing(inputs, outputs, {kExpertTokenNumCount, kIdxGather});

  // The mapping from the naive reference, on 8-byte rows holding the row id.
  std::vector<std::int64_t> row_ids(kNumTokens);
  for (std::int64_t r = 0; r < kNumTokens; ++r) row_ids[static_cast<std::size_t>(r)] = r;
  testing::ReferenceInputs small;
  small.num_ranks = 2;
  small.num_experts = 4;
  small.counts = counts;
  small.tokens = reinterpret_cast<const std::byte*>(row_ids.data());
  small.token_row_bytes = 8;
  small.scales = scales.data();
  small.scale_row_bytes = 4;
  small.weight = weight.data();
  const testing::ReferenceOutputs expected = testing::reference_reroute(small, 1, 0);
  std::vector<std::int64_t> source(kNumTokens);
  std::memcpy(source.data(), expected.tokens.data(), expected.tokens.size());

  // Sampled full rows: both ends, every chunk edge of the plan, and random ones.
  std::vector<std::int64_t> sampled = {0, kNumTokens - 1};
  const Plan plan = plan_reroute(inputs);
  for (const Chunk& chunk : plan.chunks()) {
    sampled.push_back(chunk.dst_row);
    sampled.push_back(chunk.dst_row + chunk.num_rows - 1);
  }
  std::mt19937_64 rng(3);
  for (int i = 0; i < 256; ++i) {
    sampled.push_back(std::uniform_int_distribution<std::int64_t>(0, kNumTokens - 1)(rng));
  }

  EXPECT_EQ(check_rows(permuted.get(), source, sampled), "");
  EXPECT_EQ(token_idx, expected.token_idx);
  EXPECT_EQ(expert_token_num, expected.expert_token_num);
  EXPECT_EQ(testing::first_difference("permute_per_token_scales", permuted_scales,
                                      expected.scales.data(), expected.scales.size()),
            "");
  EXPECT_EQ(testing::first_difference("permute_topk_weight", permuted_weight,
                                      expected.weight.data(), expected.weight.size()),
            "");

  // And back into the (re-poisoned) token buffer: every row where it began.
  std::memset(tokens.get(), 0xA5, static_cast<std::size_t>(token_bytes));
  moe_re_routing_inverse(
      {outputs.permute_tokens, inputs.expert_token_num_per_rank, std::nullopt, std::nullopt},
      {inputs.tokens, std::nullopt, std::nullopt});
  EXPECT_EQ(check_rows(tokens.get(), row_ids, sampled), "");
}

}  // namespace
}  // namespace moe_reroute
