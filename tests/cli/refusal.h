#pragma once

// What every refusal of bad input by moe-reroute looks like.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "program.h"

namespace moe_reroute::tools {

/// Exit status 2, nothing on stdout, and one `error:` line holding `message`.
inline void expect_bad_input(const Result& result, const std::string& message) {
  EXPECT_EQ(result.status, 2) << result.err;
  EXPECT_THAT(result.err, ::testing::StartsWith("error: "));
  EXPECT_THAT(result.err, ::testing::HasSubstr(message));
  EXPECT_EQ(std::count(result.err.begin(), result.err.end(), '\n'), 1) << result.err;
  EXPECT_EQ(result.out, "");
}

}  // namespace moe_reroute::tools
