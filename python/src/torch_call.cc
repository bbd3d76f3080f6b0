// One kernel call's tensors: torch's dtypes in the core's table, views, copies, fresh outputs.

#include "torch_call.h"

#include <ATen/Context.h>
#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty.h>

#include <array>
#include <cstdint>
#include <string_view>

#include "output_cache.h"
#include "torch_backend.h"

namespace moe_reroute::torch_ops {
namespace {

using adapter::fail;

constexpr auto kNumTorchDTypes = static_cast<std::size_t>(c10::ScalarType::NumOptions);

// A torch dtype's name in torch's Python API (torch.bfloat16: "bfloat16"), by
// which the core's dtype table knows it; torch's own names, read once. Which of
// the dtypes the operator takes is the table's business.
std::string_view python_name(c10::ScalarType type) {
  static const std::array<std::string, kNumTorchDTypes> names = [] {
    std::array<std::string, kNumTorchDTypes> names;
    for (std::size_t i = 0; i < kNumTorchDTypes; ++i) {
      if (static_cast<c10::ScalarType>(i) != c10::ScalarType::Undefined) {
        names[i] = std::string(c10::getDtypeNames(static_cast<c10::ScalarType>(i)).first);
      }
    }
    return names;
  }();
  return names[static_cast<std::size_t>(type)];
}

// Torch's dtypes against the table's, both ways, from torch's names, built once.
struct DTypeMap {
  std::array<std::optional<DType>, kNumTorchDTypes> table;  // by torch dtype
  std::vector<c10::ScalarType> torch;  // by table dtype; Undefined where torch has none
};

const DTypeMap& dtype_map() {
  static const DTypeMap map = [] {
    DTypeMap map;
    map.torch.assign(dtype_table().size(), c10::ScalarType::Undefined);
    for (std::size_t i = 0; i < kNumTorchDTypes; ++i) {
      const auto type = static_cast<c10::ScalarType>(i);
      const std::optional<DType> row = adapter::table_dtype(python_name(type));
      map.table[i] = row;
      // A row names torch's dtype by its torch name; its own name may be another's.
      if (row && dtype_info(*row).torch_name == python_name(type)) {
        map.torch[static_cast<std::size_t>(*row)] = type;
      }
    }
    return map;
  }();
  return map;
}

adapter::Storage storage(const Tensor& tensor) {
  const c10::ScalarType type = tensor.scalar_type();
  return {python_name(type), static_cast<int>(c10::elementSize(type)) * 8,
          dtype_map().table[static_cast<std::size_t>(type)]};
}

// The torch dtype of an output the core specifies by its own dtype.
c10::ScalarType torch_dtype(DType dtype) {
  const c10::ScalarType type = dtype_map().torch[static_cast<std::size_t>(dtype)];
  if (type == c10::ScalarType::Undefined) {
    fail(ErrorCode::kUnsupported,
         std::string("dtype ") + std::string(dtype_name(dtype)) + " has no torch dtype");
  }
  return type;
}

void check_device(const Tensor& tensor, const char* arg, const c10::Device& device) {
  if (tensor.device() != device) adapter::fail_device(arg, device.str());
}

// `tensor`, refused where it is undefined (a None from Python).
const Tensor& given(const Tensor& tensor, const char* arg) {
  if (!tensor.defined()) adapter::fail_none(arg);
  return tensor;
}

// The device of a call: tokens', where the build has its backend.
c10::Device call_device(const Tensor& tokens) {
  if (backend_of(given(tokens, "tokens").device().type())) return tokens.device();
  fail(ErrorCode::kInvalidArgument, "tokens: must be in CPU memory" + other_devices());
}

// A fresh output. On the CPU it comes from output_cache.h's allocator, except
// where torch is asked to fill fresh memory (deterministic algorithms with
// fill_uninitialized_memory), which at::empty does.
Tensor empty(c10::IntArrayRef dims, c10::ScalarType type, const c10::Device& device) {
  const at::Context& context = at::globalContext();
  if (!device.is_cpu() ||
      (context.deterministicAlgorithms() && context.deterministicFillUninitializedMemory())) {
    return at::empty(dims, at::TensorOptions().dtype(type).device(device));
  }
  // A storage that grows (resize_) takes its memory from the same allocator.
  return at::detail::empty_generic(dims, output_allocator(),
                                   c10::DispatchKeySet(c10::DispatchKey::CPU), type, std::nullopt);
}

// `tensor` contiguous, copied where it is not; a copied one's own memory
// (argument `arg`) is added to `copied`.
Tensor contiguous(const Tensor& tensor, const char* arg, std::vector<ByteSpan>& copied) {
  Tensor dense = tensor.contiguous();
  if (!dense.is_same(tensor)) {
    const c10::IntArrayRef sizes = tensor.sizes();
    const c10::IntArrayRef strides = tensor.strides();
    const std::int64_t item_bytes = tensor.element_size();
    copied.push_back(adapter::strided_span(arg, tensor.data_ptr(), {sizes.data(), sizes.size()},
                                           {strides.data(), strides.size()}, item_bytes,
                                           item_bytes));
  }
  return dense;
}

}  // namespace

TensorView view(const Tensor& tensor, const char* arg, const std::optional<std::string>& logical,
                const char* logical_arg, const c10::Device& device) {
  check_device(given(tensor, arg), arg, device);
  if (!tensor.is_contiguous()) adapter::fail_not_contiguous(arg);
  const c10::IntArrayRef sizes = tensor.sizes();
  return adapter::core_view(tensor.data_ptr(), storage(tensor), {sizes.data(), sizes.size()}, arg,
                            logical, logical_arg);
}

Tensor allocate(const TensorSpec& spec, const Tensor* input, const c10::Device& device) {
  if (input) {
    const Shape dims = adapter::stored_like(spec, input->sizes());
    return empty(c10::IntArrayRef(dims.dims.data(), dims.ndim), input->scalar_type(), device);
  }
  return empty(c10::IntArrayRef(spec.shape.dims.data(), spec.shape.ndim), torch_dtype(spec.dtype),
               device);
}

Call::Call(const Tensor& tokens_in, const Tensor& counts_in, const OptionalTensor& scales_in,
           const OptionalTensor& weight_in, const OptionalName& tokens_name)
    : device(call_device(tokens_in)),
      tokens(contiguous(tokens_in, "tokens", copied)),
      counts(contiguous(given(counts_in, "expert_token_num_per_rank"),
                        "expert_token_num_per_rank", copied)),
      tokens_dtype(name_of(tokens_name)) {
  if (scales_in) {
    scales = contiguous(*scales_in, "per_token_scales", copied);
    scales_dtype = adapter::scales_dtype(storage(*scales));
  }
  if (weight_in) weight = contiguous(*weight_in, "expert_topk_weight", copied);
}

}  // namespace moe_reroute::torch_ops
