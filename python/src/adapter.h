#pragma once

// What the nanobind module and the torch operators share: the one error
// helper and the reading of framework storage as core views (docs/spec.md
// section 4 for the dtypes). Framework-neutral: a framework array is described
// by its element type's name and width.

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "moe_reroute/moe_reroute.h"

namespace moe_reroute::adapter {

/// Throws Error(code, message): the one way the adapters refuse an argument.
[[noreturn]] void fail(ErrorCode code, const std::string& message);

/// A framework element type: its name as the framework spells it ("bfloat16",
/// "uint16", "float8_e4m3fn", "float4_e2m1fn_x2", ...) and its width in bits.
struct Storage {
  std::string_view name;
  int bits = 0;
};

/// The core view of dense row-major storage `dims` (argument `arg`). Without
/// `logical`, the storage dtype must be in the table (by name or torch name;
/// a packed FP4 dtype doubles the last dim). With `logical` (the value of
/// argument `logical_arg`), the storage is that table dtype itself, unsigned
/// integers of its width, or uint8 holding two FP4 elements a byte. Throws
/// Error (unsupported, out_of_range) naming the argument.
TensorView core_view(const void* data, Storage storage, std::span<const std::int64_t> dims,
                     const char* arg, const std::optional<std::string>& logical,
                     const char* logical_arg);

/// The dims of output `spec` stored like its input (`input_dims`): the
/// spec's rows, then the input's trailing storage dims.
std::vector<std::int64_t> stored_like(const TensorSpec& spec,
                                      std::span<const std::int64_t> input_dims);

/// The spec of an absent optional output (the inverse's scales or weights
/// when none are given): float32 (0,), as the forward's permute_topk_weight.
inline TensorSpec absent_spec() { return {DType::kFloat32, Shape{0}}; }

/// Scales stored as uint8 are read as float8_e8m0 (docs/spec.md section 4).
std::optional<std::string> scales_dtype(Storage scales);

}  // namespace moe_reroute::adapter
