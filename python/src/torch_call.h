#pragma once

// One kernel call's tensors as core views, and its fresh outputs (torch_call.cc).

#include <c10/core/Device.h>

#include <array>
#include <cstddef>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "adapter.h"
#include "torch_ops.h"

namespace moe_reroute::torch_ops {

/// The core view of `tensor` (argument `arg`) on `device`, read as `logical`
/// (argument `logical_arg`) when named. Throws Error naming the argument.
TensorView view(const Tensor& tensor, const char* arg, const std::optional<std::string>& logical,
                const char* logical_arg, const c10::Device& device);

/// An output with `spec`'s rows stored like `input`, or, without an input,
/// with `spec` itself in its torch dtype.
Tensor allocate(const TensorSpec& spec, const Tensor* input, const c10::Device& device);

// One call's inputs, contiguous (copied where they are not), and their views.
struct Call {
  c10::Device device;
  std::vector<ByteSpan> copied;  // the caller's memory of the copied inputs
  Tensor tokens;
  Tensor counts;
  OptionalTensor scales;
  OptionalTensor weight;
  std::optional<std::string> tokens_dtype;
  std::optional<std::string> scales_dtype;

  Call(const Tensor& tokens_in, const Tensor& counts_in, const OptionalTensor& scales_in,
       const OptionalTensor& weight_in, const OptionalName& tokens_name);

  template <typename Inputs>
  Inputs inputs() const {
    Inputs inputs{view(tokens, "tokens", tokens_dtype, "tokens_dtype", device),
                  view(counts, "expert_token_num_per_rank", std::nullopt, "", device)};
    if (scales) {
      inputs.per_token_scales =
          view(*scales, "per_token_scales", scales_dtype, "per_token_scales", device);
    }
    if (weight) inputs.expert_topk_weight = view(*weight, "expert_topk_weight", std::nullopt, "", device);
    return inputs;
  }

  TensorView output(const Tensor& tensor, const char* arg, const std::optional<std::string>& logical) const {
    return view(tensor, arg, logical, arg, device);
  }
  TensorView output(const Tensor& tensor, const char* arg) const {
    return view(tensor, arg, std::nullopt, arg, device);
  }
  // The dtype name the scales outputs are read as: the scales' own, or none.
  std::optional<std::string> out_scales_dtype() const { return scales ? scales_dtype : std::nullopt; }

  // Fresh outputs for `specs` on the call's device, each stored as `op`'s
  // description says.
  template <typename Outputs, std::size_t N>
  Outputs allocate_outputs(const std::array<TensorSpec, N>& specs, const OperatorDesc& op) const {
    const Tensor* inputs[] = {&tokens, &counts, scales ? &*scales : nullptr,
                              weight ? &*weight : nullptr};
    std::array<Tensor, N> tensors;
    for (std::size_t i = 0; i < N; ++i) {
      const int like = op.outputs[i].stored_like;
      tensors[i] = allocate(specs[i], like == kOwnSpec ? nullptr : inputs[like], device);
    }
    return std::apply([](auto&... each) { return Outputs{std::move(each)...}; }, tensors);
  }
};

}  // namespace moe_reroute::torch_ops
