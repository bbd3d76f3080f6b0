// The nanobind module moe_reroute._ep: moe_reroute::ep's dispatch and combine
// (docs/spec.md section 11) on NumPy arrays over an mpi4py communicator,
// passed as its handle (mpi4py.MPI._handleof). Outputs are NumPy arrays that
// own the bytes ep allocated. A rank that refuses an argument before it has
// views still joins the call's agreement, so that every rank raises.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "moe_reroute/ep.h"
#include "numpy_array.h"

namespace nb = nanobind;

namespace moe_reroute {
namespace {

using namespace py;

// The MPI_Comm of an mpi4py handle: a pointer in Open MPI, an int in MPICH.
template <typename Comm>
Comm comm_of(std::intptr_t handle) {
  if constexpr (std::is_pointer_v<Comm>) {
    return reinterpret_cast<Comm>(handle);
  } else {
    static_assert(std::is_integral_v<Comm>, "MPI_Comm is neither a pointer nor an integer");
    return static_cast<Comm>(handle);
  }
}

ErrorCode code_of(const std::string& name) {
  for (const ErrorCode code : {ErrorCode::kInvalidArgument, ErrorCode::kUnsupported,
                               ErrorCode::kOutOfRange, ErrorCode::kBackend}) {
    if (name == error_code_name(code)) return code;
  }
  throw Error(ErrorCode::kInvalidArgument, "code: unknown error code '" + name + "'");
}

// `tensor`'s bytes as a NumPy array of `dtype` and `dims`, which owns them.
nb::object owned_array(ep::Tensor& tensor, nb::handle dtype, const Shape& dims) {
  const std::size_t nbytes = static_cast<std::size_t>(tensor.spec().nbytes());
  std::byte* data = tensor.release().release();
  const nb::capsule owner(data,
                          [](void* bytes) noexcept { delete[] static_cast<std::byte*>(bytes); });
  // Not nb::cast, whose move policy would copy the bytes.
  const nb::object bytes =
      nb::ndarray<nb::numpy, std::uint8_t, nb::ndim<1>>(data, {nbytes}, owner).cast();
  nb::list shape;
  for (int d = 0; d < dims.ndim; ++d) shape.append(dims[d]);
  return bytes.attr("view")(dtype).attr("reshape")(nb::tuple(shape));
}

// The NumPy dtype of table dtype `dtype`'s storage.
nb::object storage_dtype(DType dtype) {
  const std::string_view name = dtype_info(dtype).npy_storage;
  return nb::module_::import_("numpy").attr("dtype")(nb::str(name.data(), name.size()));
}

// Output `tensor` stored like `input` (its dtype, its last dim as stored), or
// in its own dtype without one.
nb::object output(ep::Tensor& tensor, const std::optional<Arg>& input) {
  if (!input) return owned_array(tensor, storage_dtype(tensor.spec().dtype), tensor.spec().shape);
  return owned_array(tensor, input->array.attr("dtype"),
                     adapter::stored_like(tensor.spec(), input->shape));
}

nb::tuple dispatch(std::intptr_t comm_handle, nb::handle x, nb::handle expert_idx,
                   nb::handle expert_scales, nb::handle per_token_scales,
                   const ep::DispatchAttributes& attributes,
                   const std::optional<std::string>& tokens_dtype) {
  const MPI_Comm comm = comm_of<MPI_Comm>(comm_handle);
  std::optional<Arg> args[4];
  ep::DispatchInputs inputs;
  try {
    args[0] = arg_of(x, "x", /*writable=*/false);
    args[1] = arg_of(expert_idx, "expert_idx", false);
    args[2] = arg_of(expert_scales, "expert_scales", false);
    args[3] = arg_of(per_token_scales, "per_token_scales", false);
    if (!args[0]) adapter::fail_none("x");
    if (!args[1]) adapter::fail_none("expert_idx");
    inputs.x = view(*args[0], std::nullopt, tokens_dtype, "tokens_dtype");
    inputs.expert_idx = view(*args[1], std::nullopt, std::nullopt, "");
    if (args[2]) inputs.expert_scales = view(*args[2], std::nullopt, std::nullopt, "");
    if (args[3]) {
      inputs.per_token_scales = view(*args[3], std::nullopt,
                                     adapter::scales_dtype(storage(*args[3])), "per_token_scales");
    }
  } catch (const Error& error) {
    nb::gil_scoped_release release;
    ep::refuse_dispatch(comm, error);
  }
  ep::DispatchResult result;
  {
    nb::gil_scoped_release release;
    result = ep::dispatch(comm, inputs, attributes);
  }
  ep::DispatchOutputs& out = result.outputs;
  return nb::make_tuple(output(out.permute_tokens, args[0]),
                        output(out.permute_per_token_scales, args[3]),
                        output(out.permute_token_idx, std::nullopt),
                        output(out.expert_token_num, std::nullopt),
                        output(out.permute_topk_weight, std::nullopt),
                        output(out.expert_token_num_per_rank, std::nullopt),
                        nb::cast(std::move(result.handle)));
}

nb::object combine(const ep::Handle& handle, nb::handle expert_out) {
  std::optional<Arg> arg;
  TensorView expert_out_view;
  try {
    arg = arg_of(expert_out, "expert_out", /*writable=*/false);
    if (!arg) adapter::fail_none("expert_out");
    expert_out_view = view(*arg, std::nullopt, std::nullopt, "");
  } catch (const Error& error) {
    nb::gil_scoped_release release;
    ep::refuse_combine(handle, error);
  }
  ep::Tensor out;
  {
    nb::gil_scoped_release release;
    out = ep::combine(expert_out_view, handle);
  }
  return owned_array(out, arg->array.attr("dtype"), out.spec().shape);
}

}  // namespace
}  // namespace moe_reroute

