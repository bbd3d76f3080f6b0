"""The torch operators: opcheck, FakeTensorMode / compile / export refusing
what eager refuses, torch.compile (fullgraph, dynamic), torch.export with
save/load, AOTInductor packages, the out= form and autograd, every result
checked against the naive reference."""

from __future__ import annotations

import functools
import gc
import io
import operator
import os
import re
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.utils.checkpoint
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import moe_reroute
import reference
from cases import byte_rows, poisoned_outputs, rows
from cases import check_torch_forward as check_forward
from cases import check_torch_inverse as check_inverse
from test_errors import A, BAD_INPUTS, COUNTS, as_torch, good

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


def opcheck_samples():
    tokens, counts, scales, weight = workload(40, seed=1)
    # uint8 scales are read as float8_e8m0 (opcheck cannot do arithmetic on float8_e8m0fnu).
    e8m0 = torch.randint(0, 255, (40, 2, 2), dtype=torch.uint8)
    hif8 = torch.randint(0, 255, (40, 6), dtype=torch.uint8)
    grad_tokens, grad_counts, grad_scales, grad_weight = workload(24, seed=2, requires_grad=True)
    return [
        ((tokens, counts), dict(per_token_scales=scales, expert_topk_weight=weight)),
        ((tokens.view(torch.uint8), counts), dict(per_token_scales=e8m0, idx_type=1,
                                                  tokens_dtype="float8_e4m3fn")),
        ((hif8, counts.long()), dict(tokens_dtype="hifloat8", expert_token_num_type=0)),
        ((grad_tokens.float(), grad_counts), dict(per_token_scales=grad_scales,
                                                 expert_topk_weight=grad_weight)),
    ]


INVERSE_KEYS = ("per_token_scales", "expert_topk_weight", "tokens_dtype")


@pytest.mark.parametrize("sample", range(4))
def test_opcheck_forward_and_inverse(sample):
    args, kwargs = opcheck_samples()[sample]
    torch.library.opcheck(OPS.moe_re_routing.default, args, kwargs)
    inverse_kwargs = {k: v for k, v in kwargs.items() if k in INVERSE_KEYS}
    torch.library.opcheck(OPS.moe_re_routing_inverse.default, args, inverse_kwargs)


def test_opcheck_out():
    tokens, counts, scales, weight = workload(40, seed=3)
    out = [torch.empty_like(t) for t in OPS.moe_re_routing(tokens, counts, scales, weight)]
    torch.library.opcheck(OPS.moe_re_routing_out.default, (tokens, counts, *out),
                          dict(per_token_scales=scales, expert_topk_weight=weight))


def test_fake_kernels_infer_the_core_specs():
    with FakeTensorMode():
        tokens = torch.empty(36, 385, dtype=torch.float16)
        counts = torch.empty(3, 12, dtype=torch.int64)
        scales = torch.empty(36, 1)
        weight = torch.empty(36, 1)
        outputs = OPS.moe_re_routing(tokens, counts, scales, weight, idx_type=1)
        absent = OPS.moe_re_routing(tokens, counts)
        restored = OPS.moe_re_routing_inverse(tokens, counts, expert_topk_weight=weight)
        fp4 = OPS.moe_re_routing(torch.empty(36, 8, dtype=torch.uint8), counts,
                                 tokens_dtype="float4_e2m1")
    assert [tuple(o.shape) for o in outputs] == [(36, 385), (36, 1), (36,), (12,), (36, 1)]
    assert [o.dtype for o in outputs] == [torch.float16, torch.float32, torch.int32,
                                          torch.int64, torch.float32]
    assert [tuple(o.shape) for o in absent[1::3]] == [(36,), (0,)]
    assert [tuple(o.shape) for o in restored] == [(36, 385), (0,), (36, 1)]
    assert (fp4[0].dtype, tuple(fp4[0].shape)) == (torch.uint8, (36, 8))


# Errors decided from shapes and dtypes alone (the others read the counts).
DATA_FREE = [b for b in BAD_INPUTS if not b[0].startswith("counts ")
             or b[0] in ("counts 1-D", "counts float")]


def eager_error(arguments):
    tokens = arguments.pop("tokens")
    counts = arguments.pop("expert_token_num_per_rank")
    with pytest.raises(Exception) as caught:
        OPS.moe_re_routing(tokens, counts, **arguments)
    return caught.value


@pytest.mark.parametrize(("label", "changes", "error", "message"), DATA_FREE,
                         ids=[b[0] for b in DATA_FREE])
def test_fake_compile_and_export_refuse_as_eager(label, changes, error, message):
    arguments = as_torch(good() | changes)
    eager = eager_error(dict(arguments))
    assert type(eager) is error

    with FakeTensorMode() as mode:
        fake = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v
                for k, v in arguments.items()}
        with pytest.raises(error) as caught:
            OPS.moe_re_routing(fake.pop("tokens"), fake.pop("expert_token_num_per_rank"), **fake)
    assert str(caught.value) == str(eager)

    tensors = {k: v for k, v in arguments.items() if isinstance(v, torch.Tensor)}
    others = {k: v for k, v in arguments.items() if not isinstance(v, torch.Tensor)}

    class Call(torch.nn.Module):
        def forward(self, **inputs):
            return OPS.moe_re_routing(inputs.pop("tokens"),
                                      inputs.pop("expert_token_num_per_rank"), **inputs, **others)

    with pytest.raises(error) as caught:
        torch.export.export(Call(), (), tensors)
    assert str(caught.value) == str(eager)

    # Dynamo reports a fake kernel's exception as TorchRuntimeError quoting it.
    torch._dynamo.reset()
    compiled = torch.compile(Call(), fullgraph=True)
    with pytest.raises(Exception) as caught:
        compiled(**tensors)
    assert f"{error.__name__}({str(eager)!r})" in str(caught.value)


# Eager's refusals that read the counts' values (docs/spec.md section 4, rules 4 and 5).
DATA_ERROR = re.compile(r"^expert_token_num_per_rank: (count\[.* is negative|counts sum to |counts overflow)")


def random_arguments(rng):
    """Inputs and attributes mostly well formed, each with a chance to be
    wrong in dtype, rank, size or value, so that several rules meet."""
    choose = lambda options: options[rng.integers(len(options))]  # noqa: E731
    num_tokens = int(choose([0, 1, 3, 6]))
    dtype = choose([torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8,
                    torch.float8_e4m3fn, torch.float64])
    tokens = torch.zeros(num_tokens, int(choose([2, 4, 6])), dtype=dtype)
    if rng.random() < 0.1:
        tokens = tokens[:, None]
    num_ranks, num_experts = int(choose([1, 2])), int(choose([1, 2, 3]))
    counts = torch.zeros(num_ranks, num_experts,
                         dtype=choose([torch.int32, torch.int64, torch.int32, torch.float32]))
    counts.view(-1)[rng.integers(counts.numel())] = num_tokens + int(rng.random() < 0.1)
    if rng.random() < 0.1:
        counts = counts.view(-1)

    def optional(dtypes, shapes):
        if rng.random() < 0.4:
            return None
        return torch.zeros(choose(shapes), dtype=choose(dtypes))

    rows = [num_tokens] * 3 + [1, num_tokens + 1]
    scales = optional([torch.float32, torch.float32, torch.uint8, torch.float16],
                      [(choose(rows),), (choose(rows), 2), (choose(rows), 2, 2), ()])
    weight = optional([torch.float32, torch.float32, torch.bfloat16],
                      [(choose(rows),), (choose(rows), 1), (choose(rows), 2), (choose(rows), 1, 1)])
    attributes = dict(tokens_dtype=choose([None] * 12 + ["hifloat8", "float8_e4m3fn", "bogus",
                                                         "float4_e2m1", "bfloat16"]),
                      expert_alignment=int(choose([1, 1, 1, 4, 0])),
                      allow_spare_rows=bool(rng.random() < 0.3))
    forward_attributes = dict(expert_token_num_type=int(choose([1, 1, 0, 2, -1])),
                              idx_type=int(choose([0, 0, 1, 3])))
    return (tokens, counts, scales, weight), attributes, forward_attributes


