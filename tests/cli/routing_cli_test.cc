// moe-reroute init-routing and finalize-routing end to end: random inputs
// written as .npy files, every output byte compared with the naive reference
// (testing/routing_reference.h), and every bad input refused with exit status
// 2, one `error:` line naming the argument, and the earlier outputs left as
// they were.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <numeric>
#include <optional>
#include <ostream>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "moe_reroute/routing.h"
#include "npy.h"
#include "program.h"
#include "refusal.h"
#include "routing_reference.h"

namespace moe_reroute::tools {
namespace {

Result run_cli(const std::vector<std::string>& args) { return run_program(MOE_REROUTE_CLI, args); }

std::int64_t elements(const std::vector<std::int64_t>& shape) {
  std::int64_t count = 1;
  for (std::int64_t d : shape) count *= d;
  return count;
}

std::int64_t itemsize(const std::string& descr) { return std::stoll(descr.substr(2)); }

std::string save(const std::filesystem::path& path, const NpyArray& array) {
  write_npy(path, array.descr, array.shape, array.data.data(), array.data.size(), "test");
  return path.string();
}

template <typename Int, typename Value>
NpyArray int_array(const std::vector<Value>& values, std::vector<std::int64_t> shape) {
  NpyArray array{sizeof(Int) == 8 ? "<i8" : "<i4", std::move(shape), {}};
  array.data.resize(values.size() * sizeof(Int));
  for (std::size_t i = 0; i < values.size(); ++i) {
    const Int value = static_cast<Int>(values[i]);
    std::memcpy(array.data.data() + i * sizeof(Int), &value, sizeof(Int));
  }
  return array;
}

// The float dtypes of finalize-routing, by name.
std::string float_descr(const std::string& dtype) {
  return dtype == "float32" ? "<f4" : dtype == "float16" ? "<f2" : "<u2";
}

testing::FloatType float_type(const std::string& dtype) {
  return dtype == "float32"   ? testing::FloatType::kFloat32
         : dtype == "float16" ? testing::FloatType::kFloat16
                              : testing::FloatType::kBFloat16;
}

NpyArray random_floats(std::mt19937_64& rng, const std::string& dtype,
                       std::vector<std::int64_t> shape, float bound) {
  NpyArray array{float_descr(dtype), std::move(shape), {}};
  const std::int64_t size = itemsize(array.descr);
  array.data.resize(static_cast<std::size_t>(elements(array.shape) * size));
  std::uniform_real_distribution<float> value(-bound, bound);
  for (std::int64_t i = 0; i < elements(array.shape); ++i) {
    const std::vector<std::byte> bytes = testing::reference_store(float_type(dtype), value(rng));
    std::memcpy(array.data.data() + i * size, bytes.data(), bytes.size());
  }
  return array;
}

// Expert ids in [0, num_ids), skewed towards 0 as `skew` grows.
std::vector<std::int64_t> random_ids(std::mt19937_64& rng, std::int64_t count, std::int64_t num_ids,
                                     double skew) {
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<std::int64_t> ids(static_cast<std::size_t>(count));
  for (std::int64_t& id : ids) {
    id = std::min(num_ids - 1, static_cast<std::int64_t>(num_ids * std::pow(u(rng), 1.0 + skew)));
  }
  return ids;
}

void expect_array(const NpyArray& got, const NpyArray& expected, const std::string& name) {
  EXPECT_EQ(got.descr, expected.descr) << name;
  EXPECT_EQ(got.shape, expected.shape) << name;
  EXPECT_TRUE(got.data == expected.data) << name << ": bytes differ from the reference";
}

std::set<std::string> file_names(std::initializer_list<const char*> outputs) {
  std::set<std::string> names;
  for (const char* output : outputs) names.insert(std::string(output) + ".npy");
  return names;
}

using Flags = std::vector<std::pair<std::string, std::string>>;

// `command` with `flags`, each of `replace` replacing its flag's value (or
// removing the flag, where empty) or added, then `extra`.
std::vector<std::string> command_line(const char* command, Flags flags, const Flags& replace = {},
                                      const std::vector<std::string>& extra = {}) {
  for (const auto& change : replace) {  // no structured binding: clang 14 cannot capture one
    const auto it = std::find_if(flags.begin(), flags.end(),
                                 [&](const auto& f) { return f.first == change.first; });
    if (it == flags.end()) {
      flags.push_back(change);
    } else {
      it->second = change.second;
    }
  }
  std::vector<std::string> result = {command};
  for (const auto& [flag, value] : flags) {
    if (!value.empty()) result.insert(result.end(), {flag, value});
  }
  result.insert(result.end(), extra.begin(), extra.end());
  return result;
}

struct InitCase {
  std::string name;
  std::string dtype, descr;  // x's dtype name and .npy storage
  std::int64_t num_tokens = 0, k = 1, stored_hidden = 1;
  InitRoutingAttributes attributes;
  bool int64_ids = false;
  double skew = 0.0;
  std::int64_t num_ids = 0;  // the ids' range where expert_num is 0
};

void PrintTo(const InitCase& c, std::ostream* os) { *os << c.name; }

class InitRouting : public ::testing::TestWithParam<InitCase> {};

TEST_P(InitRouting, MatchesTheReference) {
  const InitCase& c = GetParam();
  const InitRoutingAttributes& a = c.attributes;
  std::mt19937_64 rng(std::hash<std::string>{}(c.name));
  const TestDir dir;
  NpyArray x{c.descr, {c.num_tokens, c.stored_hidden}, {}};
  x.data.resize(static_cast<std::size_t>(c.num_tokens * c.stored_hidden * itemsize(c.descr)));
  for (std::byte& b : x.data) b = static_cast<std::byte>(rng());
  const std::vector<std::int64_t> ids =
      random_ids(rng, c.num_tokens * c.k, a.expert_num > 0 ? a.expert_num : c.num_ids, c.skew);
  const NpyArray expert_idx = c.int64_ids ? int_array<std::int64_t>(ids, {c.num_tokens, c.k})
                                          : int_array<std::int32_t>(ids, {c.num_tokens, c.k});

  Flags flags = {{"--x", save(dir / "x.npy", x)},
                 {"--expert-idx", save(dir / "expert_idx.npy", expert_idx)},
                 {"--active-num", std::to_string(a.active_num)},
                 {"--expert-capacity", std::to_string(a.expert_capacity)},
                 {"--expert-num", std::to_string(a.expert_num)},
                 {"--drop-pad-mode", std::to_string(a.drop_pad_mode)},
                 {"--expert-tokens-count-or-cumsum-flag",
                  std::to_string(a.expert_tokens_count_or_cumsum_flag)},
                 {"--out", (dir / "out").string()}};
  if (c.descr == "<u2" || (c.descr == "|u1" && c.dtype != "uint8")) {
    flags.emplace_back("--x-dtype", c.dtype);
  }
  std::vector<std::string> extra;
  if (a.expert_tokens_before_capacity_flag) extra.push_back("--expert-tokens-before-capacity-flag");
  const Result result = run_cli(command_line("init-routing", flags, {}, extra));
  ASSERT_EQ(result.status, 0) << result.err;
  EXPECT_EQ(result.err, "");

  EXPECT_EQ(listing(dir / "out"),
            file_names({"expanded_x", "expanded_row_idx", "expert_tokens_count_or_cumsum",
                        "expert_tokens_before_capacity"}));
  const std::int64_t row_bytes = c.stored_hidden * itemsize(c.descr);
  const testing::InitReferenceOutputs expected = testing::reference_init_routing(
      {x.data.data(), c.num_tokens, row_bytes, ids, c.k, a.active_num, a.expert_capacity,
       a.expert_num, a.drop_pad_mode, a.expert_tokens_count_or_cumsum_flag,
       a.expert_tokens_before_capacity_flag});
  const std::vector<std::int64_t> x_shape =
      a.drop_pad_mode == kDropPad
          ? std::vector<std::int64_t>{a.expert_num, a.expert_capacity, c.stored_hidden}
          : std::vector<std::int64_t>{
                static_cast<std::int64_t>(expected.expanded_x.size()) / row_bytes, c.stored_hidden};
  const auto int32 = [](const std::vector<std::int32_t>& values) {
    return int_array<std::int32_t>(values, {static_cast<std::int64_t>(values.size())});
  };
  for (const auto& [name, array] : std::vector<std::pair<const char*, NpyArray>>{
           {"expanded_x", {x.descr, x_shape, expected.expanded_x}},
           {"expanded_row_idx", int32(expected.expanded_row_idx)},
           {"expert_tokens_count_or_cumsum", int32(expected.count_or_cumsum)},
           {"expert_tokens_before_capacity", int32(expected.before_capacity)}}) {
    expect_array(read_npy(dir / "out" / (std::string(name) + ".npy"), name), array, name);
  }
}

using A = InitRoutingAttributes;

INSTANTIATE_TEST_SUITE_P(
    Cases, InitRouting,
    ::testing::Values(
        InitCase{"float16_counts", "float16", "<f2", 100, 4, 33,
                 A{.expert_num = 8, .expert_tokens_count_or_cumsum_flag = kExpertTokensCount}},
        InitCase{"bfloat16_active_num_cumsum_int64_skewed", "bfloat16", "<u2", 50, 4, 16,
                 A{.active_num = 150,
                   .expert_num = 6,
                   .expert_tokens_count_or_cumsum_flag = kExpertTokensCumsum},
                 true, 2.0},
        InitCase{"int8_unbounded_ids_k1", "int8", "|i1", 37, 1, 24, A{}, false, 0.0, 50},
        InitCase{"uint8_active_num_past_rows", "uint8", "|u1", 9, 3, 5,
                 A{.active_num = 1000,
                   .expert_num = 4,
                   .expert_tokens_count_or_cumsum_flag = kExpertTokensCount}},
        InitCase{"float32_no_tokens", "float32", "<f4", 0, 2, 7,
                 A{.expert_num = 3, .expert_tokens_count_or_cumsum_flag = kExpertTokensCount}},
        InitCase{"float8_e4m3fn_capacity_drops", "float8_e4m3fn", "|u1", 40, 2, 64,
                 A{.expert_capacity = 5,
                   .expert_num = 4,
                   .drop_pad_mode = kDropPad,
                   .expert_tokens_before_capacity_flag = true}},
        InitCase{"float32_capacity_of_all_tokens", "float32", "<f4", 12, 3, 8,
                 A{.expert_capacity = 12, .expert_num = 3, .drop_pad_mode = kDropPad}},
        InitCase{"hifloat8_capacity_skewed_int64", "hifloat8", "|u1", 64, 8, 32,
                 A{.expert_capacity = 20,
                   .expert_num = 16,
                   .drop_pad_mode = kDropPad,
                   .expert_tokens_before_capacity_flag = true},
                 true, 3.0},
        InitCase{"float4_e2m1_capacity_one_expert", "float4_e2m1", "|u1", 10, 2, 8,
                 A{.expert_capacity = 10,
                   .expert_num = 1,
                   .drop_pad_mode = kDropPad,
                   .expert_tokens_before_capacity_flag = true}}),
    [](const ::testing::TestParamInfo<InitCase>& info) { return info.param.name; });

struct FinalizeCase {
  std::string name;
  std::string dtype;
  std::int64_t mode = kFinalizeColumnMajor;
  std::int64_t num_tokens = 0, k = 1, hidden = 1;
  std::int64_t num_experts = 4, capacity = 0;  // capacity: modes 1 and 3
  std::string optional_inputs = "";  // some of "x1 x2 bias scales"; bias brings expert_idx
  std::string scales_dtype = "";     // "": expanded_x's
  std::int64_t dropped_rows = 0;     // modes 0 and 2: rows of expanded_x fewer than T * k

