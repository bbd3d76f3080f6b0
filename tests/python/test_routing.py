"""moe_init_routing and moe_finalize_routing against naive references
written here: init's stable sort by id (np.argsort kind="stable") and a
loop over the sorted positions, finalize's float32 sum step by step in
np.float32 (each step rounded, the cast to float16 / bfloat16 by NumPy /
ml_dtypes). Random cases over dtypes, both init modes and all four finalize
modes, active_num, capacities with drops, skewed ids, T = 0, k = 1, every
optional input present and absent, through NumPy and torch; outputs compared
byte for byte. Every bad input is refused naming the argument. The torch
operators: opcheck, fake kernels, torch.compile with dynamic shapes,
torch.export, and autograd against naive torch references."""

from __future__ import annotations

import io
import itertools

import ml_dtypes
import numpy as np
import pytest

import moe_reroute
from cases import FRAMEWORKS, TOKEN_CASES, array_type, as_numpy, byte_rows, seeded, torch

INIT_KEYS = ("active_num", "expert_capacity", "expert_num", "drop_pad_mode",
             "expert_tokens_count_or_cumsum_flag", "expert_tokens_before_capacity_flag")


def flat_bytes(array) -> np.ndarray:
    """Every byte of an array or tensor, in order, as uint8 [n]."""
    return byte_rows(array.reshape(1, -1)).reshape(-1)


# ---- the naive references ----


