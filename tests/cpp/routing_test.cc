// moe_init_routing and moe_finalize_routing against the naive reference
// (testing/routing_reference.cc) over random cases, byte for byte, outputs
// poisoned first; and every bad input refused, naming the argument, with
// nothing written.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "moe_reroute/moe_reroute.h"
#include "reference.h"
#include "routing_reference.h"

namespace moe_reroute {
namespace {

using testing::FloatType;
using testing::kPoison;

std::size_t at(std::int64_t i) { return static_cast<std::size_t>(i); }

std::vector<std::byte> random_bytes(std::mt19937_64& rng, std::int64_t size) {
  std::vector<std::byte> bytes(at(size));
  for (std::byte& b : bytes) b = static_cast<std::byte>(rng());
  return bytes;
}

// A poisoned output buffer of `spec` and its view.
struct Output {
  std::vector<std::byte> bytes;
  TensorView view;
  explicit Output(const TensorSpec& spec)
      : bytes(at(spec.nbytes()), kPoison), view(bytes.data(), spec.dtype, spec.shape) {}
  bool untouched() const {
    return std::all_of(bytes.begin(), bytes.end(), [](std::byte b) { return b == kPoison; });
  }
};

template <typename T>
std::vector<std::byte> bytes_of(const std::vector<T>& values) {
  std::vector<std::byte> bytes(values.size() * sizeof(T));
  if (!bytes.empty()) std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

// ---- moe_init_routing ----

struct InitCase {
  DType dtype;
  DType id_dtype;
  std::int64_t tokens, k, hidden;
  InitRoutingAttributes attributes;
  bool skewed = false;
};

void check_init(const InitCase& c, std::uint64_t seed, int num_threads) {
  SCOPED_TRACE(::testing::Message()
               << "dtype " << dtype_name(c.dtype) << " ids " << dtype_name(c.id_dtype) << " T "
               << c.tokens << " k " << c.k << " H " << c.hidden << " mode "
               << c.attributes.drop_pad_mode << " active " << c.attributes.active_num << " C "
               << c.attributes.expert_capacity << " E " << c.attributes.expert_num << " flag "
               << c.attributes.expert_tokens_count_or_cumsum_flag << " threads " << num_threads);
  std::mt19937_64 rng(seed);
  const TensorSpec x_spec{c.dtype, {c.tokens, c.hidden}};
  const std::vector<std::byte> x = random_bytes(rng, x_spec.nbytes());
  const std::int64_t bound = c.attributes.expert_num > 0 ? c.attributes.expert_num : 40;
  std::vector<std::int64_t> ids(at(c.tokens * c.k));
  for (std::int64_t& id : ids) {
    id = c.skewed && rng() % 4 != 0 ? 0 : static_cast<std::int64_t>(rng() % at(bound));
  }
  std::vector<std::byte> id_bytes;
  if (c.id_dtype == DType::kInt32) {
    id_bytes = bytes_of(std::vector<std::int32_t>(ids.begin(), ids.end()));
  } else {
    id_bytes = bytes_of(ids);
  }
  const InitRoutingInputs inputs{TensorView(x.data(), c.dtype, x_spec.shape),
                                 TensorView(id_bytes.data(), c.id_dtype, {c.tokens, c.k})};
  const InitRoutingOutputSpecs specs = infer_init_routing(inputs, c.attributes);
  Output expanded(specs.expanded_x), row_idx(specs.expanded_row_idx),
      counts(specs.expert_tokens_count_or_cumsum), before(specs.expert_tokens_before_capacity);
  moe_init_routing(inputs, {expanded.view, row_idx.view, counts.view, before.view}, c.attributes,
                   num_threads);

  const InitRoutingAttributes& a = c.attributes;
  const testing::InitReferenceOutputs want = testing::reference_init_routing(
      {x.data(), c.tokens, x_spec.nbytes() / std::max<std::int64_t>(c.tokens, 1), ids, c.k,
       a.active_num, a.expert_capacity, a.expert_num, a.drop_pad_mode,
       a.expert_tokens_count_or_cumsum_flag, a.expert_tokens_before_capacity_flag});
  EXPECT_EQ(testing::first_difference("expanded_x", expanded.bytes, want.expanded_x.data(),
                                      want.expanded_x.size()),
            "");
  const auto expect_ints = [](const char* name, const Output& got,
                              const std::vector<std::int32_t>& expected) {
    const std::vector<std::byte> bytes = bytes_of(expected);
    EXPECT_EQ(testing::first_difference(name, got.bytes, bytes.data(), bytes.size()), "");
  };
  expect_ints("expanded_row_idx", row_idx, want.expanded_row_idx);
  expect_ints("expert_tokens_count_or_cumsum", counts, want.count_or_cumsum);
  expect_ints("expert_tokens_before_capacity", before, want.before_capacity);
}

TEST(InitRouting, MatchesTheReferenceOverRandomCases) {
  const DType dtypes[] = {DType::kFloat16, DType::kBFloat16, DType::kInt8,   DType::kFloat32,
                          DType::kFloat8E4M3FN, DType::kFloat4E2M1, DType::kUInt8};
  std::mt19937_64 rng(42);
  int cases = 0;
  for (const DType dtype : dtypes) {
    for (const std::int64_t tokens : {0, 1, 7, 64}) {
      for (const std::int64_t k : {1, 2, 8}) {
        for (const std::int64_t mode : {kDropless, kDropPad}) {
          if (mode == kDropPad && tokens == 0) continue;  // C must be in [1, T]
          InitCase c{dtype, rng() % 2 ? DType::kInt32 : DType::kInt64, tokens, k,
                     dtype == DType::kFloat4E2M1 ? 6 : static_cast<std::int64_t>(1 + rng() % 37),
                     {}, rng() % 3 == 0};
          InitRoutingAttributes& a = c.attributes;
          a.drop_pad_mode = mode;
          a.expert_num = 1 + static_cast<std::int64_t>(rng() % 9);
          if (mode == kDropless) {
            a.active_num = rng() % 2 ? 0 : static_cast<std::int64_t>(rng() % (tokens * k + 3));
            a.expert_tokens_count_or_cumsum_flag = static_cast<std::int64_t>(rng() % 3);
            if (a.expert_tokens_count_or_cumsum_flag == 0 && rng() % 2) a.expert_num = 0;
          } else {
            a.expert_capacity = 1 + static_cast<std::int64_t>(rng() % at(tokens));
            a.expert_tokens_before_capacity_flag = rng() % 2;
          }
          check_init(c, rng(), 1 + static_cast<int>(rng() % 3));
          ++cases;
        }
      }
    }
  }
  EXPECT_EQ(cases, 7 * (4 * 3 * 2 - 3));
}

TEST(InitRouting, LargeRowsAndThreadsGiveTheSameBytes) {
  for (const int threads : {1, 2, 5}) {
    InitCase c{DType::kBFloat16, DType::kInt32, 300, 4, 2048, {}};
    c.attributes.expert_num = 16;
    c.attributes.expert_tokens_count_or_cumsum_flag = kExpertTokensCount;
    check_init(c, 7, threads);
    c.attributes = {};
    c.attributes.drop_pad_mode = kDropPad;
    c.attributes.expert_num = 16;
    c.attributes.expert_capacity = 50;
    c.attributes.expert_tokens_before_capacity_flag = true;
    c.skewed = true;
    check_init(c, 8, threads);
  }
}

TEST(InitRouting, UnboundedIdsSortStably) {
  // expert_num 0: ids far apart take the comparison sort.
  std::vector<std::int64_t> ids = {1'000'000'000'000, 5, 1'000'000'000'000, 0, 5, 3};
  std::vector<std::int16_t> x = {10, 11, 12, 13, 14, 15};
  const InitRoutingInputs inputs{TensorView(x.data(), DType::kFloat16, {6, 1}),
                                 TensorView(ids.data(), DType::kInt64, {6, 1})};
  std::vector<std::int16_t> expanded(6);
  std::vector<std::int32_t> row_idx(6);
  moe_init_routing(inputs,
                   {TensorView(expanded.data(), DType::kFloat16, {6, 1}),
                    TensorView(row_idx.data(), DType::kInt32, {6}),
                    TensorView(nullptr, DType::kInt32, {0}), TensorView(nullptr, DType::kInt32, {0})});
  EXPECT_EQ(expanded, (std::vector<std::int16_t>{13, 15, 11, 14, 10, 12}));
  EXPECT_EQ(row_idx, (std::vector<std::int32_t>{4, 2, 5, 0, 3, 1}));
}

TEST(InitRouting, CountsAreWrittenWhenTheExpertsOutnumberThePositions) {
  // Far more experts than positions sort by comparison; the counts are still written.
  for (const std::int64_t mode : {kDropless, kDropPad}) {
    InitCase c{DType::kFloat32, DType::kInt32, 7, 3, 2, {}};
    c.attributes.drop_pad_mode = mode;
    c.attributes.expert_num = 12657;
    c.attributes.expert_capacity = 1;
    c.attributes.expert_tokens_count_or_cumsum_flag = kExpertTokensCount;
    c.attributes.expert_tokens_before_capacity_flag = true;
    check_init(c, 3, 1);
  }
}

TEST(InitRouting, TheLargestIdSortsWithoutOverflow) {
  std::vector<std::int64_t> ids = {std::numeric_limits<std::int64_t>::max(), 0};
  std::vector<float> x = {1.0f, 2.0f};
  std::vector<float> expanded(2);
  std::vector<std::int32_t> row_idx(2);
  moe_init_routing({TensorView(x.data(), DType::kFloat32, {2, 1}),
                    TensorView(ids.data(), DType::kInt64, {2, 1})},
                   {TensorView(expanded.data(), DType::kFloat32, {2, 1}),
                    TensorView(row_idx.data(), DType::kInt32, {2}),
                    TensorView(nullptr, DType::kInt32, {0}), TensorView(nullptr, DType::kInt32, {0})});
  EXPECT_EQ(expanded, (std::vector<float>{2.0f, 1.0f}));
  EXPECT_EQ(row_idx, (std::vector<std::int32_t>{1, 0}));
}

TEST(InitRouting, RefusesCountsPastInt64) {
  std::vector<std::int32_t> ids = {0};
  std::vector<float> x = {1.0f};
  InitRoutingAttributes a;
  a.expert_num = std::int64_t{1} << 62;
  a.expert_tokens_count_or_cumsum_flag = kExpertTokensCount;
  try {
    infer_init_routing({TensorView(x.data(), DType::kFloat32, {1, 1}),
                        TensorView(ids.data(), DType::kInt32, {1, 1})},
                       a);
    ADD_FAILURE() << "no error";
  } catch (const Error& error) {
    EXPECT_EQ(std::string(error.what()).rfind("expert_tokens_count_or_cumsum:", 0), 0u)
        << error.what();
  }
}

// Each bad call: the error names `argument`, and no output byte is written.
struct BadInit {
  std::string argument;
  std::function<void(InitRoutingInputs&, InitRoutingAttributes&)> change;
};

TEST(InitRouting, RefusesBadInputsNamingTheArgumentBeforeWriting) {
  std::vector<std::int32_t> ids = {0, 1, 2, 3, 1, 0};  // [3, 2]
  std::vector<float> x(3 * 4, 1.0f);
  const std::vector<BadInit> cases = {
      {"x", [](auto& in, auto&) { in.x.spec.shape = {12}; }},
      {"x", [](auto& in, auto&) { in.x.spec.dtype = DType::kInt32; }},
      {"expert_idx", [](auto& in, auto&) { in.expert_idx.spec.shape = {6}; }},
      {"expert_idx", [](auto& in, auto&) { in.expert_idx.spec.shape = {2, 3}; }},
      {"expert_idx", [](auto& in, auto&) { in.expert_idx.spec.dtype = DType::kFloat32; }},
      {"active_num", [](auto&, auto& a) { a.active_num = -1; }},
      {"drop_pad_mode", [](auto&, auto& a) { a.drop_pad_mode = 2; }},
      {"expert_capacity", [](auto&, auto& a) { a.drop_pad_mode = 1; a.expert_num = 4; }},
      {"expert_num", [](auto&, auto& a) { a.drop_pad_mode = 1; a.expert_capacity = 2; a.expert_num = 0; }},
      {"expert_capacity", [](auto&, auto& a) { a.drop_pad_mode = 1; a.expert_num = 4; a.expert_capacity = 4; }},
      {"expert_tokens_count_or_cumsum_flag", [](auto&, auto& a) { a.expert_tokens_count_or_cumsum_flag = 3; }},
      {"expert_num", [](auto&, auto& a) { a.expert_tokens_count_or_cumsum_flag = 1; a.expert_num = 0; }},
      {"expert_idx", [&](auto&, auto& a) { a.expert_num = 3; }},  // id 3 is not below 3
      {"expert_idx", [&](auto& in, auto&) {
         static std::int32_t negative[] = {0, 1, 2, -1, 1, 0};
         in.expert_idx.data = negative;
       }},
  };
  for (const BadInit& bad : cases) {
    InitRoutingInputs inputs{TensorView(x.data(), DType::kFloat32, {3, 4}),
                             TensorView(ids.data(), DType::kInt32, {3, 2})};
    InitRoutingAttributes attributes;
    attributes.expert_num = 4;
    bad.change(inputs, attributes);
    Output expanded(TensorSpec{DType::kFloat32, {6, 4}}), row_idx(TensorSpec{DType::kInt32, {6}});
    try {
      moe_init_routing(inputs, {expanded.view, row_idx.view, TensorView(nullptr, DType::kInt32, {0}),
                                TensorView(nullptr, DType::kInt32, {0})},
                       attributes);
      ADD_FAILURE() << "no error for " << bad.argument;
    } catch (const Error& error) {
      EXPECT_EQ(std::string(error.what()).rfind(bad.argument + ":", 0), 0u) << error.what();
    }
    EXPECT_TRUE(expanded.untouched() && row_idx.untouched()) << bad.argument;
  }
}

TEST(InitRouting, RefusesAWrongOutputOrAnOverlap) {
  std::vector<std::int32_t> ids = {0, 1, 1};
  std::vector<float> x(3, 2.0f);
  const InitRoutingInputs inputs{TensorView(x.data(), DType::kFloat32, {3, 1}),
                                 TensorView(ids.data(), DType::kInt32, {3, 1})};
  Output expanded(TensorSpec{DType::kFloat32, {3, 1}}), row_idx(TensorSpec{DType::kInt32, {3}});
  const TensorView none(nullptr, DType::kInt32, {0});
  EXPECT_THROW(moe_init_routing(inputs, {row_idx.view, row_idx.view, none, none}), Error);
  EXPECT_THROW(moe_init_routing(inputs, {inputs.x, row_idx.view, none, none}), Error);
  EXPECT_TRUE(expanded.untouched() && row_idx.untouched());
}

// ---- moe_finalize_routing ----

DType dtype_of(FloatType type) {
  return type == FloatType::kFloat16    ? DType::kFloat16
         : type == FloatType::kBFloat16 ? DType::kBFloat16
                                        : DType::kFloat32;
}

// Random finite values of `type`, a few exact zeros and negative zeros.
std::vector<std::byte> random_floats(std::mt19937_64& rng, FloatType type, std::int64_t count) {
  std::uniform_real_distribution<float> value(-4.0f, 4.0f);
  std::vector<std::byte> bytes;
  for (std::int64_t i = 0; i < count; ++i) {
    const std::uint64_t pick = rng() % 16;
    const float v = pick == 0 ? 0.0f : pick == 1 ? -0.0f : value(rng);
    const std::vector<std::byte> element = testing::reference_store(type, v);
    bytes.insert(bytes.end(), element.begin(), element.end());
  }
  return bytes;
}

struct FinalizeCase {
  FloatType dtype;
  FloatType scales_dtype;
  std::int64_t tokens, k, hidden, mode;
  bool x1, x2, bias, scales, expert_idx;
};

void check_finalize(const FinalizeCase& c, std::uint64_t seed, int num_threads) {
  SCOPED_TRACE(::testing::Message()
               << "dtype " << static_cast<int>(c.dtype) << " T " << c.tokens << " k " << c.k
               << " H " << c.hidden << " mode " << c.mode << " x1 " << c.x1 << " x2 " << c.x2
               << " bias " << c.bias << " scales " << c.scales << " threads " << num_threads);
  std::mt19937_64 rng(seed);
  const std::int64_t T = c.tokens, k = c.k, H = c.hidden, positions = T * k;
  const bool capacity = c.mode == 1 || c.mode == 3;
  const std::int64_t experts = 1 + static_cast<std::int64_t>(rng() % 5);
  const std::int64_t slots = 1 + static_cast<std::int64_t>(rng() % 6);
  // Modes 0 and 2: fewer rows than positions at times (active_num), so some are skipped.
  const std::int64_t rows = capacity ? experts * slots
                                     : positions - static_cast<std::int64_t>(rng() % 3 == 0
                                                                                ? rng() % (positions + 1)
                                                                                : 0);
  const Shape expanded_shape = capacity ? Shape{experts, slots, H} : Shape{rows, H};
  const std::vector<std::byte> expanded = random_floats(rng, c.dtype, rows * H);
  std::vector<std::int32_t> row_idx(at(positions));
  std::iota(row_idx.begin(), row_idx.end(), 0);
  std::shuffle(row_idx.begin(), row_idx.end(), rng);
  if (capacity) {
    for (std::int32_t& r : row_idx) {
      r = static_cast<std::int32_t>(rng() % at(rows + 1)) - 1;  // -1: dropped
    }
  }
  const std::int64_t bias_rows = capacity ? experts : 1 + static_cast<std::int64_t>(rng() % 4);
  std::vector<std::int32_t> ids(at(positions));
  for (std::int32_t& id : ids) id = static_cast<std::int32_t>(rng() % at(bias_rows));
  const std::vector<std::byte> x1 = random_floats(rng, c.dtype, T * H);
  const std::vector<std::byte> x2 = random_floats(rng, c.dtype, T * H);
  const std::vector<std::byte> bias = random_floats(rng, c.dtype, bias_rows * H);
  const std::vector<std::byte> scales = random_floats(rng, c.scales_dtype, positions);

  const DType dtype = dtype_of(c.dtype);
  FinalizeRoutingInputs inputs{TensorView(expanded.data(), dtype, expanded_shape),
                               TensorView(row_idx.data(), DType::kInt32, {positions})};
  if (c.x1) inputs.x1 = TensorView(x1.data(), dtype, {T, H});
  if (c.x2) inputs.x2 = TensorView(x2.data(), dtype, {T, H});
  if (c.bias) inputs.bias = TensorView(bias.data(), dtype, {bias_rows, H});
  if (c.scales) inputs.scales = TensorView(scales.data(), dtype_of(c.scales_dtype), {T, k});
  if (c.expert_idx) inputs.expert_idx = TensorView(ids.data(), DType::kInt32, {T, k});
  const FinalizeRoutingAttributes attributes{c.mode};
  Output out(infer_finalize_routing(inputs, attributes).out);
  moe_finalize_routing(inputs, {out.view}, attributes, num_threads);

  const std::vector<std::byte> want = testing::reference_finalize_routing(
      {c.dtype, c.scales_dtype, T, k, H, c.mode, expanded.data(), rows, row_idx.data(),
       c.x1 ? x1.data() : nullptr, c.x2 ? x2.data() : nullptr, c.bias ? bias.data() : nullptr,
       c.scales ? scales.data() : nullptr, ids.data()});
  EXPECT_EQ(testing::first_difference("out", out.bytes, want.data(), want.size()), "");
}

TEST(FinalizeRouting, MatchesTheReferenceBitwiseOverRandomCases) {
  const std::pair<FloatType, FloatType> dtypes[] = {
      {FloatType::kFloat16, FloatType::kFloat16},
      {FloatType::kFloat16, FloatType::kFloat32},
      {FloatType::kBFloat16, FloatType::kBFloat16},
      {FloatType::kBFloat16, FloatType::kFloat32},
      {FloatType::kFloat32, FloatType::kFloat32}};
  std::mt19937_64 rng(5);
  int cases = 0;
  for (const auto& [dtype, scales_dtype] : dtypes) {
    for (const std::int64_t mode : {0, 1, 2, 3}) {
      for (int optional = 0; optional < 16; ++optional) {
        const bool x1 = optional & 1, x2 = x1 && (optional & 2), bias = optional & 4,
                   scales = optional & 8;
        const std::int64_t k = scales ? 1 + static_cast<std::int64_t>(rng() % 4) : 1;
        const std::int64_t tokens = static_cast<std::int64_t>(rng() % 9);
        check_finalize({dtype, scales_dtype, tokens, k, 1 + static_cast<std::int64_t>(rng() % 40),
                        mode, x1, x2, bias, scales, bias || rng() % 2},
                       rng(), 1 + static_cast<int>(rng() % 3));
        ++cases;
      }
    }
  }
  EXPECT_EQ(cases, 5 * 4 * 16);
}

TEST(FinalizeRouting, LargeCallsGiveTheSameBitsOnAnyThreadCount) {
  for (const int threads : {1, 2, 7}) {
    check_finalize({FloatType::kBFloat16, FloatType::kFloat32, 200, 8, 1024, 2, true, true, true,
                    true, true},
                   11, threads);
    check_finalize({FloatType::kFloat16, FloatType::kFloat16, 150, 4, 512, 1, true, false, false,
                    true, false},
                   12, threads);
  }
}

TEST(FinalizeRouting, EveryBitPatternMatchesTheReferenceInWholeBlocksAndTails) {
  // Each 16-bit row holds every pattern (NaNs, infinities, subnormals), x1
  // them in another order, and weights that overflow, underflow into
  // subnormals and round; float32 rows are random bits. H is past any block
  // size and not a multiple of one, so both the block and the tail code run
  // (run under each MOE_REROUTE_MAX_CPU_ISA by ctest).
  const std::int64_t T = 4, k = 3, H = 65536 + 37;
  std::mt19937_64 rng(17);
  for (const FloatType type : {FloatType::kFloat16, FloatType::kBFloat16, FloatType::kFloat32}) {
    SCOPED_TRACE(static_cast<int>(type));
    const std::size_t size = type == FloatType::kFloat32 ? 4 : 2;
    const auto patterns = [&](std::int64_t rows, std::uint64_t stride) {
      std::vector<std::byte> bytes(at(rows * H) * size);
      for (std::int64_t i = 0; i < rows * H; ++i) {
        const std::uint64_t bits = size == 2 ? (at(i) * stride) & 0xffff : rng();
        std::memcpy(bytes.data() + at(i) * size, &bits, size);
      }
      return bytes;
    };
    const std::vector<std::byte> expanded = patterns(T * k, 1), x1 = patterns(T, 40503);
    const float weights[] = {1.0f, 3.0f, 0x1p-13f, 0.3f, -1.5f, 0x1p-20f,
                             100.0f, -0.7f, 1.0f, 0x1p-9f, 2.0f, 65504.0f};
    std::vector<std::int32_t> row_idx(at(T * k));
    std::iota(row_idx.begin(), row_idx.end(), 0);
    std::shuffle(row_idx.begin(), row_idx.end(), rng);
    const DType dtype = dtype_of(type);
    FinalizeRoutingInputs inputs{TensorView(expanded.data(), dtype, {T * k, H}),
                                 TensorView(row_idx.data(), DType::kInt32, {T * k})};
    inputs.x1 = TensorView(x1.data(), dtype, {T, H});
    inputs.scales = TensorView(weights, DType::kFloat32, {T, k});
    Output out(infer_finalize_routing(inputs, {kFinalizeRowMajor}).out);
    moe_finalize_routing(inputs, {out.view}, {kFinalizeRowMajor}, 2);
    const std::vector<std::byte> want = testing::reference_finalize_routing(
        {type, FloatType::kFloat32, T, k, H, kFinalizeRowMajor, expanded.data(), T * k,
         row_idx.data(), x1.data(), nullptr, nullptr, weights, nullptr});
    EXPECT_EQ(testing::first_difference("out", out.bytes, want.data(), want.size()), "");
  }
}

TEST(FinalizeRouting, RoundsToNearestEvenWithoutFusedMultiplyAdd) {
  // (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24 rounds (a tie, to even) to 1 + 2^-11,
  // so x1 + product is 0 in two roundings; fused, it would be 2^-24.
  const float x1[] = {-(1.0f + 0x1p-11f)};
  const float expanded[] = {1.0f + 0x1p-12f};
  const float scales[] = {1.0f + 0x1p-12f};
  const std::int32_t row_idx[] = {0};
  float out = -1.0f;
  FinalizeRoutingInputs inputs{TensorView(expanded, DType::kFloat32, {1, 1}),
                               TensorView(row_idx, DType::kInt32, {1})};
  inputs.x1 = TensorView(x1, DType::kFloat32, {1, 1});
  inputs.scales = TensorView(scales, DType::kFloat32, {1, 1});
  moe_finalize_routing(inputs, {TensorView(&out, DType::kFloat32, {1, 1})});
  EXPECT_EQ(out, 0.0f);
  // bfloat16 of 1 + 2^-8 (a tie) is 1; of 1 + 3 * 2^-8, 1 + 2^-6.
  const std::uint16_t one = 0x3f80;
  const float halfway[] = {0x1p-8f, 3 * 0x1p-8f};
  const std::uint16_t x1_b[] = {one, one};
  std::uint16_t rounded[2] = {};
  const std::int32_t rows[] = {0, 1};
  FinalizeRoutingInputs b{TensorView(halfway, DType::kFloat32, {2, 1}),
                          TensorView(rows, DType::kInt32, {2})};
  std::uint16_t expanded_b[2];
  for (int i = 0; i < 2; ++i) {
    std::uint32_t bits;
    std::memcpy(&bits, &halfway[i], 4);
    expanded_b[i] = static_cast<std::uint16_t>(bits >> 16);  // exact in bfloat16
  }
  b.expanded_x = TensorView(expanded_b, DType::kBFloat16, {2, 1});
  b.x1 = TensorView(x1_b, DType::kBFloat16, {2, 1});
  moe_finalize_routing(b, {TensorView(rounded, DType::kBFloat16, {2, 1})});
  EXPECT_EQ(rounded[0], 0x3f80);
  EXPECT_EQ(rounded[1], 0x3f82);
}

TEST(FinalizeRouting, AnEmptyCallOfLongRowsAllocatesNothing) {
  const std::int64_t hidden = std::int64_t{1} << 40;
  const std::int32_t none = 0;
  for (const int threads : {1, 3}) {
    moe_finalize_routing({TensorView(nullptr, DType::kFloat16, {0, 0, hidden}),
                          TensorView(&none, DType::kInt32, {0})},
                         {TensorView(nullptr, DType::kFloat16, {0, hidden})},
                         {kFinalizeRowMajorCapacity}, threads);
  }
}

TEST(FinalizeRouting, ANaNBecomesTheOneQuietNaN) {
  // NaNs of any payload and sign give float16 0x7e00, bfloat16 0x7fc0, float32 0x7fc00000.
  const std::uint16_t half_nans[] = {0x7d01, 0xfe55, 0x7fff};
  const std::int32_t rows[] = {0, 1, 2};
  std::uint16_t out[3] = {};
  moe_finalize_routing({TensorView(half_nans, DType::kFloat16, {3, 1}),
                        TensorView(rows, DType::kInt32, {3})},
                       {TensorView(out, DType::kFloat16, {3, 1})});
  EXPECT_EQ(out[0], 0x7e00);
  EXPECT_EQ(out[1], 0x7e00);
  EXPECT_EQ(out[2], 0x7e00);
  for (int i = 0; i < 3; ++i) {
    const std::vector<std::byte> want = testing::reference_store(
        FloatType::kFloat16, testing::reference_load(FloatType::kFloat16, half_nans, i));
    EXPECT_EQ(std::memcmp(&out[i], want.data(), 2), 0) << i;
  }
  const std::uint16_t bfloat_nans[] = {0x7f81, 0xffc3, 0x7fc0};
  moe_finalize_routing({TensorView(bfloat_nans, DType::kBFloat16, {3, 1}),
                        TensorView(rows, DType::kInt32, {3})},
                       {TensorView(out, DType::kBFloat16, {3, 1})});
  EXPECT_EQ(out[0], 0x7fc0);
  EXPECT_EQ(out[1], 0x7fc0);
  EXPECT_EQ(out[2], 0x7fc0);
  const std::uint32_t float_nans[] = {0x7f800001, 0xffc12345, 0x7fc00000};
  std::uint32_t float_out[3] = {};
  moe_finalize_routing({TensorView(float_nans, DType::kFloat32, {3, 1}),
                        TensorView(rows, DType::kInt32, {3})},
                       {TensorView(float_out, DType::kFloat32, {3, 1})});
  for (const std::uint32_t bits : float_out) EXPECT_EQ(bits, 0x7fc00000u);
}

TEST(FinalizeRouting, AnInfinityKeepsItsSign) {
  // One row each: +inf and -inf in every float type, summed with x1 = 1.
  const std::int32_t rows[] = {0, 1};
  const std::uint16_t half_infinities[] = {0x7c00, 0xfc00}, half_ones[] = {0x3c00, 0x3c00};
  const std::uint16_t bfloat_infinities[] = {0x7f80, 0xff80}, bfloat_ones[] = {0x3f80, 0x3f80};
  const std::uint32_t float_infinities[] = {0x7f800000u, 0xff800000u};
  const float float_ones[] = {1.0f, 1.0f};
  struct Case {
    DType dtype;
    FloatType type;
    const void *infinities, *ones;
  };
  for (const Case& c : {Case{DType::kFloat16, FloatType::kFloat16, half_infinities, half_ones},
                        Case{DType::kBFloat16, FloatType::kBFloat16, bfloat_infinities,
                             bfloat_ones},
                        Case{DType::kFloat32, FloatType::kFloat32, float_infinities,
                             float_ones}}) {
    std::uint32_t out[2] = {0xa5a5a5a5u, 0xa5a5a5a5u};
    FinalizeRoutingInputs inputs{TensorView(c.infinities, c.dtype, {2, 1}),
                                 TensorView(rows, DType::kInt32, {2})};
    inputs.x1 = TensorView(c.ones, c.dtype, {2, 1});
    moe_finalize_routing(inputs, {TensorView(out, c.dtype, {2, 1})});
    const auto size = static_cast<std::size_t>(dtype_bytes(c.dtype, 1));
    for (int i = 0; i < 2; ++i) {
      EXPECT_EQ(std::memcmp(reinterpret_cast<const std::byte*>(out) + i * size,
                            static_cast<const std::byte*>(c.infinities) + i * size, size),
                0)
          << dtype_name(c.dtype) << " " << i;
      EXPECT_EQ(testing::reference_load(c.type, c.infinities, i),
                i == 0 ? INFINITY : -INFINITY)
          << dtype_name(c.dtype) << " " << i;
    }
  }
}

struct BadFinalize {
  std::string argument;
  std::function<void(FinalizeRoutingInputs&, FinalizeRoutingAttributes&)> change;
};

TEST(FinalizeRouting, RefusesBadInputsNamingTheArgumentBeforeWriting) {
  // T = 2, k = 2, H = 3, float32.
  std::vector<float> expanded(4 * 3, 1.0f), tokens(2 * 3, 1.0f), bias(2 * 3, 1.0f), scales(4, 1.0f);
  std::vector<std::int32_t> row_idx = {0, 1, 2, 3}, ids = {0, 1, 1, 0};
  static std::int32_t below[] = {0, -2, 2, 3}, minus_one[] = {0, -1, 2, 3}, far[] = {0, 1, 2, 6},
                      bad_id[] = {0, 1, 2, 0};
  static std::uint16_t half_tokens[6];
  const std::vector<BadFinalize> cases = {
      {"drop_pad_mode", [](auto&, auto& a) { a.drop_pad_mode = 4; }},
      {"expanded_x", [](auto& in, auto&) { in.expanded_x.spec.dtype = DType::kInt8; }},
      {"expanded_x", [](auto& in, auto&) { in.expanded_x.spec.shape = {12}; }},
      {"expanded_x", [](auto&, auto& a) { a.drop_pad_mode = 1; }},  // 2-D in a capacity mode
      {"expanded_row_idx", [](auto& in, auto&) { in.expanded_row_idx.spec.shape = {2, 2}; }},
      {"expanded_row_idx", [](auto& in, auto&) { in.expanded_row_idx.spec.dtype = DType::kInt64; in.expanded_row_idx.spec.shape = {2}; }},
      {"expanded_row_idx", [](auto& in, auto&) { in.expanded_row_idx.spec.shape = {3}; }},
      {"x2", [](auto& in, auto&) { in.x1.reset(); }},
      {"x1", [](auto& in, auto&) { in.x1->spec.shape = {2, 4}; }},
      {"x2", [](auto& in, auto&) { in.x2 = TensorView(half_tokens, DType::kFloat16, {2, 3}); }},
      {"bias", [](auto& in, auto&) { in.expert_idx.reset(); }},
      {"bias", [](auto& in, auto&) { in.bias->spec.shape = {2, 2}; }},
      {"scales", [](auto& in, auto&) { in.scales->spec.shape = {4}; }},
      {"scales", [](auto& in, auto&) { in.scales->spec.dtype = DType::kInt32; }},
      {"expert_idx", [](auto& in, auto&) { in.expert_idx->spec.shape = {4}; }},
      {"expanded_row_idx", [](auto& in, auto&) { in.expanded_row_idx.data = below; }},
      {"expanded_row_idx", [](auto& in, auto&) { in.expanded_row_idx.data = minus_one; }},
      {"expanded_row_idx", [](auto& in, auto& a) {
         a.drop_pad_mode = 3;
         in.expanded_x.spec.shape = {2, 2, 3};
         in.bias->spec.shape = {2, 3};
         in.expanded_row_idx.data = far;  // 6 is not below E * C = 4
       }},
      {"expert_idx", [](auto& in, auto&) {
         in.bias->spec.shape = {1, 3};
         in.expert_idx->data = bad_id;  // id 1 is not a row of a 1-row bias
       }},
  };
  for (const BadFinalize& bad : cases) {
    FinalizeRoutingInputs inputs{TensorView(expanded.data(), DType::kFloat32, {4, 3}),
                                 TensorView(row_idx.data(), DType::kInt32, {4})};
    inputs.x1 = TensorView(tokens.data(), DType::kFloat32, {2, 3});
    inputs.x2 = TensorView(tokens.data(), DType::kFloat32, {2, 3});
    inputs.bias = TensorView(bias.data(), DType::kFloat32, {2, 3});
    inputs.scales = TensorView(scales.data(), DType::kFloat32, {2, 2});
    inputs.expert_idx = TensorView(ids.data(), DType::kInt32, {2, 2});
    FinalizeRoutingAttributes attributes;
    bad.change(inputs, attributes);
    Output out(TensorSpec{DType::kFloat32, {2, 3}});
    try {
      moe_finalize_routing(inputs, {out.view}, attributes);
      ADD_FAILURE() << "no error for " << bad.argument;
    } catch (const Error& error) {
      EXPECT_EQ(std::string(error.what()).rfind(bad.argument + ":", 0), 0u) << error.what();
    }
    EXPECT_TRUE(out.untouched()) << bad.argument;
  }
}

TEST(RoutingDescriptions, OutputDimsAgreeWithInference) {
  // The formulas the fake kernels size outputs by, evaluated on real shapes.
  const auto evaluate = [](const DimFormula& f, const std::vector<Shape>& shapes) {
    std::int64_t value = 0;
    for (int i = 0; i < f.num_terms; ++i) {
      std::int64_t term = f.terms[at(i)].coefficient;
      for (int j = 0; j < f.terms[at(i)].num_factors; ++j) {
        const InputDim d = f.terms[at(i)].factors[at(j)];
        const Shape& s = shapes[at(d.input)];
        term *= s[d.dim < 0 ? s.ndim + d.dim : d.dim];
      }
      value += term;
    }
    return f.at_most >= 0 ? std::min(value, f.at_most) : value;
  };
  for (const std::int64_t active : {0, 5, 100}) {
    for (const std::int64_t mode : {kDropless, kDropPad}) {
      InitRoutingAttributes a;
      a.active_num = active;
      a.drop_pad_mode = mode;
      a.expert_num = 3;
      a.expert_capacity = 2;
      a.expert_tokens_count_or_cumsum_flag = kExpertTokensCount;
      a.expert_tokens_before_capacity_flag = true;
      const std::vector<Shape> shapes = {{7, 5}, {7, 3}};
      const InitRoutingOutputSpecs specs = infer_init_routing(
          {TensorView(nullptr, DType::kInt8, shapes[0]), TensorView(nullptr, DType::kInt32, shapes[1])},
          a);
      const TensorSpec all[] = {specs.expanded_x, specs.expanded_row_idx,
                                specs.expert_tokens_count_or_cumsum,
                                specs.expert_tokens_before_capacity};
      const bool given[] = {true, true};
      for (std::size_t i = 0; i < 4; ++i) {
        const std::vector<DimFormula> dims = output_dims(init_routing_desc(), i, a, given);
        ASSERT_EQ(static_cast<int>(dims.size()), all[i].shape.ndim) << i;
        for (std::size_t d = 0; d < dims.size(); ++d) {
          EXPECT_EQ(evaluate(dims[d], shapes), all[i].shape[static_cast<int>(d)]) << i << " " << d;
        }
      }
    }
  }
  for (int optional = 0; optional < 4; ++optional) {
    const bool x1 = optional & 1, scales = optional & 2;
    const std::vector<Shape> shapes = {{12, 3}, {12}, {4, 3}, {}, {}, {4, 3}, {}};
    FinalizeRoutingInputs inputs{TensorView(nullptr, DType::kFloat32, shapes[0]),
                                 TensorView(nullptr, DType::kInt32, shapes[1])};
    if (x1) inputs.x1 = TensorView(nullptr, DType::kFloat32, scales ? Shape{4, 3} : Shape{12, 3});
    if (scales) inputs.scales = TensorView(nullptr, DType::kFloat32, shapes[5]);
    std::vector<Shape> given_shapes = shapes;
    given_shapes[2] = inputs.x1 ? inputs.x1->shape() : Shape{};
    const bool given[] = {true, true, x1, false, false, scales, false};
    const TensorSpec out = infer_finalize_routing(inputs).out;
    const std::vector<DimFormula> dims = output_dims(finalize_routing_desc(), 0, {}, given);
    ASSERT_EQ(dims.size(), 2u);
    EXPECT_EQ(evaluate(dims[0], given_shapes), out.shape[0]);
    EXPECT_EQ(evaluate(dims[1], given_shapes), out.shape[1]);
  }
}

}  // namespace
}  // namespace moe_reroute
