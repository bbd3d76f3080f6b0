"""Framework-neutral glue: dtype names from the core's table, the storage the
core module reads, output allocation by SPEC section 4, and the calls."""

from __future__ import annotations

import functools

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
    """What differs between NumPy and torch: dtype names, byte views, allocation,
    and the object handed to the core module (a DLPack producer or capsule)."""

    # Dtypes that cross DLPack as themselves; the rest travel as unsigned storage.
    native: frozenset[str]
    float32: object
    int32: object

    def __init__(self):
        self.kinds: dict = {}

    def dtype_name(self, dtype) -> str: ...
    def unsigned_view(self, array): ...
    def contiguous(self, array): ...
    def export(self, array): ...
    def empty(self, shape, dtype, like): ...
    def empty_like(self, array): ...

    def kind(self, dtype) -> tuple[str, str | None]:
        """(framework name, table name) of `dtype`; the table name is None for
        a native dtype and "" for one outside the table. Cached per dtype."""
        kind = self.kinds.get(dtype)
        if kind is None:
            own = self.dtype_name(dtype)
            row = None if own in self.native else _ROWS.get(own, {"name": ""})["name"]
            kind = self.kinds[dtype] = (own, row)
        return kind


class NumpyFramework(Framework):
    native = frozenset({"float16", "float32", "int8", "uint8", "int32", "int64"})
    float32 = np.float32
    int32 = np.int32

    def dtype_name(self, dtype):
        return dtype.name

    def unsigned_view(self, array):
        return array.view(f"u{array.dtype.itemsize}")

    contiguous = staticmethod(np.ascontiguousarray)

    def export(self, array):
        return array

    def empty(self, shape, dtype, like):
        return np.empty(shape, dtype)

    empty_like = staticmethod(functools.partial(np.empty_like, order="C"))


NUMPY = NumpyFramework()


def core_array(fw: Framework, array, arg: str, name: str | None = None, name_arg: str = "",
               named: bool = False):
    """(what the core module reads, dtype name or None) for `array`.

    Native dtypes go as they are (the core module checks `name` against them);
    other table dtypes go, where the argument takes a name (`named`), as
    unsigned storage of the same width under their table name. Raises TypeError
    for any other dtype.
    """
    own, row = fw.kind(array.dtype)
    if row is None:
        return fw.export(array), name
    if not row or not named:
        raise TypeError(f"{arg}: dtype {own} is not supported")
    if name is not None and name != row:
        raise TypeError(f"{name_arg}: '{name}' names the dtype of uint8 storage, "
                        f"but {arg} is {own}")
    return fw.export(fw.unsigned_view(array)), row


def dim(array, d: int) -> int:
    """Dim d, or 0 where the array has too few dims (the core then refuses it)."""
    return array.shape[d] if array.ndim > d else 0


def allocate_reroute(fw: Framework, tokens, counts, scales, weight) -> tuple:
    """Empty outputs of the forward, shaped as SPEC section 4 infers them."""
    num_tokens = dim(tokens, 0)
    return (
        fw.empty_like(tokens),
        fw.empty((num_tokens,), fw.float32, tokens) if scales is None else fw.empty_like(scales),
        fw.empty((num_tokens,), fw.int32, tokens),
        fw.empty((dim(counts, 1),), counts.dtype, tokens),
        fw.empty((0,), fw.float32, tokens) if weight is None else fw.empty_like(weight),
    )


def allocate_inverse(fw: Framework, tokens, scales, weight) -> tuple:
    """Empty outputs of the inverse; None for an absent optional input."""
    return (
        fw.empty_like(tokens),
        None if scales is None else fw.empty_like(scales),
        None if weight is None else fw.empty_like(weight),
    )


def _scales(fw: Framework, scales, arg: str = "per_token_scales"):
    if scales is None:
        return None, None
    is_uint8 = fw.kind(scales.dtype)[0] == "uint8"
    return core_array(fw, scales, arg, UINT8_SCALES if is_uint8 else None, arg, named=True)


def contiguous_inputs(fw: Framework, *arrays) -> list:
    contiguous = fw.contiguous
    return [None if a is None else contiguous(a) for a in arrays]


def _plain(fw: Framework, arrays, args) -> list:
    """The arrays of a native dtype (counts, weights, indices) as the core reads them."""
    return [None if a is None else core_array(fw, a, arg)[0] for a, arg in zip(arrays, args)]


_REROUTE_PLAIN = ("expert_token_num_per_rank", "expert_topk_weight", "permute_token_idx",
                  "expert_token_num", "permute_topk_weight")
_INVERSE_PLAIN = ("expert_token_num_per_rank", "expert_topk_weight", "restored_topk_weight")


def reroute_args(fw, tokens, counts, scales, weight, outputs, expert_token_num_type, idx_type,
                 tokens_dtype) -> tuple:
    """The arguments of the core module's reroute for these (contiguous) inputs
    and 5 outputs; raises TypeError for a dtype the core cannot be given."""
    tokens_core, tokens_name = core_array(fw, tokens, "tokens", tokens_dtype, "tokens_dtype", True)
    scales_core, scales_name = _scales(fw, scales)
    arg = "permute_tokens"
    out_tokens = core_array(fw, outputs[0], arg, tokens_name, arg, True)[0]
    arg = "permute_per_token_scales"
    out_scales = core_array(fw, outputs[1], arg, scales_name, arg, True)[0]
    counts, weight, idx, num, out_weight = _plain(
        fw, (counts, weight, outputs[2], outputs[3], outputs[4]), _REROUTE_PLAIN)
    return (tokens_core, counts, scales_core, weight, out_tokens, out_scales, idx, num, out_weight,
            expert_token_num_type, idx_type, tokens_name, scales_name)


def inverse_args(fw, tokens, counts, scales, weight, outputs, tokens_dtype) -> tuple:
    """The arguments of the core module's inverse for these (contiguous) inputs
    and outputs (restored tokens, scales or None, weight or None)."""
    tokens_core, tokens_name = core_array(fw, tokens, "tokens", tokens_dtype, "tokens_dtype", True)
    scales_core, scales_name = _scales(fw, scales)
    arg = "restored_tokens"
    out_tokens = core_array(fw, outputs[0], arg, tokens_name, arg, True)[0]
    out_scales = None
    if outputs[1] is not None:
        arg = "restored_per_token_scales"
        out_scales = core_array(fw, outputs[1], arg, scales_name, arg, True)[0]
    counts, weight, out_weight = _plain(fw, (counts, weight, outputs[2]), _INVERSE_PLAIN)
    return (tokens_core, counts, scales_core, weight, out_tokens, out_scales, out_weight,
            tokens_name, scales_name)


def run_reroute(fw, *args) -> None:
    """Runs the forward on the CPU; arguments as reroute_args."""
    _core.reroute(*reroute_args(fw, *args))


def run_inverse(fw, *args) -> None:
    """Runs the inverse on the CPU; arguments as inverse_args."""
    _core.inverse(*inverse_args(fw, *args))
