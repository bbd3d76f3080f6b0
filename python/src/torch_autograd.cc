// Autograd: backward nodes, forward-mode AD, and out='s Autograd and ADInplaceOrView kernels;
// the routing operators' backward nodes.

#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "adapter.h"
#include "torch_ops.h"

namespace moe_reroute::torch_ops {
namespace {

using torch::autograd::Node;
using torch::autograd::variable_list;

// How this torch owns graph nodes: std::shared_ptr (torch 2.9) or
// c10::intrusive_ptr (torch 2.15).
using NodePtr = decltype(torch::autograd::Edge::function);

// A new `T`, owned as NodePtr says: the one place where the two differ here.
template <typename T, typename... Args>
NodePtr make_node(Args&&... args) {
  if constexpr (std::is_base_of_v<c10::intrusive_ptr_target, T>) {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  } else {
    // torch's deleter frees a long chain of nodes without deep recursion.
    return std::shared_ptr<T>(new T(std::forward<Args>(args)...),
                              [](T* node) { deleteNode(node); });
  }
}

bool requires_grad(const Tensor& tokens, const OptionalTensor& scales, const OptionalTensor& weight) {
  return at::GradMode::is_enabled() &&
         (tokens.requires_grad() || (scales && scales->requires_grad()) ||
          (weight && weight->requires_grad()));
}

// Zeroes rows [valid, rows) of `gradient`.
void zero_rows_from(Tensor& gradient, const Tensor& valid) {
  const Tensor rows = at::arange(gradient.size(0), gradient.options().dtype(c10::kLong));
  std::vector<std::int64_t> shape(static_cast<std::size_t>(gradient.dim()), 1);
  shape[0] = gradient.size(0);
  gradient.masked_fill_(rows.ge(valid).view(shape), 0);
}

// The graph node of a call to either op, built as torch's own derivative code
// builds its nodes, which torch.func's transforms (grad, vjp, jacrev) take
// where they refuse a C++ torch::autograd::Function. Its edges lead to the
// call's tokens, per_token_scales and expert_topk_weight; its inputs are the
// gradients of the call's outputs, in order. Both ops are reorders by the
// counts, so each one's backward is the other.
class ReorderBackward : public Node {
 public:
  ReorderBackward(const Tensor& counts, const OptionalName& tokens_dtype,
                  const Attributes& attributes)
      : counts_(counts, /*is_output=*/false),
        tokens_dtype_(name_of(tokens_dtype)),
        attributes_(attributes) {}

  void release_variables() override { counts_.reset_data(); }

 protected:
  // The call's inputs with gradients: the node's edges, in order.
  enum Input : std::size_t { kTokens, kScales, kWeight };

  // The counts, refused (by torch) where modified in place since the call or
  // freed by an earlier backward.
  Tensor counts() const { return counts_.unpack(); }
  OptionalName tokens_dtype() const {
    return tokens_dtype_ ? OptionalName(*tokens_dtype_) : std::nullopt;
  }

  // The gradient of output `output`: zeros where none came (an output the
  // loss does not use, or one of a dtype without gradients).
  Tensor gradient(const variable_list& grads, std::size_t output) const {
    return grads[output].defined() ? grads[output].contiguous()
                                   : input_metadata(output).zeros_like();
  }
  // The same where `input` takes a gradient; none otherwise.
  OptionalTensor gradient_for(Input input, const variable_list& grads, std::size_t output) const {
    if (!task_should_compute_output(input)) return std::nullopt;
    return gradient(grads, output);
  }

  // The inputs' gradients from the reorder's, undefined where none is asked,
  // with rows [valid, rows) zeroed where `valid` is given: rows the op never
  // read get none.
  variable_list input_gradients(Tensor tokens, Tensor scales, Tensor weight,
                                const std::optional<Tensor>& valid) const {
    variable_list gradients{std::move(tokens), std::move(scales), std::move(weight)};
    for (const Input input : {kTokens, kScales, kWeight}) {
      Tensor& gradient = gradients[input];
      if (!task_should_compute_output(input)) {
        gradient = Tensor();
      } else if (valid) {
        zero_rows_from(gradient, *valid);
      }
    }
    return gradients;
  }

