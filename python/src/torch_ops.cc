// The torch operators: schemas, CPU and CUDA kernels, registration, the CPU output cache's knobs.
//
// The fake kernels are Python (moe_reroute/_torch.py) calling the core's
// infer_reroute / infer_inverse. Why the regular (not the stable) C++ API:
// docs/torch.md.

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "adapter.h"
#include "moe_reroute/moe_reroute.h"
#include "output_cache.h"
#include "torch_backend.h"
#include "torch_call.h"
#include "torch_ops.h"

namespace moe_reroute::torch_ops {

void raise(const Error& error) {
  const c10::SourceLocation where{__func__, __FILE__, static_cast<std::uint32_t>(__LINE__)};
  switch (error.code()) {
    case ErrorCode::kUnsupported:
      throw c10::TypeError(where, error.what());
    case ErrorCode::kInvalidArgument:
    case ErrorCode::kOutOfRange:
      throw c10::ValueError(where, error.what());
    case ErrorCode::kBackend:
      break;
  }
  throw c10::Error(where, error.what());
}

namespace {

using adapter::fail;

// The CPU backend: the core itself.
[[maybe_unused]] const bool cpu_registered = register_backend(
    c10::DeviceType::CPU,
    {[](const Call&, const RerouteInputs& inputs, const RerouteOutputs& outputs,
        const Attributes& attributes) { moe_re_routing(inputs, outputs, attributes); },
     [](const Call&, const InverseInputs& inputs, const InverseOutputs& outputs,
        const Attributes& attributes) { moe_re_routing_inverse(inputs, outputs, attributes); },
     nullptr,
     [](const c10::Device&, const InitRoutingInputs& inputs, const InitRoutingOutputs& outputs,
        const InitRoutingAttributes& attributes) { moe_init_routing(inputs, outputs, attributes); },
     [](const c10::Device&, const FinalizeRoutingInputs& inputs,
        const FinalizeRoutingOutputs& outputs, const FinalizeRoutingAttributes& attributes) {
       moe_finalize_routing(inputs, outputs, attributes);
     }});

// Runs the call on its device's backend (call_device has found it).
template <typename Inputs, typename Outputs>
void run(const Call& call, const Inputs& inputs, const Outputs& outputs,
         const Attributes& attributes) {
  const Backend& backend = *backend_of(call.device.type());
  if constexpr (std::is_same_v<Inputs, RerouteInputs>) {
    backend.reroute(call, inputs, outputs, attributes);
  } else {
    backend.inverse(call, inputs, outputs, attributes);
  }
}

RerouteOutputs reroute_outputs(const Call& call, const Tensor& tokens, const Tensor& scales,
                               const Tensor& idx, const Tensor& num, const Tensor& weight) {
  return {call.output(tokens, "permute_tokens", call.tokens_dtype),
          call.output(scales, "permute_per_token_scales", call.out_scales_dtype()),
          call.output(idx, "permute_token_idx"), call.output(num, "expert_token_num"),
          call.output(weight, "permute_topk_weight")};
}

Forward reroute(const Tensor& tokens, const Tensor& counts, const OptionalTensor& scales,
                const OptionalTensor& weight, std::int64_t expert_token_num_type,
                std::int64_t idx_type, OptionalName tokens_dtype, std::int64_t expert_alignment,
                bool allow_spare_rows) {
  return translated([&] {
    const Call call(tokens, counts, scales, weight, tokens_dtype);
    const RerouteInputs inputs = call.inputs<RerouteInputs>();
    const Attributes attributes =
        attributes_of(expert_token_num_type, idx_type, expert_alignment, allow_spare_rows);
    Forward outputs = call.allocate_outputs<Forward>(
        adapter::output_specs(infer_reroute(inputs, attributes)), reroute_desc());
    auto& [out_tokens, out_scales, out_idx, out_num, out_weight] = outputs;
    run(call, inputs, reroute_outputs(call, out_tokens, out_scales, out_idx, out_num, out_weight),
        attributes);
    return outputs;
  });
}

void reroute_out(const Tensor& tokens, const Tensor& counts, const Tensor& permute_tokens,
                 const Tensor& permute_per_token_scales, const Tensor& permute_token_idx,
                 const Tensor& expert_token_num, const Tensor& permute_topk_weight,
                 const OptionalTensor& scales, const OptionalTensor& weight,
                 std::int64_t expert_token_num_type, std::int64_t idx_type,
                 OptionalName tokens_dtype, std::int64_t expert_alignment, bool allow_spare_rows) {
  translated([&] {
    // The inputs' views first, then the outputs': the order the fake kernel checks in.
    const Call call(tokens, counts, scales, weight, tokens_dtype);
    const RerouteInputs inputs = call.inputs<RerouteInputs>();
    const RerouteOutputs outputs =
        reroute_outputs(call, permute_tokens, permute_per_token_scales, permute_token_idx,
                        expert_token_num, permute_topk_weight);
    const Attributes attributes =
        attributes_of(expert_token_num_type, idx_type, expert_alignment, allow_spare_rows);
    if (!call.copied.empty()) {
      adapter::check_out_against_copied(infer_reroute(inputs, attributes), outputs, call.copied);
    }
    run(call, inputs, outputs, attributes);
  });
}

Inverse inverse(const Tensor& tokens, const Tensor& counts, const OptionalTensor& scales,
                const OptionalTensor& weight, OptionalName tokens_dtype,
                std::int64_t expert_alignment, bool allow_spare_rows) {
  return translated([&] {
    const Call call(tokens, counts, scales, weight, tokens_dtype);
    const InverseInputs inputs = call.inputs<InverseInputs>();
    const Attributes attributes = attributes_of(kExpertTokenNumCount, kIdxGather,
                                                expert_alignment, allow_spare_rows);
    Inverse outputs = call.allocate_outputs<Inverse>(
        adapter::output_specs(infer_inverse(inputs, attributes)), inverse_desc());
    auto& [out_tokens, out_scales, out_weight] = outputs;
    InverseOutputs views{call.output(out_tokens, "restored_tokens", call.tokens_dtype)};
    if (call.scales) {
      views.restored_per_token_scales =
          call.output(out_scales, "restored_per_token_scales", call.out_scales_dtype());
    }
    if (call.weight) views.restored_topk_weight = call.output(out_weight, "restored_topk_weight");
    run(call, inputs, views, attributes);
    return outputs;
  });
}

// The backend's run of the routing operator `R`; null where it has none.
template <typename R>
auto routing_run(const Backend& backend) {
  if constexpr (std::is_same_v<R, adapter::InitRouting>) {
    return backend.init_routing;
  } else {
    return backend.finalize_routing;
  }
}

// The kernel of the routing operator `R` (adapter.h) for every device, boxed:
// it reads the inputs and attributes by the description (the schema lists the
// inputs in its order, the required ones first in both), copies inputs that
// are not contiguous, allocates the outputs as the description stores them
// and hands the call to the backend of the first input's device, refusing a
// device whose backend has no such run.
template <typename R>
void routing(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  translated([&] {
    const auto& op = R::desc();
    const std::size_t num_values = op.inputs.size() + op.attributes.size();
    const auto values = torch::jit::last(*stack, num_values);
    std::vector<Tensor> inputs;  // undefined where absent
    for (std::size_t i = 0; i < op.inputs.size(); ++i) {
      const bool given = values[i].isTensor() && values[i].toTensor().defined();
      if (!given && !op.inputs[i].optional) adapter::fail_none(op.inputs[i].name);
      inputs.push_back(given ? values[i].toTensor().contiguous() : Tensor());
    }
    const std::string_view first = op.inputs[0].name;
    const c10::Device device = inputs[0].device();
    const Backend* backend = backend_of(device.type());
    const auto run = backend ? routing_run<R>(*backend) : nullptr;
    if (!run) {
      fail(ErrorCode::kInvalidArgument, std::string(first) + ": must be in CPU memory (" +
                                            std::string(op.name) + " has no " +
                                            c10::DeviceTypeName(device.type()) + " backend)");
    }
    std::vector<std::optional<TensorView>> views;
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      if (!inputs[i].defined()) {
        views.emplace_back();
        continue;
      }
      const char* name = op.inputs[i].name.data();
      if (inputs[i].device() != device) adapter::fail_device(name, device.str(), first);
      views.push_back(view(inputs[i], name, std::nullopt, name, device));
    }
    const auto attributes = routing_attributes(op, values);
    const typename R::Inputs core_inputs = R::inputs(views);
    const auto specs = R::specs(core_inputs, attributes);
    std::vector<Tensor> outputs;
    std::vector<TensorView> output_views;
    for (std::size_t i = 0; i < specs.size(); ++i) {
      const int like = op.outputs[i].stored_like;
      const bool stored_like = like != kOwnSpec && inputs[like].defined();
      outputs.push_back(allocate(specs[i], stored_like ? &inputs[like] : nullptr, device));
      const char* name = op.outputs[i].name.data();
      output_views.push_back(view(outputs.back(), name, std::nullopt, name, device));
    }
    run(device, core_inputs, R::outputs(output_views), attributes);
    torch::jit::drop(*stack, num_values);
    for (Tensor& output : outputs) torch::jit::push(*stack, std::move(output));
  });
}

// The boxed kernel of the routing operator `R`, to register.
template <typename R>
torch::CppFunction routing_kernel() {
  return torch::CppFunction::makeFromBoxedFunction<&routing<R>>();
}

/// Reads and clears what every device backend found (a host sync each) and
/// raises ValueError naming the argument when bad counts were seen since the
/// last check.
void cuda_check() { translated(check_backends); }

/// Sets the device backends' status check ("deferred" or "sync") and returns
/// the previous one.
std::string set_cuda_status_check(c10::string_view mode) {
  return translated([&] {
    if (mode != "deferred" && mode != "sync") {
      fail(ErrorCode::kInvalidArgument,
           "mode: must be \"deferred\" or \"sync\"; got \"" + std::string(mode) + "\"");
    }
    return std::string(set_sync_checks(mode == "sync") ? "sync" : "deferred");
  });
}

/// Sets the most bytes of freed CPU outputs kept for reuse and returns the
/// previous limit.
std::int64_t set_cpu_output_cache_limit(std::int64_t limit_bytes) {
  return translated([&] {
    if (limit_bytes < 0) {
      fail(ErrorCode::kInvalidArgument,
           "limit_bytes: must be >= 0 (0 keeps none), got " + std::to_string(limit_bytes));
    }
    return set_output_cache_limit(limit_bytes);
  });
}

/// The bytes of freed CPU outputs kept for reuse now.
std::int64_t cpu_output_cache_bytes() { return output_cache_bytes(); }

// The schema of `op` from its description: the required inputs, then
// `outputs` (the out= variant's, which it returns none of), the optional
// inputs and the attributes with their defaults. Named `name`.
template <typename A>
std::string schema(const OperatorDescOf<A>& op, const std::string& name, bool out) {
  std::string arguments;
  const auto add = [&arguments](const std::string& argument) {
    arguments += (arguments.empty() ? "" : ", ") + argument;
  };
  for (const InputDesc& input : op.inputs) {
    if (!input.optional) add("Tensor " + std::string(input.name));
  }
  char alias = 'a';
  for (const OutputDesc& output : op.outputs) {
    if (out) add(std::string("Tensor(") + alias++ + "!) " + std::string(output.name));
  }
  for (const InputDesc& input : op.inputs) {
    if (input.optional) add("Tensor? " + std::string(input.name) + "=None");
  }
  for (const AttributeDescOf<A>& attribute : op.attributes) {
    const std::string attribute_name(attribute.name);
    switch (attribute.kind) {
      case AttributeKind::kInt:
        add("int " + attribute_name + "=" + std::to_string(attribute.default_value));
        break;
      case AttributeKind::kBool:
        add("bool " + attribute_name + (attribute.default_value ? "=True" : "=False"));
        break;
      case AttributeKind::kDTypeName:
        add("str? " + attribute_name + "=None");
        break;
    }
  }
  std::string returns;
  for (std::size_t i = 0; i < op.outputs.size() && !out; ++i) returns += i ? ", Tensor" : "Tensor";
  if (out || op.outputs.size() != 1) returns = "(" + returns + ")";
  return name + "(" + arguments + ") -> " + returns;
}

}  // namespace

