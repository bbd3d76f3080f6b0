// The Python module moe_reroute._torch_ops: the operators' eager entry points.
//
// moe_reroute's public functions call these in eager mode: each calls its
// operator through the dispatcher as torch.ops does (autograd, the CPU and
// CUDA kernels, fake tensors and every mode or transform below Python run
// alike), without the Python frame of torch.ops and its parsing of the
// arguments against the schema, which cost as much as the operator's whole
// gap to an index_select at decode size (docs/torch.md). Arguments that are
// not plainly of the schema's types (a NumPy integer, a missing tensor) get
// NotImplemented back, for the caller to go through torch.ops, whose
// conversions and errors then apply. Bound with pybind11, as torch/python.h
// binds tensors.

#include <torch/python.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>

#include "torch_ops.h"

namespace moe_reroute::torch_ops {
namespace {

namespace py = pybind11;

// `value` as the schema type T, without conversions; nothing where it is not
// plainly a T (a bool or a NumPy integer for an int: torch.ops decides those).
template <typename T>
std::optional<T> plain(py::handle value) {
  PyObject* object = value.ptr();
  if constexpr (std::is_same_v<T, Tensor>) {
    // torch's caster (torch/python.h) takes a torch.Tensor and refuses the rest.
    try {
      return value.cast<Tensor>();
    } catch (const py::cast_error&) {
      return std::nullopt;
    }
  } else if constexpr (std::is_same_v<T, OptionalTensor>) {
    if (value.is_none()) return T{};
    std::optional<Tensor> tensor = plain<Tensor>(value);
    if (!tensor) return std::nullopt;
    return T{std::move(*tensor)};
  } else if constexpr (std::is_same_v<T, std::int64_t>) {
    if (!PyLong_CheckExact(object)) return std::nullopt;
    int overflow = 0;
    const long long number = PyLong_AsLongLongAndOverflow(object, &overflow);
    if (overflow != 0) return std::nullopt;
    return number;
  } else if constexpr (std::is_same_v<T, bool>) {
    if (!PyBool_Check(object)) return std::nullopt;
    return object == Py_True;
  } else {
    static_assert(std::is_same_v<T, OptionalName>);
    if (value.is_none()) return T{};
    Py_ssize_t size = 0;
    const char* text = PyUnicode_Check(object) ? PyUnicode_AsUTF8AndSize(object, &size) : nullptr;
    if (text == nullptr) {
      PyErr_Clear();
      return std::nullopt;
    }
    return T{c10::string_view(text, static_cast<std::size_t>(size))};
  }
}

// `body()`, run with the GIL released; the GIL is held again when it returns.
template <typename Body>
auto without_gil(const Body& body) {
  const py::gil_scoped_release no_gil;
  return body();
}

// Calls `op` on `args` converted as plain(), with the GIL released as
// torch.ops releases it; NotImplemented where an argument is not plain.
template <typename Result, typename... Params, std::size_t... I>
py::object call_plain(const c10::TypedOperatorHandle<Result(Params...)>& op,
                      const py::args& args, std::index_sequence<I...>) {
  const auto not_implemented = [] { return py::reinterpret_borrow<py::object>(Py_NotImplemented); };
  if (args.size() != sizeof...(Params)) return not_implemented();
  std::tuple<std::optional<std::decay_t<Params>>...> values{
      plain<std::decay_t<Params>>(args[I])...};
  if (!(std::get<I>(values) && ...)) return not_implemented();
  const auto call = [&] { return op.call(*std::get<I>(values)...); };
  if constexpr (std::is_void_v<Result>) {
    without_gil(call);
    return py::none();
  } else {
    return py::cast(without_gil(call));
  }
}

template <typename Result, typename... Params>
py::object call_plain(const c10::TypedOperatorHandle<Result(Params...)>& op,
                      const py::args& args) {
  return call_plain(op, args, std::index_sequence_for<Params...>{});
}

}  // namespace
}  // namespace moe_reroute::torch_ops

namespace ops = moe_reroute::torch_ops;

// Python imports this library as moe_reroute._torch_ops: the registrations
// (torch_ops.cc, torch_autograd.cc) run as it loads, and these are its functions.
PYBIND11_MODULE(_torch_ops, m) {
  using pybind11::args;
  m.doc() = "Eager entry points of the moe_reroute operators (moe_reroute._torch).";
  m.def("forward", [](const args& a) { return ops::call_plain(ops::forward_op(), a); });
  m.def("forward_out", [](const args& a) { return ops::call_plain(ops::out_op(), a); });
  m.def("inverse", [](const args& a) { return ops::call_plain(ops::inverse_op(), a); });
}
