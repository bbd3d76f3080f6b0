"""Dtype sweeps and framework helpers shared by the Python tests."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import ml_dtypes
import numpy as np

import reference
from reference import POISON, random_bytes

try:
    import torch
except ImportError:  # the NumPy-only install (scripts/test.sh tests it too)
    torch = None

FRAMEWORKS = ("numpy",) if torch is None else ("numpy", "torch")
_TENSOR = () if torch is None else torch.Tensor  # isinstance(x, ()) is False


class _TorchNamed:
    """A case that names its torch dtype (torch_name)."""

    @property
    def torch_dtype(self):
        """None where this torch lacks it, or without torch."""
        return getattr(torch, self.torch_name, None)


@dataclass(frozen=True)
class TokenCase(_TorchNamed):
    label: str
    numpy_dtype: object  # None where NumPy has no storage for it
    torch_name: str
    tokens_dtype: str | None
    bits: int  # bits per logical element

    def dtype(self, framework: str):
        return self.numpy_dtype if framework == "numpy" else self.torch_dtype


TOKEN_CASES = [
    TokenCase("float16", np.float16, "float16", None, 16),
    TokenCase("bfloat16", ml_dtypes.bfloat16, "bfloat16", None, 16),
    TokenCase("int8", np.int8, "int8", None, 8),
    TokenCase("float32", np.float32, "float32", None, 32),
    TokenCase("uint8", np.uint8, "uint8", None, 8),
    TokenCase("float8_e5m2", ml_dtypes.float8_e5m2, "float8_e5m2", None, 8),
    TokenCase("float8_e4m3fn", ml_dtypes.float8_e4m3fn, "float8_e4m3fn", None, 8),
    TokenCase("uint8-hifloat8", np.uint8, "uint8", "hifloat8", 8),
    TokenCase("uint8-float4_e2m1", np.uint8, "uint8", "float4_e2m1", 4),
    TokenCase("uint8-float4_e1m2", np.uint8, "uint8", "float4_e1m2", 4),
    TokenCase("uint8-float8_e4m3fn", np.uint8, "uint8", "float8_e4m3fn", 8),
    TokenCase("uint8-float8_e5m2", np.uint8, "uint8", "float8_e5m2", 8),
    TokenCase("float4_e2m1fn_x2", None, "float4_e2m1fn_x2", None, 4),
]


@dataclass(frozen=True)
class ScaleCase(_TorchNamed):
    label: str
    numpy_dtype: object
    torch_name: str
    trailing: tuple  # dims past A
    itemsize: int
    dtype_name: str  # what the core reads: float32 or float8_e8m0


SCALE_CASES = [
    None,
    ScaleCase("float32[A]", np.float32, "float32", (), 4, "float32"),
    ScaleCase("float32[A,S]", np.float32, "float32", (3,), 4, "float32"),
    ScaleCase("float32[A,K,2]", np.float32, "float32", (3, 2), 4, "float32"),
    ScaleCase("e8m0[A]", ml_dtypes.float8_e8m0fnu, "float8_e8m0fnu", (), 1, "float8_e8m0"),
    ScaleCase("uint8[A,S] as e8m0", np.uint8, "uint8", (5,), 1, "float8_e8m0"),
    ScaleCase("e8m0[A,K,2]", ml_dtypes.float8_e8m0fnu, "float8_e8m0fnu", (4, 2), 1,
              "float8_e8m0"),
]

FP8 = ("float8_e5m2", "float8_e4m3fn")
FP4 = ("float4_e2m1", "float4_e1m2")


def token_name(case: TokenCase) -> str:
    """The dtype the core reads tokens of `case` as."""
    return case.tokens_dtype or {"float4_e2m1fn_x2": "float4_e2m1"}.get(case.label, case.label)


def pairs(case: TokenCase, scales: ScaleCase) -> bool:
    """The rule-7 pairing table (docs/spec.md section 4): FP8 tokens take every
    scale form of both dtypes; FP4 tokens float32 or e8m0 [A] / [A, S]; other
    tokens float32 [A] / [A, S] only."""
    name = token_name(case)
    if name in FP8:
        return True
    if len(scales.trailing) > 1:
        return False
    return name in FP4 or scales.dtype_name == "float32"


def from_bytes(framework: str, data: np.ndarray, dtype, shape):
    """`data` (uint8 rows) reinterpreted as `dtype` of `shape`, in the framework."""
    if framework == "numpy":
        return data.view(dtype).reshape(shape)
    return torch.from_numpy(data.reshape(-1)).view(dtype).reshape(shape)


def random_array(framework, rng, dtype, shape, itemsize):
    rows = shape[0]
    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * itemsize
    return from_bytes(framework, random_bytes(rng, (rows, row_bytes)), dtype, shape)


def poisoned(framework, dtype, shape, itemsize):
    """An output of `dtype` and `shape` filled with POISON bytes."""
    rows = shape[0]
    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * itemsize
    return from_bytes(framework, np.full((rows, row_bytes), POISON, np.uint8), dtype, shape)


def byte_rows(array) -> np.ndarray:
    """[dim 0, bytes per row] uint8 copy of an array or tensor."""
    if isinstance(array, _TENSOR):
        itemsize = array.element_size()
        # One-byte dtypes as uint8 first: torch cannot copy float4_e2m1fn_x2.
        data = array.detach().view(torch.uint8) if itemsize == 1 else array.detach()
        flat = data.contiguous().view(torch.uint8).reshape(-1).numpy()
    else:
        itemsize = array.itemsize
        flat = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
    row_bytes = int(np.prod(array.shape[1:], dtype=np.int64)) * itemsize
    return flat.reshape(array.shape[0], row_bytes).copy()


def as_numpy(array) -> np.ndarray:
    return array.numpy() if isinstance(array, _TENSOR) else array


def framework_dtype(framework: str, name: str):
    return getattr(np if framework == "numpy" else torch, name)


def counts_array(framework: str, counts: np.ndarray):
    return counts if framework == "numpy" else torch.from_numpy(counts)


def array_type(framework: str):
    return np.ndarray if framework == "numpy" else _TENSOR


def seeded(*labels) -> np.random.Generator:
    """A generator seeded by the test's labels, so every case has its own data."""
    return np.random.default_rng(zlib.crc32("/".join(labels).encode()))


