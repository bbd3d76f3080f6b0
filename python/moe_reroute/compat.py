"""Drop-in names for code written against the original's PyTorch APIs
(torch_npu): porting is changing an import. They take the original's argument
names and defaults where the semantics exist here, NumPy arrays or torch
tensors alike, and refuse what has no counterpart here (quantization, an
active expert range, a gather row index) with NotImplementedError naming the
argument. docs/spec.md section 8 lists what still differs.

    from moe_reroute.compat import npu_moe_init_routing_v2, npu_moe_finalize_routing
"""

from __future__ import annotations

import numpy as np

from . import (moe_finalize_routing, moe_init_routing, moe_re_routing as _moe_re_routing)

__all__ = ["moe_re_routing", "npu_moe_finalize_routing", "npu_moe_init_routing_v2",
           "npu_moe_re_routing"]


def npu_moe_re_routing(tokens, expert_token_num_per_rank, *, per_token_scales=None,
                       expert_token_num_type=1, idx_type=0):
    """torch_npu.npu_moe_re_routing: (permute_tokens, permute_per_token_scales,
    permute_token_idx, expert_token_num), the four outputs of MoeReRouting."""
    return _moe_re_routing(tokens, expert_token_num_per_rank, per_token_scales=per_token_scales,
                           expert_token_num_type=expert_token_num_type, idx_type=idx_type)[:4]


def moe_re_routing(tokens, expert_token_num_per_rank, per_token_scales=None,
                   expert_token_num_type=1, idx_type=0):
    """The published Python wrapper's form: per_token_scales (and the
    attributes) positional; the four outputs of npu_moe_re_routing."""
    return npu_moe_re_routing(tokens, expert_token_num_per_rank,
                              per_token_scales=per_token_scales,
                              expert_token_num_type=expert_token_num_type, idx_type=idx_type)


def _unsupported(name: str, value, why: str):
    raise NotImplementedError(f"{name}: {value!r} is not supported by moe_reroute ({why})")


def npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1,
                            expert_capacity=-1, expert_num=-1, drop_pad_mode=0,
                            expert_tokens_num_type=0, expert_tokens_num_flag=False,
                            quant_mode=-1, active_expert_range=None, row_idx_type=0):
    """torch_npu.npu_moe_init_routing_v2 without quantization: (expanded_x,
    expanded_row_idx, expert_token_cumsum_or_count, expanded_scale).

    -1 means "not set" for active_num, expert_capacity and expert_num, as in
    the original. expert_tokens_num_type 0 is the cumsum, 1 the count, output
    when expert_tokens_num_flag is set (else an empty (0,) output).
    expanded_scale is `scale` ([T] float32) moved with its token's rows (empty
    without scale). quant_mode defaults to -1 (none) here: the original's 0 and
    1 quantize, which this library does not."""
    if quant_mode != -1:
        _unsupported("quant_mode", quant_mode, "it does not quantize; pass -1")
    if offset is not None:
        _unsupported("offset", type(offset).__name__, "it does not quantize")
    if active_expert_range:
        _unsupported("active_expert_range", active_expert_range, "every expert is active")
    if row_idx_type != 0:
        _unsupported("row_idx_type", row_idx_type, "expanded_row_idx is the scatter index, 0")
    if expert_tokens_num_type not in (0, 1):
        _unsupported("expert_tokens_num_type", expert_tokens_num_type,
                     "0 (cumsum) and 1 (count) only")
    attributes = dict(
        active_num=max(active_num, 0), expert_capacity=max(expert_capacity, 0),
        expert_num=max(expert_num, 0), drop_pad_mode=drop_pad_mode,
        expert_tokens_count_or_cumsum_flag=(1 + expert_tokens_num_type
                                            if expert_tokens_num_flag else 0))
    expanded_x, expanded_row_idx, counts, _ = moe_init_routing(x, expert_idx, **attributes)
    if scale is None:
        expanded_scale = _empty_float32(counts)
    else:
        # The scales move as the rows do: the same sort, on one float32 column.
        expanded_scale = moe_init_routing(scale.reshape(-1, 1), expert_idx,
                                          **attributes)[0].reshape(-1)
    return expanded_x, expanded_row_idx, counts, expanded_scale


def _empty_float32(like):
    """An empty (0,) float32 array or tensor, as `like` is one (on its device)."""
    if isinstance(like, np.ndarray):
        return np.empty(0, np.float32)
    import torch  # like is a tensor: torch is there
    return like.new_empty(0, dtype=torch.float32)


def npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales,
                             expanded_src_to_dst_row, export_for_source_row, drop_pad_mode=0):
    """torch_npu.npu_moe_finalize_routing: positional as the original, the
    optional ones None where absent."""
    return moe_finalize_routing(expanded_permuted_rows, expanded_src_to_dst_row, x1=skip1,
                                x2=skip2, bias=bias, scales=scales,
                                expert_idx=export_for_source_row, drop_pad_mode=drop_pad_mode)