  bool has(const std::string& input) const {
    return (" " + optional_inputs + " ").find(" " + input + " ") != std::string::npos;
  }
};

void PrintTo(const FinalizeCase& c, std::ostream* os) { *os << c.name; }

class FinalizeRouting : public ::testing::TestWithParam<FinalizeCase> {};

TEST_P(FinalizeRouting, MatchesTheReference) {
  const FinalizeCase& c = GetParam();
  std::mt19937_64 rng(std::hash<std::string>{}(c.name));
  const TestDir dir;
  const std::int64_t T = c.num_tokens, k = c.k, H = c.hidden, n = T * k;
  const bool capacity =
      c.mode == kFinalizeColumnMajorCapacity || c.mode == kFinalizeRowMajorCapacity;
  const std::string scales_dtype = c.scales_dtype.empty() ? c.dtype : c.scales_dtype;
  NpyArray expanded_x;
  std::vector<std::int64_t> rows(static_cast<std::size_t>(n));
  if (capacity) {
    expanded_x = random_floats(rng, c.dtype, {c.num_experts, c.capacity, H}, 4);
    std::uniform_int_distribution<std::int64_t> slot(-1, c.num_experts * c.capacity - 1);
    for (std::int64_t& row : rows) row = slot(rng);
  } else {
    expanded_x = random_floats(rng, c.dtype, {n - c.dropped_rows, H}, 4);
    std::iota(rows.begin(), rows.end(), 0);
    std::shuffle(rows.begin(), rows.end(), rng);
  }
  const NpyArray expanded_row_idx = int_array<std::int32_t>(rows, {n});
  std::optional<NpyArray> x1, x2, bias, scales, expert_idx;
  if (c.has("x1")) x1 = random_floats(rng, c.dtype, {T, H}, 4);
  if (c.has("x2")) x2 = random_floats(rng, c.dtype, {T, H}, 4);
  if (c.has("bias")) {
    bias = random_floats(rng, c.dtype, {c.num_experts, H}, 4);
    expert_idx = int_array<std::int32_t>(random_ids(rng, n, c.num_experts, 0.0), {T, k});
  }
  if (c.has("scales")) scales = random_floats(rng, scales_dtype, {T, k}, 2);

  Flags flags = {{"--expanded-x", save(dir / "expanded_x.npy", expanded_x)},
                 {"--expanded-row-idx", save(dir / "expanded_row_idx.npy", expanded_row_idx)},
                 {"--drop-pad-mode", std::to_string(c.mode)},
                 {"--out", (dir / "out").string()}};
  for (const auto& [flag, array] : {std::pair{"--x1", &x1},
                                    {"--x2", &x2},
                                    {"--bias", &bias},
                                    {"--scales", &scales},
                                    {"--expert-idx", &expert_idx}}) {
    if (*array) flags.emplace_back(flag, save(dir / (flag + 2), **array));
  }
  if (c.dtype == "bfloat16") flags.emplace_back("--expanded-x-dtype", "bfloat16");
  if (scales && scales_dtype == "bfloat16") flags.emplace_back("--scales-dtype", "bfloat16");
  const Result result = run_cli(command_line("finalize-routing", flags));
  ASSERT_EQ(result.status, 0) << result.err;
  EXPECT_EQ(result.err, "");
  EXPECT_EQ(listing(dir / "out"), file_names({"out"}));

  const auto data = [](const std::optional<NpyArray>& array) -> const void* {
    return array ? array->data.data() : nullptr;
  };
  testing::FinalizeReferenceInputs ref;
  ref.dtype = float_type(c.dtype);
  ref.scales_dtype = float_type(scales_dtype);
  ref.num_tokens = T;
  ref.top_k = k;
  ref.hidden = H;
  ref.drop_pad_mode = c.mode;
  ref.expanded_x = expanded_x.data.data();
  ref.expanded_rows = elements(expanded_x.shape) / H;
  ref.expanded_row_idx = reinterpret_cast<const std::int32_t*>(expanded_row_idx.data.data());
  ref.x1 = data(x1);
  ref.x2 = data(x2);
  ref.bias = data(bias);
  ref.scales = data(scales);
  ref.expert_idx = static_cast<const std::int32_t*>(data(expert_idx));
  expect_array(read_npy(dir / "out" / "out.npy", "out"),
               {expanded_x.descr, {T, H}, testing::reference_finalize_routing(ref)}, "out");
}

INSTANTIATE_TEST_SUITE_P(
    Cases, FinalizeRouting,
    ::testing::Values(
        FinalizeCase{"float32_bare_k1", "float32", kFinalizeColumnMajor, 20, 1, 17},
        FinalizeCase{"float16_x1_scales_dropped_rows", "float16", kFinalizeColumnMajor, 33, 4, 40,
                     4, 0, "x1 scales", "", 5},
        FinalizeCase{"bfloat16_row_major_all", "bfloat16", kFinalizeRowMajor, 24, 3, 64, 5, 0,
                     "x1 x2 bias scales"},
        FinalizeCase{"bfloat16_float32_scales_bias", "bfloat16", kFinalizeRowMajor, 16, 8, 32, 3, 0,
                     "bias scales", "float32", 7},
        FinalizeCase{"float16_capacity_bias_scales", "float16", kFinalizeColumnMajorCapacity, 10, 3,
                     24, 4, 6, "bias scales"},
        FinalizeCase{"float32_row_major_capacity_all", "float32", kFinalizeRowMajorCapacity, 19, 2,
                     9, 3, 7, "x1 x2 bias scales"},
        FinalizeCase{"float16_row_major_capacity_bare", "float16", kFinalizeRowMajorCapacity, 12, 1,
                     8, 2, 5},
        FinalizeCase{"float32_no_tokens", "float32", kFinalizeRowMajor, 0, 3, 6, 4, 0, "x1 scales"},
        FinalizeCase{"bfloat16_x1_only", "bfloat16", kFinalizeColumnMajor, 21, 1, 15, 4, 0, "x1"}),
    [](const ::testing::TestParamInfo<FinalizeCase>& info) { return info.param.name; });

// Bad input: exit status 2, one `error:` line naming the argument, nothing on
// stdout, and both commands' earlier outputs byte for byte as they were.
class BadRoutingInput : public ::testing::Test {
 protected:
  static constexpr std::int64_t kTokens = 16, kK = 2, kHidden = 8, kExperts = 4;

