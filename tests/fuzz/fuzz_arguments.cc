#include "fuzz_arguments.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <utility>

#include "workload.h"

namespace moe_reroute::fuzz {
namespace {

using testing::kPoison;
constexpr std::int64_t kMaxCountBlocks = 256;
constexpr std::int64_t kInt32Max = std::numeric_limits<std::int32_t>::max();
constexpr std::int64_t kInt64Max = std::numeric_limits<std::int64_t>::max();
constexpr std::int64_t kInt64Min = std::numeric_limits<std::int64_t>::min();

// Sizes at the edges of int32, int64 and byte arithmetic.
constexpr std::int64_t kEdgeValues[] = {-1,
                                        -2,
                                        -kInt32Max - 1,
                                        kInt32Max,
                                        kInt32Max + 1,
                                        std::int64_t{1} << 32,
                                        std::int64_t{1} << 40,
                                        std::int64_t{1} << 57,
                                        (std::int64_t{1} << 57) + 1,
                                        std::int64_t{1} << 62,
                                        kInt64Max,
                                        kInt64Min};

// dim 0 is `rows` (usually A), the rest drawn with `small_max`.
Shape draw_shape(FuzzedDataProvider& provider, int ndim, std::int64_t rows,
                 std::int64_t small_max) {
  Shape shape;
  shape.ndim = ndim;
  for (int d = 0; d < ndim; ++d) {
    shape.dims[static_cast<std::size_t>(d)] = d == 0 ? rows : draw_size(provider, small_max);
  }
  return shape;
}

// Elements of `shape` when it is non-negative and at most `limit`, else -1.
std::int64_t small_numel(const Shape& shape, std::int64_t limit) {
  std::int64_t elements = 1;
  for (int d = 0; d < shape.ndim; ++d) {
    if (shape[d] < 0 || __builtin_mul_overflow(elements, shape[d], &elements) || elements > limit) {
      return -1;
    }
  }
  return elements;
}

void draw_counts(FuzzedDataProvider& provider, Arguments& arguments) {
  const DType dtype = draw_dtype(provider, {DType::kInt32, DType::kInt64});
  const int ndim = draw_ndim(provider, 2);
  Shape shape;
  shape.ndim = ndim;
  for (int d = 0; d < ndim; ++d) shape.dims[static_cast<std::size_t>(d)] = draw_size(provider, 6);
  arguments.counts = TensorView(nullptr, dtype, shape);
  const std::int64_t numel = small_numel(shape, kMaxCountBlocks);
  if (numel < 0 || !valid_dtype(dtype)) return;
  arguments.counts_storage.assign(static_cast<std::size_t>(dtype_bytes(dtype, numel)), kPoison);
  arguments.counts.data = arguments.counts_storage.data();
  if (dtype != DType::kInt32 && dtype != DType::kInt64) return;
  for (std::int64_t i = 0; i < numel; ++i) {
    // One in 16 an edge value, else a third zeros (empty blocks, A = 0) and small counts.
    const int pick = provider.ConsumeIntegralInRange<int>(0, 15);
    std::int64_t value = pick == 15 ? draw_edge_value(provider)
                         : pick < 5 ? 0
                                    : provider.ConsumeIntegralInRange<std::int64_t>(1, 12);
    if (dtype == DType::kInt32) {
      const auto stored = static_cast<std::int32_t>(value);
      value = stored;
      std::memcpy(arguments.counts_storage.data() + i * 4, &stored, 4);
    } else {
      std::memcpy(arguments.counts_storage.data() + i * 8, &value, 8);
    }
    arguments.count_values.push_back(value);
  }
}

// expert_alignment: usually 1, else a small or an edge value.
std::int64_t draw_alignment(FuzzedDataProvider& provider) {
  constexpr std::int64_t kAlignments[] = {2, 3, 16, 128, 0, -1, std::int64_t{1} << 40,
                                          std::numeric_limits<std::int64_t>::max()};
  return provider.ConsumeIntegralInRange<int>(0, 3) != 3 ? 1 : provider.PickValueInArray(kAlignments);
}

// A: usually the counts' sum (so the call is consistent; with spare rows up
// to 8 more), else any size.
std::int64_t draw_num_tokens(FuzzedDataProvider& provider, const Arguments& arguments) {
  std::int64_t sum = 0;
  bool summable = !arguments.count_values.empty();
  for (std::int64_t value : arguments.count_values) {
    summable = summable && !__builtin_add_overflow(sum, value, &sum);
  }
  if (summable && provider.ConsumeIntegralInRange<int>(0, 7) != 7) {
    const std::int64_t spare =
        arguments.attributes.allow_spare_rows ? provider.ConsumeIntegralInRange<std::int64_t>(0, 8) : 0;
    return sum <= std::numeric_limits<std::int64_t>::max() - spare ? sum + spare : sum;
  }
  return draw_size(provider, 64);
}

// The rows of the tokens: A, or for the inverse R = A + E * (k - 1) when that fits.
std::int64_t token_rows(const Arguments& arguments, std::int64_t num_tokens,
                        bool expert_ordered_tokens) {
  const std::int64_t k = arguments.attributes.expert_alignment;
  std::int64_t pad = 0, rows = num_tokens;
  if (!expert_ordered_tokens || k <= 1 || arguments.counts.shape().ndim != 2 ||
      __builtin_mul_overflow(arguments.counts.shape()[1], k - 1, &pad) ||
      __builtin_add_overflow(num_tokens, pad, &rows)) {
    return num_tokens;
  }
  return rows;
}

}  // namespace

std::int64_t draw_edge_value(FuzzedDataProvider& provider) {
  return provider.PickValueInArray(kEdgeValues);
}

std::int64_t draw_size(FuzzedDataProvider& provider, std::int64_t small_max) {
  if (provider.ConsumeIntegralInRange<int>(0, 15) == 15) return draw_edge_value(provider);
  return provider.ConsumeIntegralInRange<std::int64_t>(0, small_max);
}

DType draw_dtype(FuzzedDataProvider& provider, std::initializer_list<DType> usual) {
  const int pick = provider.ConsumeIntegralInRange<int>(0, 63);
  if (pick == 63) return static_cast<DType>(provider.ConsumeIntegralInRange<int>(13, 255));
  if (pick >= 60) {
    return static_cast<DType>(
        provider.ConsumeIntegralInRange<std::size_t>(0, dtype_table().size() - 1));
  }
  return *(usual.begin() + pick % static_cast<int>(usual.size()));
}

std::int64_t draw_attribute(FuzzedDataProvider& provider, std::int64_t lo, std::int64_t hi) {
  if (provider.ConsumeIntegralInRange<int>(0, 15) == 15) {
    return provider.ConsumeIntegral<std::int64_t>();
  }
  return provider.ConsumeIntegralInRange<std::int64_t>(lo, hi);
}

int draw_ndim(FuzzedDataProvider& provider, int usual) {
  if (provider.ConsumeIntegralInRange<int>(0, 7) == 7) {
    return provider.ConsumeIntegralInRange<int>(0, kMaxDims);
  }
  return usual;
}

std::int64_t draw_rows(FuzzedDataProvider& provider, std::int64_t usual) {
  return provider.ConsumeIntegralInRange<int>(0, 15) == 15 ? draw_size(provider, 64) : usual;
}

Shape draw_shape_like(FuzzedDataProvider& provider, std::initializer_list<std::int64_t> dims) {
  Shape shape;
  shape.ndim = draw_ndim(provider, static_cast<int>(dims.size()));
  for (int d = 0; d < shape.ndim; ++d) {
    shape.dims[static_cast<std::size_t>(d)] = static_cast<std::size_t>(d) < dims.size()
                                                  ? *(dims.begin() + d)
                                                  : draw_size(provider, 4);
  }
  return shape;
}

bool valid_dtype(DType dtype) { return static_cast<std::size_t>(dtype) < dtype_table().size(); }

bool attach_random(TensorView& view, std::vector<std::byte>& storage, std::uint64_t seed) {
  if (!small_enough({view.spec})) return false;
  storage.resize(static_cast<std::size_t>(view.nbytes()));
  testing::fill_random(storage.data(), storage.size(), seed);
  view.data = storage.data();
  return true;
}

std::vector<std::int64_t> attach_indices(TensorView& view, std::vector<std::byte>& storage,
                                         std::uint64_t seed,
                                         const std::function<std::int64_t()>& draw) {
  std::vector<std::int64_t> values;
  if (!attach_random(view, storage, seed)) return values;
  const bool int32 = view.dtype() == DType::kInt32;
  if (!int32 && view.dtype() != DType::kInt64) return values;
  const std::int64_t numel = view.shape().numel();
  for (std::int64_t i = 0; i < numel; ++i) {
    std::int64_t value = draw();
    if (int32) {
      const auto stored = static_cast<std::int32_t>(value);
      value = stored;
      std::memcpy(storage.data() + i * 4, &stored, 4);
    } else {
      std::memcpy(storage.data() + i * 8, &value, 8);
    }
    values.push_back(value);
  }
  return values;
}

void maybe_null(FuzzedDataProvider& provider, TensorView& view) {
  if (provider.ConsumeIntegralInRange<int>(0, 15) == 15) view.data = nullptr;
}

Arguments decode_arguments(FuzzedDataProvider& provider, bool expert_ordered_tokens) {
  Arguments arguments;
  arguments.num_threads = provider.ConsumeIntegralInRange<int>(0, 4);
  arguments.attributes.expert_token_num_type = draw_attribute(provider);
  arguments.attributes.idx_type = draw_attribute(provider);
  arguments.attributes.expert_alignment = draw_alignment(provider);
  arguments.attributes.allow_spare_rows = provider.ConsumeBool();
  draw_counts(provider, arguments);

  const std::int64_t num_tokens =
      token_rows(arguments, draw_num_tokens(provider, arguments), expert_ordered_tokens);
  const DType token_dtype = draw_dtype(
      provider, {DType::kInt8, DType::kFloat16, DType::kBFloat16, DType::kFloat32,
                 DType::kFloat8E4M3FN, DType::kFloat4E2M1, DType::kFloat4E1M2, DType::kUInt8});
  arguments.tokens = TensorView(nullptr, token_dtype,
                                draw_shape(provider, draw_ndim(provider, 2), num_tokens, 40));

  if (provider.ConsumeBool()) {
    const DType dtype = draw_dtype(provider, {DType::kFloat32, DType::kFloat8E8M0});
    const int usual_ndim = provider.ConsumeIntegralInRange<int>(1, 3);
    arguments.scales = TensorView(
        nullptr, dtype,
        draw_shape(provider, draw_ndim(provider, usual_ndim), draw_rows(provider, num_tokens), 4));
  }
  if (provider.ConsumeBool()) {
    const DType dtype = draw_dtype(provider, {DType::kFloat32});
    Shape shape =
        draw_shape(provider, draw_ndim(provider, provider.ConsumeIntegralInRange<int>(1, 2)),
                   draw_rows(provider, num_tokens), 2);
    if (shape.ndim == 2 && provider.ConsumeIntegralInRange<int>(0, 7) != 7) shape.dims[1] = 1;
    arguments.weight = TensorView(nullptr, dtype, shape);
  }
  arguments.seed = provider.ConsumeIntegral<std::uint64_t>();
  return arguments;
}

namespace {
std::string finding_context;
}  // namespace

void set_finding_context(std::string context) {
  finding_context = std::move(context);
  // For a crash the sanitizers report before any require: print every call.
  static const bool print = std::getenv("MOE_REROUTE_FUZZ_PRINT") != nullptr;
  if (print) std::fprintf(stderr, "fuzz call: %s\n", finding_context.c_str());
}

void require(bool condition, const std::string& what) {
  if (condition) return;
  std::fprintf(stderr, "fuzz finding: %s\n", what.c_str());
  if (!finding_context.empty()) std::fprintf(stderr, "  in: %s\n", finding_context.c_str());
  std::abort();
}

std::string describe(const TensorView& view) {
  std::string text = valid_dtype(view.dtype())
                         ? view.spec.to_string()
                         : "dtype#" + std::to_string(static_cast<int>(view.dtype()));
  return text + (view.data ? "" : " @null");
}

std::string describe(const std::vector<std::int64_t>& values) {
  std::string text = "[";
  for (std::size_t i = 0; i < values.size() && i < 64; ++i) {
    text += (i ? ", " : "") + std::to_string(values[i]);
  }
  return text + (values.size() > 64 ? ", ...]" : "]");
}

std::int64_t row_bytes(const TensorSpec& spec) {
  std::int64_t elements = 1;
  for (int d = 1; d < spec.shape.ndim; ++d) elements *= spec.shape[d];
  return dtype_bytes(spec.dtype, elements);
}

bool small_enough(const std::vector<TensorSpec>& specs) {
  for (const TensorSpec& spec : specs) {
    if (!valid_dtype(spec.dtype) || small_numel(spec.shape, kMaxRunBytes * 8) < 0 ||
        spec.nbytes() > kMaxRunBytes) {
      return false;
    }
  }
  return true;
}

PoisonedOutputs::PoisonedOutputs(const std::vector<TensorSpec>& output_specs) {
  for (const TensorSpec& spec : output_specs) {
    outputs.emplace_back(static_cast<std::size_t>(spec.nbytes()), kPoison);
  }
}

Buffers::Buffers(const Arguments& arguments, const std::vector<TensorSpec>& output_specs)
    : PoisonedOutputs(output_specs) {
  const auto fill = [&](std::vector<std::byte>& storage, const TensorView& view,
                        std::uint64_t salt) {
    storage.resize(static_cast<std::size_t>(view.nbytes()));
    testing::fill_random(storage.data(), storage.size(), arguments.seed + salt);
  };
  fill(tokens, arguments.tokens, 1);
  if (arguments.scales) fill(scales, *arguments.scales, 2);
  if (arguments.weight) fill(weight, *arguments.weight, 3);
}

std::vector<TensorView> PoisonedOutputs::output_views(const std::vector<TensorSpec>& output_specs) {
  std::vector<TensorView> views;
  for (std::size_t i = 0; i < output_specs.size(); ++i) {
    views.emplace_back(outputs[i].data(), output_specs[i].dtype, output_specs[i].shape);
  }
  return views;
}

bool PoisonedOutputs::outputs_untouched() const {
  for (const std::vector<std::byte>& output : outputs) {
    for (std::byte b : output) {
      if (b != kPoison) return false;
    }
  }
  return true;
}

testing::ReferenceInputs reference_inputs(const Arguments& arguments, const Buffers& buffers) {
  // Null means absent to the reference, so no rows point at a byte it never reads.
  static const std::byte kNoRows{};
  const auto rows_of = [](const std::vector<std::byte>& v) { return v.empty() ? &kNoRows : v.data(); };
  testing::ReferenceInputs in;
  in.num_ranks = arguments.counts.shape()[0];
  in.num_experts = arguments.counts.shape()[1];
  in.counts = arguments.count_values;
  in.tokens = buffers.tokens.data();
  in.token_row_bytes = row_bytes(arguments.tokens.spec);
  if (arguments.scales) {
    in.scales = rows_of(buffers.scales);
    in.scale_row_bytes = row_bytes(arguments.scales->spec);
  }
  if (arguments.weight) in.weight = rows_of(buffers.weight);
  in.expert_alignment = arguments.attributes.expert_alignment;
  return in;
}

void require_equal(const char* name, const std::vector<std::byte>& got, const void* expected,
                   std::size_t expected_bytes) {
  const std::string difference = testing::first_difference(
      name, got, static_cast<const std::byte*>(expected), expected_bytes);
  require(difference.empty(), difference + " (reference)");
}

void require_rows(const char* name, const std::vector<std::byte>& got,
                  const std::vector<std::byte>& expected, std::int64_t specified_rows,
                  std::int64_t row_bytes) {
  const std::string difference = testing::rows_difference(name, got.data(), got.size(), expected,
                                                          specified_rows, row_bytes);
  require(difference.empty(), difference + " (reference)");
}

void require_plan_tiles(const Plan& plan) {
  require(plan.num_threads() >= 1 && plan.thread_begin().front() == 0 &&
              plan.thread_begin().back() == static_cast<std::int64_t>(plan.chunks().size()),
          "plan: thread_begin does not partition the chunks");
  for (int t = 0; t < plan.num_threads(); ++t) {
    require(plan.thread_begin()[t] <= plan.thread_begin()[t + 1], "plan: thread_begin decreases");
  }
  // Destinations (pad rows included) tile the written rows in chunk order
  // (the CPU run zeroes a thread's chunks as one run of rows); the sources
  // of the moved rows are disjoint and add up to the valid rows.
  std::vector<std::pair<std::int64_t, std::int64_t>> sources;
  std::int64_t next = 0;
  for (const Chunk& chunk : plan.chunks()) {
    require(chunk.num_rows > 0, "plan: empty chunk");
    require(chunk.dst_row == next,
            "plan: chunks do not tile the destination rows in order at row " + std::to_string(next));
    next = chunk.dst_row + chunk.num_rows;
    if (chunk.src_row != kPadRows) sources.emplace_back(chunk.src_row, chunk.num_rows);
  }
  require(next == plan.num_written_rows(), "plan: chunks cover " + std::to_string(next) + " of " +
                                               std::to_string(plan.num_written_rows()) + " rows");
  std::sort(sources.begin(), sources.end());
  std::int64_t end = 0, moved = 0;
  for (const auto& [first, rows] : sources) {
    require(first >= end, "plan: source rows overlap at row " + std::to_string(first));
    end = first + rows;
    moved += rows;
  }
  require(moved == plan.num_valid_rows(), "plan: chunks move " + std::to_string(moved) + " of " +
                                              std::to_string(plan.num_valid_rows()) + " rows");
  require(end <= plan.input_specs()[0].shape[0], "plan: a source row past the tokens");
}

std::string break_one_output(FuzzedDataProvider& provider, const std::vector<TensorView*>& outputs,
                             const std::vector<const TensorView*>& inputs) {
  const int mode = provider.ConsumeIntegralInRange<int>(0, 7);
  const std::size_t index = provider.ConsumeIntegralInRange<std::size_t>(0, outputs.size() - 1);
  TensorView& output = *outputs[index];
  switch (mode) {
    case 1:
      output.spec.dtype = output.dtype() == DType::kFloat32 ? DType::kInt32 : DType::kFloat32;
      return "wrong dtype";
    case 2:
      output.spec.shape.dims[0] += 1;
      return "wrong dim 0";
    case 3: {
      if (output.nbytes() == 0) return "";
      const TensorView& input =
          *inputs[provider.ConsumeIntegralInRange<std::size_t>(0, inputs.size() - 1)];
      if (input.nbytes() == 0 || input.data == nullptr) return "";
      output.data = input.data;
      return "aliases an input";
    }
    case 4:
      if (output.nbytes() == 0) return "";
      output.data = nullptr;
      return "null data";
    case 5: {
      if (outputs.size() < 2 || output.nbytes() == 0) return "";
      std::size_t other = provider.ConsumeIntegralInRange<std::size_t>(0, outputs.size() - 2);
      other += other >= index ? 1 : 0;
      if (outputs[other]->nbytes() == 0) return "";
      output.data = outputs[other]->data;
      return "aliases another output";
    }
    default:
      return "";
  }
}

}  // namespace moe_reroute::fuzz
