"""Forward and inverse against the naive reference: every token dtype, every
scale layout, both index types, both count modes, zero and skewed counts,
A = 0, through NumPy, moe_reroute's torch entry and torch.ops directly. The
NumPy cases run without torch too: scripts/test.sh installs the package in
an environment without torch, as README's plain `pip install .` does, and
runs this file there."""

from __future__ import annotations

import os
import pathlib
import re
import signal

import numpy as np
import pytest

import moe_reroute
import reference
from cases import (FRAMEWORKS, SCALE_CASES, TOKEN_CASES, array_type, as_numpy, byte_rows,
                   counts_array, framework_dtype, make_inputs, pairs, poisoned_outputs,
                   random_array, seeded, torch)

NUM_TRIALS = 4


def assert_matches_input(output, array):
    assert output.dtype == array.dtype
    assert tuple(output.shape) == tuple(array.shape)


def assert_absent(framework, output):
    """An absent optional output: empty (0,) float32."""
    assert isinstance(output, array_type(framework))
    assert output.dtype == framework_dtype(framework, "float32") and tuple(output.shape) == (0,)


def check_forward(framework, result, tokens, counts, scales, weight, attributes):
    expected = reference.reroute(
        byte_rows(tokens), counts, None if scales is None else byte_rows(scales),
        None if weight is None else byte_rows(weight), **attributes)
    assert all(isinstance(x, array_type(framework)) for x in result)
    f32 = framework_dtype(framework, "float32")
    assert_matches_input(result[0], tokens)
    np.testing.assert_array_equal(byte_rows(result[0]), expected[0])
    if scales is not None:
        assert_matches_input(result[1], scales)
    else:
        assert result[1].dtype == f32 and tuple(result[1].shape) == (tokens.shape[0],)
    np.testing.assert_array_equal(byte_rows(result[1]), expected[1])
    assert result[2].dtype == framework_dtype(framework, "int32")
    np.testing.assert_array_equal(as_numpy(result[2]), expected[2])
    assert as_numpy(result[3]).dtype == counts.dtype
    np.testing.assert_array_equal(as_numpy(result[3]), expected[3])
    if weight is not None:
        assert_matches_input(result[4], weight)
        np.testing.assert_array_equal(byte_rows(result[4]), expected[4])
    else:
        assert result[4].dtype == f32 and tuple(result[4].shape) == (0,)


def call_forward(framework, form, tokens, counts, scales, weight, attributes, tokens_dtype):
    counts = counts_array(framework, counts)
    kwargs = dict(per_token_scales=scales, expert_topk_weight=weight,
                  tokens_dtype=tokens_dtype, **attributes)
    if form == "out":
        out = poisoned_outputs(framework, tokens, counts, scales, weight)
        result = moe_reroute.moe_re_routing(tokens, counts, **kwargs, out=out)
        assert all(r is o for r, o in zip(result, out))
        return result
    if form == "torch.ops":
        return torch.ops.moe_reroute.moe_re_routing(tokens, counts, **kwargs)
    return moe_reroute.moe_re_routing(tokens, counts, **kwargs)


FORMS = {"numpy": ("allocate", "out"), "torch": ("allocate", "out", "torch.ops")}
EXPRESSIBLE = [(framework, case) for framework in FRAMEWORKS for case in TOKEN_CASES
               if case.dtype(framework) is not None]


@pytest.mark.parametrize(("framework", "case", "form"),
                         [(f, c, form) for f, c in EXPRESSIBLE for form in FORMS[f]],
                         ids=lambda p: getattr(p, "label", p))