def outcome(call):
    """(exception type, message), or the outputs' (shape, dtype)s."""
    try:
        return [(tuple(o.shape), o.dtype) for o in call()]
    except Exception as refused:  # noqa: BLE001 - compared between eager and fake
        return type(refused), str(refused)


@pytest.mark.parametrize("op", ["moe_re_routing", "moe_re_routing_inverse"])
def test_fake_kernels_decide_as_eager_on_random_inputs(op):
    """Over random inputs where several rules meet: the fake kernel refuses
    with eager's exception and message, or gives eager's output specs; only
    where eager refuses the counts' values does the fake kernel, which cannot
    read them, give outputs."""
    rng = np.random.default_rng(20)
    seen = set()
    for _ in range(300):
        tensors, attributes, forward_attributes = random_arguments(rng)
        if op == "moe_re_routing":
            attributes |= forward_attributes
        call = functools.partial(getattr(OPS, op), **attributes)
        eager = outcome(lambda: call(*tensors))
        with FakeTensorMode() as mode:
            fake = outcome(lambda: call(*(None if t is None else mode.from_tensor(t)
                                          for t in tensors)))
        if isinstance(eager, tuple) and DATA_ERROR.match(eager[1]):
            assert isinstance(fake, list), (eager, fake)
        else:
            assert fake == eager, (tensors, attributes)
        seen.add(eager[1].split(":")[0] if isinstance(eager, tuple) else "outputs")
    # The cases reach the outputs and the refusals of most arguments.
    assert {"outputs", "tokens", "tokens_dtype", "expert_token_num_per_rank", "per_token_scales",
            "expert_topk_weight", "expert_alignment"} <= seen, seen


def dense_dtypes():
    """Every torch dtype but the quantized ones (other tensors than dense ones) by its
    Python name, once each (torch.bit is torch.uint1)."""
    dtypes = {getattr(torch, name) for name in dir(torch)
              if isinstance(getattr(torch, name), torch.dtype)}
    names = {dtype: str(dtype).removeprefix("torch.") for dtype in dtypes}
    return {dtype: name for dtype, name in names.items() if not name.startswith(("qint", "quint"))}


REFUSED_TOKEN_DTYPES = sorted(
    ((dtype, name) for dtype, name in dense_dtypes().items()
     if not any(row["torch_name"] == name and row["token"] for row in moe_reroute.dtype_table())),
    key=operator.itemgetter(1))


@pytest.mark.filterwarnings("ignore:.* support is experimental")  # complex32, bcomplex32
@pytest.mark.parametrize(("dtype", "name"), REFUSED_TOKEN_DTYPES,
                         ids=[name for _, name in REFUSED_TOKEN_DTYPES])
def test_every_refused_torch_dtype_is_named_as_in_python_eager_and_fake(dtype, name):
    table_names = {row["torch_name"]: row["name"] for row in moe_reroute.dtype_table()}
    counts = torch.from_numpy(COUNTS)
    tokens = torch.empty(A, 4, dtype=dtype)
    with pytest.raises(TypeError, match=f"^tokens: dtype {table_names.get(name, name)} ") as eager:
        OPS.moe_re_routing(tokens, counts)
    with FakeTensorMode() as mode, pytest.raises(TypeError) as fake:
        OPS.moe_re_routing(mode.from_tensor(tokens), mode.from_tensor(counts))
    assert str(fake.value) == str(eager.value)


INVERSE_ARGUMENTS = ("tokens", "expert_token_num_per_rank", "per_token_scales",
                     "expert_topk_weight", "tokens_dtype", "expert_alignment", "allow_spare_rows")


@pytest.mark.parametrize(("label", "changes", "error", "message"), DATA_FREE,
                         ids=[b[0] for b in DATA_FREE])
def test_inverse_fake_refuses_as_eager(label, changes, error, message):
    """The inverse's fake kernel against its eager kernel on the forward's bad
    inputs: the same exception where eager refuses (the inverse checks no
    pairing, so some of them it takes), and outputs of eager's specs where not."""
    arguments = {k: v for k, v in as_torch(good() | changes).items() if k in INVERSE_ARGUMENTS}
    try:
        eager = OPS.moe_re_routing_inverse(**arguments)
    except Exception as refused:  # noqa: BLE001 - compared with the fake's below
        eager = refused
    with FakeTensorMode() as mode:
        fake = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v
                for k, v in arguments.items()}
        try:
            faked = OPS.moe_re_routing_inverse(**fake)
        except Exception as refused:  # noqa: BLE001
            faked = refused
    if isinstance(eager, Exception):
        assert (type(faked), str(faked)) == (type(eager), str(eager))
    else:
        assert [(t.dtype, tuple(t.shape)) for t in faked] == [(t.dtype, tuple(t.shape))
                                                              for t in eager]


def refusals(call, arguments):
    """The exception eager raises for `call(**arguments)`, and FakeTensorMode's."""
    with pytest.raises(Exception) as eager:
        call(**arguments)
    with FakeTensorMode() as mode:
        fake = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v
                for k, v in arguments.items()}
        with pytest.raises(Exception) as faked:
            call(**fake)
    return eager.value, faked.value


def out_arguments():
    tokens, counts, scales, weight = workload(20, seed=5)
    out = [torch.empty_like(t) for t in OPS.moe_re_routing(tokens, counts, scales, weight)]
    names = ("permute_tokens", "permute_per_token_scales", "permute_token_idx",
             "expert_token_num", "permute_topk_weight")
    return dict(tokens=tokens, expert_token_num_per_rank=counts, per_token_scales=scales,
                expert_topk_weight=weight, **dict(zip(names, out)))


# out= tensors the kernel refuses before reading any data: (label, output, a
# replacement made from the good one, the message's start).
BAD_OUT = [
    ("tokens dtype", "permute_tokens", lambda t: t.float(), "permute_tokens: must be float16"),
    ("tokens rows", "permute_tokens", lambda t: torch.empty(21, 8, dtype=t.dtype),
     "permute_tokens: must be float16[20, 8], got float16[21, 8]"),
    ("tokens hidden", "permute_tokens", lambda t: torch.empty(20, 9, dtype=t.dtype),
     "permute_tokens: must be"),
    ("tokens not contiguous", "permute_tokens",
     lambda t: torch.empty(8, 20, dtype=t.dtype).t(), "permute_tokens: must be contiguous"),
    ("scales rows", "permute_per_token_scales", lambda t: torch.empty(19),
     "permute_per_token_scales: must be"),
    ("index int64", "permute_token_idx", lambda t: t.long(),
     "permute_token_idx: must be int32[20], got int64[20]"),
    ("expert_token_num length", "expert_token_num",
     lambda t: torch.empty(t.shape[0] + 1, dtype=t.dtype), "expert_token_num: must be"),
    ("weight [A]", "permute_topk_weight", lambda t: torch.empty(20),
     "permute_topk_weight: must be float32[20, 1], got float32[20]"),
    ("weight on another device", "permute_topk_weight",
     lambda t: torch.empty_like(t, device="meta"), "permute_topk_weight: must be in CPU memory"),
]


@pytest.mark.parametrize(("label", "name", "replace", "message"), BAD_OUT,
                         ids=[b[0] for b in BAD_OUT])
def test_fake_and_compile_refuse_bad_out_tensors_as_eager(label, name, replace, message):
    arguments = out_arguments()
    arguments[name] = replace(arguments[name])
    eager, faked = refusals(OPS.moe_re_routing_out, arguments)
    assert type(eager) is ValueError and str(eager).startswith(message)
    assert (type(faked), str(faked)) == (type(eager), str(eager))

    if label.endswith("device"):
        return  # a meta output sends eager to the fake kernel too; no input for compile
    torch._dynamo.reset()
    compiled = torch.compile(lambda **a: OPS.moe_re_routing_out(**a), fullgraph=True)
    with pytest.raises(Exception) as caught:
        compiled(**arguments)
    assert f"ValueError({str(eager)!r})" in str(caught.value)


