#include "moe_reroute/tensor.h"

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

std::int64_t Shape::numel() const {
  std::int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= (*this)[i];
  return n;
}

bool Shape::operator==(const Shape& other) const {
  if (ndim != other.ndim) return false;
  for (int i = 0; i < ndim; ++i) {
    if ((*this)[i] != other[i]) return false;
  }
  return true;
}

std::string Shape::to_string() const {
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
