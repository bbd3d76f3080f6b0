// The nanobind module moe_reroute._core: the dtype table, the core's shape
// rules (infer_reroute / infer_inverse, which NumPy allocation and the torch
// fake kernels both use) and the CPU run on NumPy arrays. Errors become
// TypeError / ValueError / RuntimeError by their kind, naming the argument.

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "adapter.h"
#include "moe_reroute/moe_reroute.h"

namespace nb = nanobind;

namespace moe_reroute {
namespace {

using adapter::fail;

// A NumPy array's bytes through the buffer protocol, held until the argument
// is dropped. No format is asked for, so ml_dtypes arrays qualify too, and no
// contiguity, so that check_contiguous can name the argument.
struct BufferRelease {
  void operator()(Py_buffer* view) const {
    PyBuffer_Release(view);
    delete view;
  }
};
using Buffer = std::unique_ptr<Py_buffer, BufferRelease>;

Buffer buffer_of(nb::handle array, bool writable) {
  auto view = std::make_unique<Py_buffer>();
  const int flags = PyBUF_STRIDES | (writable ? PyBUF_WRITABLE : 0);
  if (PyObject_GetBuffer(array.ptr(), view.get(), flags) != 0) {
    throw nb::python_error();
  }
  return Buffer(view.release());
}

// An argument as the Python layer hands it over: None, or (name, storage
// dtype name, storage bits, shape, data) where data is the NumPy array itself,
// or None for shape inference alone.
struct Arg {
  std::string name;
  std::string storage;
  int bits = 0;
  std::vector<std::int64_t> shape;
  Buffer data;
};

void check_contiguous(const Py_buffer& view, const std::string& name) {
  Py_ssize_t expected = view.itemsize;
  if (view.len == 0) return;
  for (int d = view.ndim; d-- > 0;) {
    if (view.shape[d] != 1 && view.strides[d] != expected) {
      fail(ErrorCode::kInvalidArgument,
           name + ": must be contiguous (dense row-major); got strides that are not");
    }
    expected *= view.shape[d];
  }
}

// `writable`: the argument is an output.
std::optional<Arg> arg_of(nb::handle object, bool writable) {
  if (object.is_none()) return std::nullopt;
  const nb::tuple fields = nb::cast<nb::tuple>(object);
  Arg arg{nb::cast<std::string>(fields[0]), nb::cast<std::string>(fields[1]),
          nb::cast<int>(fields[2]), nb::cast<std::vector<std::int64_t>>(fields[3]), nullptr};
  if (!fields[4].is_none()) arg.data = buffer_of(fields[4], writable);
  return arg;
}

TensorView view(const Arg& arg, const std::optional<std::string>& logical, const char* logical_arg) {
  if (arg.data) check_contiguous(*arg.data, arg.name);
  return adapter::core_view(arg.data ? arg.data->buf : nullptr, {arg.storage, arg.bits},
                            arg.shape, arg.name.c_str(), logical, logical_arg);
}

// The views of one call's inputs (tokens, counts, scales?, weight?).
struct Inputs {
  std::vector<std::optional<Arg>> args;
  std::optional<std::string> tokens_dtype;
  std::optional<std::string> scales_dtype;

  Inputs(const nb::sequence& inputs, const std::optional<std::string>& tokens_name) {
    for (nb::handle item : inputs) args.push_back(arg_of(item, /*writable=*/false));
    if (args.size() != 4 || !args[0] || !args[1]) {
      fail(ErrorCode::kInvalidArgument, "inputs: expected (tokens, counts, scales, weight)");
    }
    tokens_dtype = tokens_name;
    if (args[2]) scales_dtype = adapter::scales_dtype({args[2]->storage, args[2]->bits});
  }