def init_reference(x_rows, expert_idx, active_num=0, expert_capacity=0, expert_num=0,
                   drop_pad_mode=0, expert_tokens_count_or_cumsum_flag=0,
                   expert_tokens_before_capacity_flag=False):
    """(expanded_x bytes [rows, row bytes], expanded_row_idx, count/cumsum,
    before capacity) of x's byte rows `x_rows`, as the contract says."""
    num_tokens, top_k = expert_idx.shape
    ids = expert_idx.reshape(-1).astype(np.int64)
    order = np.argsort(ids, kind="stable")
    row_idx = np.full(num_tokens * top_k, -2, np.int32)
    counts = np.zeros(max(expert_num, 1 + int(ids.max(initial=-1))), np.int32)
    for e in ids:
        counts[e] += 1
    empty = np.zeros(0, np.int32)
    if drop_pad_mode == 0:
        rows = num_tokens * top_k if active_num == 0 else min(active_num, num_tokens * top_k)
        expanded = np.zeros((rows, x_rows.shape[1]), np.uint8)
        for i, p in enumerate(order):
            row_idx[p] = i
            if i < rows:
                expanded[i] = x_rows[p // top_k]
        flag = expert_tokens_count_or_cumsum_flag
        tokens = counts if flag == 2 else np.cumsum(counts).astype(np.int32) if flag == 1 else empty
        return expanded, row_idx, tokens, empty
    expanded = np.zeros((expert_num * expert_capacity, x_rows.shape[1]), np.uint8)
    seen = [0] * expert_num
    for p in order:
        e = ids[p]
        if seen[e] < expert_capacity:
            row_idx[p] = e * expert_capacity + seen[e]
            expanded[row_idx[p]] = x_rows[p // top_k]
        else:
            row_idx[p] = -1
        seen[e] += 1
    return expanded, row_idx, empty, counts if expert_tokens_before_capacity_flag else empty


def finalize_reference(expanded_x, expanded_row_idx, x1=None, x2=None, bias=None, scales=None,
                       expert_idx=None, drop_pad_mode=0):
    """out of NumPy inputs: in np.float32, one rounded step at a time."""
    hidden = expanded_x.shape[-1]
    rows = expanded_x.reshape(-1, hidden)
    top_k = 1 if scales is None else scales.shape[1]
    num_tokens = (x1.shape[0] if x1 is not None else scales.shape[0] if scales is not None
                  else expanded_row_idx.shape[0])
    out = np.empty((num_tokens, hidden), expanded_x.dtype)
    for t in range(num_tokens):
        y = np.zeros(hidden, np.float32)
        if x1 is not None:
            y = x1[t].astype(np.float32)
            if x2 is not None:
                y = y + x2[t].astype(np.float32)
        for j in range(top_k):
            row = expanded_row_idx[t * top_k + j if drop_pad_mode >= 2 else j * num_tokens + t]
            if row == -1 or row >= rows.shape[0]:
                continue
            v = rows[row].astype(np.float32)
            if bias is not None:
                v = v + bias[expert_idx[t, j]].astype(np.float32)
            if scales is not None:
                v = v * np.float32(scales[t, j])
            y = y + v
        out[t] = y.astype(expanded_x.dtype)
    return out


# ---- init ----


# The torch operators on a CUDA device too, where there is one.
DEVICE_FRAMEWORKS = FRAMEWORKS + (("cuda",) if torch is not None and torch.cuda.is_available()
                                  else ())


def to_framework(framework, array):
    """`array` as a tensor of its dtype for torch (by its bytes: torch takes
    no ml_dtypes array), on the GPU for "cuda"."""
    if framework == "numpy":
        return array
    flat = torch.from_numpy(np.ascontiguousarray(array).view(np.uint8).reshape(-1))
    tensor = flat.view(getattr(torch, array.dtype.name)).reshape(array.shape)
    return tensor.cuda() if framework == "cuda" else tensor


def from_device(framework, result):
    """A CUDA call's outputs back in CPU memory, checking they were on the GPU."""
    if framework != "cuda":
        return result
    assert all(r.is_cuda for r in result)
    return tuple(r.cpu() for r in result)


def random_ids(rng, num_tokens, top_k, num_experts, skewed):
    """[T, k] ids in [0, E): uniform, or most on a few experts."""
    if skewed:
        weights = 0.5 ** np.arange(num_experts)
        return rng.choice(num_experts, (num_tokens, top_k), p=weights / weights.sum())
    return rng.integers(0, num_experts, (num_tokens, top_k))


def init_cases(rng):
    """(T, k, ids dtype, attributes) of random cases covering both modes,
    active_num, drops, skewed ids, T = 0 and k = 1."""
    cases = []
    for trial in range(10):
        num_tokens = [0, 1, 7, 40][trial % 4]
        top_k = [1, 2, 3, 8][trial // 3 % 4]
        num_experts = int(rng.integers(1, 9))
        positions = num_tokens * top_k
        active_num = [0, max(1, positions // 2), positions + 3][trial % 3]
        for flag in (0, 1, 2):
            cases.append((num_tokens, top_k, trial % 2, trial % 5 == 1, dict(
                active_num=active_num, expert_num=num_experts if flag or trial % 2 else 0,
                expert_tokens_count_or_cumsum_flag=flag)))
        if num_tokens:
            capacity = int(rng.integers(1, num_tokens + 1))
            for before in (False, True):
                cases.append((num_tokens, top_k, trial % 2, trial % 3 == 0, dict(
                    drop_pad_mode=1, expert_capacity=capacity, expert_num=num_experts,
                    expert_tokens_before_capacity_flag=before)))
    return cases


INIT_TOKEN_CASES = [(framework, case) for framework in DEVICE_FRAMEWORKS for case in TOKEN_CASES
                    if case.tokens_dtype is None and case.dtype(framework) is not None]


@pytest.mark.parametrize(("framework", "case"), INIT_TOKEN_CASES,
                         ids=[f"{f}-{c.label}" for f, c in INIT_TOKEN_CASES])
def test_init_routing_matches_the_reference(framework, case):
    rng = seeded("init", framework, case.label)
    for num_tokens, top_k, int64_ids, skewed, attributes in init_cases(rng):
        columns = int(rng.integers(1, 12))  # of storage: FP4 packs two a byte
        x_bytes = rng.integers(0, 256, (num_tokens, columns * max(1, case.bits // 8)),
                               dtype=np.uint8)
        x = to_framework(framework, x_bytes).view(case.dtype(framework))
        num_experts = max(attributes["expert_num"], 1)
        if framework == "cuda":  # the CUDA backend needs expert_num >= 1
            attributes = dict(attributes, expert_num=num_experts)
        ids = random_ids(rng, num_tokens, top_k, num_experts, skewed).astype(
            np.int64 if int64_ids else np.int32)
        result = from_device(framework, moe_reroute.moe_init_routing(
            x, to_framework(framework, ids), **attributes))
        expected = init_reference(x_bytes, ids, **attributes)
        assert all(isinstance(r, array_type(framework)) for r in result)
        expanded = result[0]
        assert expanded.dtype == x.dtype
        mode = attributes.get("drop_pad_mode", 0)
        if mode == 1:
            assert tuple(expanded.shape) == (attributes["expert_num"],
                                             attributes["expert_capacity"], x.shape[1])
        else:
            assert tuple(expanded.shape) == (expected[0].shape[0], x.shape[1])
        np.testing.assert_array_equal(flat_bytes(expanded), expected[0].reshape(-1))
        for output, want in zip(result[1:], expected[1:]):
            assert str(output.dtype).endswith("int32")
            np.testing.assert_array_equal(as_numpy(output), want)


def test_init_routing_spec_example():
    """Ids [[2, 0], [0, 2], [1, 0]]: the sort by id is positions 1, 2, 5, 4,
    0, 3; with capacity 2, expert 0's third entry (position 5) is dropped."""
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    ids = np.array([[2, 0], [0, 2], [1, 0]], np.int32)
    expanded, row_idx, cumsum, _ = moe_reroute.moe_init_routing(
        x, ids, expert_num=3, expert_tokens_count_or_cumsum_flag=1)
    np.testing.assert_array_equal(row_idx, [4, 0, 1, 5, 3, 2])
    np.testing.assert_array_equal(expanded[:, 0], [0, 2, 4, 4, 0, 2])
    np.testing.assert_array_equal(cumsum, [3, 4, 6])
    expanded, row_idx, _, before = moe_reroute.moe_init_routing(
        x, ids, drop_pad_mode=1, expert_capacity=2, expert_num=3,
        expert_tokens_before_capacity_flag=True)
    np.testing.assert_array_equal(row_idx, [4, 0, 1, 5, 2, -1])
    np.testing.assert_array_equal(before, [3, 1, 2])
    np.testing.assert_array_equal(expanded[..., 0], [[0, 2], [4, 0], [0, 2]])


# ---- finalize ----

# (expanded_x dtype, scales dtype)
FINALIZE_DTYPES = [(np.float16, np.float16), (ml_dtypes.bfloat16, ml_dtypes.bfloat16),
                   (np.float32, np.float32), (ml_dtypes.bfloat16, np.float32),
                   (np.float16, np.float32)]
# x1 / x2, bias with expert_idx, scales: each present or absent.
OPTIONAL_FORMS = list(itertools.product(("", "x1", "x1+x2"), ("", "expert_idx", "bias"),
                                        (False, True)))


def normal(rng, shape, dtype):
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def finalize_inputs(rng, mode, dtype, scales_dtype, form, num_tokens, top_k):
    """The arguments of one random call (NumPy), as a dict."""
    residual, with_ids, with_scales = form
    top_k = top_k if with_scales else 1
    hidden = int(rng.integers(1, 20))
    positions = num_tokens * top_k
    if mode in (1, 3):
        num_experts, capacity = int(rng.integers(1, 5)), int(rng.integers(1, 4))
        expanded = normal(rng, (num_experts, capacity, hidden), dtype)
        row_idx = rng.integers(-1, num_experts * capacity, positions)
    else:
        num_experts = int(rng.integers(1, 5))
        rows = int(rng.integers(0, positions + 1))  # rows past these are skipped (active_num)
        expanded = normal(rng, (rows, hidden), dtype)
        row_idx = rng.permutation(positions)
    arguments = dict(expanded_x=expanded, expanded_row_idx=row_idx.astype(np.int32),
                     drop_pad_mode=mode)
    if residual:
        arguments["x1"] = normal(rng, (num_tokens, hidden), dtype)
    if residual == "x1+x2":
        arguments["x2"] = normal(rng, (num_tokens, hidden), dtype)
    if with_ids:
        arguments["expert_idx"] = rng.integers(0, num_experts, (num_tokens, top_k),
                                               dtype=np.int32)
    if with_ids == "bias":
        arguments["bias"] = normal(rng, (num_experts, hidden), dtype)
    if with_scales:
        arguments["scales"] = normal(rng, (num_tokens, top_k), scales_dtype)
    return arguments


def framework_arguments(framework, arguments):
    return {k: to_framework(framework, v) if isinstance(v, np.ndarray) else v
            for k, v in arguments.items()}


@pytest.mark.parametrize("framework", DEVICE_FRAMEWORKS)
@pytest.mark.parametrize("mode", range(4))
@pytest.mark.parametrize(("dtype", "scales_dtype"), FINALIZE_DTYPES,
                         ids=["float16", "bfloat16", "float32", "bfloat16-float32-scales",
                              "float16-float32-scales"])
def test_finalize_routing_matches_the_reference(framework, mode, dtype, scales_dtype):
    rng = seeded("finalize", framework, str(mode), np.dtype(dtype).name,
                 np.dtype(scales_dtype).name)
    for index, form in enumerate(OPTIONAL_FORMS):
        num_tokens = [0, 1, 6, 33][index % 4]
        top_k = [1, 2, 4][index % 3]
        arguments = finalize_inputs(rng, mode, dtype, scales_dtype, form, num_tokens, top_k)
        given = framework_arguments(framework, arguments)
        out, = from_device(framework, (moe_reroute.moe_finalize_routing(
            given.pop("expanded_x"), given.pop("expanded_row_idx"), **given),))
        expected = finalize_reference(**arguments)
        assert isinstance(out, array_type(framework))
        assert tuple(out.shape) == expected.shape
        assert flat_bytes(out).size == expected.nbytes
        np.testing.assert_array_equal(flat_bytes(out), flat_bytes(expected))


def test_finalize_routing_undoes_init_routing_in_mode_2():
    """The pipeline's round trip: finalize (mode 2) of init's rows with unit
    scales sums each token's k copies of itself."""
    rng = seeded("round trip")
    x = normal(rng, (20, 8), np.float32)
    ids = rng.integers(0, 5, (20, 3)).astype(np.int32)
    expanded, row_idx, _, _ = moe_reroute.moe_init_routing(x, ids)
    out = moe_reroute.moe_finalize_routing(expanded, row_idx, scales=np.ones((20, 3), np.float32),
                                           drop_pad_mode=2)
    np.testing.assert_array_equal(out, x + x + x)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_inputs_that_are_not_contiguous_are_read_by_value(framework):
    rng = seeded("strided", framework)
    x = normal(rng, (6, 10), np.float32)
    ids = rng.integers(0, 4, (3, 6)).astype(np.int32)
    init = moe_reroute.moe_init_routing(to_framework(framework, x)[:, ::2],
                                        to_framework(framework, ids).T, expert_num=4)
    expected = init_reference(byte_rows(np.ascontiguousarray(x[:, ::2])),
                              np.ascontiguousarray(ids.T), expert_num=4)
    np.testing.assert_array_equal(byte_rows(init[0]), expected[0])
    expanded = normal(rng, (12, 8), np.float16)
    scales = normal(rng, (3, 6), np.float16)
    out = moe_reroute.moe_finalize_routing(
        to_framework(framework, expanded)[::2], init[1],
        scales=to_framework(framework, scales).T, drop_pad_mode=2)
    want = finalize_reference(expanded[::2].copy(), as_numpy(init[1]),
                              scales=scales.T.copy(), drop_pad_mode=2)
    np.testing.assert_array_equal(flat_bytes(out), flat_bytes(want))


# ---- errors ----

T, K, H = 4, 2, 6


def init_good():
    rng = np.random.default_rng(1)
    return dict(x=normal(rng, (T, H), np.float16),
                expert_idx=rng.integers(0, 3, (T, K)).astype(np.int32), expert_num=3)


def finalize_good():
    rng = np.random.default_rng(2)
    return dict(expanded_x=normal(rng, (T * K, H), np.float16),
                expanded_row_idx=rng.permutation(T * K).astype(np.int32),
                x1=normal(rng, (T, H), np.float16), x2=normal(rng, (T, H), np.float16),
                bias=normal(rng, (3, H), np.float16), scales=normal(rng, (T, K), np.float16),
                expert_idx=rng.integers(0, 3, (T, K)).astype(np.int32))


# (label, changes to the good arguments, error type, message pattern)
INIT_BAD = [
    ("x 1-D", dict(x=np.ones(T, np.float16)), ValueError, r"^x: must be 2-D \[T, H\]"),
    ("x int32", dict(x=np.ones((T, H), np.int32)), TypeError, "^x: dtype int32 is not a token"),
    ("x float64", dict(x=np.ones((T, H))), TypeError, "^x: dtype float64"),
    ("expert_idx 1-D", dict(expert_idx=np.zeros(T, np.int32)), ValueError,
     r"^expert_idx: must be 2-D \[T, k\]"),
    ("expert_idx rows", dict(expert_idx=np.zeros((T + 1, K), np.int32)), ValueError,
     "^expert_idx: has 5 rows but x has T = 4"),
    ("expert_idx float", dict(expert_idx=np.zeros((T, K), np.float32)), TypeError,
     "^expert_idx: dtype float32 is not int32 or int64"),
    ("id negative", dict(expert_idx=np.array([[0, 1]] * 3 + [[2, -1]], np.int32)), ValueError,
     r"^expert_idx: \[3, 1\] = -1 is negative"),
    ("id too large", dict(expert_idx=np.array([[0, 3]] * 4, np.int64)), ValueError,
     r"^expert_idx: \[0, 1\] = 3 is not below expert_num = 3"),
    ("active_num", dict(active_num=-1), ValueError, "^active_num: must be >= 0"),
    ("drop_pad_mode", dict(drop_pad_mode=2), ValueError, "^drop_pad_mode: must be 0"),
    ("flag", dict(expert_tokens_count_or_cumsum_flag=3), ValueError,
     "^expert_tokens_count_or_cumsum_flag: must be 0"),
    ("flag without experts", dict(expert_tokens_count_or_cumsum_flag=1, expert_num=0),
     ValueError, "^expert_num: must be >= 1 with expert_tokens_count_or_cumsum_flag 1"),
    ("capacity 0", dict(drop_pad_mode=1), ValueError,
     "^expert_capacity: must be >= 1 with drop_pad_mode 1"),
    ("capacity past T", dict(drop_pad_mode=1, expert_capacity=T + 1), ValueError,
     "^expert_capacity: must be at most T = 4"),
    ("capacity without experts", dict(drop_pad_mode=1, expert_capacity=1, expert_num=0),
     ValueError, "^expert_num: must be >= 1 with drop_pad_mode 1"),
]

FINALIZE_BAD = [
    ("mode", dict(drop_pad_mode=4), ValueError, "^drop_pad_mode: must be 0, 1, 2 or 3"),
    ("expanded_x 3-D in mode 0", dict(expanded_x=np.ones((2, 4, H), np.float16)), ValueError,
     r"^expanded_x: must be 2-D \[T \* k, H\]"),
    ("expanded_x 2-D in mode 1", dict(drop_pad_mode=1), ValueError,
     r"^expanded_x: must be 3-D \[E, C, H\]"),
    ("expanded_x int8", dict(expanded_x=np.ones((T * K, H), np.int8)), TypeError,
     "^expanded_x: dtype int8 is not float16, bfloat16 or float32"),
    ("row_idx 2-D", dict(expanded_row_idx=np.zeros((T, K), np.int32)), ValueError,
     r"^expanded_row_idx: must be 1-D"),
    ("row_idx int64", dict(expanded_row_idx=np.zeros(T * K, np.int64)), TypeError,
     "^expanded_row_idx: dtype int64 is not int32"),
    ("row_idx length", dict(expanded_row_idx=np.zeros(T * K + 1, np.int32)), ValueError,
     "^expanded_row_idx: has 9 rows but scales is"),
    ("row below -1", dict(expanded_row_idx=np.array([0, 1, 2, -2, 4, 5, 6, 7], np.int32)),
     ValueError, r"^expanded_row_idx: \[3\] = -2 is below -1"),
    ("-1 in mode 0", dict(expanded_row_idx=np.array([0, 1, 2, -1, 4, 5, 6, 7], np.int32)),
     ValueError, r"^expanded_row_idx: \[3\] = -1 \(a dropped row\) needs drop_pad_mode 1 or 3"),
    ("row past E * C", dict(expanded_x=np.ones((2, 3, H), np.float16), drop_pad_mode=3,
                            bias=np.ones((2, H), np.float16),
                            expert_idx=np.zeros((T, K), np.int32),
                            expanded_row_idx=np.array([0, 1, 2, 6, 4, 5, 0, 1], np.int32)),
     ValueError, r"^expanded_row_idx: \[3\] = 6 is not below E \* C = 6"),
    ("x2 without x1", dict(x1=None), ValueError, "^x2: needs x1"),
    ("x1 shape", dict(x1=np.ones((T, H + 1), np.float16)), ValueError,
     r"^x1: must be \[T, H\] = \[4, 6\]"),
    ("x2 dtype", dict(x2=np.ones((T, H), np.float32)), TypeError,
     "^x2: dtype float32 is not expanded_x's float16"),
    ("bias without expert_idx", dict(expert_idx=None), ValueError, "^bias: needs expert_idx"),
    ("bias shape", dict(bias=np.ones((3, H + 1), np.float16)), ValueError,
     r"^bias: must be \[E, H\]"),
    ("scales shape", dict(scales=np.ones((T, K, 1), np.float16)), ValueError,
     r"^scales: must be 2-D \[T, k\]"),
    ("scales dtype", dict(scales=np.ones((T, K), ml_dtypes.bfloat16)), TypeError,
     "^scales: dtype bfloat16 does not pair with expanded_x's float16"),
    ("expert_idx shape", dict(expert_idx=np.zeros((T, K + 1), np.int32)), ValueError,
     r"^expert_idx: must be \[T, k\] = \[4, 2\]"),
    ("expert_idx past bias", dict(expert_idx=np.full((T, K), 3, np.int32)), ValueError,
     r"^expert_idx: \[0, 0\] = 3 is not a row of bias \(E = 3\)"),
]


def call(op, framework, arguments):
    arguments = framework_arguments(framework, arguments)
    if op == "init":
        return moe_reroute.moe_init_routing(arguments.pop("x"), arguments.pop("expert_idx"),
                                            **arguments)
    return moe_reroute.moe_finalize_routing(arguments.pop("expanded_x"),
                                            arguments.pop("expanded_row_idx"), **arguments)


BAD = ([("init", *b) for b in INIT_BAD] + [("finalize", *b) for b in FINALIZE_BAD])


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize(("op", "label", "changes", "error", "message"), BAD,
                         ids=[f"{b[0]}-{b[1]}" for b in BAD])
def test_bad_input_raises_naming_the_argument(framework, op, label, changes, error, message):
    good = init_good() if op == "init" else finalize_good()
    with pytest.raises(error, match=message):
        call(op, framework, good | changes)


@pytest.mark.parametrize(("op", "name"), [("init", "x"), ("init", "expert_idx"),
                                          ("finalize", "expanded_x"),
                                          ("finalize", "expanded_row_idx")])
def test_a_missing_required_input_is_named(op, name):
    good = init_good() if op == "init" else finalize_good()
    with pytest.raises(TypeError, match=f"^{name}: must be given, got None"):
        call(op, "numpy", good | {name: None})


@pytest.mark.parametrize(("keyword", "value", "message"), [
    ("active_num", "1", "active_num: expected int, got str"),
    ("expert_num", True, "expert_num: expected int, got bool"),
    ("expert_tokens_before_capacity_flag", 1,
     "expert_tokens_before_capacity_flag: expected bool, got int"),
    ("drop_pad_mode", 2**63, "drop_pad_mode: 9223372036854775808 does not fit in int64"),
])
def test_numpy_attribute_of_the_wrong_type_is_named(keyword, value, message):
    with pytest.raises((TypeError, ValueError), match=f"^{message}$"):
        call("init", "numpy", init_good() | {keyword: value})


def test_a_numpy_input_beside_a_numpy_first_input_must_be_numpy():
    with pytest.raises(TypeError, match="^expert_idx: expected a numpy.ndarray, as x is one"):
        moe_reroute.moe_init_routing(np.ones((T, H), np.float16), [[0, 1]] * T)
    with pytest.raises(TypeError, match="^x: expected a numpy.ndarray or torch.Tensor, got list"):
        moe_reroute.moe_init_routing([[1.0]], np.zeros((1, 1), np.int32))


# ---- torch ----

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")
OPS = None if torch is None else torch.ops.moe_reroute


def torch_init_samples():
    rng = np.random.default_rng(3)
    x = torch.from_numpy(normal(rng, (12, 6), np.float32))
    ids = torch.from_numpy(rng.integers(0, 4, (12, 3)).astype(np.int32))
    return [((x, ids), dict(expert_num=4, expert_tokens_count_or_cumsum_flag=2)),
            ((x.half(), ids.long()), dict(active_num=20)),
            ((x.clone().requires_grad_(), ids), dict(drop_pad_mode=1, expert_capacity=3,
                                                     expert_num=4,
                                                     expert_tokens_before_capacity_flag=True))]


def torch_finalize_samples():
    rng = np.random.default_rng(4)
    full = framework_arguments("torch", finalize_inputs(
        rng, 2, np.float32, np.float32, ("x1+x2", "bias", True), 9, 3))
    grads = {k: v.detach().clone().requires_grad_()
             if isinstance(v, torch.Tensor) and v.is_floating_point() else v
             for k, v in full.items()}
    capacity = framework_arguments("torch", finalize_inputs(
        rng, 1, ml_dtypes.bfloat16, np.float32, ("x1", "", True), 7, 2))
    bare = framework_arguments("torch", finalize_inputs(
        rng, 0, np.float16, np.float16, ("", "", False), 5, 1))
    return [full, grads, capacity, bare]


def split(arguments, first, second):
    arguments = dict(arguments)
    return (arguments.pop(first), arguments.pop(second)), arguments


@needs_torch
@pytest.mark.parametrize("sample", range(3))
def test_opcheck_init_routing(sample):
    args, kwargs = torch_init_samples()[sample]
    torch.library.opcheck(OPS.moe_init_routing.default, args, kwargs)


@needs_torch
@pytest.mark.parametrize("sample", range(4))
def test_opcheck_finalize_routing(sample):
    args, kwargs = split(torch_finalize_samples()[sample], "expanded_x", "expanded_row_idx")
    torch.library.opcheck(OPS.moe_finalize_routing.default, args, kwargs)


@needs_torch
def test_schemas_are_the_descriptions():
    assert str(OPS.moe_init_routing.default._schema) == (
        "moe_reroute::moe_init_routing(Tensor x, Tensor expert_idx, int active_num=0, "
        "int expert_capacity=0, int expert_num=0, int drop_pad_mode=0, "
        "int expert_tokens_count_or_cumsum_flag=0, bool expert_tokens_before_capacity_flag="
        "False) -> (Tensor, Tensor, Tensor, Tensor)")
    assert str(OPS.moe_finalize_routing.default._schema) == (
        "moe_reroute::moe_finalize_routing(Tensor expanded_x, Tensor expanded_row_idx, "
        "Tensor? x1=None, Tensor? x2=None, Tensor? bias=None, Tensor? scales=None, "
        "Tensor? expert_idx=None, int drop_pad_mode=0) -> Tensor")


@needs_torch
def test_fake_kernels_size_outputs_by_the_core_formulas():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(10, 7, dtype=torch.bfloat16)
        ids = torch.empty(10, 3, dtype=torch.int64)
        dropless = OPS.moe_init_routing(x, ids, active_num=12, expert_num=5,
                                        expert_tokens_count_or_cumsum_flag=1)
        capacity = OPS.moe_init_routing(x, ids, drop_pad_mode=1, expert_capacity=4, expert_num=5,
                                        expert_tokens_before_capacity_flag=True)
        fp4 = OPS.moe_init_routing(torch.empty(10, 4, dtype=torch.float4_e2m1fn_x2), ids)
        out = OPS.moe_finalize_routing(torch.empty(5, 4, 7), torch.empty(30, dtype=torch.int32),
                                       scales=torch.empty(10, 3), drop_pad_mode=3)
        alone = OPS.moe_finalize_routing(torch.empty(30, 7, dtype=torch.float16),
                                         torch.empty(30, dtype=torch.int32))
    assert [tuple(o.shape) for o in dropless] == [(12, 7), (30,), (5,), (0,)]
    assert [o.dtype for o in dropless] == [torch.bfloat16] + [torch.int32] * 3
    assert [tuple(o.shape) for o in capacity] == [(5, 4, 7), (30,), (0,), (5,)]
    assert (fp4[0].dtype, tuple(fp4[0].shape)) == (torch.float4_e2m1fn_x2, (30, 4))
    assert (out.dtype, tuple(out.shape)) == (torch.float32, (10, 7))
    assert (alone.dtype, tuple(alone.shape)) == (torch.float16, (30, 7))


# Errors that need the ids' or row indices' values: the kernels find them.
VALUE_ERRORS = {"id negative", "id too large", "row below -1", "-1 in mode 0", "row past E * C",
                "expert_idx past bias"}
DATA_FREE = [b for b in BAD if b[1] not in VALUE_ERRORS]


@needs_torch
@pytest.mark.parametrize(("op", "label", "changes", "error", "message"), DATA_FREE,
                         ids=[f"{b[0]}-{b[1]}" for b in DATA_FREE])
def test_fake_kernels_refuse_as_eager(op, label, changes, error, message):
    """Errors decided from shapes and dtypes alone: the fake kernel raises
    eager's exception under FakeTensorMode."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    good = init_good() if op == "init" else finalize_good()
    arguments = framework_arguments("torch", good | changes)
    with FakeTensorMode() as mode:
        faked = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v
                 for k, v in arguments.items()}
        with pytest.raises(error, match=message):
            call(op, "numpy", faked)  # already tensors: call() leaves them as they are


@needs_torch
def test_an_input_on_another_device_is_named():
    x = torch.ones(T, H, dtype=torch.float16, device="meta")
    with pytest.raises(ValueError, match="^expert_idx: must be on meta like x$"):
        OPS.moe_init_routing(x, torch.zeros(T, K, dtype=torch.int32))


@needs_torch
@pytest.mark.skipif(torch is None or not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_inputs_on_two_devices_are_refused_by_name():
    x = torch.ones(T, H, dtype=torch.float16, device="cuda")
    ids = torch.zeros(T, K, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="^expert_idx: must be in CPU memory like x$"):
        OPS.moe_init_routing(x.cpu(), ids)
    with pytest.raises(ValueError, match="^expert_num: must be >= 1 for the CUDA backend"):
        OPS.moe_init_routing(x, ids)


def pipeline(x, ids, scales):
    """init, then finalize of its rows weighted by the scales (mode 2)."""
    expanded, row_idx, counts, _ = moe_reroute.moe_init_routing(
        x, ids, expert_num=6, expert_tokens_count_or_cumsum_flag=2)
    return expanded, row_idx, counts, moe_reroute.moe_finalize_routing(
        expanded * 2, row_idx, x1=x, scales=scales, drop_pad_mode=2)


def pipeline_inputs(num_tokens, seed):
    rng = np.random.default_rng(seed)
    return (torch.from_numpy(normal(rng, (num_tokens, 8), np.float32)),
            torch.from_numpy(rng.integers(0, 6, (num_tokens, 2)).astype(np.int32)),
            torch.from_numpy(normal(rng, (num_tokens, 2), np.float32)))


def check_pipeline(result, x, ids, scales):
    expanded, row_idx, counts, out = result
    want = init_reference(byte_rows(x), ids.numpy(), expert_num=6,
                          expert_tokens_count_or_cumsum_flag=2)
    np.testing.assert_array_equal(flat_bytes(expanded), want[0].reshape(-1))
    np.testing.assert_array_equal(row_idx.numpy(), want[1])
    np.testing.assert_array_equal(counts.numpy(), want[2])
    expected = finalize_reference((expanded * 2).numpy(), row_idx.numpy(), x1=x.numpy(),
                                  scales=scales.numpy(), drop_pad_mode=2)
    np.testing.assert_array_equal(flat_bytes(out), flat_bytes(expected))


@needs_torch
def test_compile_fullgraph_dynamic_matches_the_reference():
    torch._dynamo.reset()
    compiled = torch.compile(pipeline, fullgraph=True, dynamic=True)
    for num_tokens in (5, 17, 64):
        inputs = pipeline_inputs(num_tokens, num_tokens)
        check_pipeline(compiled(*inputs), *inputs)


class Pipeline(torch.nn.Module if torch is not None else object):
    def forward(self, x, ids, scales):
        return pipeline(x, ids, scales)


@needs_torch
def test_export_save_load_matches_the_reference():
    tokens = torch.export.Dim("T", min=2)
    program = torch.export.export(Pipeline(), pipeline_inputs(24, 1),
                                  dynamic_shapes=({0: tokens}, {0: tokens}, {0: tokens}))
    targets = {n.target for n in program.graph.nodes if n.op == "call_function"}
    assert {OPS.moe_init_routing.default, OPS.moe_finalize_routing.default} <= targets
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer).module()
    for num_tokens in (24, 41):
        inputs = pipeline_inputs(num_tokens, num_tokens)
        check_pipeline(loaded(*inputs), *inputs)


# ---- autograd: naive torch references in float32, with tolerances ----


def init_grad_reference(grad_expanded, row_idx, num_tokens, top_k):
    """x's gradient: each position's kept row's gradient, added to its token."""
    rows = grad_expanded.reshape(-1, grad_expanded.shape[-1])
    grad = torch.zeros(num_tokens, rows.shape[1])
    for p in range(num_tokens * top_k):
        row = int(row_idx[p])
        if 0 <= row < rows.shape[0]:
            grad[p // top_k] += rows[row].float()
    return grad


@needs_torch
@pytest.mark.parametrize("attributes", [dict(), dict(active_num=7),
                                        dict(drop_pad_mode=1, expert_capacity=2, expert_num=4)])
def test_init_backward_sums_the_gradients_of_each_token_rows(attributes):
    rng = np.random.default_rng(5)
    x = torch.from_numpy(normal(rng, (9, 5), np.float32)).requires_grad_()
    ids = torch.from_numpy(random_ids(rng, 9, 3, 4, skewed=True).astype(np.int32))
    expanded, row_idx, counts, before = moe_reroute.moe_init_routing(x, ids, **attributes)
    assert not (row_idx.requires_grad or counts.requires_grad or before.requires_grad)
    weight = torch.from_numpy(normal(rng, tuple(expanded.shape), np.float32))
    (expanded * weight).sum().backward()
    torch.testing.assert_close(x.grad, init_grad_reference(weight, row_idx, 9, 3),
                               rtol=1e-6, atol=1e-6)


def finalize_grad_reference(grad_out, arguments):
    """The gradients of expanded_x, x1, x2, bias and scales, slot by slot."""
    mode = arguments.get("drop_pad_mode", 0)
    expanded = arguments["expanded_x"].detach().float()
    rows = expanded.reshape(-1, expanded.shape[-1])
    scales, bias, ids = (arguments.get(n) for n in ("scales", "bias", "expert_idx"))
    num_tokens, top_k = grad_out.shape[0], 1 if scales is None else scales.shape[1]
    grads = dict(expanded_x=torch.zeros_like(rows), x1=grad_out, x2=grad_out)
    if bias is not None:
        grads["bias"] = torch.zeros_like(bias, dtype=torch.float32)
    if scales is not None:
        grads["scales"] = torch.zeros(num_tokens, top_k)
    for t in range(num_tokens):
        for j in range(top_k):
            row = int(arguments["expanded_row_idx"][t * top_k + j if mode >= 2
                                                   else j * num_tokens + t])
            if row == -1 or row >= rows.shape[0]:
                continue
            scale = 1.0 if scales is None else scales[t, j].detach().float()
            grads["expanded_x"][row] += grad_out[t].float() * scale
            value = rows[row]
            if bias is not None:
                grads["bias"][ids[t, j]] += grad_out[t].float() * scale
                value = value + bias[ids[t, j]].detach().float()
            if scales is not None:
                grads["scales"][t, j] = (grad_out[t].float() * value).sum()
    grads["expanded_x"] = grads["expanded_x"].reshape(expanded.shape)
    return grads


@needs_torch
@pytest.mark.parametrize("mode", range(4))
@pytest.mark.parametrize("form", [("x1+x2", "bias", True), ("", "", False), ("x1", "", True)],
                         ids=["all", "none", "x1-scales"])
def test_finalize_backward_matches_the_naive_reference(mode, form):
    rng = np.random.default_rng(6 + mode)
    arguments = framework_arguments("torch", finalize_inputs(rng, mode, np.float32, np.float32,
                                                             form, 7, 3))
    for value in arguments.values():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            value.requires_grad_()
    out = call("finalize", "numpy", arguments)  # tensors already
    grad_out = torch.from_numpy(normal(rng, tuple(out.shape), np.float32))
    out.backward(grad_out)
    expected = finalize_grad_reference(grad_out, arguments)
    for name, want in expected.items():
        if name in arguments:
            torch.testing.assert_close(arguments[name].grad, want, rtol=1e-5, atol=1e-5)


@needs_torch
def test_finalize_backward_in_bfloat16_with_float32_scales_keeps_each_dtype():
    rng = np.random.default_rng(9)
    arguments = framework_arguments("torch", finalize_inputs(
        rng, 3, ml_dtypes.bfloat16, np.float32, ("x1", "bias", True), 6, 2))
    for name in ("expanded_x", "x1", "bias", "scales"):
        arguments[name].requires_grad_()
    call("finalize", "numpy", arguments).float().sum().backward()
    assert [arguments[n].grad.dtype for n in ("expanded_x", "x1", "bias", "scales")] == [
        torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float32]


@needs_torch
def test_compiled_training_step_gradients_match_eager():
    """AOTAutograd traces the backward nodes with dynamic shapes."""
    torch._dynamo.reset()

    def step(x, ids, scales):
        return pipeline(x, ids, scales)[3].square().sum()

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for num_tokens in (6, 19):
        x, ids, scales = pipeline_inputs(num_tokens, num_tokens + 100)
        eager = [t.clone().requires_grad_() for t in (x, scales)]
        traced = [t.clone().requires_grad_() for t in (x, scales)]
        step(eager[0], ids, eager[1]).backward()
        compiled(traced[0], ids, traced[1]).backward()
        for a, b in zip(eager, traced):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-5)


@needs_torch
def test_forward_mode_tangents_are_refused_by_name():
    import torch.autograd.forward_ad as fwAD
    x, ids = torch.ones(T, H), torch.zeros(T, K, dtype=torch.int32)
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, torch.ones_like(x))
        with pytest.raises(NotImplementedError, match="x: has a forward-mode tangent"):
            OPS.moe_init_routing(dual, ids)