  void SetUp() override {
    std::mt19937_64 rng(7);
    std::vector<std::int64_t> rows(kTokens * kK);
    std::iota(rows.begin(), rows.end(), 0);
    const std::vector<std::int64_t> ids = random_ids(rng, kTokens * kK, kExperts, 0.0);
    init_ = {{"--x", file("x.npy", random_floats(rng, "float32", {kTokens, kHidden}, 4))},
             {"--expert-idx", file("ids.npy", int_array<std::int32_t>(ids, {kTokens, kK}))},
             {"--expert-num", std::to_string(kExperts)},
             {"--expert-tokens-count-or-cumsum-flag", "2"},
             {"--out", (dir_ / "init_out").string()}};
    finalize_ = {
        {"--expanded-x",
         file("expanded_x.npy", random_floats(rng, "float32", {kTokens * kK, kHidden}, 4))},
        {"--expanded-row-idx", file("rows.npy", int_array<std::int32_t>(rows, {kTokens * kK}))},
        {"--x1", file("x1.npy", random_floats(rng, "float32", {kTokens, kHidden}, 4))},
        {"--x2", file("x2.npy", random_floats(rng, "float32", {kTokens, kHidden}, 4))},
        {"--bias", file("bias.npy", random_floats(rng, "float32", {kExperts, kHidden}, 4))},
        {"--scales", file("scales.npy", random_floats(rng, "float32", {kTokens, kK}, 2))},
        {"--expert-idx", in("ids.npy")},
        {"--drop-pad-mode", "2"},
        {"--out", (dir_ / "finalize_out").string()}};
    for (const auto* flags : {&init_, &finalize_}) {
      const Result first =
          run_cli(command_line(flags == &init_ ? "init-routing" : "finalize-routing", *flags));
      ASSERT_EQ(first.status, 0) << first.err;
    }
    before_ = snapshot();
    ASSERT_EQ(before_.size(), 5u);
  }

