"""The PyTorch custom operators, registered with torch.library at import:

- ``moe_reroute::moe_re_routing`` (functional, autograd: the backward is the
  inverse reorder of the incoming gradients);
- ``moe_reroute::moe_re_routing_out`` (writes five caller-provided tensors,
  declared mutated; returns nothing);
- ``moe_reroute::moe_re_routing_inverse`` (functional, autograd: the backward
  is the forward reorder). Absent optional outputs are empty (0,) float32
  tensors, the convention ``permute_topk_weight`` already follows.

Tensor arguments are positional-or-keyword (torch.library does not take
keyword-only tensors), with the names and defaults of SPEC section 7. The CPU
kernels hand the tensors' memory to the core through DLPack (inputs that are
not contiguous are copied first); the fake kernels allocate by SPEC section 4.
"""

from __future__ import annotations

from typing import Optional

import torch

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

    def contiguous(self, array):
        return array.contiguous()

    def plain(self, array):
        return array.detach() if array.requires_grad else array

    def empty(self, shape, dtype, like):
        return torch.empty(shape, dtype=dtype, device=like.device)


TORCH = TorchFramework()
Tensor = torch.Tensor

_REROUTE_ARGS = ("Tensor? per_token_scales=None, Tensor? expert_topk_weight=None, "
                 "int expert_token_num_type=1, int idx_type=0, str? tokens_dtype=None")
_OUT_ARGS = ("permute_tokens", "permute_per_token_scales", "permute_token_idx",
             "expert_token_num", "permute_topk_weight")


@torch.library.custom_op(
    "moe_reroute::moe_re_routing", mutates_args=(), device_types="cpu",
    schema=f"(Tensor tokens, Tensor expert_token_num_per_rank, {_REROUTE_ARGS}) "
           "-> (Tensor, Tensor, Tensor, Tensor, Tensor)")
def reroute(tokens: Tensor, expert_token_num_per_rank: Tensor,
            per_token_scales: Optional[Tensor] = None, expert_topk_weight: Optional[Tensor] = None,
            expert_token_num_type: int = 1, idx_type: int = 0,
            tokens_dtype: Optional[str] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    inputs = _bridge.contiguous_inputs(TORCH, tokens, expert_token_num_per_rank,
                                       per_token_scales, expert_topk_weight)
    outputs = _bridge.allocate_reroute(TORCH, *inputs)
    _bridge.run_reroute(TORCH, *inputs, outputs, expert_token_num_type, idx_type, tokens_dtype)
    return outputs


@reroute.register_fake
def _(tokens, expert_token_num_per_rank, per_token_scales=None, expert_topk_weight=None,
      expert_token_num_type=1, idx_type=0, tokens_dtype=None):
    return _bridge.allocate_reroute(TORCH, tokens, expert_token_num_per_rank, per_token_scales,
                                    expert_topk_weight)


@torch.library.custom_op(
    "moe_reroute::moe_re_routing_out", mutates_args=_OUT_ARGS, device_types="cpu",
    schema="(Tensor tokens, Tensor expert_token_num_per_rank, Tensor(a!) permute_tokens, "
           "Tensor(b!) permute_per_token_scales, Tensor(c!) permute_token_idx, "
           f"Tensor(d!) expert_token_num, Tensor(e!) permute_topk_weight, {_REROUTE_ARGS}) -> ()")
def reroute_out(tokens: Tensor, expert_token_num_per_rank: Tensor, permute_tokens: Tensor,
                permute_per_token_scales: Tensor, permute_token_idx: Tensor,
                expert_token_num: Tensor, permute_topk_weight: Tensor,
                per_token_scales: Optional[Tensor] = None,
                expert_topk_weight: Optional[Tensor] = None, expert_token_num_type: int = 1,
                idx_type: int = 0, tokens_dtype: Optional[str] = None) -> None:
    inputs = _bridge.contiguous_inputs(TORCH, tokens, expert_token_num_per_rank,
                                       per_token_scales, expert_topk_weight)
    outputs = (permute_tokens, permute_per_token_scales, permute_token_idx, expert_token_num,
               permute_topk_weight)
    _bridge.run_reroute(TORCH, *inputs, outputs, expert_token_num_type, idx_type, tokens_dtype)


@reroute_out.register_fake
def _(tokens, expert_token_num_per_rank, *outputs_and_attributes, **kwargs):
    # Writes only the caller's tensors, so there is nothing to allocate; the
    # core checks their specs when the kernel runs.
    return None


@torch.library.custom_op(
    "moe_reroute::moe_re_routing_inverse", mutates_args=(), device_types="cpu",
    schema="(Tensor tokens, Tensor expert_token_num_per_rank, Tensor? per_token_scales=None, "
           "Tensor? expert_topk_weight=None, str? tokens_dtype=None) -> (Tensor, Tensor, Tensor)")
def inverse(tokens: Tensor, expert_token_num_per_rank: Tensor,
            per_token_scales: Optional[Tensor] = None, expert_topk_weight: Optional[Tensor] = None,
            tokens_dtype: Optional[str] = None) -> tuple[Tensor, Tensor, Tensor]:
    inputs = _bridge.contiguous_inputs(TORCH, tokens, expert_token_num_per_rank,
                                       per_token_scales, expert_topk_weight)
    outputs = _bridge.allocate_inverse(TORCH, inputs[0], inputs[2], inputs[3])
    _bridge.run_inverse(TORCH, *inputs, outputs, tokens_dtype)
    return _with_empty_absent(tokens, outputs)


@inverse.register_fake
def _(tokens, expert_token_num_per_rank, per_token_scales=None, expert_topk_weight=None,
      tokens_dtype=None):
    return _with_empty_absent(
        tokens, _bridge.allocate_inverse(TORCH, tokens, per_token_scales, expert_topk_weight))


def _with_empty_absent(tokens: Tensor, outputs: tuple) -> tuple:
    return tuple(torch.empty((0,), dtype=torch.float32, device=tokens.device)
                 if output is None else output for output in outputs)


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
    restored = inverse(*grads, ctx.tokens_dtype)
    return (restored[0], None, restored[1] if ctx.has_scales else None,
            restored[2] if ctx.has_weight else None, None, None, None)


def _inverse_backward(ctx, grad_tokens, grad_scales, grad_weight):
    grads = _saved_gradients(ctx, grad_tokens, grad_scales, grad_weight)
    permuted = reroute(*grads, 1, 0, ctx.tokens_dtype)
    return (permuted[0], None, permuted[1] if ctx.has_scales else None,
            permuted[4] if ctx.has_weight else None, None)


reroute.register_autograd(_reroute_backward, setup_context=_setup)
inverse.register_autograd(_inverse_backward, setup_context=_setup)