@pytest.mark.parametrize(("op", "name"), [
    ("moe_re_routing", "tokens"), ("moe_re_routing", "expert_token_num_per_rank"),
    ("moe_re_routing_inverse", "tokens"), ("moe_re_routing_inverse", "expert_token_num_per_rank"),
    ("moe_re_routing_out", "tokens"), ("moe_re_routing_out", "permute_tokens"),
    ("moe_re_routing_out", "permute_token_idx")])
def test_none_for_a_required_tensor_is_named_in_eager_and_fake(op, name):
    """torch passes None for a Tensor argument as an undefined tensor."""
    arguments = out_arguments()
    if op != "moe_re_routing_out":
        arguments = {k: arguments[k] for k in INVERSE_ARGUMENTS[:4]}
    arguments[name] = None
    eager, faked = refusals(getattr(OPS, op), arguments)
    assert (type(eager), str(eager)) == (TypeError, f"{name}: must be given, got None")
    assert (type(faked), str(faked)) == (type(eager), str(eager))


@pytest.mark.parametrize("op", ["moe_re_routing", "moe_re_routing_inverse"])
@pytest.mark.parametrize("name", ["expert_token_num_per_rank", "per_token_scales",
                                  "expert_topk_weight"])
def test_fake_refuses_an_input_on_another_device_as_eager(op, name):
    """A meta tensor sends even the eager call to the fake kernel (the Meta
    key outranks CPU), which refused nothing here before and returned outputs
    on two devices. The C++ kernel's refusal (on a GPU, tests/python/test_cuda.py)
    is worded by the same adapter function, fail_device; the message is checked
    as the contract states it."""
    tokens, counts, scales, weight = workload(20, seed=6)
    arguments = dict(tokens=tokens, expert_token_num_per_rank=counts, per_token_scales=scales,
                     expert_topk_weight=weight)
    arguments[name] = arguments[name].to("meta")
    eager, faked = refusals(getattr(OPS, op), arguments)
    assert (type(eager), str(eager)) == (ValueError, f"{name}: must be in CPU memory like tokens")
    assert (type(faked), str(faked)) == (type(eager), str(eager))


def routed(tokens, counts, scales, weight):
    outputs = moe_reroute.moe_re_routing(tokens, counts, per_token_scales=scales,
                                         expert_topk_weight=weight, idx_type=1)
    restored = moe_reroute.moe_re_routing_inverse(outputs[0], counts,
                                                  expert_topk_weight=outputs[4])
    return outputs, restored


def check_routed(result, tokens, counts, scales, weight):
    outputs, restored = result
    check_forward(outputs, tokens, counts, scales, weight, idx_type=1)
    check_inverse(restored, outputs[0], counts, None, outputs[4])


def test_compile_fullgraph_dynamic_matches_the_reference():
    torch._dynamo.reset()
    compiled = torch.compile(routed, fullgraph=True, dynamic=True)
    for num_tokens in (17, 64, 200):
        inputs = workload(num_tokens, seed=num_tokens, num_ranks_experts=(2, 3 + num_tokens % 5))
        check_routed(compiled(*inputs), *inputs)


class Routed(torch.nn.Module):
    def forward(self, tokens, counts, scales, weight):
        return routed(tokens, counts, scales, weight)


def exported(num_ranks_experts=(4, 3)):
    inputs = workload(48, seed=4, num_ranks_experts=num_ranks_experts)
    tokens_rows = torch.export.Dim("A", min=2)
    return torch.export.export(
        Routed(), inputs,
        dynamic_shapes=({0: tokens_rows}, None, {0: tokens_rows}, {0: tokens_rows}))


def test_export_save_load_matches_the_reference():
    program = exported()
    calls = [n.target for n in program.graph.nodes
             if n.op == "call_function" and n.target is not operator.getitem]
    assert calls == [OPS.moe_re_routing.default, OPS.moe_re_routing_inverse.default]
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer).module()
    for num_tokens in (48, 100):
        inputs = workload(num_tokens, seed=num_tokens, num_ranks_experts=(4, 3))
        check_routed(loaded(*inputs), *inputs)


def test_aoti_package_runs_forward_and_inverse(tmp_path):
    path = torch._inductor.aoti_compile_and_package(exported(),
                                                    package_path=str(tmp_path / "routed.pt2"))
    runner = torch._inductor.aoti_load_package(path)
    for num_tokens in (48, 77):
        inputs = workload(num_tokens, seed=num_tokens + 1, num_ranks_experts=(4, 3))
        check_routed(runner(*inputs), *inputs)


def test_compiled_training_step_gradients_are_the_reference_inverse():
    """AOTAutograd traces the backward through the graph nodes: a compiled
    step (fullgraph) whose loss weighs each data output gives the gradients
    the reference inverse gives the weights."""
    torch._dynamo.reset()
    tokens, counts, scales, weight = workload(50, seed=19, tokens_dtype=torch.float32,
                                              requires_grad=True)
    outputs = data_outputs(OPS.moe_re_routing(tokens, counts, scales, weight))
    weights = [torch.randn(o.shape) for o in outputs]
    step = torch.compile(lambda t, s, w: sum(
        (o * g).sum() for o, g in zip(data_outputs(OPS.moe_re_routing(t, counts, s, w)), weights)),
        fullgraph=True)
    step(tokens, scales, weight).backward()
    expected = reference.inverse(rows(weights[0]), counts.numpy(), *map(rows, weights[1:]))
    for tensor, want in zip((tokens, scales, weight), expected):
        np.testing.assert_array_equal(rows(tensor.grad), want)


def test_decode_step_compiles_once_over_count_patterns():
    torch._dynamo.reset()
    num_tokens, num_ranks, num_experts = 64, 2, 4
    step = torch.compile(
        lambda tokens, counts: moe_reroute.moe_re_routing(
            tokens, counts, expert_alignment=16, allow_spare_rows=True, idx_type=0),
        fullgraph=True, dynamic=False)
    tokens = torch.randn(num_tokens, 8)
    rng = np.random.default_rng(5)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for valid in (64, 40, 0, 64, 13):
            counts = reference.random_counts(rng, valid)
            cells = np.zeros((num_ranks, num_experts), np.int32)
            cells.flat[:counts.size] = counts.flat[:num_ranks * num_experts]
            cells[0, 0] += valid - cells.sum()
            counts = torch.from_numpy(cells)
            outputs = step(tokens, counts)
            check_forward(outputs, tokens, counts, None, None, expert_alignment=16,
                          allow_spare_rows=True)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("case", ["out aliases tokens", "two outputs share memory"])
def test_compile_refuses_aliased_out_as_eager(backend, case):
    """A functionalized graph hands the kernel copies of its out= tensors, so
    the fake kernel refuses overlap as the kernel does, with its message, and
    nothing is written."""
    arguments = out_arguments()
    if case == "out aliases tokens":
        arguments["permute_tokens"] = arguments["tokens"]
        message = "permute_tokens: overlaps input tokens"
    else:
        shared = torch.full((20,), 0.5)
        arguments["permute_per_token_scales"] = shared
        arguments["permute_topk_weight"] = shared.view(20, 1)
        message = "permute_topk_weight: overlaps output permute_per_token_scales"
    before = {k: v.clone() for k, v in arguments.items() if isinstance(v, torch.Tensor)}
    eager, faked = refusals(OPS.moe_re_routing_out, arguments)
    assert (type(eager), str(eager)) == (ValueError, message)
    assert (type(faked), str(faked)) == (ValueError, message)

    torch._dynamo.reset()
    compiled = torch.compile(lambda **a: OPS.moe_re_routing_out(**a), fullgraph=True,
                             backend=backend)
    with pytest.raises(Exception) as caught:
        compiled(**arguments)
    assert f"ValueError({message!r})" in str(caught.value)
    for name, tensor in before.items():
        assert np.array_equal(byte_rows(arguments[name]), byte_rows(tensor)), name