def make_inputs(framework, case, rng, trial):
    """(counts, tokens, scales, weight) of trial `trial`: A = 0 first, H = 7168
    second, the scale case and weight layout cycling with the trial."""
    num_tokens = 0 if trial == 0 else None
    counts = reference.random_counts(rng, num_tokens, np.int32 if trial % 2 else np.int64)
    num_tokens = int(counts.sum())
    hidden = 2 * int(rng.integers(1, 20)) if trial != 1 else 7168
    element_bytes = max(1, case.bits // 8)  # FP4 storage: one byte per two elements
    columns = hidden * case.bits // 8 // element_bytes
    tokens = random_array(framework, rng, case.dtype(framework), (num_tokens, columns),
                          element_bytes)
    paired = [None] + [s for s in SCALE_CASES[1:] if pairs(case, s)]
    scale_case = paired[trial % len(paired) if trial else rng.integers(len(paired))]
    scales = None
    if scale_case is not None:
        scales = random_array(framework, rng, scale_case.numpy_dtype if framework == "numpy"
                              else scale_case.torch_dtype, (num_tokens, *scale_case.trailing),
                              scale_case.itemsize)
    weight_shape = [None, (num_tokens, 1), (num_tokens,)][trial % 3]
    weight = None if weight_shape is None else random_array(
        framework, rng, framework_dtype(framework, "float32"), weight_shape, 4)
    return counts, tokens, scales, weight


def poisoned_outputs(framework, tokens, counts, scales, weight):
    """Outputs with the SPEC section 4 specs, every byte POISON."""
    f32, i32 = framework_dtype(framework, "float32"), framework_dtype(framework, "int32")
    num_tokens = tokens.shape[0]

    def like(array):
        itemsize = array.itemsize if framework == "numpy" else array.element_size()
        return poisoned(framework, array.dtype, tuple(array.shape), itemsize)

    return [
        like(tokens),
        like(scales) if scales is not None else poisoned(framework, f32, (num_tokens,), 4),
        poisoned(framework, i32, (num_tokens,), 4),
        like(counts[0]),
        like(weight) if weight is not None else poisoned(framework, f32, (0,), 4),
    ]



def rows(tensor) -> np.ndarray:
    """Byte rows of a tensor on any device."""
    return byte_rows(tensor.detach().cpu())


def check_torch_forward(outputs, tokens, counts, scales, weight, **attributes):
    """Each forward output byte for byte as the reference (tail rows aside)."""
    expected = reference.reroute(rows(tokens), counts.cpu().numpy(),
                                 None if scales is None else rows(scales),
                                 None if weight is None else rows(weight), **attributes)
    valid = reference.valid_rows(counts.cpu().numpy(), attributes.get("expert_alignment", 1))
    for i in (0, 1, 4):
        if i == 4 and weight is None:
            assert tuple(outputs[4].shape) == (0,)
            continue
        np.testing.assert_array_equal(rows(outputs[i])[:valid], expected[i][:valid])
    np.testing.assert_array_equal(outputs[2].cpu().numpy(), expected[2])
    np.testing.assert_array_equal(outputs[3].cpu().numpy(), expected[3])


def check_torch_inverse(restored, tokens, counts, scales, weight):
    expected = reference.inverse(rows(tokens), counts.cpu().numpy(),
                                 None if scales is None else rows(scales),
                                 None if weight is None else rows(weight))
    for output, want in zip(restored, expected):
        if want is None:
            assert output.dtype == torch.float32 and tuple(output.shape) == (0,)
        else:
            np.testing.assert_array_equal(rows(output), want)