  torch::autograd::SavedVariable counts_;
  std::optional<std::string> tokens_dtype_;
  Attributes attributes_;
};

// The forward's backward: the inverse reorder of the incoming gradients.
class RerouteBackward final : public ReorderBackward {
 public:
  using ReorderBackward::ReorderBackward;
  std::string name() const override { return "MoeReRoutingBackward"; }

  variable_list apply(variable_list&& grads) override {
    const Tensor counts = this->counts();
    auto [tokens, scales, weight] = std::apply(
        [&](const auto&... attributes) {
          return inverse_op().call(gradient(grads, 0), counts, gradient_for(kScales, grads, 1),
                                   gradient_for(kWeight, grads, 4), attributes...);
        },
        inverse_arguments(attributes_, tokens_dtype()));
    // The forward's spare input rows, past the counts' sum.
    return input_gradients(
        std::move(tokens), std::move(scales), std::move(weight),
        attributes_.allow_spare_rows ? std::optional<Tensor>(counts.sum()) : std::nullopt);
  }
};

// The inverse's backward: the forward reorder of the incoming gradients.
class InverseBackward final : public ReorderBackward {
 public:
  using ReorderBackward::ReorderBackward;
  std::string name() const override { return "MoeReRoutingInverseBackward"; }

  variable_list apply(variable_list&& grads) override {
    Attributes forward = attributes_;
    forward.expert_token_num_type = kExpertTokenNumCumsum;
    forward.idx_type = kIdxGather;
    auto [tokens, scales, idx, cumsum, weight] = std::apply(
        [&](const auto&... attributes) {
          return forward_op().call(gradient(grads, 0), counts(), gradient_for(kScales, grads, 1),
                                   gradient_for(kWeight, grads, 2), attributes...);
        },
        reroute_arguments(forward, tokens_dtype()));
    // The inverse's tail input rows, past the last padded segment end
    // (cumsum[-1]): there are some with padding room or spare rows.
    const bool tail = pads(attributes_) || attributes_.allow_spare_rows;
    return input_gradients(std::move(tokens), std::move(scales), std::move(weight),
                           tail ? std::optional<Tensor>(cumsum[-1]) : std::nullopt);
  }
};

// Records `output` as the next of `node`'s inputs and, where its dtype has
// gradients, makes `node` its grad_fn (the index outputs and integer data
// get none).
void set_history(const NodePtr& node, const Tensor& output) {
  const std::uint32_t input_nr = node->add_input_metadata(output);
  if (torch::autograd::isDifferentiableType(output.scalar_type())) {
    torch::autograd::impl::set_gradient_edge(output, {node, input_nr});
  }
}

// Runs `call(tokens, scales, weight)` below the autograd layer and, where an
// input requires grad, makes a `Backward` node (edges to tokens, scales,
// weight) its outputs' grad_fn.
template <typename Backward, typename Call>
auto recorded(const Tensor& tokens, const Tensor& counts, const OptionalTensor& scales,
              const OptionalTensor& weight, const OptionalName& tokens_dtype,
              const Attributes& attributes, const Call& call) {
  NodePtr node;
  if (requires_grad(tokens, scales, weight)) {
    node = make_node<Backward>(counts, tokens_dtype, attributes);
    node->set_next_edges(torch::autograd::collect_next_edges(tokens, scales, weight));
  }
  auto outputs = [&] {
    const at::AutoDispatchBelowADInplaceOrView guard;
    return call(tokens, scales, weight);
  }();
  if (node) std::apply([&](const auto&... output) { (set_history(node, output), ...); }, outputs);
  return outputs;
}

// Forward-mode AD's one level, as in torch's own derivative code.
constexpr std::uint64_t kForwardLevel = 0;

bool has_tangent(const Tensor& tensor) { return tensor._fw_grad(kForwardLevel).defined(); }
bool has_tangent(const OptionalTensor& tensor) { return tensor && has_tangent(*tensor); }

Tensor primal(const Tensor& tensor) { return tensor._fw_primal(kForwardLevel); }
OptionalTensor primal(const OptionalTensor& tensor) {
  return tensor ? OptionalTensor(primal(*tensor)) : std::nullopt;
}

// What the tangent call reads for an input: its tangent, or the input itself
// (detached) where it has none; that output's tangent is then left unset.
Tensor tangent_or_input(const Tensor& tensor) {
  const Tensor& tangent = tensor._fw_grad(kForwardLevel);
  return tangent.defined() ? tangent : tensor.detach();
}
OptionalTensor tangent_or_input(const OptionalTensor& tensor) {
  return tensor ? OptionalTensor(tangent_or_input(*tensor)) : std::nullopt;
}

void set_tangent(const Tensor& output, const OptionalTensor& input, const Tensor& tangent) {
  if (has_tangent(input)) output._set_fw_grad(tangent, kForwardLevel, /*is_inplace_op=*/false);
}

// Both ops are linear in tokens, scales and weight, so the tangent of each of
// their data outputs (at kTokens, kScales, kWeight) is the same op run on the
// inputs' tangents. `call(tokens, scales, weight)` runs the op; the primal call
// gets the inputs without their tangents, through which backward mode still records.
template <std::size_t kTokens, std::size_t kScales, std::size_t kWeight, typename Call>
auto with_tangents(const Tensor& tokens, const OptionalTensor& scales,
                   const OptionalTensor& weight, const Call& call) {
  auto outputs = call(primal(tokens), primal(scales), primal(weight));
  const auto tangents =
      call(tangent_or_input(tokens), tangent_or_input(scales), tangent_or_input(weight));
  set_tangent(std::get<kTokens>(outputs), tokens, std::get<kTokens>(tangents));
  set_tangent(std::get<kScales>(outputs), scales, std::get<kScales>(tangents));
  set_tangent(std::get<kWeight>(outputs), weight, std::get<kWeight>(tangents));
  return outputs;
}

// moe_init_routing's backward: x's gradient sums the gradients of its
// expanded rows, which is moe_finalize_routing of them with unit scales in
// the layout init writes (row-major; [T * k, H], or [E, C, H] by capacity):
// rows past active_num and dropped entries give none.
class InitRoutingBackward final : public Node {
 public:
  using Routing = adapter::InitRouting;
  InitRoutingBackward(const std::vector<Tensor>& inputs, const InitRoutingAttributes& attributes)
      : num_tokens_(inputs[0].sym_size(0)),
        top_k_(inputs[1].sym_size(1)),
        mode_(attributes.drop_pad_mode == kDropPad ? kFinalizeRowMajorCapacity
                                                   : kFinalizeRowMajor) {}
  std::string name() const override { return "MoeInitRoutingBackward"; }