def test_out_writes_the_given_tensors():
    tokens, counts, scales, weight = workload(60, seed=5)
    out = [torch.full(t.shape, reference.POISON, dtype=torch.uint8).view(t.dtype)
           if t.element_size() == 1 else torch.empty_like(t).fill_(0.5)
           for t in OPS.moe_re_routing(tokens, counts, scales, weight)]
    pointers = [t.data_ptr() for t in out]
    result = moe_reroute.moe_re_routing(tokens, counts, per_token_scales=scales,
                                        expert_topk_weight=weight, out=out)
    assert all(r is o for r, o in zip(result, out))
    assert [t.data_ptr() for t in result] == pointers
    check_forward(result, tokens, counts, scales, weight)


@pytest.mark.parametrize("name", ["tokens", "per_token_scales", "expert_topk_weight",
                                  "permute_tokens", "permute_per_token_scales",
                                  "permute_topk_weight"])
def test_out_refuses_an_argument_that_requires_grad_as_torch_out_functions_do(name):
    """out= records no graph: with grad mode on, an argument that requires grad
    is refused (RuntimeError naming it, nothing written) in eager and fake
    calls; under no_grad the call writes the result."""
    arguments = out_arguments()
    inputs = [arguments[k] for k in ("tokens", "expert_token_num_per_rank", "per_token_scales",
                                     "expert_topk_weight")]
    names = list(arguments)[4:]
    arguments |= zip(names, poisoned_outputs("torch", *inputs))
    arguments[name].requires_grad_()
    eager, faked = refusals(OPS.moe_re_routing_out, arguments)
    assert type(eager) is RuntimeError
    assert str(eager).startswith(f"{name}: requires grad, but moe_re_routing_out (out=) has no "
                                 "autograd")
    assert (type(faked), str(faked)) == (type(eager), str(eager))
    assert all((byte_rows(arguments[output]) == reference.POISON).all() for output in names)

    with torch.no_grad():
        OPS.moe_re_routing_out(**arguments)
    check_forward([arguments[output] for output in names], *inputs)


@pytest.mark.parametrize("name", ["tokens", "permute_tokens"])
def test_out_refuses_a_forward_mode_tangent_before_writing(name):
    """As torch's own out= functions (NotImplementedError): a dual input or
    output would lose its tangent."""
    arguments = out_arguments()
    inputs = [arguments[k] for k in INVERSE_ARGUMENTS[:4]]
    names = list(arguments)[4:]
    arguments |= zip(names, poisoned_outputs("torch", *inputs))
    with fwAD.dual_level():
        arguments[name] = fwAD.make_dual(arguments[name], torch.zeros_like(arguments[name]))
        with pytest.raises(NotImplementedError, match=f"^{name}: has a forward-mode tangent, but "
                                                      "moe_re_routing_out"):
            OPS.moe_re_routing_out(**arguments)
    assert all((byte_rows(arguments[output]) == reference.POISON).all() for output in names)


def test_out_refuses_inference_outputs_outside_inference_mode_before_writing():
    """torch refuses in-place writes to inference tensors outside inference
    mode (its own out= functions after writing); this op names the output and
    writes nothing, and writes it under inference_mode."""
    arguments = out_arguments()
    inputs = [arguments[k] for k in INVERSE_ARGUMENTS[:4]]
    with torch.inference_mode():
        outputs = [t.clone() for t in poisoned_outputs("torch", *inputs)]
    arguments |= zip(list(arguments)[4:], outputs)
    with pytest.raises(RuntimeError, match="^permute_tokens: is an inference tensor, which out= "
                                           r"writes only under torch.inference_mode\(\)"):
        OPS.moe_re_routing_out(**arguments)
    assert all((byte_rows(t) == reference.POISON).all() for t in outputs)
    with torch.inference_mode():
        OPS.moe_re_routing_out(**arguments)
    check_forward(outputs, *inputs)


def test_out_is_declared_mutated_in_the_schema():
    schema = OPS.moe_re_routing_out.default._schema
    mutated = [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write]
    assert mutated == ["permute_tokens", "permute_per_token_scales", "permute_token_idx",
                       "expert_token_num", "permute_topk_weight"]


def test_schemas_end_with_the_static_shape_attributes():
    for op in (OPS.moe_re_routing, OPS.moe_re_routing_out, OPS.moe_re_routing_inverse):
        arguments = op.default._schema.arguments
        assert [(a.name, a.default_value) for a in arguments[-2:]] == [
            ("expert_alignment", 1), ("allow_spare_rows", False)]


def test_out_bumps_the_version_of_each_output():
    tokens, counts, scales, weight = workload(20, seed=8)
    out = [torch.empty_like(t) for t in OPS.moe_re_routing(tokens, counts, scales, weight)]
    versions = [t._version for t in out]
    moe_reroute.moe_re_routing(tokens, counts, per_token_scales=scales, expert_topk_weight=weight,
                               out=out)
    assert all(t._version > v for t, v in zip(out, versions))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("weight_shape", ["[A,1]", "[A]"])
def test_backward_is_the_reference_inverse_of_the_gradients(dtype, weight_shape):
    tokens, counts, scales, weight = workload(70, seed=6, tokens_dtype=dtype, requires_grad=True)
    if weight_shape == "[A]":
        weight = weight.detach().reshape(-1).requires_grad_()
    outputs = moe_reroute.moe_re_routing(tokens, counts, per_token_scales=scales,
                                         expert_topk_weight=weight)
    assert not outputs[2].requires_grad and not outputs[3].requires_grad
    grads = [torch.randn(t.shape).to(t.dtype) for t in (outputs[0], outputs[1], outputs[4])]
    torch.autograd.backward([outputs[0], outputs[1], outputs[4]], grads)
    expected = reference.inverse(*(rows(g) for g in grads[:1]), counts.numpy(),
                                 rows(grads[1]), rows(grads[2]))
    for tensor, want in zip((tokens, scales, weight), expected):
        assert tensor.grad.dtype == tensor.dtype and tensor.grad.shape == tensor.shape
        np.testing.assert_array_equal(rows(tensor.grad), want)


@pytest.mark.parametrize("k", [1, 3])
def test_inverse_backward_with_spare_rows_gives_unread_rows_zero(k):
    """The inverse's tail input rows, past the padded segments, are never read,
    so their gradient is zero, not the forward's unwritten rows: under
    deterministic algorithms torch fills fresh memory with NaN."""
    counts = torch.tensor([[1, 0], [1, 1]], dtype=torch.int32)
    num_rows = 6 + 2 * (k - 1)
    inputs = [torch.randn(num_rows, *trail, requires_grad=True) for trail in ((2,), (), (1,))]
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        restored = moe_reroute.moe_re_routing_inverse(
            inputs[0], counts, per_token_scales=inputs[1], expert_topk_weight=inputs[2],
            expert_alignment=k, allow_spare_rows=True)
        sum(r[:3].sum() for r in restored).backward()
    finally:
        torch.use_deterministic_algorithms(deterministic)
    read = reference.valid_rows(counts.numpy(), k)
    for tensor in inputs:
        assert torch.isfinite(tensor.grad).all()
        assert (tensor.grad[read:] == 0).all()


def test_inverse_backward_is_the_reference_forward_of_the_gradients():
    tokens, counts, scales, weight = workload(30, seed=7, tokens_dtype=torch.float32,
                                              requires_grad=True)
    restored = moe_reroute.moe_re_routing_inverse(tokens, counts, per_token_scales=scales,
                                                  expert_topk_weight=weight)
    grads = [torch.randn(t.shape) for t in restored]
    torch.autograd.backward(list(restored), grads)
    expected = reference.reroute(rows(grads[0]), counts.numpy(), rows(grads[1]), rows(grads[2]))
    for tensor, want in zip((tokens, scales, weight), (expected[0], expected[1], expected[4])):
        np.testing.assert_array_equal(rows(tensor.grad), want)


