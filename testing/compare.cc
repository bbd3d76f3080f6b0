// The byte comparisons of outputs against the naive reference, and the
// Workload's side of them: kept out of workload.cc, which the CLI links.

#include <cstring>
#include <string>
#include <vector>

#include "reference.h"
#include "workload.h"

namespace moe_reroute::testing {

std::string first_difference(const char* name, const std::vector<std::byte>& got,
                             const std::byte* expected, std::size_t expected_bytes) {
  if (got.size() != expected_bytes) {
    return std::string(name) + ": " + std::to_string(got.size()) + " bytes, expected " +
           std::to_string(expected_bytes);
  }
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (got[i] != expected[i]) {
      return std::string(name) + ": byte " + std::to_string(i) + " is " +
             std::to_string(std::to_integer<int>(got[i])) + ", expected " +
             std::to_string(std::to_integer<int>(expected[i]));
    }
  }
  return "";
}

std::string rows_difference(const char* name, const std::byte* got, std::size_t got_bytes,
                            const std::vector<std::byte>& expected, std::int64_t specified_rows,
                            std::int64_t row_bytes) {
  if (got_bytes != expected.size()) {
    return std::string(name) + ": " + std::to_string(got_bytes) + " bytes, expected " +
           std::to_string(expected.size());
  }
  const std::size_t specified = static_cast<std::size_t>(specified_rows * row_bytes);
  for (std::size_t i = 0; i < got_bytes; ++i) {
    const std::byte want = i < specified ? expected[i] : kPoison;
    if (got[i] != want) {
      return std::string(name) + ": byte " + std::to_string(i) + " (row " +
             std::to_string(static_cast<std::int64_t>(i) / row_bytes) + ") is " +
             std::to_string(std::to_integer<int>(got[i])) + ", expected " +
             std::to_string(std::to_integer<int>(want)) + (i < specified ? "" : " (unwritten)");
    }
  }
  return "";
}

ReferenceInputs Workload::reference_inputs() const {
  ReferenceInputs in;
  in.num_ranks = config_.num_ranks;
  in.num_experts = config_.num_experts;
  in.counts = counts;
  in.tokens = tokens.data();
  in.token_row_bytes = dtype_bytes(config_.token_dtype, config_.hidden);
  // Null means absent to the reference, so A = 0 points at a byte it never reads.
  static const std::byte kNoRows{};
  const auto rows_of = [](const std::vector<std::byte>& v) { return v.empty() ? &kNoRows : v.data(); };
  if (config_.has_scales) {
    in.scales = rows_of(scales);
    in.scale_row_bytes = scale_row_bytes();
  }
  if (config_.has_weight) in.weight = rows_of(weight);
  in.num_tokens = config_.num_tokens;
  in.expert_alignment = config_.attributes.expert_alignment;
  return in;
}

std::string Workload::compare(const ReferenceOutputs& expected) const {
  std::vector<std::byte> expected_num(expert_token_num.size());
  const std::size_t count_bytes = static_cast<std::size_t>(dtype_bytes(config_.count_dtype, 1));
  for (std::size_t e = 0; e < expected.expert_token_num.size(); ++e) {
    const auto value32 = static_cast<std::int32_t>(expected.expert_token_num[e]);
    std::memcpy(expected_num.data() + e * count_bytes,
                count_bytes == 4 ? static_cast<const void*>(&value32) : &expected.expert_token_num[e],
                count_bytes);
  }
  const std::int64_t rows = expected.specified_rows;
  for (const std::string& diff :
       {rows_difference("permute_tokens", permute_tokens.data(), permute_tokens.size(),
                        expected.tokens, rows, dtype_bytes(config_.token_dtype, config_.hidden)),
        rows_difference("permute_per_token_scales", permute_scales.data(), permute_scales.size(),
                        expected.scales, rows, scale_row_bytes()),
        rows_difference("permute_topk_weight", permute_weight.data(), permute_weight.size(),
                        expected.weight, rows, 4),
        first_difference("permute_token_idx", token_idx,
                         reinterpret_cast<const std::byte*>(expected.token_idx.data()),
                         expected.token_idx.size() * 4),
        first_difference("expert_token_num", expert_token_num, expected_num.data(),
                         expected_num.size())}) {
    if (!diff.empty()) return diff;
  }
  return "";
}

}  // namespace moe_reroute::testing
