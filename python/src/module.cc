// The nanobind module moe_reroute._core: the dtype table, the operators'
// descriptions, the core's shape rules (infer_*, which NumPy allocation and
// the torch fake kernels both use) and the CPU run on NumPy arrays. Errors become
// TypeError / ValueError / RuntimeError by their kind, naming the argument.

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "adapter.h"
#include "numpy_array.h"
#include "moe_reroute/moe_reroute.h"

namespace nb = nanobind;

namespace moe_reroute {
namespace {

using adapter::fail;
using namespace py;

// The views of one call's inputs (tokens, counts, scales?, weight?).
struct Inputs {
  std::vector<std::optional<Arg>> args;
  std::optional<std::string> tokens_dtype;
  std::optional<std::string> scales_dtype;

  Inputs(const nb::sequence& inputs, const OperatorDesc& op,
         const std::optional<std::string>& tokens_name) {
    if (nb::len(inputs) != op.inputs.size()) {
      fail(ErrorCode::kInvalidArgument, "inputs: expected (tokens, counts, scales, weight)");
    }
    for (const InputDesc& input : op.inputs) {
      args.push_back(arg_of(inputs[args.size()], input.name, /*writable=*/false));
      if (!input.optional && !args.back()) adapter::fail_none(input.name);
    }
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

// An output as the torch fake kernels allocate it (the bound class
// OutputSpec): its spec's dtype and shape, the input it is stored like, and
// its rows as a formula in the tokens' rows and E.
struct OutputSpec {
  std::string dtype;
  std::vector<std::int64_t> shape;
  std::optional<int> stored_like;  // the input's index
  RowsFormula rows;
  std::vector<DimFormula> dims;  // the routing operators': each dim in the inputs' dims
};

template <std::size_t N>
std::vector<OutputSpec> output_spec_list(const std::array<TensorSpec, N>& specs,
                                         const OperatorDesc& op, const Attributes& attributes,
                                         const Inputs& call) {
  std::vector<OutputSpec> list;
  for (std::size_t i = 0; i < N; ++i) {
    const Shape& shape = specs[i].shape;
    OutputSpec& spec = list.emplace_back();
    spec.dtype = dtype_name(specs[i].dtype);
    spec.shape.assign(shape.dims.begin(), shape.dims.begin() + shape.ndim);
    const int like = op.outputs[i].stored_like;
    if (like != kOwnSpec) spec.stored_like = like;
    spec.rows = output_rows(op, i, attributes, like != kOwnSpec && call.args[like].has_value());
  }
  return list;
}

std::vector<OutputSpec> infer_forward(const nb::sequence& inputs, const Attributes& attributes,
                       const std::optional<std::string>& tokens_dtype) {
  const Inputs call(inputs, reroute_desc(), tokens_dtype);
  return output_spec_list(
      adapter::output_specs(infer_reroute(call.views<RerouteInputs>(), attributes)),
      reroute_desc(), attributes, call);
}

std::vector<OutputSpec> infer_backward(const nb::sequence& inputs, const Attributes& attributes,
                        const std::optional<std::string>& tokens_dtype) {
  const Inputs call(inputs, inverse_desc(), tokens_dtype);
  return output_spec_list(
      adapter::output_specs(infer_inverse(call.views<InverseInputs>(), attributes)),
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
  // input (that input's dtype, adapter::stored_like's dims) where given, else
  // in the spec's dtype.
  template <std::size_t N, typename A>
  OutputArrays(const std::array<TensorSpec, N>& specs, const OperatorDescOf<A>& op,
               const std::vector<std::optional<Arg>>& inputs) {
    for (std::size_t i = 0; i < N; ++i) {
      const int like = op.outputs[i].stored_like;
      const std::optional<Arg>* input = like == kOwnSpec ? nullptr : &inputs[like];
      fresh(specs[i], input && *input ? &**input : nullptr, op.outputs[i].name);
    }
  }

  // The outputs of `op` the caller gave (described).
  OutputArrays(const nb::sequence& outputs, const OperatorDesc& op) {
    const std::size_t n = op.outputs.size();
    for (nb::handle item : outputs) {
      const std::string_view name = args.size() < n ? op.outputs[args.size()].name : "out";
      std::optional<Arg> arg = arg_of(item, name, /*writable=*/true);
      if (!arg) adapter::fail_none(name);
      args.push_back(std::move(*arg));
      arrays.append(item);
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
      dtype = input->array.attr("dtype");
    } else {
      const DTypeInfo& info = dtype_info(spec.dtype);
      arg.storage = info.name;
      arg.bits = info.bits;
      arg.shape.assign(spec.shape.dims.begin(), spec.shape.dims.begin() + spec.shape.ndim);
      dtype = nb::str(info.npy_storage.data(), info.npy_storage.size());
    }
    const nb::object array = numpy_empty()(nb::cast(arg.shape), dtype);
    arrays.append(array);
    arg.array = array;
    arg.buffer = buffer_of(array, /*writable=*/true);
  }
};

// The outputs of a forward call: the caller's, or fresh by the inferred specs.
OutputArrays forward_outputs(const std::optional<nb::sequence>& outputs, const Inputs& call,
                             const RerouteInputs& views, const Attributes& attributes) {
  if (outputs) return OutputArrays(*outputs, reroute_desc());
  return OutputArrays(adapter::output_specs(infer_reroute(views, attributes)), reroute_desc(),
                      call.args);
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
  const Inputs call(inputs, reroute_desc(), tokens_dtype);
  const RerouteInputs views = call.views<RerouteInputs>();
  const OutputArrays out(outputs, reroute_desc());
  const RerouteOutputs out_views = forward_views(call, out.args);
  check_output_specs(infer_reroute(views, attributes), out_views);
}

// The memory of each array in `copied` (by the argument's name): the caller's
// inputs that the Python layer copied to C order or native byte order.
std::vector<ByteSpan> copied_spans(const nb::dict& copied, std::vector<std::string>& names) {
  static_assert(sizeof(Py_ssize_t) == sizeof(std::int64_t));
  std::vector<ByteSpan> spans;
  for (auto [name, array] : copied) names.push_back(nb::cast<std::string>(name));
  for (auto [name, array] : copied) {
    const Buffer buffer = buffer_of(array, /*writable=*/false);
    const Py_buffer& view = *buffer;
    spans.push_back(adapter::strided_span(names[spans.size()].c_str(), view.buf,
                                          {reinterpret_cast<const std::int64_t*>(view.shape),
                                           static_cast<std::size_t>(view.ndim)},
                                          {reinterpret_cast<const std::int64_t*>(view.strides),
                                           static_cast<std::size_t>(view.ndim)},
                                          1, view.itemsize));
  }
  return spans;
}

nb::tuple run_forward(const nb::sequence& inputs, const std::optional<nb::sequence>& outputs,
                      const nb::dict& copied, const Attributes& attributes,
                      const std::optional<std::string>& tokens_dtype, int num_threads) {
  const Inputs call(inputs, reroute_desc(), tokens_dtype);
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
  const Inputs call(inputs, inverse_desc(), tokens_dtype);
  const InverseInputs views = call.views<InverseInputs>();
  const OutputArrays out(adapter::output_specs(infer_inverse(views, attributes)),
                         inverse_desc(), call.args);
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

// One call of a routing operator `R` (adapter.h): its inputs in the
// description's order, each an Argument, a NumPy array or None where
// optional, on the first input's device where described.
template <typename R>
struct RoutingCall {
  std::vector<std::optional<Arg>> args;
  std::vector<std::optional<TensorView>> views;

  explicit RoutingCall(const nb::sequence& inputs) {
    const auto& op = R::desc();
    if (nb::len(inputs) != op.inputs.size()) {
      fail(ErrorCode::kInvalidArgument, "inputs: expected the " +
                                            std::to_string(op.inputs.size()) + " inputs of " +
                                            std::string(op.name));
    }
    for (const InputDesc& input : op.inputs) {
      args.push_back(arg_of(inputs[args.size()], input.name, /*writable=*/false));
      if (!input.optional && !args.back()) adapter::fail_none(input.name);
    }
    const std::optional<std::string>& device = args[0]->device;
    for (const std::optional<Arg>& arg : args) {
      if (arg && device && arg->device && *arg->device != *device) {
        adapter::fail_device(arg->name, *device, op.inputs[0].name);
      }
      views.push_back(arg ? std::optional(view(*arg, std::nullopt, std::nullopt, ""))
                          : std::nullopt);
    }
  }

  typename R::Inputs inputs() const { return R::inputs(views); }
};

// The OutputSpecs of a routing call: dtype, shape, the input stored like, and
// each dim as a formula in the inputs' dims (output_dims).
template <typename R>
std::vector<OutputSpec> infer_routing(const nb::sequence& inputs,
                                      const typename R::Attributes& attributes) {
  const RoutingCall<R> call(inputs);
  const auto specs = R::specs(call.inputs(), attributes);
  std::array<bool, R::kNumInputs> given{};
  for (std::size_t i = 0; i < given.size(); ++i) given[i] = call.args[i].has_value();
  std::vector<OutputSpec> list;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const Shape& shape = specs[i].shape;
    OutputSpec& spec = list.emplace_back();
    spec.dtype = dtype_name(specs[i].dtype);
    spec.shape.assign(shape.dims.begin(), shape.dims.begin() + shape.ndim);
    const int like = R::desc().outputs[i].stored_like;
    if (like != kOwnSpec) spec.stored_like = like;
    spec.dims = output_dims(R::desc(), i, attributes, given);
  }
  return list;
}

// Runs a routing call on the CPU into fresh NumPy arrays by the core's specs;
// returns them (the one output itself where there is one).
template <typename R>
nb::object run_routing(const nb::sequence& inputs, const typename R::Attributes& attributes,
                       int num_threads) {
  const RoutingCall<R> call(inputs);
  const typename R::Inputs views = call.inputs();
  const OutputArrays out(R::specs(views, attributes), R::desc(), call.args);
  std::vector<TensorView> out_views;
  for (const Arg& arg : out.args) out_views.push_back(view(arg, std::nullopt, std::nullopt, ""));
  {
    nb::gil_scoped_release release;
    R::run(views, R::outputs(out_views), attributes, num_threads);
  }
  if constexpr (R::kNumOutputs == 1) return out.arrays[0];
  return nb::tuple(out.arrays);
}

// A DimFormula as Python evaluates it: ((coefficient, ((input, dim), ...)), ...), at_most.
nb::tuple formula_tuple(const DimFormula& formula) {
  nb::list terms;
  for (int t = 0; t < formula.num_terms; ++t) {
    const DimTerm& term = formula.terms[static_cast<std::size_t>(t)];
    nb::list factors;
    for (int f = 0; f < term.num_factors; ++f) {
      const InputDim& factor = term.factors[static_cast<std::size_t>(f)];
      factors.append(nb::make_tuple(factor.input, factor.dim));
    }
    terms.append(nb::make_tuple(term.coefficient, nb::tuple(factors)));
  }
  return nb::make_tuple(nb::tuple(terms), formula.at_most);
}

// A strided array as its memory is laid out (the bound class Strided): its
// address, dims, strides in elements and element bytes.
struct Strided {
  std::string name;
  std::uintptr_t address = 0;
  std::vector<std::int64_t> dims;
  std::vector<std::int64_t> strides;
  std::int64_t item_bytes = 0;

  ByteSpan span() const {
    return adapter::strided_span(name.c_str(), reinterpret_cast<const void*>(address), dims,
                                 strides, item_bytes, item_bytes);
  }
};

void check_strided(const std::vector<const Strided*>& inputs,
                   const std::vector<const Strided*>& outputs) {
  std::vector<ByteSpan> spans;
  for (const auto* side : {&inputs, &outputs}) {
    for (const Strided* array : *side) spans.push_back(array->span());
  }
  const std::span<const ByteSpan> all(spans);
  check_disjoint(all.first(inputs.size()), all.subspan(inputs.size()));
}

// The attribute struct `A` as the class `name`, with one property per
// attribute `op` describes.
template <typename A>
void bind_attributes(nb::module_& m, const char* name, const OperatorDescOf<A>& op,
                     const char* doc) {
  auto cls = nb::class_<A>(m, name, doc)
                 .def(nb::init<>())
                 .def("__eq__", [](const A& a, const A& b) { return a == b; });
  for (const AttributeDescOf<A>& attribute : op.attributes) {
    const AttributeDescOf<A>* desc = &attribute;  // static: outlives the module
    if (desc->kind == AttributeKind::kInt) {
      cls.def_prop_rw(
          desc->name.data(), [desc](const A& a) { return desc->get(a); },
          [desc](A& a, std::int64_t value) { desc->set(a, value); });
    } else if (desc->kind == AttributeKind::kBool) {
      cls.def_prop_rw(
          desc->name.data(), [desc](const A& a) { return desc->get(a) != 0; },
          [desc](A& a, bool value) { desc->set(a, value); });
    }
  }
}

// The description of `op` into `all`: {name: {"inputs": [(name, optional)],
// "outputs": [(name, the index of the input it is stored like or None,
// optional)], "attributes": [(name, "int" | "bool" | "dtype_name", default)],
// "attributes_class": the bound class of its attribute struct}}.
template <typename A>
void describe(nb::dict& all, const OperatorDescOf<A>& op) {
  nb::list inputs, outputs, attributes;
  for (const InputDesc& input : op.inputs) {
    inputs.append(nb::make_tuple(nb::str(input.name.data()), input.optional));
  }
  for (const OutputDesc& output : op.outputs) {
    nb::object like = nb::none();
    if (output.stored_like != kOwnSpec) like = nb::int_(output.stored_like);
    outputs.append(nb::make_tuple(nb::str(output.name.data()), like, output.optional));
  }
  for (const AttributeDescOf<A>& attribute : op.attributes) {
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
  desc["attributes_class"] = nb::type<A>();
  all[nb::str(op.name.data())] = desc;
}

nb::dict operators() {
  nb::dict all;
  describe(all, reroute_desc());
  describe(all, inverse_desc());
  describe(all, init_routing_desc());
  describe(all, finalize_routing_desc());
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

  py::translate_errors();

  bind_attributes(m, "Attributes", reroute_desc(),
                  "The attributes of moe_re_routing and moe_re_routing_inverse (docs/spec.md "
                  "section 2), their defaults until set.");
  bind_attributes(m, "InitRoutingAttributes", init_routing_desc(),
                  "The attributes of moe_init_routing, their defaults until set.");
  bind_attributes(m, "FinalizeRoutingAttributes", finalize_routing_desc(),
                  "The attributes of moe_finalize_routing, their defaults until set.");
  m.attr("OPERATORS") = operators();

  nb::class_<Argument>(m, "Argument",
                       "A tensor's metadata, which the shape rules read: its name, storage "
                       "dtype name and bits, shape, device and whether it is contiguous.")
      .def(nb::init<std::string, std::string, int, std::vector<std::int64_t>,
                    std::optional<std::string>, bool>(),
           nb::arg("name"), nb::arg("storage"), nb::arg("bits"), nb::arg("shape"),
           nb::arg("device").none(), nb::arg("contiguous"))
      .def_ro("name", &Argument::name)
      .def_ro("storage", &Argument::storage)
      .def_ro("bits", &Argument::bits)
      .def_ro("shape", &Argument::shape)
      .def_ro("device", &Argument::device)
      .def_ro("contiguous", &Argument::contiguous);
  nb::class_<OutputSpec>(m, "OutputSpec",
                         "An output's spec as a framework allocates it: dtype, shape, the "
                         "index of the input it is stored like (or None), and its rows as "
                         "rows_per_input_row * (tokens' rows) + rows_per_expert * E; for the "
                         "routing operators, dims: each dim as ((coefficient, ((input, dim), "
                         "...)), ...), at_most: the sum of the terms, each its coefficient "
                         "times the product of those input dims, at most at_most where >= 0.")
      .def_ro("dtype", &OutputSpec::dtype)
      .def_ro("shape", &OutputSpec::shape)
      .def_ro("stored_like", &OutputSpec::stored_like)
      .def_prop_ro("rows_per_input_row", [](const OutputSpec& o) { return o.rows.per_input_row; })
      .def_prop_ro("rows_per_expert", [](const OutputSpec& o) { return o.rows.per_expert; })
      .def_prop_ro("dims", [](const OutputSpec& o) {
        nb::list dims;
        for (const DimFormula& formula : o.dims) dims.append(formula_tuple(formula));
        return dims;
      });
  nb::class_<Strided>(m, "Strided",
                      "An array's memory: its address, dims, strides in elements and "
                      "element bytes.")
      .def(nb::init<std::string, std::uintptr_t, std::vector<std::int64_t>,
                    std::vector<std::int64_t>, std::int64_t>(),
           nb::arg("name"), nb::arg("address"), nb::arg("dims"), nb::arg("strides"),
           nb::arg("item_bytes"));

  m.def("infer_reroute", &infer_forward, nb::arg("inputs"), nb::arg("attributes"),
        nb::arg("tokens_dtype").none(),
        "The five OutputSpecs of the forward for the Arguments (tokens, counts, scales, "
        "weight), None where absent; the core's infer_reroute and output_rows.");
  m.def("infer_inverse", &infer_backward, nb::arg("inputs"), nb::arg("attributes"),
        nb::arg("tokens_dtype").none(),
        "The three OutputSpecs of the inverse (an absent output: float32 (0,)).");
  m.def("check_reroute_out", &check_forward_out, nb::arg("inputs"), nb::arg("outputs"),
        nb::arg("attributes"), nb::arg("tokens_dtype").none(),
        "Refuses an out= call from its described arguments (no data) as the torch kernel "
        "would before reading any: the inputs, then each output's device, layout, dtype and "
        "spec.");
  m.def("reroute", &run_forward, nb::arg("inputs"), nb::arg("outputs").none(), nb::arg("copied"),
        nb::arg("attributes"), nb::arg("tokens_dtype").none(), nb::arg("num_threads") = 0,
        "Runs the forward on the CPU into the five outputs (None: fresh NumPy arrays) and "
        "returns them; writes nothing when it raises. copied: {name: array} of the "
        "caller's inputs that `inputs` holds copies of, which outputs must not overlap.");
  m.def("inverse", &run_backward, nb::arg("inputs"), nb::arg("attributes"),
        nb::arg("tokens_dtype").none(), nb::arg("num_threads") = 0,
        "Runs the inverse on the CPU into three fresh NumPy arrays and returns them (an absent "
        "output: float32 (0,)).");
  m.def("infer_init_routing", &infer_routing<adapter::InitRouting>, nb::arg("inputs"),
        nb::arg("attributes"),
        "The four OutputSpecs of moe_init_routing for the Arguments (x, expert_idx); the "
        "core's infer_init_routing and output_dims.");
  m.def("infer_finalize_routing", &infer_routing<adapter::FinalizeRouting>, nb::arg("inputs"),
        nb::arg("attributes"),
        "The OutputSpec of moe_finalize_routing for the Arguments (expanded_x, "
        "expanded_row_idx, x1, x2, bias, scales, expert_idx), None where absent.");
  m.def("init_routing", &run_routing<adapter::InitRouting>, nb::arg("inputs"),
        nb::arg("attributes"), nb::arg("num_threads") = 0,
        "Runs moe_init_routing on the CPU on the arrays (x, expert_idx) into four fresh NumPy "
        "arrays and returns them; writes nothing when it raises.");
  m.def("finalize_routing", &run_routing<adapter::FinalizeRouting>, nb::arg("inputs"),
        nb::arg("attributes"), nb::arg("num_threads") = 0,
        "Runs moe_finalize_routing on the CPU on the arrays (expanded_x, expanded_row_idx, "
        "x1, x2, bias, scales, expert_idx), None where absent, into a fresh NumPy array "
        "and returns it.");
  m.def("check_disjoint", &check_strided, nb::arg("inputs"), nb::arg("outputs"),
        "Refuses an output overlapping an input or an earlier output (docs/spec.md rule 10), "
        "each a Strided.");
  m.def("dtype_table", &table,
        "The dtype table: one dict per dtype (name, bits, npy_storage, torch_name and "
        "the token / scale / count roles).");
  m.def("hardware_threads", &hardware_threads, "The threads num_threads = 0 uses.");
}
