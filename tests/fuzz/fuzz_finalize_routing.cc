// Fuzzes moe_finalize_routing (see fuzz_routing.h for what is checked): every
// drop_pad_mode (and any int64), shapes, ranks and dtypes valid or not, each
// optional input present or absent, row indices and bias ids in and out of
// range, and the float inputs as random bytes (NaNs, infinities, subnormals):
// an accepted call equals the reference bit for bit.

#include <algorithm>
#include <string>
#include <vector>

#include "fuzz_routing.h"
#include "moe_reroute/operator.h"
#include "routing_reference.h"

namespace moe_reroute::fuzz {
namespace {

// At most this many row indices and ids get values; larger ones are only inferred.
constexpr std::int64_t kMaxIndices = 4096;

bool capacity_mode(std::int64_t mode) {
  return mode == kFinalizeColumnMajorCapacity || mode == kFinalizeRowMajorCapacity;
}

testing::FloatType float_type(DType dtype) {
  return dtype == DType::kFloat16    ? testing::FloatType::kFloat16
         : dtype == DType::kBFloat16 ? testing::FloatType::kBFloat16
                                     : testing::FloatType::kFloat32;
}

struct FinalizeRouting {
  struct Case {
    FinalizeRoutingInputs inputs;
    FinalizeRoutingAttributes attributes;
    int num_threads = 0;
    bool runnable = false;
    // Storage of each input, in description order.
    std::vector<std::byte> storage[7];
    std::vector<std::int64_t> row_idx, ids;  // as stored, widened
  };

  static const FinalizeRoutingDesc& desc() { return finalize_routing_desc(); }

