// Fuzzes moe_init_routing (see fuzz_routing.h for what is checked): shapes,
// ranks and dtypes valid or not, any int64 attributes, expert ids in and out
// of range (edge values, and expert_num past the counting sort's reach).

#include <string>
#include <vector>

#include "fuzz_routing.h"
#include "moe_reroute/operator.h"
#include "routing_reference.h"

namespace moe_reroute::fuzz {
namespace {

// At most this many ids get values; larger id tensors are only inferred.
constexpr std::int64_t kMaxIds = 4096;

struct InitRouting {
  struct Case {
    InitRoutingInputs inputs;
    InitRoutingAttributes attributes;
    int num_threads = 0;
    bool runnable = false;
    std::vector<std::byte> x, expert_idx;
    std::vector<std::int64_t> ids;  // as stored, widened
  };

  static const InitRoutingDesc& desc() { return init_routing_desc(); }

  static void decode(FuzzedDataProvider& provider, Case& c) {
    c.num_threads = provider.ConsumeIntegralInRange<int>(0, 4);
    InitRoutingAttributes& a = c.attributes;
    a.drop_pad_mode = draw_attribute(provider, kDropless, kDropPad);
    // One in 8 an expert_num past 2 T k + 4096, where the sort compares instead of counting.
    a.expert_num = provider.ConsumeIntegralInRange<int>(0, 7) == 7
                       ? provider.ConsumeIntegralInRange<std::int64_t>(0, 1 << 14)
                       : draw_attribute(provider, 0, 8);
    a.expert_tokens_count_or_cumsum_flag =
        draw_attribute(provider, kExpertTokensNone, kExpertTokensCount);
    a.expert_tokens_before_capacity_flag = provider.ConsumeBool();
    const std::int64_t tokens = draw_size(provider, 12), k = draw_size(provider, 4);
    const bool small = tokens >= 0 && tokens <= 64 && k >= 0 && k <= 64;
    a.active_num =
        provider.ConsumeBool() ? 0 : draw_attribute(provider, 0, small ? tokens * k + 2 : 8);
    a.expert_capacity = draw_attribute(provider, 0, small ? tokens : 4);

    const DType x_dtype = draw_dtype(
        provider, {DType::kInt8, DType::kFloat16, DType::kBFloat16, DType::kFloat32,
                   DType::kFloat8E4M3FN, DType::kFloat4E2M1, DType::kUInt8});
    const std::int64_t hidden = draw_size(provider, 24);
    c.inputs.x = TensorView(nullptr, x_dtype, draw_shape_like(provider, {tokens, hidden}));
    const DType id_dtype = draw_dtype(provider, {DType::kInt32, DType::kInt64});
    c.inputs.expert_idx =
        TensorView(nullptr, id_dtype, draw_shape_like(provider, {draw_rows(provider, tokens), k}));

    const auto seed = provider.ConsumeIntegral<std::uint64_t>();
    const bool x_stored = attach_random(c.inputs.x, c.x, seed);
    const std::int64_t bound = a.expert_num > 0 && a.expert_num <= (1 << 14) ? a.expert_num : 8;
    const auto draw_id = [&] {
      const int pick = provider.ConsumeIntegralInRange<int>(0, 31);
      if (pick == 31) return draw_edge_value(provider);
      if (pick == 30) return a.expert_num;  // the first id out of range
      return provider.ConsumeIntegralInRange<std::int64_t>(0, bound - 1);
    };
    const bool ids_stored = small_enough({c.inputs.expert_idx.spec}) &&
                            c.inputs.expert_idx.shape().numel() <= kMaxIds;
    if (ids_stored) c.ids = attach_indices(c.inputs.expert_idx, c.expert_idx, seed + 1, draw_id);
    c.runnable = x_stored && ids_stored;
    maybe_null(provider, c.inputs.x);
    maybe_null(provider, c.inputs.expert_idx);
  }

  static std::string describe(const Case& c) {
    const InitRoutingAttributes& a = c.attributes;
    return "moe_init_routing x " + fuzz::describe(c.inputs.x) + ", expert_idx " +
           fuzz::describe(c.inputs.expert_idx) + " = " + fuzz::describe(c.ids) +
           ", active_num " + std::to_string(a.active_num) + ", expert_capacity " +
           std::to_string(a.expert_capacity) + ", expert_num " + std::to_string(a.expert_num) +
           ", drop_pad_mode " + std::to_string(a.drop_pad_mode) +
           ", expert_tokens_count_or_cumsum_flag " +
           std::to_string(a.expert_tokens_count_or_cumsum_flag) +
           ", expert_tokens_before_capacity_flag " +
           std::to_string(a.expert_tokens_before_capacity_flag) + ", num_threads " +
           std::to_string(c.num_threads);
  }

  static std::vector<const TensorView*> inputs(const Case& c) {
    return {&c.inputs.x, &c.inputs.expert_idx};
  }

  static std::vector<TensorSpec> infer(const Case& c) {
    const InitRoutingOutputSpecs specs = infer_init_routing(c.inputs, c.attributes);
    return {specs.expanded_x, specs.expanded_row_idx, specs.expert_tokens_count_or_cumsum,
            specs.expert_tokens_before_capacity};
  }

  static void call(const Case& c, const std::vector<TensorView>& views) {
    moe_init_routing(c.inputs, {views[0], views[1], views[2], views[3]}, c.attributes,
                     c.num_threads);
  }

  // An id below 0, or at or past expert_num where that is set.
  static std::string value_refusal(const Case& c) {
    const std::int64_t k = c.inputs.expert_idx.shape()[1], experts = c.attributes.expert_num;
    for (std::size_t p = 0; p < c.ids.size(); ++p) {
      if (c.ids[p] < 0 || (experts > 0 && c.ids[p] >= experts)) {
        const auto position = static_cast<std::int64_t>(p);
        return "expert_idx: [" + std::to_string(position / k) + ", " +
               std::to_string(position % k) + "] = " + std::to_string(c.ids[p]);
      }
    }
    return "";
  }

  static void check_against_reference(const Case& c, const PoisonedOutputs& buffers) {
    const InitRoutingAttributes& a = c.attributes;
    const testing::InitReferenceOutputs expected = testing::reference_init_routing(
        {c.x.data(), c.inputs.x.shape()[0], row_bytes(c.inputs.x.spec), c.ids,
         c.inputs.expert_idx.shape()[1], a.active_num, a.expert_capacity, a.expert_num,
         a.drop_pad_mode, a.expert_tokens_count_or_cumsum_flag,
         a.expert_tokens_before_capacity_flag});
    const auto require_ints = [&](const char* name, std::size_t output,
                                  const std::vector<std::int32_t>& values) {
      require_equal(name, buffers.outputs[output], values.data(), values.size() * 4);
    };
    require_equal("expanded_x", buffers.outputs[0], expected.expanded_x.data(),
                  expected.expanded_x.size());
    require_ints("expanded_row_idx", 1, expected.expanded_row_idx);
    require_ints("expert_tokens_count_or_cumsum", 2, expected.count_or_cumsum);
    require_ints("expert_tokens_before_capacity", 3, expected.before_capacity);
  }
};

}  // namespace
}  // namespace moe_reroute::fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  return moe_reroute::fuzz::fuzz_routing<moe_reroute::fuzz::InitRouting>(data, size);
}
