// Findings of the fuzzers, kept as plain tests.

#include <gtest/gtest.h>

#include "moe_reroute/reroute.h"

namespace moe_reroute {
namespace {

constexpr std::int64_t kHugeRow = std::int64_t{1} << 62;

// fuzz_reroute: with A = 0 a tokens shape is 0 bytes however long its rows,
// so [0, 2^62] float32 passed the size check and planning then overflowed
// int64 computing the row bytes (signed overflow, caught by UBSan).
TEST(FuzzFinding, ZeroRowsDoNotHideAnOverlongRow) {
  const std::int64_t zero_count = 0;
  const TensorView counts(&zero_count, DType::kInt64, {1, 1});
  RerouteInputs tokens_row{TensorView(nullptr, DType::kFloat32, {0, kHugeRow}), counts, {}, {}};
  RerouteInputs scales_row{TensorView(nullptr, DType::kInt8, {0, 8}),
                           counts,
                           TensorView(nullptr, DType::kFloat32, {0, kHugeRow}),
                           {}};
  InverseInputs inverse_row{TensorView(nullptr, DType::kInt64, {0, kHugeRow}), counts, {}, {}};
  const auto refused = [](const auto& plan, const std::string& message) {
    try {
      plan();
      ADD_FAILURE() << "accepted; expected: " << message;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kOutOfRange);
      EXPECT_EQ(e.what(), message);
    }
  };
  refused([&] { plan_reroute(tokens_row); },
          "tokens: [0, 4611686018427387904] overflows int64 bytes");
  refused([&] { plan_reroute(scales_row); },
          "per_token_scales: [0, 4611686018427387904] overflows int64 bytes");
  refused([&] { plan_inverse(inverse_row); },
          "tokens: [0, 4611686018427387904] overflows int64 bytes");
  // A long row that does fit is still fine with no rows.
  RerouteInputs long_row{
      TensorView(nullptr, DType::kFloat32, {0, std::int64_t{1} << 40}), counts, {}, {}};
  EXPECT_EQ(plan_reroute(long_row).token_row_bytes(), std::int64_t{1} << 42);
}

}  // namespace
}  // namespace moe_reroute