// Typed by the kernels themselves: a kernel whose signature is not torch_ops.h's
// does not compile.
c10::TypedOperatorHandle<RerouteKernel> forward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("moe_reroute::moe_re_routing", "")
                             .typed<decltype(reroute)>();
  return op;
}

c10::TypedOperatorHandle<RerouteOutKernel> out_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("moe_reroute::moe_re_routing_out", "")
                             .typed<decltype(reroute_out)>();
  return op;
}

c10::TypedOperatorHandle<InverseKernel> inverse_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("moe_reroute::moe_re_routing_inverse", "")
                             .typed<decltype(inverse)>();
  return op;
}

c10::TypedOperatorHandle<FinalizeRoutingKernel> finalize_routing_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("moe_reroute::moe_finalize_routing", "")
                             .typed<FinalizeRoutingKernel>();
  return op;
}

}  // namespace moe_reroute::torch_ops

namespace ops = moe_reroute::torch_ops;

TORCH_LIBRARY(moe_reroute, m) {
  m.set_python_module("moe_reroute._torch");
  const std::vector<at::Tag> tags = {at::Tag::pt2_compliant_tag};
  const moe_reroute::OperatorDesc& forward = moe_reroute::reroute_desc();
  const moe_reroute::OperatorDesc& inverse = moe_reroute::inverse_desc();
  const std::string forward_name(forward.name);
  m.def(ops::schema(forward, forward_name, false).c_str(), tags);
  m.def(ops::schema(forward, forward_name + "_out", true).c_str(), tags);
  m.def(ops::schema(inverse, std::string(inverse.name), false).c_str(), tags);
  const moe_reroute::InitRoutingDesc& init = moe_reroute::init_routing_desc();
  const moe_reroute::FinalizeRoutingDesc& finalize = moe_reroute::finalize_routing_desc();
  m.def(ops::schema(init, std::string(init.name), false).c_str(), tags);
  m.def(ops::schema(finalize, std::string(finalize.name), false).c_str(), tags);
  m.def("cuda_check() -> ()", &ops::cuda_check);
  m.def("set_cuda_status_check(str mode) -> str", &ops::set_cuda_status_check);
  m.def("set_cpu_output_cache_limit(int limit_bytes) -> int", &ops::set_cpu_output_cache_limit);
  m.def("cpu_output_cache_bytes() -> int", &ops::cpu_output_cache_bytes);
}

// The routing operators' kernel, for both keys: it refuses a device without
// a backend run naming the input, where an unregistered key would only name
// the key.
TORCH_LIBRARY_IMPL(moe_reroute, CPU, m) {
  m.impl("moe_re_routing", &ops::reroute);
  m.impl("moe_re_routing_out", &ops::reroute_out);
  m.impl("moe_re_routing_inverse", &ops::inverse);
  m.impl("moe_init_routing", ops::routing_kernel<moe_reroute::adapter::InitRouting>());
  m.impl("moe_finalize_routing", ops::routing_kernel<moe_reroute::adapter::FinalizeRouting>());
}

TORCH_LIBRARY_IMPL(moe_reroute, CUDA, m) {
  m.impl("moe_re_routing", &ops::reroute);
  m.impl("moe_re_routing_out", &ops::reroute_out);
  m.impl("moe_re_routing_inverse", &ops::inverse);
  m.impl("moe_init_routing", ops::routing_kernel<moe_reroute::adapter::InitRouting>());
  m.impl("moe_finalize_routing", ops::routing_kernel<moe_reroute::adapter::FinalizeRouting>());
}
