"""MoE token re-routing (MoeReRoutingV2) for NumPy arrays and PyTorch tensors.

``moe_re_routing`` reorders the rows received by the dispatch AlltoAll from
(source rank, local expert) order to (local expert, source rank) order, with
their scales and top-k weights; ``moe_re_routing_inverse`` puts them back.
Torch tensors go through the custom operators ``torch.ops.moe_reroute.*``
(registered at import when torch is installed); NumPy arrays go straight to
the C++ core. See SPEC.md for the contract.
"""

from __future__ import annotations

import importlib.util

from . import _bridge, _core
from ._core import __version__

if importlib.util.find_spec("torch") is not None:
    from . import _torch
else:
    _torch = None

__all__ = ["__version__", "dtype_table", "moe_re_routing", "moe_re_routing_inverse",
           "set_cuda_status_check"]


def dtype_table() -> list[dict]:
    """The core's dtype table: name, bits, npy_storage, torch_name, roles."""
    return [dict(row) for row in _bridge.TABLE]


def set_cuda_status_check(mode: str) -> str:
    """Sets what a call on CUDA tensors does with its device status word (bad
    counts are found on the device) and returns the previous mode: "raise"
    (default; one host sync per call, ValueError naming the argument; under
    CUDA graph capture "assert" instead), "assert" (torch._assert_async, no
    sync; a bad count then poisons the CUDA context) or "off" (no check)."""
    if _torch is None:
        raise RuntimeError("set_cuda_status_check: torch is not installed")
    return _torch.set_cuda_status_check(mode)


def _is_torch(array) -> bool:
    return _torch is not None and isinstance(array, _torch.torch.Tensor)


def _numpy_inputs(tokens, counts, scales, weight) -> list:
    named = {"tokens": tokens, "expert_token_num_per_rank": counts,
             "per_token_scales": scales, "expert_topk_weight": weight}
    for arg, array in named.items():
        if array is not None and not isinstance(array, _bridge.np.ndarray):
            raise TypeError(f"{arg}: expected a numpy.ndarray or torch.Tensor, "
                            f"got {type(array).__name__}")
    return _bridge.contiguous_inputs(_bridge.NUMPY, tokens, counts, scales, weight)


def moe_re_routing(tokens, expert_token_num_per_rank, *, per_token_scales=None,
                   expert_topk_weight=None, expert_token_num_type=1, idx_type=0,
                   tokens_dtype=None, out=None):
    """Returns (permute_tokens, permute_per_token_scales, permute_token_idx,
    expert_token_num, permute_topk_weight), as SPEC section 7.

    tokens [A, H] (uint8 storage plus ``tokens_dtype`` for hifloat8 / FP4, FP4
    as [A, H/2] bytes), expert_token_num_per_rank [N, E] int32/int64,
    per_token_scales [A] / [A, S] float32 or [A, K, 2] / [A, S] float8_e8m0
    (uint8 scales are read as float8_e8m0), expert_topk_weight [A, 1] / [A]
    float32. Torch tensors in, torch tensors out; NumPy in, NumPy out.
    ``out``: the five outputs to write (contiguous, the inferred shapes and
    dtypes); they are returned. Non-contiguous inputs are copied to contiguous
    ones. Raises TypeError (dtype) or ValueError (shape, value) naming the
    argument, before writing anything.
    """
    args = (per_token_scales, expert_topk_weight, expert_token_num_type, idx_type, tokens_dtype)
    if _is_torch(tokens):
        if out is None:
            return _torch.reroute(tokens, expert_token_num_per_rank, *args)
        _torch.reroute_out(tokens, expert_token_num_per_rank, *out, *args)
        return tuple(out)
    fw = _bridge.NUMPY
    tokens, counts, scales, weight = _numpy_inputs(tokens, expert_token_num_per_rank,
                                                   per_token_scales, expert_topk_weight)
    outputs = out if out is not None else _bridge.allocate_reroute(fw, tokens, counts, scales,
                                                                   weight)
    _bridge.run_reroute(fw, tokens, counts, scales, weight, outputs, expert_token_num_type,
                        idx_type, tokens_dtype)
    return tuple(outputs)


def moe_re_routing_inverse(tokens, expert_token_num_per_rank, *, per_token_scales=None,
                           expert_topk_weight=None, tokens_dtype=None):
    """Returns (restored_tokens, restored_per_token_scales, restored_topk_weight):
    expert-ordered rows back in rank order by the same counts, the optional
    outputs None exactly when their input is None.

    tokens [A, H] of any table dtype (uint8 storage plus ``tokens_dtype`` as for
    the forward); other arguments and errors as for ``moe_re_routing``. The
    torch operator returns an empty (0,) float32 tensor for an absent optional
    output; this function turns it into None.
    """
    if _is_torch(tokens):
        restored = _torch.inverse(tokens, expert_token_num_per_rank, per_token_scales,
                                  expert_topk_weight, tokens_dtype)
        return (restored[0], None if per_token_scales is None else restored[1],
                None if expert_topk_weight is None else restored[2])
    fw = _bridge.NUMPY
    tokens, counts, scales, weight = _numpy_inputs(tokens, expert_token_num_per_rank,
                                                   per_token_scales, expert_topk_weight)
    outputs = _bridge.allocate_inverse(fw, tokens, scales, weight)
    _bridge.run_inverse(fw, tokens, counts, scales, weight, outputs, tokens_dtype)
    return outputs
