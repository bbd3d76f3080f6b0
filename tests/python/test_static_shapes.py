"""expert_alignment and allow_spare_rows (docs/spec.md section 9) through NumPy
and torch, against the naive reference's own static-shape layout: k in
{1, 2, 16, 128}, E = 1, all-zero counts, A = 0, sum(c) = 0 < A, skew, both
index types, both count modes, every scale form, allocating and out=, and the
inverse. Tail rows (never written) keep the POISON of an out= buffer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moe_reroute
import reference
from cases import (FRAMEWORKS, SCALE_CASES, byte_rows, check_torch_forward, poisoned,
                   random_array, rows, seeded)


def counts_for(rng, shape, total, skew):
    """[N, E] int counts summing to `total`, skewed onto one cell when `skew`."""
    cells = int(np.prod(shape))
    p = np.full(cells, 1 / cells)
    if skew:
        p = np.full(cells, 0.01 / max(cells - 1, 1))
        p[0] = 0.99 if cells > 1 else 1
    return rng.multinomial(total, p / p.sum()).reshape(shape)


# (label, A, valid rows sum(c), (N, E), skew)
LAYOUTS = [
    ("E=1", 12, 12, (3, 1), False),
    ("all zero A=0", 0, 0, (2, 3), False),
    ("sum 0 < A", 9, 0, (2, 3), False),
    ("skew", 40, 40, (4, 4), True),
    ("spare", 40, 25, (2, 5), False),
    ("uniform", 33, 33, (3, 2), False),
]
ALIGNMENTS = (1, 2, 16, 128)


def params():
    for label, num_tokens, valid, shape, skew in LAYOUTS:
        for k in ALIGNMENTS:
            yield pytest.param(num_tokens, valid, shape, skew, k, id=f"{label}-k{k}")


def array(framework, data):
    return data if framework == "numpy" else torch.from_numpy(data)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize(("num_tokens", "valid", "shape", "skew", "k"), list(params()))
def test_forward_and_inverse_match_the_reference(framework, num_tokens, valid, shape, skew, k):
    rng = seeded("static", framework, str(num_tokens), str(valid), str(shape), str(k))
    spare = valid < num_tokens
    for trial, scale_case in enumerate(SCALE_CASES):
        counts = counts_for(rng, shape, valid, skew).astype(np.int32 if trial % 2 else np.int64)
        # FP8 tokens (uint8 storage) take every scale form.
        dtype = np.uint8 if framework == "numpy" else torch.uint8
        tokens = random_array(framework, rng, dtype, (num_tokens, 6), 1)
        scales = None
        if scale_case is not None:
            scales = random_array(framework, rng, scale_case.numpy_dtype if framework == "numpy"
                                  else scale_case.torch_dtype,
                                  (num_tokens, *scale_case.trailing), scale_case.itemsize)
        weight = random_array(framework, rng, np.float32 if framework == "numpy"
                              else torch.float32, (num_tokens, 1), 4) if trial % 3 else None
        attributes = dict(expert_token_num_type=trial % 2, idx_type=(trial // 2) % 2,
                          expert_alignment=k, allow_spare_rows=spare)
        expected = reference.reroute(byte_rows(tokens), counts,
                                     None if scales is None else byte_rows(scales),
                                     None if weight is None else byte_rows(weight), **attributes)
        kwargs = dict(per_token_scales=scales, expert_topk_weight=weight,
                      tokens_dtype="float8_e4m3fn", **attributes)
        result = moe_reroute.moe_re_routing(tokens, array(framework, counts), **kwargs)
        num_rows = reference.rows_out(num_tokens, shape[1], k)
        assert result[0].shape[0] == num_rows
        written = reference.valid_rows(counts, k)
        for i in (0, 1, 4):
            if i == 4 and weight is None:
                continue
            np.testing.assert_array_equal(byte_rows(result[i])[:written], expected[i][:written])
        np.testing.assert_array_equal(np.asarray(result[2]), expected[2])
        np.testing.assert_array_equal(np.asarray(result[3]), expected[3])

        # out= into poisoned buffers: the tail rows stay POISON.
        out = [poisoned(framework, r.dtype, tuple(r.shape),
                        r.itemsize if framework == "numpy" else r.element_size())
               for r in result]
        moe_reroute.moe_re_routing(tokens, array(framework, counts), **kwargs, out=out)
        for i in (0, 1, 4):
            if i == 4 and weight is None:
                continue
            np.testing.assert_array_equal(byte_rows(out[i]), expected[i])

        restored = moe_reroute.moe_re_routing_inverse(
            result[0], array(framework, counts),
            per_token_scales=None if scales is None else result[1],
            expert_topk_weight=None if weight is None else result[4],
            tokens_dtype="float8_e4m3fn", expert_alignment=k, allow_spare_rows=spare)
        want = reference.inverse(byte_rows(result[0]), counts,
                                 None if scales is None else byte_rows(result[1]),
                                 None if weight is None else byte_rows(result[4]),
                                 expert_alignment=k, allow_spare_rows=spare)
        for output, rows_want in zip(restored, want):
            if rows_want is not None:
                assert output.shape[0] == num_tokens
                np.testing.assert_array_equal(byte_rows(output)[:valid], rows_want[:valid])


@pytest.mark.parametrize("k", [2, 16])
def test_backward_gives_zero_to_rows_never_read(k):
    counts = torch.tensor([[3, 0, 2], [1, 4, 0]], dtype=torch.int32)
    tokens = torch.randn(14, 8).requires_grad_()  # 10 valid rows, 4 spare
    permuted = moe_reroute.moe_re_routing(tokens, counts, expert_alignment=k,
                                          allow_spare_rows=True)
    grad = torch.randn(permuted[0].shape)
    permuted[0].backward(grad)
    expected = reference.inverse(rows(grad), counts.numpy(), expert_alignment=k)[0]
    expected[10:] = 0
    np.testing.assert_array_equal(rows(tokens.grad), expected)

    expert_rows = torch.randn(permuted[0].shape).requires_grad_()
    restored = moe_reroute.moe_re_routing_inverse(expert_rows, counts, expert_alignment=k,
                                                  allow_spare_rows=True)[0]
    grad = torch.randn(restored.shape)
    restored.backward(grad)
    forward = reference.reroute(rows(grad), counts.numpy(), expert_alignment=k)[0]
    written = reference.valid_rows(counts.numpy(), k)
    forward[written:] = 0  # tail rows: never read by the inverse
    np.testing.assert_array_equal(rows(expert_rows.grad), forward)


def test_fake_kernel_rows_follow_a_and_e_symbolically():
    torch._dynamo.reset()
    step = torch.compile(lambda tokens, counts: moe_reroute.moe_re_routing(
        tokens, counts, expert_alignment=16, allow_spare_rows=True), fullgraph=True, dynamic=True)
    for num_tokens, shape in ((20, (2, 3)), (50, (2, 5)), (7, (1, 4))):
        tokens = torch.randn(num_tokens, 8)
        counts = torch.from_numpy(counts_for(np.random.default_rng(num_tokens), shape,
                                             num_tokens - 3, False).astype(np.int32))
        outputs = step(tokens, counts)
        assert outputs[0].shape[0] == num_tokens + shape[1] * 15
        check_torch_forward(outputs, tokens, counts, None, None, expert_alignment=16,
                            allow_spare_rows=True)
