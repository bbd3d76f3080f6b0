// moe_init_routing and moe_finalize_routing: validation, shape inference,
// the layout of init's sort by expert, and the one-shot calls, which run on
// the CPU backend (src/cpu/routing.cc).

#include "routing.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "check.h"
#include "moe_reroute/operator.h"

namespace moe_reroute {
namespace detail {
namespace {

constexpr std::int64_t kIndexLimit = std::numeric_limits<std::int32_t>::max();

std::string str(std::int64_t value) { return std::to_string(value); }

std::string dims_string(std::initializer_list<std::int64_t> dims) {
  return Shape(dims).to_string();
}

// The dtype's value and the rank: the first checks of every view.
void check_view(const TensorView& view, const char* name, int ndim, const char* layout) {
  check_dtype_value(view, name);
  if (view.shape().ndim != ndim) {
    fail(ErrorCode::kInvalidArgument, std::string(name) + ": must be " + str(ndim) + "-D " +
                                          layout + ", got " + view.spec.to_string());
  }
  for (int d = 0; d < ndim; ++d) {
    if (view.shape()[d] < 0) {
      fail(ErrorCode::kInvalidArgument, std::string(name) + ": dim " + str(d) +
                                            " must be >= 0, got " + view.spec.to_string());
    }
  }
  checked_nbytes(view.spec, name);
}

void check_index_dtype(const TensorView& view, const char* name, bool int64_too) {
  if (view.dtype() == DType::kInt32 || (int64_too && view.dtype() == DType::kInt64)) return;
  fail(ErrorCode::kUnsupported, std::string(name) + ": dtype " +
                                    std::string(dtype_name(view.dtype())) + " is not int32" +
                                    (int64_too ? " or int64" : ""));
}

// Calls body(p, value) for each of the `size` elements of int32 or int64 `view`.
template <typename Body>
void for_each_index(const TensorView& view, std::int64_t size, const Body& body) {
  const auto each = [&]<typename T>(T) {
    for (std::int64_t p = 0; p < size; ++p) body(p, static_cast<std::int64_t>(load<T>(view.data, p)));
  };
  if (view.dtype() == DType::kInt32) {
    each(std::int32_t{});
  } else {
    each(std::int64_t{});
  }
}

// "[t, j]" of flat position p of a [T, k] view.
std::string position(std::int64_t p, std::int64_t k) {
  std::string text = "[";  // appended: GCC 12 warns falsely (-Wrestrict) on "[" + ...
  text += str(p / k);
  text += ", ";
  text += str(p % k);
  return text + "]";
}

void check_data(const TensorView& view, const char* name) {
  if (view.data == nullptr && view.nbytes() > 0) {
    fail(ErrorCode::kInvalidArgument, std::string(name) + ": data is null");
  }
}

template <typename A>
std::vector<NamedView> named(const OperatorDescOf<A>& op, std::span<const TensorView* const> views,
                             bool outputs) {
  std::vector<NamedView> list;
  for (std::size_t i = 0; i < views.size(); ++i) {
    if (views[i] == nullptr) continue;
    list.push_back({(outputs ? op.outputs[i].name : op.inputs[i].name).data(), views[i]});
  }
  return list;
}

std::vector<TensorSpec> specs_of(const std::vector<NamedView>& views) {
  std::vector<TensorSpec> specs;
  for (const NamedView& view : views) specs.push_back(view.view->spec);
  return specs;
}


// check_run_arguments on `op`'s views by name, with `extra` after the outputs.
template <typename A>
void check_named(const OperatorDescOf<A>& op, std::span<const TensorView* const> input_views,
                 std::span<const TensorView* const> output_views, std::vector<TensorSpec> specs,
                 const std::vector<NamedView>& extra) {
  const std::vector<NamedView> named_inputs = named(op, input_views, false);
  std::vector<NamedView> named_outputs = named(op, output_views, true);
  named_outputs.insert(named_outputs.end(), extra.begin(), extra.end());
  for (const NamedView& view : extra) specs.push_back(view.view->spec);
  check_run_arguments(specs_of(named_inputs), named_inputs, specs, named_outputs);
}

}  // namespace

InitRoutingCall validate(const InitRoutingInputs& inputs, const InitRoutingAttributes& attributes) {
  const TensorView& x = inputs.x;
  check_view(x, "x", 2, "[T, H]");
  const DTypeInfo& info = dtype_info(x.dtype());
  if (!(info.roles & kRoleToken)) {
    fail(ErrorCode::kUnsupported, "x: dtype " + std::string(info.name) +
                                      " is not a token dtype (float16, bfloat16, int8, "
                                      "float8_e5m2, float8_e4m3fn, hifloat8, float4_e2m1, "
                                      "float4_e1m2, float32, uint8)");
  }
  const std::int64_t tokens = x.shape()[0], hidden = x.shape()[1];
  if (hidden < 1) fail(ErrorCode::kInvalidArgument, "x: H must be >= 1, got " + str(hidden));
  if (info.bits < 8 && hidden % 2 != 0) {
    fail(ErrorCode::kInvalidArgument, "x: " + std::string(info.name) +
                                          " packs two elements per byte, so H must be even, got " +
                                          str(hidden));
  }
  const TensorView& ids = inputs.expert_idx;
  check_view(ids, "expert_idx", 2, "[T, k]");
  check_index_dtype(ids, "expert_idx", /*int64_too=*/true);
  if (ids.shape()[0] != tokens) {
    fail(ErrorCode::kInvalidArgument, "expert_idx: has " + str(ids.shape()[0]) +
                                          " rows but x has T = " + str(tokens));
  }
  const std::int64_t k = ids.shape()[1];
  if (k < 1) fail(ErrorCode::kInvalidArgument, "expert_idx: k must be >= 1, got 0");
  if (tokens > kIndexLimit / k) {
    fail(ErrorCode::kOutOfRange, "expert_idx: T * k = " + str(tokens) + " * " + str(k) +
                                     " exceeds the int32 index limit 2147483647");
  }

  const InitRoutingAttributes& a = attributes;
  if (a.active_num < 0) {
    fail(ErrorCode::kInvalidArgument, "active_num: must be >= 0, got " + str(a.active_num));
  }
  if (a.drop_pad_mode != kDropless && a.drop_pad_mode != kDropPad) {
    fail(ErrorCode::kInvalidArgument,
         "drop_pad_mode: must be 0 (dropless) or 1 (by capacity), got " + str(a.drop_pad_mode));
  }
  const std::int64_t flag = a.expert_tokens_count_or_cumsum_flag;
  if (flag < kExpertTokensNone || flag > kExpertTokensCount) {
    fail(ErrorCode::kInvalidArgument,
         "expert_tokens_count_or_cumsum_flag: must be 0 (none), 1 (cumsum) or 2 (count), got " +
             str(flag));
  }
  if (a.expert_num < 0) {
    fail(ErrorCode::kInvalidArgument, "expert_num: must be >= 0, got " + str(a.expert_num));
  }
  const bool capacity = a.drop_pad_mode == kDropPad;
  if (capacity) {
    if (a.expert_capacity < 1) {
      fail(ErrorCode::kInvalidArgument,
           "expert_capacity: must be >= 1 with drop_pad_mode 1, got " + str(a.expert_capacity));
    }
    if (a.expert_num < 1) {
      fail(ErrorCode::kInvalidArgument,
           "expert_num: must be >= 1 with drop_pad_mode 1, got " + str(a.expert_num));
    }
    if (a.expert_capacity > tokens) {
      fail(ErrorCode::kInvalidArgument, "expert_capacity: must be at most T = " + str(tokens) +
                                            " with drop_pad_mode 1, got " +
                                            str(a.expert_capacity));
    }
    if (a.expert_num > kIndexLimit / a.expert_capacity) {
      fail(ErrorCode::kOutOfRange, "expert_num: E * C = " + str(a.expert_num) + " * " +
                                       str(a.expert_capacity) +
                                       " exceeds the int32 index limit 2147483647");
    }
  } else if (flag != kExpertTokensNone && a.expert_num < 1) {
    fail(ErrorCode::kInvalidArgument, "expert_num: must be >= 1 with "
                                      "expert_tokens_count_or_cumsum_flag " +
                                          str(flag) + ", got " + str(a.expert_num));
  }

  InitRoutingCall call{a, tokens, k, row_bytes(x.spec), {}};
  const std::int64_t positions = tokens * k;
  const std::int64_t rows = a.active_num > 0 ? std::min(a.active_num, positions) : positions;
  const Shape expanded = capacity ? Shape{a.expert_num, a.expert_capacity, hidden}
                                  : Shape{rows, hidden};
  call.specs.expanded_x = {x.dtype(), expanded};
  checked_nbytes(call.specs.expanded_x, "expanded_x");
  call.specs.expanded_row_idx = {DType::kInt32, {positions}};
  call.specs.expert_tokens_count_or_cumsum = {
      DType::kInt32, {!capacity && flag != kExpertTokensNone ? a.expert_num : 0}};
  call.specs.expert_tokens_before_capacity = {
      DType::kInt32, {capacity && a.expert_tokens_before_capacity_flag ? a.expert_num : 0}};
  checked_nbytes(call.specs.expert_tokens_count_or_cumsum, "expert_tokens_count_or_cumsum");
  checked_nbytes(call.specs.expert_tokens_before_capacity, "expert_tokens_before_capacity");
  return call;
}

InitRoutingLayout init_routing_layout(const InitRoutingCall& call, const TensorView& expert_idx) {
  const InitRoutingAttributes& a = call.attributes;
  const std::int64_t positions = call.num_tokens * call.top_k;
  check_data(expert_idx, "expert_idx");
  // The ids read once: checked, and kept as int64 for the sort.
  std::vector<std::int64_t> ids(static_cast<std::size_t>(positions));
  std::int64_t max_id = -1;
  for_each_index(expert_idx, positions, [&](std::int64_t p, std::int64_t id) {
    if (id < 0 || (a.expert_num > 0 && id >= a.expert_num)) {
      fail(ErrorCode::kInvalidArgument,
           "expert_idx: " + position(p, call.top_k) + " = " + str(id) +
               (id < 0 ? " is negative" : " is not below expert_num = " + str(a.expert_num)));
    }
    max_id = std::max(max_id, id);
    ids[static_cast<std::size_t>(p)] = id;
  });

  // The stable sort by id: counting, unless the ids spread far past the positions.
  std::vector<std::int32_t> order(ids.size());
  const std::int64_t most_buckets = 2 * positions + 4096;
  const std::int64_t span = a.expert_num > 0 ? a.expert_num : max_id;  // max_id + 1 may overflow
  if (span <= most_buckets) {
    std::vector<std::int64_t> next(static_cast<std::size_t>(a.expert_num > 0 ? span : span + 1), 0);
    for (const std::int64_t id : ids) ++next[static_cast<std::size_t>(id)];
    std::exclusive_scan(next.begin(), next.end(), next.begin(), std::int64_t{0});
    for (std::size_t p = 0; p < ids.size(); ++p) {
      order[static_cast<std::size_t>(next[static_cast<std::size_t>(ids[p])]++)] =
          static_cast<std::int32_t>(p);
    }
  } else {
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](std::int32_t l, std::int32_t r) {
      return ids[static_cast<std::size_t>(l)] < ids[static_cast<std::size_t>(r)];
    });
  }
  // The ids per expert, where an output holds them (E of them, bounded by its spec).
  const auto per_expert = [&] {
    std::vector<std::int32_t> counts(static_cast<std::size_t>(a.expert_num), 0);
    for (const std::int64_t id : ids) ++counts[static_cast<std::size_t>(id)];
    return counts;
  };