@pytest.mark.parametrize("with_grad", [False, True], ids=["forward AD", "and backward"])
def test_forward_ad_tangents_are_the_reference_forward_of_the_tangents(with_grad):
    """Dual tensors: each data output's tangent is the reference forward of the
    inputs' tangents; an input without one (scales here) leaves its output
    without one. With inputs that require grad, backward mode records too."""
    tokens, counts, scales, weight = workload(50, seed=11, tokens_dtype=torch.float32,
                                              requires_grad=with_grad)
    tangents = [torch.randn(t.shape) for t in (tokens, weight)]
    with fwAD.dual_level():
        outputs = moe_reroute.moe_re_routing(
            fwAD.make_dual(tokens, tangents[0]), counts, per_token_scales=scales,
            expert_topk_weight=fwAD.make_dual(weight, tangents[1]))
        primals, outputs_tangents = zip(*(fwAD.unpack_dual(o) for o in outputs))
    expected = reference.reroute(rows(tangents[0]), counts.numpy(), None, rows(tangents[1]))
    np.testing.assert_array_equal(rows(outputs_tangents[0]), expected[0])
    np.testing.assert_array_equal(rows(outputs_tangents[4]), expected[4])
    assert outputs_tangents[1:4] == (None, None, None)
    check_forward(primals, tokens, counts, scales, weight)
    assert (primals[0].grad_fn is not None) == with_grad


def test_inverse_jvp_is_the_reference_inverse_of_the_tangents():
    tokens, counts, scales, weight = workload(40, seed=12, tokens_dtype=torch.bfloat16)
    tangents = tuple(torch.randn(t.shape).to(t.dtype) for t in (tokens, scales, weight))
    _, outputs_tangents = torch.func.jvp(
        lambda t, s, w: moe_reroute.moe_re_routing_inverse(t, counts, per_token_scales=s,
                                                           expert_topk_weight=w),
        (tokens, scales, weight), tangents)
    expected = reference.inverse(rows(tangents[0]), counts.numpy(),
                                 rows(tangents[1]), rows(tangents[2]))
    for got, want in zip(outputs_tangents, expected):
        np.testing.assert_array_equal(rows(got), want)


def data_outputs(outputs):
    """The outputs with gradients: the forward's tokens, scales and weights
    (not its indices and counts); all three of the inverse's."""
    return (outputs[0], outputs[1], outputs[4]) if len(outputs) == 5 else tuple(outputs)


@pytest.mark.parametrize("k, spare", [(1, False), (1, True), (4, True)],
                         ids=["dense", "spare rows", "k = 4, spare rows"])
def test_func_vjp_is_the_reference_reorder_of_the_cotangents(k, spare):
    """torch.func's backward transforms take the ops' graph nodes: the vjp of
    the forward is the reference inverse of the cotangents (the spare input
    rows, never read, get zero), the vjp of the inverse the reference forward
    (its tail input rows, never read, get zero)."""
    tokens, counts, scales, weight = workload(40, seed=14, tokens_dtype=torch.float32)
    if spare:  # 6 rows past the counts' sum
        tokens, scales, weight = (torch.cat([t, t[:6]]) for t in (tokens, scales, weight))
    attributes = dict(expert_alignment=k, allow_spare_rows=spare)
    for op, expected_of in (
            (moe_reroute.moe_re_routing, lambda c: reference.inverse(
                *c[:1], counts.numpy(), *c[1:], expert_alignment=k)),
            (moe_reroute.moe_re_routing_inverse, lambda c: operator.itemgetter(0, 1, 4)(
                reference.reroute(c[0], counts.numpy(), *c[1:], expert_alignment=k)))):
        inputs = (tokens, scales, weight)
        outputs, vjp = torch.func.vjp(
            lambda t, s, w: data_outputs(op(t, counts, per_token_scales=s, expert_topk_weight=w,
                                            **attributes)), *inputs)
        cotangents = tuple(torch.randn(o.shape) for o in outputs)
        expected = expected_of([rows(c) for c in cotangents])
        read = (int(counts.sum()) if op is moe_reroute.moe_re_routing
                else reference.valid_rows(counts.numpy(), k))
        for got, want, given in zip(vjp(cotangents), expected, inputs):
            want[read:] = 0
            assert got.shape == given.shape
            np.testing.assert_array_equal(rows(got), want)
        tokens = outputs[0].detach()  # the inverse's turn: its input is the forward's output
        scales, weight = (torch.randn(o.shape) for o in outputs[1:])


def test_func_jacrev_grad_and_per_sample_grad_follow_the_reference_permutation():
    """jacrev of permute_tokens is the permutation the reference makes of the
    identity; grad of a weighted sum is the reference inverse of the weights;
    vmap(grad) gives each batch entry its own gradient."""
    tokens, counts, _, _ = workload(12, seed=15, tokens_dtype=torch.float32, hidden=3)
    # Row r of the reference forward of the identity is the one-hot of its source row.
    permutation = torch.from_numpy(
        reference.reroute(byte_rows(np.eye(12, dtype=np.float32)), counts.numpy())[0].copy()
    ).view(torch.float32)
    jacobian = torch.func.jacrev(lambda t: OPS.moe_re_routing(t, counts)[0])(tokens)
    torch.testing.assert_close(jacobian, torch.einsum("ra,hk->rhak", permutation, torch.eye(3)),
                               rtol=0, atol=0)

    weights = torch.randn(12, 3)
    gradient = torch.func.grad(lambda t: (OPS.moe_re_routing(t, counts)[0] * weights).sum())(tokens)
    np.testing.assert_array_equal(rows(gradient), reference.inverse(rows(weights), counts.numpy())[0])

    batch = torch.stack([tokens, -2 * tokens, tokens + 1])
    per_sample = torch.vmap(torch.func.grad(
        lambda t: OPS.moe_re_routing(t, counts)[0].pow(2).sum()))(batch)
    torch.testing.assert_close(per_sample, 2 * batch, rtol=0, atol=0)


# ---- torch.vmap ----

# (token dtype, bytes per entry row of tokens, scales entry shape after A, scales dtype)
VMAP_DTYPES = [
    (torch.float32, 24, (), torch.float32),
    (torch.bfloat16, 16, (3,), torch.float32),
    (torch.int8, 8, (), torch.float32),
    (torch.float8_e4m3fn, 8, (2, 2), torch.float8_e8m0fnu),
    (torch.float4_e2m1fn_x2, 4, (3,), torch.uint8),  # uint8 scales read as float8_e8m0
]


def random_of(rng, dtype, shape):
    """Random bytes of `dtype` (finite for float32 and bfloat16)."""
    if dtype in (torch.float32, torch.bfloat16):
        return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)).to(dtype)
    size = torch.empty(0, dtype=dtype).element_size()
    data = rng.integers(0, 256, (*shape[:-1], shape[-1] * size) if shape else (size,), np.uint8)
    return torch.from_numpy(data).view(dtype).reshape(shape)


def batched(rng, entries, batch_size):
    """`entries` ([B, ...]) batched at a random dim, or None for an entry shared
    by the batch (entry 0 then stands for every entry); the tensor and its dim."""
    dim = rng.choice([None, 0, 1, -1])
    if dim is None:
        return entries[0], None
    return entries.movedim(0, int(dim)), int(dim)


def entry_of(tensor, dim, b):
    return tensor if tensor is None or dim is None else tensor.select(dim, b)


def vmap_inputs(seed, inverse=False):
    rng = np.random.default_rng(seed)
    dtype, row_bytes, scale_rest, scale_dtype = VMAP_DTYPES[seed % len(VMAP_DTYPES)]
    batch_size = int(rng.integers(1, 4))
    alignment = int(rng.choice([1, 3]))
    spare = not inverse and bool(rng.integers(0, 2))
    counts = torch.from_numpy(reference.random_counts(rng))
    valid = int(counts.sum())
    num_rows = valid + (int(rng.integers(1, 4)) if spare else 0)
    if inverse:
        num_rows = reference.rows_out(valid, counts.shape[1], alignment)
    width = row_bytes // torch.empty(0, dtype=dtype).element_size()
    while True:  # at least one input batched
        drawn = [batched(rng, random_of(rng, d, (batch_size, num_rows, *rest)), batch_size)
                 for d, rest in ((dtype, (width,)), (scale_dtype, scale_rest),
                                 (torch.float32, (1,) if rng.integers(0, 2) else ()))]
        if any(dim is not None for _, dim in drawn):
            break
    attributes = dict(expert_alignment=alignment, allow_spare_rows=spare)
    if not inverse:
        attributes |= dict(idx_type=int(rng.integers(0, 2)),
                           expert_token_num_type=int(rng.integers(0, 2)))
    return batch_size, counts, drawn, attributes


