"""The torch operators, defined and implemented in C++ (_torch_ops.so, imported
here): ``torch.ops.moe_reroute.moe_re_routing``, ``moe_re_routing_out``,
``moe_re_routing_inverse``, ``moe_init_routing`` and ``moe_finalize_routing``,
with CPU, CUDA and autograd kernels that run no Python. What this module adds
is how the public functions call them (FORWARD, FORWARD_OUT, INVERSE: in eager
mode through the module's C++ entry points, which skip torch.ops' Python
layer) and the fake kernels (FakeTensorMode, torch.compile, torch.export): the
core's shape rules (infer_*) run on the size hints decide every error and
every output spec, and give each output's rows (the routing operators': each
dim) as a formula in the inputs' sizes; and the vmap rules, which lay out a
batch that shares its counts once (docs/torch.md)."""

from __future__ import annotations

import math

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


def _describe(tensor, name: str, output: bool = False):
    """A tensor for the core module, by its size hints and device. Only an
    output must be contiguous: the kernel copies inputs."""
    if tensor is None:
        return None
    return _core.Argument(name, str(tensor.dtype).removeprefix("torch."),
                          8 * tensor.element_size(), [_hint(size) for size in tensor.shape],
                          str(tensor.device), tensor.is_contiguous() if output else True)


def _attributes(op: str, values) -> tuple:
    """(the core's Attributes, tokens_dtype) of `op`'s attribute `values` as
    the dispatcher passes them: positional, in schema order, those left at
    their defaults at the end left out."""
    defaults = [default for _, _, default in _bridge.OPERATORS[op]["attributes"]]
    return _bridge.attributes(op, (*values, *defaults[len(values):]))


def _infer(infer, tensors, attributes) -> list:
    return infer([_describe(t, n) for t, n in zip(tensors, _bridge.INPUT_NAMES)], *attributes)


def _fake(infer, tensors, attributes) -> tuple:
    """Fake outputs: the core decides on the size hints (raising eager's
    error) and gives each output's rows as a formula in the tokens' rows and
    E, which are evaluated on the (possibly symbolic) sizes. Each output is
    stored like the input the core names for it (its dtype, its trailing
    dims), or as its spec, as the C++ kernel allocates it."""
    tokens, counts = tensors[0], tensors[1]
    outputs = []
    for spec in _infer(infer, tensors, attributes):
        rows = (spec.rows_per_input_row * tokens.shape[0]
                + spec.rows_per_expert * counts.shape[1]) if spec.shape else None
        source = tensors[spec.stored_like] if spec.stored_like is not None else None
        if source is not None:
            outputs.append(source.new_empty([rows, *source.shape[1:]]))
        else:
            dtype = getattr(torch, _bridge.row(spec.dtype)["torch_name"])
            outputs.append(tokens.new_empty([rows, *spec.shape[1:]] if spec.shape else [],
                                            dtype=dtype))
    return tuple(outputs)


def _fake_kernel(name, infer):
    """The fake kernel of the operator `name`, whose shape rules are `infer`."""
    def kernel(tokens, expert_token_num_per_rank, per_token_scales=None, expert_topk_weight=None,
               *attributes):
        return _fake(infer, (tokens, expert_token_num_per_rank, per_token_scales,
                             expert_topk_weight), _attributes(name, attributes))
    return kernel


for _name, _infer_op in ((_bridge.REROUTE, _core.infer_reroute),
                         (_bridge.INVERSE, _core.infer_inverse)):
    torch.library.register_fake(f"moe_reroute::{_name}", _fake_kernel(_name, _infer_op))


def _dim(formula, tensors):
    """An output dim from the core's formula (output_dims) on the inputs'
    possibly symbolic sizes: the sum of the terms, each its coefficient times
    the product of its input dims, then at most at_most where that is >= 0."""
    terms, at_most = formula
    value = sum(coefficient * math.prod((tensors[i].shape[d] for i, d in factors), start=1)
                for coefficient, factors in terms)
    return value if at_most < 0 else torch.sym_min(value, at_most)


