"""Every bad input raises ValueError (shape, value) or TypeError (dtype) with a
message naming the argument, through NumPy and torch, and writes nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moe_reroute
from reference import POISON

A = 6
COUNTS = np.array([[1, 0, 2], [2, 1, 0]], np.int32)


def good():
    rng = np.random.default_rng(0)
    return dict(tokens=rng.standard_normal((A, 4)).astype(np.float16),
                expert_token_num_per_rank=COUNTS.copy(),
                per_token_scales=rng.random(A).astype(np.float32),
                expert_topk_weight=rng.random((A, 1)).astype(np.float32))


# (label, changes to the good arguments, error type, message pattern)
BAD_INPUTS = [
    ("tokens 1-D", dict(tokens=np.ones(A, np.float16)), ValueError, "tokens: must be 2-D"),
    ("tokens H=0", dict(tokens=np.ones((A, 0), np.float16)), ValueError, "tokens: H must be >= 1"),
    ("tokens 5-D", dict(tokens=np.ones((A, 1, 1, 1, 4), np.float16)), ValueError,
     "tokens: 5-D, at most 4 dims are supported"),
    ("scales 5-D", dict(per_token_scales=np.ones((A, 1, 1, 1, 2), np.float32)), ValueError,
     "per_token_scales: 5-D, at most 4 dims are supported"),
    ("tokens float64", dict(tokens=np.ones((A, 4))), TypeError, "tokens: dtype float64"),
    ("tokens int32", dict(tokens=np.ones((A, 4), np.int32)), TypeError,
     "tokens: dtype int32 is not a token dtype"),
    ("counts 1-D", dict(expert_token_num_per_rank=np.array([6], np.int32)), ValueError,
     "expert_token_num_per_rank: must be 2-D"),
    ("counts float", dict(expert_token_num_per_rank=COUNTS.astype(np.float32)), TypeError,
     "expert_token_num_per_rank: dtype float32 must be int32 or int64"),
    ("counts negative", dict(expert_token_num_per_rank=np.array([[7, -1, 0]], np.int64)),
     ValueError, r"expert_token_num_per_rank: count\[0\]\[1\] = -1 is negative"),
    ("counts sum", dict(expert_token_num_per_rank=np.array([[1, 2]], np.int32)), ValueError,
     "expert_token_num_per_rank: counts sum to 3 but tokens has 6 rows"),
    ("counts overflow", dict(expert_token_num_per_rank=np.array([[2**62, 2**62, 2**62]])),
     ValueError, "expert_token_num_per_rank: counts overflow int64"),
    ("scales rows", dict(per_token_scales=np.ones(5, np.float32)), ValueError,
     "per_token_scales: dim 0 is 5 but tokens has 6 rows"),
    ("scales int8", dict(per_token_scales=np.ones(A, np.int8)), TypeError,
     "per_token_scales: dtype int8 must be float32 or float8_e8m0"),
    ("scales e8m0 with float16 tokens", dict(per_token_scales=np.ones(A, np.uint8)), TypeError,
     "per_token_scales: float8_e8m0 scales pair only with float8_e5m2, float8_e4m3fn, "
     "float4_e2m1 or float4_e1m2 tokens, got float16 tokens"),
    ("scales [A,K,2] with float16 tokens", dict(per_token_scales=np.ones((A, 2, 2), np.float32)),
     ValueError, r"per_token_scales: float32 scales with float16 tokens must be \[A\], \[A, S\]"),
    ("weight int32", dict(expert_topk_weight=np.ones(A, np.int32)), TypeError,
     "expert_topk_weight: dtype int32 must be float32"),
    ("weight dim 1", dict(expert_topk_weight=np.ones((A, 2), np.float32)), ValueError,
     "expert_topk_weight: dim 1 must be 1"),
    ("weight rows", dict(expert_topk_weight=np.ones((4, 1), np.float32)), ValueError,
     "expert_topk_weight: dim 0 is 4"),
    ("expert_token_num_type", dict(expert_token_num_type=2), ValueError,
     "expert_token_num_type: must be 0"),
    ("idx_type", dict(idx_type=-1), ValueError, "idx_type: must be 0"),
    # Whole in every path: 2**32 once passed as 0 (gather) in the torch op.
    ("expert_token_num_type 2**32+1", dict(expert_token_num_type=2**32 + 1), ValueError,
     r"expert_token_num_type: must be 0 \(cumsum\) or 1 \(count\), got 4294967297$"),
    ("idx_type 2**32", dict(idx_type=2**32), ValueError,
     r"idx_type: must be 0 \(gather\) or 1 \(scatter\), got 4294967296$"),
    ("tokens_dtype unknown", dict(tokens=np.ones((A, 4), np.uint8), tokens_dtype="fp8"),
     TypeError, "tokens_dtype: unknown dtype 'fp8'"),
    ("tokens_dtype on float16", dict(tokens_dtype="hifloat8"), TypeError,
     "tokens_dtype: 'hifloat8' names the dtype of unsigned storage, but tokens is float16"),
    ("tokens_dtype too wide", dict(tokens=np.ones((A, 4), np.uint8), tokens_dtype="bfloat16"),
     TypeError, r"^tokens_dtype: 'bfloat16' \(16 bits\) does not fit uint8 storage of tokens "
     r"\(elements of the same width, or two FP4 elements per uint8\)$"),
    ("tokens 0-D", dict(tokens=np.array(1.0, np.float16)), ValueError,
     r"^tokens: must be 2-D \[A, H\], got float16\[\]$"),
]


def as_torch(arguments: dict) -> dict:
    return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v
            for k, v in arguments.items()}


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize(("label", "changes", "error", "message"), BAD_INPUTS,
                         ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_raises_naming_the_argument(framework, label, changes, error, message):
    arguments = good() | changes
    if framework == "torch":
        arguments = as_torch(arguments)
    tokens = arguments.pop("tokens")
    counts = arguments.pop("expert_token_num_per_rank")
    with pytest.raises(error, match=message):
        moe_reroute.moe_re_routing(tokens, counts, **arguments)
    inverse_arguments = {k: v for k, v in arguments.items()
                         if k in ("per_token_scales", "expert_topk_weight", "tokens_dtype")}
    # The inverse checks no pairing: its rows may be of any dtype.
    if label not in ("tokens int32", "expert_token_num_type", "idx_type",
                     "expert_token_num_type 2**32+1", "idx_type 2**32",
                     "scales e8m0 with float16 tokens", "scales [A,K,2] with float16 tokens"):
        with pytest.raises(error, match=message):
            moe_reroute.moe_re_routing_inverse(tokens, counts, **inverse_arguments)


def poisoned_outputs(framework):
    arguments = good()
    outputs = moe_reroute.moe_re_routing(arguments.pop("tokens"),
                                         arguments.pop("expert_token_num_per_rank"), **arguments)
    outputs = [np.full_like(o, 0).view(np.uint8) for o in outputs]
    for o in outputs:
        o.fill(POISON)
    outputs = [o.view(d) for o, d in zip(outputs, (np.float16, np.float32, np.int32, np.int32,
                                                    np.float32))]
    return outputs if framework == "numpy" else [torch.from_numpy(o) for o in outputs]


def column_major_copy(array):
    if isinstance(array, torch.Tensor):
        return array.t().contiguous().t()
    return array.T.copy().T


# (label, replace output i with f(outputs), error, message)
BAD_OUTPUTS = [
    ("shape", 0, lambda o: o[0][:5], ValueError, r"permute_tokens: must be float16\[6, 4\]"),
    ("dtype", 2, lambda o: o[1] * 1, ValueError,
     r"permute_token_idx: must be int32\[6\], got float32\[6\]"),
    ("non-contiguous", 0, lambda o: column_major_copy(o[0]), ValueError,
     "permute_tokens: must be contiguous"),
    ("overlap", 4, None, ValueError, "permute_topk_weight: overlaps input expert_topk_weight"),
]


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize(("label", "index", "change", "error", "message"), BAD_OUTPUTS,
                         ids=[b[0] for b in BAD_OUTPUTS])
def test_bad_out_raises_and_writes_nothing(framework, label, index, change, error, message):
    arguments = good()
    if framework == "torch":
        arguments = as_torch(arguments)
    outputs = poisoned_outputs(framework)
    outputs[index] = arguments["expert_topk_weight"] if change is None else change(outputs)
    with pytest.raises(error, match=message):
        moe_reroute.moe_re_routing(arguments.pop("tokens"),
                                   arguments.pop("expert_token_num_per_rank"), **arguments,
                                   out=outputs)
    for i, output in enumerate(outputs):
        if i != index:
            data = output.numpy() if isinstance(output, torch.Tensor) else output
            assert (data.view(np.uint8) == POISON).all()


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("name", ["per_token_scales", "expert_topk_weight"])
def test_zero_dim_scales_or_weight_are_refused_with_one_token(framework, name):
    """A 0-D array is not [A] with A = 1."""
    arguments = dict(tokens=np.ones((1, 4), np.float16),
                     expert_token_num_per_rank=np.ones((1, 1), np.int32),
                     **{name: np.array(0.5, np.float32)})
    if framework == "torch":
        arguments = as_torch(arguments)
    message = (r"^expert_topk_weight: must be \[A, 1\] or \[A\], got float32\[\]$"
               if name == "expert_topk_weight" else r"^per_token_scales: .*got float32\[\]$")
    for op in (moe_reroute.moe_re_routing, moe_reroute.moe_re_routing_inverse):
        with pytest.raises(ValueError, match=message):
            op(arguments["tokens"], arguments["expert_token_num_per_rank"],
               **{name: arguments[name]})


def strided_input(name):
    """(the input `name` as a view that the call must copy, out= with one
    output overlapping the view's memory, that output's index, the memory)."""
    rng = np.random.default_rng(3)
    if name == "tokens":  # every other column of [A, 8]
        memory = rng.standard_normal((A, 8)).astype(np.float16)
        view, index, overlapping = memory[:, ::2], 0, memory.reshape(-1)[:A * 4].reshape(A, 4)
    elif name == "big-endian tokens":
        memory = rng.standard_normal((A, 4)).astype(">f2")
        view, index, overlapping = memory, 0, memory.view(np.float16)
    elif name == "expert_token_num_per_rank":  # the transpose of a column-major copy
        memory = COUNTS.T.copy()
        view, index, overlapping = memory.T, 3, memory.reshape(-1)[:3]
    elif name == "per_token_scales":
        memory = rng.random(2 * A).astype(np.float32)
        view, index, overlapping = memory[::2], 1, memory[A:]
    else:  # expert_topk_weight: column 0 of [A, 2]
        memory = rng.random((A, 2)).astype(np.float32)
        view, index, overlapping = memory[:, :1], 4, memory.reshape(-1)[A:].reshape(A, 1)
    outputs = poisoned_outputs("numpy")
    outputs[index] = overlapping
    return view, outputs, index, memory


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("name", ["tokens", "big-endian tokens", "expert_token_num_per_rank",
                                  "per_token_scales", "expert_topk_weight"])
def test_out_overlapping_a_copied_input_is_refused_and_writes_nothing(framework, name):
    """An input that is not contiguous (or not in native byte order) goes to
    the core as a copy: out= is checked against the caller's own memory, the
    whole span the view touches."""
    if framework == "torch" and name == "big-endian tokens":
        pytest.skip("torch tensors have no byte order")
    view, outputs, index, memory = strided_input(name)
    before = memory.copy()
    input_name = name.removeprefix("big-endian ")
    arguments = good() | {input_name: view}
    if framework == "torch":  # the same views of the same memory
        arguments = as_torch(arguments)
        outputs = [torch.from_numpy(o) for o in outputs]
    output_name = moe_reroute._bridge.OUTPUT_NAMES["moe_re_routing"][index]
    with pytest.raises(ValueError, match=f"^{output_name}: overlaps input {input_name}$"):
        moe_reroute.moe_re_routing(arguments.pop("tokens"),
                                   arguments.pop("expert_token_num_per_rank"), **arguments,
                                   out=outputs)
    assert memory.tobytes() == before.tobytes()
    for i, output in enumerate(outputs):
        if i != index:
            data = output.numpy() if isinstance(output, torch.Tensor) else output
            assert (data.view(np.uint8) == POISON).all()


def test_inverse_sum_error_names_the_rows_it_derives_from():
    """The inverse's A is its R rows less the padding room: both are named."""
    tokens = np.ones((6, 4), np.float32)
    counts = np.array([[1, 0, 1], [1, 1, 0]], np.int32)
    with pytest.raises(ValueError, match=r"^expert_token_num_per_rank: counts sum to 4 but tokens "
                                         r"has 3 rows \(its 6 rows less E \* \(k - 1\) = 3 rows "
                                         r"of padding room\)$"):
        moe_reroute.moe_re_routing_inverse(tokens, counts, expert_alignment=2)


