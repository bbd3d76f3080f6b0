"""The torch custom operators: opcheck, torch.compile (fullgraph, dynamic),
torch.export with save/load, the out= form and autograd."""

from __future__ import annotations

import io
import operator

import numpy as np
import pytest
import torch

import moe_reroute
import reference

OPS = torch.ops.moe_reroute


def workload(num_tokens, seed=0, tokens_dtype=torch.float16, hidden=8, requires_grad=False,
             num_ranks_experts=None):
    """Random inputs; counts [N, E] random, or of the given (N, E)."""
    rng = np.random.default_rng(seed)
    if num_ranks_experts is None:
        counts = torch.from_numpy(reference.random_counts(rng, num_tokens))
    else:
        num_cells = int(np.prod(num_ranks_experts))
        cells = rng.multinomial(num_tokens, np.full(num_cells, 1 / num_cells))
        counts = torch.from_numpy(cells.reshape(num_ranks_experts).astype(np.int32))
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randn(num_tokens, hidden, generator=generator).to(tokens_dtype)
    scales = torch.rand(num_tokens, generator=generator)
    weight = torch.rand(num_tokens, 1, generator=generator)
    for tensor in (tokens, scales, weight):
        tensor.requires_grad_(requires_grad and tensor.is_floating_point())
    return tokens, counts, scales, weight


def assert_bitwise_equal(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype and a.shape == e.shape
        assert torch.equal(a.detach().view(torch.uint8), e.detach().view(torch.uint8))


def opcheck_samples():
    tokens, counts, scales, weight = workload(40, seed=1)
    # uint8 scales are read as float8_e8m0 (opcheck cannot do arithmetic on float8_e8m0fnu).
    e8m0 = torch.randint(0, 255, (40, 2, 2), dtype=torch.uint8)
    hif8 = torch.randint(0, 255, (40, 6), dtype=torch.uint8)
    grad_tokens, grad_counts, grad_scales, grad_weight = workload(24, seed=2, requires_grad=True)
    return [
        ((tokens, counts), dict(per_token_scales=scales, expert_topk_weight=weight)),
        ((tokens.to(torch.int8), counts), dict(per_token_scales=e8m0, idx_type=1)),
        ((hif8, counts.long()), dict(tokens_dtype="hifloat8", expert_token_num_type=0)),
        ((grad_tokens.float(), grad_counts), dict(per_token_scales=grad_scales,
                                                 expert_topk_weight=grad_weight)),
    ]


@pytest.mark.parametrize("sample", range(4))
def test_opcheck_forward_and_inverse(sample):
    args, kwargs = opcheck_samples()[sample]
    torch.library.opcheck(OPS.moe_re_routing.default, args, kwargs)
    inverse_kwargs = {k: v for k, v in kwargs.items() if k in
                      ("per_token_scales", "expert_topk_weight", "tokens_dtype")}
    torch.library.opcheck(OPS.moe_re_routing_inverse.default, args, inverse_kwargs)


def test_opcheck_out():
    tokens, counts, scales, weight = workload(40, seed=3)
    out = [torch.empty_like(t) for t in moe_reroute.moe_re_routing(
        tokens, counts, per_token_scales=scales, expert_topk_weight=weight)]
    torch.library.opcheck(OPS.moe_re_routing_out.default, (tokens, counts, *out),
                          dict(per_token_scales=scales, expert_topk_weight=weight))


def test_fake_kernels_infer_spec_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        tokens = torch.empty(36, 385, dtype=torch.float16)
        counts = torch.empty(3, 12, dtype=torch.int64)
        scales = torch.empty(36, 1)
        weight = torch.empty(36, 1)
        outputs = OPS.moe_re_routing(tokens, counts, scales, weight)
        absent = OPS.moe_re_routing(tokens, counts)
        restored = OPS.moe_re_routing_inverse(tokens, counts, expert_topk_weight=weight)
    assert [tuple(o.shape) for o in outputs] == [(36, 385), (36, 1), (36,), (12,), (36, 1)]
    assert [o.dtype for o in outputs] == [torch.float16, torch.float32, torch.int32,
                                          torch.int64, torch.float32]
    assert [tuple(o.shape) for o in absent[1::3]] == [(36,), (0,)]
    assert [tuple(o.shape) for o in restored] == [(36, 385), (0,), (36, 1)]


def routed(tokens, counts, scales, weight):
    outputs = moe_reroute.moe_re_routing(tokens, counts, per_token_scales=scales,
                                         expert_topk_weight=weight, idx_type=1)
    restored = moe_reroute.moe_re_routing_inverse(outputs[0], counts, expert_topk_weight=outputs[4])
    return (*outputs, restored[0], restored[2])


def test_compile_fullgraph_dynamic_is_bitwise_eager():
    torch._dynamo.reset()
    compiled = torch.compile(routed, fullgraph=True, dynamic=True)
    for num_tokens in (17, 64, 200):
        inputs = workload(num_tokens, seed=num_tokens)
        assert_bitwise_equal(compiled(*inputs), routed(*inputs))


class Routed(torch.nn.Module):
    def forward(self, tokens, counts, scales, weight):
        return moe_reroute.moe_re_routing(tokens, counts, per_token_scales=scales,
                                          expert_topk_weight=weight)


def test_export_save_load_is_one_node_and_bitwise_eager():
    inputs = workload(48, seed=4, num_ranks_experts=(4, 3))
    tokens_rows = torch.export.Dim("A", min=1)
    program = torch.export.export(
        Routed(), inputs,
        dynamic_shapes=({0: tokens_rows}, None, {0: tokens_rows}, {0: tokens_rows}))
    calls = [n for n in program.graph.nodes
             if n.op == "call_function" and n.target is not operator.getitem]
    assert [n.target for n in calls] == [OPS.moe_re_routing.default]

    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer).module()
    for num_tokens in (48, 100):
        inputs = workload(num_tokens, seed=num_tokens, num_ranks_experts=(4, 3))
        assert_bitwise_equal(loaded(*inputs), Routed()(*inputs))


