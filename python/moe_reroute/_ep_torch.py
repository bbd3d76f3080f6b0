"""moe_reroute.ep on torch.distributed (docs/spec.md section 11): the local
steps in the library's torch operators, the bytes in point-to-point messages
straight from where they are read to where they are read next, autograd as in
DeepEP. Called by ep.dispatch for any group that is not an mpi4py
communicator.

Costs per dispatch: two agreements (all_reduce MAX of a few int64), the
counts (one all_to_all_single of N * E int32) and one batch_isend_irecv with
a message per non-empty (rank, local expert) block and part (tokens, scales,
weights). The counts are read on the host to lay out the receive side: on
CUDA that is one synchronisation per dispatch. A combine costs one agreement
and one batch of a message per block. The backward passes exchange rows as
well (dispatch's as a combine, combine's as a dispatch), so every rank must
run them, as with DeepEP; whether x, expert_scales and expert_out require
grad is agreed with the arguments, so that every rank's backward moves the
same parts.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist

from . import _bridge, _core, _torch, moe_finalize_routing, moe_init_routing, moe_re_routing
from .ep import DispatchResult

_DTYPE_CODE = {row["name"]: code for code, row in enumerate(_bridge.TABLE)}  # the core's DType
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)  # combine's and autograd's dtypes
# The failure word carries the failing rank's exception type by its index here.
_ERRORS = (TypeError, ValueError, RuntimeError)
_COUNT_FLAG = 2  # moe_init_routing's expert_tokens_count_or_cumsum_flag: counts
_ROW_MAJOR = 2   # moe_finalize_routing's drop_pad_mode for moe_init_routing's layout


def _dtype_name(tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _spec(tensor) -> str:
    """dtype and shape as TensorSpec::to_string prints them: float32[3, 2]."""
    return f"{_dtype_name(tensor)}[{', '.join(map(str, tensor.shape))}]"


def _tensor(name: str, value, optional: bool = False):
    if (value is None and optional) or isinstance(value, torch.Tensor):
        return value
    raise TypeError(f"{name}: expected torch.Tensor, got {_bridge.type_name(value)}")


def _same_device(name: str, tensor, like, like_name: str):
    if tensor is not None and tensor.device != like.device:
        where = "in CPU memory" if like.device.type == "cpu" else f"on {like.device}"
        raise ValueError(f"{name}: must be {where} like {like_name}")


def _byte_rows(tensor):
    """[dim 0, bytes per row] uint8 view of a contiguous tensor, as the
    messages and copies take it (gloo has no float8 or float4 types)."""
    shape = (tensor.shape[0], math.prod(tensor.shape[1:]))
    if tensor.numel() == 0:  # its strides may be any: nothing is read or written
        return tensor.new_empty((shape[0], shape[1] * tensor.element_size()), dtype=torch.uint8)
    return tensor.view(shape).view(torch.uint8)


def _collective_device(group):
    # NCCL takes CUDA tensors only; gloo (and a mixed group's CPU side) CPU ones.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# The values every rank must pass alike, by name; each rank's in this order.
_DISPATCH_AGREED = (
    "num_experts", "x: dtype", "x: H", "expert_scales: presence", "per_token_scales: dtype",
    "per_token_scales: dims", "per_token_scales: dim 1", "per_token_scales: dim 2",
    "expert_token_num_type", "idx_type", "expert_alignment", "capacity",
    # Every rank's backward exchanges, or none's.
    "x: requires grad", "expert_scales: requires grad")
_COMBINE_AGREED = ("expert_out: dtype", "expert_out: H'", "expert_out: requires grad")


def _agree(group, step: str, error, names=(), values=()) -> None:
    """The bounded agreement: one all_reduce MAX over the group in which every
    rank learns the lowest rank whose arguments failed (and its exception
    type) and whether the values named `names` differ between ranks (a rank
    that failed has none). Raises on every rank when either happened: the
    failing rank its own error, the others the same type naming it."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    n = len(names)
    word = [0] * (1 + 2 * n)
    if error is not None:
        kind = next((i for i, t in enumerate(_ERRORS) if isinstance(error, t)), len(_ERRORS) - 1)
        # The maximum is the lowest failing rank; the maxima of value and -value: max and -min.
        word[0] = (size - rank) << 8 | (kind + 1)
    else:
        word[1:] = [*values, *(-value for value in values)]
    reduced = torch.tensor(word, dtype=torch.int64, device=_collective_device(group))
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
    word = reduced.tolist()
    if word[0]:
        if error is not None:
            raise error
        raise _ERRORS[(word[0] & 0xFF) - 1](
            f"{step}: rank {size - (word[0] >> 8)} refused its arguments (its error names the "
            "argument); nothing was sent")
    for i, name in enumerate(names):
        high, low = word[1 + i], -word[1 + n + i]
        if high != low:
            raise ValueError(f"{name} differs across ranks ({low} to {high}); every rank must "
                             "pass the same")


