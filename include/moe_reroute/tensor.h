#pragma once

/// A tensor view (pointer, dtype, shape) and a shape-only spec, the only
/// tensor types the core sees. Views are dense and row-major.

#include <array>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>

#include "moe_reroute/dtype.h"
#include "moe_reroute/export.h"

namespace moe_reroute {

inline constexpr int kMaxDims = 4;

struct MOE_REROUTE_API Shape {
  int ndim = 0;  // 0..kMaxDims; validation refuses a view set outside, naming it "[ndim <n>]"
  std::array<std::int64_t, kMaxDims> dims{};

  Shape() = default;
  /// Throws Error (invalid_argument) past kMaxDims dimensions.
  Shape(std::initializer_list<std::int64_t> sizes) : Shape(std::span(sizes.begin(), sizes.size())) {}
  explicit Shape(std::span<const std::int64_t> sizes);

  std::int64_t operator[](int i) const { return dims[static_cast<std::size_t>(i)]; }
  /// Product of the dims (1 for a 0-d shape); no overflow check.
  std::int64_t numel() const;
  bool operator==(const Shape& other) const;
  /// "[256, 7168]".
  std::string to_string() const;
};

/// What inference produces: the dtype and shape of an output.
struct TensorSpec {
  DType dtype = DType::kUInt8;
  Shape shape;

  std::int64_t nbytes() const { return dtype_bytes(dtype, shape.numel()); }
  bool operator==(const TensorSpec& other) const = default;
  /// "float32[256, 1]".
  MOE_REROUTE_API std::string to_string() const;
};

/// A dense row-major tensor in host (or, for the CUDA backend, device)
/// memory. The core never writes through a view passed as an input.
struct TensorView {
  void* data = nullptr;
  TensorSpec spec;

  TensorView() = default;
  TensorView(const void* data, DType dtype, Shape shape)
      : data(const_cast<void*>(data)), spec{dtype, shape} {}

  DType dtype() const { return spec.dtype; }
  const Shape& shape() const { return spec.shape; }
  std::int64_t nbytes() const { return spec.nbytes(); }
};

}  // namespace moe_reroute
