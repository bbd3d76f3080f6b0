#include "adapter.h"

#include <limits>

namespace moe_reroute::adapter {
namespace {

// The logical dims of `dims` stored as `storage_bits`-wide elements of `bits`
// each (a byte holding two FP4 elements doubles the last dim).
Shape logical_dims(std::span<const std::int64_t> dims, int storage_bits, int bits,
                   const char* arg) {
  if (dims.size() > static_cast<std::size_t>(kMaxDims)) {
    fail(ErrorCode::kInvalidArgument, std::string(arg) + ": " + std::to_string(dims.size()) +
                                          "-D, at most " + std::to_string(kMaxDims) +
                                          " dims are supported");
  }
  Shape logical(dims);
  if (storage_bits == 2 * bits && logical.ndim > 0) {
    std::int64_t& last = logical.dims[static_cast<std::size_t>(logical.ndim - 1)];
    if (last > std::numeric_limits<std::int64_t>::max() / 2) {
      fail(ErrorCode::kOutOfRange, std::string(arg) + ": last dim " + std::to_string(last) +
                                       " overflows int64 when read as two FP4 elements a byte");
    }
    last *= 2;
  }
  return logical;
}

}  // namespace

void fail(ErrorCode code, const std::string& message) { throw Error(code, message); }

std::optional<DType> table_dtype(std::string_view name) {
  for (const DTypeInfo& info : dtype_table()) {
    if (info.name == name || (!info.torch_name.empty() && info.torch_name == name)) {
      return info.dtype;
    }
  }
  return std::nullopt;
}

void fail_none(std::string_view arg) {
  fail(ErrorCode::kUnsupported, std::string(arg) + ": must be given, got None");
}

void fail_not_contiguous(std::string_view arg) {
  fail(ErrorCode::kInvalidArgument,
       std::string(arg) + ": must be contiguous (dense row-major); got strides that are not");
}

void fail_device(std::string_view arg, std::string_view device, std::string_view first) {
  fail(ErrorCode::kInvalidArgument,
       std::string(arg) + ": must be " +
           (device == "cpu" ? std::string("in CPU memory") : "on " + std::string(device)) +
           " like " + std::string(first));
}

TensorView core_view(const void* data, Storage storage, std::span<const std::int64_t> dims,
                     const char* arg, const std::optional<std::string>& logical,
                     const char* logical_arg) {
  if (!logical) {
    if (!storage.dtype) {
      fail(ErrorCode::kUnsupported,
           std::string(arg) + ": dtype " + std::string(storage.name) + " is not supported");
    }
    const int bits = dtype_info(*storage.dtype).bits;
    return TensorView(data, *storage.dtype, logical_dims(dims, storage.bits, bits, arg));
  }
  const std::optional<DType> named = dtype_from_name(*logical);
  if (!named) {
    std::string known;
    for (const DTypeInfo& info : dtype_table())
      known += (known.empty() ? "" : ", ") + std::string(info.name);
    fail(ErrorCode::kUnsupported,
         std::string(logical_arg) + ": unknown dtype '" + *logical + "' (known: " + known + ")");
  }
  const int bits = dtype_info(*named).bits;
  if (storage.dtype == named) {
    return TensorView(data, *named, logical_dims(dims, storage.bits, bits, arg));
  }
  if (!storage.name.starts_with("uint")) {
    fail(ErrorCode::kUnsupported, std::string(logical_arg) + ": '" + *logical +
                                      "' names the dtype of unsigned storage, but " + arg +
                                      " is " + std::string(storage.name));
  }
  if (storage.bits != bits && !(storage.bits == 8 && bits == 4)) {
    fail(ErrorCode::kUnsupported,
         std::string(logical_arg) + ": '" + *logical + "' (" + std::to_string(bits) +
             " bits) does not fit " + std::string(storage.name) + " storage of " + arg +
             " (elements of the same width, or two FP4 elements per uint8)");
  }
  return TensorView(data, *named, logical_dims(dims, storage.bits, bits, arg));
}

std::array<TensorSpec, 5> output_specs(const RerouteOutputSpecs& specs) {
  return {specs.permute_tokens, specs.permute_per_token_scales, specs.permute_token_idx,
          specs.expert_token_num, specs.permute_topk_weight};
}

std::array<TensorSpec, 3> output_specs(const InverseOutputSpecs& specs) {
  const TensorSpec absent{DType::kFloat32, Shape{0}};
  return {specs.restored_tokens, specs.restored_per_token_scales.value_or(absent),
          specs.restored_topk_weight.value_or(absent)};
}

Shape stored_like(const TensorSpec& spec, std::span<const std::int64_t> input_dims) {
  Shape dims = spec.shape;
  if (dims.ndim >= 2 && input_dims.size() >= 2) dims.dims[dims.ndim - 1] = input_dims.back();
  return dims;
}

ByteSpan strided_span(const char* name, const void* data, std::span<const std::int64_t> dims,
                      std::span<const std::int64_t> strides, std::int64_t stride_bytes,
                      std::int64_t item_bytes) {
  const auto base = reinterpret_cast<std::uintptr_t>(data);
  std::int64_t low = 0;
  std::int64_t high = item_bytes;
  for (std::size_t d = 0; d < dims.size(); ++d) {
    if (dims[d] == 0) return {name, base, base};
    const std::int64_t reach = (dims[d] - 1) * strides[d] * stride_bytes;
    (reach < 0 ? low : high) += reach;
  }
  return {name, base + static_cast<std::uintptr_t>(low), base + static_cast<std::uintptr_t>(high)};
}

void check_out_against_copied(const RerouteOutputSpecs& specs, const RerouteOutputs& outputs,
                              std::span<const ByteSpan> copied_inputs) {
  check_output_specs(specs, outputs);
  check_disjoint(copied_inputs, outputs);
}

std::optional<std::string> scales_dtype(Storage scales) {
  if (scales.name == "uint8") return std::string(dtype_name(DType::kFloat8E8M0));
  return std::nullopt;
}

}  // namespace moe_reroute::adapter
