"""moe_reroute.ep over an mpi4py communicator: NumPy arrays to the C++
component moe_reroute::ep (the module _ep), the communicator by its handle.
A rank whose arguments fail the checks here still joins the call's
agreement (refuse_*), so that every rank raises and none waits."""

from __future__ import annotations

from . import _bridge, _numpy
from .ep import DispatchResult


def _module():
    try:
        from . import _ep
    except ImportError:
        raise RuntimeError("moe_reroute.ep: this build has no MPI support (moe_reroute._ep is "
                           "built when CMake finds MPI: install libopenmpi-dev or another MPI "
                           "and reinstall moe_reroute)") from None
    return _ep


def _code(error: Exception) -> str:
    """The core's code for an error of the checks here (the C++ side raises
    it back as the same Python type)."""
    return "unsupported" if isinstance(error, TypeError) else "invalid_argument"


class Handle:
    """What combine needs of a dispatch, and the communicator it ran on
    (kept alive here: the C++ handle holds its handle only)."""

    __slots__ = ("_handle", "_group")

    def __init__(self, handle, group):
        self._handle, self._group = handle, group

    def combine(self, expert_out):
        ep = _module()
        try:
            expert_out = _numpy.native(_numpy.check_array(expert_out, "expert_out", "expert_out"))
        except (TypeError, ValueError) as error:
            ep.refuse_combine(self._handle, _code(error), str(error))
        return ep.combine(self._handle, expert_out)


def dispatch(x, expert_idx, num_experts, group, expert_scales, per_token_scales, tokens_dtype,
             expert_alignment, capacity, idx_type, expert_token_num_type) -> DispatchResult:
    ep = _module()
    from mpi4py import MPI  # imported by the caller already: group is one of its communicators
    comm = MPI._handleof(group)
    try:
        attributes = ep.DispatchAttributes()
        attributes.num_experts = _bridge.checked("num_experts", num_experts, int)
        attributes.expert_alignment = _bridge.checked("expert_alignment", expert_alignment, int)
        attributes.capacity = -1 if capacity is None else _bridge.checked("capacity", capacity, int)
        attributes.idx_type = _bridge.checked("idx_type", idx_type, int)
        attributes.expert_token_num_type = _bridge.checked(
            "expert_token_num_type", expert_token_num_type, int)
        if tokens_dtype is not None:
            tokens_dtype = _bridge.checked("tokens_dtype", tokens_dtype, str)
        arrays = [None if a is None and optional
                  else _numpy.native(_numpy.check_array(a, name, "x"))
                  for a, name, optional in ((x, "x", False), (expert_idx, "expert_idx", False),
                                            (expert_scales, "expert_scales", True),
                                            (per_token_scales, "per_token_scales", True))]
    except (TypeError, ValueError) as error:
        ep.refuse_dispatch(comm, _code(error), str(error))
    *outputs, handle = ep.dispatch(comm, *arrays, attributes, tokens_dtype)
    return DispatchResult(*outputs, Handle(handle, group))