  InitRoutingLayout layout;
  layout.row_idx.resize(order.size());
  if (a.drop_pad_mode == kDropless) {
    const std::int64_t rows = call.specs.expanded_x.shape[0];
    layout.source_token.resize(static_cast<std::size_t>(rows));
    for (std::size_t i = 0; i < order.size(); ++i) {
      layout.row_idx[static_cast<std::size_t>(order[i])] = static_cast<std::int32_t>(i);
      if (static_cast<std::int64_t>(i) < rows) layout.source_token[i] = order[i] / call.top_k;
    }
    const std::int64_t flag = a.expert_tokens_count_or_cumsum_flag;
    if (flag != kExpertTokensNone) {
      layout.expert_tokens = per_expert();
      if (flag == kExpertTokensCumsum) {
        std::inclusive_scan(layout.expert_tokens.begin(), layout.expert_tokens.end(),
                            layout.expert_tokens.begin());
      }
    }
    return layout;
  }
  // By capacity: the c-th entry of expert e in sort order fills slot e * C + c, or is dropped.
  const std::int64_t capacity = a.expert_capacity;
  layout.source_token.assign(static_cast<std::size_t>(a.expert_num * capacity), -1);
  std::int64_t start = 0;  // of the current expert's entries in `order`
  for (std::size_t i = 0; i < order.size(); ++i) {
    const std::int64_t id = ids[static_cast<std::size_t>(order[i])];
    if (i > 0 && id != ids[static_cast<std::size_t>(order[i - 1])]) start = static_cast<std::int64_t>(i);
    const std::int64_t c = static_cast<std::int64_t>(i) - start;
    std::int32_t slot = -1;
    if (c < capacity) {
      slot = static_cast<std::int32_t>(id * capacity + c);
      layout.source_token[static_cast<std::size_t>(slot)] = order[i] / call.top_k;
    }
    layout.row_idx[static_cast<std::size_t>(order[i])] = slot;
  }
  if (a.expert_tokens_before_capacity_flag) layout.tokens_before_capacity = per_expert();
  return layout;
}

