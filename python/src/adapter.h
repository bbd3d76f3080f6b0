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

/// Refuses `arg`, which is not on `device`, the device of the call's first
/// input `first` (a framework's device name: "cpu", "cuda:0").
[[noreturn]] void fail_device(std::string_view arg, std::string_view device,
                              std::string_view first = "tokens");

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
/// input's storage dims): the spec's dims, the last of a 2-D or wider one as
/// the 2-D or wider input stores its own (FP4 packed two a byte: halved).
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

/// moe_init_routing and moe_finalize_routing as the adapters call them: the
/// description, the core's types and calls, inputs and outputs by the
/// description's indices (an absent optional input: none).
struct InitRouting {
  using Attributes = InitRoutingAttributes;
  using Inputs = InitRoutingInputs;
  using Outputs = InitRoutingOutputs;
  static constexpr std::size_t kNumInputs = 2;
  static constexpr std::size_t kNumOutputs = 4;
  static const InitRoutingDesc& desc() { return init_routing_desc(); }
  static Inputs inputs(std::span<const std::optional<TensorView>> views) {
    return {*views[0], *views[1]};
  }
  static Outputs outputs(std::span<const TensorView> views) {
    return {views[0], views[1], views[2], views[3]};
  }
  static std::array<TensorSpec, kNumOutputs> specs(const Inputs& inputs,
                                                   const Attributes& attributes) {
    const InitRoutingOutputSpecs specs = infer_init_routing(inputs, attributes);
    return {specs.expanded_x, specs.expanded_row_idx, specs.expert_tokens_count_or_cumsum,
            specs.expert_tokens_before_capacity};
  }
  static void run(const Inputs& inputs, const Outputs& outputs, const Attributes& attributes,
                  int num_threads) {
    moe_init_routing(inputs, outputs, attributes, num_threads);
  }
};

struct FinalizeRouting {
  using Attributes = FinalizeRoutingAttributes;
  using Inputs = FinalizeRoutingInputs;
  using Outputs = FinalizeRoutingOutputs;
  static constexpr std::size_t kNumInputs = 7;
  static constexpr std::size_t kNumOutputs = 1;
  static const FinalizeRoutingDesc& desc() { return finalize_routing_desc(); }
  static Inputs inputs(std::span<const std::optional<TensorView>> views) {
    return {*views[0], *views[1], views[2], views[3], views[4], views[5], views[6]};
  }
  static Outputs outputs(std::span<const TensorView> views) { return {views[0]}; }
  static std::array<TensorSpec, kNumOutputs> specs(const Inputs& inputs,
                                                   const Attributes& attributes) {
    return {infer_finalize_routing(inputs, attributes).out};
  }
  static void run(const Inputs& inputs, const Outputs& outputs, const Attributes& attributes,
                  int num_threads) {
    moe_finalize_routing(inputs, outputs, attributes, num_threads);
  }
};

/// Scales stored as uint8 are read as float8_e8m0 (docs/spec.md section 4).
std::optional<std::string> scales_dtype(Storage scales);

}  // namespace moe_reroute::adapter
