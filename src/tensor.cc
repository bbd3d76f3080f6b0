#include "moe_reroute/tensor.h"

#include <algorithm>

#include "moe_reroute/error.h"

namespace moe_reroute {

Shape::Shape(std::span<const std::int64_t> sizes) {
  if (sizes.size() > kMaxDims) {
    throw Error(ErrorCode::kInvalidArgument, "shape: " + std::to_string(sizes.size()) +
                                                 " dims, at most " + std::to_string(kMaxDims) +
                                                 " are supported");
  }
  for (std::int64_t size : sizes) dims[static_cast<std::size_t>(ndim++)] = size;
}

namespace {

// The dims a shape holds: ndim is a public field that a caller may have set
// out of range, which validation then refuses, naming the shape.
int held_dims(const Shape& shape) { return std::clamp(shape.ndim, 0, kMaxDims); }

}  // namespace

std::int64_t Shape::numel() const {
  std::int64_t n = 1;
  for (int i = 0; i < held_dims(*this); ++i) n *= (*this)[i];
  return n;
}

bool Shape::operator==(const Shape& other) const {
  if (ndim != other.ndim) return false;
  for (int i = 0; i < held_dims(*this); ++i) {
    if ((*this)[i] != other[i]) return false;
  }
  return true;
}

std::string Shape::to_string() const {
  if (ndim != held_dims(*this)) return "[ndim " + std::to_string(ndim) + "]";
  std::string s = "[";
  for (int i = 0; i < ndim; ++i) {
    if (i > 0) s += ", ";
    s += std::to_string((*this)[i]);
  }
  return s + "]";
}

std::string TensorSpec::to_string() const {
  return std::string(dtype_name(dtype)) + shape.to_string();
}

const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument:
      return "invalid_argument";
    case ErrorCode::kUnsupported:
      return "unsupported";
    case ErrorCode::kOutOfRange:
      return "out_of_range";
    case ErrorCode::kBackend:
      return "backend";
  }
  return "unknown";
}

}  // namespace moe_reroute
