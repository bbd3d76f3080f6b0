"""moe_reroute.compat: the torch_npu names map the original's arguments onto
the operators, checked against the naive references (reference.py and
test_routing.py's), for NumPy and torch alike; what has no counterpart is
refused by name."""

from __future__ import annotations

import numpy as np
import pytest

import reference
from cases import FRAMEWORKS, as_numpy, byte_rows, seeded, torch
from moe_reroute import compat
from test_routing import finalize_reference, init_reference, to_framework

T, K, H, E = 9, 3, 5, 6


def inputs(framework, seed):
    rng = seeded("compat", framework, seed)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = rng.integers(0, E, (T, K)).astype(np.int32)
    scale = rng.standard_normal(T).astype(np.float32)
    return rng, x, ids, scale, [to_framework(framework, a) for a in (x, ids, scale)]


def same_bytes(got, want):
    return np.array_equal(byte_rows(as_numpy(got).reshape(1, -1)),
                          byte_rows(np.ascontiguousarray(want).reshape(1, -1)))


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize(("num_type", "flag", "ours"), [(0, False, 0), (0, True, 1), (1, True, 2)])
def test_init_routing_v2_maps_the_original_arguments(framework, num_type, flag, ours):
    _, x, ids, scale, (fx, fids, fscale) = inputs(framework, f"{num_type}{flag}")
    got = compat.npu_moe_init_routing_v2(fx, fids, scale=fscale, active_num=-1, expert_num=E,
                                         expert_tokens_num_type=num_type,
                                         expert_tokens_num_flag=flag)
    expanded, row_idx, counts, _ = init_reference(
        byte_rows(x), ids, expert_num=E, expert_tokens_count_or_cumsum_flag=ours)
    # expanded_scale: each row's token's scale, as the rows moved.
    expanded_scale, _, _, _ = init_reference(byte_rows(scale.reshape(-1, 1)), ids, expert_num=E)
    assert same_bytes(got[0], expanded)
    assert np.array_equal(as_numpy(got[1]), row_idx)
    assert np.array_equal(as_numpy(got[2]), counts)
    assert same_bytes(got[3], expanded_scale)
    assert as_numpy(got[3]).dtype == np.float32


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_init_routing_v2_capacity_and_no_scale(framework):
    _, x, ids, _, (fx, fids, _) = inputs(framework, "capacity")
    got = compat.npu_moe_init_routing_v2(fx, fids, expert_capacity=2, expert_num=E,
                                         drop_pad_mode=1)
    expanded, row_idx, _, _ = init_reference(byte_rows(x), ids, expert_capacity=2, expert_num=E,
                                             drop_pad_mode=1)
    assert same_bytes(got[0], expanded)
    assert np.array_equal(as_numpy(got[1]), row_idx)
    assert as_numpy(got[3]).shape == (0,) and as_numpy(got[3]).dtype == np.float32


@pytest.mark.parametrize(("keyword", "value"), [
    ("quant_mode", 0), ("quant_mode", 1), ("offset", np.zeros(1, np.float32)),
    ("active_expert_range", [0, 3]), ("row_idx_type", 1), ("expert_tokens_num_type", 2)])
def test_init_routing_v2_refuses_what_has_no_counterpart(keyword, value):
    _, _, _, _, (x, ids, _) = inputs("numpy", "refuse")
    with pytest.raises(NotImplementedError, match=f"^{keyword}: "):
        compat.npu_moe_init_routing_v2(x, ids, expert_num=E, **{keyword: value})


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_finalize_routing_takes_the_original_positions(framework):
    rng, _, ids, _, _ = inputs(framework, "finalize")
    rows = rng.standard_normal((T * K, H)).astype(np.float32)
    row_idx = rng.permutation(T * K).astype(np.int32)
    skip1, skip2 = (rng.standard_normal((T, H)).astype(np.float32) for _ in range(2))
    bias = rng.standard_normal((E, H)).astype(np.float32)
    scales = rng.standard_normal((T, K)).astype(np.float32)
    args = [to_framework(framework, a) for a in (rows, skip1, skip2, bias, scales, row_idx, ids)]
    got = compat.npu_moe_finalize_routing(*args, 2)
    want = finalize_reference(rows, row_idx, skip1, skip2, bias, scales, ids, drop_pad_mode=2)
    assert same_bytes(got, want)
    got = compat.npu_moe_finalize_routing(args[0], None, None, None, None, args[5], None)
    assert same_bytes(got, finalize_reference(rows, row_idx))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_re_routing_names_give_the_original_four_outputs(framework):
    rng = seeded("compat re_routing", framework)
    counts = np.array([[1, 0, 2], [2, 1, 0]], np.int32)
    tokens = rng.integers(-100, 100, (6, 4)).astype(np.int8)
    scales = rng.standard_normal(6).astype(np.float32)
    want = reference.reroute(byte_rows(tokens), counts, byte_rows(scales.reshape(-1, 1)),
                             expert_token_num_type=0, idx_type=1)
    ft, fc, fs = (to_framework(framework, a) for a in (tokens, counts, scales))
    for got in (compat.npu_moe_re_routing(ft, fc, per_token_scales=fs, expert_token_num_type=0,
                                          idx_type=1),
                compat.moe_re_routing(ft, fc, fs, 0, 1)):
        assert len(got) == 4
        assert same_bytes(got[0], want[0]) and same_bytes(got[1], want[1])
        assert np.array_equal(as_numpy(got[2]), want[2])
        assert np.array_equal(as_numpy(got[3]), want[3])


def test_compat_works_without_torch_tensors_too():
    # The empty expanded_scale of a NumPy call is a NumPy array, not a tensor.
    _, _, _, _, (x, ids, _) = inputs("numpy", "types")
    assert isinstance(compat.npu_moe_init_routing_v2(x, ids)[3], np.ndarray)
    if torch is not None:
        _, _, _, _, (tx, tids, _) = inputs("torch", "types")
        assert isinstance(compat.npu_moe_init_routing_v2(tx, tids)[3], torch.Tensor)