  static void decode(FuzzedDataProvider& provider, Case& c) {
    c.num_threads = provider.ConsumeIntegralInRange<int>(0, 4);
    const std::int64_t mode =
        draw_attribute(provider, kFinalizeColumnMajor, kFinalizeRowMajorCapacity);
    c.attributes.drop_pad_mode = mode;
    const bool capacity = capacity_mode(mode);
    const DType dtype = draw_dtype(provider, {DType::kFloat16, DType::kBFloat16, DType::kFloat32});
    const std::int64_t tokens = draw_size(provider, 8), hidden = draw_size(provider, 16);
    const bool with_scales = provider.ConsumeBool();
    const std::int64_t k = with_scales ? draw_size(provider, 4) : 1;
    const bool small = tokens >= 0 && tokens <= 64 && k >= 0 && k <= 64;
    const std::int64_t positions = small ? tokens * k : draw_size(provider, 16);
    const std::int64_t experts = draw_size(provider, 4), slots = draw_size(provider, 4);
    // Modes 0 and 2: fewer rows than positions at times (after active_num).
    std::int64_t rows = positions;
    if (positions > 0 && provider.ConsumeBool()) {
      rows -= provider.ConsumeIntegralInRange<std::int64_t>(0, positions);
    }

    FinalizeRoutingInputs& in = c.inputs;
    in.expanded_x = TensorView(nullptr, dtype,
                               capacity ? draw_shape_like(provider, {experts, slots, hidden})
                                        : draw_shape_like(provider, {rows, hidden}));
    in.expanded_row_idx = TensorView(nullptr, draw_dtype(provider, {DType::kInt32}),
                                     draw_shape_like(provider, {draw_rows(provider, positions)}));
    const auto token_shaped = [&] {
      return TensorView(nullptr, draw_dtype(provider, {dtype}),
                        draw_shape_like(provider, {draw_rows(provider, tokens), hidden}));
    };
    if (provider.ConsumeBool()) in.x1 = token_shaped();
    if (provider.ConsumeBool()) in.x2 = token_shaped();
    const bool with_bias = provider.ConsumeBool();
    if (with_bias) {
      const std::int64_t bias_rows =
          draw_rows(provider, capacity ? experts : draw_size(provider, 4));
      in.bias = TensorView(nullptr, draw_dtype(provider, {dtype}),
                           draw_shape_like(provider, {bias_rows, hidden}));
    }
    if (with_scales) {
      const DType scales_dtype = dtype == DType::kBFloat16
                                     ? draw_dtype(provider, {DType::kBFloat16, DType::kFloat32})
                                     : draw_dtype(provider, {dtype});
      in.scales = TensorView(nullptr, scales_dtype,
                             draw_shape_like(provider, {draw_rows(provider, tokens), k}));
    }
    if (with_bias ? provider.ConsumeIntegralInRange<int>(0, 7) != 7 : provider.ConsumeBool()) {
      in.expert_idx = TensorView(nullptr, draw_dtype(provider, {DType::kInt32}),
                                 draw_shape_like(provider, {draw_rows(provider, tokens), k}));
    }

    const auto seed = provider.ConsumeIntegral<std::uint64_t>();
    c.runnable = true;
    const auto attach = [&](TensorView& view, std::size_t input) {
      c.runnable = attach_random(view, c.storage[input], seed + input) && c.runnable;
    };
    attach(in.expanded_x, 0);
    if (in.x1) attach(*in.x1, 2);
    if (in.x2) attach(*in.x2, 3);
    if (in.bias) attach(*in.bias, 4);
    if (in.scales) attach(*in.scales, 5);

    // Row indices: mostly rows of expanded_x; -1 (dropped) often in modes 1
    // and 3; one past the rows, -2 and edge values now and then.
    const bool small_capacity = experts >= 0 && slots >= 0 && experts <= 64 && slots <= 64;
    const std::int64_t expanded_rows = !capacity ? rows : small_capacity ? experts * slots : 0;
    const auto draw_row = [&]() -> std::int64_t {
      const int pick = provider.ConsumeIntegralInRange<int>(0, 31);
      if (pick == 31) return draw_edge_value(provider);
      if (pick == 30) return expanded_rows;
      if (pick == 29) return -2;
      if (pick == 28 || (capacity && pick < 6)) return -1;
      // expanded_rows may be a drawn edge value: no `- 1` below zero (overflow).
      return provider.ConsumeIntegralInRange<std::int64_t>(
          0, expanded_rows > 0 ? expanded_rows - 1 : 0);
    };
    const std::int64_t bias_rows = in.bias && in.bias->shape().ndim >= 1 ? in.bias->shape()[0] : 0;
    const auto draw_id = [&]() -> std::int64_t {
      const int pick = provider.ConsumeIntegralInRange<int>(0, 31);
      if (pick == 31) return draw_edge_value(provider);
      if (pick == 30) return bias_rows;
      return provider.ConsumeIntegralInRange<std::int64_t>(
          0, bias_rows > 0 ? std::min<std::int64_t>(bias_rows - 1, 64) : 0);
    };
    const auto indices = [&](TensorView& view, std::size_t input, const auto& draw) {
      if (!small_enough({view.spec}) || view.shape().numel() > kMaxIndices) {
        c.runnable = false;
        return std::vector<std::int64_t>{};
      }
      return attach_indices(view, c.storage[input], seed + input, draw);
    };
    c.row_idx = indices(in.expanded_row_idx, 1, draw_row);
    if (in.expert_idx) c.ids = indices(*in.expert_idx, 6, draw_id);

    for (TensorView* view : {&in.expanded_x, &in.expanded_row_idx}) maybe_null(provider, *view);
    for (std::optional<TensorView>* view : {&in.x1, &in.x2, &in.bias, &in.scales, &in.expert_idx}) {
      if (*view) maybe_null(provider, **view);
    }
  }

