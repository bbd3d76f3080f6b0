"""CUDA tensors through the torch operators. The host side (the status check
modes, cuda_check) runs everywhere; the GPU cases (against the naive
reference, the sticky status word, sync mode, streams, graph capture and
replay, autograd, compile) skip without a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moe_reroute
import reference
from cases import (TOKEN_CASES, check_torch_forward, check_torch_inverse, make_inputs,
                   poisoned_outputs, rows, seeded)

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.fixture
def status_check():
    """Sets the status check for one test and restores the previous mode."""
    previous = []
    yield lambda mode: previous.append(moe_reroute.set_cuda_status_check(mode))
    if previous:
        moe_reroute.set_cuda_status_check(previous[0])


def test_status_check_returns_the_previous_mode(status_check):
    status_check("sync")
    assert moe_reroute.set_cuda_status_check("deferred") == "sync"
    assert moe_reroute.set_cuda_status_check("deferred") == "deferred"


def test_status_check_is_deferred_at_import():
    import subprocess
    import sys
    code = "import moe_reroute; print(moe_reroute.set_cuda_status_check('deferred'))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "deferred"


def test_status_check_refuses_other_modes():
    with pytest.raises(ValueError, match='mode: must be "deferred" or "sync"; got "raise"'):
        moe_reroute.set_cuda_status_check("raise")


def test_cuda_check_without_bad_counts_passes():
    moe_reroute.cuda_check()


def to_cuda(*tensors):
    return [None if t is None else t.cuda() for t in tensors]


TORCH_CASES = [case for case in TOKEN_CASES if case.torch_dtype is not None]


@needs_gpu
@pytest.mark.parametrize("case", TORCH_CASES, ids=lambda c: c.label)
def test_cuda_matches_the_reference(case):
    rng = seeded("cuda", case.label)
    for trial in range(4):
        counts, tokens, scales, weight = make_inputs("torch", case, rng, trial)
        counts = torch.from_numpy(counts)
        attributes = dict(expert_token_num_type=trial % 2, idx_type=(trial // 2) % 2)
        inputs = to_cuda(tokens, counts, scales, weight)
        kwargs = dict(per_token_scales=inputs[2], expert_topk_weight=inputs[3],
                      tokens_dtype=case.tokens_dtype, **attributes)
        result = moe_reroute.moe_re_routing(*inputs[:2], **kwargs)
        check_torch_forward(result, tokens, counts, scales, weight, **attributes)
        out = to_cuda(*poisoned_outputs("torch", tokens, counts, scales, weight))
        moe_reroute.moe_re_routing(*inputs[:2], **kwargs, out=out)
        check_torch_forward(out, tokens, counts, scales, weight, **attributes)
        restored = moe_reroute.moe_re_routing_inverse(
            result[0], inputs[1], per_token_scales=None if scales is None else result[1],
            expert_topk_weight=None if weight is None else result[4],
            tokens_dtype=case.tokens_dtype)
        check_torch_inverse(restored, result[0], counts,
                            None if scales is None else result[1],
                            None if weight is None else result[4])
    moe_reroute.cuda_check()


def bad_counts_case():
    tokens = torch.randint(-128, 128, (12, 16), dtype=torch.int8, device="cuda")
    return tokens, {"negative": torch.tensor([[13, -1]], dtype=torch.int32, device="cuda"),
                    "sum": torch.tensor([[5, 6]], dtype=torch.int64, device="cuda")}


BAD = [("negative", "expert_token_num_per_rank: some count is negative"),
       ("sum", "expert_token_num_per_rank: the counts do not sum")]


@needs_gpu
@pytest.mark.parametrize(("bad", "message"), BAD)
def test_cuda_bad_counts_are_sticky_until_cuda_check(status_check, bad, message):
    status_check("deferred")
    tokens, counts = bad_counts_case()
    moe_reroute.moe_re_routing(tokens, counts[bad])  # no host sync, no raise
    moe_reroute.moe_re_routing(tokens, torch.tensor([[5, 7]], device="cuda"))
    with pytest.raises(ValueError, match=message):
        moe_reroute.cuda_check()
    moe_reroute.cuda_check()  # cleared by the check


@needs_gpu
@pytest.mark.parametrize(("bad", "message"), BAD)
def test_cuda_sync_mode_raises_at_the_call(status_check, bad, message):
    status_check("sync")
    tokens, counts = bad_counts_case()
    with pytest.raises(ValueError, match=message):
        moe_reroute.moe_re_routing(tokens, counts[bad])
    with pytest.raises(ValueError, match=message):
        moe_reroute.moe_re_routing_inverse(tokens, counts[bad])
    moe_reroute.cuda_check()


@needs_gpu
def test_cuda_bad_counts_write_no_output(status_check):
    status_check("deferred")
    tokens, counts = bad_counts_case()
    good = moe_reroute.moe_re_routing(tokens, torch.tensor([[5, 7]], device="cuda"))
    out = [torch.full_like(t.view(torch.uint8), reference.POISON).view(t.dtype) for t in good]
    moe_reroute.moe_re_routing(tokens, counts["sum"], out=out)
    torch.cuda.synchronize()
    for t in out:
        assert torch.all(t.view(torch.uint8) == reference.POISON)
    with pytest.raises(ValueError):
        moe_reroute.cuda_check()


@needs_gpu
def test_cuda_refuses_a_tensor_on_another_device():
    tokens, _ = bad_counts_case()
    with pytest.raises(ValueError,
                       match="expert_token_num_per_rank: must be on cuda:0 like tokens"):
        moe_reroute.moe_re_routing(tokens, torch.tensor([[12]], dtype=torch.int32))


@needs_gpu
def test_cuda_runs_on_the_current_stream():
    rng = seeded("stream")
    counts, tokens, scales, weight = make_inputs("torch", TORCH_CASES[0], rng, 2)
    counts = torch.from_numpy(counts)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        inputs = to_cuda(tokens, counts, scales, weight)
        result = moe_reroute.moe_re_routing(*inputs[:2], per_token_scales=inputs[2],
                                            expert_topk_weight=inputs[3])
    stream.synchronize()
    check_torch_forward(result, tokens, counts, scales, weight)


def random_like(tensor, generator):
    """Random bytes in `tensor`'s shape and dtype, on the CPU."""
    data = torch.randint(0, 256, (tensor.numel() * tensor.element_size(),), dtype=torch.uint8,
                         generator=generator)
    return data.view(tensor.dtype).reshape(tensor.shape)


