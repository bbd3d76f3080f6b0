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
// or None for shape inference alone; the torch fake kernels add the tensor's
// device and whether it is contiguous: (..., None, device, contiguous).
struct Arg {
  std::string name;
  std::string storage;
  int bits = 0;
  std::vector<std::int64_t> shape;
  Buffer data;
  std::optional<std::string> device;  // a framework's name ("cpu", "cuda:0"), where described
  bool contiguous = true;             // of a described tensor without data
};

void check_contiguous(const Py_buffer& view, const std::string& name) {
  Py_ssize_t expected = view.itemsize;
  if (view.len == 0) return;
  for (int d = view.ndim; d-- > 0;) {
    if (view.shape[d] != 1 && view.strides[d] != expected) adapter::fail_not_contiguous(name);
    expected *= view.shape[d];
  }
}

// `writable`: the argument is an output.
std::optional<Arg> arg_of(nb::handle object, bool writable) {
  if (object.is_none()) return std::nullopt;
  const nb::tuple fields = nb::cast<nb::tuple>(object);
  Arg arg{nb::cast<std::string>(fields[0]), nb::cast<std::string>(fields[1]),
          nb::cast<int>(fields[2]), nb::cast<std::vector<std::int64_t>>(fields[3]), nullptr,
          std::nullopt, true};
  if (!fields[4].is_none()) arg.data = buffer_of(fields[4], writable);
  if (fields.size() == 7) {
    arg.device = nb::cast<std::string>(fields[5]);
    arg.contiguous = nb::cast<bool>(fields[6]);
  }
  return arg;
}

adapter::Storage storage(const Arg& arg) {
  return {arg.storage, arg.bits, adapter::table_dtype(arg.storage)};
}

// The core view of `arg`, refused as the torch kernels refuse it: off
// `device` (tokens' device, where described), not contiguous, or of a dtype
// the core does not take as `logical`.
TensorView view(const Arg& arg, const std::optional<std::string>& device,
                const std::optional<std::string>& logical, const char* logical_arg) {
  if (device && arg.device && *arg.device != *device) adapter::fail_device(arg.name, *device);
  if (arg.data) check_contiguous(*arg.data, arg.name);
  if (!arg.contiguous) adapter::fail_not_contiguous(arg.name);
  return adapter::core_view(arg.data ? arg.data->buf : nullptr, storage(arg), arg.shape,
                            arg.name.c_str(), logical, logical_arg);
}

// The views of one call's inputs (tokens, counts, scales?, weight?).
struct Inputs {
  std::vector<std::optional<Arg>> args;
  std::optional<std::string> tokens_dtype;
  std::optional<std::string> scales_dtype;

  Inputs(const nb::sequence& inputs, const std::optional<std::string>& tokens_name) {
    for (nb::handle item : inputs) args.push_back(arg_of(item, /*writable=*/false));
    if (args.size() != 4) {
      fail(ErrorCode::kInvalidArgument, "inputs: expected (tokens, counts, scales, weight)");
    }
    if (!args[0]) adapter::fail_none("tokens");
    if (!args[1]) adapter::fail_none("expert_token_num_per_rank");
    tokens_dtype = tokens_name;
    if (args[2]) scales_dtype = adapter::scales_dtype(storage(*args[2]));
  }

  // The device every argument must be on: tokens', where described.
  const std::optional<std::string>& device() const { return args[0]->device; }

  template <typename CoreInputs>
  CoreInputs views() const {
    CoreInputs inputs{view(*args[0], device(), tokens_dtype, "tokens_dtype"),
                      view(*args[1], device(), std::nullopt, "")};
    if (args[2]) {
      inputs.per_token_scales = view(*args[2], device(), scales_dtype, "per_token_scales");
    }
    if (args[3]) inputs.expert_topk_weight = view(*args[3], device(), std::nullopt, "");
    return inputs;
  }
};

// (dtype name, shape, the index of the input it is stored like or None, its
// rows formula (per input row, per expert)) of each output spec of `op`: what
// the torch fake kernels allocate by.
template <std::size_t N>
nb::list specs_list(const std::array<TensorSpec, N>& specs, const OperatorDesc& op,
                    const Attributes& attributes, const Inputs& call) {
  nb::list list;
  for (std::size_t i = 0; i < N; ++i) {
    const Shape& shape = specs[i].shape;
    const int like = op.outputs[i].stored_like;
    nb::object input = nb::none();
    if (like != kOwnSpec) input = nb::int_(like);
    const RowsFormula rows =
        output_rows(op, i, attributes, like != kOwnSpec && call.args[like].has_value());
    list.append(nb::make_tuple(
        std::string(dtype_name(specs[i].dtype)),
        std::vector<std::int64_t>(shape.dims.begin(), shape.dims.begin() + shape.ndim), input,
        nb::make_tuple(rows.per_input_row, rows.per_expert)));
  }
  return list;
}

