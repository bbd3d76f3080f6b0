// The .npy reader and writer: round trips of every storage of the dtype
// table, numpy's exact header bytes, every malformed file refused with a
// message naming the argument, and the all-or-nothing output set.

#include "npy.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include "moe_reroute/dtype.h"
#include "moe_reroute/error.h"
#include "output_set.h"
#include "test_dir.h"

namespace moe_reroute::tools {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;
using namespace std::string_literals;

std::string with_length(std::string_view header, int major) {
  std::string bytes = "\x93NUMPY";
  bytes += static_cast<char>(major);
  bytes += '\0';
  const std::size_t length = header.size();
  for (int i = 0; i < (major == 1 ? 2 : 4); ++i)
    bytes += static_cast<char>(length >> (8 * i) & 0xFF);
  return bytes + std::string(header);
}

std::string npy_file(std::string_view header, std::string_view data, int major = 1) {
  return with_length(header, major) + std::string(data);
}

std::string dict(std::string_view descr, std::string_view shape, std::string_view order = "False") {
  return "{'descr': '" + std::string(descr) + "', 'fortran_order': " + std::string(order) +
         ", 'shape': " + std::string(shape) + ", }\n";
}

class NpyFileTest : public ::testing::Test {
 protected:
  std::filesystem::path write(const std::string& bytes) {
    const std::filesystem::path path = dir_ / ("f" + std::to_string(next_++) + ".npy");
    std::ofstream(path, std::ios::binary) << bytes;
    return path;
  }
  // read_npy must refuse `bytes` with a message naming the argument and holding `words`.
  void expect_refused(const std::string& bytes, const std::string& words) {
    const std::filesystem::path path = write(bytes);
    try {
      read_npy(path, "tokens");
      ADD_FAILURE() << "accepted a file that should be refused for: " << words;
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), StartsWith("tokens: "));
      EXPECT_THAT(e.what(), HasSubstr(words));
    }
  }

  TestDir dir_;
  int next_ = 0;
};

TEST(NpyHeader, MatchesNumpyByteForByte) {
  // np.save of np.arange(6, dtype='<f4').reshape(2, 3) and np.zeros(5, '|u1').
  const std::string expected_f4 =
      "\x93NUMPY\x01\x00v\x00{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }"s +
      std::string(58, ' ') + "\n";
  const std::string expected_u1 =
      "\x93NUMPY\x01\x00v\x00{'descr': '|u1', 'fortran_order': False, 'shape': (5,), }"s +
      std::string(60, ' ') + "\n";
  EXPECT_EQ(npy_header("<f4", std::vector<std::int64_t>{2, 3}), expected_f4);
  EXPECT_EQ(npy_header("|u1", std::vector<std::int64_t>{5}), expected_u1);
  EXPECT_EQ(npy_header("<i8", std::vector<std::int64_t>{}).size() % 64, 0u);
}

TEST_F(NpyFileTest, RoundTripsEveryStorageOfTheTable) {
  for (const DTypeInfo& info : dtype_table()) {
    SCOPED_TRACE(std::string(info.name));
    const std::vector<std::int64_t> shape = {3, 5};
    const std::string descr = storage_descr(info.dtype);
    const std::size_t bytes = 15 * static_cast<std::size_t>(std::stoi(descr.substr(2)));
    std::vector<unsigned char> data(bytes);
    std::iota(data.begin(), data.end(), 7);
    const std::filesystem::path path = dir_ / (std::string(info.name) + ".npy");
    write_npy(path, descr, shape, data.data(), bytes, "out");
    const NpyArray array = read_npy(path, "tokens");
    EXPECT_EQ(array.descr, descr);
    EXPECT_EQ(array.shape, shape);
    ASSERT_EQ(array.data.size(), bytes);
    EXPECT_EQ(std::memcmp(array.data.data(), data.data(), bytes), 0);

    const LoadedTensor loaded =
        load_tensor(path, "tokens", std::string(info.name), "--tokens-dtype");
    EXPECT_EQ(loaded.view.dtype(), info.dtype);
    EXPECT_EQ(loaded.view.shape(), Shape({3, info.bits == 4 ? 10 : 5}));
    EXPECT_EQ(loaded.view.nbytes(), static_cast<std::int64_t>(bytes));
    EXPECT_EQ(storage_shape(loaded.view.spec), shape);
  }
}

