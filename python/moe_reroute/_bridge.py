"""Framework-neutral glue: the core's dtype table, the input names, and the
attributes type-checked as the core module takes them (docs/spec.md section 4)."""

from __future__ import annotations

import operator

import numpy as np

from . import _core

TABLE = tuple(_core.dtype_table())
_ROWS = {row["name"]: row for row in TABLE}

INPUT_NAMES = ("tokens", "expert_token_num_per_rank", "per_token_scales", "expert_topk_weight")


def row(name: str) -> dict:
    """The dtype table row named `name` (a name the core returned)."""
    return _ROWS[name]


INT64_MIN, INT64_MAX = -2**63, 2**63 - 1


def type_name(value) -> str:
    """The type of `value` as a user writes it: int, numpy.float32, torch.Tensor."""
    kind = type(value)
    if kind.__module__ == "builtins":
        return kind.__qualname__
    return f"{kind.__module__}.{kind.__qualname__}"


def checked(name: str, value, kind):
    """`value` as a `kind`, else TypeError naming `name`. An int is anything
    integral but a bool (operator.index: NumPy integers too, as NumPy's own
    functions take them) and must fit int64, as the core takes it (else
    ValueError); a bool is a Python or NumPy bool; a str is a str."""
    if kind is int and not isinstance(value, (bool, np.bool_)):
        try:
            value = operator.index(value)
        except TypeError:
            pass
        else:
            if not INT64_MIN <= value <= INT64_MAX:
                raise ValueError(f"{name}: {value} does not fit in int64")
            return value
    elif kind is bool and isinstance(value, (bool, np.bool_)):
        return bool(value)
    elif kind is str and isinstance(value, str):
        return value
    raise TypeError(f"{name}: expected {kind.__name__}, got {type_name(value)}")


def attributes(expert_token_num_type, idx_type, expert_alignment, allow_spare_rows) -> dict:
    """The forward's attributes as the core module takes them, type-checked."""
    return dict(expert_token_num_type=checked("expert_token_num_type", expert_token_num_type, int),
                idx_type=checked("idx_type", idx_type, int),
                **inverse_attributes(expert_alignment, allow_spare_rows))


def inverse_attributes(expert_alignment, allow_spare_rows) -> dict:
    return dict(expert_alignment=checked("expert_alignment", expert_alignment, int),
                allow_spare_rows=checked("allow_spare_rows", allow_spare_rows, bool))


def forward_out(out) -> tuple:
    """`out` as a tuple; ValueError unless it holds the forward's five outputs."""
    out = tuple(out)
    if len(out) != len(_core.FORWARD_OUTPUT_NAMES):
        raise ValueError(f"out: expected {len(_core.FORWARD_OUTPUT_NAMES)} outputs, "
                         f"got {len(out)}")
    return out


def tokens_name(tokens_dtype):
    """tokens_dtype, if None or a str; else TypeError naming it."""
    return None if tokens_dtype is None else checked("tokens_dtype", tokens_dtype, str)