@needs_gpu
def test_cuda_graph_capture_and_replay(status_check):
    status_check("deferred")
    rng = seeded("graph")
    counts, tokens, scales, weight = make_inputs("torch", TORCH_CASES[0], rng, 2)
    static = to_cuda(tokens, torch.from_numpy(counts), scales, weight)

    def step():
        return moe_reroute.moe_re_routing(static[0], static[1], per_token_scales=static[2],
                                          expert_topk_weight=static[3])

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up off the capture, as torch.cuda.graph asks
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in range(3):
        generator = torch.Generator().manual_seed(seed)
        fresh = [random_like(t, generator) for t in (tokens, scales, weight)]
        cells = rng.multinomial(tokens.shape[0], np.full(counts.size, 1 / counts.size))
        fresh_counts = torch.from_numpy(cells.reshape(counts.shape).astype(counts.dtype))
        for dst, src in zip(static, (fresh[0], fresh_counts, fresh[1], fresh[2])):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        check_torch_forward(captured, fresh[0], fresh_counts, fresh[1], fresh[2])
    moe_reroute.cuda_check()


FIRST_CALL_UNDER_CAPTURE = """
import sys
sys.path.insert(0, {tests!r})
import torch
import moe_reroute
from cases import check_torch_forward

tokens = torch.arange(48, dtype=torch.float32).reshape(6, 8)
counts = torch.tensor([[2, 1], [0, 3]], dtype=torch.int32)
static = [tokens.cuda(), counts.cuda()]


def capture():
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = moe_reroute.moe_re_routing(*static)
    return graph, outputs


try:
    capture()
except RuntimeError as error:
    print("refused:", error)
side = torch.cuda.Stream()
with torch.cuda.stream(side):
    moe_reroute.moe_re_routing(*static)  # the warm-up call
torch.cuda.synchronize()
graph, outputs = capture()
graph.replay()
torch.cuda.synchronize()
check_torch_forward(outputs, tokens, counts, None, None)
moe_reroute.cuda_check()
print("replayed")
"""