def test_read_only_numpy_out_is_refused():
    arguments = good()
    outputs = poisoned_outputs("numpy")
    outputs[0].flags.writeable = False
    with pytest.raises(ValueError, match="permute_tokens: is read-only"):
        moe_reroute.moe_re_routing(arguments.pop("tokens"),
                                   arguments.pop("expert_token_num_per_rank"), **arguments,
                                   out=outputs)


def test_non_array_input_is_refused():
    with pytest.raises(TypeError, match="^expert_token_num_per_rank: expected a numpy.ndarray, "
                                        "as tokens is one, got list$"):
        moe_reroute.moe_re_routing(np.ones((A, 4), np.float16), [[6]])
    with pytest.raises(TypeError, match="^per_token_scales: expected a numpy.ndarray, as tokens "
                                        "is one, got torch.Tensor$"):
        moe_reroute.moe_re_routing(np.ones((A, 4), np.float16), COUNTS,
                                   per_token_scales=torch.ones(A))
    with pytest.raises(TypeError, match="^tokens: expected a numpy.ndarray or torch.Tensor, "
                                        "got list$"):
        moe_reroute.moe_re_routing([[1.0]], COUNTS)


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("name", ["tokens", "expert_token_num_per_rank"])
def test_none_input_is_named(framework, name):
    arguments = good()
    if framework == "torch":
        arguments = as_torch(arguments)
    arguments[name] = None
    with pytest.raises(TypeError, match=f"^{name}: must be given, got None$"):
        moe_reroute.moe_re_routing(arguments.pop("tokens"),
                                   arguments.pop("expert_token_num_per_rank"), **arguments)


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("count", [4, 6])
def test_out_of_another_length_is_refused(framework, count):
    arguments = good()
    if framework == "torch":
        arguments = as_torch(arguments)
    tokens, counts = arguments.pop("tokens"), arguments.pop("expert_token_num_per_rank")
    outputs = moe_reroute.moe_re_routing(tokens, counts, **arguments)
    out = (list(outputs) * 2)[:count]
    with pytest.raises(ValueError, match=f"^out: expected 5 outputs, got {count}$"):
        moe_reroute.moe_re_routing(tokens, counts, **arguments, out=out)


