"""MoE token re-routing (MoeReRoutingV2) for NumPy arrays and PyTorch tensors.

``moe_re_routing`` reorders the rows received by the dispatch AlltoAll from
(source rank, local expert) order to (local expert, source rank) order, with
their scales and top-k weights; ``moe_re_routing_inverse`` puts them back.
``moe_init_routing`` sorts a rank's tokens by expert before the dispatch;
``moe_finalize_routing`` sums each token's k expert outputs after the combine.
Torch tensors go to the C++ operators ``torch.ops.moe_reroute.*`` (loaded at
import when this build has them, docs/torch.md); NumPy arrays go straight to
the C++ core. The contract: docs/spec.md.
"""

from __future__ import annotations

import importlib.util
import pathlib

from . import _bridge, _core, _numpy, ep
from ._core import __version__

# The torch operators exist where the package was built against a torch.
if (importlib.util.find_spec("torch") is not None
        and pathlib.Path(__file__).with_name("_torch_ops.so").exists()):
    from . import _torch
    _TENSOR = _torch.torch.Tensor  # looked up once: the check runs on every call
else:
    _torch = None
    _TENSOR = ()  # isinstance(x, ()) is False: nothing goes to the torch operators

__all__ = ["__version__", "cpu_output_cache_bytes", "cuda_check", "dtype_table", "ep",
           "moe_finalize_routing", "moe_init_routing", "moe_re_routing",
           "moe_re_routing_inverse", "set_cpu_output_cache_limit", "set_cuda_status_check"]


def dtype_table() -> list[dict]:
    """The core's dtype table: name, bits, npy_storage, torch_name, roles."""
    return [dict(row) for row in _bridge.TABLE]


def _ops():
    if _torch is None:
        raise RuntimeError("moe_reroute: this build has no torch operators (install it with "
                           "pip install --no-build-isolation . where torch is installed)")
    return _torch.OPS


def set_cuda_status_check(mode: str) -> str:
    """Sets when bad counts found on a CUDA device are reported, and returns
    the previous mode: "deferred" (the default: no host sync; the per-device
    status word is sticky until ``cuda_check()``) or "sync" (checked after
    every call with one host sync, raising ValueError; for debugging, not
    under CUDA graph capture)."""
    return _ops().set_cuda_status_check(mode)


def cuda_check() -> None:
    """Reads and clears every CUDA device's status word (one host sync each)
    and raises ValueError naming the argument if any call since the last check
    had bad counts (negative, or not summing as the contract says)."""
    _ops().cuda_check()


def set_cpu_output_cache_limit(limit_bytes: int) -> int:
    """Sets the most bytes of freed torch CPU outputs (those of 4 MiB and
    more) kept mapped for the next output of the same size, unmapping the
    oldest above it, and returns the previous limit (default 1 GiB; 0 keeps
    none and empties the cache)."""
    return _ops().set_cpu_output_cache_limit(limit_bytes)


def cpu_output_cache_bytes() -> int:
    """The bytes of freed torch CPU outputs the cache keeps now."""
    return _ops().cpu_output_cache_bytes()


def _refuse_torch(array) -> None:
    """Raises where `array` is a torch tensor and this build has no torch
    operators (found without importing torch)."""
    if _torch is None and type(array).__module__.startswith("torch"):
        _ops()


def moe_re_routing(tokens, expert_token_num_per_rank, *, per_token_scales=None,
                   expert_topk_weight=None, expert_token_num_type=1, idx_type=0,
                   tokens_dtype=None, expert_alignment=1, allow_spare_rows=False, out=None):
    """Returns (permute_tokens, permute_per_token_scales, permute_token_idx,
    expert_token_num, permute_topk_weight), as docs/spec.md section 7.

    tokens [A, H] of a token dtype (raw unsigned storage plus ``tokens_dtype``
    for hifloat8 / FP4 / FP8 / bfloat16, FP4 as [A, H/2] bytes),
    expert_token_num_per_rank [N, E] int32/int64, per_token_scales [A] / [A, S]
    float32 or [A], [A, S], [A, K, 2] float8_e8m0 (uint8 scales are read as
    float8_e8m0), expert_topk_weight [A, 1] / [A] float32. ``expert_alignment``
    k pads each expert's segment to a multiple of k rows (R = A + E*(k-1) rows
    when k > 1); ``allow_spare_rows`` lets the counts sum to less than A.
    Torch tensors in, torch tensors out; NumPy in, NumPy out. ``out``: the five
    outputs to write (contiguous, the inferred specs); they are returned. It
    has no autograd: as torch's own out= functions, it refuses torch tensors
    that require grad (with grad mode on) or carry forward-mode tangents.
    Raises TypeError (dtype), ValueError (shape, value) or RuntimeError
    (device runtime) naming the argument, before writing anything.
    """
    if out is not None:
        out = _bridge.forward_out(out)
    # The arguments go on positionally: at decode size each Python step shows.
    if isinstance(tokens, _TENSOR):
        if out is None:
            return _torch.FORWARD(tokens, expert_token_num_per_rank, per_token_scales,
                                  expert_topk_weight, expert_token_num_type, idx_type,
                                  tokens_dtype, expert_alignment, allow_spare_rows)
        _torch.FORWARD_OUT(tokens, expert_token_num_per_rank, *out, per_token_scales,
                           expert_topk_weight, expert_token_num_type, idx_type, tokens_dtype,
                           expert_alignment, allow_spare_rows)
        return out
    _refuse_torch(tokens)
    return _numpy.reroute(
        (tokens, expert_token_num_per_rank, per_token_scales, expert_topk_weight),
        *_bridge.attributes(_bridge.REROUTE, (expert_token_num_type, idx_type, tokens_dtype,
                                              expert_alignment, allow_spare_rows)), out)


