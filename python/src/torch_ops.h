#pragma once

// What the torch glue's files share: the operators' C++ types and handles, the error translation.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

#include "moe_reroute/moe_reroute.h"

namespace moe_reroute::torch_ops {

using at::Tensor;
using OptionalTensor = std::optional<Tensor>;
using OptionalName = std::optional<c10::string_view>;
using Forward = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;
using Inverse = std::tuple<Tensor, Tensor, Tensor>;

// The kernels' C++ signatures, as the schemas (torch_ops.cc) give them.
using RerouteKernel = Forward(const Tensor& tokens, const Tensor& counts,
                              const OptionalTensor& scales, const OptionalTensor& weight,
                              std::int64_t expert_token_num_type, std::int64_t idx_type,
                              OptionalName tokens_dtype, std::int64_t expert_alignment,
                              bool allow_spare_rows);
using RerouteOutKernel = void(const Tensor& tokens, const Tensor& counts,
                              const Tensor& permute_tokens, const Tensor& permute_per_token_scales,
                              const Tensor& permute_token_idx, const Tensor& expert_token_num,
                              const Tensor& permute_topk_weight, const OptionalTensor& scales,
                              const OptionalTensor& weight, std::int64_t expert_token_num_type,
                              std::int64_t idx_type, OptionalName tokens_dtype,
                              std::int64_t expert_alignment, bool allow_spare_rows);
using InverseKernel = Inverse(const Tensor& tokens, const Tensor& counts,
                              const OptionalTensor& scales, const OptionalTensor& weight,
                              OptionalName tokens_dtype, std::int64_t expert_alignment,
                              bool allow_spare_rows);

using FinalizeRoutingKernel = Tensor(const Tensor& expanded_x, const Tensor& expanded_row_idx,
                                     const OptionalTensor& x1, const OptionalTensor& x2,
                                     const OptionalTensor& bias, const OptionalTensor& scales,
                                     const OptionalTensor& expert_idx, std::int64_t drop_pad_mode);

/// The operators moe_re_routing, moe_re_routing_out, moe_re_routing_inverse
/// and moe_finalize_routing, for calls through the dispatcher (every dispatch
/// key, as torch.ops calls).
c10::TypedOperatorHandle<RerouteKernel> forward_op();
c10::TypedOperatorHandle<RerouteOutKernel> out_op();
c10::TypedOperatorHandle<InverseKernel> inverse_op();
c10::TypedOperatorHandle<FinalizeRoutingKernel> finalize_routing_op();

/// Throws `error` as Python's exception by its kind: TypeError, ValueError,
/// RuntimeError.
[[noreturn]] void raise(const Error& error);

/// `body()`, a library Error it throws raised as Python's exception.
template <typename Body>
auto translated(Body body) {
  try {
    return body();
  } catch (const Error& error) {
    raise(error);
  }
}

/// The attributes the schemas take as positional arguments, as one value;
/// the one place the torch glue unpacks or packs them.
inline Attributes attributes_of(std::int64_t expert_token_num_type, std::int64_t idx_type,
                                std::int64_t expert_alignment, bool allow_spare_rows) {
  return {expert_token_num_type, idx_type, expert_alignment, allow_spare_rows};
}
/// `attributes` and `tokens_dtype` as the arguments after the tensors of the
/// forward's and the inverse's schemas.
inline auto reroute_arguments(const Attributes& a, OptionalName tokens_dtype) {
  return std::tuple(a.expert_token_num_type, a.idx_type, tokens_dtype, a.expert_alignment,
                    a.allow_spare_rows);
}
inline auto inverse_arguments(const Attributes& a, OptionalName tokens_dtype) {
  return std::tuple(tokens_dtype, a.expert_alignment, a.allow_spare_rows);
}
/// Whether the forward pads each expert's segment (docs/spec.md section 9).
inline bool pads(const Attributes& a) { return a.expert_alignment > 1; }

/// The attributes of the routing operator `op` from a call's schema values
/// (its inputs, then its attributes, in description order): the one place
/// the torch glue reads them.
template <typename A>
A routing_attributes(const OperatorDescOf<A>& op, c10::ArrayRef<c10::IValue> values) {
  A attributes;
  for (std::size_t i = 0; i < op.attributes.size(); ++i) {
    const AttributeDescOf<A>& attribute = op.attributes[i];
    const c10::IValue& value = values[op.inputs.size() + i];
    attribute.set(attributes,
                  attribute.kind == AttributeKind::kBool ? value.toBool() : value.toInt());
  }
  return attributes;
}

inline std::optional<std::string> name_of(const OptionalName& name) {
  if (!name) return std::nullopt;
  return std::string(*name);
}

}  // namespace moe_reroute::torch_ops
