#pragma once

// NumPy .npy files (format versions 1.0, 2.0 and 3.0), read whole and written
// whole, and their mapping to the operator's tensor views. Every error is a
// moe_reroute::Error whose message starts with the argument it concerns.

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "moe_reroute/tensor.h"

namespace moe_reroute::tools {

/// A C-order, little-endian array as stored in a .npy file.
struct NpyArray {
  std::string descr;                // normalized: "|u1", "<f4", ...; always a table storage
  std::vector<std::int64_t> shape;  // at most kMaxDims dims
  std::vector<std::byte> data;
};

/// The descr numpy writes for `descr` in any of its byte-order spellings
/// ("=f4" -> "<f4", "<i1" -> "|i1"); throws Error naming `argument` for a
/// big-endian, structured or unknown descr, or one no dtype of the table stores.
std::string normalize_descr(std::string_view descr, std::string_view argument);

/// Parses the header dict of a .npy file ("{'descr': '<f4', 'fortran_order':
/// False, 'shape': (2, 3), }"); throws Error naming `argument`.
NpyArray parse_npy_header(std::string_view header, std::string_view argument);

/// Reads a whole .npy file; throws Error naming `argument` for an unreadable,
/// truncated, over-long, big-endian, Fortran-order or otherwise unsupported file.
NpyArray read_npy(const std::filesystem::path& path, std::string_view argument);

/// The magic, version and header of a .npy file (version 1.0, or 2.0 when the
/// header needs it), padded so the data after it starts 64-byte aligned.
std::string npy_header(std::string_view descr, std::span<const std::int64_t> shape);

/// Writes a .npy file; throws Error naming `argument` when it cannot.
void write_npy(const std::filesystem::path& path, std::string_view descr,
               std::span<const std::int64_t> shape, const void* data, std::size_t bytes,
               std::string_view argument);

/// A .npy array seen as the operator argument `argument`: the storage decides
/// the dtype (`<f2` float16, `|u1` uint8, ...) unless `dtype_name` names one
/// stored the same way (bfloat16 as `<u2`, FP8 and e8m0 as `|u1`, FP4 as `|u1`
/// [.., H/2] whose last dim then counts two elements per byte).
struct LoadedTensor {
  NpyArray array;
  TensorView view;
};

/// Reads `path` as `argument`; `flag` is the command-line flag naming the
/// dtype, for messages. Throws Error naming `argument`.
LoadedTensor load_tensor(const std::filesystem::path& path, std::string_view argument,
                         const std::optional<std::string>& dtype_name, std::string_view flag);

/// The .npy descr and shape that store `spec` (FP4 halves the last dim).
std::string storage_descr(DType dtype);
std::vector<std::int64_t> storage_shape(const TensorSpec& spec);

/// The dtype a .npy descr means on its own (its numpy name, when the table
/// knows it: "<f2" float16, "|u1" uint8); nullopt for "<u2".
std::optional<DType> default_dtype(std::string_view descr);

}  // namespace moe_reroute::tools