nb::list infer_forward(const nb::sequence& inputs, const Attributes& attributes,
                       const std::optional<std::string>& tokens_dtype) {
  const Inputs call(inputs, tokens_dtype);
  return specs_list(adapter::output_specs(infer_reroute(call.views<RerouteInputs>(), attributes)),
                    reroute_desc(), attributes, call);
}

nb::list infer_backward(const nb::sequence& inputs, const Attributes& attributes,
                        const std::optional<std::string>& tokens_dtype) {
  const Inputs call(inputs, tokens_dtype);
  return specs_list(adapter::output_specs(infer_inverse(call.views<InverseInputs>(), attributes)),
                    inverse_desc(), attributes, call);
}

// numpy.empty, looked up once and never released: a static Python object
// must not outlive the interpreter.
nb::handle numpy_empty() {
  static const nb::handle empty = nb::object(nb::module_::import_("numpy").attr("empty")).release();
  return empty;
}

// The outputs of one call: their NumPy arrays (the tuple the call returns),
// fresh or the caller's, and the same arrays described for the core.
struct OutputArrays {
  nb::list arrays;
  std::vector<Arg> args;

  // Fresh arrays by the core's specs, each stored as `op` says: like its
  // input (that input's dtype, its trailing dims) where given, else in the
  // spec's dtype.
  template <std::size_t N>
  OutputArrays(const std::array<TensorSpec, N>& specs, const OperatorDesc& op, const Inputs& call) {
    for (std::size_t i = 0; i < N; ++i) {
      const int like = op.outputs[i].stored_like;
      const std::optional<Arg>* input = like == kOwnSpec ? nullptr : &call.args[like];
      fresh(specs[i], input && *input ? &**input : nullptr, op.outputs[i].name);
    }
  }

  // The outputs of `op` the caller gave (described).
  OutputArrays(const nb::sequence& outputs, const OperatorDesc& op) {
    const std::size_t n = op.outputs.size();
    for (nb::handle item : outputs) {
      std::optional<Arg> arg = arg_of(item, /*writable=*/true);
      if (!arg) adapter::fail_none(args.size() < n ? op.outputs[args.size()].name : "out");
      args.push_back(std::move(*arg));
      arrays.append(nb::cast<nb::tuple>(item)[4]);
    }
    if (args.size() != n) {
      fail(ErrorCode::kInvalidArgument, "out: expected " + std::to_string(n) + " outputs, got " +
                                            std::to_string(args.size()));
    }
  }