NB_MODULE(_ep, m) {
  using namespace moe_reroute;
  m.doc() = "moe_reroute::ep over MPI; use moe_reroute.ep with an mpi4py communicator.";
  py::translate_errors();

  nb::class_<ep::DispatchAttributes>(m, "DispatchAttributes",
                                     "dispatch's attributes (docs/spec.md section 11), "
                                     "the same on every rank; capacity -1: the rows received.")
      .def(nb::init<>())
      .def_rw("num_experts", &ep::DispatchAttributes::num_experts)
      .def_rw("expert_token_num_type", &ep::DispatchAttributes::expert_token_num_type)
      .def_rw("idx_type", &ep::DispatchAttributes::idx_type)
      .def_rw("expert_alignment", &ep::DispatchAttributes::expert_alignment)
      .def_rw("capacity", &ep::DispatchAttributes::capacity);
  nb::class_<ep::Handle>(m, "Handle",
                         "What combine needs of a dispatch; keeps the communicator's handle, "
                         "not the communicator.")
      .def_prop_ro("num_tokens", &ep::Handle::num_tokens)
      .def_prop_ro("top_k", &ep::Handle::top_k)
      .def_prop_ro("num_rows", &ep::Handle::num_rows);

  m.def("dispatch", &dispatch, nb::arg("comm"), nb::arg("x"), nb::arg("expert_idx"),
        nb::arg("expert_scales").none(), nb::arg("per_token_scales").none(),
        nb::arg("attributes"), nb::arg("tokens_dtype").none(),
        "Collective over the communicator of handle `comm`: ep::dispatch on the NumPy arrays "
        "(C order, native byte order; None where absent) with the OpenMP threads "
        "num_threads = 0 uses. Returns (permute_tokens, permute_per_token_scales, "
        "permute_token_idx, expert_token_num, permute_topk_weight, "
        "expert_token_num_per_rank, Handle). Raises on every rank on a bad argument on any.");
  m.def("combine", &combine, nb::arg("handle"), nb::arg("expert_out"),
        "Collective over the dispatch's communicator: ep::combine; returns [T, H'] of "
        "expert_out's dtype.");
  m.def(
      "refuse_dispatch",
      [](std::intptr_t comm, const std::string& code, const std::string& message) {
        const Error error(code_of(code), message);
        nb::gil_scoped_release release;
        ep::refuse_dispatch(comm_of<MPI_Comm>(comm), error);
      },
      nb::arg("comm"), nb::arg("code"), nb::arg("message"),
      "Collective, in place of a dispatch this rank refused before calling it: raises the "
      "error of `code` ('invalid_argument', 'unsupported', ...) and `message` here, and "
      "dispatch's error naming this rank on every other rank.");
  m.def(
      "refuse_combine",
      [](const ep::Handle& handle, const std::string& code, const std::string& message) {
        const Error error(code_of(code), message);
        nb::gil_scoped_release release;
        ep::refuse_combine(handle, error);
      },
      nb::arg("handle"), nb::arg("code"), nb::arg("message"),
      "The same in place of a combine after `handle`'s dispatch.");
}
