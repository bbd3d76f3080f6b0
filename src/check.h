#pragma once

// Helpers shared by planning and the backends' output checks.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "moe_reroute/error.h"
#include "moe_reroute/export.h"
#include "moe_reroute/operator.h"
#include "moe_reroute/reroute.h"
#include "moe_reroute/tensor.h"

namespace moe_reroute::detail {

[[noreturn]] inline void fail(ErrorCode code, const std::string& message) {
  throw Error(code, message);
}

/// Element i of `base` as T, through memcpy: views may be misaligned.
template <typename T>
T load(const void* base, std::int64_t i) {
  T value;
  std::memcpy(&value, static_cast<const std::byte*>(base) + i * std::int64_t{sizeof(T)}, sizeof(T));
  return value;
}

/// Writes element i of `base` as T, through memcpy: views may be misaligned.
template <typename T>
void store(void* base, std::int64_t i, T value) {
  std::memcpy(static_cast<std::byte*>(base) + i * std::int64_t{sizeof(T)}, &value, sizeof(T));
}

/// Calls `body(i, count)` for the first `size` counts of int32 or int64
/// `counts`, as int64, in order; the dtype is chosen once, not per count.
template <typename Body>
void for_each_count(const TensorView& counts, std::size_t size, const Body& body) {
  const auto each = [&]<typename T>(T) {
    for (std::size_t i = 0; i < size; ++i) {
      body(i, static_cast<std::int64_t>(load<T>(counts.data, static_cast<std::int64_t>(i))));
    }
  };
  if (counts.dtype() == DType::kInt32) {
    each(std::int32_t{});
  } else {
    each(std::int64_t{});
  }
}

/// The view of an optional input or output, or null where it is absent.
inline const TensorView* given(const std::optional<TensorView>& view) {
  return view ? &*view : nullptr;
}

/// Throws Error for num_threads < 0 (0: all hardware threads).
inline void check_num_threads(int num_threads) {
  if (num_threads < 0) {
    fail(ErrorCode::kInvalidArgument,
         "num_threads: must be >= 0 (0 = all hardware threads), got " + std::to_string(num_threads));
  }
}

/// Bytes of `spec`; throws Error naming `name` for a negative dim or a size
/// past int64.
MOE_REROUTE_API std::int64_t checked_nbytes(const TensorSpec& spec, const char* name);

/// Bytes of one dim-0 row: everything past dim 0.
inline std::int64_t row_bytes(const TensorSpec& spec) {
  std::int64_t elements = 1;
  for (int d = 1; d < spec.shape.ndim; ++d) elements *= spec.shape[d];
  return dtype_bytes(spec.dtype, elements);
}

}  // namespace moe_reroute::detail

namespace moe_reroute::detail {

/// Throws Error naming `name` where `view`'s DType is a value outside the
/// table (C++ callers only: a cast from a bad integer), before any message
/// looks its name up.
void check_dtype_value(const TensorView& view, const char* name);

struct NamedView {
  const char* name;
  const TensorView* view;
};

/// The given inputs with their argument names, in plan order.
template <typename Inputs>
std::vector<NamedView> named_inputs(const Inputs& inputs) {
  const std::span<const InputDesc> names = reroute_desc().inputs;
  std::vector<NamedView> named = {{names[0].name.data(), &inputs.tokens},
                                  {names[1].name.data(), &inputs.expert_token_num_per_rank}};
  if (inputs.per_token_scales) named.push_back({names[2].name.data(), &*inputs.per_token_scales});
  if (inputs.expert_topk_weight) {
    named.push_back({names[3].name.data(), &*inputs.expert_topk_weight});
  }
  return named;
}

/// The forward's five outputs with their names, in struct order.
MOE_REROUTE_API std::vector<NamedView> named_outputs(const RerouteOutputs& outputs);

/// The inverse's outputs with their names; throws Error unless each optional
/// output is given exactly when its input is.
MOE_REROUTE_API std::vector<NamedView> named_outputs(const InverseInputs& inputs, const InverseOutputs& outputs);

/// plan_reroute and plan_inverse into `plan`, whose vectors keep their memory
/// (the one-shot calls reuse one plan per thread: no allocation per call).
void plan_reroute(Plan& plan, const RerouteInputs& inputs, const Attributes& attributes,
                  int num_threads);
void plan_inverse(Plan& plan, const InverseInputs& inputs, const Attributes& attributes,
                  int num_threads);

/// Rule 10 and the plan's contract: every input and output has the spec the
/// plan holds for it, data is non-null where bytes are moved, and no output
/// overlaps an input or another output. Throws Error.
MOE_REROUTE_API void check_run_arguments(std::span<const TensorSpec> input_specs,
                                         const std::vector<NamedView>& inputs,
                                         std::span<const TensorSpec> output_specs,
                                         const std::vector<NamedView>& outputs);

}  // namespace moe_reroute::detail
