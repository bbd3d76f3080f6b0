"""The PyTorch operators, defined with torch.library at import:

- ``moe_reroute::moe_re_routing`` (functional, autograd: the backward is the
  inverse reorder of the incoming gradients);
- ``moe_reroute::moe_re_routing_out`` (writes five caller-provided tensors,
  declared mutated; returns nothing; no autograd);
- ``moe_reroute::moe_re_routing_inverse`` (functional, autograd: the backward
  is the forward reorder). Absent optional outputs are empty (0,) float32
  tensors, the convention ``permute_topk_weight`` already follows.

Tensor arguments are positional-or-keyword (torch.library does not take
keyword-only tensors), with the names and defaults of SPEC section 7. The
kernels are registered on the dispatcher directly (not through
torch.library.custom_op, whose Python wrappers cost more than the kernel at
decode sizes); they hand the tensors' memory to the core as DLPack capsules
(inputs that are not contiguous are copied first). The fake kernels allocate
by SPEC section 4.
"""

from __future__ import annotations

import functools

import torch
import torch.utils.dlpack

from . import _bridge


class TorchFramework(_bridge.Framework):
    native = frozenset({"float16", "bfloat16", "float32", "int8", "uint8", "int32", "int64"})
    float32 = torch.float32
    int32 = torch.int32
    _unsigned = {1: torch.uint8, 2: torch.uint16}

    def dtype_name(self, dtype):
        return str(dtype).removeprefix("torch.")

    def unsigned_view(self, array):
        return array.view(self._unsigned[array.element_size()])

    contiguous = staticmethod(torch.Tensor.contiguous)

    # A capsule straight from C++: Tensor.__dlpack__ is Python and costs ~3 us a tensor.
    export = staticmethod(torch.utils.dlpack.to_dlpack)

    def empty(self, shape, dtype, like):
        return torch.empty(shape, dtype=dtype, device=like.device)

    empty_like = staticmethod(functools.partial(torch.empty_like,
                                                memory_format=torch.contiguous_format))


TORCH = TorchFramework()
Tensor = torch.Tensor

_REROUTE_ARGS = ("Tensor? per_token_scales=None, Tensor? expert_topk_weight=None, "
                 "int expert_token_num_type=1, int idx_type=0, str? tokens_dtype=None")
