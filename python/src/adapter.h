#pragma once

// What the nanobind module and the torch operators share: the one error
// helper and the reading of framework storage as core views (docs/spec.md
// section 4 for the dtypes). Framework-neutral: a framework array is described
// by its element type's name and width.

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "moe_reroute/moe_reroute.h"

namespace moe_reroute::adapter {

/// Throws Error(code, message): the one way the adapters refuse an argument.
[[noreturn]] void fail(ErrorCode code, const std::string& message);

/// Refuses `arg`, which is None where an array or tensor is required (torch
/// passes None as an undefined tensor).
[[noreturn]] void fail_none(std::string_view arg);

/// Refuses `arg`, which is not dense row-major (an output given to be written).
[[noreturn]] void fail_not_contiguous(std::string_view arg);

/// Refuses `arg`, which is not on `tokens_device` (a framework's device name:
/// "cpu", "cuda:0").
[[noreturn]] void fail_device(std::string_view arg, std::string_view tokens_device);

/// A framework element type: its name as the framework spells it ("bfloat16",
/// "uint16", "float8_e4m3fn", "float4_e2m1fn_x2", ...), its width in bits and
/// the table dtype of that name (`table_dtype`), which a framework may look up
/// once per element type and keep.
struct Storage {
  std::string_view name;
  int bits = 0;
  std::optional<DType> dtype;
};

/// The table dtype a framework names `name` (its docs/spec.md or torch name);
/// none where the table has no such row.
std::optional<DType> table_dtype(std::string_view name);

/// The core view of dense row-major storage `dims` (argument `arg`). Without
/// `logical`, the storage dtype must be in the table (by name or torch name;
/// a packed FP4 dtype doubles the last dim). With `logical` (the value of
/// argument `logical_arg`), the storage is that table dtype itself, unsigned
/// integers of its width, or uint8 holding two FP4 elements a byte. Throws
/// Error (unsupported, out_of_range) naming the argument.
TensorView core_view(const void* data, Storage storage, std::span<const std::int64_t> dims,
                     const char* arg, const std::optional<std::string>& logical,
                     const char* logical_arg);

/// The outputs' specs in struct order; an absent optional output of the
/// inverse is float32 (0,), as the forward's permute_topk_weight.
std::array<TensorSpec, 5> output_specs(const RerouteOutputSpecs& specs);
std::array<TensorSpec, 3> output_specs(const InverseOutputSpecs& specs);

/// The dims of output `spec` stored like its input (`input_dims`, a viewed
/// input's storage dims): the spec's rows, then the input's trailing dims.
Shape stored_like(const TensorSpec& spec, std::span<const std::int64_t> input_dims);

/// The bytes a strided array spans: `dims` with `strides` counted in units of
/// `stride_bytes` bytes, elements of `item_bytes` at `data` (docs/spec.md
/// rule 10: the whole span a view touches).
ByteSpan strided_span(const char* name, const void* data, std::span<const std::int64_t> dims,
                      std::span<const std::int64_t> strides, std::int64_t stride_bytes,
                      std::int64_t item_bytes);

/// Rule 10 for an out= call where some inputs were copied (to C order, to
/// native byte order) before the run, which then sees only the copies: each
/// output's spec, then no output overlapping `copied_inputs` (the caller's
/// memory of those inputs) or another output. Throws Error before anything is
/// written; the run checks the rest.
void check_out_against_copied(const RerouteOutputSpecs& specs, const RerouteOutputs& outputs,
                              std::span<const ByteSpan> copied_inputs);

/// Scales stored as uint8 are read as float8_e8m0 (docs/spec.md section 4).
std::optional<std::string> scales_dtype(Storage scales);

}  // namespace moe_reroute::adapter