 private:
  void fresh(const TensorSpec& spec, const Arg* input, std::string_view name) {
    Arg& arg = args.emplace_back();
    arg.name = name;
    nb::object dtype;
    if (input) {
      arg.storage = input->storage;
      arg.bits = input->bits;
      const Shape shape = adapter::stored_like(spec, input->shape);
      arg.shape.assign(shape.dims.begin(), shape.dims.begin() + shape.ndim);
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
  }
};

// The outputs of a forward call: the caller's, or fresh by the inferred specs.
OutputArrays forward_outputs(const std::optional<nb::sequence>& outputs, const Inputs& call,
                             const RerouteInputs& views, const Attributes& attributes) {
  if (outputs) return OutputArrays(*outputs, reroute_desc());
  return OutputArrays(adapter::output_specs(infer_reroute(views, attributes)), reroute_desc(),
                      call);
}

// The forward's output views, read as the torch kernel reads out= tensors.
RerouteOutputs forward_views(const Inputs& call, const std::vector<Arg>& args) {
  const std::optional<std::string>& device = call.device();
  const std::optional<std::string> out_scales = call.args[2] ? call.scales_dtype : std::nullopt;
  return {view(args[0], device, call.tokens_dtype, "permute_tokens"),
          view(args[1], device, out_scales, "permute_per_token_scales"),
          view(args[2], device, std::nullopt, ""), view(args[3], device, std::nullopt, ""),
          view(args[4], device, std::nullopt, "")};
}

// The out= call refused from descriptions alone, as the torch kernel refuses
// it before reading any data (the fake kernel of moe_re_routing_out): the
// inputs' views, the outputs' (device, layout, dtype), the shape rules, then
// each output's spec.
void check_forward_out(const nb::sequence& inputs, const nb::sequence& outputs,
                       const Attributes& attributes,
                       const std::optional<std::string>& tokens_dtype) {
  const Inputs call(inputs, tokens_dtype);
  const RerouteInputs views = call.views<RerouteInputs>();
  const OutputArrays out(outputs, reroute_desc());
  const RerouteOutputs out_views = forward_views(call, out.args);
  check_output_specs(infer_reroute(views, attributes), out_views);
}

// The memory of each (name, array) in `copied`: the caller's inputs that the
// Python layer copied to C order or native byte order.
std::vector<ByteSpan> copied_spans(const nb::sequence& copied, std::vector<std::string>& names) {
  static_assert(sizeof(Py_ssize_t) == sizeof(std::int64_t));
  std::vector<ByteSpan> spans;
  for (nb::handle item : copied) names.push_back(nb::cast<std::string>(item[0]));
  for (std::size_t i = 0; i < names.size(); ++i) {
    const Buffer buffer = buffer_of(copied[i][1], /*writable=*/false);
    const Py_buffer& view = *buffer;
    spans.push_back(adapter::strided_span(names[i].c_str(), view.buf,
                                          {reinterpret_cast<const std::int64_t*>(view.shape),
                                           static_cast<std::size_t>(view.ndim)},
                                          {reinterpret_cast<const std::int64_t*>(view.strides),
                                           static_cast<std::size_t>(view.ndim)},
                                          1, view.itemsize));
  }
  return spans;
}

nb::tuple run_forward(const nb::sequence& inputs, const std::optional<nb::sequence>& outputs,
                      const nb::sequence& copied, const Attributes& attributes,
                      const std::optional<std::string>& tokens_dtype, int num_threads) {
  const Inputs call(inputs, tokens_dtype);
  const RerouteInputs views = call.views<RerouteInputs>();
  const OutputArrays out = forward_outputs(outputs, call, views, attributes);
  const RerouteOutputs out_views = forward_views(call, out.args);
  if (outputs && nb::len(copied) > 0) {
    std::vector<std::string> names;  // the spans' names point into these
    adapter::check_out_against_copied(infer_reroute(views, attributes), out_views,
                                      copied_spans(copied, names));
  }
  {
    nb::gil_scoped_release release;
    moe_re_routing(views, out_views, attributes, num_threads);
  }
  return nb::tuple(out.arrays);
}

nb::tuple run_backward(const nb::sequence& inputs, const Attributes& attributes,
                       const std::optional<std::string>& tokens_dtype, int num_threads) {
  const Inputs call(inputs, tokens_dtype);
  const InverseInputs views = call.views<InverseInputs>();
  const OutputArrays out(adapter::output_specs(infer_inverse(views, attributes)),
                         inverse_desc(), call);
  const std::vector<Arg>& args = out.args;
  InverseOutputs out_views{view(args[0], call.device(), tokens_dtype, "restored_tokens")};
  if (call.args[2]) {
    out_views.restored_per_token_scales =
        view(args[1], call.device(), call.scales_dtype, "restored_per_token_scales");
  }
  if (call.args[3]) out_views.restored_topk_weight = view(args[2], call.device(), std::nullopt, "");
  {
    nb::gil_scoped_release release;
    moe_re_routing_inverse(views, out_views, attributes, num_threads);
  }
  return nb::tuple(out.arrays);
}

// check_disjoint on arrays described as (name, address, dims, strides in
// elements, element bytes).
void check_strided(const nb::sequence& inputs, const nb::sequence& outputs) {
  std::vector<std::string> names;
  std::vector<ByteSpan> spans;
  for (const nb::sequence* side : {&inputs, &outputs}) {
    for (nb::handle item : *side) names.push_back(nb::cast<std::string>(item[0]));
  }
  std::size_t i = 0;
  for (const nb::sequence* side : {&inputs, &outputs}) {
    for (nb::handle item : *side) {
      const auto dims = nb::cast<std::vector<std::int64_t>>(item[2]);
      const auto strides = nb::cast<std::vector<std::int64_t>>(item[3]);
      const auto item_bytes = nb::cast<std::int64_t>(item[4]);
      const auto address = reinterpret_cast<const void*>(nb::cast<std::uintptr_t>(item[1]));
      spans.push_back(adapter::strided_span(names[i++].c_str(), address, dims, strides,
                                            item_bytes, item_bytes));
    }
  }
  const std::span<const ByteSpan> all(spans);
  const std::size_t num_inputs = nb::len(inputs);
  check_disjoint(all.first(num_inputs), all.subspan(num_inputs));
}

// Attributes as a class with one property per attribute the descriptions name.
void bind_attributes(nb::module_& m) {
  auto cls = nb::class_<Attributes>(m, "Attributes",
                                    "The operators' attributes (docs/spec.md section 2), "
                                    "their defaults until set.")
                 .def(nb::init<>())
                 .def("__eq__", [](const Attributes& a, const Attributes& b) { return a == b; });
  for (const AttributeDesc& attribute : reroute_desc().attributes) {
    const AttributeDesc* desc = &attribute;  // static: outlives the module
    if (desc->kind == AttributeKind::kInt) {
      cls.def_prop_rw(
          desc->name.data(), [desc](const Attributes& a) { return desc->get(a); },
          [desc](Attributes& a, std::int64_t value) { desc->set(a, value); });
    } else if (desc->kind == AttributeKind::kBool) {
      cls.def_prop_rw(
          desc->name.data(), [desc](const Attributes& a) { return desc->get(a) != 0; },
          [desc](Attributes& a, bool value) { desc->set(a, value); });
    }
  }
}

// Each operator's description: {name: {"inputs": [(name, optional)], "outputs":
// [(name, the index of the input it is stored like or None, optional)],
// "attributes": [(name, "int" | "bool" | "dtype_name", default)]}}.
nb::dict operators() {
  nb::dict all;
  for (const OperatorDesc* op : {&reroute_desc(), &inverse_desc()}) {
    nb::list inputs, outputs, attributes;
    for (const InputDesc& input : op->inputs) {
      inputs.append(nb::make_tuple(nb::str(input.name.data()), input.optional));
    }
    for (const OutputDesc& output : op->outputs) {
      nb::object like = nb::none();
      if (output.stored_like != kOwnSpec) like = nb::int_(output.stored_like);
      outputs.append(nb::make_tuple(nb::str(output.name.data()), like, output.optional));
    }
    for (const AttributeDesc& attribute : op->attributes) {
      const char* kind = "dtype_name";
      nb::object value = nb::none();
      if (attribute.kind == AttributeKind::kInt) {
        kind = "int";
        value = nb::int_(attribute.default_value);
      } else if (attribute.kind == AttributeKind::kBool) {
        kind = "bool";
        value = nb::bool_(attribute.default_value != 0);
      }
      attributes.append(nb::make_tuple(nb::str(attribute.name.data()), kind, value));
    }
    nb::dict desc;
    desc["inputs"] = nb::tuple(inputs);
    desc["outputs"] = nb::tuple(outputs);
    desc["attributes"] = nb::tuple(attributes);
    all[nb::str(op->name.data())] = desc;
  }
  return all;
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

  bind_attributes(m);
  m.attr("OPERATORS") = operators();

  // Each argument: None or (name, storage dtype name, storage bits, shape, array or None).
  m.def("infer_reroute", &infer_forward, nb::arg("inputs"), nb::arg("attributes"),
        nb::arg("tokens_dtype").none(),
        "The five output specs [(dtype name, logical shape, the index of the input it is "
        "stored like or None, (rows per input row, rows per expert))] of the forward for "
        "inputs (tokens, counts, scales, weight); the core's infer_reroute and output_rows.");
  m.def("infer_inverse", &infer_backward, nb::arg("inputs"), nb::arg("attributes"),
        nb::arg("tokens_dtype").none(),
        "The three output specs of the inverse (an absent output: float32 (0,)).");
  m.def("check_reroute_out", &check_forward_out, nb::arg("inputs"), nb::arg("outputs"),
        nb::arg("attributes"), nb::arg("tokens_dtype").none(),
        "Refuses an out= call from its described arguments (no data) as the torch kernel "
        "would before reading any: the inputs, then each output's device, layout, dtype and "
        "spec.");
  m.def("reroute", &run_forward, nb::arg("inputs"), nb::arg("outputs").none(), nb::arg("copied"),
        nb::arg("attributes"), nb::arg("tokens_dtype").none(), nb::arg("num_threads") = 0,
        "Runs the forward on the CPU into the five outputs (None: fresh NumPy arrays) and "
        "returns them; writes nothing when it raises. copied: [(name, array)] of the "
        "caller's inputs that `inputs` holds copies of, which outputs must not overlap.");
  m.def("inverse", &run_backward, nb::arg("inputs"), nb::arg("attributes"),
        nb::arg("tokens_dtype").none(), nb::arg("num_threads") = 0,
        "Runs the inverse on the CPU into three fresh NumPy arrays and returns them (an absent "
        "output: float32 (0,)).");
  m.def("check_disjoint", &check_strided, nb::arg("inputs"), nb::arg("outputs"),
        "Refuses an output overlapping an input or an earlier output (docs/spec.md rule 10), "
        "each described as (name, address, dims, strides in elements, element bytes).");
  m.def("dtype_table", &table,
        "The dtype table: one dict per dtype (name, bits, npy_storage, torch_name and "
        "the token / scale / count roles).");
  m.def("hardware_threads", &hardware_threads, "The threads num_threads = 0 uses.");
}
