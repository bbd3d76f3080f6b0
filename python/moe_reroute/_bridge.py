"""Framework-neutral glue: the core's dtype table, the input names, and the
attributes type-checked as the core module takes them (docs/spec.md section 4)."""

from __future__ import annotations

import operator

import numpy as np

from . import _core

TABLE = tuple(_core.dtype_table())
_ROWS = {row["name"]: row for row in TABLE}

# The core's description of each operator: its inputs, outputs and attributes.
OPERATORS = _core.OPERATORS
# moe_re_routing, moe_re_routing_inverse, moe_init_routing, moe_finalize_routing
REROUTE, INVERSE, INIT_ROUTING, FINALIZE_ROUTING = OPERATORS
INPUT_NAMES = tuple(name for name, _ in OPERATORS[REROUTE]["inputs"])
OUTPUT_NAMES = {op: tuple(output[0] for output in desc["outputs"])
                for op, desc in OPERATORS.items()}


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


_KINDS = {"int": int, "bool": bool, "dtype_name": str}


def attributes(op: str, values) -> tuple:
    """(the core's Attributes, tokens_dtype) from `values`, the attributes of
    `op` in its description's order, each type-checked (tokens_dtype: a str
    or None). Calls repeat their attributes: those of recent calls are kept,
    by value and type (True is not 1), and never changed once made."""
    key = (op, values, tuple(map(type, values)))
    try:
        parsed = _PARSED.get(key)
    except TypeError:  # an unhashable value, which _parsed refuses by name
        return _parsed(op, values)
    if parsed is None:
        parsed = _parsed(op, values)
        if len(_PARSED) >= 64:
            _PARSED.clear()
        _PARSED[key] = parsed
    return parsed


_PARSED = {}


def _parsed(op: str, values) -> tuple:
    result, tokens_dtype = OPERATORS[op]["attributes_class"](), None
    for (name, kind, _), value in zip(OPERATORS[op]["attributes"], values):
        if kind == "dtype_name":
            tokens_dtype = None if value is None else checked(name, value, str)
        else:
            setattr(result, name, checked(name, value, _KINDS[kind]))
    return result, tokens_dtype


def named_attributes(op: str, values: dict):
    """The core's attributes of `op` (it has no dtype_name one) from `values`
    by name, each type-checked."""
    names = [name for name, _, _ in OPERATORS[op]["attributes"]]
    return attributes(op, tuple(values[name] for name in names))[0]


def forward_out(out) -> tuple:
    """`out` as a tuple; ValueError unless it holds the forward's five outputs."""
    out = tuple(out)
    if len(out) != len(OUTPUT_NAMES[REROUTE]):
        raise ValueError(f"out: expected {len(OUTPUT_NAMES[REROUTE])} outputs, got {len(out)}")
    return out