def _routing_fake_kernel(name, infer):
    """The fake kernel of the routing operator `name`, whose shape rules are
    `infer`: the core decides on the size hints (raising eager's error), and
    each output dim is its formula evaluated on the sizes, each output stored
    like the input the description names for it (its dtype) or in its spec's
    dtype, as the C++ kernel allocates it."""
    inputs = [input_name for input_name, _ in _bridge.OPERATORS[name]["inputs"]]

    def kernel(*args):
        # The dispatcher leaves out trailing defaults.
        tensors = (*args[:len(inputs)], *[None] * (len(inputs) - len(args)))
        attributes, _ = _attributes(name, args[len(inputs):])
        outputs = []
        for spec in infer([_describe(t, n) for t, n in zip(tensors, inputs)], attributes):
            source = tensors[spec.stored_like] if spec.stored_like is not None else None
            dtype = (source.dtype if source is not None
                     else getattr(torch, _bridge.row(spec.dtype)["torch_name"]))
            outputs.append(tensors[0].new_empty([_dim(f, tensors) for f in spec.dims],
                                                dtype=dtype))
        return outputs[0] if len(outputs) == 1 else tuple(outputs)
    return kernel


for _name, _infer_op in ((_bridge.INIT_ROUTING, _core.infer_init_routing),
                         (_bridge.FINALIZE_ROUTING, _core.infer_finalize_routing)):
    torch.library.register_fake(f"moe_reroute::{_name}", _routing_fake_kernel(_name, _infer_op))


@torch.library.register_fake("moe_reroute::moe_re_routing_out")
def _reroute_out_fake(tokens, expert_token_num_per_rank, *outputs_and_rest):
    # Every argument is checked as the kernel checks it before reading data.
    outputs, rest = outputs_and_rest[:5], outputs_and_rest[5:]
    scales, weight = (*rest[:2], None, None)[:2]  # the dispatcher leaves out trailing defaults
    inputs = (tokens, expert_token_num_per_rank, scales, weight)
    names = _bridge.OUTPUT_NAMES[_bridge.REROUTE]
    _core.check_reroute_out(
        [_describe(t, n) for t, n in zip(inputs, _bridge.INPUT_NAMES)],
        [_describe(t, n, output=True) for t, n in zip(outputs, names)],
        *_attributes(_bridge.REROUTE, rest[2:]))
    # Fake tensors alias as the traced ones do: refuse overlap here, as the kernel
    # would, since a functionalized graph hands the kernel copies of the outputs.
    given = [(n, t) for n, t in zip(_bridge.INPUT_NAMES, inputs) if t is not None]
    described = _strided(given + list(zip(names, outputs)))
    _core.check_disjoint(described[:len(given)], described[len(given):])


_STORAGE_BYTES = 1 << 52  # apart: more than any tensor's storage holds


def _strided(named) -> list:
    """Each (name, tensor) as a Strided by size hints, its address its place
    in its storage, the storages laid _STORAGE_BYTES apart and tensors that
    alias one another in the same one."""
    storages, described = [], []
    for name, tensor in named:
        storage = next((i for i, other in enumerate(storages)
                        if torch._C._is_alias_of(tensor, other)), None)
        if storage is None:
            storage = len(storages)
            storages.append(tensor)
        item = tensor.element_size()
        address = storage * _STORAGE_BYTES + _hint(tensor.storage_offset()) * item
        described.append(_core.Strided(name, address, [_hint(s) for s in tensor.shape],
                                       [_hint(s) for s in tensor.stride()], item))
    return described


# ---- torch.vmap: the layout once for a batch that shares its counts ----
#
# The layout depends only on the counts, so with counts shared by the batch
# one call makes it, on the shared inputs (and, where tokens are batched, on a
# one-element column of the first entry's tokens, which keeps the dtype pairing
# of the shared scales), and each batched tensor's rows are then gathered by
# its gather index at once for every entry, pad and unset rows zero. Each
# entry is first checked by the core's shape rules, so vmap raises what a call
# of one entry raises. Counts batched too give a call per entry; a batch of
# none gives empty outputs of the entries' specs.


_GATHER, _SCATTER = 0, 1  # idx_type (spec rule 9)


def _bytes(tensor):
    """One-byte tensors as uint8: torch has no copy kernel for float4_e2m1fn_x2."""
    return tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor


def _gathered(tensor, dim, index):
    """Rows index[r] of every entry of `tensor` (batched at `dim`), zero where
    index[r] < 0 (masked, so no host sync on CUDA); the batch stays at `dim`.
    One index_select of whole rows (torch's fast path), over entries side by
    side in each row, or, for a batch in front, over the entries' rows one
    after another."""
    data = _bytes(tensor)
    source = index.clamp(min=0).long()
    if dim == 0:  # entry b's row i is row b * A + i of [B * A, rest]
        batch, rows = data.shape[:2]
        source = (torch.arange(batch, device=source.device)[:, None] * rows + source).flatten()
        gathered = data.reshape(batch * rows, -1).index_select(0, source)
        gathered = gathered.reshape(batch, index.shape[0], *data.shape[2:])
    else:  # [A, ...]: the entries side by side in each row
        gathered = data.reshape(data.shape[0], -1).index_select(0, source)
        gathered = gathered.reshape(index.shape[0], *data.shape[1:])
    rows_dim = 1 if dim == 0 else 0
    unset = (index < 0).view([-1 if d == rows_dim else 1 for d in range(gathered.dim())])
    return gathered.masked_fill_(unset, 0).view(tensor.dtype)