@pytest.mark.parametrize("seed", range(20))
def test_vmap_moves_every_entry_as_the_reference_by_one_layout(seed):
    """Counts shared by the batch: vmap over any of tokens, scales and weights,
    at any dim, gives each entry what the reference gives it, byte for byte,
    from one call of the operator (two for a scatter index), whatever the
    batch size, without torch's batching fallback."""
    batch_size, counts, drawn, attributes = vmap_inputs(seed)
    (tokens, tokens_dim), (scales, scales_dim), (weight, weight_dim) = drawn
    with DispatchSeen() as mode, warnings.catch_warnings():
        warnings.simplefilter("error")  # the fallback warns of its speed
        got = torch.vmap(lambda t, s, w: moe_reroute.moe_re_routing(
            t, counts, per_token_scales=s, expert_topk_weight=w, **attributes),
            in_dims=(tokens_dim, scales_dim, weight_dim))(tokens, scales, weight)
    calls = [f for f in mode.functions if f is OPS.moe_re_routing.default]
    assert len(calls) == 1 + (attributes["idx_type"] == 1)
    for b in range(batch_size):
        check_forward([output[b] for output in got], entry_of(tokens, tokens_dim, b), counts,
                      entry_of(scales, scales_dim, b), entry_of(weight, weight_dim, b),
                      **attributes)


@pytest.mark.parametrize("seed", range(20))
def test_vmap_of_the_inverse_restores_every_entry_as_the_reference(seed):
    batch_size, counts, drawn, attributes = vmap_inputs(seed, inverse=True)
    (tokens, tokens_dim), (scales, scales_dim), (weight, weight_dim) = drawn
    with DispatchSeen() as mode, warnings.catch_warnings():
        warnings.simplefilter("error")
        got = torch.vmap(lambda t, s, w: moe_reroute.moe_re_routing_inverse(
            t, counts, per_token_scales=s, expert_topk_weight=w, **attributes),
            in_dims=(tokens_dim, scales_dim, weight_dim))(tokens, scales, weight)
    # The inverse on the shared inputs, the forward for the index.
    assert [f for f in mode.functions if f in (OPS.moe_re_routing.default,
                                                OPS.moe_re_routing_inverse.default)] == [
        OPS.moe_re_routing_inverse.default, OPS.moe_re_routing.default]
    for b in range(batch_size):
        entry = [entry_of(t, d, b) for t, d in drawn]
        expected = reference.inverse(*(rows(t) for t in entry[:1]), counts.numpy(),
                                     *(rows(t) for t in entry[1:]),
                                     expert_alignment=attributes["expert_alignment"])
        for output, given, want in zip(got, entry, expected):
            assert output[b].dtype == given.dtype and output[b].shape[1:] == given.shape[1:]
            np.testing.assert_array_equal(rows(output[b]), want)


def test_vmap_over_counts_runs_each_entry_with_its_own_layout():
    tokens, counts, scales, weight = workload(30, seed=13, tokens_dtype=torch.float32)
    batch_counts = torch.stack([counts, counts.flip(0), counts.flip(1)])
    batch_tokens = torch.stack([tokens, -tokens, 2 * tokens])
    got = torch.vmap(lambda t, c: moe_reroute.moe_re_routing(
        t, c, per_token_scales=scales, expert_topk_weight=weight))(batch_tokens, batch_counts)
    for b in range(3):
        check_forward([output[b] for output in got], batch_tokens[b], batch_counts[b], scales,
                      weight)


def test_vmap_of_an_empty_batch_gives_empty_outputs_of_each_entry_spec():
    tokens, counts, scales, _ = workload(30, seed=17, tokens_dtype=torch.bfloat16)
    expected = moe_reroute.moe_re_routing(tokens, counts, per_token_scales=scales,
                                          expert_alignment=4)
    got = torch.vmap(lambda t: moe_reroute.moe_re_routing(
        t, counts, per_token_scales=scales, expert_alignment=4))(tokens[None][:0])
    assert [(o.dtype, tuple(o.shape)) for o in got] == [
        (e.dtype, (0, *e.shape)) for e in expected]


def test_vmap_refuses_a_bad_entry_as_a_call_of_that_entry():
    tokens, counts, scales, _ = workload(30, seed=18, tokens_dtype=torch.float32)
    batch = torch.stack([tokens, tokens])
    with pytest.raises(ValueError) as eager:
        moe_reroute.moe_re_routing(tokens, counts, per_token_scales=scales[:29])
    with pytest.raises(ValueError) as mapped:
        torch.vmap(lambda t: moe_reroute.moe_re_routing(t, counts,
                                                        per_token_scales=scales[:29]))(batch)
    assert str(mapped.value) == str(eager.value)


