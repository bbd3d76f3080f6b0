// Findings in the CLI's .npy reader, kept as plain tests.

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <limits>

#include "moe_reroute/error.h"
#include "npy.h"

namespace moe_reroute {
namespace {

// fuzz_npy corpus fp4_last_dim_overflow: a uint8 file read as float4_e2m1
// doubles its last dim (two elements a byte); with no rows the file is empty
// however large that dim, and doubling 2^63 - 1 overflowed int64 (UBSan).
TEST(FuzzFinding, Fp4LastDimThatOverflowsWhenDoubled) {
  const std::filesystem::path path =
      std::filesystem::temp_directory_path() /
      ("moe_reroute_fp4_overflow_" +
       std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + ".npy");
  const std::int64_t shape[] = {0, std::numeric_limits<std::int64_t>::max()};
  const std::string header = tools::npy_header("|u1", shape);
  std::ofstream(path, std::ios::binary)
      .write(header.data(), static_cast<std::streamsize>(header.size()));
  try {
    tools::load_tensor(path, "tokens", "float4_e2m1", "--tokens-dtype");
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_EQ(std::string(e.what()), "tokens: " + path.string() +
                                         ": the last dim counts two FP4 elements a byte and then "
                                         "overflows int64");
  }
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace moe_reroute