  template <typename CoreInputs>
  CoreInputs views() const {
    CoreInputs inputs{view(*args[0], tokens_dtype, "tokens_dtype"),
                      view(*args[1], std::nullopt, "")};
    if (args[2]) inputs.per_token_scales = view(*args[2], scales_dtype, "per_token_scales");
    if (args[3]) inputs.expert_topk_weight = view(*args[3], std::nullopt, "");
    return inputs;
  }
};

Attributes attributes_of(int expert_token_num_type, int idx_type, std::int64_t expert_alignment,
                         bool allow_spare_rows) {
  return {expert_token_num_type, idx_type, expert_alignment, allow_spare_rows};
}

// (dtype name, shape) of each output spec.
nb::list specs_list(std::initializer_list<TensorSpec> specs) {
  nb::list list;
  for (const TensorSpec& spec : specs) {
    list.append(nb::make_tuple(std::string(dtype_name(spec.dtype)),
                               std::vector<std::int64_t>(spec.shape.dims.begin(),
                                                         spec.shape.dims.begin() + spec.shape.ndim)));
  }
  return list;
}

nb::list infer_forward(const nb::sequence& inputs, const std::optional<std::string>& tokens_dtype,
                       int expert_token_num_type, int idx_type, std::int64_t expert_alignment,
                       bool allow_spare_rows) {
  const Inputs call(inputs, tokens_dtype);
  const RerouteOutputSpecs specs =
      infer_reroute(call.views<RerouteInputs>(),
                    attributes_of(expert_token_num_type, idx_type, expert_alignment,
                                  allow_spare_rows));
  return specs_list({specs.permute_tokens, specs.permute_per_token_scales,
                     specs.permute_token_idx, specs.expert_token_num, specs.permute_topk_weight});
}

nb::list infer_backward(const nb::sequence& inputs, const std::optional<std::string>& tokens_dtype,
                        std::int64_t expert_alignment, bool allow_spare_rows) {
  const Inputs call(inputs, tokens_dtype);
  const InverseOutputSpecs specs = infer_inverse(
      call.views<InverseInputs>(),
      attributes_of(kExpertTokenNumCount, kIdxGather, expert_alignment, allow_spare_rows));
  const TensorSpec absent = adapter::absent_spec();
  return specs_list({specs.restored_tokens, specs.restored_per_token_scales.value_or(absent),
                     specs.restored_topk_weight.value_or(absent)});
}

// numpy.empty, looked up once and never released: a static Python object
// must not outlive the interpreter.
nb::handle numpy_empty() {
  static const nb::handle empty = nb::object(nb::module_::import_("numpy").attr("empty")).release();
  return empty;
}

// Fresh NumPy arrays for the outputs of one call, each appended to `arrays`
// and returned described.
struct Allocation {
  nb::list arrays;

