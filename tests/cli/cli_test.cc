// The moe-reroute binary end to end: `gen` then the `run` command it prints,
// compared byte for byte with the naive reference; the inverse restoring the
// inputs; and every bad input refused with exit status 2, one `error:` line
// naming the argument, and nothing written to the output dir.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "moe_reroute/version.h"
#include "npy.h"
#include "program.h"
#include "refusal.h"
#include "reference.h"

namespace moe_reroute::tools {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

Result run_cli(const std::vector<std::string>& args) { return run_program(MOE_REROUTE_CLI, args); }

std::vector<std::string> words(const std::string& line) {
  std::istringstream in(line);
  std::vector<std::string> result;
  for (std::string word; in >> word;) result.push_back(word);
  return result;
}

// The `run` arguments `gen` printed, with the output directory replaced.
std::vector<std::string> printed_run_args(const std::string& gen_stdout,
                                          const std::filesystem::path& out) {
  std::vector<std::string> args = words(gen_stdout);
  EXPECT_GE(args.size(), 7u);
  EXPECT_EQ(args[0], "moe-reroute");
  EXPECT_EQ(args[args.size() - 2], "--out");
  args.erase(args.begin());
  args.back() = out.string();
  return args;
}

std::vector<std::byte> bytes_of(const NpyArray& array) { return array.data; }

template <typename T>
std::vector<std::byte> bytes_of(const std::vector<T>& values) {
  std::vector<std::byte> bytes(values.size() * sizeof(T));
  if (!bytes.empty()) std::memcpy(bytes.data(), values.data(), bytes.size());  // never null
  return bytes;
}

std::vector<std::int64_t> counts_of(const NpyArray& counts) {
  std::vector<std::int64_t> values;
  const std::size_t itemsize = counts.descr == "<i8" ? 8 : 4;
  for (std::size_t i = 0; i < counts.data.size(); i += itemsize) {
    std::int64_t value = 0;
    if (itemsize == 8) {
      std::memcpy(&value, counts.data.data() + i, 8);
    } else {
      std::int32_t value32 = 0;
      std::memcpy(&value32, counts.data.data() + i, 4);
      value = value32;
    }
    values.push_back(value);
  }
  return values;
}

// Bytes of one dim-0 row of a stored array.
std::int64_t row_bytes(const NpyArray& array) {
  std::int64_t bytes = std::stoll(array.descr.substr(2));
  for (std::size_t d = 1; d < array.shape.size(); ++d) bytes *= array.shape[d];
  return bytes;
}

const std::set<std::string> kInverseOutputs = {
    "restored_tokens.npy", "restored_per_token_scales.npy", "restored_topk_weight.npy"};

// An absent optional output: the empty (0,) float32 file.
void expect_absent(const NpyArray& array) {
  EXPECT_EQ(array.descr, "<f4");
  EXPECT_EQ(array.shape, std::vector<std::int64_t>{0});
}

struct Case {
  std::string name;
  std::vector<std::string> gen_args;
  int idx_type = 0;
  int expert_token_num_type = 1;
};

class EndToEnd : public ::testing::TestWithParam<Case> {};

TEST_P(EndToEnd, GenThenRunMatchesTheReferenceAndTheInverseRestoresTheInputs) {
  const Case& c = GetParam();
  const TestDir dir;
  std::vector<std::string> gen_args = {"gen",
                                       "--out",
                                       (dir / "in").string(),
                                       "--idx-type",
                                       std::to_string(c.idx_type),
                                       "--expert-token-num-type",
                                       std::to_string(c.expert_token_num_type)};
  gen_args.insert(gen_args.end(), c.gen_args.begin(), c.gen_args.end());
  const Result gen = run_cli(gen_args);
  ASSERT_EQ(gen.status, 0) << gen.err;
  const std::vector<std::string> run_args = printed_run_args(gen.out, dir / "out");
  const Result run = run_cli(run_args);
  ASSERT_EQ(run.status, 0) << run.err;
  EXPECT_EQ(run.err, "");

  const auto in = [&](const char* name) { return read_npy(dir / "in" / name, name); };
  const auto out = [&](const char* name) { return read_npy(dir / "out" / name, name); };
  const std::set<std::string> inputs = listing(dir / "in");
  const bool has_scales = inputs.count("scales.npy") > 0,
             has_weight = inputs.count("topk_weight.npy") > 0;
  const NpyArray tokens = in("tokens.npy"), counts = in("counts.npy");
  const NpyArray scales = has_scales ? in("scales.npy") : NpyArray{};
  const NpyArray weight = has_weight ? in("topk_weight.npy") : NpyArray{};

  testing::ReferenceInputs ref;
  ref.num_ranks = counts.shape[0];
  ref.num_experts = counts.shape[1];
  ref.counts = counts_of(counts);
  const std::int64_t num_tokens = tokens.shape[0];
  ref.tokens = tokens.data.data();
  ref.token_row_bytes = row_bytes(tokens);
  if (has_scales) {
    ref.scales = scales.data.data();
    ref.scale_row_bytes = row_bytes(scales);
  }
  if (has_weight) ref.weight = weight.data.data();
  const testing::ReferenceOutputs expected =
      testing::reference_reroute(ref, c.expert_token_num_type, c.idx_type);

  EXPECT_EQ(listing(dir / "out"),
            (std::set<std::string>{"permute_tokens.npy", "permute_per_token_scales.npy",
                                   "permute_token_idx.npy", "expert_token_num.npy",
                                   "permute_topk_weight.npy"}));
  const NpyArray permute_tokens = out("permute_tokens.npy");
  EXPECT_EQ(permute_tokens.descr, tokens.descr);
  EXPECT_EQ(permute_tokens.shape, tokens.shape);
  EXPECT_TRUE(bytes_of(permute_tokens) == expected.tokens) << "permute_tokens";
  const NpyArray permute_scales = out("permute_per_token_scales.npy");
  EXPECT_EQ(permute_scales.shape,
            has_scales ? scales.shape : std::vector<std::int64_t>{num_tokens});
  EXPECT_EQ(permute_scales.descr, has_scales ? scales.descr : "<f4");
  EXPECT_TRUE(bytes_of(permute_scales) == expected.scales) << "permute_per_token_scales";
  const NpyArray idx = out("permute_token_idx.npy");
  EXPECT_EQ(idx.descr, "<i4");
  EXPECT_TRUE(bytes_of(idx) == bytes_of(expected.token_idx)) << "permute_token_idx";
  const NpyArray expert_token_num = out("expert_token_num.npy");
  EXPECT_EQ(expert_token_num.descr, counts.descr);
  EXPECT_EQ(counts_of(expert_token_num), expected.expert_token_num);
  const NpyArray permute_weight = out("permute_topk_weight.npy");
  if (has_weight) {
    EXPECT_EQ(permute_weight.shape, weight.shape);
    EXPECT_EQ(permute_weight.descr, "<f4");
  } else {
    expect_absent(permute_weight);
  }
  EXPECT_TRUE(bytes_of(permute_weight) == expected.weight) << "permute_topk_weight";

  // The inverse takes the permuted files back; the dtype flags of `run` still apply.
  std::vector<std::string> inverse_args = {"inverse",
                                           "--tokens",
                                           (dir / "out" / "permute_tokens.npy").string(),
                                           "--counts",
                                           (dir / "in" / "counts.npy").string(),
                                           "--out",
                                           (dir / "restored").string()};
  for (std::size_t i = 0; i + 1 < run_args.size(); ++i) {
    if (run_args[i] == "--tokens-dtype" || run_args[i] == "--scales-dtype") {
      inverse_args.insert(inverse_args.end(), {run_args[i], run_args[i + 1]});
    }
  }
  if (has_scales) {
    inverse_args.insert(inverse_args.end(),
                        {"--scales", (dir / "out" / "permute_per_token_scales.npy").string()});
  }
  if (has_weight) {
    inverse_args.insert(inverse_args.end(),
                        {"--topk-weight", (dir / "out" / "permute_topk_weight.npy").string()});
  }
  const Result inverse = run_cli(inverse_args);
  ASSERT_EQ(inverse.status, 0) << inverse.err;
  EXPECT_EQ(listing(dir / "restored"), kInverseOutputs);
  const auto restored = [&](const char* name) { return read_npy(dir / "restored" / name, name); };
  const NpyArray restored_tokens = restored("restored_tokens.npy");
  EXPECT_EQ(restored_tokens.descr, tokens.descr);
  EXPECT_EQ(restored_tokens.shape, tokens.shape);
  EXPECT_TRUE(restored_tokens.data == tokens.data) << "restored_tokens";
  const NpyArray restored_scales = restored("restored_per_token_scales.npy");
  const NpyArray restored_weight = restored("restored_topk_weight.npy");
  if (has_scales) {
    EXPECT_TRUE(restored_scales.data == scales.data) << "restored scales";
  } else {
    expect_absent(restored_scales);
  }
  if (has_weight) {
    EXPECT_TRUE(restored_weight.data == weight.data) << "restored weight";
  } else {
    expect_absent(restored_weight);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Dtypes, EndToEnd,
    ::testing::Values(
        Case{"int8_gather_count", {"--tokens", "300", "--hidden", "40"}},
        Case{"float16_scatter_cumsum_f32x3_int64",
             {"--tokens-dtype", "float16", "--scales", "f32x3", "--counts-dtype", "int64",
              "--ranks", "3", "--experts", "5", "--skew", "1.5"},
             1,
             0},
        Case{"bfloat16_scatter", {"--tokens-dtype", "bfloat16", "--hidden", "33"}, 1, 1},
        Case{"float8_e4m3fn_cumsum", {"--tokens-dtype", "float8_e4m3fn", "--no-topk-weight"}, 0, 0},
        Case{"float8_e5m2", {"--tokens-dtype", "float8_e5m2", "--scales", "none", "--ranks", "1"}},
        Case{"hifloat8_one_expert",
             {"--tokens-dtype", "hifloat8", "--experts", "1", "--tokens", "17"},
             1,
             0},
        Case{"float8_e5m2_mx_scales",
             {"--tokens-dtype", "float8_e5m2", "--hidden", "256", "--scales", "e8m0"}},
        Case{"float4_e2m1_e8m0_rows",
             {"--tokens-dtype", "float4_e2m1", "--hidden", "256", "--scales", "e8m0a"}},
        Case{"float4_e1m2_e8m0x3_scatter",
             {"--tokens-dtype", "float4_e1m2", "--hidden", "18", "--scales", "e8m0x3"},
             1,
             1},
        Case{"float32_bare", {"--tokens-dtype", "float32", "--scales", "none", "--no-topk-weight"}},
        Case{"uint8_zero_tokens", {"--tokens-dtype", "uint8", "--tokens", "0"}}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// Rule 7's pairing table (docs/spec.md), written out for the tests: the gen
// scale forms each token dtype takes. The refused rest is BadInput.ScalePairingTable.
const std::vector<std::string> kScaleForms = {"none",  "f32",    "f32x3", "f32k2",
                                              "e8m0a", "e8m0x3", "e8m0"};

bool scales_pair(const std::string& tokens, const std::string& scales) {
  const bool fp8 = tokens == "float8_e5m2" || tokens == "float8_e4m3fn";
  const bool fp4 = tokens == "float4_e2m1" || tokens == "float4_e1m2";
  if (scales == "none" || scales == "f32" || scales == "f32x3") return true;
  if (scales == "f32k2" || scales == "e8m0") return fp8;
  return fp8 || fp4;
}

const std::vector<std::string> kTokenDtypes = {
    "float16",     "bfloat16",    "int8",        "float8_e5m2", "float8_e4m3fn",
    "hifloat8",    "float4_e2m1", "float4_e1m2", "float32",     "uint8"};

std::vector<Case> pairing_cases(bool accepted) {
  std::vector<Case> cases;
  for (const std::string& tokens : kTokenDtypes) {
    for (const std::string& scales : kScaleForms) {
      if (scales_pair(tokens, scales) != accepted) continue;
      cases.push_back({tokens + "_" + scales,
                       {"--tokens-dtype", tokens, "--hidden", "128", "--tokens", "48", "--scales",
                        scales}});
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(
    ScalePairingTable, EndToEnd, ::testing::ValuesIn(pairing_cases(true)),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// Static shapes (docs/spec.md section 9): gen with spare rows and k = 16, then
// run; rows the contract fixes match the naive reference, the index in full.
TEST(StaticShapes, RunAndInverseFollowTheAlignedLayout) {
  for (const int idx_type : {0, 1}) {
    const TestDir dir;
    const Result gen = run_cli({"gen", "--out", (dir / "in").string(), "--tokens", "200",
                                "--valid-tokens", "150", "--expert-alignment", "16", "--hidden",
                                "24", "--ranks", "3", "--experts", "5", "--tokens-dtype",
                                "bfloat16", "--expert-token-num-type", "0", "--idx-type",
                                std::to_string(idx_type)});
    ASSERT_EQ(gen.status, 0) << gen.err;
    EXPECT_THAT(gen.out, HasSubstr("--expert-alignment 16 --allow-spare-rows"));
    const Result run = run_cli(printed_run_args(gen.out, dir / "out"));
    ASSERT_EQ(run.status, 0) << run.err;

    const auto in = [&](const char* name) { return read_npy(dir / "in" / name, name); };
    const auto out = [&](const char* name) { return read_npy(dir / "out" / name, name); };
    const NpyArray tokens = in("tokens.npy"), counts = in("counts.npy");
    const NpyArray scales = in("scales.npy"), weight = in("topk_weight.npy");
    testing::ReferenceInputs ref;
    ref.num_ranks = 3;
    ref.num_experts = 5;
    ref.counts = counts_of(counts);
    ref.tokens = tokens.data.data();
    ref.token_row_bytes = row_bytes(tokens);
    ref.scales = scales.data.data();
    ref.scale_row_bytes = row_bytes(scales);
    ref.weight = weight.data.data();
    ref.num_tokens = 200;
    ref.expert_alignment = 16;
    const testing::ReferenceOutputs expected = testing::reference_reroute(ref, 0, idx_type);
    const std::int64_t rows = 200 + 5 * 15;
    const NpyArray permute_tokens = out("permute_tokens.npy");
    EXPECT_EQ(permute_tokens.shape, (std::vector<std::int64_t>{rows, 24}));
    const auto specified = [&](const NpyArray& got, const std::vector<std::byte>& want) {
      const std::size_t bytes = static_cast<std::size_t>(expected.specified_rows * row_bytes(got));
      return got.data.size() == want.size() &&
             std::equal(want.begin(), want.begin() + static_cast<std::ptrdiff_t>(bytes),
                        got.data.begin());
    };
    EXPECT_TRUE(specified(permute_tokens, expected.tokens)) << "permute_tokens";
    EXPECT_TRUE(specified(out("permute_per_token_scales.npy"), expected.scales));
    EXPECT_TRUE(specified(out("permute_topk_weight.npy"), expected.weight));
    EXPECT_TRUE(bytes_of(out("permute_token_idx.npy")) == bytes_of(expected.token_idx));
    EXPECT_EQ(counts_of(out("expert_token_num.npy")), expected.expert_token_num);

    // And back: R rows to A = 200, the 150 valid rows restored.
    const Result inverse = run_cli(
        {"inverse", "--tokens", (dir / "out" / "permute_tokens.npy").string(), "--counts",
         (dir / "in" / "counts.npy").string(), "--tokens-dtype", "bfloat16",
         "--expert-alignment", "16", "--allow-spare-rows", "--out", (dir / "back").string()});
    ASSERT_EQ(inverse.status, 0) << inverse.err;
    const NpyArray restored = read_npy(dir / "back" / "restored_tokens.npy", "restored");
    EXPECT_EQ(restored.shape, tokens.shape);
    EXPECT_TRUE(std::equal(tokens.data.begin(), tokens.data.begin() + 150 * 48,
                           restored.data.begin()));
  }
}

// Every inverse writes all three outputs, so none of an earlier run's stays
// beside this run's: here the scales and weight of a run that had them.
TEST(Cli, InverseReplacesEveryOutput) {
  const TestDir dir;
  const Result gen = run_cli({"gen", "--out", (dir / "in").string(), "--tokens", "64", "--hidden",
                              "16", "--ranks", "2", "--experts", "3"});
  ASSERT_EQ(gen.status, 0) << gen.err;
  const std::vector<std::string> inverse = {
      "inverse", "--tokens", (dir / "in" / "tokens.npy").string(), "--counts",
      (dir / "in" / "counts.npy").string(), "--out", (dir / "out").string()};
  std::vector<std::string> with_optional = inverse;
  with_optional.insert(with_optional.end(),
                       {"--scales", (dir / "in" / "scales.npy").string(), "--topk-weight",
                        (dir / "in" / "topk_weight.npy").string()});
  const Result first = run_cli(with_optional);
  ASSERT_EQ(first.status, 0) << first.err;
  const Result second = run_cli(inverse);
  ASSERT_EQ(second.status, 0) << second.err;
  EXPECT_EQ(listing(dir / "out"), kInverseOutputs);
  for (const char* name : {"restored_per_token_scales.npy", "restored_topk_weight.npy"}) {
    SCOPED_TRACE(name);
    expect_absent(read_npy(dir / "out" / name, name));
  }
}

TEST(Cli, PrintsTheVersion) {
  const Result result = run_cli({"--version"});
  EXPECT_EQ(result.status, 0);
  EXPECT_THAT(result.out, HasSubstr(MOE_REROUTE_VERSION_STRING));
}

// Bad input: exit status 2, exactly one `error:` line that names the argument,
// and nothing (not even a temporary) in the output directory.
class BadInput : public ::testing::Test {
 protected:
  void SetUp() override {
    std::filesystem::create_directories(dir_ / "out");
    const Result gen = run_cli({"gen", "--out", (dir_ / "in").string(), "--tokens", "64",
                                "--hidden", "16", "--ranks", "2", "--experts", "3"});
    ASSERT_EQ(gen.status, 0) << gen.err;
  }

  std::string in(const char* name) const { return (dir_ / "in" / name).string(); }

  // Writes an .npy file of `descr` and `shape` holding `values` (repeated).
  std::string file(const char* name, const char* descr, std::vector<std::int64_t> shape,
                   std::vector<std::int64_t> values = {1}) {
    std::int64_t elements = 1;
    for (std::int64_t d : shape) elements *= d;
    const std::size_t itemsize = static_cast<std::size_t>(std::stoi(std::string(descr + 2)));
    std::vector<std::byte> data(static_cast<std::size_t>(elements) * itemsize);
    for (std::size_t i = 0; i * itemsize < data.size(); ++i) {
      std::memcpy(data.data() + i * itemsize, &values[i % values.size()], itemsize);
    }
    const std::filesystem::path path = dir_ / name;
    write_npy(path, descr, shape, data.data(), data.size(), "test");
    return path.string();
  }
  std::string raw(const char* name, const std::string& bytes) {
    std::ofstream(dir_ / name, std::ios::binary) << bytes;
    return (dir_ / name).string();
  }

  // `run` (or `inverse`) with the generated inputs, `replace`d and `extra` flags added.
  void expect_refused(const std::vector<std::string>& extra, const std::string& argument,
                      std::vector<std::pair<std::string, std::string>> replace = {},
                      const char* command = "run") {
    std::vector<std::pair<std::string, std::string>> flags = {
        {"--tokens", in("tokens.npy")},
        {"--counts", in("counts.npy")},
        {"--scales", in("scales.npy")},
        {"--topk-weight", in("topk_weight.npy")},
        {"--out", (dir_ / "out").string()}};
    for (const auto& [flag, value] : replace) {
      bool found = false;
      for (auto& f : flags) {
        if (f.first == flag) {
          f.second = value;
          found = true;
        }
      }
      if (!found) flags.emplace_back(flag, value);
    }
    std::vector<std::string> args = {command};
    for (const auto& [flag, value] : flags) {
      if (value.empty()) continue;
      args.insert(args.end(), {flag, value});
    }
    args.insert(args.end(), extra.begin(), extra.end());
    expect_bad_input(run_cli(args), argument);
    EXPECT_TRUE(listing(dir_ / "out").empty())
        << "output written on error: " << *listing(dir_ / "out").begin();
  }

  TestDir dir_;
};

TEST_F(BadInput, GeneratedInputsRunCleanly) {
  const Result result = run_cli({"run", "--tokens", in("tokens.npy"), "--counts", in("counts.npy"),
                                 "--scales", in("scales.npy"), "--out", (dir_ / "out").string()});
  EXPECT_EQ(result.status, 0) << result.err;
  EXPECT_EQ(listing(dir_ / "out").size(), 5u);
}

// A rename that fails part-way (expert_token_num.npy, the fourth output, is a
// non-empty directory) leaves every earlier output byte for byte as it was.
TEST_F(BadInput, AFailedRenameLeavesTheEarlierOutputs) {
  const std::filesystem::path out = dir_ / "out";
  const Result first = run_cli({"run", "--tokens", in("tokens.npy"), "--counts", in("counts.npy"),
                                "--scales", in("scales.npy"), "--topk-weight",
                                in("topk_weight.npy"), "--out", out.string()});
  ASSERT_EQ(first.status, 0) << first.err;
  std::filesystem::remove(out / "expert_token_num.npy");
  std::filesystem::create_directory(out / "expert_token_num.npy");
  std::ofstream(out / "expert_token_num.npy" / "kept") << "kept";
  std::vector<std::pair<std::string, std::string>> before;
  for (const std::string& name : listing(out)) {
    if (std::filesystem::is_regular_file(out / name)) before.emplace_back(name, slurp(out / name));
  }
  ASSERT_EQ(before.size(), 4u);

  const Result gen = run_cli({"gen", "--out", (dir_ / "in2").string(), "--tokens", "64",
                              "--hidden", "16", "--ranks", "2", "--experts", "3", "--seed", "1"});
  ASSERT_EQ(gen.status, 0) << gen.err;
  ASSERT_NE(slurp(dir_ / "in2" / "tokens.npy"), slurp(in("tokens.npy")));
  const Result second = run_cli(printed_run_args(gen.out, out));
  EXPECT_EQ(second.status, 2);
  EXPECT_THAT(second.err, StartsWith("error: out: cannot rename "));
  EXPECT_EQ(std::count(second.err.begin(), second.err.end(), '\n'), 1) << second.err;

  std::set<std::string> names = {"expert_token_num.npy"};
  for (const auto& [name, bytes] : before) {
    names.insert(name);
    EXPECT_TRUE(slurp(out / name) == bytes) << name << " changed";
  }
  EXPECT_EQ(listing(out), names);  // no temporary or moved-aside file either
  EXPECT_EQ(slurp(out / "expert_token_num.npy" / "kept"), "kept");
}

TEST_F(BadInput, UnreadableOrMalformedFiles) {
  expect_refused({}, "tokens: cannot open", {{"--tokens", (dir_ / "missing.npy").string()}});
  expect_refused({}, "tokens: ", {{"--tokens", raw("text.npy", "not an npy file\n")}});
  const std::string tokens = slurp(in("tokens.npy"));
  expect_refused({},
                 "tokens: ", {{"--tokens", raw("short.npy", tokens.substr(0, tokens.size() - 1))}});
  expect_refused({}, "tokens: ", {{"--tokens", raw("header.npy", tokens.substr(0, 40))}});
  std::string big_endian = tokens;
  big_endian.replace(big_endian.find("'|i1'"), 5, "'>i2'");
  expect_refused({}, "tokens: ", {{"--tokens", raw("big.npy", big_endian)}});
  std::string fortran = tokens;
  fortran.replace(fortran.find("False"), 5, "True ");
  expect_refused({}, "tokens: ", {{"--tokens", raw("fortran.npy", fortran)}});
  expect_refused({}, "expert_token_num_per_rank: ", {{"--counts", raw("c.npy", "\x93NUMPY")}});
  expect_refused({}, "per_token_scales: ", {{"--scales", file("s.npy", "<f8", {64})}});
  expect_refused({}, "expert_topk_weight: ", {{"--topk-weight", raw("w.npy", "")}});
}

TEST_F(BadInput, Spec4Violations) {
  expect_refused({}, "tokens: must be 2-D", {{"--tokens", file("t1.npy", "|i1", {64})}});
  expect_refused({}, "tokens: H must be >= 1", {{"--tokens", file("t0.npy", "|i1", {64, 0})}});
  expect_refused({}, "expert_token_num_per_rank: must be 2-D",
                 {{"--counts", file("c1.npy", "<i4", {6})}});
  expect_refused({}, "expert_token_num_per_rank: dtype float32",
                 {{"--counts", file("cf.npy", "<f4", {2, 3})}});
  expect_refused({}, "expert_token_num_per_rank: N and E",
                 {{"--counts", file("c0.npy", "<i4", {0, 3})}});
  expect_refused({}, "expert_token_num_per_rank: count[0][1] = -1 is negative",
                 {{"--counts", file("cn.npy", "<i8", {2, 3}, {65, -1})}});
  expect_refused({}, "expert_token_num_per_rank: counts sum to 60",
                 {{"--counts", file("cs.npy", "<i4", {2, 3}, {10})}});
  expect_refused({}, "per_token_scales: dim 0 is 63", {{"--scales", file("s63.npy", "<f4", {63})}});
  expect_refused({}, "per_token_scales: 5-D array, at most 4 dims", {{"--scales", file("s5d.npy", "<f4", {64, 1, 1, 1, 1})}});
  expect_refused({}, "per_token_scales: dtype int8", {{"--scales", file("si.npy", "|i1", {64})}});
  expect_refused({}, "per_token_scales: dtype uint8 must be float32 or float8_e8m0",
                 {{"--scales", file("se.npy", "|u1", {64})}});
  expect_refused({"--scales-dtype", "float8_e8m0"}, "per_token_scales: float8_e8m0 scales pair only",
                 {{"--scales", file("se1.npy", "|u1", {64})}});
  expect_refused({}, "expert_topk_weight: dim 1 must be 1",
                 {{"--topk-weight", file("w2.npy", "<f4", {64, 2})}});
  expect_refused({}, "expert_topk_weight: dtype int32",
                 {{"--topk-weight", file("wi.npy", "<i4", {64, 1})}});
  expect_refused({}, "expert_topk_weight: dim 0 is 32",
                 {{"--topk-weight", file("w0.npy", "<f4", {32, 1})}});
  expect_refused({"--idx-type", "2"}, "idx_type: must be 0");
  expect_refused({"--idx-type", "4294967296"},
                 "idx_type: must be 0 (gather) or 1 (scatter), got 4294967296");
  expect_refused({"--expert-token-num-type", "-1"}, "expert_token_num_type: must be 0");
}

// The refused rows of rule 7's pairing table, each through `run`.
TEST_F(BadInput, ScalePairingTable) {
  ASSERT_EQ(pairing_cases(/*accepted=*/false).size(), 28u);  // 6 x 4 plain + 2 x 2 FP4 rows
  for (const Case& c : pairing_cases(/*accepted=*/false)) {
    SCOPED_TRACE(c.name);
    const std::string tokens = c.gen_args[1], scales = c.gen_args[7];
    const bool fp4 = tokens.starts_with("float4");
    const char* descr = tokens == "float16"    ? "<f2"
                        : tokens == "bfloat16" ? "<u2"
                        : tokens == "int8"     ? "|i1"
                        : tokens == "float32"  ? "<f4"
                                               : "|u1";
    const bool named = std::string(descr) == "<u2" || (std::string(descr) == "|u1" && tokens != "uint8");
    std::vector<std::string> extra;
    if (named) extra = {"--tokens-dtype", tokens};
    const bool e8m0 = scales.starts_with("e8m0");
    if (e8m0) extra.insert(extra.end(), {"--scales-dtype", "float8_e8m0"});
    const std::vector<std::int64_t> shape = scales == "f32" || scales == "e8m0a" ? std::vector<std::int64_t>{64}
                                            : scales.ends_with("x3") ? std::vector<std::int64_t>{64, 3}
                                                                     : std::vector<std::int64_t>{64, 1, 2};
    expect_refused(extra, "per_token_scales: ",
                   {{"--tokens", file("t.npy", descr, {64, fp4 ? 8 : 16})},
                    {"--scales", file("s.npy", e8m0 ? "|u1" : "<f4", shape)}});
  }
}

TEST_F(BadInput, DtypeNames) {
  expect_refused({"--tokens-dtype", "float9"}, "tokens: unknown dtype name 'float9'");
  expect_refused({"--tokens-dtype", "float16"}, "tokens: --tokens-dtype float16 is stored as <f2");
  expect_refused({"--tokens-dtype", "float8_e8m0"},
                 "tokens: dtype float8_e8m0 is not a token dtype",
                 {{"--tokens", file("u1.npy", "|u1", {64, 16})}});
  expect_refused({}, "tokens: ", {{"--tokens", file("u2.npy", "<u2", {64, 16})}});
  expect_refused({"--scales-dtype", "bfloat16"},
                 "per_token_scales: --scales-dtype bfloat16 is stored as <u2");
  expect_refused({"--scales-dtype", "float8_e8m0"},
                 "per_token_scales: --scales-dtype needs --scales", {{"--scales", ""}});
}

TEST_F(BadInput, CommandLineErrors) {
  expect_refused({"--bogus"}, "--bogus");
  expect_refused({}, "--out", {{"--out", ""}});
  expect_refused({}, "--counts", {{"--counts", ""}});
  // gen: the workload flags pass the core's inference before anything is
  // allocated by them.
  for (const auto& [args, message] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"gen", "--tokens", "4", "--valid-tokens", "-5", "--out", (dir_ / "g").string()},
            "--valid-tokens: must be -1 (all) or 0 to --tokens, got -5"},
           {{"gen", "--tokens", "4", "--scales", "e8m0", "--out", (dir_ / "g").string()},
            "per_token_scales: float8_e8m0 scales pair only"}}) {
    const Result refused = run_cli(args);
    EXPECT_EQ(refused.status, 2) << message;
    EXPECT_THAT(refused.err, HasSubstr(message));
  }
  expect_refused({"--threads", "-1"}, "--threads: must be >= 0 (0 = all hardware threads), got -1");
  expect_refused({"--idx-type", "gather"}, "--idx-type");
  expect_refused({}, "out: cannot create", {{"--out", raw("plain-file", "x")}});
  const Result no_command = run_cli({});
  EXPECT_EQ(no_command.status, 2);
  EXPECT_THAT(no_command.err, StartsWith("error: "));
}

// An integer past its option's 64-bit type is refused as typed, by every
// subcommand; one that fits reaches the operator's checks unchanged.
TEST_F(BadInput, IntegersPastTheirTypeAreQuotedAsTyped) {
  expect_refused({"--idx-type", "18446744073709551616"},
                 "--idx-type: 18446744073709551616 does not fit in int64");
  expect_refused({"--expert-alignment", "18446744073709551616"},
                 "--expert-alignment: 18446744073709551616 does not fit in int64");
  expect_refused({"--expert-token-num-type", "-9223372036854775809"},
                 "--expert-token-num-type: -9223372036854775809 does not fit in int64");
  expect_refused({"--expert-alignment", "99999999999999999999"},
                 "--expert-alignment: 99999999999999999999 does not fit in int64", {}, "inverse");
  expect_refused({"--expert-alignment", "9223372036854775807"},
                 "expert_alignment: 9223372036854775807 with E = 3 experts overflows int64 rows");
  const std::string g = (dir_ / "g").string();
  for (const auto& [args, message] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"gen", "--tokens", "18446744073709551616", "--out", g},
            "--tokens: 18446744073709551616 does not fit in int64"},
           {{"gen", "--valid-tokens", "-9223372036854775809", "--out", g},
            "--valid-tokens: -9223372036854775809 does not fit in int64"},
           {{"gen", "--seed", "18446744073709551616", "--out", g},
            "--seed: 18446744073709551616 does not fit in uint64"},
           {{"gen", "--seed", "-1", "--out", g}, "--seed: -1 does not fit in uint64"}}) {
    const Result refused = run_cli(args);
    EXPECT_EQ(refused.status, 2) << message;
    EXPECT_EQ(refused.err, "error: " + message + "\n");
    EXPECT_FALSE(std::filesystem::exists(g));
  }
}

TEST_F(BadInput, InverseErrors) {
  expect_refused({}, "expert_token_num_per_rank: counts sum to 60",
                 {{"--counts", file("cs.npy", "<i4", {2, 3}, {10})}}, "inverse");
  expect_refused({}, "per_token_scales: dim 0 is 63", {{"--scales", file("s63.npy", "<f4", {63})}},
                 "inverse");
  expect_refused({"--idx-type", "0"}, "--idx-type", {}, "inverse");
}

TEST_F(BadInput, AMissingOutputDirectoryIsNotCreated) {
  const std::filesystem::path out = dir_ / "never";
  expect_refused({}, "expert_token_num_per_rank",
                 {{"--counts", file("cs.npy", "<i4", {2, 3}, {10})}, {"--out", out.string()}});
  EXPECT_FALSE(std::filesystem::exists(out));
}

}  // namespace
}  // namespace moe_reroute::tools