def test_backward_refuses_counts_changed_in_place_and_a_second_pass():
    """The node saves the counts as torch saves a tensor: modified in place
    after the call, or freed by a first backward, they are refused."""
    tokens, counts, _, _ = workload(20, seed=16, tokens_dtype=torch.float32, requires_grad=True)
    permuted = moe_reroute.moe_re_routing(tokens, counts)[0]
    counts.add_(0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        permuted.sum().backward()
    restored = moe_reroute.moe_re_routing_inverse(tokens, counts)[0]
    restored.sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        restored.sum().backward()


@pytest.mark.parametrize("saving", ["checkpoint", "save_on_cpu"])
def test_saved_tensor_hooks_keep_the_reference_gradient(saving):
    """The node saves the counts as torch saves a tensor, so activation
    checkpointing (recomputed at backward) and save_on_cpu (packed and
    unpacked) give the reference inverse of the incoming gradient."""
    tokens, counts, _, _ = workload(40, seed=18, tokens_dtype=torch.float32, requires_grad=True)
    weights = torch.randn(tokens.shape)
    step = lambda t: (OPS.moe_re_routing(t, counts)[0] * weights).sum()
    if saving == "checkpoint":
        loss = torch.utils.checkpoint.checkpoint(step, tokens, use_reentrant=False)
    else:
        with torch.autograd.graph.save_on_cpu():
            loss = step(tokens)
    loss.backward()
    np.testing.assert_array_equal(rows(tokens.grad),
                                  reference.inverse(rows(weights), counts.numpy())[0])


def test_weight_gradient_with_integer_tokens():
    """Integer tokens take no gradient, and their output none; the weights'
    gradient is still the reference inverse of theirs, and the scales', whose
    output the loss does not use, zero."""
    _, counts, scales, weight = workload(30, seed=17, requires_grad=True)
    tokens = torch.randint(-128, 128, (30, 8), dtype=torch.int8)
    outputs = moe_reroute.moe_re_routing(tokens, counts, per_token_scales=scales,
                                         expert_topk_weight=weight)
    assert not outputs[0].requires_grad and outputs[4].grad_fn.name() == "MoeReRoutingBackward"
    grad = torch.randn(outputs[4].shape)
    outputs[4].backward(grad)
    np.testing.assert_array_equal(
        rows(weight.grad), reference.inverse(rows(tokens), counts.numpy(), None, rows(grad))[2])
    assert scales.grad.shape == scales.shape and not scales.grad.any()


def python_functions_called(call) -> list[str]:
    called = []

    def profile(frame, event, arg):
        if event == "call":
            called.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return called


@pytest.mark.parametrize("mode", ["no input requires grad", "no_grad", "inference_mode"])
def test_eager_call_without_gradients_runs_no_python_kernel(mode):
    tokens, counts, scales, weight = workload(20, seed=9, tokens_dtype=torch.float32,
                                              requires_grad=mode != "no input requires grad")
    op = OPS.moe_re_routing.default
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(
        mode, torch.enable_grad)
    with context():
        called = python_functions_called(functools.partial(op, tokens, counts, scales, weight))
    # Only torch's OpOverload.__call__, the Python entry of every torch op.
    assert [c.rsplit("/", 2)[-2:] for c in called] == [["torch", "_ops.py:__call__"]]


@pytest.mark.parametrize("mode", ["no input requires grad", "no_grad", "inference_mode",
                                  "records the graph"])
def test_public_eager_call_skips_torch_ops_python(mode):
    """The public functions call the operators through their C++ entry
    points: no Python of torch.ops (or any other of torch's) runs, only the
    package's own two frames and Dynamo's is-tracing flag."""
    tokens, counts, scales, weight = workload(20, seed=9, tokens_dtype=torch.float32,
                                              requires_grad=mode != "no input requires grad")
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(
        mode, torch.enable_grad)
    calls = {
        "forward": functools.partial(moe_reroute.moe_re_routing, tokens, counts,
                                     per_token_scales=scales, expert_topk_weight=weight),
        "inverse": functools.partial(moe_reroute.moe_re_routing_inverse, tokens, counts,
                                     per_token_scales=scales),
    }
    for name, call in calls.items():
        with context():
            called = python_functions_called(call)
        public = "moe_re_routing" if name == "forward" else "moe_re_routing_inverse"
        assert [c.rsplit("/", 2)[-2:] for c in called] == [
            ["moe_reroute", f"__init__.py:{public}"], ["moe_reroute", "_torch.py:call"],
            ["compiler", "__init__.py:is_dynamo_compiling"]], name
    with context():
        outputs = calls["forward"]()
    check_forward(outputs, tokens, counts, scales, weight)
    assert (outputs[0].grad_fn is not None) == (mode == "records the graph")


def test_entry_points_hand_back_arguments_that_are_not_plain():
    """An argument that is not plainly of the schema's type gets
    NotImplemented back from the C++ entry point, and the public function
    then calls torch.ops, which converts it (a NumPy integer) or names it."""
    from moe_reroute import _torch_ops
    tokens, counts, scales, weight = workload(20, seed=3)
    plain = (tokens, counts, scales, weight, 1, 0, None, 1, False)
    check_forward(_torch_ops.forward(*plain), tokens, counts, scales, weight)
    for index, value in [(0, None), (1, counts.numpy()), (2, scales.numpy()), (3, 1.0),
                         (4, np.int64(1)), (5, True), (6, b"int8"), (7, 2**63), (8, 1)]:
        changed = list(plain)
        changed[index] = value
        assert _torch_ops.forward(*changed) is NotImplemented, (index, value)
    assert _torch_ops.forward(*plain[:8]) is NotImplemented
    assert _torch_ops.inverse(tokens, counts, None, None, None, 1, np.bool_(False)) \
        is NotImplemented
    outputs = moe_reroute.moe_re_routing(tokens, counts, per_token_scales=scales,
                                         expert_alignment=np.int64(4))
    check_forward(outputs, tokens, counts, scales, None, expert_alignment=4)
    with pytest.raises(RuntimeError, match="Expected a value of type 'int' for argument "
                                           "'expert_alignment' but instead found type 'str'"):
        moe_reroute.moe_re_routing(tokens, counts, expert_alignment="4")


class Seen:
    """A mode that records each function it sees, then calls it."""

    def __init__(self):
        super().__init__()
        self.functions = []

    def record(self, func, types, args=(), kwargs=None):
        self.functions.append(func)
        return func(*args, **(kwargs or {}))


class FunctionsSeen(Seen, torch.overrides.TorchFunctionMode):
    __torch_function__ = Seen.record


class DispatchSeen(Seen, TorchDispatchMode):
    __torch_dispatch__ = Seen.record


class Tagged(torch.Tensor):
    """A tensor subclass with a __torch_function__ that records each function."""
    functions = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.functions.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_torch_function_modes_and_subclasses_see_the_operators():
    """Where a mode or a subclass has a __torch_function__, the public
    functions call torch.ops, which calls it first, as for torch's own ops."""
    tokens, counts, scales, weight = workload(20, seed=4)
    with FunctionsSeen() as mode:
        outputs = moe_reroute.moe_re_routing(tokens, counts, per_token_scales=scales,
                                             expert_topk_weight=weight)
        restored = moe_reroute.moe_re_routing_inverse(outputs[0], counts)
        out = poisoned_outputs("torch", tokens, counts, scales, weight)
        moe_reroute.moe_re_routing(tokens, counts, per_token_scales=scales,
                                   expert_topk_weight=weight, out=out)
    assert [f for f in mode.functions if isinstance(f, torch._ops.OpOverload)] == [
        OPS.moe_re_routing.default, OPS.moe_re_routing_inverse.default,
        OPS.moe_re_routing_out.default]
    check_forward(outputs, tokens, counts, scales, weight)
    check_forward(out, tokens, counts, scales, weight)
    check_inverse(restored, outputs[0], counts, None, None)
    Tagged.functions.clear()
    tagged = moe_reroute.moe_re_routing(tokens.as_subclass(Tagged), counts)
    assert OPS.moe_re_routing.default in Tagged.functions
    check_forward(tagged, tokens, counts, None, None)


def test_dispatch_modes_see_the_entry_point_call():
    """The C++ entry points call the dispatcher, so what hooks in below
    Python (a dispatch mode here; fake tensors, make_fx, functorch) sees the
    call as from torch.ops."""
    tokens, counts, scales, weight = workload(20, seed=5)
    with DispatchSeen() as mode:
        outputs = moe_reroute.moe_re_routing(tokens, counts, per_token_scales=scales,
                                             expert_topk_weight=weight)
    assert OPS.moe_re_routing.default in mode.functions
    check_forward(outputs, tokens, counts, scales, weight)


def test_public_call_releases_the_gil():
    """Other Python threads run while a call moves the bytes, as with torch.ops.
    With a switch interval of 0.5 s the caller's thread keeps the GIL through
    a call of some milliseconds unless the call releases it, so the main
    thread only ever sees the call in progress if it does."""
    tokens, counts, _, _ = workload(8192, seed=6, tokens_dtype=torch.float32, hidden=1024)
    state = {"inside": False, "seen": 0}

    def call():
        state["inside"] = True
        state["outputs"] = moe_reroute.moe_re_routing(tokens, counts)
        state["inside"] = False

    previous = sys.getswitchinterval()
    sys.setswitchinterval(0.5)
    try:
        worker = threading.Thread(target=call)
        worker.start()
        while worker.is_alive():
            state["seen"] += state["inside"]
        worker.join()
    finally:
        sys.setswitchinterval(previous)
    assert state["seen"] > 0
    check_forward(state["outputs"], tokens, counts, None, None)


def test_grad_call_records_the_graph_and_no_grad_call_none():
    tokens, counts, scales, weight = workload(20, seed=9, tokens_dtype=torch.float32,
                                              requires_grad=True)
    with torch.no_grad():
        plain = moe_reroute.moe_re_routing(tokens, counts, per_token_scales=scales,
                                           expert_topk_weight=weight)
    tracked = moe_reroute.moe_re_routing(tokens, counts, per_token_scales=scales,
                                         expert_topk_weight=weight)
    assert not any(t.requires_grad for t in plain)
    assert tracked[0].grad_fn.name() == "MoeReRoutingBackward"
    restored = moe_reroute.moe_re_routing_inverse(tracked[0], counts)
    assert restored[0].grad_fn.name() == "MoeReRoutingInverseBackward"
    check_forward(plain, tokens, counts, scales, weight)
    check_forward(tracked, tokens, counts, scales, weight)


# ---- the CPU output cache ----

MIB = 1 << 20
# bf16 tokens of 3001 x 1499: 9.0 MB, cached (4 MiB and more) in a block of 10 MiB.
CACHED_TOKENS, CACHED_HIDDEN, CACHED_BLOCK = 3001, 1499, 10 * MIB


@pytest.fixture
def output_cache():
    """The cache emptied, at its default limit, before and after the test
    (after a collection, so that no earlier test's output comes back during it)."""
    gc.collect()
    default = moe_reroute.set_cpu_output_cache_limit(0)
    moe_reroute.set_cpu_output_cache_limit(default)
    yield default
    moe_reroute.set_cpu_output_cache_limit(0)
    moe_reroute.set_cpu_output_cache_limit(default)


def cached_workload(seed):
    return workload(CACHED_TOKENS, seed=seed, tokens_dtype=torch.bfloat16, hidden=CACHED_HIDDEN)


def poison_and_free(outputs):
    """Every byte of `outputs` POISON, then the outputs freed; their data pointers."""
    pointers = [output.data_ptr() for output in outputs]
    for output in outputs:
        output.view(torch.uint8).fill_(reference.POISON)
    outputs.clear()
    return pointers


def test_a_freed_large_output_is_reused_and_rewritten_in_full(output_cache):
    assert output_cache == 1 << 30  # the documented default
    tokens, counts, scales, weight = cached_workload(seed=31)
    kwargs = dict(per_token_scales=scales, expert_topk_weight=weight)
    first = list(moe_reroute.moe_re_routing(tokens, counts, **kwargs))
    assert first[0].data_ptr() % (2 * MIB) == 0  # whole huge pages
    pointers = poison_and_free(first)
    # Only the tokens output is large; the four small ones go back to torch.
    assert moe_reroute.cpu_output_cache_bytes() == CACHED_BLOCK
    second = moe_reroute.moe_re_routing(tokens, counts, **kwargs)
    assert second[0].data_ptr() == pointers[0]
    assert moe_reroute.cpu_output_cache_bytes() == 0
    check_forward(second, tokens, counts, scales, weight)

    # The inverse takes the same block back, poisoned, and rewrites it.
    permuted = dict(per_token_scales=second[1], expert_topk_weight=second[4])
    restored_pointers = poison_and_free(list(moe_reroute.moe_re_routing_inverse(
        second[0], counts, **permuted)))
    restored = moe_reroute.moe_re_routing_inverse(second[0], counts, **permuted)
    assert restored[0].data_ptr() == restored_pointers[0]
    check_inverse(restored, second[0], counts, second[1], second[4])


def test_the_limit_bounds_what_the_cache_keeps(output_cache):
    tokens, counts, _, _ = cached_workload(seed=32)
    assert moe_reroute.set_cpu_output_cache_limit(CACHED_BLOCK) == output_cache
    # Two outputs freed under room for one: the second is unmapped.
    outputs = [moe_reroute.moe_re_routing(tokens, counts)[0] for _ in range(2)]
    outputs.clear()
    assert moe_reroute.cpu_output_cache_bytes() == CACHED_BLOCK
    # A lower limit unmaps what is above it at once; 0 keeps nothing.
    assert moe_reroute.set_cpu_output_cache_limit(CACHED_BLOCK - 1) == CACHED_BLOCK
    assert moe_reroute.cpu_output_cache_bytes() == 0
    moe_reroute.set_cpu_output_cache_limit(0)
    del outputs
    outputs = moe_reroute.moe_re_routing(tokens, counts)
    check_forward(outputs, tokens, counts, None, None)
    del outputs
    assert moe_reroute.cpu_output_cache_bytes() == 0


def test_small_outputs_are_not_cached(output_cache):
    # 256 x 7168 bf16 (decode): 3.7 MB, under 4 MiB.
    tokens, counts, scales, weight = workload(256, seed=33, tokens_dtype=torch.bfloat16,
                                              hidden=7168)
    outputs = moe_reroute.moe_re_routing(tokens, counts, per_token_scales=scales,
                                         expert_topk_weight=weight)
    check_forward(outputs, tokens, counts, scales, weight)
    del outputs
    assert moe_reroute.cpu_output_cache_bytes() == 0


def test_a_negative_limit_is_refused_and_changes_nothing(output_cache):
    with pytest.raises(ValueError, match=re.escape(
            "limit_bytes: must be >= 0 (0 keeps none), got -1")):
        moe_reroute.set_cpu_output_cache_limit(-1)
    assert moe_reroute.set_cpu_output_cache_limit(output_cache) == output_cache


def test_a_cached_output_is_an_ordinary_tensor(output_cache):
    tokens, counts, _, _ = cached_workload(seed=34)
    permuted = moe_reroute.moe_re_routing(tokens, counts)[0]
    expected = permuted.clone()
    # Its storage grows (a new block) and keeps its bytes; it saves and loads.
    permuted.resize_(CACHED_TOKENS + 1000, CACHED_HIDDEN)
    assert torch.equal(permuted[:CACHED_TOKENS], expected)
    buffer = io.BytesIO()
    torch.save(permuted[:CACHED_TOKENS].clone(), buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer), expected)
    del permuted
    # The first block, then the grown one: 4001 x 1499 bf16, 12.0 MB in 12 MiB.
    assert moe_reroute.cpu_output_cache_bytes() == CACHED_BLOCK + 12 * MIB


