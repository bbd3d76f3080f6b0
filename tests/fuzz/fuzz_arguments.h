#pragma once

// Decodes fuzzer bytes into operator arguments (shapes, dtypes, attributes and
// counts, valid or not) and owns the buffers of a call that planning accepted.
// Shared by the forward and inverse fuzz targets.

#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "moe_reroute/reroute.h"
#include "reference.h"

namespace moe_reroute::fuzz {

/// Tensors no larger than this get real buffers and are run; larger accepted
/// shapes are only planned.
inline constexpr std::int64_t kMaxRunBytes = std::int64_t{1} << 20;

/// Shapes, dtypes and attributes as decoded; token, scale and weight data are
/// null (planning must not read them), the counts point at `counts_storage`
/// when their shape is small enough to hold, else null.
struct Arguments {
  TensorView tokens;
  TensorView counts;
  std::optional<TensorView> scales;
  std::optional<TensorView> weight;
  Attributes attributes;
  int num_threads = 0;
  std::uint64_t seed = 0;  // for the token bytes
  std::vector<std::byte> counts_storage;
  std::vector<std::int64_t> count_values;  // as stored, widened; empty when counts has no data
};

/// `expert_ordered_tokens`: the tokens are the inverse's R expert-ordered rows,
/// so a consistent call has A + E * (k - 1) of them.
Arguments decode_arguments(FuzzedDataProvider& provider, bool expert_ordered_tokens);

/// Aborts with `what` when `condition` fails: the fuzzer's finding.
void require(bool condition, const std::string& what);

/// Input and output buffers of one run: inputs filled with seeded random
/// bytes, outputs poisoned. Outputs are listed by `output_specs` order.
struct Buffers {
  std::vector<std::byte> tokens, scales, weight;
  std::vector<std::vector<std::byte>> outputs;

  Buffers(const Arguments& arguments, const std::vector<TensorSpec>& output_specs);
  /// The arguments' inputs (RerouteInputs or InverseInputs) over these buffers.
  template <typename Inputs>
  Inputs inputs(const Arguments& arguments) {
    Inputs in{TensorView(tokens.data(), arguments.tokens.dtype(), arguments.tokens.shape()),
              arguments.counts, std::nullopt, std::nullopt};
    if (arguments.scales) {
      in.per_token_scales =
          TensorView(scales.data(), arguments.scales->dtype(), arguments.scales->shape());
    }
    if (arguments.weight) {
      in.expert_topk_weight =
          TensorView(weight.data(), arguments.weight->dtype(), arguments.weight->shape());
    }
    return in;
  }
  /// Views of the outputs, with `output_specs`.
  std::vector<TensorView> output_views(const std::vector<TensorSpec>& output_specs);
  /// True when every output byte still holds the poison.
  bool outputs_untouched() const;
};

/// True when every spec is at most kMaxRunBytes.
bool small_enough(const std::vector<TensorSpec>& specs);

/// The naive reference's view of the arguments and buffers.
testing::ReferenceInputs reference_inputs(const Arguments& arguments, const Buffers& buffers);

/// Aborts naming `name` unless `got` equals `expected` byte for byte.
void require_equal(const char* name, const std::vector<std::byte>& got, const void* expected,
                   std::size_t expected_bytes);

/// Aborts unless the plan's chunks tile [0, A) in both source and destination
/// rows (every row moved exactly once) and the threads partition the chunks.
/// Requires the first `specified_rows` rows (of `row_bytes`) of `got` to equal
/// `expected` and the rest to hold the poison (testing::rows_difference).
void require_rows(const char* name, const std::vector<std::byte>& got,
                  const std::vector<std::byte>& expected, std::int64_t specified_rows,
                  std::int64_t row_bytes);

void require_plan_tiles(const Plan& plan);

/// Sometimes breaks one of `outputs` so that running must fail: a wrong dtype,
/// a wrong dim 0, data aliasing the input `tokens`, or null data. Returns what
/// it did ("" when it left them alone).
std::string break_one_output(FuzzedDataProvider& provider, const std::vector<TensorView*>& outputs,
                             const TensorView& tokens);

/// Row bytes of a spec (everything past dim 0).
std::int64_t row_bytes(const TensorSpec& spec);

}  // namespace moe_reroute::fuzz