TEST_F(NpyFileTest, ReadsWhatNumpyWritesInEveryVersion) {
  const std::string data = "\x01\x02\x03\x04\x05\x06";
  for (int major : {1, 2, 3}) {
    const NpyArray array = read_npy(write(npy_file(dict("|i1", "(2, 3)"), data, major)), "tokens");
    EXPECT_EQ(array.descr, "|i1");
    EXPECT_EQ(array.shape, (std::vector<std::int64_t>{2, 3}));
    EXPECT_EQ(array.data.size(), 6u);
  }
  const NpyArray scalar = read_npy(write(npy_file(dict("<i4", "()"), "abcd")), "tokens");
  EXPECT_TRUE(scalar.shape.empty());
  const NpyArray empty = read_npy(write(npy_file(dict("<f4", "(0,)"), "")), "tokens");
  EXPECT_EQ(empty.shape, (std::vector<std::int64_t>{0}));
  const NpyArray reordered = read_npy(
      write(npy_file("{\"shape\": (1,),\"fortran_order\":False,'descr':'<f2'}", "ab")), "tokens");
  EXPECT_EQ(reordered.descr, "<f2");
}

TEST(NpyDescr, AcceptsEveryByteOrderSpellingNumpyWrites) {
  EXPECT_EQ(normalize_descr("<f4", "tokens"), "<f4");
  EXPECT_EQ(normalize_descr("=f4", "tokens"), "<f4");
  EXPECT_EQ(normalize_descr("f2", "tokens"), "<f2");
  EXPECT_EQ(normalize_descr("|i1", "tokens"), "|i1");
  EXPECT_EQ(normalize_descr("<u1", "tokens"), "|u1");
  EXPECT_EQ(normalize_descr(">i1", "tokens"), "|i1");
  EXPECT_EQ(normalize_descr("=i8", "tokens"), "<i8");
  EXPECT_EQ(normalize_descr("<u2", "tokens"), "<u2");
}

TEST(NpyDescr, RefusesWhatNoDtypeOfTheTableStores) {
  for (const auto& [descr, words] :
       std::vector<std::pair<std::string, std::string>>{{">f4", "big-endian"},
                                                        {">i8", "big-endian"},
                                                        {"|f4", "no byte order"},
                                                        {"<f8", "not supported"},
                                                        {"|b1", "not supported"},
                                                        {"<c8", "not supported"},
                                                        {"O", "unknown .npy descr"},
                                                        {"<f", "unknown .npy descr"},
                                                        {"", "unknown .npy descr"},
                                                        {"<4f", "unknown .npy descr"}}) {
    try {
      normalize_descr(descr, "per_token_scales");
      ADD_FAILURE() << "accepted " << descr;
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), StartsWith("per_token_scales: "));
      EXPECT_THAT(e.what(), HasSubstr(words)) << descr;
    }
  }
}

TEST_F(NpyFileTest, RefusesMalformedFiles) {
  const std::string six = "\x01\x02\x03\x04\x05\x06";
  expect_refused("", "not a .npy file");
  expect_refused("PK\x03\x04 a zip file, say", "not a .npy file");
  expect_refused("\x93NUMPZ\x01\x00\x10\x00"s, "not a .npy file");
  expect_refused("\x93NUMPY\x01", "truncated inside the .npy preamble");
  expect_refused("\x93NUMPY\x02\x00\x10\x00"s, "truncated inside the .npy preamble");
  expect_refused(with_length(dict("|i1", "(6,)"), 1).substr(0, 30),
                 "truncated inside the .npy header");
  expect_refused(npy_file(dict("|i1", "(2, 3)"), six.substr(0, 5)), "truncated");
  expect_refused(npy_file(dict("<f4", "(2, 3)"), six), "truncated");
  expect_refused(npy_file(dict("|i1", "(2, 3)"), six + "x"), "the file holds 7");
  expect_refused(npy_file(dict(">f4", "(1,)"), "abcd"), "big-endian");
  expect_refused(npy_file(dict("|i1", "(2, 3)", "True"), six), "Fortran-order");
  expect_refused(npy_file(dict("<c16", "(1,)"), std::string(16, 'x')), "not supported");
  expect_refused(
      npy_file("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (1,), }", "abcd"),
      "structured");
  expect_refused(npy_file(dict("|i1", "(6,)"), six, 4), "version 4.0");
  expect_refused("\x93NUMPY\x01\x01" + with_length(dict("|i1", "(6,)"), 1).substr(8) + six,
                 "version 1.1");
  expect_refused("\x93NUMPY\x02\x00\xf0\xff\xff\xff{'descr'"s, "too long");
  expect_refused(npy_file("hello, world\n", six), "malformed .npy header");
  expect_refused(npy_file("{'descr': '|i1', 'fortran_order': False, 'shape': (6,), } junk", six),
                 "malformed .npy header");
  expect_refused(npy_file("{'descr': '|i1', 'fortran_order': Maybe, 'shape': (6,), }", six),
                 "malformed .npy header");
  expect_refused(npy_file("{'descr': '|i1', 'shape': (6,), }", six), "lacks");
  expect_refused(npy_file("{'descr': '|i1', 'fortran_order': False, 'shape': (6,), 'x': 1}", six),
                 "unexpected key 'x'");
  expect_refused(npy_file(dict("|i1", "(-6,)"), six), "malformed .npy header");
  expect_refused(npy_file(dict("|i1", "(6"), six), "malformed .npy header");
  expect_refused(npy_file(dict("|i1", "(1, 1, 1, 1, 6)"), six), "5-D array");
  expect_refused(npy_file(dict("|i1", "(99999999999999999999,)"), six), "overflows int64");
  expect_refused(npy_file(dict("<i8", "(4611686018427387904, 4)"), six), "overflows int64");
}