@needs_gpu
def test_cuda_first_call_under_capture_is_refused_and_a_warm_up_fixes_it():
    """The first call on a device makes its status word, which a capture
    cannot: refused before anything is captured; after a warm-up call the same
    capture replays right. In a fresh process: the word lives per process."""
    import pathlib
    import subprocess
    import sys
    code = FIRST_CALL_UNDER_CAPTURE.format(tests=str(pathlib.Path(__file__).parent))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == ("refused: tokens: the first call on cuda:0 makes its status word, which "
                        "cannot happen under CUDA graph capture; call the operator once on cuda:0 "
                        "before capturing (a warm-up call)"), run.stdout
    assert lines[-1] == "replayed"


@needs_gpu
def test_cuda_sync_mode_is_refused_under_capture(status_check):
    tokens, _ = bad_counts_case()
    counts = torch.tensor([[5, 7]], device="cuda")
    moe_reroute.moe_re_routing(tokens, counts)  # the warm-up call
    torch.cuda.synchronize()
    status_check("sync")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match='set_cuda_status_check: "sync" reads the status word '
                                          "after every call, which cannot happen under CUDA "
                                          'graph capture; capture in "deferred" mode'):
        with torch.cuda.graph(graph):
            moe_reroute.moe_re_routing(tokens, counts)
    moe_reroute.cuda_check()


@needs_gpu
def test_cuda_check_is_refused_under_capture(status_check):
    status_check("deferred")
    tokens, _ = bad_counts_case()
    moe_reroute.moe_re_routing(tokens, torch.tensor([[5, 7]], device="cuda"))  # the warm-up call
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="cuda_check: reads the status words [(]a host sync[)], "
                                           "which cannot happen under CUDA graph capture; call "
                                           "it after the capture"):
        with torch.cuda.graph(graph):
            moe_reroute.cuda_check()
    moe_reroute.cuda_check()


@needs_gpu
def test_cuda_backward_is_the_reference_inverse():
    generator = torch.Generator().manual_seed(5)
    counts = torch.tensor([[3, 0, 2], [1, 4, 0]], dtype=torch.int32)
    tokens = torch.randn(10, 8, generator=generator).cuda().requires_grad_()
    grad = torch.randn(10, 8, generator=generator)
    moe_reroute.moe_re_routing(tokens, counts.cuda())[0].backward(grad.cuda())
    np.testing.assert_array_equal(rows(tokens.grad),
                                  reference.inverse(rows(grad), counts.numpy())[0])


@needs_gpu
def test_cuda_compile_fullgraph_matches_the_reference():
    torch._dynamo.reset()

    def routed(tokens, counts):
        permuted = moe_reroute.moe_re_routing(tokens, counts)
        return permuted, moe_reroute.moe_re_routing_inverse(permuted[0], counts)

    compiled = torch.compile(routed, fullgraph=True)
    generator = torch.Generator().manual_seed(6)
    tokens = torch.randn(20, 8, generator=generator).half()
    counts = torch.tensor([[5, 5], [4, 6]], dtype=torch.int64)
    permuted, restored = compiled(tokens.cuda(), counts.cuda())
    check_torch_forward(permuted, tokens, counts, None, None)
    check_torch_inverse(restored, permuted[0], counts, None, None)
