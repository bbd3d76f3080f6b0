// The one dtype table: every docs/spec.md name, its width, storage and roles.

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "sweep.h"

namespace moe_reroute::test {
namespace {

struct Row {
  std::string_view name;
  DType dtype;
  int bits;
  std::string_view npy_storage;
};

// docs/spec.md section 2, written out independently of the library's table.
const std::vector<Row> kSpecRows = {
    {"float16", DType::kFloat16, 16, "<f2"},
    {"bfloat16", DType::kBFloat16, 16, "<u2"},
    {"int8", DType::kInt8, 8, "|i1"},
    {"float8_e5m2", DType::kFloat8E5M2, 8, "|u1"},
    {"float8_e4m3fn", DType::kFloat8E4M3FN, 8, "|u1"},
    {"hifloat8", DType::kHiFloat8, 8, "|u1"},
    {"float4_e2m1", DType::kFloat4E2M1, 4, "|u1"},
    {"float4_e1m2", DType::kFloat4E1M2, 4, "|u1"},
    {"float32", DType::kFloat32, 32, "<f4"},
    {"uint8", DType::kUInt8, 8, "|u1"},
    {"int32", DType::kInt32, 32, "<i4"},
    {"int64", DType::kInt64, 64, "<i8"},
    {"float8_e8m0", DType::kFloat8E8M0, 8, "|u1"},
};

TEST(DTypeTable, EverySpecNameIsFoundWithItsBitsAndStorage) {
  ASSERT_EQ(dtype_table().size(), kSpecRows.size());
  for (const Row& row : kSpecRows) {
    SCOPED_TRACE(std::string(row.name));
    ASSERT_EQ(dtype_from_name(row.name), row.dtype);
    const DTypeInfo& info = dtype_info(row.dtype);
    EXPECT_EQ(info.dtype, row.dtype);
    EXPECT_EQ(info.name, row.name);
    EXPECT_EQ(dtype_name(row.dtype), row.name);
    EXPECT_EQ(info.bits, row.bits);
    EXPECT_EQ(info.npy_storage, row.npy_storage);
  }
}

TEST(DTypeTable, UnknownNamesAreNotFound) {
  for (const char* name : {"", "float8", "Float16", "fp16", "half", "float4_e2m1fn_x2",
                           "float8_e8m0fnu", "int16", "float16 ", "bool"}) {
    EXPECT_EQ(dtype_from_name(name), std::nullopt) << '"' << name << '"';
  }
}

std::vector<std::string_view> names_with_role(DTypeRole role) {
  std::vector<std::string_view> names;
  for (const DTypeInfo& info : dtype_table()) {
    if (info.roles & role) names.push_back(info.name);
  }
  return names;
}

TEST(DTypeTable, RolesMatchSpecSection2) {
  EXPECT_EQ(names_with_role(kRoleToken),
            (std::vector<std::string_view>{"float16", "bfloat16", "int8", "float8_e5m2",
                                           "float8_e4m3fn", "hifloat8", "float4_e2m1",
                                           "float4_e1m2", "float32", "uint8"}));
  EXPECT_EQ(names_with_role(kRoleScale),
            (std::vector<std::string_view>{"float32", "float8_e8m0"}));
  EXPECT_EQ(names_with_role(kRoleCount), (std::vector<std::string_view>{"int32", "int64"}));
}

TEST(DTypeTable, TorchNamesExistExactlyWhereTorchHasTheDType) {
  for (const char* name : {"hifloat8", "float4_e1m2"}) {
    EXPECT_EQ(dtype_info(*dtype_from_name(name)).torch_name, "") << name;
  }
  EXPECT_EQ(dtype_info(DType::kFloat4E2M1).torch_name, "float4_e2m1fn_x2");
  EXPECT_EQ(dtype_info(DType::kFloat8E8M0).torch_name, "float8_e8m0fnu");
  EXPECT_EQ(dtype_info(DType::kBFloat16).torch_name, "bfloat16");
}

TEST(DTypeBytes, PacksTwoFp4ElementsPerByteAndRoundsUp) {
  EXPECT_EQ(dtype_bytes(DType::kFloat4E2M1, 0), 0);
  EXPECT_EQ(dtype_bytes(DType::kFloat4E2M1, 10), 5);
  EXPECT_EQ(dtype_bytes(DType::kFloat4E1M2, 9), 5);
  EXPECT_EQ(dtype_bytes(DType::kFloat16, 3), 6);
  EXPECT_EQ(dtype_bytes(DType::kInt64, 3), 24);
}

TEST(DTypeInfo, UnknownEnumValueIsUnsupported) {
  EXPECT_EQ(refusal_difference([] { dtype_info(static_cast<DType>(200)); },
                               ErrorCode::kUnsupported, {"dtype", "200"}),
            "");
}

TEST(ErrorCodeName, NamesEveryCode) {
  EXPECT_STREQ(error_code_name(ErrorCode::kInvalidArgument), "invalid_argument");
  EXPECT_STREQ(error_code_name(ErrorCode::kUnsupported), "unsupported");
  EXPECT_STREQ(error_code_name(ErrorCode::kOutOfRange), "out_of_range");
}

}  // namespace
}  // namespace moe_reroute::test