  static std::string describe(const Case& c) {
    std::string text = "moe_finalize_routing";
    const std::vector<const TensorView*> views = inputs(c);
    for (std::size_t i = 0; i < views.size(); ++i) {
      if (!views[i]) continue;
      text += (i ? ", " : " ") + std::string(desc().inputs[i].name) + " " +
              fuzz::describe(*views[i]);
      if (i == 1) text += " = " + fuzz::describe(c.row_idx);
      if (i == 6) text += " = " + fuzz::describe(c.ids);
    }
    return text + ", drop_pad_mode " + std::to_string(c.attributes.drop_pad_mode) +
           ", num_threads " + std::to_string(c.num_threads);
  }

  static std::vector<const TensorView*> inputs(const Case& c) {
    const FinalizeRoutingInputs& in = c.inputs;
    const auto given = [](const std::optional<TensorView>& view) {
      return view ? &*view : nullptr;
    };
    return {&in.expanded_x, &in.expanded_row_idx, given(in.x1),        given(in.x2),
            given(in.bias), given(in.scales),     given(in.expert_idx)};
  }

  static std::vector<TensorSpec> infer(const Case& c) {
    return {infer_finalize_routing(c.inputs, c.attributes).out};
  }

  static void call(const Case& c, const std::vector<TensorView>& views) {
    moe_finalize_routing(c.inputs, {views[0]}, c.attributes, c.num_threads);
  }

  // A row index below -1, -1 in modes 0 and 2, at or past E * C in modes 1
  // and 3; then, with bias, an id that is not a row of bias.
  static std::string value_refusal(const Case& c) {
    const bool capacity = capacity_mode(c.attributes.drop_pad_mode);
    const Shape& ex = c.inputs.expanded_x.shape();
    for (std::size_t p = 0; p < c.row_idx.size(); ++p) {
      const std::int64_t row = c.row_idx[p];
      if (row < -1 || (row == -1 && !capacity) || (capacity && row >= ex[0] * ex[1])) {
        return "expanded_row_idx: [" + std::to_string(p) + "] = " + std::to_string(row);
      }
    }
    if (!c.inputs.bias) return "";
    const std::int64_t k = c.inputs.expert_idx->shape()[1], bias_rows = c.inputs.bias->shape()[0];
    for (std::size_t p = 0; p < c.ids.size(); ++p) {
      if (c.ids[p] < 0 || c.ids[p] >= bias_rows) {
        const auto position = static_cast<std::int64_t>(p);
        return "expert_idx: [" + std::to_string(position / k) + ", " +
               std::to_string(position % k) + "] = " + std::to_string(c.ids[p]);
      }
    }
    return "";
  }

  static void check_against_reference(const Case& c, const PoisonedOutputs& buffers) {
    const FinalizeRoutingInputs& in = c.inputs;
    const Shape& ex = in.expanded_x.shape();
    const bool capacity = capacity_mode(c.attributes.drop_pad_mode);
    const auto data = [&](std::size_t input, bool given) -> const void* {
      return given ? c.storage[input].data() : nullptr;
    };
    const auto row_idx = static_cast<const std::int32_t*>(in.expanded_row_idx.data);
    const auto ids =
        in.expert_idx ? static_cast<const std::int32_t*>(in.expert_idx->data) : nullptr;
    const std::vector<std::byte> expected = testing::reference_finalize_routing(
        {float_type(in.expanded_x.dtype()),
         in.scales ? float_type(in.scales->dtype()) : testing::FloatType::kFloat32,
         in.scales ? in.scales->shape()[0] : in.expanded_row_idx.shape()[0],
         in.scales ? in.scales->shape()[1] : 1, ex[ex.ndim - 1], c.attributes.drop_pad_mode,
         data(0, true), capacity ? ex[0] * ex[1] : ex[0], row_idx, data(2, in.x1.has_value()),
         data(3, in.x2.has_value()), data(4, in.bias.has_value()), data(5, in.scales.has_value()),
         ids});
    require_equal("out", buffers.outputs[0], expected.data(), expected.size());
  }
};

}  // namespace
}  // namespace moe_reroute::fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  return moe_reroute::fuzz::fuzz_routing<moe_reroute::fuzz::FinalizeRouting>(data, size);
}
