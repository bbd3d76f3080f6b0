// The nanobind adapter: takes NumPy arrays and torch tensors through DLPack
// (no copies), checks device, contiguity and dtype, builds core views, runs the
// core without the GIL and turns moe_reroute::Error into TypeError/ValueError.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "moe_reroute/moe_reroute.h"

namespace nb = nanobind;

namespace moe_reroute {
namespace {

using Input = nb::ndarray<nb::ro>;
using Output = nb::ndarray<>;
using Code = nb::dlpack::dtype_code;

[[noreturn]] void fail(ErrorCode code, const std::string& message) { throw Error(code, message); }

// The array dtypes DLPack carries natively; every other dtype of the table
// arrives as unsigned-integer storage plus its name.
struct NativeDType {
  nb::dlpack::dtype dlpack;
  DType dtype;
};
constexpr NativeDType kNative[] = {
    {{static_cast<std::uint8_t>(Code::Float), 16, 1}, DType::kFloat16},
    {{static_cast<std::uint8_t>(Code::Bfloat), 16, 1}, DType::kBFloat16},
    {{static_cast<std::uint8_t>(Code::Float), 32, 1}, DType::kFloat32},
    {{static_cast<std::uint8_t>(Code::Int), 8, 1}, DType::kInt8},
    {{static_cast<std::uint8_t>(Code::UInt), 8, 1}, DType::kUInt8},
    {{static_cast<std::uint8_t>(Code::Int), 32, 1}, DType::kInt32},
    {{static_cast<std::uint8_t>(Code::Int), 64, 1}, DType::kInt64},
};

std::string dlpack_name(nb::dlpack::dtype dtype) {
  for (const NativeDType& native : kNative) {
    if (native.dlpack == dtype) return std::string(dtype_name(native.dtype));
  }
  const char* kinds[] = {"int", "uint", "float", "opaque", "bfloat", "complex", "bool"};
  const std::string kind = dtype.code < 7 ? kinds[dtype.code] : "code" + std::to_string(dtype.code);
  return kind + std::to_string(dtype.bits) + (dtype.lanes != 1 ? "x" + std::to_string(dtype.lanes) : "");
}

// The core view of `array` (argument `arg`). With `logical` (argument
// `logical_arg`), the array is storage of that dtype: the same dtype, or
// unsigned integers of the same width, or uint8 holding two FP4 elements per
// byte (the last dim doubles).
template <typename Array>
TensorView view_of(const Array& array, const char* arg, const std::optional<std::string>& logical,
                   const char* logical_arg) {
  if (array.device_type() != nb::device::cpu::value) {
    fail(ErrorCode::kInvalidArgument,
         std::string(arg) + ": must be in CPU memory (this build has only the CPU backend)");
  }
  std::vector<std::int64_t> dims(array.ndim());
  std::int64_t numel = 1;
  for (std::size_t d = 0; d < dims.size(); ++d) {
    dims[d] = static_cast<std::int64_t>(array.shape(d));
    numel *= dims[d];
  }
  std::int64_t expected_stride = 1;
  for (std::size_t d = dims.size(); d-- > 0 && numel > 0;) {
    if (dims[d] != 1 && array.stride(d) != expected_stride) {
      fail(ErrorCode::kInvalidArgument,
           std::string(arg) + ": must be contiguous (dense row-major); got strides that are not");
    }
    expected_stride *= dims[d];
  }

  const nb::dlpack::dtype storage = array.dtype();
  std::optional<DType> native;
  for (const NativeDType& candidate : kNative) {
    if (candidate.dlpack == storage) native = candidate.dtype;
  }
  if (!logical) {
    if (!native) {
      fail(ErrorCode::kUnsupported,
           std::string(arg) + ": dtype " + dlpack_name(storage) + " is not supported");
    }
    return TensorView(array.data(), *native, Shape(dims));
  }
  const std::optional<DType> named = dtype_from_name(*logical);
  if (!named) {
    std::string known;
    for (const DTypeInfo& info : dtype_table()) known += (known.empty() ? "" : ", ") + std::string(info.name);
    fail(ErrorCode::kUnsupported,
         std::string(logical_arg) + ": unknown dtype '" + *logical + "' (known: " + known + ")");
  }
  if (native == named) return TensorView(array.data(), *named, Shape(dims));
  const int bits = dtype_info(*named).bits;
  if (storage.code != static_cast<std::uint8_t>(Code::UInt) || storage.lanes != 1) {
    fail(ErrorCode::kUnsupported, std::string(logical_arg) + ": '" + *logical +
                                      "' names the dtype of uint8 storage, but " + arg + " is " +
                                      dlpack_name(storage));
  }
  if (storage.bits == 8 && bits == 4 && !dims.empty()) {
    dims.back() *= 2;
  } else if (storage.bits != bits) {
    fail(ErrorCode::kUnsupported,
         std::string(logical_arg) + ": '" + *logical + "' (" + std::to_string(bits) +
             " bits) does not fit " + dlpack_name(storage) + " storage of " + arg +
             " (one byte per FP8/HiF8 element, two FP4 elements per byte)");
  }
  return TensorView(array.data(), *named, Shape(dims));
}

template <typename Array>
std::optional<TensorView> optional_view(const std::optional<Array>& array, const char* arg,
                                        const std::optional<std::string>& logical,
                                        const char* logical_arg) {
  if (!array) return std::nullopt;
  return view_of(*array, arg, logical, logical_arg);
}

void reroute(const Input& tokens, const Input& counts, const std::optional<Input>& scales,
             const std::optional<Input>& weight, const Output& permute_tokens,
             const Output& permute_scales, const Output& permute_token_idx,
             const Output& expert_token_num, const Output& permute_weight,
             int expert_token_num_type, int idx_type, const std::optional<std::string>& tokens_dtype,
             const std::optional<std::string>& scales_dtype, int num_threads) {
  const RerouteInputs inputs{
      view_of(tokens, "tokens", tokens_dtype, "tokens_dtype"),
      view_of(counts, "expert_token_num_per_rank", std::nullopt, ""),
      optional_view(scales, "per_token_scales", scales_dtype, "per_token_scales"),
      optional_view(weight, "expert_topk_weight", std::nullopt, "")};
  const std::optional<std::string> out_scales_dtype = scales ? scales_dtype : std::nullopt;
  const RerouteOutputs outputs{
      view_of(permute_tokens, "permute_tokens", tokens_dtype, "permute_tokens"),
      view_of(permute_scales, "permute_per_token_scales", out_scales_dtype, "permute_per_token_scales"),
      view_of(permute_token_idx, "permute_token_idx", std::nullopt, ""),
      view_of(expert_token_num, "expert_token_num", std::nullopt, ""),
      view_of(permute_weight, "permute_topk_weight", std::nullopt, "")};
  const Attributes attributes{expert_token_num_type, idx_type};
  nb::gil_scoped_release release;
  moe_re_routing(inputs, outputs, attributes, num_threads);
}

void inverse(const Input& tokens, const Input& counts, const std::optional<Input>& scales,
             const std::optional<Input>& weight, const Output& restored_tokens,
             const std::optional<Output>& restored_scales,
             const std::optional<Output>& restored_weight,
             const std::optional<std::string>& tokens_dtype,
             const std::optional<std::string>& scales_dtype, int num_threads) {
  const InverseInputs inputs{
      view_of(tokens, "tokens", tokens_dtype, "tokens_dtype"),
      view_of(counts, "expert_token_num_per_rank", std::nullopt, ""),
      optional_view(scales, "per_token_scales", scales_dtype, "per_token_scales"),
      optional_view(weight, "expert_topk_weight", std::nullopt, "")};
  const InverseOutputs outputs{
      view_of(restored_tokens, "restored_tokens", tokens_dtype, "restored_tokens"),
      optional_view(restored_scales, "restored_per_token_scales", scales_dtype, "restored_per_token_scales"),
      optional_view(restored_weight, "restored_topk_weight", std::nullopt, "")};
  nb::gil_scoped_release release;
  moe_re_routing_inverse(inputs, outputs, num_threads);
}

nb::list table() {
  nb::list rows;
  for (const DTypeInfo& info : dtype_table()) {
    nb::dict row;
    row["name"] = std::string(info.name);
    row["bits"] = info.bits;
    row["npy_storage"] = std::string(info.npy_storage);
    row["torch_name"] = std::string(info.torch_name);
    row["token"] = (info.roles & kRoleToken) != 0;
    row["scale"] = (info.roles & kRoleScale) != 0;
    row["count"] = (info.roles & kRoleCount) != 0;
    rows.append(row);
  }
  return rows;
}

}  // namespace
}  // namespace moe_reroute

