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

CUDA tensors go to the CUDA backend when the module has it (``_core.has_cuda``):
on the current stream of tokens' device, with a per-call scratch tensor (the
status word and the workspace) from the caching allocator, so that the call
is graph-capturable. The counts live on the device, so a bad count is reported
in the status word, which ``set_cuda_status_check`` says what to do with.
"""

from __future__ import annotations

import functools

import torch
import torch.utils.dlpack

from . import _bridge, _core


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

STATUS_CHECKS = ("raise", "assert", "off")
_status_check = "raise"


def set_cuda_status_check(mode: str) -> str:
    """Sets what a CUDA call does with its status word; returns the previous mode.

    "raise" (the default): read it after the call (one host synchronisation)
    and raise ValueError naming the argument when the counts were bad; under
    CUDA graph capture or torch.compile tracing, where no host sync is allowed,
    "assert" instead. "assert": torch._assert_async, no host sync; a bad count
    is then a device-side assert, which leaves the CUDA context unusable.
    "off": no check; with bad counts the outputs are unspecified.
    """
    global _status_check
    if mode not in STATUS_CHECKS:
        raise ValueError(f"mode: must be one of {', '.join(STATUS_CHECKS)}; got {mode!r}")
    previous, _status_check = _status_check, mode
    return previous


def status_action(mode: str, capturing: bool, compiling: bool) -> str:
    """What a CUDA call does with its status word under `mode`: "raise",
    "assert" or "off"."""
    return "assert" if mode == "raise" and (capturing or compiling) else mode


def _check_status(status: Tensor) -> None:
    """Acts on the status word (a one-element int32 CUDA tensor) of the call just enqueued."""
    action = status_action(_status_check, torch.cuda.is_current_stream_capturing(),
                           torch.compiler.is_compiling())
    if action == "assert":
        torch._assert_async(status == 0, "moe_reroute: expert_token_num_per_rank: some count "
                                         "is negative or the counts do not sum to A")
    elif action == "raise":
        value = int(status.item())
        if value:
            raise ValueError(_core.cuda_status_message(value))


def backend(is_cuda: bool) -> str:
    """The backend a call runs, by whether tokens is a CUDA tensor: "cuda"
    where the module has it, else "cpu" (whose core module then names any
    tensor on another device)."""
    return "cuda" if is_cuda and _core.has_cuda else "cpu"


def _run(cpu, cuda_name: str, tokens: Tensor, counts: Tensor, args: tuple) -> None:
    """Runs `args` (the core module's arguments) on tokens' backend: `cpu`, or
    the module's `cuda_name` on the current stream with a fresh scratch tensor."""
    if backend(tokens.is_cuda) == "cpu":
        cpu(*args)
        return
    with torch.cuda.device(tokens.device):
        scratch_bytes = _core.cuda_scratch_bytes(_bridge.dim(counts, 0), _bridge.dim(counts, 1))
        scratch = torch.empty(scratch_bytes // 4, dtype=torch.int32, device=tokens.device)
        getattr(_core, cuda_name)(*args, torch.cuda.current_stream().cuda_stream,
                                  TORCH.export(scratch))
        _check_status(scratch[0])


def _reroute_kernel(tokens, expert_token_num_per_rank, per_token_scales=None,
                    expert_topk_weight=None, expert_token_num_type=1, idx_type=0,
                    tokens_dtype=None):
    inputs = _bridge.contiguous_inputs(TORCH, tokens, expert_token_num_per_rank,
                                       per_token_scales, expert_topk_weight)
    outputs = _bridge.allocate_reroute(TORCH, *inputs)
    _run(_core.reroute, "reroute_cuda", inputs[0], inputs[1],
         _bridge.reroute_args(TORCH, *inputs, outputs, expert_token_num_type, idx_type,
                              tokens_dtype))
    return outputs


def _reroute_out_kernel(tokens, expert_token_num_per_rank, permute_tokens,
                        permute_per_token_scales, permute_token_idx, expert_token_num,
                        permute_topk_weight, per_token_scales=None, expert_topk_weight=None,
                        expert_token_num_type=1, idx_type=0, tokens_dtype=None):
    inputs = _bridge.contiguous_inputs(TORCH, tokens, expert_token_num_per_rank,
                                       per_token_scales, expert_topk_weight)
    outputs = (permute_tokens, permute_per_token_scales, permute_token_idx, expert_token_num,
               permute_topk_weight)
    _run(_core.reroute, "reroute_cuda", inputs[0], inputs[1],
         _bridge.reroute_args(TORCH, *inputs, outputs, expert_token_num_type, idx_type,
                              tokens_dtype))


def _inverse_kernel(tokens, expert_token_num_per_rank, per_token_scales=None,
                    expert_topk_weight=None, tokens_dtype=None):
    inputs = _bridge.contiguous_inputs(TORCH, tokens, expert_token_num_per_rank,
                                       per_token_scales, expert_topk_weight)
    outputs = _bridge.allocate_inverse(TORCH, inputs[0], inputs[2], inputs[3])
    _run(_core.inverse, "inverse_cuda", inputs[0], inputs[1],
         _bridge.inverse_args(TORCH, *inputs, outputs, tokens_dtype))
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
    _LIB.impl(_name, _kernel, "CUDA")
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
