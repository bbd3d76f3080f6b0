#include "moe_reroute/dtype.h"

#include <array>

#include "moe_reroute/error.h"

namespace moe_reroute {
namespace {

constexpr std::uint8_t kTokenOrScale = kRoleToken | kRoleScale;

// In DType order; dtype_info indexes it by the enum value.
constexpr std::array<DTypeInfo, 13> kTable = {{
    {DType::kFloat16, "float16", 16, "<f2", "float16", kRoleToken},
    {DType::kBFloat16, "bfloat16", 16, "<u2", "bfloat16", kRoleToken},
    {DType::kInt8, "int8", 8, "|i1", "int8", kRoleToken},
    {DType::kFloat8E5M2, "float8_e5m2", 8, "|u1", "float8_e5m2", kRoleToken},
    {DType::kFloat8E4M3FN, "float8_e4m3fn", 8, "|u1", "float8_e4m3fn", kRoleToken},
    {DType::kHiFloat8, "hifloat8", 8, "|u1", "", kRoleToken},
    {DType::kFloat4E2M1, "float4_e2m1", 4, "|u1", "float4_e2m1fn_x2", kRoleToken},
    {DType::kFloat4E1M2, "float4_e1m2", 4, "|u1", "", kRoleToken},
    {DType::kFloat32, "float32", 32, "<f4", "float32", kTokenOrScale},
    {DType::kUInt8, "uint8", 8, "|u1", "uint8", kRoleToken},
    {DType::kInt32, "int32", 32, "<i4", "int32", kRoleCount},
    {DType::kInt64, "int64", 64, "<i8", "int64", kRoleCount},
    {DType::kFloat8E8M0, "float8_e8m0", 8, "|u1", "float8_e8m0fnu", kRoleScale},
}};

constexpr bool table_is_in_enum_order() {
  for (std::size_t i = 0; i < kTable.size(); ++i) {
    if (static_cast<std::size_t>(kTable[i].dtype) != i) return false;
  }
  return true;
}
static_assert(table_is_in_enum_order());

}  // namespace

std::span<const DTypeInfo> dtype_table() { return kTable; }

const DTypeInfo& dtype_info(DType dtype) {
  auto index = static_cast<std::size_t>(dtype);
  if (index >= kTable.size()) {
    throw Error(ErrorCode::kUnsupported, "dtype: unknown enum value " + std::to_string(index));
  }
  return kTable[index];
}

std::optional<DType> dtype_from_name(std::string_view name) {
  for (const DTypeInfo& info : kTable) {
    if (info.name == name) return info.dtype;
  }
  return std::nullopt;
}

}  // namespace moe_reroute
