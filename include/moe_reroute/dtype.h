#pragma once

/// The dtype table: every element type the operator knows, by name, with its
/// width and the names frameworks and file formats use for its storage.

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

#include "moe_reroute/export.h"

namespace moe_reroute {

enum class DType : std::uint8_t {
  kFloat16,
  kBFloat16,
  kInt8,
  kFloat8E5M2,
  kFloat8E4M3FN,
  kHiFloat8,
  kFloat4E2M1,
  kFloat4E1M2,
  kFloat32,
  kUInt8,
  kInt32,
  kInt64,
  kFloat8E8M0,
};

/// Which arguments of the operator may hold a dtype (bit flags).
enum DTypeRole : std::uint8_t {
  kRoleToken = 1,   // tokens / permute_tokens
  kRoleScale = 2,   // per_token_scales
  kRoleCount = 4,   // expert_token_num_per_rank / expert_token_num
};

struct DTypeInfo {
  DType dtype;
  std::string_view name;         // docs/spec.md name, e.g. "float8_e4m3fn"
  int bits;                      // bits per element: 4, 8, 16, 32 or 64
  std::string_view npy_storage;  // .npy descr of the storage, e.g. "|u1" for FP8
  std::string_view torch_name;   // torch dtype name, "" where torch has none
  std::uint8_t roles;            // DTypeRole flags
};

/// All rows of the table, in DType order.
MOE_REROUTE_API std::span<const DTypeInfo> dtype_table();

/// The table row of `dtype`.
MOE_REROUTE_API const DTypeInfo& dtype_info(DType dtype);

/// Looks a dtype up by its docs/spec.md name; nullopt for an unknown name.
MOE_REROUTE_API std::optional<DType> dtype_from_name(std::string_view name);

inline std::string_view dtype_name(DType dtype) { return dtype_info(dtype).name; }

/// Bytes held by `num_elements` elements of `dtype` (FP4 packs two per byte;
/// an odd FP4 count rounds up).
inline std::int64_t dtype_bytes(DType dtype, std::int64_t num_elements) {
  return (num_elements * dtype_info(dtype).bits + 7) / 8;
}

}  // namespace moe_reroute