def _requires_grad(tensor) -> bool:
    return tensor is not None and tensor.requires_grad and torch.is_grad_enabled()


class _Local:
    """What one rank checks alone before the first agreement, and then packs:
    raises TypeError or ValueError naming the argument, as ep.cc's validate
    and sort_pairs do, in their order."""

    def __init__(self, x, expert_idx, num_experts, group, expert_scales, per_token_scales,
                 tokens_dtype, expert_alignment, capacity, idx_type, expert_token_num_type):
        size = dist.get_world_size(group)
        x, expert_idx = _tensor("x", x), _tensor("expert_idx", expert_idx)
        expert_scales = _tensor("expert_scales", expert_scales, optional=True)
        per_token_scales = _tensor("per_token_scales", per_token_scales, optional=True)
        num_experts = _bridge.checked("num_experts", num_experts, int)
        if num_experts < 1 or num_experts % size:
            raise ValueError(f"num_experts: must be a positive multiple of the {size} ranks of "
                             f"group, got {num_experts}")
        capacity = -1 if capacity is None else _bridge.checked("capacity", capacity, int)
        if capacity < -1:
            raise ValueError(f"capacity: must be >= 0 (or -1: the rows received), got {capacity}")
        init = _bridge.named_attributes(_bridge.INIT_ROUTING, dict(
            active_num=0, expert_capacity=0, expert_num=num_experts, drop_pad_mode=0,
            expert_tokens_count_or_cumsum_flag=_COUNT_FLAG,
            expert_tokens_before_capacity_flag=False))
        _core.infer_init_routing([_torch._describe(x, "x"),
                                  _torch._describe(expert_idx, "expert_idx")], init)
        num_tokens, top_k = expert_idx.shape
        if expert_scales is not None:
            if (expert_scales.dtype != torch.float32
                    or tuple(expert_scales.shape) != (num_tokens, top_k)):
                raise ValueError(f"expert_scales: must be float32 [T, k] = [{num_tokens}, "
                                 f"{top_k}], got {_spec(expert_scales)}")
            _same_device("expert_scales", expert_scales, x, "x")
        if _requires_grad(x) and x.dtype not in _FLOATS:
            raise TypeError(f"x: requires grad, but only float16, bfloat16 and float32 tokens are "
                            f"differentiable, got {_dtype_name(x)}")
        # moe_re_routing's rules on the scales' form and the attributes, on the
        # shapes the receiver will have.
        experts = num_experts // size
        self.reroute = _bridge.attributes(_bridge.REROUTE, (
            expert_token_num_type, idx_type, tokens_dtype, expert_alignment, capacity >= 0))
        counts = _core.Argument("expert_token_num_per_rank", "int32", 32, [size, experts],
                                str(x.device), True)
        specs = _core.infer_reroute([_torch._describe(x, "tokens"), counts,
                                     _torch._describe(per_token_scales, "per_token_scales"),
                                     None], *self.reroute)
        attributes = self.reroute[0]
        _same_device("per_token_scales", per_token_scales, x, "x")
        # The pack: the pairs' rows sorted by global expert, the ids checked.
        with torch.no_grad():
            self.packed, self.row_idx, self.sent, _ = moe_init_routing(
                x, expert_idx, expert_num=num_experts,
                expert_tokens_count_or_cumsum_flag=_COUNT_FLAG)
        scales_shape = () if per_token_scales is None else tuple(per_token_scales.shape)
        self.agreed = (  # _DISPATCH_AGREED's values
            num_experts, _DTYPE_CODE[specs[0].dtype], specs[0].shape[1],
            int(expert_scales is not None),
            -1 if per_token_scales is None else _DTYPE_CODE[specs[1].dtype], len(scales_shape),
            scales_shape[1] if len(scales_shape) > 1 else 0,
            scales_shape[2] if len(scales_shape) > 2 else 0,
            attributes.expert_token_num_type, attributes.idx_type, attributes.expert_alignment,
            capacity, int(_requires_grad(x)), int(_requires_grad(expert_scales)))
        self.x, self.expert_scales, self.per_token_scales = x, expert_scales, per_token_scales
        self.capacity, self.experts, self.top_k = capacity, experts, top_k


