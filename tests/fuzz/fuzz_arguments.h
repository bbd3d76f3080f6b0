#pragma once

// Decodes fuzzer bytes into operator arguments (shapes, dtypes, attributes and
// counts, valid or not) and owns the buffers of a call that planning accepted.
// The forward and inverse fuzz targets use all of it; the routing targets the
// drawing helpers, the input storage, the poisoned outputs and the checks.

#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "moe_reroute/reroute.h"
#include "reference.h"

namespace moe_reroute::fuzz {

/// Tensors no larger than this get real buffers and are run; larger accepted
/// shapes are only planned.
inline constexpr std::int64_t kMaxRunBytes = std::int64_t{1} << 20;

/// One in 16 an edge value of int32, int64 or byte arithmetic, else 0..small_max
/// (an exhausted input gives 0).
std::int64_t draw_size(FuzzedDataProvider& provider, std::int64_t small_max);
/// An edge value: -1, -2, the int32 and int64 limits, powers of two past int32.
std::int64_t draw_edge_value(FuzzedDataProvider& provider);
/// Mostly one of `usual`; one in 16 any table dtype, one in 64 an enum value past the table.
DType draw_dtype(FuzzedDataProvider& provider, std::initializer_list<DType> usual);
/// One in 16 any int64, else lo..hi.
std::int64_t draw_attribute(FuzzedDataProvider& provider, std::int64_t lo = 0, std::int64_t hi = 1);
/// Usually `usual` dims; one in 8 any number up to kMaxDims.
int draw_ndim(FuzzedDataProvider& provider, int usual);
/// `usual` (one in 16 replaced by draw_size up to 64): a dim 0 meant to match.
std::int64_t draw_rows(FuzzedDataProvider& provider, std::int64_t usual);
/// `dims`, in a rank drawn by draw_ndim: missing dims dropped, extra ones drawn.
Shape draw_shape_like(FuzzedDataProvider& provider, std::initializer_list<std::int64_t> dims);
/// True for a DType value inside the table.
bool valid_dtype(DType dtype);

/// Gives `view` `storage` of seeded random bytes when its dtype is in the table
/// and it holds at most kMaxRunBytes; else leaves its data null and returns false.
bool attach_random(TensorView& view, std::vector<std::byte>& storage, std::uint64_t seed);
/// As attach_random, but an int32 or int64 `view` holds draw() per element;
/// returns those values as stored, widened (empty when it got no storage or
/// has another dtype).
std::vector<std::int64_t> attach_indices(TensorView& view, std::vector<std::byte>& storage,
                                         std::uint64_t seed,
                                         const std::function<std::int64_t()>& draw);
/// One in 16 sets `view`'s data to null.
void maybe_null(FuzzedDataProvider& provider, TensorView& view);

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

/// Aborts with `what` when `condition` fails: the fuzzer's finding, printed
/// with the context last set (the decoded call, so a finding reads on its own;
/// MOE_REROUTE_FUZZ_PRINT=1 prints every context as it is set).
void require(bool condition, const std::string& what);
void set_finding_context(std::string context);

/// "float32[3, 4] @null": a view's spec, and "@null" where its data is null.
std::string describe(const TensorView& view);
/// "[v0, v1, ...]", at most 64 values.
std::string describe(const std::vector<std::int64_t>& values);

/// Poisoned output buffers, in `output_specs` order.
struct PoisonedOutputs {
  std::vector<std::vector<std::byte>> outputs;

  explicit PoisonedOutputs(const std::vector<TensorSpec>& output_specs);
  /// Views of the outputs, with `output_specs`.
  std::vector<TensorView> output_views(const std::vector<TensorSpec>& output_specs);
  /// True when every output byte still holds the poison.
  bool outputs_untouched() const;
};

/// Input and output buffers of one run: inputs filled with seeded random
/// bytes, outputs poisoned.
struct Buffers : PoisonedOutputs {
  std::vector<std::byte> tokens, scales, weight;

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
};

/// True when every spec's size is defined (no negative dim, no int64
/// overflow) and at most kMaxRunBytes.
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
/// a wrong dim 0, data aliasing one of `inputs` or another output, or null
/// data. Returns what it did ("" when it left them alone).
std::string break_one_output(FuzzedDataProvider& provider, const std::vector<TensorView*>& outputs,
                             const std::vector<const TensorView*>& inputs);

/// Row bytes of a spec (everything past dim 0).
std::int64_t row_bytes(const TensorSpec& spec);

}  // namespace moe_reroute::fuzz