def test_out_writes_the_given_tensors_without_allocating():
    tokens, counts, scales, weight = workload(60, seed=5)
    expected = moe_reroute.moe_re_routing(tokens, counts, per_token_scales=scales,
                                          expert_topk_weight=weight)
    out = [torch.full_like(t, 0).view(torch.uint8).fill_(reference.POISON).view(t.dtype)
           if t.numel() else torch.empty_like(t) for t in expected]
    pointers = [t.data_ptr() for t in out]
    result = moe_reroute.moe_re_routing(tokens, counts, per_token_scales=scales,
                                        expert_topk_weight=weight, out=out)
    assert all(r is o for r, o in zip(result, out))
    assert [t.data_ptr() for t in result] == pointers
    assert_bitwise_equal(result, expected)


def test_out_is_declared_mutated_in_the_schema():
    schema = OPS.moe_re_routing_out.default._schema
    mutated = [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write]
    assert mutated == ["permute_tokens", "permute_per_token_scales", "permute_token_idx",
                       "expert_token_num", "permute_topk_weight"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_backward_is_the_inverse_reorder(dtype):
    tokens, counts, scales, weight = workload(70, seed=6, tokens_dtype=dtype, requires_grad=True)
    outputs = moe_reroute.moe_re_routing(tokens, counts, per_token_scales=scales,
                                         expert_topk_weight=weight)
    assert not outputs[2].requires_grad and not outputs[3].requires_grad
    grads = [torch.randn(t.shape).to(t.dtype) for t in (outputs[0], outputs[1], outputs[4])]
    torch.autograd.backward([outputs[0], outputs[1], outputs[4]], grads)
    gather = outputs[2].long()
    for tensor, grad in zip((tokens, scales, weight), grads):
        expected = torch.empty_like(grad)
        expected[gather] = grad
        assert tensor.grad.dtype == tensor.dtype
        assert torch.equal(tensor.grad.view(torch.uint8), expected.view(torch.uint8))


def test_inverse_backward_is_the_forward_reorder():
    tokens, counts, _, weight = workload(30, seed=7, tokens_dtype=torch.float32,
                                         requires_grad=True)
    restored, _, restored_weight = moe_reroute.moe_re_routing_inverse(
        tokens, counts, expert_topk_weight=weight)
    grad = torch.randn(restored.shape)
    grad_weight = torch.randn(restored_weight.shape)
    torch.autograd.backward([restored, restored_weight], [grad, grad_weight])
    forward = moe_reroute.moe_re_routing(grad, counts, expert_topk_weight=grad_weight)
    assert torch.equal(tokens.grad, forward[0])
    assert torch.equal(weight.grad, forward[4])



def test_out_bumps_the_version_of_each_output():
    tokens, counts, scales, weight = workload(20, seed=8)
    out = [torch.empty_like(t) for t in moe_reroute.moe_re_routing(
        tokens, counts, per_token_scales=scales, expert_topk_weight=weight)]
    versions = [t._version for t in out]
    moe_reroute.moe_re_routing(tokens, counts, per_token_scales=scales, expert_topk_weight=weight,
                               out=out)
    assert all(t._version > v for t, v in zip(out, versions))


def test_no_grad_call_on_grad_inputs_records_no_graph():
    tokens, counts, scales, weight = workload(20, seed=9, tokens_dtype=torch.float32,
                                              requires_grad=True)
    with torch.no_grad():
        outputs = moe_reroute.moe_re_routing(tokens, counts, per_token_scales=scales,
                                             expert_topk_weight=weight)
    with_grad = moe_reroute.moe_re_routing(tokens, counts, per_token_scales=scales,
                                           expert_topk_weight=weight)
    assert not any(t.requires_grad for t in outputs)
    assert with_grad[0].grad_fn is not None
    assert_bitwise_equal(outputs, with_grad)