  std::string in(const char* name) const { return (dir_ / name).string(); }
  std::string file(const char* name, const NpyArray& array) { return save(dir_ / name, array); }
  // An int32 file of `shape` holding `values`, repeated.
  std::string ints(const char* name, const std::vector<std::int64_t>& values,
                   std::vector<std::int64_t> shape) {
    std::vector<std::int64_t> repeated(static_cast<std::size_t>(elements(shape)));
    for (std::size_t i = 0; i < repeated.size(); ++i) repeated[i] = values[i % values.size()];
    return file(name, int_array<std::int32_t>(repeated, std::move(shape)));
  }
  std::string floats(const char* name, std::vector<std::int64_t> shape,
                     const std::string& dtype = "float32") {
    std::mt19937_64 rng(1);
    return file(name, random_floats(rng, dtype, std::move(shape), 1));
  }

  std::map<std::string, std::string> snapshot() const {
    std::map<std::string, std::string> files;
    for (const char* out : {"init_out", "finalize_out"}) {
      for (const std::string& name : listing(dir_ / out)) {
        if (std::filesystem::is_regular_file(dir_ / out / name)) {
          files[std::string(out) + "/" + name] = slurp(dir_ / out / name);
        }
      }
    }
    return files;
  }

  void expect_refused(const std::vector<std::string>& args, const std::string& message) {
    expect_bad_input(run_cli(args), message);
    EXPECT_TRUE(snapshot() == before_) << "an output changed on error: " << message;
  }
  void expect_init_refused(const Flags& replace, const std::string& message,
                           const std::vector<std::string>& extra = {}) {
    SCOPED_TRACE(message);
    expect_refused(command_line("init-routing", init_, replace, extra), message);
  }
  void expect_finalize_refused(const Flags& replace, const std::string& message,
                               const std::vector<std::string>& extra = {}) {
    SCOPED_TRACE(message);
    expect_refused(command_line("finalize-routing", finalize_, replace, extra), message);
  }