def test_forward_matches_reference(framework, case, form):
    rng = seeded(framework, case.label, form)
    for trial in range(NUM_TRIALS):
        counts, tokens, scales, weight = make_inputs(framework, case, rng, trial)
        attributes = dict(expert_token_num_type=trial % 2, idx_type=(trial // 2) % 2)
        result = call_forward(framework, form, tokens, counts, scales, weight, attributes,
                              case.tokens_dtype)
        check_forward(framework, result, tokens, counts, scales, weight, attributes)


@pytest.mark.parametrize(("framework", "case"), EXPRESSIBLE, ids=lambda p: getattr(p, "label", p))
def test_inverse_matches_reference_and_undoes_forward(framework, case):
    rng = seeded(framework, case.label, "inverse")
    for trial in range(NUM_TRIALS):
        counts, tokens, scales, weight = make_inputs(framework, case, rng, trial)
        counts_in = counts_array(framework, counts)
        restored = moe_reroute.moe_re_routing_inverse(
            tokens, counts_in, per_token_scales=scales, expert_topk_weight=weight,
            tokens_dtype=case.tokens_dtype)
        expected = reference.inverse(byte_rows(tokens), counts,
                                     None if scales is None else byte_rows(scales),
                                     None if weight is None else byte_rows(weight))
        for output, array, want in zip(restored, (tokens, scales, weight), expected):
            if array is None:
                assert_absent(framework, output)
                continue
            assert isinstance(output, array_type(framework))
            assert_matches_input(output, array)
            np.testing.assert_array_equal(byte_rows(output), want)

        permuted = moe_reroute.moe_re_routing(tokens, counts_in, per_token_scales=scales,
                                              expert_topk_weight=weight,
                                              tokens_dtype=case.tokens_dtype)
        back = moe_reroute.moe_re_routing_inverse(
            permuted[0], counts_in, per_token_scales=None if scales is None else permuted[1],
            expert_topk_weight=None if weight is None else permuted[4],
            tokens_dtype=case.tokens_dtype)
        np.testing.assert_array_equal(byte_rows(back[0]), byte_rows(tokens))
        if scales is not None:
            np.testing.assert_array_equal(byte_rows(back[1]), byte_rows(scales))
        if weight is not None:
            np.testing.assert_array_equal(byte_rows(back[2]), byte_rows(weight))


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("dtype", ["int32", "int64", "float16"])
def test_inverse_takes_any_table_dtype(framework, dtype):
    rng = np.random.default_rng(7)
    counts = reference.random_counts(rng, 50)
    itemsize = np.dtype(dtype).itemsize
    tokens = random_array(framework, rng, framework_dtype(framework, dtype), (50, 6), itemsize)
    restored, scales, weight = moe_reroute.moe_re_routing_inverse(
        tokens, counts_array(framework, counts))
    assert_absent(framework, scales)
    assert_absent(framework, weight)
    np.testing.assert_array_equal(byte_rows(restored),
                                  reference.inverse(byte_rows(tokens), counts)[0])


@pytest.mark.skipif(torch is None, reason="no torch here")
def test_inverse_torch_op_returns_empty_for_absent_outputs():
    counts = torch.tensor([[2, 1]], dtype=torch.int32)
    tokens = torch.arange(6, dtype=torch.float32).reshape(3, 2) + 1
    restored = torch.ops.moe_reroute.moe_re_routing_inverse(tokens, counts)
    assert torch.equal(restored[0], tokens[[0, 1, 2]])
    for absent in restored[1:]:
        assert absent.dtype == torch.float32 and absent.shape == (0,)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_noncontiguous_inputs_are_made_contiguous(framework):
    rng = np.random.default_rng(3)
    counts = reference.random_counts(rng, 40)
    wide = random_array(framework, rng, framework_dtype(framework, "float16"), (40, 16), 2)
    tokens = wide[:, ::2]
    scales = random_array(framework, rng, framework_dtype(framework, "float32"), (40, 4), 4)
    scales = scales.T.copy().T if framework == "numpy" else scales.t().contiguous().t()
    result = moe_reroute.moe_re_routing(tokens, counts_array(framework, counts),
                                        per_token_scales=scales)
    check_forward(framework, result, tokens, counts, scales, None,
                  dict(expert_token_num_type=1, idx_type=0))


@pytest.mark.parametrize("count_dtype", [np.int32, np.int64])
def test_numpy_inputs_in_the_other_byte_order_are_read_by_value(count_dtype):
    """Inputs in non-native byte order (np.load of another machine's file) are
    converted, as non-contiguous ones are: native outputs of the same values.
    out= arrays must be native (the core writes native numbers)."""
    rng = np.random.default_rng(4)
    counts = reference.random_counts(rng, 40, count_dtype)
    tokens = random_array("numpy", rng, np.float16, (40, 6), 2)
    scales = random_array("numpy", rng, np.float32, (40,), 4)
    weight = random_array("numpy", rng, np.float32, (40, 1), 4)
    swapped = [a.astype(a.dtype.newbyteorder()) for a in (tokens, counts, scales, weight)]
    result = moe_reroute.moe_re_routing(swapped[0], swapped[1], per_token_scales=swapped[2],
                                        expert_topk_weight=swapped[3])
    check_forward("numpy", result, tokens, counts, scales, weight,
                  dict(expert_token_num_type=1, idx_type=0))
    restored = moe_reroute.moe_re_routing_inverse(
        result[0].astype(result[0].dtype.newbyteorder()), swapped[1],
        per_token_scales=swapped[2], expert_topk_weight=swapped[3])
    np.testing.assert_array_equal(byte_rows(restored[0]), byte_rows(tokens))

    out = list(result)
    out[2] = out[2].astype(out[2].dtype.newbyteorder())
    message = f"permute_token_idx: dtype {out[2].dtype.str} is not in native byte order"
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        moe_reroute.moe_re_routing(tokens, counts, per_token_scales=scales,
                                   expert_topk_weight=weight, out=out)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_numpy_scalar_attributes_act_as_python_ones(framework):
    """NumPy integers and bools as attributes (what np.lcm or a loaded config
    gives), as NumPy's own functions take them: the same bytes as Python ints."""
    rng = np.random.default_rng(5)
    counts = reference.random_counts(rng, 40)
    tokens = random_array(framework, rng, framework_dtype(framework, "float16"), (40, 6), 2)
    attributes = dict(expert_token_num_type=np.int8(0), idx_type=np.uint64(1),
                      expert_alignment=np.int64(1), allow_spare_rows=np.bool_(True))
    result = moe_reroute.moe_re_routing(tokens, counts_array(framework, counts), **attributes)
    check_forward(framework, result, tokens, counts, None, None,
                  dict(expert_token_num_type=0, idx_type=1))
    padded = moe_reroute.moe_re_routing(tokens, counts_array(framework, counts),
                                        expert_alignment=np.int64(4))
    assert padded[0].shape[0] == reference.rows_out(40, counts.shape[1], 4)
    restored = moe_reroute.moe_re_routing_inverse(padded[0], counts_array(framework, counts),
                                                  expert_alignment=np.int32(4),
                                                  allow_spare_rows=np.bool_(False))
    np.testing.assert_array_equal(byte_rows(restored[0]), byte_rows(tokens))


def test_spec_worked_example():
    counts = np.array([[1, 0, 2], [2, 1, 0]], np.int32)
    tokens = (np.arange(12, dtype=np.float16) + 1).reshape(6, 2)
    permuted, _, gather, totals, _ = moe_reroute.moe_re_routing(tokens, counts)
    np.testing.assert_array_equal(permuted, tokens[[0, 3, 4, 5, 1, 2]])
    np.testing.assert_array_equal(gather, [0, 3, 4, 5, 1, 2])
    np.testing.assert_array_equal(totals, [3, 1, 2])
    _, _, scatter, cumsum, _ = moe_reroute.moe_re_routing(tokens, counts, idx_type=1,
                                                          expert_token_num_type=0)
    np.testing.assert_array_equal(scatter, [0, 4, 5, 1, 2, 3])
    np.testing.assert_array_equal(cumsum, [3, 4, 6])


def test_dtype_table_is_the_cores():
    table = moe_reroute.dtype_table()
    names = [row["name"] for row in table]
    assert names[:3] == ["float16", "bfloat16", "int8"]
    assert {"hifloat8", "float4_e2m1", "float4_e1m2", "float8_e8m0"} <= set(names)
    for row in table:
        if row["torch_name"] and hasattr(torch, row["torch_name"]):
            assert isinstance(getattr(torch, row["torch_name"]), torch.dtype)


PAIRING = [(case, scales) for case in TOKEN_CASES for scales in SCALE_CASES[1:]
           if case.dtype("numpy") is not None]


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize(("case", "scale_case"), PAIRING,
                         ids=[f"{c.label}-{s.label}" for c, s in PAIRING])
def test_pairing_table(framework, case, scale_case):
    """Each (tokens, scales) row of the rule-7 table: accepted and moved bit
    for bit, or refused naming per_token_scales."""
    if case.dtype(framework) is None:
        pytest.skip(f"{framework} has no {case.label}")
    rng = seeded("pairing", framework, case.label, scale_case.label)
    counts = reference.random_counts(rng, 30)
    element_bytes = max(1, case.bits // 8)
    tokens = random_array(framework, rng, case.dtype(framework), (30, 8 // element_bytes * 2),
                          element_bytes)
    scales = random_array(framework, rng, scale_case.numpy_dtype if framework == "numpy"
                          else scale_case.torch_dtype, (30, *scale_case.trailing),
                          scale_case.itemsize)
    call = lambda: moe_reroute.moe_re_routing(  # noqa: E731
        tokens, counts_array(framework, counts), per_token_scales=scales,
        tokens_dtype=case.tokens_dtype)
    if not pairs(case, scale_case):
        with pytest.raises((TypeError, ValueError), match="^per_token_scales: "):
            call()
        return
    check_forward(framework, call(), tokens, counts, scales, None, {})


def misaligned(framework, values: np.ndarray):
    """`values` in memory one byte off its dtype's alignment."""
    buffer = bytearray(values.nbytes + 1)
    view = np.frombuffer(buffer, values.dtype, values.size, offset=1).reshape(values.shape)
    view[...] = values
    assert not view.flags.aligned
    return view if framework == "numpy" else torch.from_numpy(view)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("count_dtype", [np.int32, np.int64])
def test_misaligned_counts_index_and_expert_token_num(framework, count_dtype):
    rng = seeded("misaligned", framework, np.dtype(count_dtype).name)
    counts = reference.random_counts(rng, 50, count_dtype)
    tokens = random_array(framework, rng, framework_dtype(framework, "float16"), (50, 6), 2)
    result = moe_reroute.moe_re_routing(tokens, misaligned(framework, counts))
    check_forward(framework, result, tokens, counts, None, None, {})
    out = list(poisoned_outputs(framework, tokens, counts_array(framework, counts), None, None))
    out[2] = misaligned(framework, np.full(50, -7, np.int32))
    out[3] = misaligned(framework, np.full(counts.shape[1], -7, count_dtype))
    moe_reroute.moe_re_routing(tokens, misaligned(framework, counts), out=out)
    check_forward(framework, out, tokens, counts, None, None, {})
    restored = moe_reroute.moe_re_routing_inverse(result[0], misaligned(framework, counts))
    np.testing.assert_array_equal(byte_rows(restored[0]), byte_rows(tokens))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_forked_child_runs_the_operator_instead_of_hanging(framework):
    # GNU OpenMP hangs in a child forked after a parallel region; the operator
    # runs such a child's calls on its one thread. The child gets 30 s.
    rng = np.random.default_rng(12)
    counts = reference.random_counts(rng, 4096)
    tokens = rng.random((4096, 512), dtype=np.float32)
    if framework == "torch":
        tokens, counts = torch.from_numpy(tokens), torch.from_numpy(counts)
    expected = moe_reroute.moe_re_routing(tokens, counts)  # two threads: the team exists
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            signal.alarm(30)
            result = moe_reroute.moe_re_routing(tokens, counts)
            status = 0 if all(np.array_equal(byte_rows(a), byte_rows(b))
                              for a, b in zip(result, expected)) else 2
        finally:
            os._exit(status)
    _, wait_status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(wait_status) == 0


@pytest.mark.skipif(torch is not None, reason="checks the install without torch (scripts/test.sh)")
def test_without_torch_the_numpy_part_installs_alone():
    """Built where torch is not installed, the package has no torch operators,
    and what needs them says so (the NumPy calls above ran here)."""
    assert not pathlib.Path(moe_reroute.__file__).with_name("_torch_ops.so").exists()
    message = "^moe_reroute: this build has no torch operators"
    for call in (moe_reroute.cuda_check, moe_reroute.cpu_output_cache_bytes,
                 lambda: moe_reroute.set_cuda_status_check("sync"),
                 lambda: moe_reroute.set_cpu_output_cache_limit(0)):
        with pytest.raises(RuntimeError, match=message):
            call()