  void save_outputs(c10::ArrayRef<c10::IValue> outputs) {
    row_idx_ = torch::autograd::SavedVariable(outputs[1].toTensor(), /*is_output=*/false);
  }
  void release_variables() override { row_idx_.reset_data(); }

  variable_list apply(variable_list&& grads) override {
    variable_list gradients(Routing::kNumInputs);
    if (!task_should_compute_output(0)) return gradients;
    const Tensor gradient =
        grads[0].defined() ? grads[0].contiguous() : input_metadata(0).zeros_like();
    const Tensor unit = at::ones_symint({num_tokens_, top_k_}, gradient.options());
    gradients[0] = finalize_routing_op().call(gradient, row_idx_.unpack(), std::nullopt,
                                              std::nullopt, std::nullopt, unit, std::nullopt,
                                              mode_);
    return gradients;
  }

 private:
  torch::autograd::SavedVariable row_idx_;
  c10::SymInt num_tokens_;
  c10::SymInt top_k_;
  std::int64_t mode_;
};

// moe_finalize_routing's backward, from each slot (t, j) read (its row r,
// scale s): expanded_x[r] and bias[expert_idx[t, j]] get grad_out[t] * s,
// scales[t, j] gets the sum over h of grad_out[t, h] * (expanded_x[r] +
// bias)[h], x1 and x2 get grad_out; slots skipped get nothing. In float32,
// as the forward sums.
class FinalizeRoutingBackward final : public Node {
 public:
  using Routing = adapter::FinalizeRouting;
  enum Input : std::size_t { kExpandedX, kRowIdx, kX1, kX2, kBias, kScales, kExpertIdx };