def test_unpacked_fp4_numpy_is_refused():
    import ml_dtypes
    with pytest.raises(TypeError, match="tokens: dtype float4_e2m1fn is not supported"):
        moe_reroute.moe_re_routing(np.ones((A, 4), ml_dtypes.float4_e2m1fn), COUNTS)


def test_fp8_tensor_with_other_tokens_dtype_is_refused():
    tokens = torch.ones(A, 4).to(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="tokens_dtype: 'hifloat8' names the dtype of unsigned "
                                        "storage, but tokens is float8_e4m3fn"):
        moe_reroute.moe_re_routing(tokens, torch.from_numpy(COUNTS), tokens_dtype="hifloat8")



def test_fp4_storage_too_wide_to_double_is_refused():
    # A = 0 rows of 2**62 bytes: no memory, but doubling the dim for FP4 would overflow.
    tokens = np.lib.stride_tricks.as_strided(np.zeros(1, np.uint8), (0, 2**62), (2**62, 1))
    counts = np.zeros((1, 1), np.int32)
    with pytest.raises(ValueError, match="tokens: last dim 4611686018427387904 overflows"):
        moe_reroute.moe_re_routing(tokens, counts, tokens_dtype="float4_e2m1")


@pytest.mark.parametrize(("keyword", "value", "message"), [
    ("tokens_dtype", 5, "tokens_dtype: expected str, got int"),
    ("expert_alignment", "2", "expert_alignment: expected int, got str"),
    ("allow_spare_rows", "yes", "allow_spare_rows: expected bool, got str"),
    ("idx_type", True, "idx_type: expected int, got bool"),
    ("idx_type", np.bool_(False), "idx_type: expected int, got numpy.bool"),
    ("expert_alignment", np.float32(2), "expert_alignment: expected int, got numpy.float32"),
    ("expert_alignment", np.ones(2, np.int64), "expert_alignment: expected int, got numpy.ndarray"),
    ("allow_spare_rows", 1, "allow_spare_rows: expected bool, got int"),
    ("allow_spare_rows", np.int8(1), "allow_spare_rows: expected bool, got numpy.int8"),
])
def test_numpy_attribute_of_the_wrong_type_is_named(keyword, value, message):
    arguments = good()
    with pytest.raises(TypeError, match=message):
        moe_reroute.moe_re_routing(arguments.pop("tokens"),
                                   arguments.pop("expert_token_num_per_rank"), **{keyword: value})