FinalizeRoutingCall validate(const FinalizeRoutingInputs& inputs,
                             const FinalizeRoutingAttributes& attributes) {
  const std::int64_t mode = attributes.drop_pad_mode;
  if (mode < kFinalizeColumnMajor || mode > kFinalizeRowMajorCapacity) {
    fail(ErrorCode::kInvalidArgument, "drop_pad_mode: must be 0, 1, 2 or 3, got " + str(mode));
  }
  const bool capacity = mode == kFinalizeColumnMajorCapacity || mode == kFinalizeRowMajorCapacity;
  const TensorView& expanded = inputs.expanded_x;
  check_dtype_value(expanded, "expanded_x");
  const DType dtype = expanded.dtype();
  if (dtype != DType::kFloat16 && dtype != DType::kBFloat16 && dtype != DType::kFloat32) {
    fail(ErrorCode::kUnsupported, "expanded_x: dtype " + std::string(dtype_name(dtype)) +
                                      " is not float16, bfloat16 or float32");
  }
  check_view(expanded, "expanded_x", capacity ? 3 : 2,
             capacity ? "[E, C, H] with drop_pad_mode 1 and 3"
                      : "[T * k, H] with drop_pad_mode 0 and 2");
  const Shape& ex = expanded.shape();
  const std::int64_t hidden = ex[ex.ndim - 1];
  if (hidden < 1) fail(ErrorCode::kInvalidArgument, "expanded_x: H must be >= 1, got " + str(hidden));

  const TensorView& row_idx = inputs.expanded_row_idx;
  check_view(row_idx, "expanded_row_idx", 1, "[T * k]");
  check_index_dtype(row_idx, "expanded_row_idx", /*int64_too=*/false);

  FinalizeRoutingCall call{attributes, row_idx.shape()[0], 1, hidden,
                           capacity ? ex[0] * ex[1] : ex[0], 0, {}};
  const auto same_dtype = [&](const TensorView& view, const char* name) {
    check_dtype_value(view, name);
    if (view.dtype() != dtype) {
      fail(ErrorCode::kUnsupported, std::string(name) + ": dtype " +
                                        std::string(dtype_name(view.dtype())) +
                                        " is not expanded_x's " + std::string(dtype_name(dtype)));
    }
  };
  if (inputs.scales) {
    const TensorView& scales = *inputs.scales;
    check_view(scales, "scales", 2, "[T, k]");
    if (scales.dtype() != dtype && scales.dtype() != DType::kFloat32) {
      fail(ErrorCode::kUnsupported,
           "scales: dtype " + std::string(dtype_name(scales.dtype())) + " does not pair with " +
               "expanded_x's " + std::string(dtype_name(dtype)) + " (the same dtype, or float32)");
    }
    call.num_tokens = scales.shape()[0];
    call.top_k = scales.shape()[1];
    if (call.top_k < 1) fail(ErrorCode::kInvalidArgument, "scales: k must be >= 1, got 0");
    if (row_idx.shape()[0] != call.num_tokens * call.top_k) {
      fail(ErrorCode::kInvalidArgument,
           "expanded_row_idx: has " + str(row_idx.shape()[0]) + " rows but scales is " +
               scales.spec.to_string() + ": T * k = " + str(call.num_tokens * call.top_k));
    }
  }
  const std::int64_t tokens = call.num_tokens;
  const auto token_shaped = [&](const std::optional<TensorView>& view, const char* name) {
    if (!view) return;
    same_dtype(*view, name);
    if (!(view->shape() == Shape{tokens, hidden})) {
      fail(ErrorCode::kInvalidArgument, std::string(name) + ": must be [T, H] = " +
                                            dims_string({tokens, hidden}) + ", got " +
                                            view->spec.to_string());
    }
    checked_nbytes(view->spec, name);
  };
  if (inputs.x2 && !inputs.x1) fail(ErrorCode::kInvalidArgument, "x2: needs x1");
  token_shaped(inputs.x1, "x1");
  token_shaped(inputs.x2, "x2");
  if (inputs.bias) {
    if (!inputs.expert_idx) fail(ErrorCode::kInvalidArgument, "bias: needs expert_idx");
    const TensorView& bias = *inputs.bias;
    same_dtype(bias, "bias");
    const Shape& b = bias.shape();
    if (b.ndim != 2 || b[1] != hidden || b[0] < 0 || (capacity && b[0] != ex[0])) {
      fail(ErrorCode::kInvalidArgument,
           "bias: must be [E, H] = " +
               (capacity ? dims_string({ex[0], hidden}) : "[E, " + str(hidden) + "]") + ", got " +
               bias.spec.to_string());
    }
    checked_nbytes(bias.spec, "bias");
    call.bias_rows = b[0];
  }
  if (inputs.expert_idx) {
    const TensorView& ids = *inputs.expert_idx;
    check_dtype_value(ids, "expert_idx");
    check_index_dtype(ids, "expert_idx", /*int64_too=*/false);
    if (!(ids.shape() == Shape{tokens, call.top_k})) {
      fail(ErrorCode::kInvalidArgument, "expert_idx: must be [T, k] = " +
                                            dims_string({tokens, call.top_k}) + ", got " +
                                            ids.spec.to_string());
    }
  }
  call.specs.out = {dtype, {tokens, hidden}};
  checked_nbytes(call.specs.out, "out");
  return call;
}