class Handle:
    """What combine (and the backward passes) need of a dispatch: the group,
    the counts both ways and their offsets, the sorted order of the pairs and
    the weights (expert_scales itself, not a copy, so that combine's autograd
    reaches it)."""

    def __init__(self, group, local: _Local, sent: list, received: np.ndarray, num_rows: int,
                 expert_alignment: int):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self._peers = [r if group is None else dist.get_global_rank(group, r)
                       for r in range(self.size)]
        self.experts, self.top_k = local.experts, local.top_k
        self.num_tokens = local.x.shape[0]
        self.num_rows = num_rows  # R: the rows of permute_tokens, which expert_out must have
        self.sent = sent  # [N * E]: pairs sent to each global expert, in sorted order
        self.sent_offset = np.concatenate([[0], np.cumsum(sent)[:-1]]).tolist()
        self.received = received.tolist()  # [N][E]: what rank r sent here for local expert e
        # moe_re_routing's DstOffset: expert e's segment (padded totals of the
        # experts before it), then the blocks of ranks 0 .. r - 1.
        totals = received.sum(axis=0)
        padded = -(-totals // expert_alignment) * expert_alignment
        segment = np.cumsum(padded) - padded
        self.dst = (segment + np.cumsum(received, axis=0) - received).tolist()
        self.pad_rows = [(int(s + t), int(s + p))
                         for s, t, p in zip(segment, totals, padded) if p > t]
        self.row_idx = local.row_idx  # [T * k] int32: the sorted position of pair t * k + j
        # The pair at each sorted position.
        self.order = torch.empty_like(self.row_idx, dtype=torch.int64)
        self.order[self.row_idx.long()] = torch.arange(self.row_idx.numel(),
                                                       device=self.row_idx.device)
        self.weights = local.expert_scales  # [T, k] float32 or None (weight 1)

    def exchange(self, parts, back: bool = False) -> None:
        """Moves each (rank, expert) block of rows between the sorted pair
        rows at the source and its place at the expert's rank; `parts` are
        (sorted rows [T * k, ..], placed rows [R, ..]) byte-row pairs, all
        moved in one batch. Forward: sorted to placed (dispatch); back:
        placed to sorted (combine). A rank's own blocks are copied."""
        ops = []
        for peer in range(self.size):
            for e in range(self.experts):
                g = peer * self.experts + e
                first, sent = self.sent_offset[g], self.sent[g]
                at, received = self.dst[peer][e], self.received[peer][e]
                for sorted_rows, placed in parts:
                    out_block = sorted_rows[first:first + sent]
                    in_block = placed[at:at + received]
                    if back:
                        out_block, in_block = in_block, out_block
                    if peer == self.rank:
                        in_block.copy_(out_block)
                        continue
                    if out_block.shape[0]:
                        ops.append(dist.P2POp(dist.isend, out_block, self._peers[peer], self.group))
                    if in_block.shape[0]:
                        ops.append(dist.P2POp(dist.irecv, in_block, self._peers[peer], self.group))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    def returned(self, placed):
        """The rows of `placed` [R, H'] back at their sorted positions: [T * k, H']."""
        rows = placed.new_empty((self.num_tokens * self.top_k, *placed.shape[1:]))
        self.exchange([(_byte_rows(rows), _byte_rows(placed.contiguous()))], back=True)
        return rows

    def combine(self, expert_out):
        """ep.combine: expert_out [R, H'] back to the source ranks, each token's
        k rows summed as moe_finalize_routing mode 2 sums them."""
        error = None
        try:
            expert_out = _tensor("expert_out", expert_out)
            if expert_out.dtype not in _FLOATS:
                raise TypeError(f"expert_out: dtype {_dtype_name(expert_out)} is not float16, "
                                "bfloat16 or float32")
            shape = tuple(expert_out.shape)
            if len(shape) != 2 or shape[0] != self.num_rows or shape[1] < 1:
                raise ValueError(f"expert_out: must be [R, H'] with R = {self.num_rows} rows "
                                 f"(dispatch's permute_tokens), got {_spec(expert_out)}")
            _same_device("expert_out", expert_out, self.row_idx, "x")
            agreed = (_DTYPE_CODE[_dtype_name(expert_out)], expert_out.shape[1],
                      int(_requires_grad(expert_out)))
        except Exception as caught:  # every rank hears of it before anything is sent
            error, agreed = caught, ()
        _agree(self.group, "combine", error, _COMBINE_AGREED, agreed)
        return _Combine.apply(expert_out, self.weights, self)

    def scales(self, weights):
        """moe_finalize_routing's scales: the weights, or ones."""
        if weights is not None:
            return weights
        return torch.ones((self.num_tokens, self.top_k), dtype=torch.float32,
                          device=self.row_idx.device)


def dispatch(x, expert_idx, num_experts, group, expert_scales, per_token_scales, tokens_dtype,
             expert_alignment, capacity, idx_type, expert_token_num_type) -> DispatchResult:
    """ep.dispatch on a torch.distributed group (None: the default group)."""
    error = local = None
    try:
        local = _Local(x, expert_idx, num_experts, group, expert_scales, per_token_scales,
                       tokens_dtype, expert_alignment, capacity, idx_type, expert_token_num_type)
    except Exception as caught:  # every rank hears of it before anything is sent
        error = caught
    _agree(group, "dispatch", error, _DISPATCH_AGREED, () if local is None else local.agreed)

    rank, size = dist.get_rank(group), dist.get_world_size(group)
    counts = torch.empty_like(local.sent)
    dist.all_to_all_single(counts, local.sent, group=group)
    received = counts.view(size, local.experts)
    # Both counts on the host at once: on CUDA the one synchronisation of a dispatch.
    host = torch.cat((local.sent, counts)).cpu().numpy().astype(np.int64)
    sent, received_host = host[:counts.numel()], host[counts.numel():].reshape(size, local.experts)
    # The receiver's index and expert_token_num are moe_re_routing's for these
    # counts, whatever the rows hold: its call on one byte a row gives them.
    num_received = int(received_host.sum())
    error = layout = None
    try:
        if 0 <= local.capacity < num_received:
            raise ValueError(f"capacity: rank {rank} receives {num_received} rows, more than "
                             f"capacity = {local.capacity}")
        num_recv = num_received if local.capacity < 0 else local.capacity
        attributes, _ = local.reroute
        layout = moe_re_routing(
            torch.empty((num_recv, 1), dtype=torch.uint8, device=local.x.device), received,
            expert_token_num_type=attributes.expert_token_num_type, idx_type=attributes.idx_type,
            expert_alignment=attributes.expert_alignment,
            allow_spare_rows=attributes.allow_spare_rows)
    except Exception as caught:
        error = caught
    _agree(group, "dispatch", error)
    handle = Handle(group, local, sent.tolist(), received_host, layout[0].shape[0],
                    local.reroute[0].expert_alignment)
    outputs = _Dispatch.apply(local.x, local.expert_scales, handle, local, layout)
    return DispatchResult(*outputs, received, handle)


class _Dispatch(torch.autograd.Function):
    """The exchange of dispatch; backward: permute_tokens' gradient comes back
    as a combine without weights, permute_topk_weight's to expert_scales."""

    @staticmethod
    def forward(ctx, x, expert_scales, handle, local, layout):
        num_rows = handle.num_rows
        tokens = x.new_empty((num_rows, *x.shape[1:]))
        parts = [(_byte_rows(local.packed), _byte_rows(tokens))]
        scales_out, weight_out = layout[1], layout[4]  # [R] zeros, (0,): without scales, weights
        order = handle.order
        if local.per_token_scales is not None:
            scales = local.per_token_scales.contiguous()
            scales_out = scales.new_empty((num_rows, *scales.shape[1:]))
            parts.append((_byte_rows(scales).index_select(0, order // handle.top_k),
                          _byte_rows(scales_out)))
        if expert_scales is not None:
            weight_out = expert_scales.new_empty((num_rows,))
            parts.append((_byte_rows(expert_scales.reshape(-1)[order]), _byte_rows(weight_out)))
        handle.exchange(parts)
        for begin, end in handle.pad_rows:
            for _, placed in parts:
                placed[begin:end] = 0
        ctx.handle = handle
        ctx.mark_non_differentiable(scales_out, layout[2], layout[3])
        if expert_scales is None:
            ctx.mark_non_differentiable(weight_out)
        return tokens, scales_out, layout[2], layout[3], weight_out

    @staticmethod
    def backward(ctx, grad_tokens, _scales, _idx, _num, grad_weight):
        handle = ctx.handle
        needs_x, needs_weights = ctx.needs_input_grad[:2]
        pairs = handle.num_tokens * handle.top_k
        parts, grad_x, grad_weights = [], None, None
        if needs_x:
            rows = grad_tokens.new_empty((pairs, *grad_tokens.shape[1:]))
            parts.append((_byte_rows(rows), _byte_rows(grad_tokens.contiguous())))
        if needs_weights:
            weights = grad_weight.new_empty((pairs,))
            parts.append((_byte_rows(weights), _byte_rows(grad_weight.contiguous())))
        handle.exchange(parts, back=True)
        if needs_x:
            grad_x = moe_finalize_routing(rows, handle.row_idx, scales=handle.scales(None),
                                          drop_pad_mode=_ROW_MAJOR)
        if needs_weights:
            grad_weights = weights[handle.row_idx.long()].view(handle.num_tokens, handle.top_k)
        return grad_x, grad_weights, None, None, None


class _Combine(torch.autograd.Function):
    """The exchange and the weighted sum of combine; backward: a dispatch of
    the gradient, each pair's row grad_out[t] * w[t, j], and the weights'
    gradient, dot(grad_out[t], row(t, j))."""

    @staticmethod
    def forward(ctx, expert_out, weights, handle):
        rows = handle.returned(expert_out)
        ctx.handle = handle
        ctx.save_for_backward(weights, rows if ctx.needs_input_grad[1] else None)
        return moe_finalize_routing(rows, handle.row_idx, scales=handle.scales(weights),
                                    drop_pad_mode=_ROW_MAJOR)

    @staticmethod
    def backward(ctx, grad_out):
        handle = ctx.handle
        weights, rows = ctx.saved_tensors
        grad_expert_out = grad_weights = None
        if ctx.needs_input_grad[0]:
            sorted_grad = grad_out.index_select(0, handle.order // handle.top_k)
            if weights is not None:
                sorted_weights = weights.reshape(-1)[handle.order]
                sorted_grad = (sorted_grad.float() * sorted_weights[:, None]).to(grad_out.dtype)
            # Rows no pair reads (pad and spare rows) get zeros.
            grad_expert_out = grad_out.new_zeros((handle.num_rows, grad_out.shape[1]))
            handle.exchange([(_byte_rows(sorted_grad.contiguous()), _byte_rows(grad_expert_out))])
        if ctx.needs_input_grad[1]:
            pair_rows = rows[handle.row_idx.long()].float()
            grad_weights = (pair_rows.view(handle.num_tokens, handle.top_k, rows.shape[1])
                            * grad_out.float()[:, None, :]).sum(dim=-1)
        return grad_expert_out, grad_weights, None
