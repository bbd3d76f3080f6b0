#pragma once

/// The operators on either side of the expert-parallel exchange, after the
/// original's MoeInitRoutingV2 and MoeFinalizeRoutingV2 (docs/spec.md sections
/// 12 and 13): moe_init_routing sorts a rank's tokens by expert before the
/// dispatch AlltoAll; moe_finalize_routing sums each token's k expert outputs,
/// weighted, after the combine AlltoAll.
///
/// One call each: it validates every argument, reading the ids or row indices
/// on the host, then writes; nothing is written unless every check passed.

#include <cstdint>
#include <optional>

#include "moe_reroute/error.h"
#include "moe_reroute/export.h"
#include "moe_reroute/tensor.h"

namespace moe_reroute {

/// drop_pad_mode of moe_init_routing: dropless, or by expert capacity.
inline constexpr int kDropless = 0;
inline constexpr int kDropPad = 1;
/// expert_tokens_count_or_cumsum_flag: no output, the cumsum or the counts.
inline constexpr int kExpertTokensNone = 0;
inline constexpr int kExpertTokensCumsum = 1;
inline constexpr int kExpertTokensCount = 2;

struct InitRoutingAttributes {
  std::int64_t active_num = 0;       // rows of expanded_x in dropless mode (0: T * k)
  std::int64_t expert_capacity = 0;  // C, drop_pad_mode 1
  std::int64_t expert_num = 0;       // E; 0: the ids are not bounded (dropless, no counts)
  std::int64_t drop_pad_mode = kDropless;
  std::int64_t expert_tokens_count_or_cumsum_flag = kExpertTokensNone;
  bool expert_tokens_before_capacity_flag = false;
  bool operator==(const InitRoutingAttributes& other) const = default;
};

struct InitRoutingInputs {
  TensorView x;           // [T, H], a token dtype
  TensorView expert_idx;  // [T, k] int32 or int64
};

struct InitRoutingOutputs {
  TensorView expanded_x;                     // [n, H] dropless; [E, C, H] by capacity
  TensorView expanded_row_idx;               // [T * k] int32
  TensorView expert_tokens_count_or_cumsum;  // [E] int32, or (0,)
  TensorView expert_tokens_before_capacity;  // [E] int32, or (0,)
};

struct InitRoutingOutputSpecs {
  TensorSpec expanded_x;
  TensorSpec expanded_row_idx;
  TensorSpec expert_tokens_count_or_cumsum;
  TensorSpec expert_tokens_before_capacity;
  bool operator==(const InitRoutingOutputSpecs& other) const = default;
};

/// drop_pad_mode of moe_finalize_routing: where expanded_row_idx keeps the
/// row of (t, j), and whether expanded_x is [T * k, H] or [E, C, H].
inline constexpr int kFinalizeColumnMajor = 0;          // idx[j * T + t], [T * k, H]
inline constexpr int kFinalizeColumnMajorCapacity = 1;  // idx[j * T + t], [E, C, H]
inline constexpr int kFinalizeRowMajor = 2;             // idx[t * k + j], [T * k, H]
inline constexpr int kFinalizeRowMajorCapacity = 3;     // idx[t * k + j], [E, C, H]

struct FinalizeRoutingAttributes {
  std::int64_t drop_pad_mode = kFinalizeColumnMajor;
  bool operator==(const FinalizeRoutingAttributes& other) const = default;
};

struct FinalizeRoutingInputs {
  TensorView expanded_x;        // [T * k, H] or [E, C, H]: float16, bfloat16, float32
  TensorView expanded_row_idx;  // [T * k] int32
  std::optional<TensorView> x1 = std::nullopt;          // [T, H], expanded_x's dtype
  std::optional<TensorView> x2 = std::nullopt;          // [T, H], needs x1
  std::optional<TensorView> bias = std::nullopt;        // [E, H], needs expert_idx
  std::optional<TensorView> scales = std::nullopt;      // [T, k]: expanded_x's dtype, or float32
  std::optional<TensorView> expert_idx = std::nullopt;  // [T, k] int32
};

struct FinalizeRoutingOutputs {
  TensorView out;  // [T, H], expanded_x's dtype
};

struct FinalizeRoutingOutputSpecs {
  TensorSpec out;
  bool operator==(const FinalizeRoutingOutputSpecs& other) const = default;
};

/// Output specs from shapes, dtypes and attributes alone (reads no data);
/// throws Error naming the argument for every rule that needs no values.
MOE_REROUTE_API InitRoutingOutputSpecs infer_init_routing(
    const InitRoutingInputs& inputs, const InitRoutingAttributes& attributes = {});
MOE_REROUTE_API FinalizeRoutingOutputSpecs infer_finalize_routing(
    const FinalizeRoutingInputs& inputs, const FinalizeRoutingAttributes& attributes = {});

/// Validates everything (the ids' or row indices' values too), checks each
/// output's spec and that no output overlaps an input or another output, then
/// runs on the CPU over at most `num_threads` threads (0: all hardware
/// threads). Throws Error before writing anything.
MOE_REROUTE_API void moe_init_routing(const InitRoutingInputs& inputs,
                                      const InitRoutingOutputs& outputs,
                                      const InitRoutingAttributes& attributes = {},
                                      int num_threads = 0);
MOE_REROUTE_API void moe_finalize_routing(const FinalizeRoutingInputs& inputs,
                                          const FinalizeRoutingOutputs& outputs,
                                          const FinalizeRoutingAttributes& attributes = {},
                                          int num_threads = 0);

}  // namespace moe_reroute