void check_finalize_values(const FinalizeRoutingCall& call, const FinalizeRoutingInputs& inputs) {
  const std::int64_t mode = call.attributes.drop_pad_mode;
  const bool capacity = mode == kFinalizeColumnMajorCapacity || mode == kFinalizeRowMajorCapacity;
  const TensorView& row_idx = inputs.expanded_row_idx;
  check_data(row_idx, "expanded_row_idx");
  for_each_index(row_idx, row_idx.shape()[0], [&](std::int64_t p, std::int64_t row) {
    const std::string at = "expanded_row_idx: [" + str(p) + "] = " + str(row);
    if (row < -1) fail(ErrorCode::kInvalidArgument, at + " is below -1");
    if (row == -1 && !capacity) {
      fail(ErrorCode::kInvalidArgument,
           at + " (a dropped row) needs drop_pad_mode 1 or 3, got " + str(mode));
    }
    if (capacity && row >= call.expanded_rows) {
      fail(ErrorCode::kInvalidArgument,
           at + " is not below E * C = " + str(call.expanded_rows));
    }
  });
  if (inputs.bias) {
    check_data(*inputs.expert_idx, "expert_idx");
    for_each_index(*inputs.expert_idx, call.num_tokens * call.top_k,
                   [&](std::int64_t p, std::int64_t id) {
                     if (id < 0 || id >= call.bias_rows) {
                       fail(ErrorCode::kInvalidArgument,
                            "expert_idx: " + position(p, call.top_k) + " = " + str(id) +
                                " is not a row of bias (E = " + str(call.bias_rows) + ")");
                     }
                   });
  }
}