@pytest.mark.parametrize("keyword", ["expert_token_num_type", "idx_type", "expert_alignment"])
@pytest.mark.parametrize("value", [2**63, -2**63 - 1, 2**70, np.uint64(2**64 - 1)])
def test_numpy_attribute_past_int64_is_named(keyword, value):
    arguments = good()
    with pytest.raises(ValueError, match=f"^{keyword}: {value} does not fit in int64$"):
        moe_reroute.moe_re_routing(arguments.pop("tokens"),
                                   arguments.pop("expert_token_num_per_rank"), **{keyword: value})


@pytest.mark.parametrize(("keyword", "good_value", "bad_value"), [
    ("allow_spare_rows", True, 1), ("idx_type", 1, True), ("expert_alignment", 1, 1.0)])
def test_numpy_attribute_of_the_wrong_type_is_refused_after_an_equal_good_one(keyword,
                                                                              good_value,
                                                                              bad_value):
    """Parsed attributes are kept for the next call by value and type: True
    == 1, but an earlier call with one does not let the other through."""
    arguments = good()
    tokens, counts = arguments.pop("tokens"), arguments.pop("expert_token_num_per_rank")
    moe_reroute.moe_re_routing(tokens, counts, **{keyword: good_value})
    with pytest.raises(TypeError, match=f"^{keyword}: expected "):
        moe_reroute.moe_re_routing(tokens, counts, **{keyword: bad_value})