def moe_re_routing_inverse(tokens, expert_token_num_per_rank, *, per_token_scales=None,
                           expert_topk_weight=None, tokens_dtype=None, expert_alignment=1,
                           allow_spare_rows=False):
    """Returns (restored_tokens, restored_per_token_scales, restored_topk_weight):
    R expert-ordered rows back to A = R - E*(k-1) rank-ordered rows by the same
    counts and attributes. An absent optional input gives an empty (0,) float32
    output, as the forward's permute_topk_weight. Arguments and errors as for
    ``moe_re_routing``; tokens may have any table dtype.
    """
    if isinstance(tokens, _TENSOR):
        return _torch.INVERSE(
            tokens, expert_token_num_per_rank, per_token_scales, expert_topk_weight,
            tokens_dtype, expert_alignment, allow_spare_rows)
    _refuse_torch(tokens)
    return _numpy.inverse(
        (tokens, expert_token_num_per_rank, per_token_scales, expert_topk_weight),
        *_bridge.attributes(_bridge.INVERSE, (tokens_dtype, expert_alignment, allow_spare_rows)))


def _routing(op: str, inputs: dict, attributes: dict):
    """`op` on its `inputs` and `attributes`, each by name: torch tensors go
    to its torch operator, NumPy arrays to the core."""
    first = next(iter(inputs.values()))
    if isinstance(first, _TENSOR):
        return getattr(_torch.OPS, op)(**inputs, **attributes)
    _refuse_torch(first)
    arrays = [inputs[name] for name, _ in _bridge.OPERATORS[op]["inputs"]]
    return _numpy.routing(op, arrays, _bridge.named_attributes(op, attributes))


def moe_init_routing(x, expert_idx, *, active_num=0, expert_capacity=0, expert_num=0,
                     drop_pad_mode=0, expert_tokens_count_or_cumsum_flag=0,
                     expert_tokens_before_capacity_flag=False):
    """Returns (expanded_x, expanded_row_idx, expert_tokens_count_or_cumsum,
    expert_tokens_before_capacity): x's rows sorted by expert (the stable sort
    of expert_idx flattened), as docs/spec.md's moe_init_routing section.

    x [T, H] of a token dtype, expert_idx [T, k] int32/int64 ids.
    drop_pad_mode 0: expanded_x [n, H] (n = T * k, or min(active_num, T * k)),
    expanded_row_idx int32 [T * k] (each position's row), and with
    expert_tokens_count_or_cumsum_flag 1 or 2 the int32 cumsum or count of
    each of the expert_num experts. drop_pad_mode 1: expanded_x [E, C, H]
    (E = expert_num, C = expert_capacity; unused slots zero, entries past C
    dropped, their expanded_row_idx -1), and with
    expert_tokens_before_capacity_flag the counts before dropping. Outputs a
    mode does not make are empty (0,) int32. Torch tensors in, torch tensors
    out (autograd: x's gradient sums its expanded rows'); NumPy in, NumPy out.
    Raises TypeError (dtype) or ValueError (shape, value) naming the argument,
    before writing anything.
    """
    return _routing(_bridge.INIT_ROUTING, dict(x=x, expert_idx=expert_idx), dict(
        active_num=active_num, expert_capacity=expert_capacity, expert_num=expert_num,
        drop_pad_mode=drop_pad_mode,
        expert_tokens_count_or_cumsum_flag=expert_tokens_count_or_cumsum_flag,
        expert_tokens_before_capacity_flag=expert_tokens_before_capacity_flag))


def moe_finalize_routing(expanded_x, expanded_row_idx, *, x1=None, x2=None, bias=None,
                         scales=None, expert_idx=None, drop_pad_mode=0):
    """Returns out [T, H]: per token t, in float32, x1 + x2, then for j = 0 ..
    k - 1 (expanded_x[row] + bias[expert_idx[t, j]]) * scales[t, j] added,
    cast to expanded_x's dtype, as docs/spec.md's moe_finalize_routing section.

    expanded_x [T * k, H] (drop_pad_mode 0, 2) or [E, C, H] (1, 3) float16,
    bfloat16 or float32; expanded_row_idx int32 [T * k]: the row of (t, j) at
    [j * T + t] (modes 0, 1) or [t * k + j] (modes 2, 3, moe_init_routing's
    layout); rows -1 (modes 1, 3) or past expanded_x (modes 0, 2) are skipped.
    x1, x2 [T, H], bias [E, H] (with expert_idx int32 [T, k]) of expanded_x's
    dtype; scales [T, k] of that dtype, or float32; k is
    scales' dim 1, or 1 without scales. Torch tensors in, torch tensors out
    (autograd for expanded_x, x1, x2, bias and scales); NumPy in, NumPy out.
    Raises TypeError (dtype) or ValueError (shape, value) naming the argument,
    before writing anything.
    """
    return _routing(_bridge.FINALIZE_ROUTING, dict(
        expanded_x=expanded_x, expanded_row_idx=expanded_row_idx, x1=x1, x2=x2, bias=bias,
        scales=scales, expert_idx=expert_idx), dict(drop_pad_mode=drop_pad_mode))
