// The nanobind adapter: takes NumPy arrays and torch tensors through DLPack
// (no copies), checks device, contiguity and dtype, builds core views, runs the
// core without the GIL and turns moe_reroute::Error into TypeError/ValueError.
// Built with MOE_REROUTE_HAS_CUDA, it also runs the CUDA backend on device
// memory (reroute_cuda, inverse_cuda).

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "moe_reroute/moe_reroute.h"
#if MOE_REROUTE_HAS_CUDA
#include "moe_reroute/cuda.h"
#endif

namespace nb = nanobind;

namespace moe_reroute {
namespace {

using Input = nb::ndarray<nb::ro>;
using Output = nb::ndarray<>;
using Code = nb::dlpack::dtype_code;

[[noreturn]] void fail(ErrorCode code, const std::string& message) { throw Error(code, message); }

// Where every array of one call must be: in CPU memory, or on tokens' CUDA device.
struct Device {
  int type = nb::device::cpu::value;
  int id = 0;
};

void check_device(int type, int id, const char* arg, const Device& device) {
  const bool cuda = device.type == nb::device::cuda::value;
  if (type == device.type && (!cuda || id == device.id)) return;
  std::string where;
  if (cuda) {
    where = "on cuda:" + std::to_string(device.id) + " like tokens";
  } else if (!MOE_REROUTE_HAS_CUDA) {
    where = "in CPU memory (this build has only the CPU backend)";
  } else {
    where = std::string("in CPU memory") +
            (arg == std::string("tokens") ? " or on a CUDA device" : " like tokens");
  }
  fail(ErrorCode::kInvalidArgument, std::string(arg) + ": must be " + where);
}

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
  return kind + std::to_string(dtype.bits) +
         (dtype.lanes != 1 ? "x" + std::to_string(dtype.lanes) : "");
}

// The core view of `array` (argument `arg`, on `device`). With `logical` (argument
// `logical_arg`), the array is storage of that dtype: the same dtype, or
// unsigned integers of the same width, or uint8 holding two FP4 elements per
// byte (the last dim doubles).
template <typename Array>
TensorView view_of(const Array& array, const char* arg, const std::optional<std::string>& logical,
                   const char* logical_arg, const Device& device) {
  check_device(array.device_type(), array.device_id(), arg, device);
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
    for (const DTypeInfo& info : dtype_table())
      known += (known.empty() ? "" : ", ") + std::string(info.name);
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
    if (dims.back() > std::numeric_limits<std::int64_t>::max() / 2) {
      fail(ErrorCode::kOutOfRange, std::string(arg) + ": last dim " + std::to_string(dims.back()) +
                                       " overflows int64 when read as two FP4 elements a byte");
    }
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
                                        const char* logical_arg, const Device& device) {
  if (!array) return std::nullopt;
  return view_of(*array, arg, logical, logical_arg, device);
}

// The input views (forward or inverse) of one call, every array on `device`.
template <typename Inputs>
Inputs input_views(const Input& tokens, const Input& counts, const std::optional<Input>& scales,
                   const std::optional<Input>& weight,
                   const std::optional<std::string>& tokens_dtype,
                   const std::optional<std::string>& scales_dtype, const Device& device) {
  return {view_of(tokens, "tokens", tokens_dtype, "tokens_dtype", device),
          view_of(counts, "expert_token_num_per_rank", std::nullopt, "", device),
          optional_view(scales, "per_token_scales", scales_dtype, "per_token_scales", device),
          optional_view(weight, "expert_topk_weight", std::nullopt, "", device)};
}

// The views of one forward call, every array on `device`.
struct RerouteViews {
  RerouteInputs inputs;
  RerouteOutputs outputs;
  Attributes attributes;
};

RerouteViews reroute_views(const Input& tokens, const Input& counts,
                           const std::optional<Input>& scales, const std::optional<Input>& weight,
                           const Output& permute_tokens, const Output& permute_scales,
                           const Output& permute_token_idx, const Output& expert_token_num,
                           const Output& permute_weight, int expert_token_num_type, int idx_type,
                           const std::optional<std::string>& tokens_dtype,
                           const std::optional<std::string>& scales_dtype, const Device& device) {
  const std::optional<std::string> out_scales_dtype = scales ? scales_dtype : std::nullopt;
  return {input_views<RerouteInputs>(tokens, counts, scales, weight, tokens_dtype, scales_dtype,
                                     device),
          {view_of(permute_tokens, "permute_tokens", tokens_dtype, "permute_tokens", device),
           view_of(permute_scales, "permute_per_token_scales", out_scales_dtype,
                   "permute_per_token_scales", device),
           view_of(permute_token_idx, "permute_token_idx", std::nullopt, "", device),
           view_of(expert_token_num, "expert_token_num", std::nullopt, "", device),
           view_of(permute_weight, "permute_topk_weight", std::nullopt, "", device)},
          {expert_token_num_type, idx_type}};
}

// The views of one inverse call, every array on `device`.
struct InverseViews {
  InverseInputs inputs;
  InverseOutputs outputs;
};

InverseViews inverse_views(const Input& tokens, const Input& counts,
                           const std::optional<Input>& scales, const std::optional<Input>& weight,
                           const Output& restored_tokens,
                           const std::optional<Output>& restored_scales,
                           const std::optional<Output>& restored_weight,
                           const std::optional<std::string>& tokens_dtype,
                           const std::optional<std::string>& scales_dtype, const Device& device) {
  return {input_views<InverseInputs>(tokens, counts, scales, weight, tokens_dtype, scales_dtype,
                                     device),
          {view_of(restored_tokens, "restored_tokens", tokens_dtype, "restored_tokens", device),
           optional_view(restored_scales, "restored_per_token_scales", scales_dtype,
                         "restored_per_token_scales", device),
           optional_view(restored_weight, "restored_topk_weight", std::nullopt, "", device)}};
}

void reroute(const Input& tokens, const Input& counts, const std::optional<Input>& scales,
             const std::optional<Input>& weight, const Output& permute_tokens,
             const Output& permute_scales, const Output& permute_token_idx,
             const Output& expert_token_num, const Output& permute_weight,
             int expert_token_num_type, int idx_type,
             const std::optional<std::string>& tokens_dtype,
             const std::optional<std::string>& scales_dtype, int num_threads) {
  const RerouteViews views =
      reroute_views(tokens, counts, scales, weight, permute_tokens, permute_scales,
                    permute_token_idx, expert_token_num, permute_weight, expert_token_num_type,
                    idx_type, tokens_dtype, scales_dtype, Device{});
  nb::gil_scoped_release release;
  moe_re_routing(views.inputs, views.outputs, views.attributes, num_threads);
}

void inverse(const Input& tokens, const Input& counts, const std::optional<Input>& scales,
             const std::optional<Input>& weight, const Output& restored_tokens,
             const std::optional<Output>& restored_scales,
             const std::optional<Output>& restored_weight,
             const std::optional<std::string>& tokens_dtype,
             const std::optional<std::string>& scales_dtype, int num_threads) {
  const InverseViews views =
      inverse_views(tokens, counts, scales, weight, restored_tokens, restored_scales,
                    restored_weight, tokens_dtype, scales_dtype, Device{});
  nb::gil_scoped_release release;
  moe_re_routing_inverse(views.inputs, views.outputs, {}, num_threads);
}

#if MOE_REROUTE_HAS_CUDA
// The scratch tensor of a CUDA call: the int32 status word, padded to 8
// bytes, then the workspace.
constexpr std::size_t kStatusBytes = 8;

std::size_t scratch_bytes(std::int64_t num_ranks, std::int64_t num_experts) {
  return kStatusBytes + cuda::required_workspace_bytes(num_ranks, num_experts);
}

// tokens' CUDA device (tokens must be on one).
Device cuda_device(const Input& tokens) {
  if (tokens.device_type() != nb::device::cuda::value) {
    fail(ErrorCode::kInvalidArgument, "tokens: must be on a CUDA device for the CUDA backend");
  }
  return {nb::device::cuda::value, tokens.device_id()};
}

// The context of a call on `stream` with `scratch` (int32, on `device`).
cuda::DeviceContext cuda_context(std::uintptr_t stream, const Output& scratch,
                                 const Device& device) {
  check_device(scratch.device_type(), scratch.device_id(), "scratch", device);
  if (scratch.dtype() != nb::dtype<std::int32_t>() || scratch.ndim() != 1 ||
      scratch.nbytes() < kStatusBytes) {
    fail(ErrorCode::kInvalidArgument, "scratch: must be a 1-D int32 tensor of at least " +
                                          std::to_string(kStatusBytes) + " bytes");
  }
  auto* status = static_cast<std::int32_t*>(scratch.data());
  return {reinterpret_cast<void*>(stream), status,
          reinterpret_cast<std::byte*>(status) + kStatusBytes, scratch.nbytes() - kStatusBytes};
}

void reroute_cuda(const Input& tokens, const Input& counts, const std::optional<Input>& scales,
                  const std::optional<Input>& weight, const Output& permute_tokens,
                  const Output& permute_scales, const Output& permute_token_idx,
                  const Output& expert_token_num, const Output& permute_weight,
                  int expert_token_num_type, int idx_type,
                  const std::optional<std::string>& tokens_dtype,
                  const std::optional<std::string>& scales_dtype, std::uintptr_t stream,
                  const Output& scratch) {
  const Device device = cuda_device(tokens);
  const RerouteViews views =
      reroute_views(tokens, counts, scales, weight, permute_tokens, permute_scales,
                    permute_token_idx, expert_token_num, permute_weight, expert_token_num_type,
                    idx_type, tokens_dtype, scales_dtype, device);
  const cuda::DeviceContext context = cuda_context(stream, scratch, device);
  nb::gil_scoped_release release;
  cuda::moe_re_routing(views.inputs, views.outputs, views.attributes, context);
}

void inverse_cuda(const Input& tokens, const Input& counts, const std::optional<Input>& scales,
                  const std::optional<Input>& weight, const Output& restored_tokens,
                  const std::optional<Output>& restored_scales,
                  const std::optional<Output>& restored_weight,
                  const std::optional<std::string>& tokens_dtype,
                  const std::optional<std::string>& scales_dtype, std::uintptr_t stream,
                  const Output& scratch) {
  const Device device = cuda_device(tokens);
  const InverseViews views =
      inverse_views(tokens, counts, scales, weight, restored_tokens, restored_scales,
                    restored_weight, tokens_dtype, scales_dtype, device);
  const cuda::DeviceContext context = cuda_context(stream, scratch, device);
  nb::gil_scoped_release release;
  cuda::moe_re_routing_inverse(views.inputs, views.outputs, {}, context);
}
#endif

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
  m.attr("has_cuda") = static_cast<bool>(MOE_REROUTE_HAS_CUDA);
#if MOE_REROUTE_HAS_CUDA
  m.def("reroute_cuda", &reroute_cuda, nb::arg("tokens"), nb::arg("expert_token_num_per_rank"),
        nb::arg("per_token_scales").none(), nb::arg("expert_topk_weight").none(),
        nb::arg("permute_tokens"), nb::arg("permute_per_token_scales"),
        nb::arg("permute_token_idx"), nb::arg("expert_token_num"), nb::arg("permute_topk_weight"),
        nb::arg("expert_token_num_type"), nb::arg("idx_type"), nb::arg("tokens_dtype").none(),
        nb::arg("scales_dtype").none(), nb::arg("stream"), nb::arg("scratch"),
        "Enqueues the forward on `stream` (a cudaStream_t as an integer) for arrays on tokens' "
        "CUDA device. `scratch`: int32 on that device, cuda_scratch_bytes(N, E) bytes; its "
        "first element becomes the status word (0: fine, else see cuda_status_message). "
        "Never synchronises. Raises as reroute, before enqueueing anything.");
  m.def("inverse_cuda", &inverse_cuda, nb::arg("tokens"), nb::arg("expert_token_num_per_rank"),
        nb::arg("per_token_scales").none(), nb::arg("expert_topk_weight").none(),
        nb::arg("restored_tokens"), nb::arg("restored_per_token_scales").none(),
        nb::arg("restored_topk_weight").none(), nb::arg("tokens_dtype").none(),
        nb::arg("scales_dtype").none(), nb::arg("stream"), nb::arg("scratch"),
        "Enqueues the inverse on `stream`; arguments as reroute_cuda.");
  m.def("cuda_scratch_bytes", &scratch_bytes, nb::arg("num_ranks"), nb::arg("num_experts"),
        "Bytes of the scratch tensor of a CUDA call with [N, E] counts: the status word "
        "(padded to 8 bytes) and the workspace.");
  m.def("cuda_status_message", &cuda::status_message, nb::arg("status"),
        "The message for a non-zero status word, naming the argument; \"\" for 0.");
#endif
  m.def("dtype_table", &table,
        "The dtype table: one dict per dtype (name, bits, npy_storage, torch_name and "
        "the token / scale / count roles).");
  m.def("hardware_threads", &hardware_threads, "The threads num_threads = 0 uses.");
}