_SCHEMAS = {
    "moe_re_routing": f"(Tensor tokens, Tensor expert_token_num_per_rank, {_REROUTE_ARGS}) "
                      "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    "moe_re_routing_out": "(Tensor tokens, Tensor expert_token_num_per_rank, "
                          "Tensor(a!) permute_tokens, Tensor(b!) permute_per_token_scales, "
                          "Tensor(c!) permute_token_idx, Tensor(d!) expert_token_num, "
                          f"Tensor(e!) permute_topk_weight, {_REROUTE_ARGS}) -> ()",
    "moe_re_routing_inverse": "(Tensor tokens, Tensor expert_token_num_per_rank, "
                              "Tensor? per_token_scales=None, Tensor? expert_topk_weight=None, "
                              "str? tokens_dtype=None) -> (Tensor, Tensor, Tensor)",
}
_LIB = torch.library.Library("moe_reroute", "DEF")
for _name, _schema in _SCHEMAS.items():
    _LIB.define(_name + _schema, tags=(torch.Tag.pt2_compliant_tag,))
_FORWARD = torch.ops.moe_reroute.moe_re_routing.default
_OUT = torch.ops.moe_reroute.moe_re_routing_out.default
_INVERSE = torch.ops.moe_reroute.moe_re_routing_inverse.default
# Positions of the five outputs in the out= schema.
_OUT_SLICE = slice(2, 7)


def _reroute_kernel(tokens, expert_token_num_per_rank, per_token_scales=None,
                    expert_topk_weight=None, expert_token_num_type=1, idx_type=0,
                    tokens_dtype=None):
    inputs = _bridge.contiguous_inputs(TORCH, tokens, expert_token_num_per_rank,
                                       per_token_scales, expert_topk_weight)
    outputs = _bridge.allocate_reroute(TORCH, *inputs)
    _bridge.run_reroute(TORCH, *inputs, outputs, expert_token_num_type, idx_type, tokens_dtype)
    return outputs


def _reroute_out_kernel(tokens, expert_token_num_per_rank, permute_tokens,
                        permute_per_token_scales, permute_token_idx, expert_token_num,
                        permute_topk_weight, per_token_scales=None, expert_topk_weight=None,
                        expert_token_num_type=1, idx_type=0, tokens_dtype=None):
    inputs = _bridge.contiguous_inputs(TORCH, tokens, expert_token_num_per_rank,
                                       per_token_scales, expert_topk_weight)
    outputs = (permute_tokens, permute_per_token_scales, permute_token_idx, expert_token_num,
               permute_topk_weight)
    _bridge.run_reroute(TORCH, *inputs, outputs, expert_token_num_type, idx_type, tokens_dtype)


def _inverse_kernel(tokens, expert_token_num_per_rank, per_token_scales=None,
                    expert_topk_weight=None, tokens_dtype=None):
    inputs = _bridge.contiguous_inputs(TORCH, tokens, expert_token_num_per_rank,
                                       per_token_scales, expert_topk_weight)
    outputs = _bridge.allocate_inverse(TORCH, inputs[0], inputs[2], inputs[3])
    _bridge.run_inverse(TORCH, *inputs, outputs, tokens_dtype)
    return _with_empty_absent(tokens, outputs)


def _reroute_fake(tokens, expert_token_num_per_rank, per_token_scales=None,
                  expert_topk_weight=None, expert_token_num_type=1, idx_type=0,
                  tokens_dtype=None):
    return _bridge.allocate_reroute(TORCH, tokens, expert_token_num_per_rank, per_token_scales,
                                    expert_topk_weight)


def _reroute_out_fake(tokens, expert_token_num_per_rank, *outputs_and_attributes):
    # Writes only the caller's tensors, so there is nothing to allocate; the
    # core checks their specs when the kernel runs.
    return None


def _inverse_fake(tokens, expert_token_num_per_rank, per_token_scales=None,
                  expert_topk_weight=None, tokens_dtype=None):
    return _with_empty_absent(
        tokens, _bridge.allocate_inverse(TORCH, tokens, per_token_scales, expert_topk_weight))


def _with_empty_absent(tokens: Tensor, outputs: tuple) -> tuple:
    return tuple(torch.empty((0,), dtype=torch.float32, device=tokens.device)
                 if output is None else output for output in outputs)


def _out_inplace_or_view(keyset, *args):
    """Bumps the version counters of the five outputs, as every in-place op does."""
    torch.autograd.graph.increment_version(args[_OUT_SLICE])
    with torch._C._AutoDispatchBelowADInplaceOrView():
        return _OUT.redispatch(keyset & torch._C._after_ADInplaceOrView_keyset, *args)


def _setup(ctx, inputs, output):
    ctx.has_scales = inputs[2] is not None
    ctx.has_weight = inputs[3] is not None
    ctx.tokens_dtype = inputs[-1]
    ctx.save_for_backward(inputs[1])


def _saved_gradients(ctx, grad_tokens, grad_scales, grad_weight):
    """The counts and the gradients to reorder (None for an absent optional input)."""
    (counts,) = ctx.saved_tensors
    return (grad_tokens.contiguous(), counts,
            grad_scales.contiguous() if ctx.has_scales else None,
            grad_weight.contiguous() if ctx.has_weight else None)


def _reroute_backward(ctx, grad_tokens, grad_scales, grad_idx, grad_num, grad_weight):
    grads = _saved_gradients(ctx, grad_tokens, grad_scales, grad_weight)
    restored = _INVERSE(*grads, ctx.tokens_dtype)
    return (restored[0], None, restored[1] if ctx.has_scales else None,
            restored[2] if ctx.has_weight else None, None, None, None)


def _inverse_backward(ctx, grad_tokens, grad_scales, grad_weight):
    grads = _saved_gradients(ctx, grad_tokens, grad_scales, grad_weight)
    permuted = _FORWARD(*grads, 1, 0, ctx.tokens_dtype)
    return (permuted[0], None, permuted[1] if ctx.has_scales else None,
            permuted[4] if ctx.has_weight else None, None)


for _name, _kernel, _fake in (("moe_re_routing", _reroute_kernel, _reroute_fake),
                              ("moe_re_routing_out", _reroute_out_kernel, _reroute_out_fake),
                              ("moe_re_routing_inverse", _inverse_kernel, _inverse_fake)):
    _LIB.impl(_name, _kernel, "CPU")
    torch.library.register_fake(f"moe_reroute::{_name}", _fake, lib=_LIB)
torch.library.register_autograd("moe_reroute::moe_re_routing", _reroute_backward,
                                setup_context=_setup, lib=_LIB)
torch.library.register_autograd("moe_reroute::moe_re_routing_inverse", _inverse_backward,
                                setup_context=_setup, lib=_LIB)
_LIB.impl("moe_re_routing_out", torch.library.fallthrough_kernel, "Autograd")
_LIB.impl("moe_re_routing_out", _out_inplace_or_view, "ADInplaceOrView", with_keyset=True)


def _call(op, args, differentiable):
    """`op(*args)` from eager code. Where no gradient is needed it enters the
    dispatcher below the autograd layer, which is what the autograd kernel's
    no-grad branch does, without its Python; traced code (torch.compile,
    export) always sees the plain call."""
    if torch.compiler.is_compiling() or (torch.is_grad_enabled()
                                         and torch._C._any_requires_grad(*differentiable)):
        return op(*args)
    with torch._C._AutoDispatchBelowADInplaceOrView():
        return op(*args)


def reroute(tokens, expert_token_num_per_rank, per_token_scales, expert_topk_weight,
            expert_token_num_type, idx_type, tokens_dtype) -> tuple:
    """The functional forward operator (the eager entry of moe_reroute.moe_re_routing)."""
    return _call(_FORWARD, (tokens, expert_token_num_per_rank, per_token_scales,
                            expert_topk_weight, expert_token_num_type, idx_type, tokens_dtype),
                 (tokens, per_token_scales, expert_topk_weight))


def reroute_out(tokens, expert_token_num_per_rank, *outputs_and_attributes) -> None:
    """The out= operator: (tokens, counts, five outputs, scales, weight, attributes)."""
    _OUT(tokens, expert_token_num_per_rank, *outputs_and_attributes)


def inverse(tokens, expert_token_num_per_rank, per_token_scales, expert_topk_weight,
            tokens_dtype) -> tuple:
    """The functional inverse operator (the eager entry of moe_re_routing_inverse)."""
    return _call(_INVERSE, (tokens, expert_token_num_per_rank, per_token_scales,
                            expert_topk_weight, tokens_dtype),
                 (tokens, per_token_scales, expert_topk_weight))
