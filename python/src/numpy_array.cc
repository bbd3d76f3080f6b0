#include "numpy_array.h"

#include <tuple>
#include <unordered_map>
#include <utility>

namespace moe_reroute::py {
namespace {

using adapter::fail;

void check_contiguous(const Py_buffer& view, const std::string& name) {
  Py_ssize_t expected = view.itemsize;
  if (view.len == 0) return;
  for (int d = view.ndim; d-- > 0;) {
    if (view.shape[d] != 1 && view.strides[d] != expected) adapter::fail_not_contiguous(name);
    expected *= view.shape[d];
  }
}

// (name, bits) of a NumPy dtype, looked up once per dtype object: numpy's
// dtype.name is Python code, a few us a call. The cached dtypes are kept
// alive, since their addresses are the keys, and never released: a static
// Python object must not outlive the interpreter.
std::pair<std::string, int> numpy_storage(nb::handle dtype, std::string_view arg) {
  static auto& cache = *new std::unordered_map<PyObject*, std::pair<std::string, int>>();
  if (const auto found = cache.find(dtype.ptr()); found != cache.end()) return found->second;
  const auto bytes = nb::cast<int>(dtype.attr("itemsize"));
  std::pair<std::string, int> storage{nb::cast<std::string>(dtype.attr("name")), 8 * bytes};
  if ((bytes != 1 && bytes != 2 && bytes != 4 && bytes != 8) ||
      nb::cast<bool>(dtype.attr("hasobject"))) {
    fail(ErrorCode::kUnsupported,
         std::string(arg) + ": dtype " + storage.first + " is not supported");
  }
  if (cache.size() >= 64) {  // a program making dtypes: keep a few
    for (const auto& [kept, _] : cache) Py_DECREF(kept);
    cache.clear();
  }
  cache.emplace(dtype.inc_ref().ptr(), storage);
  return storage;
}

}  // namespace

Buffer buffer_of(nb::handle array, bool writable) {
  auto view = std::make_unique<Py_buffer>();
  const int flags = PyBUF_STRIDES | (writable ? PyBUF_WRITABLE : 0);
  if (PyObject_GetBuffer(array.ptr(), view.get(), flags) != 0) {
    throw nb::python_error();
  }
  return Buffer(view.release());
}

std::optional<Arg> arg_of(nb::handle object, std::string_view name, bool writable) {
  if (object.is_none()) return std::nullopt;
  if (nb::isinstance<Argument>(object)) return Arg{{nb::cast<const Argument&>(object)}, {}, {}};
  Arg arg;
  arg.name = name;
  std::tie(arg.storage, arg.bits) = numpy_storage(object.attr("dtype"), name);
  arg.array = nb::borrow(object);
  arg.buffer = buffer_of(object, writable);
  const Py_buffer& view = *arg.buffer;
  arg.shape.assign(view.shape, view.shape + view.ndim);
  return arg;
}

adapter::Storage storage(const Arg& arg) {
  return {arg.storage, arg.bits, adapter::table_dtype(arg.storage)};
}

TensorView view(const Arg& arg, const std::optional<std::string>& device,
                const std::optional<std::string>& logical, const char* logical_arg) {
  if (device && arg.device && *arg.device != *device) adapter::fail_device(arg.name, *device);
  if (arg.buffer) check_contiguous(*arg.buffer, arg.name);
  if (!arg.contiguous) adapter::fail_not_contiguous(arg.name);
  return adapter::core_view(arg.buffer ? arg.buffer->buf : nullptr, storage(arg), arg.shape,
                            arg.name.c_str(), logical, logical_arg);
}

void translate_errors() {
  nb::register_exception_translator([](const std::exception_ptr& pointer, void*) {
    try {
      std::rethrow_exception(pointer);
    } catch (const Error& error) {
      PyObject* type = PyExc_RuntimeError;
      if (error.code() == ErrorCode::kUnsupported) type = PyExc_TypeError;
      if (error.code() == ErrorCode::kInvalidArgument || error.code() == ErrorCode::kOutOfRange)
        type = PyExc_ValueError;
      PyErr_SetString(type, error.what());
    }
  });
}

}  // namespace moe_reroute::py