TEST_F(NpyFileTest, RefusesAMissingFile) {
  try {
    read_npy(dir_ / "missing.npy", "expert_token_num_per_rank");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), StartsWith("expert_token_num_per_rank: cannot open"));
  }
}

TEST_F(NpyFileTest, LoadTensorNeedsANameThatFitsTheStorage) {
  const std::filesystem::path u2 = write(npy_file(dict("<u2", "(2, 2)"), "abcdefgh"));
  const std::filesystem::path f2 = write(npy_file(dict("<f2", "(2, 2)"), "abcdefgh"));
  const std::filesystem::path u1 = write(npy_file(dict("|u1", "(2, 3)"), "abcdef"));
  EXPECT_EQ(load_tensor(f2, "tokens", std::nullopt, "--tokens-dtype").view.dtype(),
            DType::kFloat16);
  EXPECT_EQ(load_tensor(u1, "tokens", std::nullopt, "--tokens-dtype").view.dtype(), DType::kUInt8);
  const LoadedTensor fp4 = load_tensor(u1, "tokens", "float4_e2m1", "--tokens-dtype");
  EXPECT_EQ(fp4.view.spec, (TensorSpec{DType::kFloat4E2M1, {2, 6}}));
  EXPECT_EQ(load_tensor(u2, "tokens", "bfloat16", "--tokens-dtype").view.dtype(), DType::kBFloat16);

  const auto refused = [](const std::filesystem::path& path, std::optional<std::string> name,
                          const std::string& words) {
    try {
      load_tensor(path, "tokens", name, "--tokens-dtype");
      ADD_FAILURE() << words;
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), StartsWith("tokens: "));
      EXPECT_THAT(e.what(), HasSubstr(words));
    }
  };
  refused(u2, std::nullopt, "name its dtype with --tokens-dtype (bfloat16)");
  refused(f2, "float8_e4m3fn", "--tokens-dtype float8_e4m3fn is stored as |u1");
  refused(u1, "bfloat16", "--tokens-dtype bfloat16 is stored as <u2");
  refused(u1, "float9", "unknown dtype name 'float9'");
}

TEST(OutputSet, NothingAppearsUntilCommit) {
  TestDir dir;
  const std::filesystem::path out = dir / "new" / "nested";
  const std::int32_t values[3] = {1, 2, 3};
  {
    OutputSet set(out);
    set.add("a.npy", TensorView(values, DType::kInt32, {3}));
    set.add("b.npy", TensorView(values, DType::kInt32, {3}));
    for (const std::string& name : listing(out)) EXPECT_EQ(name[0], '.') << name;
    EXPECT_EQ(listing(out).size(), 2u);
  }
  EXPECT_TRUE(listing(out).empty()) << "an uncommitted set must remove its temporaries";

  OutputSet set(out);
  set.add("a.npy", TensorView(values, DType::kInt32, {3}));
  set.add("b.npy", TensorView(values, DType::kFloat4E2M1, {2, 6}));
  set.commit();
  EXPECT_EQ(listing(out), (std::set<std::string>{"a.npy", "b.npy"}));
  const NpyArray b = read_npy(out / "b.npy", "b");
  EXPECT_EQ(b.descr, "|u1");
  EXPECT_EQ(b.shape, (std::vector<std::int64_t>{2, 3}));
}

TEST(OutputSet, RefusesADirectoryThatIsAFile) {
  TestDir dir;
  std::ofstream(dir / "file") << "x";
  EXPECT_THROW(OutputSet(dir / "file"), Error);
}

}  // namespace
}  // namespace moe_reroute::tools