NB_MODULE(_core, m) {
  using namespace moe_reroute;
  m.doc() = "The C++ core of moe_reroute; use the functions of the moe_reroute package.";
  m.attr("__version__") = MOE_REROUTE_VERSION_STRING;

  nb::register_exception_translator([](const std::exception_ptr& pointer, void*) {
    try {
      std::rethrow_exception(pointer);
    } catch (const Error& error) {
      PyErr_SetString(error.code() == ErrorCode::kUnsupported ? PyExc_TypeError : PyExc_ValueError,
                      error.what());
    }
  });

  m.def("reroute", &reroute, nb::arg("tokens"), nb::arg("expert_token_num_per_rank"),
        nb::arg("per_token_scales").none(), nb::arg("expert_topk_weight").none(),
        nb::arg("permute_tokens"), nb::arg("permute_per_token_scales"),
        nb::arg("permute_token_idx"), nb::arg("expert_token_num"), nb::arg("permute_topk_weight"),
        nb::arg("expert_token_num_type"), nb::arg("idx_type"), nb::arg("tokens_dtype").none(),
        nb::arg("scales_dtype").none(), nb::arg("num_threads") = 0,
        "Runs the forward into the given outputs. Arrays: CPU, contiguous, any DLPack "
        "producer; a *_dtype name reads unsigned storage as that dtype. Raises TypeError "
        "(dtype) or ValueError (shape, value) naming the argument; writes nothing then.");
  m.def("inverse", &inverse, nb::arg("tokens"), nb::arg("expert_token_num_per_rank"),
        nb::arg("per_token_scales").none(), nb::arg("expert_topk_weight").none(),
        nb::arg("restored_tokens"), nb::arg("restored_per_token_scales").none(),
        nb::arg("restored_topk_weight").none(), nb::arg("tokens_dtype").none(),
        nb::arg("scales_dtype").none(), nb::arg("num_threads") = 0,
        "Runs the inverse (expert order back to rank order) into the given outputs; "
        "arguments and errors as for reroute.");
  m.def("dtype_table", &table,
        "The dtype table: one dict per dtype (name, bits, npy_storage, torch_name and "
        "the token / scale / count roles).");
  m.def("hardware_threads", &hardware_threads, "The threads num_threads = 0 uses.");
}
