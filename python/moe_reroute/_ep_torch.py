"""moe_reroute.ep on torch.distributed (docs/spec.md section 11): the local
steps in the library's torch operators, the bytes in messages, autograd as in
DeepEP. Called by ep.dispatch for any group that is not an mpi4py
communicator.

Costs per dispatch: one all-gather (_all_gather) of each rank's failure
word, the values every rank must pass alike, the tokens it sends each rank
and its pairs to each global expert (N + N * E int64), which gives every
rank the whole count matrix; it is read on the host (on CUDA the one synchronisation of a
dispatch). While it runs, each rank gathers the rows of the tokens it sends,
each token once to each rank that has one of its experts (and their
per-token scales alike). Then one all_to_all_single of those rows (one more
for the scales) and one of each pair's row index there and weight; one
moe_re_routing call places the pairs' indices and weights and gives idx and
expert_token_num, and one gather of the received rows by the placed indices
is permute_tokens. A combine costs one agreement (an all-gather, which runs
while the rows of an exchange by peer are put back in source-rank order) and
the exchange back, which sends each pair's row one of two ways, picked from
the count matrix and the row bytes alike on every rank (Handle.by_peer):
where the mean block (the rows one rank sends another for one expert) has
SMALL_BLOCK_BYTES or more, one point-to-point message per block, straight
into the pair rows; where less, one all_to_all_single of the rows in
source-rank order. The backward passes exchange rows as well (dispatch's as
a combine, combine's as a dispatch of a row per pair), so every rank must
run them, as with DeepEP; whether x, expert_scales and expert_out require
grad is agreed with the arguments, so that every rank's backward moves the
same parts."""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
import torch.distributed as dist

from . import (_bridge, _core, _torch, moe_finalize_routing, moe_init_routing, moe_re_routing,
               moe_re_routing_inverse)
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
# Counts that ride in dispatch's agreement (N + num_experts up to this: one
# collective before the rows); more take a second all-gather.
_COUNT_SLOTS = 1024


def _refuse(step: str, error, failing: int, kind: int) -> None:
    """Raises on every rank for the lowest failing rank `failing`: this rank's
    own error where it failed, else an exception of the failing rank's type
    (`kind`, an index into _ERRORS) naming it."""
    if error is not None:
        raise error
    raise _ERRORS[kind](f"{step}: rank {failing} refused its arguments (its error names the "
                        "argument); nothing was sent")


def _all_gather(row, group, async_op=False):
    """Every rank's 1-D `row` (one length on all), [N * len] in rank order,
    and the work (None unless `async_op`): an all_to_all_single of the row
    to every rank, which gloo runs in half the time of its all_gather."""
    gathered = row.new_empty((dist.get_world_size(group) * row.numel(),))
    work = dist.all_to_all_single(gathered, row.repeat(dist.get_world_size(group)), group=group,
                                  async_op=async_op)
    return gathered, work