  // An output of `spec` named `name`: stored like `input` (its dtype, its
  // trailing dims) when given, else in the spec's dtype.
  std::optional<Arg> operator()(const TensorSpec& spec, const std::optional<Arg>& input,
                                const char* name) {
    Arg arg;
    arg.name = name;
    nb::object dtype;
    if (input) {
      arg.storage = input->storage;
      arg.bits = input->bits;
      arg.shape = adapter::stored_like(spec, input->shape);
      dtype = nb::handle(input->data->obj).attr("dtype");
    } else {
      const DTypeInfo& info = dtype_info(spec.dtype);
      arg.storage = info.name;
      arg.bits = info.bits;
      arg.shape.assign(spec.shape.dims.begin(), spec.shape.dims.begin() + spec.shape.ndim);
      dtype = nb::str(info.npy_storage.data(), info.npy_storage.size());
    }
    const nb::object array = numpy_empty()(nb::cast(arg.shape), dtype);
    arrays.append(array);
    arg.data = buffer_of(array, /*writable=*/true);
    return arg;
  }
};

// The outputs the caller gave (described, `count` of them), each appended to `arrays`.
std::vector<std::optional<Arg>> outputs_of(const nb::sequence& outputs, std::size_t count,
                                           nb::list& arrays) {
  std::vector<std::optional<Arg>> args;
  for (nb::handle item : outputs) {
    args.push_back(arg_of(item, /*writable=*/true));
    arrays.append(nb::cast<nb::tuple>(item)[4]);
  }
  if (args.size() != count) {
    fail(ErrorCode::kInvalidArgument, "out: expected " + std::to_string(count) + " outputs");
  }
  return args;
}

nb::tuple run_forward(const nb::sequence& inputs, const std::optional<nb::sequence>& outputs,
                      const std::optional<std::string>& tokens_dtype, int expert_token_num_type,
                      int idx_type, std::int64_t expert_alignment, bool allow_spare_rows,
                      int num_threads) {
  const Inputs call(inputs, tokens_dtype);
  const RerouteInputs views = call.views<RerouteInputs>();
  const Attributes attributes =
      attributes_of(expert_token_num_type, idx_type, expert_alignment, allow_spare_rows);
  Allocation fresh;
  std::vector<std::optional<Arg>> out;
  if (outputs) {
    out = outputs_of(*outputs, 5, fresh.arrays);
  } else {
    const RerouteOutputSpecs specs = infer_reroute(views, attributes);
    out.push_back(fresh(specs.permute_tokens, call.args[0], "permute_tokens"));
    out.push_back(fresh(specs.permute_per_token_scales, call.args[2], "permute_per_token_scales"));
    out.push_back(fresh(specs.permute_token_idx, std::nullopt, "permute_token_idx"));
    out.push_back(fresh(specs.expert_token_num, std::nullopt, "expert_token_num"));
    out.push_back(fresh(specs.permute_topk_weight, call.args[3], "permute_topk_weight"));
  }
  const std::optional<std::string> out_scales = call.args[2] ? call.scales_dtype : std::nullopt;
  const RerouteOutputs out_views{view(*out[0], tokens_dtype, "permute_tokens"),
                                 view(*out[1], out_scales, "permute_per_token_scales"),
                                 view(*out[2], std::nullopt, ""), view(*out[3], std::nullopt, ""),
                                 view(*out[4], std::nullopt, "")};
  {
    nb::gil_scoped_release release;
    moe_re_routing(views, out_views, attributes, num_threads);
  }
  return nb::tuple(fresh.arrays);
}

nb::tuple run_backward(const nb::sequence& inputs, const std::optional<std::string>& tokens_dtype,
                       std::int64_t expert_alignment, bool allow_spare_rows, int num_threads) {
  const Inputs call(inputs, tokens_dtype);
  const InverseInputs views = call.views<InverseInputs>();
  const Attributes attributes =
      attributes_of(kExpertTokenNumCount, kIdxGather, expert_alignment, allow_spare_rows);
  const InverseOutputSpecs specs = infer_inverse(views, attributes);
  const TensorSpec absent = adapter::absent_spec();
  Allocation fresh;
  std::vector<std::optional<Arg>> out;
  out.push_back(fresh(specs.restored_tokens, call.args[0], "restored_tokens"));
  out.push_back(fresh(specs.restored_per_token_scales.value_or(absent), call.args[2],
                      "restored_per_token_scales"));
  out.push_back(
      fresh(specs.restored_topk_weight.value_or(absent), call.args[3], "restored_topk_weight"));
  InverseOutputs out_views{view(*out[0], tokens_dtype, "restored_tokens")};
  if (call.args[2]) {
    out_views.restored_per_token_scales =
        view(*out[1], call.scales_dtype, "restored_per_token_scales");
  }
  if (call.args[3]) out_views.restored_topk_weight = view(*out[2], std::nullopt, "");
  {
    nb::gil_scoped_release release;
    moe_re_routing_inverse(views, out_views, attributes, num_threads);
  }
  return nb::tuple(fresh.arrays);
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
      PyObject* type = PyExc_RuntimeError;
      if (error.code() == ErrorCode::kUnsupported) type = PyExc_TypeError;
      if (error.code() == ErrorCode::kInvalidArgument || error.code() == ErrorCode::kOutOfRange)
        type = PyExc_ValueError;
      PyErr_SetString(type, error.what());
    }
  });

  // Each argument: None or (name, storage dtype name, storage bits, shape, array or None).
  m.def("infer_reroute", &infer_forward, nb::arg("inputs"), nb::kw_only(),
        nb::arg("tokens_dtype").none(), nb::arg("expert_token_num_type"), nb::arg("idx_type"),
        nb::arg("expert_alignment"), nb::arg("allow_spare_rows"),
        "The five output specs [(dtype name, logical shape)] of the forward for inputs "
        "(tokens, counts, scales, weight); the core's infer_reroute.");
  m.def("infer_inverse", &infer_backward, nb::arg("inputs"), nb::kw_only(),
        nb::arg("tokens_dtype").none(), nb::arg("expert_alignment"), nb::arg("allow_spare_rows"),
        "The three output specs of the inverse (an absent output: float32 (0,)).");
  m.def("reroute", &run_forward, nb::arg("inputs"), nb::arg("outputs").none(), nb::kw_only(),
        nb::arg("tokens_dtype").none(), nb::arg("expert_token_num_type"), nb::arg("idx_type"),
        nb::arg("expert_alignment"), nb::arg("allow_spare_rows"), nb::arg("num_threads") = 0,
        "Runs the forward on the CPU into the five outputs (None: fresh NumPy arrays) and "
        "returns them; writes nothing when it raises.");
  m.def("inverse", &run_backward, nb::arg("inputs"), nb::kw_only(),
        nb::arg("tokens_dtype").none(), nb::arg("expert_alignment"), nb::arg("allow_spare_rows"),
        nb::arg("num_threads") = 0,
        "Runs the inverse on the CPU into three fresh NumPy arrays and returns them (an absent "
        "output: float32 (0,)).");
  m.def("dtype_table", &table,
        "The dtype table: one dict per dtype (name, bits, npy_storage, torch_name and "
        "the token / scale / count roles).");
  m.def("hardware_threads", &hardware_threads, "The threads num_threads = 0 uses.");
}