def _per_entry(op, info, in_dims, args):
    """`op` on each entry in turn, the outputs stacked."""
    entries = [op(*(a if d is None else a.select(d, b) for a, d in zip(args, in_dims)))
               for b in range(info.batch_size)]
    return tuple(torch.stack(column) for column in zip(*entries)), (0,) * len(entries[0])


def _vmap_rule(name, infer, gather_index, data_outputs):
    """The vmap rule of the operator `name` (tokens, counts, scales, weight,
    then its attributes). `infer` checks one entry as the operator does;
    `gather_index(tokens, counts, outputs, attributes)` is the row of each
    output row's source (-1: none); `data_outputs` are the outputs of tokens,
    scales and weight."""
    op = getattr(OPS, name).default
    defaults = (None, None, *(d for _, _, d in _bridge.OPERATORS[name]["attributes"]))

    def rule(info, in_dims, *args):
        args = (*args, *defaults[len(args) - 2:])  # the dispatcher leaves out trailing defaults
        in_dims = tuple(d if d is None or d >= 0 else d + a.dim()
                        for a, d in zip(args, (*in_dims, *[None] * (len(args) - len(in_dims)))))
        tensors, dims, values = args[:4], in_dims[:4], args[4:]
        attributes = _bridge.attributes(name, values)
        if info.batch_size == 0:  # the entries' outputs by their specs, none of them
            entry = [None if t is None else torch.empty(
                t.shape if d is None else t.shape[:d] + t.shape[d + 1:], dtype=t.dtype,
                device="meta") for t, d in zip(tensors, dims)]
            specs = _fake(infer, entry, attributes)
            return (tuple(tensors[0].new_empty((0, *o.shape), dtype=o.dtype) for o in specs),
                    (0,) * len(specs))
        if dims[1] is not None:
            return _per_entry(op, info, in_dims, args)
        entry = [t if d is None else t.select(d, 0) for t, d in zip(tensors, dims)]
        _infer(infer, entry, attributes)
        shared_tokens = (entry[0] if dims[0] is None else
                         _bytes(entry[0])[:, :1].contiguous().view(entry[0].dtype))
        outputs = list(op(shared_tokens, tensors[1], *(t if d is None else None
                                                       for t, d in zip(tensors[2:], dims[2:])),
                          *values))
        index = gather_index(entry[0], tensors[1], outputs, attributes[0])
        out_dims = [None] * len(outputs)
        for slot, output in zip((0, 2, 3), data_outputs):
            if dims[slot] is not None:
                outputs[output] = _gathered(tensors[slot], dims[slot], index)
                out_dims[output] = dims[slot]
        return tuple(outputs), tuple(out_dims)
    return rule


_FORWARD_ATTRIBUTES = _bridge.OPERATORS[_bridge.REROUTE]["attributes"]


def _index(num_rows, counts, attributes, idx_type):
    """The forward's permute_token_idx of `idx_type` for `num_rows` rows and
    the core's `attributes` (from a call on one byte a row)."""
    rows = torch.empty(num_rows, 1, dtype=torch.uint8, device=counts.device)
    values = [idx_type if name == "idx_type" else
              None if kind == "dtype_name" else getattr(attributes, name)
              for name, kind, _ in _FORWARD_ATTRIBUTES]
    return OPS.moe_re_routing.default(rows, counts, None, None, *values)[2]


def _forward_gather_index(tokens, counts, outputs, attributes):
    if attributes.idx_type == _GATHER:
        return outputs[2]
    return _index(tokens.shape[0], counts, attributes, _GATHER)


def _inverse_gather_index(tokens, counts, outputs, attributes):
    # Each restored row comes from where the forward scatters it.
    return _index(outputs[0].shape[0], counts, attributes, _SCATTER)


torch.library.register_vmap("moe_reroute::moe_re_routing", _vmap_rule(
    _bridge.REROUTE, _core.infer_reroute, _forward_gather_index, (0, 1, 4)))
torch.library.register_vmap("moe_reroute::moe_re_routing_inverse", _vmap_rule(
    _bridge.INVERSE, _core.infer_inverse, _inverse_gather_index, (0, 1, 2)))
