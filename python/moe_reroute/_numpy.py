"""NumPy arrays (ml_dtypes ones included) to the C++ core: each array goes as
itself, its bytes read through the buffer protocol and its dtype by its name
and width, which the core's table reads; the core allocates the outputs by its
own specs."""

from __future__ import annotations

import numpy as np

from . import _bridge, _core


def check_array(array, name: str, first: str = "tokens"):
    """`array`, if a NumPy array; the call's first input (`first`) decides
    the framework of a call."""
    if array is None:
        raise TypeError(f"{name}: must be given, got None")
    if not isinstance(array, np.ndarray):
        expected = ("a numpy.ndarray or torch.Tensor" if name == first
                    else f"a numpy.ndarray, as {first} is one")
        raise TypeError(f"{name}: expected {expected}, got {_bridge.type_name(array)}")
    return array


def native(array):
    """`array` in C order and the machine's byte order, copied where it is not:
    the core reads counts as numbers, and allocates outputs in native order."""
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    return np.asarray(array, order="C")  # not ascontiguousarray: it makes 0-D arrays 1-D


def inputs(arrays, op: str = _bridge.REROUTE) -> list:
    """The inputs of `op` (None where optional and absent), copied to C order
    and native byte order where they are not."""
    described = _bridge.OPERATORS[op]["inputs"]
    first = described[0][0]
    return [None if a is None and optional else native(check_array(a, name, first))
            for a, (name, optional) in zip(arrays, described)]


def outputs(arrays, names) -> list:
    """The outputs, each checked writable and in native byte order."""
    for array, name in zip(arrays, names):
        if not check_array(array, name).dtype.isnative:
            raise TypeError(f"{name}: dtype {array.dtype.str} is not in native byte order")
        if not array.flags.writeable:
            raise ValueError(f"{name}: is read-only")
    return arrays


def reroute(arrays, attributes, tokens_dtype, out):
    """The forward into `out` (checked) or, without it, into fresh arrays that
    the core allocates by its own specs."""
    given = inputs(arrays)
    copied = {}
    if out is not None:
        out = outputs(out, _bridge.OUTPUT_NAMES[_bridge.REROUTE])
        # The caller's own arrays where the core gets copies: out= must not overlap them.
        copied = {name: a for a, g, name in zip(arrays, given, _bridge.INPUT_NAMES)
                  if g is not a}
    return _core.reroute(given, out, copied, attributes, tokens_dtype)


def inverse(arrays, attributes, tokens_dtype):
    return _core.inverse(inputs(arrays), attributes, tokens_dtype)


_ROUTING = {_bridge.INIT_ROUTING: _core.init_routing,
            _bridge.FINALIZE_ROUTING: _core.finalize_routing}


def routing(op, arrays, attributes):
    """moe_init_routing or moe_finalize_routing (`op`) on `arrays`, its
    inputs in order, into fresh arrays that the core allocates by its specs."""
    return _ROUTING[op](inputs(arrays, op), attributes)