void check_arguments(const InitRoutingCall& call, const InitRoutingInputs& inputs,
                     const InitRoutingOutputs& outputs, const std::vector<NamedView>& extra) {
  const TensorView* input_views[] = {&inputs.x, &inputs.expert_idx};
  const TensorView* output_views[] = {&outputs.expanded_x, &outputs.expanded_row_idx,
                                      &outputs.expert_tokens_count_or_cumsum,
                                      &outputs.expert_tokens_before_capacity};
  check_named(init_routing_desc(), input_views, output_views,
              {call.specs.expanded_x, call.specs.expanded_row_idx,
               call.specs.expert_tokens_count_or_cumsum, call.specs.expert_tokens_before_capacity},
              extra);
}

void check_arguments(const FinalizeRoutingCall& call, const FinalizeRoutingInputs& inputs,
                     const FinalizeRoutingOutputs& outputs, const std::vector<NamedView>& extra) {
  const TensorView* input_views[] = {&inputs.expanded_x,   &inputs.expanded_row_idx,
                                     given(inputs.x1),     given(inputs.x2),
                                     given(inputs.bias),   given(inputs.scales),
                                     given(inputs.expert_idx)};
  const TensorView* output_views[] = {&outputs.out};
  check_named(finalize_routing_desc(), input_views, output_views, {call.specs.out}, extra);
}

}  // namespace detail

