#pragma once

// A deliberately naive reference of moe_init_routing and moe_finalize_routing
// (docs/spec.md sections 12 and 13), for the tests and the benchmarks'
// verification. It shares no code with the library: the sort is std::sort of
// (id, position) pairs, the float conversions are the compiler's _Float16 and
// a nearest-of-two-candidates bfloat16 rounding.

#include <cstddef>
#include <cstdint>
#include <vector>

namespace moe_reroute::testing {

struct InitReferenceInputs {
  const std::byte* x = nullptr;
  std::int64_t num_tokens = 0;  // T
  std::int64_t row_bytes = 0;
  std::vector<std::int64_t> expert_idx;  // [T * k]
  std::int64_t top_k = 1;
  std::int64_t active_num = 0;
  std::int64_t expert_capacity = 0;
  std::int64_t expert_num = 0;
  std::int64_t drop_pad_mode = 0;
  std::int64_t count_or_cumsum_flag = 0;
  bool before_capacity_flag = false;
};

struct InitReferenceOutputs {
  std::vector<std::byte> expanded_x;
  std::vector<std::int32_t> expanded_row_idx;
  std::vector<std::int32_t> count_or_cumsum;
  std::vector<std::int32_t> before_capacity;
};

InitReferenceOutputs reference_init_routing(const InitReferenceInputs& in);

enum class FloatType { kFloat16, kBFloat16, kFloat32 };

struct FinalizeReferenceInputs {
  FloatType dtype = FloatType::kFloat32;         // expanded_x, x1, x2, bias, out
  FloatType scales_dtype = FloatType::kFloat32;
  std::int64_t num_tokens = 0, top_k = 1, hidden = 1;
  std::int64_t drop_pad_mode = 0;
  const void* expanded_x = nullptr;
  std::int64_t expanded_rows = 0;  // T * k-ish rows, or E * C
  const std::int32_t* expanded_row_idx = nullptr;
  const void* x1 = nullptr;
  const void* x2 = nullptr;
  const void* bias = nullptr;
  const void* scales = nullptr;
  const std::int32_t* expert_idx = nullptr;
};

/// out's bytes, [T, H] of `dtype`.
std::vector<std::byte> reference_finalize_routing(const FinalizeReferenceInputs& in);

/// The element at `i` of `data` as float, and `value` rounded to `type`'s bytes.
float reference_load(FloatType type, const void* data, std::int64_t i);
std::vector<std::byte> reference_store(FloatType type, float value);

}  // namespace moe_reroute::testing
