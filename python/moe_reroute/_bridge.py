"""Framework-neutral glue: dtype names from the core's table, the storage the
core module reads, output allocation by SPEC section 4, and the calls."""

from __future__ import annotations

import numpy as np

from . import _core

TABLE = tuple(_core.dtype_table())

# SPEC names and framework names (NumPy / ml_dtypes dtype.name, torch dtype
# name) to table rows.
_ROWS = {row["name"]: row for row in TABLE} | {
    row["torch_name"]: row for row in TABLE if row["torch_name"]
}

# Scales stored as uint8 are read as this dtype.
UINT8_SCALES = "float8_e8m0"


class Framework:
    """What differs between NumPy and torch: dtype names, byte views, allocation."""

    # Dtypes that cross DLPack as themselves; the rest travel as unsigned storage.
    native: frozenset[str]

    def dtype_name(self, dtype) -> str: ...
    def unsigned_view(self, array): ...
    def contiguous(self, array): ...
    def plain(self, array): ...
    def empty(self, shape, dtype, like): ...
    float32: object
    int32: object


class NumpyFramework(Framework):
    native = frozenset({"float16", "float32", "int8", "uint8", "int32", "int64"})
    float32 = np.float32
    int32 = np.int32

    def dtype_name(self, dtype):
        return dtype.name

    def unsigned_view(self, array):
        return array.view(f"u{array.dtype.itemsize}")

    def contiguous(self, array):
        return np.ascontiguousarray(array)

    def plain(self, array):
        return array

    def empty(self, shape, dtype, like):
        return np.empty(shape, dtype)


NUMPY = NumpyFramework()


def core_array(fw: Framework, array, arg: str, name: str | None = None, name_arg: str = "",
               named: bool = False):
    """(array the core module reads, dtype name or None) for `array`.

    Native dtypes go as they are (the core module checks `name` against them);
    other table dtypes go, where the argument takes a name (`named`), as
    unsigned storage of the same width under their table name. Raises TypeError
    for any other dtype.
    """
    array = fw.plain(array)
    own = fw.dtype_name(array.dtype)
    if own in fw.native:
        return array, name
    row = _ROWS.get(own)
    if row is None or not named:
        raise TypeError(f"{arg}: dtype {own} is not supported")
    if name is not None and name != row["name"]:
        raise TypeError(f"{name_arg}: '{name}' names the dtype of uint8 storage, but {arg} is {own}")
    return fw.unsigned_view(array), row["name"]


def _dim(array, d: int) -> int:
    """Dim d, or 0 where the array has too few dims (the core then refuses it)."""
    return array.shape[d] if array.ndim > d else 0


def allocate_reroute(fw: Framework, tokens, counts, scales, weight) -> tuple:
    """Empty outputs of the forward, shaped as SPEC section 4 infers them."""
    num_tokens = _dim(tokens, 0)
    return (
        fw.empty(tokens.shape, tokens.dtype, tokens),
        fw.empty(scales.shape, scales.dtype, tokens)
        if scales is not None
        else fw.empty((num_tokens,), fw.float32, tokens),
        fw.empty((num_tokens,), fw.int32, tokens),
        fw.empty((_dim(counts, 1),), counts.dtype, tokens),
        fw.empty(weight.shape, weight.dtype, tokens)
        if weight is not None
        else fw.empty((0,), fw.float32, tokens),
    )


def allocate_inverse(fw: Framework, tokens, scales, weight) -> tuple:
    """Empty outputs of the inverse; None for an absent optional input."""
    return (
        fw.empty(tokens.shape, tokens.dtype, tokens),
        None if scales is None else fw.empty(scales.shape, scales.dtype, tokens),
        None if weight is None else fw.empty(weight.shape, weight.dtype, tokens),
    )


def _scales(fw: Framework, scales, arg: str = "per_token_scales"):
    if scales is None:
        return None, None
    is_uint8 = fw.dtype_name(scales.dtype) == "uint8"
    return core_array(fw, scales, arg, UINT8_SCALES if is_uint8 else None, arg, named=True)


def contiguous_inputs(fw: Framework, *arrays) -> list:
    return [None if a is None else fw.contiguous(a) for a in arrays]


def _plain(fw: Framework, array, arg: str):
    return None if array is None else core_array(fw, array, arg)[0]


def run_reroute(fw, tokens, counts, scales, weight, outputs, expert_token_num_type, idx_type,
                tokens_dtype) -> None:
    """Runs the forward into `outputs` (5 arrays); inputs must be contiguous."""
    tokens_core, tokens_name = core_array(fw, tokens, "tokens", tokens_dtype, "tokens_dtype", True)
    scales_core, scales_name = _scales(fw, scales)
    arg = "permute_tokens"
    out_tokens = core_array(fw, outputs[0], arg, tokens_name, arg, True)[0]
    arg = "permute_per_token_scales"
    out_scales = core_array(fw, outputs[1], arg, scales_name, arg, True)[0]
    _core.reroute(tokens_core, _plain(fw, counts, "expert_token_num_per_rank"), scales_core,
                  _plain(fw, weight, "expert_topk_weight"), out_tokens, out_scales,
                  _plain(fw, outputs[2], "permute_token_idx"),
                  _plain(fw, outputs[3], "expert_token_num"),
                  _plain(fw, outputs[4], "permute_topk_weight"), expert_token_num_type, idx_type,
                  tokens_name, scales_name)


def run_inverse(fw, tokens, counts, scales, weight, outputs, tokens_dtype) -> None:
    """Runs the inverse into `outputs` (restored tokens, scales or None, weight or None)."""
    tokens_core, tokens_name = core_array(fw, tokens, "tokens", tokens_dtype, "tokens_dtype", True)
    scales_core, scales_name = _scales(fw, scales)
    arg = "restored_tokens"
    out_tokens = core_array(fw, outputs[0], arg, tokens_name, arg, True)[0]
    out_scales = None
    if outputs[1] is not None:
        arg = "restored_per_token_scales"
        out_scales = core_array(fw, outputs[1], arg, scales_name, arg, True)[0]
    _core.inverse(tokens_core, _plain(fw, counts, "expert_token_num_per_rank"), scales_core,
                  _plain(fw, weight, "expert_topk_weight"), out_tokens, out_scales,
                  _plain(fw, outputs[2], "restored_topk_weight"), tokens_name, scales_name)