InitRoutingOutputSpecs infer_init_routing(const InitRoutingInputs& inputs,
                                          const InitRoutingAttributes& attributes) {
  return detail::validate(inputs, attributes).specs;
}

FinalizeRoutingOutputSpecs infer_finalize_routing(const FinalizeRoutingInputs& inputs,
                                                  const FinalizeRoutingAttributes& attributes) {
  return detail::validate(inputs, attributes).specs;
}

void moe_init_routing(const InitRoutingInputs& inputs, const InitRoutingOutputs& outputs,
                      const InitRoutingAttributes& attributes, int num_threads) {
  detail::check_num_threads(num_threads);
  const detail::InitRoutingCall call = detail::validate(inputs, attributes);
  detail::check_arguments(call, inputs, outputs);
  const detail::InitRoutingLayout layout = detail::init_routing_layout(call, inputs.expert_idx);
  detail::cpu::init_routing(call, layout, inputs, outputs, num_threads);
}

void moe_finalize_routing(const FinalizeRoutingInputs& inputs,
                          const FinalizeRoutingOutputs& outputs,
                          const FinalizeRoutingAttributes& attributes, int num_threads) {
  detail::check_num_threads(num_threads);
  const detail::FinalizeRoutingCall call = detail::validate(inputs, attributes);
  detail::check_arguments(call, inputs, outputs);
  detail::check_finalize_values(call, inputs);
  detail::cpu::finalize_routing(call, inputs, outputs, num_threads);
}

}  // namespace moe_reroute