  FinalizeRoutingBackward(const std::vector<Tensor>& inputs,
                          const FinalizeRoutingAttributes& attributes)
      : mode_(attributes.drop_pad_mode) {
    for (const Input input : {kExpandedX, kRowIdx, kBias, kScales, kExpertIdx}) {
      saved_[input] = torch::autograd::SavedVariable(inputs[input], /*is_output=*/false);
    }
  }
  std::string name() const override { return "MoeFinalizeRoutingBackward"; }

  void save_outputs(c10::ArrayRef<c10::IValue>) {}
  void release_variables() override {
    for (torch::autograd::SavedVariable& saved : saved_) saved.reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    variable_list gradients(Routing::kNumInputs);
    const Tensor gradient = grads[0].defined() ? grads[0] : input_metadata(0).zeros_like();
    for (const Input input : {kX1, kX2}) {
      if (task_should_compute_output(input)) gradients[input] = gradient;
    }
    const bool expanded_wanted = task_should_compute_output(kExpandedX);
    const bool bias_wanted = task_should_compute_output(kBias);
    const bool scales_wanted = task_should_compute_output(kScales);
    if (!expanded_wanted && !bias_wanted && !scales_wanted) return gradients;

    const Tensor expanded = saved_[kExpandedX].unpack();
    const Tensor bias = saved_[kBias].unpack();
    const Tensor scales = saved_[kScales].unpack();
    const Tensor expanded_rows = expanded.flatten(0, -2);
    const c10::SymInt rows = expanded_rows.sym_size(0);
    const c10::SymInt hidden = expanded_rows.sym_size(1);
    const c10::SymInt num_tokens = gradient.sym_size(0);
    const c10::SymInt top_k = scales.defined() ? scales.sym_size(1) : c10::SymInt(1);
    const auto float32 = gradient.options().dtype(at::kFloat);

    // The row of each slot, [T, k], and whether the forward read it.
    const Tensor row_idx = saved_[kRowIdx].unpack().to(at::kLong);
    const bool row_major = mode_ == kFinalizeRowMajor || mode_ == kFinalizeRowMajorCapacity;
    const Tensor index = row_major ? row_idx.view_symint({num_tokens, top_k})
                                   : row_idx.view_symint({top_k, num_tokens}).t();
    const bool capacity =
        mode_ == kFinalizeColumnMajorCapacity || mode_ == kFinalizeRowMajorCapacity;
    const Tensor skipped = capacity ? index.lt(0) : index.ge(c10::Scalar(rows));
    // Row r of expanded_x as row r + 1 of a copy whose row 0, where skipped slots go, is zero.
    const Tensor shifted = index.add(1).masked_fill(skipped, 0).flatten();
    const Tensor scale = scales.defined() ? scales.to(at::kFloat)
                                          : at::ones_symint({num_tokens, top_k}, float32);
    const Tensor incoming = gradient.to(at::kFloat);
    // grad_out[t] * s of each slot, [T * k, H], zero where skipped.
    const Tensor weighted =
        incoming.unsqueeze(1).mul(scale.masked_fill(skipped, 0).unsqueeze(2)).flatten(0, 1);
    if (expanded_wanted) {
      gradients[kExpandedX] = at::zeros_symint({rows + 1, hidden}, float32)
                                  .index_add_(0, shifted, weighted)
                                  .narrow_symint(0, 1, rows)
                                  .to(expanded.scalar_type())
                                  .view_symint(expanded.sym_sizes());
    }
    const Tensor experts =
        bias.defined() ? saved_[kExpertIdx].unpack().to(at::kLong).flatten() : Tensor();
    if (bias_wanted) {
      gradients[kBias] = at::zeros_like(bias, float32).index_add_(0, experts, weighted)
                             .to(bias.scalar_type());
    }
    if (scales_wanted) {
      Tensor read = at::cat({at::zeros_symint({1, hidden}, float32), expanded_rows.to(at::kFloat)})
                        .index_select(0, shifted);
      if (bias.defined()) read = read.add(bias.to(at::kFloat).index_select(0, experts));
      gradients[kScales] = incoming.unsqueeze(1)
                               .mul(read.view_symint({num_tokens, top_k, hidden}))
                               .sum(2)
                               .masked_fill(skipped, 0)
                               .to(scales.scalar_type());
    }
    return gradients;
  }