def test_deterministic_fill_fills_unwritten_rows_as_torch_empty(output_cache):
    # Spare rows of the inverse are not written: torch's deterministic mode
    # fills fresh memory (NaN for floats), and so does the operator then.
    tokens = torch.randn(CACHED_TOKENS, CACHED_HIDDEN)
    counts = torch.tensor([[1000, 500]], dtype=torch.int32)
    assert torch.are_deterministic_algorithms_enabled() is False
    torch.use_deterministic_algorithms(True)
    try:
        restored = moe_reroute.moe_re_routing_inverse(tokens, counts, allow_spare_rows=True)[0]
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.isnan(restored[1500:]).all()
    np.testing.assert_array_equal(rows(restored[:1500]), reference.inverse(
        rows(tokens), counts.numpy(), allow_spare_rows=True)[0][:1500])


def test_threads_share_the_cache(output_cache):
    inputs = [cached_workload(seed=40 + i) for i in range(4)]
    errors = []

    def calls(tokens, counts, scales, weight):
        try:
            for _ in range(6):
                outputs = moe_reroute.moe_re_routing(tokens, counts, per_token_scales=scales,
                                                     expert_topk_weight=weight)
                check_forward(outputs, tokens, counts, scales, weight)
                outputs[0].view(torch.uint8).fill_(reference.POISON)
        except Exception as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=calls, args=args) for args in inputs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    # Each thread holds at most two outputs at a time (the last one during its next call).
    assert 0 < moe_reroute.cpu_output_cache_bytes() <= 8 * CACHED_BLOCK


def test_a_forked_child_frees_and_takes_cached_outputs(output_cache):
    tokens, counts, _, _ = cached_workload(seed=35)
    kept = moe_reroute.moe_re_routing(tokens, counts)[0]
    moe_reroute.moe_re_routing(tokens, counts)
    assert moe_reroute.cpu_output_cache_bytes() == CACHED_BLOCK
    pid = os.fork()
    if pid == 0:  # the child: one thread, as in DataLoader workers (docs/torch.md)
        status = 1
        try:
            torch.set_num_threads(1)
            del kept
            outputs = moe_reroute.moe_re_routing(tokens, counts)
            check_forward(outputs, tokens, counts, None, None)
            status = 0 if moe_reroute.cpu_output_cache_bytes() == CACHED_BLOCK else 2
        finally:
            os._exit(status)
    _, wait_status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(wait_status) == 0
    # The parent's cache and outputs are its own.
    assert moe_reroute.cpu_output_cache_bytes() == CACHED_BLOCK
    assert torch.equal(kept, moe_reroute.moe_re_routing(tokens, counts)[0])


def test_an_output_that_cannot_be_mapped_raises_out_of_memory():
    # In a child whose address space is capped just above what it maps now.
    code = """
import resource, torch, moe_reroute
tokens = torch.zeros(1 << 16, 4096, dtype=torch.int8)  # 256 MiB
counts = torch.tensor([[1 << 16]], dtype=torch.int32)
with open("/proc/self/statm") as statm:
    mapped = int(statm.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (mapped + (64 << 20), resource.RLIM_INFINITY))
try:
    moe_reroute.moe_re_routing(tokens, counts)
except torch.OutOfMemoryError as error:
    print(error)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "moe_reroute: cannot map 268435456 bytes for a CPU output\n"
