"""Expert-parallel dispatch and combine in which each byte crosses once
(docs/spec.md section 11): the sort by expert, the exchange and
moe_re_routing as one step, and the way back with the weighted top-k sum.

``group`` picks the runtime: an mpi4py communicator takes NumPy arrays (the
C++ component ``moe_reroute::ep``, one ``MPI_Alltoallw`` per call), a
torch.distributed process group (None: the default group) takes torch
tensors (gloo on CPU, NCCL on CUDA; autograd as in DeepEP: dispatch's
backward is a combine without weights, combine's a dispatch of the gradient).
mpi4py is needed only for the first.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["DispatchResult", "combine", "dispatch"]


class DispatchResult(NamedTuple):
    """dispatch's outputs on the rows this rank received: moe_re_routing's
    five, the counts each rank sent here, and the handle combine takes."""
    permute_tokens: Any             # [R, H], x's dtype, in (local expert, source rank) order
    permute_per_token_scales: Any   # the scales' form with R rows; [R] float32 zeros without
    permute_token_idx: Any          # [R] (idx_type 0) or [A] (idx_type 1) int32
    expert_token_num: Any           # [E] int32: counts (type 1) or padded cumsum (type 0)
    permute_topk_weight: Any        # [R] float32, each row's weight; (0,) without expert_scales
    expert_token_num_per_rank: Any  # [N, E] int32: row r, what rank r sent here
    handle: Any                     # what combine needs of this dispatch


def _is_mpi(group) -> bool:
    # Checked by the type's module, so that mpi4py is imported only by its users.
    return type(group).__module__.startswith("mpi4py")


def dispatch(x, expert_idx, num_experts: int, *, group=None, expert_scales=None,
             per_token_scales=None, tokens_dtype=None, expert_alignment: int = 1,
             capacity: int | None = None, idx_type: int = 0,
             expert_token_num_type: int = 1) -> DispatchResult:
    """Sends each (token, slot) pair of this rank to the rank of its expert
    (global expert g lives on rank g // E as local expert g % E, num_experts
    = N * E) and returns, on every rank, moe_re_routing's outputs for what
    arrived, in source-rank order, as a DispatchResult. Collective over
    `group`.

    x [T, H] of a token dtype (raw unsigned storage plus ``tokens_dtype``, as
    moe_re_routing), expert_idx [T, k] int32/int64 global experts,
    expert_scales [T, k] float32 (the top-k weights combine applies),
    per_token_scales in the forms moe_re_routing takes, with T rows.
    ``capacity`` fixes the receive rows A (static shapes, spare rows allowed;
    more arriving is refused); ``expert_alignment``, ``idx_type`` and
    ``expert_token_num_type`` are moe_re_routing's. A bad argument on any rank
    raises on every rank before anything is sent: TypeError or ValueError
    naming the argument on the rank that has it, the same type naming that
    rank on the others.
    """
    args = (x, expert_idx, num_experts, group, expert_scales, per_token_scales, tokens_dtype,
            expert_alignment, capacity, idx_type, expert_token_num_type)
    if _is_mpi(group):
        from . import _ep_mpi
        return _ep_mpi.dispatch(*args)
    from . import _ops
    _ops()  # the library's RuntimeError where this build has no torch operators
    from . import _ep_torch
    return _ep_torch.dispatch(*args)


def combine(expert_out, handle):
    """Sends expert_out [R, H'] (float16, bfloat16 or float32, in
    permute_tokens' row order) back to the source ranks and returns [T, H'] of
    its dtype: out[t] = the float32 sum over j in order of expert_scales[t, j]
    * row(t, j) (weight 1 without expert_scales), each step rounded on its
    own, as moe_finalize_routing computes it. Collective over the dispatch's
    group."""
    return handle.combine(expert_out)