class _Agreement:
    """The bounded agreement: one all-gather over the group of each rank's
    failure word (its exception type), the values named `names` (a rank that
    failed has none) and, for dispatch (`with_counts`), its counts (the
    tokens it sends to each rank, then the pairs it sends to each global
    expert; None where it failed). It starts here and runs while the caller
    does local work; result() raises on every rank when a rank failed or the
    values differ between ranks (_refuse), and returns every rank's counts,
    [N, N + num_experts] int64 on the host: on CUDA one synchronisation. The
    gathered rows have one length on every rank whatever they passed (the
    backend ends the process where they differ): up to _COUNT_SLOTS counts
    ride in them, more take a second gather once every rank knows that
    num_experts is agreed."""

    def __init__(self, group, step: str, error, names=(), values=(), with_counts=False,
                 counts=None):
        self.group, self.step, self.error, self.names = group, step, error, names
        self.with_counts, self.counts = with_counts, counts
        head = [0] * (1 + len(names))
        if error is not None:
            head[0] = 1 + next((i for i, t in enumerate(_ERRORS) if isinstance(error, t)),
                               len(_ERRORS) - 1)
        else:
            head[1:] = values
        self.head = len(head)
        row = np.zeros(len(head) + (_COUNT_SLOTS if with_counts else 0), np.int64)
        row[:len(head)] = head
        row = torch.from_numpy(row).to(_collective_device(group))
        self.inline = counts is not None and counts.numel() <= _COUNT_SLOTS
        if self.inline:
            row[self.head:self.head + counts.numel()] = counts
        self.gathered, self.work = _all_gather(row, group, async_op=True)

    def result(self):
        self.work.wait()
        size = dist.get_world_size(self.group)
        gathered = self.gathered.view(size, -1).cpu().numpy()
        failed = np.flatnonzero(gathered[:, 0])
        if failed.size:
            _refuse(self.step, self.error, int(failed[0]), int(gathered[failed[0], 0]) - 1)
        values = gathered[:, 1:self.head]
        low, high = values.min(axis=0), values.max(axis=0)
        differs = np.flatnonzero(low != high)
        if differs.size:
            i = differs[0]
            raise ValueError(f"{self.names[i]} differs across ranks ({low[i]} to {high[i]}); "
                             "every rank must pass the same")
        if not self.with_counts:
            return None
        if self.inline:
            return gathered[:, self.head:self.head + self.counts.numel()]
        counts = self.counts.to(device=_collective_device(self.group), dtype=torch.int64)
        return _all_gather(counts, self.group)[0].view(size, -1).cpu().numpy()


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
        # The ids checked and sorted by global expert: the call on rows of one
        # byte; pack() moves x's rows while the agreement runs.
        with torch.no_grad():
            _, self.row_idx, self.sent, _ = moe_init_routing(
                torch.empty((num_tokens, 1), dtype=torch.uint8, device=x.device), expert_idx,
                expert_num=num_experts,
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
        # Each token goes once to each rank that has one of its experts.
        self.dest = (expert_idx // experts).long()  # [T, k]: the rank of each pair's expert
        self.to_rank = torch.zeros((size, num_tokens), dtype=torch.bool, device=x.device)
        self.to_rank.scatter_(0, self.dest.t(), True)
        self.unique = self.to_rank.sum(dim=1)  # [N]: the tokens this rank sends each rank

    def pack(self):
        """While the agreement runs: the rows of the tokens each rank gets, in
        rank order, each rank's in token order (`rows`, and `scale_rows` of
        per_token_scales), and each pair's row among its rank's
        (`token_of_pair` [T, k])."""
        with torch.no_grad():
            self.token_of_pair = (self.to_rank.cumsum(dim=1) - 1).gather(0, self.dest.t()).t()
            tokens = self.to_rank.nonzero()[:, 1]
            self.rows = _byte_rows(self.x.contiguous()).index_select(0, tokens)
            self.scale_rows = (None if self.per_token_scales is None else
                               _byte_rows(self.per_token_scales.contiguous()).index_select(0, tokens))


# Combine's rows, where their mean block (the rows one rank sends another for
# one expert) has fewer bytes, move as one all_to_all_single after
# moe_re_routing_inverse; at and above it, as one message per block straight
# into the pair rows. On gloo each message costs about 0.1 ms: bench/ep.py at
# 2 ranks found the message per peer faster at 115 KiB blocks, the two even at
# 172 KiB and the message per block faster at 230 KiB.
SMALL_BLOCK_BYTES = 128 << 10


class Handle:
    """What combine (and the backward passes) need of a dispatch: the group,
    the counts both ways and their offsets, the sorted order of the pairs and
    the weights (expert_scales itself, not a copy, so that combine's autograd
    reaches it). `blocks` [N, N, E]: the pairs rank s sends rank r's expert e,
    every rank's, so that every rank picks the same way to exchange."""

    def __init__(self, group, local: _Local, blocks: np.ndarray, unique: np.ndarray, counts,
                 num_slots: int, num_rows: int):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self._peers = [r if group is None else dist.get_global_rank(group, r)
                       for r in range(self.size)]
        self.experts, self.top_k = local.experts, local.top_k
        self.num_tokens = local.x.shape[0]
        self.num_slots = num_slots  # A: the rows received, or capacity
        self.num_rows = num_rows  # R: the rows of permute_tokens, which expert_out must have
        attributes = local.reroute[0]
        self.device = local.x.device
        # moe_re_routing's attributes that place rows, and all of them.
        self.placement = dict(expert_alignment=attributes.expert_alignment,
                              allow_spare_rows=attributes.allow_spare_rows)
        self.attributes = dict(self.placement, idx_type=attributes.idx_type,
                               expert_token_num_type=attributes.expert_token_num_type)
        sent, received = blocks[self.rank].reshape(-1), blocks[:, self.rank]
        self.sent = sent.tolist()  # [N * E]: pairs sent to each global expert, in sorted order
        self.sent_offset = (np.cumsum(sent) - sent).tolist()
        self.received = received.tolist()  # [N][E]: what rank r sent here for local expert e
        self.sent_by_rank = blocks[self.rank].sum(axis=1).tolist()
        self.received_by_rank = received.sum(axis=1).tolist()
        self.num_received = sum(self.received_by_rank)
        # The tokens dispatch sends each rank and receives from each, and where
        # this rank's land there: after row 0 (zeros) and the ranks before it.
        self.unique_sent = unique[self.rank].tolist()
        self.unique_received = unique[:, self.rank].tolist()
        self.token_base = 1 + unique[:self.rank].sum(axis=0)
        self.pair_base = 1 + blocks[:self.rank].sum(axis=(0, 2))
        self.counts = counts  # [N, E] int32 on x's device: received, for moe_re_routing
        # moe_re_routing's DstOffset: expert e's segment (padded totals of the
        # experts before it), then the blocks of ranks 0 .. r - 1.
        alignment = attributes.expert_alignment
        totals = received.sum(axis=0)
        padded = -(-totals // alignment) * alignment
        segment = np.cumsum(padded) - padded
        self.dst = (segment + np.cumsum(received, axis=0) - received).tolist()
        self.num_valid = int(padded.sum())  # rows past it are spare
        remote = blocks[~np.eye(self.size, dtype=bool)]  # the blocks between two ranks
        self.block_rows = remote.sum() / max(np.count_nonzero(remote), 1)
        self.row_idx = local.row_idx  # [T * k] int32: the sorted position of pair t * k + j
        self.weights = local.expert_scales  # [T, k] float32 or None (weight 1)

    @functools.cached_property
    def order(self):
        """The pair at each sorted position [T * k] int64."""
        order = torch.empty_like(self.row_idx, dtype=torch.int64)
        order[self.row_idx.long()] = torch.arange(self.row_idx.numel(), device=self.device)
        return order

    def sort(self, pairs):
        """Per-pair values [T * k] in sorted order."""
        return pairs.new_empty(pairs.shape).index_copy_(0, self.row_idx.long(), pairs)

    def by_peer(self, row_bytes: int) -> bool:
        """Whether a part of `row_bytes` a row moves one message per peer
        rather than per block: its mean block is small. The same on every rank."""
        return row_bytes * self.block_rows < SMALL_BLOCK_BYTES

    def _by_block(self, parts) -> None:
        """Moves each (rank, expert) block of rows from its place at the
        expert's rank back to the sorted pair rows at the source; `parts` are
        (sorted rows [T * k, ..], placed rows [R, ..]) byte-row pairs, all
        moved in one batch. A rank's own blocks are copied."""
        if not parts:  # the loop over the blocks costs at decode size
            return
        ops = []
        for peer in range(self.size):
            for e in range(self.experts):
                g = peer * self.experts + e
                first, sent = self.sent_offset[g], self.sent[g]
                at, received = self.dst[peer][e], self.received[peer][e]
                for sorted_rows, placed in parts:
                    out_block, in_block = placed[at:at + received], sorted_rows[first:first + sent]
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

    def _by_peer(self, sorted_rows, ranked, back: bool = False):
        """Starts moving rows between the sorted pair rows at the source (a
        peer's contiguous) and the rows [A, ..] received in source-rank
        order, in one all_to_all_single; returns its work. Forward: sorted to
        received; back: the reverse."""
        step = -1 if back else 1  # (output, input): (received, sorted), or the reverse
        return dist.all_to_all_single(*(ranked[:self.num_received], sorted_rows)[::step],
                                      *(self.received_by_rank, self.sent_by_rank)[::step],
                                      group=self.group, async_op=True)

    def place(self, parts, index, weights, sent, received):
        """Dispatch's exchange. `parts`: byte rows [sum(sent), b] (or None),
        the rows each rank gets in rank order, `sent[r]` to rank r; `index`
        [T * k] int32, each pair's row at its expert's rank (1 + the rows of
        the ranks before this one there + its place among this rank's), and
        `weights` [T * k] float32 (or None), both in sorted pair order. The
        rows land after a row of zeros, the pairs' index and weights in
        source-rank order, where one moe_re_routing call places them (pad
        rows 0: the zero row) and gives idx and expert_token_num; each part's
        rows [R, b] are then one gather (spare rows unwritten). Returns (the
        placed parts, that call's five outputs)."""
        meta = index[:, None] if weights is None else torch.stack(
            (index, weights.view(torch.int32)), dim=1)
        ranked = meta.new_empty((self.num_slots, meta.shape[1]))
        works, landed = [self._by_peer(meta, ranked)], []
        for rows in parts:
            if rows is None:
                landed.append(None)
                continue
            landed.append(rows.new_empty((1 + sum(received), rows.shape[1])))
            landed[-1][0] = 0
            works.append(dist.all_to_all_single(landed[-1][1:], rows, received, sent,
                                                group=self.group, async_op=True))
        for work in works:  # in flight together: gloo runs them on its threads
            work.wait()
        layout = moe_re_routing(
            _byte_rows(ranked[:, :1].contiguous()), self.counts,
            expert_topk_weight=None if weights is None else ranked[:, 1].contiguous().view(
                torch.float32), **self.attributes)
        at = layout[0].view(torch.int32).view(-1)[:self.num_valid]
        placed = []
        for rows in landed:
            if rows is not None:
                placed.append(rows.new_empty((self.num_rows, rows.shape[1])))
                torch.index_select(rows, 0, at, out=placed[-1][:self.num_valid])
            else:
                placed.append(None)
        return placed, layout

    def pair_index(self):
        """`place`'s index where each pair is a row of its own: the sorted pair
        rows [T * k, ..] are what each rank gets, in rank order."""
        sent = np.asarray(self.sent_by_rank)
        first = np.cumsum(sent) - sent
        index = np.repeat(self.pair_base - first, sent) + np.arange(sent.sum())
        return torch.from_numpy(index.astype(np.int32)).to(self.device)

    def rank_order(self, placed):
        """Placed rows [R, b] uint8 in source-rank order [A, b], as an exchange
        by peer sends them back."""
        return moe_re_routing_inverse(placed, self.counts, **self.placement)[0]

    def bring_back(self, parts, ranked=None) -> list:
        """Combine's exchange: each of `parts`, placed rows [R, b] uint8, back
        to the sorted pair rows [T * k, b] at the source ranks; `ranked`, if
        given, holds rank_order of each part that moves by peer (else None)."""
        returned, by_block = [], []
        for i, placed in enumerate(parts):
            returned.append(placed.new_empty((self.num_tokens * self.top_k, placed.shape[1])))
            if self.by_peer(placed.shape[1]):
                in_order = ranked[i] if ranked is not None else None
                self._by_peer(returned[-1], self.rank_order(placed) if in_order is None
                              else in_order, back=True).wait()
            else:
                by_block.append((returned[-1], placed))
        self._by_block(by_block)
        return returned

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
        agreement = _Agreement(self.group, "combine", error, _COMBINE_AGREED, agreed)
        # While it runs: the local reorder before an exchange by peer.
        ranked = None
        if error is None and self.by_peer(expert_out.shape[1] * expert_out.element_size()):
            with torch.no_grad():
                ranked = self.rank_order(_byte_rows(expert_out.contiguous()))
        agreement.result()
        return _Combine.apply(expert_out, self.weights, self, ranked)

    def scales(self, weights):
        """moe_finalize_routing's scales: the weights, or ones."""
        if weights is not None:
            return weights
        return torch.ones((self.num_tokens, self.top_k), dtype=torch.float32,
                          device=self.row_idx.device)


def _typed(rows, like, num_rows: int):
    """Byte rows [n, b] as `like`'s dtype and trailing shape: [num_rows, ..]."""
    shape = (num_rows, *like.shape[1:])
    return like.new_empty(shape) if rows.numel() == 0 else rows.view(like.dtype).view(shape)


def dispatch(x, expert_idx, num_experts, group, expert_scales, per_token_scales, tokens_dtype,
             expert_alignment, capacity, idx_type, expert_token_num_type) -> DispatchResult:
    """ep.dispatch on a torch.distributed group (None: the default group)."""
    error = local = None
    try:
        local = _Local(x, expert_idx, num_experts, group, expert_scales, per_token_scales,
                       tokens_dtype, expert_alignment, capacity, idx_type, expert_token_num_type)
    except Exception as caught:  # every rank hears of it before anything is sent
        error = caught
    counts = (None if local is None
              else torch.cat((local.unique, local.sent.to(local.unique.dtype))))
    agreement = _Agreement(group, "dispatch", error, _DISPATCH_AGREED,
                           () if local is None else local.agreed, True, counts)
    if local is not None:
        local.pack()
    matrix = agreement.result()
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    unique = matrix[:, :size]  # [source, destination]: the tokens rank s sends rank r
    blocks = matrix[:, size:].reshape(size, size, local.experts)  # [source, destination, expert]
    num_received = blocks.sum(axis=(0, 2))
    # Every rank checks every rank's capacity from the counts it has of all.
    over = np.flatnonzero(num_received > local.capacity) if local.capacity >= 0 else []
    if len(over):
        _refuse("dispatch", ValueError(
            f"capacity: rank {rank} receives {num_received[rank]} rows, more than capacity = "
            f"{local.capacity}") if rank in over else None, int(over[0]), _ERRORS.index(ValueError))
    num_slots = int(num_received[rank]) if local.capacity < 0 else local.capacity
    # R, moe_re_routing's output rows: A, and E * (k - 1) more with alignment k.
    alignment = local.reroute[0].expert_alignment
    num_rows = num_slots + (local.experts * (alignment - 1) if alignment > 1 else 0)
    received = torch.from_numpy(blocks[:, rank].astype(np.int32)).to(local.x.device)
    handle = Handle(group, local, blocks, unique, received, num_slots, num_rows)
    outputs = _Dispatch.apply(local.x, local.expert_scales, handle, local)
    return DispatchResult(*outputs, received, handle)


class _Dispatch(torch.autograd.Function):
    """The exchange of dispatch; backward: permute_tokens' gradient comes back
    as a combine without weights, permute_topk_weight's to expert_scales."""

    @staticmethod
    def forward(ctx, x, expert_scales, handle, local):
        base = torch.from_numpy(handle.token_base).to(handle.device)
        index = handle.sort((base[local.dest] + local.token_of_pair).int().reshape(-1))
        weights = None if expert_scales is None else handle.sort(expert_scales.reshape(-1))
        (tokens, scales), layout = handle.place(
            (local.rows, local.scale_rows), index, weights, handle.unique_sent,
            handle.unique_received)
        tokens = _typed(tokens, x, handle.num_rows)
        # Without scales: the layout call's [R] zeros.
        scales = layout[1] if scales is None else _typed(scales, local.per_token_scales,
                                                         handle.num_rows)
        ctx.handle = handle
        ctx.mark_non_differentiable(scales, layout[2], layout[3])
        if expert_scales is None:
            ctx.mark_non_differentiable(layout[4])
        return tokens, scales, layout[2], layout[3], layout[4]

    @staticmethod
    def backward(ctx, grad_tokens, _scales, _idx, _num, grad_weight):
        handle = ctx.handle
        needs_x, needs_weights = ctx.needs_input_grad[:2]
        pairs = handle.num_tokens * handle.top_k
        grads = [grad.contiguous() for grad, needed in ((grad_tokens, needs_x),
                                                        (grad_weight, needs_weights)) if needed]
        rows = [_typed(returned, grad, pairs)
                for returned, grad in zip(handle.bring_back(map(_byte_rows, grads)), grads)]
        grad_x = grad_weights = None
        if needs_x:
            grad_x = moe_finalize_routing(rows.pop(0), handle.row_idx, scales=handle.scales(None),
                                          drop_pad_mode=_ROW_MAJOR)
        if needs_weights:
            grad_weights = rows.pop(0)[handle.row_idx.long()].view(handle.num_tokens,
                                                                   handle.top_k)
        return grad_x, grad_weights, None, None, None


class _Combine(torch.autograd.Function):
    """The exchange and the weighted sum of combine; backward: a dispatch of
    the gradient, each pair's row grad_out[t] * w[t, j], and the weights'
    gradient, dot(grad_out[t], row(t, j))."""

    @staticmethod
    def forward(ctx, expert_out, weights, handle, ranked):
        expert_out = expert_out.contiguous()
        returned, = handle.bring_back([_byte_rows(expert_out)], [ranked])
        rows = _typed(returned, expert_out, handle.num_tokens * handle.top_k)
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
                sorted_weights = handle.sort(weights.reshape(-1))
                sorted_grad = (sorted_grad.float() * sorted_weights[:, None]).to(grad_out.dtype)
            (placed,), _ = handle.place((_byte_rows(sorted_grad.contiguous()),),
                                        handle.pair_index(), None, handle.sent_by_rank,
                                        handle.received_by_rank)
            grad_expert_out = _typed(placed, grad_out, handle.num_rows)
            grad_expert_out[handle.num_valid:] = 0  # the spare rows, which no pair reads
        if ctx.needs_input_grad[1]:
            pair_rows = rows[handle.row_idx.long()].float()
            grad_weights = (pair_rows.view(handle.num_tokens, handle.top_k, rows.shape[1])
                            * grad_out.float()[:, None, :]).sum(dim=-1)
        return grad_expert_out, grad_weights, None, None
