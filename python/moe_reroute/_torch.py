"""The torch operators, defined and implemented in C++ (_torch_ops.so, imported
here): ``torch.ops.moe_reroute.moe_re_routing``, ``moe_re_routing_out`` and
``moe_re_routing_inverse``, with CPU, CUDA and autograd kernels that run no
Python. What this module adds is how the public functions call them (FORWARD,
FORWARD_OUT, INVERSE: in eager mode through the module's C++ entry points,
which skip torch.ops' Python layer) and the fake kernels (FakeTensorMode,
torch.compile, torch.export): the core's infer_reroute / infer_inverse run on
the size hints decide every error and every output spec, and the output row
counts are made symbolic from what the core returns (docs/torch.md)."""

from __future__ import annotations

import torch
from torch.overrides import has_torch_function

from . import _bridge, _core, _torch_ops  # importing _torch_ops registers the operators

# A symbolic size's hint, without adding a guard (renamed in torch 2.15).
try:
    from torch.fx.experimental.symbolic_shapes import hint_int as _size_hint
except ImportError:
    from torch.fx.experimental.symbolic_shapes import guarding_hint_or_throw as _size_hint

OPS = torch.ops.moe_reroute


def _eager(op, entry, tracing=torch.compiler.is_dynamo_compiling):
    """A function calling the operator overload `op` on its arguments. Eager,
    it calls `entry`, the C++ entry point of `op`, which calls it through the
    dispatcher without torch.ops' Python layer (NotImplemented where an
    argument is not plainly of the schema's type). Where Dynamo traces
    (torch.compile, strict torch.export), and where a tensor subclass or a mode
    has a __torch_function__, it calls `op` itself, which they trace or
    override. Tracing below Python (make_fx, non-strict export, FakeTensorMode)
    sees the same dispatcher call either way."""
    def call(*args):
        if not (tracing() or has_torch_function(args)):
            result = entry(*args)
            if result is not NotImplemented:
                return result
        return op(*args)
    return call


FORWARD = _eager(OPS.moe_re_routing.default, _torch_ops.forward)
FORWARD_OUT = _eager(OPS.moe_re_routing_out.default, _torch_ops.forward_out)
INVERSE = _eager(OPS.moe_re_routing_inverse.default, _torch_ops.inverse)


def _hint(size) -> int:
    return _size_hint(size) if isinstance(size, torch.SymInt) else int(size)


def _describe(tensor, name: str, rows: int = 0, experts: int = 0, output: bool = False):
    """A tensor for the core module, by its size hints and device; `rows` and
    `experts` are added to its row dim (and, for the counts, to E) to probe
    the rules. Only an output must be contiguous: the kernel copies inputs."""
    if tensor is None:
        return None
    shape = [_hint(size) for size in tensor.shape]
    if name == "expert_token_num_per_rank":
        if len(shape) > 1:
            shape[1] += experts
    elif shape:
        shape[0] += rows
    return (name, str(tensor.dtype).removeprefix("torch."), 8 * tensor.element_size(), shape,
            None, str(tensor.device), tensor.is_contiguous() if output else True)


def _infer(infer, tensors, rows=0, experts=0, **kwargs) -> list:
    described = [_describe(t, n, rows, experts)
                 for t, n in zip(tensors, _bridge.INPUT_NAMES)]
    return infer(described, **kwargs)


def _fake(infer, tensors, **kwargs) -> tuple:
    """Fake outputs: the core decides (raising eager's error) on the size
    hints; each output's row count is then rebuilt from the symbolic A (tokens'
    rows) and E (the counts' dim 1): the core is probed at A + 1 and E + 1
    where they are symbolic, the rules being affine in A and E. Each output is
    stored like the input the core names for it (its dtype, its trailing dims),
    or as its spec, as the C++ kernel allocates it."""
    specs = _infer(infer, tensors, **kwargs)
    tokens, counts = tensors[0], tensors[1]
    terms = []
    for size, key in ((tokens.shape[0], "rows"),
                      (counts.shape[1] if counts.dim() > 1 else 0, "experts")):
        if isinstance(size, torch.SymInt):
            probed = _infer(infer, tensors, **{key: 1}, **kwargs)
            terms.append((size, _hint(size), [p[1][0] - s[1][0] if s[1] else 0
                                              for p, s in zip(probed, specs)]))
    outputs = []
    for i, (dtype_name, shape, stored_like) in enumerate(specs):
        rows = shape[0] if shape else None
        for size, hint, slopes in terms:
            if rows is not None and slopes[i]:
                rows = rows + slopes[i] * (size - hint)
        source = tensors[stored_like] if stored_like is not None else None
        if source is not None:
            outputs.append(source.new_empty([rows, *source.shape[1:]]))
        else:
            dtype = getattr(torch, _bridge.row(dtype_name)["torch_name"])
            outputs.append(tokens.new_empty([rows, *shape[1:]] if shape else [], dtype=dtype))
    return tuple(outputs)


@torch.library.register_fake("moe_reroute::moe_re_routing")
def _reroute_fake(tokens, expert_token_num_per_rank, per_token_scales=None,
                  expert_topk_weight=None, expert_token_num_type=1, idx_type=0,
                  tokens_dtype=None, expert_alignment=1, allow_spare_rows=False):
    return _fake(_core.infer_reroute,
                 (tokens, expert_token_num_per_rank, per_token_scales, expert_topk_weight),
                 tokens_dtype=tokens_dtype,
                 **_bridge.attributes(expert_token_num_type, idx_type, expert_alignment,
                                      allow_spare_rows))


@torch.library.register_fake("moe_reroute::moe_re_routing_out")
def _reroute_out_fake(tokens, expert_token_num_per_rank, permute_tokens,
                      permute_per_token_scales, permute_token_idx, expert_token_num,
                      permute_topk_weight, per_token_scales=None, expert_topk_weight=None,
                      expert_token_num_type=1, idx_type=0, tokens_dtype=None,
                      expert_alignment=1, allow_spare_rows=False):
    # Every argument is checked as the kernel checks it before reading data.
    inputs = (tokens, expert_token_num_per_rank, per_token_scales, expert_topk_weight)
    outputs = (permute_tokens, permute_per_token_scales, permute_token_idx, expert_token_num,
               permute_topk_weight)
    _core.check_reroute_out(
        [_describe(t, n) for t, n in zip(inputs, _bridge.INPUT_NAMES)],
        [_describe(t, n, output=True) for t, n in zip(outputs, _core.FORWARD_OUTPUT_NAMES)],
        tokens_dtype=tokens_dtype,
        **_bridge.attributes(expert_token_num_type, idx_type, expert_alignment,
                             allow_spare_rows))


@torch.library.register_fake("moe_reroute::moe_re_routing_inverse")
def _inverse_fake(tokens, expert_token_num_per_rank, per_token_scales=None,
                  expert_topk_weight=None, tokens_dtype=None, expert_alignment=1,
                  allow_spare_rows=False):
    return _fake(_core.infer_inverse,
                 (tokens, expert_token_num_per_rank, per_token_scales, expert_topk_weight),
                 tokens_dtype=tokens_dtype,
                 **_bridge.inverse_attributes(expert_alignment, allow_spare_rows))
