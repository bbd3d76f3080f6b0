// The moe-reroute-bench binary end to end: a small workload verified, timed
// and ended with its JSON line; bad flags refused with exit status 2 and one
// `error:` line naming the flag, as moe-reroute refuses them.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "program.h"

namespace moe_reroute::tools {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

Result run_bench(const std::vector<std::string>& args) {
  return run_program(MOE_REROUTE_BENCH, args);
}

TEST(Bench, VerifiesAndEndsWithJson) {
  const Result result = run_bench({"--tokens", "500", "--hidden", "300", "--ranks", "4",
                                   "--experts", "3", "--repeat", "2", "--skew", "1", "--json"});
  ASSERT_EQ(result.status, 0) << result.err;
  EXPECT_THAT(result.out, HasSubstr("\nverified\n"));
  EXPECT_THAT(result.out, HasSubstr("plain copy"));
  EXPECT_THAT(result.out, HasSubstr("per-row gather"));
  EXPECT_THAT(result.out, HasSubstr("when streaming stores pay"));
  EXPECT_THAT(result.out, HasSubstr("A/4 valid rows (allow_spare_rows)"));
  EXPECT_THAT(result.out, HasSubstr("expert_alignment 128, same counts"));
  EXPECT_THAT(result.out, HasSubstr(" hardware threads of "));  // and the processor's name
  EXPECT_THAT(result.err, HasSubstr("verifying"));
  const std::string trimmed = result.out.substr(0, result.out.size() - 1);
  const std::string last = trimmed.substr(trimmed.rfind('\n') + 1);
  EXPECT_THAT(last, StartsWith("{\"verified\": true, \"bytes\": "));
  for (const char* key :
       {"\"op_s\": ", "\"copy_s\": ", "\"ratio\": ", "\"gather_s\": ", "\"streaming_stores\": ",
        "\"sweep\": [{\"A\": 7, ", "\"spare_rows_quarter_ratio\": ", "\"alignment_128_ratio\": ",
        "\"pad_share\": ", "\"pad_share_written\": ", "\"config\": {"}) {
    EXPECT_THAT(last, HasSubstr(key));
  }
  EXPECT_EQ(last.back(), '}');
}

// The workload flags pass the core's inference before anything is allocated by them.
TEST(Bench, RefusesBadFlags) {
  for (const auto& [args, message] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--repeat", "0"}, "--repeat: Value 0 not in range 1 to 1048576"},
           {{"--tokens", "4", "--expert-alignment", "0"}, "expert_alignment: must be >= 1, got 0"},
           {{"--threads", "-1"}, "--threads: must be >= 0 (0 = all hardware threads), got -1"},
           {{"--experts", "18446744073709551616"},
            "--experts: 18446744073709551616 does not fit in int64"}}) {
    const Result refused = run_bench(args);
    EXPECT_EQ(refused.status, 2) << message;
    EXPECT_EQ(refused.err, "error: " + message + "\n");
    EXPECT_EQ(refused.out, "");
  }
}

}  // namespace
}  // namespace moe_reroute::tools