 private:
  std::array<torch::autograd::SavedVariable, Routing::kNumInputs> saved_;
  std::int64_t mode_;
};

// The routing operators' autograd kernel, boxed: where grad mode is on and
// an input requires grad, a `Backward` node (edges to every input, in the
// description's order) becomes the grad_fn of the outputs with gradients
// (the index and count outputs have none). Forward-mode tangents are refused
// by name: these operators have no forward derivative.
template <typename Backward>
void routing_autograd(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& desc = Backward::Routing::desc();
  const auto values = torch::jit::last(*stack, desc.inputs.size() + desc.attributes.size());
  std::vector<Tensor> inputs;  // undefined where absent
  bool wanted = false;
  for (std::size_t i = 0; i < desc.inputs.size(); ++i) {
    inputs.push_back(values[i].isTensor() ? values[i].toTensor() : Tensor());
    const Tensor& input = inputs.back();
    TORCH_CHECK_NOT_IMPLEMENTED(!input.defined() || !has_tangent(input), desc.inputs[i].name,
                                ": has a forward-mode tangent, but ", desc.name,
                                " has no forward-mode derivative");
    wanted = wanted || (input.defined() && input.requires_grad());
  }
  NodePtr node;
  if (wanted && at::GradMode::is_enabled()) {
    node = make_node<Backward>(inputs, routing_attributes(desc, values));
    node->set_next_edges(torch::autograd::collect_next_edges(inputs));
  }
  {
    const at::AutoDispatchBelowADInplaceOrView guard;
    op.callBoxed(stack);
  }
  if (!node) return;
  const auto outputs = torch::jit::last(*stack, op.schema().returns().size());
  for (const c10::IValue& output : outputs) set_history(node, output.toTensor());
  static_cast<Backward&>(*node).save_outputs(outputs);
}

// The autograd kernels: with no gradient to track they only call the kernel
// below the autograd layer, so an eager no-grad call costs no more than the kernel.
Forward reroute_autograd(const Tensor& tokens, const Tensor& counts, const OptionalTensor& scales,
                         const OptionalTensor& weight, std::int64_t expert_token_num_type,
                         std::int64_t idx_type, OptionalName tokens_dtype,
                         std::int64_t expert_alignment, bool allow_spare_rows) {
  const auto call = [&](const Tensor& t, const OptionalTensor& s, const OptionalTensor& w) {
    return forward_op().call(t, counts, s, w, expert_token_num_type, idx_type, tokens_dtype,
                             expert_alignment, allow_spare_rows);
  };
  if (has_tangent(tokens) || has_tangent(scales) || has_tangent(weight)) {
    return with_tangents<0, 1, 4>(tokens, scales, weight, call);
  }
  return recorded<RerouteBackward>(
      tokens, counts, scales, weight, tokens_dtype,
      attributes_of(expert_token_num_type, idx_type, expert_alignment, allow_spare_rows), call);
}

Inverse inverse_autograd(const Tensor& tokens, const Tensor& counts, const OptionalTensor& scales,
                         const OptionalTensor& weight, OptionalName tokens_dtype,
                         std::int64_t expert_alignment, bool allow_spare_rows) {
  const auto call = [&](const Tensor& t, const OptionalTensor& s, const OptionalTensor& w) {
    return inverse_op().call(t, counts, s, w, tokens_dtype, expert_alignment, allow_spare_rows);
  };
  if (has_tangent(tokens) || has_tangent(scales) || has_tangent(weight)) {
    return with_tangents<0, 1, 2>(tokens, scales, weight, call);
  }
  return recorded<InverseBackward>(
      tokens, counts, scales, weight, tokens_dtype,
      attributes_of(kExpertTokenNumCount, kIdxGather, expert_alignment, allow_spare_rows), call);
}

// The out= op's autograd kernel, boxed: it reads each argument by its schema
// name, and refuses before anything is written
// - an argument that requires grad while grad mode is on, or that has a
//   forward-mode tangent: out= has no derivative, as torch's own out=
//   functions have none (an output that requires grad would also be written
//   behind autograd's back);
// - an output that is an inference tensor: this kernel runs outside
//   inference mode, where torch refuses in-place writes to one (torch's own
//   out= functions refuse it after writing);
// then goes on to the version bump below.
void reroute_out_autograd(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const bool grad_mode = at::GradMode::is_enabled();
  const std::vector<c10::Argument>& arguments = op.schema().arguments();
  const auto values = torch::jit::last(*stack, arguments.size());
  for (std::size_t i = 0; i < arguments.size(); ++i) {
    if (!values[i].isTensor()) continue;
    const Tensor& tensor = values[i].toTensor();
    TORCH_CHECK(!grad_mode || !tensor.requires_grad(), arguments[i].name(),
                ": requires grad, but moe_re_routing_out (out=) has no autograd; call "
                "moe_re_routing for gradients, or this under torch.no_grad()");
    TORCH_CHECK_NOT_IMPLEMENTED(!has_tangent(tensor), arguments[i].name(),
                                ": has a forward-mode tangent, but moe_re_routing_out (out=) has "
                                "no derivative; call moe_re_routing for tangents");
    const c10::AliasInfo* alias = arguments[i].alias_info();
    TORCH_CHECK(alias == nullptr || !alias->isWrite() || !tensor.is_inference(),
                arguments[i].name(),
                ": is an inference tensor, which out= writes only under "
                "torch.inference_mode(); pass a clone");
  }
  const at::AutoDispatchBelowAutograd guard;
  op.callBoxed(stack);
}

// The out= op's ADInplaceOrView kernel: bumps the five outputs' version
// counters, as every in-place op does, so that autograd sees the writes.
void reroute_out_inplace(const Tensor& tokens, const Tensor& counts, const Tensor& permute_tokens,
                         const Tensor& permute_per_token_scales, const Tensor& permute_token_idx,
                         const Tensor& expert_token_num, const Tensor& permute_topk_weight,
                         const OptionalTensor& scales, const OptionalTensor& weight,
                         std::int64_t expert_token_num_type, std::int64_t idx_type,
                         OptionalName tokens_dtype, std::int64_t expert_alignment,
                         bool allow_spare_rows) {
  {
    const at::AutoDispatchBelowADInplaceOrView guard;
    out_op().call(tokens, counts, permute_tokens, permute_per_token_scales, permute_token_idx,
                  expert_token_num, permute_topk_weight, scales, weight, expert_token_num_type,
                  idx_type, tokens_dtype, expert_alignment, allow_spare_rows);
  }
  for (const Tensor* output : {&permute_tokens, &permute_per_token_scales, &permute_token_idx,
                               &expert_token_num, &permute_topk_weight}) {
    torch::autograd::impl::bump_version(*output);
  }
}

}  // namespace
}  // namespace moe_reroute::torch_ops

namespace ops = moe_reroute::torch_ops;

TORCH_LIBRARY_IMPL(moe_reroute, Autograd, m) {
  m.impl("moe_re_routing", &ops::reroute_autograd);
  m.impl("moe_init_routing",
         torch::CppFunction::makeFromBoxedFunction<
             &ops::routing_autograd<ops::InitRoutingBackward>>());
  m.impl("moe_finalize_routing",
         torch::CppFunction::makeFromBoxedFunction<
             &ops::routing_autograd<ops::FinalizeRoutingBackward>>());
  m.impl("moe_re_routing_inverse", &ops::inverse_autograd);
  m.impl("moe_re_routing_out",
         torch::CppFunction::makeFromBoxedFunction<&ops::reroute_out_autograd>());
}

TORCH_LIBRARY_IMPL(moe_reroute, ADInplaceOrView, m) {
  m.impl("moe_re_routing_out", &ops::reroute_out_inplace);
}