  TestDir dir_;
  Flags init_, finalize_;
  std::map<std::string, std::string> before_;
};

TEST_F(BadRoutingInput, InitShapesAndAttributes) {
  expect_init_refused({{"--x", floats("x1d.npy", {kTokens})}}, "error: x: must be 2-D");
  expect_init_refused({{"--expert-idx", ints("ids15.npy", {0}, {kTokens - 1, kK})}},
                      "expert_idx: has 15 rows");
  expect_init_refused({{"--expert-idx", ints("ids1d.npy", {0}, {kTokens * kK})}},
                      "expert_idx: must be 2-D");
  expect_init_refused({{"--expert-idx", floats("idsf.npy", {kTokens, kK})}},
                      "expert_idx: dtype float32");
  expect_init_refused({{"--active-num", "-1"}}, "active_num: must be >= 0, got -1");
  expect_init_refused({{"--drop-pad-mode", "2"}}, "drop_pad_mode: must be 0 (dropless) or 1");
  const Flags by_capacity = {{"--drop-pad-mode", "1"},
                             {"--expert-tokens-count-or-cumsum-flag", "0"}};
  const auto with = [](Flags flags, const Flags& more) {
    flags.insert(flags.end(), more.begin(), more.end());
    return flags;
  };
  expect_init_refused(with(by_capacity, {{"--expert-capacity", "0"}}),
                      "expert_capacity: must be >= 1");
  expect_init_refused(with(by_capacity, {{"--expert-capacity", "17"}}),
                      "expert_capacity: must be at most T = 16");
  expect_init_refused(with(by_capacity, {{"--expert-capacity", "4"}, {"--expert-num", "0"}}),
                      "expert_num: must be >= 1 with drop_pad_mode 1");
  expect_init_refused({{"--expert-tokens-count-or-cumsum-flag", "3"}},
                      "expert_tokens_count_or_cumsum_flag: must be 0 (none), 1 (cumsum) or 2");
  expect_init_refused({{"--expert-num", "0"}},
                      "expert_num: must be >= 1 with expert_tokens_count_or_cumsum_flag 2");
}

TEST_F(BadRoutingInput, InitIdValues) {
  expect_init_refused({{"--expert-idx", ints("neg.npy", {0, 1, -1, 2}, {kTokens, kK})}},
                      "expert_idx: [1, 0] = -1 is negative");
  expect_init_refused({{"--expert-idx", ints("big.npy", {0, 1, kExperts}, {kTokens, kK})}},
                      "expert_idx: [1, 0] = 4 is not below expert_num = 4");
}

TEST_F(BadRoutingInput, FinalizeShapesAndDtypes) {
  expect_finalize_refused({{"--drop-pad-mode", "4"}}, "drop_pad_mode: must be 0, 1, 2 or 3, got 4");
  expect_finalize_refused({{"--expanded-x", floats("ex3d.npy", {kExperts, 8, kHidden})}},
                          "expanded_x: must be 2-D");
  expect_finalize_refused({{"--drop-pad-mode", "3"}}, "expanded_x: must be 3-D");
  expect_finalize_refused({{"--expanded-row-idx", ints("rows2d.npy", {0}, {kTokens, kK})}},
                          "expanded_row_idx: must be 1-D");
  expect_finalize_refused({{"--x1", ""}}, "x2: needs x1");
  expect_finalize_refused({{"--x1", floats("x1s.npy", {kTokens - 1, kHidden})}},
                          "x1: must be [T, H] = [16, 8], got float32[15, 8]");
  expect_finalize_refused({{"--x2", floats("x2s.npy", {kTokens, kHidden + 1})}},
                          "x2: must be [T, H]");
  expect_finalize_refused({{"--expert-idx", ""}}, "bias: needs expert_idx");
  expect_finalize_refused({{"--bias", floats("bias1d.npy", {kHidden})}}, "bias: must be [E, H]");
  expect_finalize_refused({{"--scales", floats("scales3d.npy", {kTokens, kK, 1})}},
                          "scales: must be 2-D");
  expect_finalize_refused({{"--x1", floats("x1h.npy", {kTokens, kHidden}, "float16")}},
                          "x1: dtype float16 is not expanded_x's float32");
  expect_finalize_refused({{"--scales", floats("scalesh.npy", {kTokens, kK}, "float16")}},
                          "scales: dtype float16 does not pair with expanded_x's float32");
  expect_finalize_refused({{"--expanded-x", ints("exi.npy", {0}, {kTokens * kK, kHidden})},
                           {"--x1", ""},
                           {"--x2", ""},
                           {"--bias", ""},
                           {"--scales", ""}},
                          "expanded_x: dtype int32");
}

TEST_F(BadRoutingInput, FinalizeRowIndexValues) {
  std::vector<std::int64_t> rows(kTokens * kK);
  std::iota(rows.begin(), rows.end(), 0);
  rows[5] = -2;
  expect_finalize_refused({{"--expanded-row-idx", ints("m2.npy", rows, {kTokens * kK})}},
                          "expanded_row_idx: [5] = -2 is below -1");
  rows[5] = -1;
  expect_finalize_refused({{"--expanded-row-idx", ints("m1.npy", rows, {kTokens * kK})}},
                          "expanded_row_idx: [5] = -1 (a dropped row) needs drop_pad_mode 1 or 3");
  rows[5] = kExperts * 8;  // E * C in mode 3, with expanded_x [E, C, H]
  expect_finalize_refused({{"--drop-pad-mode", "3"},
                           {"--expanded-x", floats("exc.npy", {kExperts, 8, kHidden})},
                           {"--expanded-row-idx", ints("past.npy", rows, {kTokens * kK})}},
                          "expanded_row_idx: [5] = 32 is not below E * C = 32");
  expect_finalize_refused({{"--expert-idx", ints("ids_past.npy", {0, kExperts}, {kTokens, kK})}},
                          "expert_idx: [0, 1] = 4 is not a row of bias (E = 4)");
}

// The .npy files and the command line, named by flag or argument.
TEST_F(BadRoutingInput, FilesAndFlags) {
  expect_init_refused({{"--x", in("missing.npy")}}, "x: cannot open");
  expect_init_refused({{"--expert-idx", ""}}, "--expert-idx");
  expect_init_refused({{"--x", floats("xb.npy", {kTokens, kHidden}, "bfloat16")}},
                      "x: " + in("xb.npy") + " holds <u2; name its dtype with --x-dtype");
  expect_init_refused({}, "x: --x-dtype bfloat16 is stored as <u2", {"--x-dtype", "bfloat16"});
  expect_init_refused({}, "x: unknown dtype name 'float9'", {"--x-dtype", "float9"});
  expect_init_refused({{"--active-num", "18446744073709551616"}},
                      "--active-num: 18446744073709551616 does not fit in int64");
  expect_init_refused({}, "--threads: must be >= 0", {"--threads", "-1"});
  expect_init_refused({}, "--bogus", {"--bogus"});
  expect_finalize_refused({{"--expanded-row-idx", ""}}, "--expanded-row-idx");
  expect_finalize_refused({{"--scales", ""}}, "scales: --scales-dtype needs --scales",
                          {"--scales-dtype", "bfloat16"});
  expect_finalize_refused({}, "expanded_x: --expanded-x-dtype bfloat16 is stored as <u2",
                          {"--expanded-x-dtype", "bfloat16"});
  expect_finalize_refused(
      {{"--expanded-x", floats("exb.npy", {kTokens * kK, kHidden}, "bfloat16")}},
      "x1: --expanded-x-dtype bfloat16 is stored as <u2", {"--expanded-x-dtype", "bfloat16"});
  expect_finalize_refused({{"--drop-pad-mode", "-9223372036854775809"}},
                          "--drop-pad-mode: -9223372036854775809 does not fit in int64");
  expect_finalize_refused({{"--out", ints("plain.npy", {1}, {1})}}, "out: cannot create");
  // A refused call creates no output directory either.
  expect_finalize_refused({{"--x1", ""}, {"--out", (dir_ / "never").string()}}, "x2: needs x1");
  EXPECT_FALSE(std::filesystem::exists(dir_ / "never"));
}

// A rename that fails part-way (the fourth output is a non-empty directory)
// leaves the earlier outputs of init-routing byte for byte as they were.
TEST_F(BadRoutingInput, AFailedRenameLeavesTheEarlierOutputs) {
  const std::filesystem::path out = dir_ / "init_out",
                              blocked = out / "expert_tokens_before_capacity.npy";
  std::filesystem::remove(blocked);
  std::filesystem::create_directory(blocked);
  std::ofstream(blocked / "kept") << "kept";
  before_ = snapshot();
  ASSERT_EQ(before_.size(), 4u);  // three of init-routing, one of finalize-routing
  expect_init_refused({{"--x", floats("other_x.npy", {kTokens, kHidden})}},
                      "error: out: cannot rename ");
  EXPECT_EQ(listing(out),
            file_names({"expanded_x", "expanded_row_idx", "expert_tokens_count_or_cumsum",
                        "expert_tokens_before_capacity"}));
  EXPECT_EQ(slurp(blocked / "kept"), "kept");
}

}  // namespace
}  // namespace moe_reroute::tools
