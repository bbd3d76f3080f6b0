"""CUDA tensors through the torch operators. The host logic (backend choice,
status handling, scratch sizing, the CUDA entry's host-side checks) runs
everywhere; the GPU cases (bitwise against the CPU backend, bad counts,
graph capture and replay) skip without a GPU or without the CUDA backend."""

from __future__ import annotations

import ctypes
import re
import numpy as np
import pytest
import torch

import moe_reroute
import reference
from cases import TOKEN_CASES, make_inputs, poisoned_outputs, seeded

_core = moe_reroute._core
_torch = moe_reroute._torch
OPS = torch.ops.moe_reroute

needs_cuda_backend = pytest.mark.skipif(not _core.has_cuda,
                                        reason="module built without the CUDA backend")
needs_gpu = pytest.mark.skipif(not (_core.has_cuda and torch.cuda.is_available()),
                               reason="needs a GPU and the CUDA backend")


@pytest.fixture
def status_check():
    """Sets the status check for one test and restores the previous mode."""
    previous = []
    yield lambda mode: previous.append(moe_reroute.set_cuda_status_check(mode))
    if previous:
        moe_reroute.set_cuda_status_check(previous[0])


@pytest.mark.parametrize(("mode", "capturing", "compiling", "action"), [
    ("raise", False, False, "raise"),
    ("raise", True, False, "assert"),
    ("raise", False, True, "assert"),
    ("assert", False, False, "assert"),
    ("assert", True, True, "assert"),
    ("off", False, False, "off"),
    ("off", True, False, "off"),
])
def test_status_action(mode, capturing, compiling, action):
    assert _torch.status_action(mode, capturing, compiling) == action


def test_set_cuda_status_check_returns_the_previous_mode_and_refuses_others(status_check):
    status_check("off")
    assert moe_reroute.set_cuda_status_check("assert") == "off"
    with pytest.raises(ValueError, match="mode: must be one of raise, assert, off; got 'sync'"):
        moe_reroute.set_cuda_status_check("sync")
    assert moe_reroute.set_cuda_status_check("assert") == "assert"


def test_backend_choice():
    assert _torch.backend(False) == "cpu"
    assert _torch.backend(True) == ("cuda" if _core.has_cuda else "cpu")


@pytest.mark.parametrize("name", ["moe_re_routing", "moe_re_routing_out",
                                  "moe_re_routing_inverse"])
def test_kernels_are_registered_for_cpu_and_cuda(name):
    for key in ("CPU", "CUDA"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"moe_reroute::{name}", key)


@needs_cuda_backend
@pytest.mark.parametrize(("num_ranks", "num_experts"), [(1, 1), (16, 16), (3, 1000)])
def test_scratch_is_the_status_word_and_two_offset_tables(num_ranks, num_experts):
    assert _core.cuda_scratch_bytes(num_ranks, num_experts) == 8 + 2 * 8 * num_ranks * num_experts


@needs_cuda_backend
@pytest.mark.parametrize(("status", "message"), [
    (0, "^$"),
    (1, "^expert_token_num_per_rank: some count is negative$"),
    (2, "^expert_token_num_per_rank: the counts do not sum to the number of rows of tokens$"),
    (3, "^expert_token_num_per_rank: some count is negative; the counts do not sum"),
])
def test_status_messages_name_the_argument(status, message):
    assert re.search(message, _core.cuda_status_message(status))


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32),
                ("device_id", ctypes.c_int32), ("ndim", ctypes.c_int32),
                ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16),
                ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


_KEEP_ALIVE = []


def device_capsule(array: np.ndarray, device_type: int, device_id: int = 0):
    """A DLPack capsule that claims `array`'s shape and dtype on another
    device (2: CUDA), for the host-side device checks; nothing reads its data."""
    shape = (ctypes.c_int64 * array.ndim)(*array.shape)
    strides = (ctypes.c_int64 * array.ndim)(*[s // array.itemsize for s in array.strides])
    code = {"i": 0, "u": 1, "f": 2}[array.dtype.kind]
    managed = DLManagedTensor(DLTensor(0x10000, device_type, device_id, array.ndim, code,
                                       array.itemsize * 8, 1, shape, strides, 0), None, None)
    _KEEP_ALIVE.extend((shape, strides, managed))
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype = ctypes.py_object
    new_capsule.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
    return new_capsule(ctypes.addressof(managed), b"dltensor", None)


def host_arguments(num_tokens=6):
    """Arguments of the core module's reroute on NumPy arrays."""
    tokens = np.arange(num_tokens * 4, dtype=np.int8).reshape(num_tokens, 4)
    counts = np.array([[num_tokens]], np.int32)
    outputs = (np.empty_like(tokens), np.empty(num_tokens, np.float32),
               np.empty(num_tokens, np.int32), np.empty(1, np.int32), np.empty(0, np.float32))
    return [tokens, counts, None, None, *outputs, 1, 0, None, None]


def host_scratch():
    return np.empty(_core.cuda_scratch_bytes(1, 1) // 4, np.int32)


def on_devices(devices: dict, default=None) -> list:
    """host_arguments with each array i moved (as a capsule) to devices.get(i,
    default): a (DLPack device type, id) pair, or None for host memory."""
    arguments = host_arguments()
    for i, array in enumerate(arguments):
        device = devices.get(i, default)
        if isinstance(array, np.ndarray) and device is not None:
            arguments[i] = device_capsule(array, *device)
    return arguments


@needs_cuda_backend
def test_cuda_entry_refuses_host_tokens_before_launching():
    with pytest.raises(ValueError, match="^tokens: must be on a CUDA device for the CUDA backend"):
        _core.reroute_cuda(*host_arguments(), 0, host_scratch())


@needs_cuda_backend
@pytest.mark.parametrize(("position", "arg"), [(1, "expert_token_num_per_rank"),
                                               (6, "permute_token_idx")])
@pytest.mark.parametrize("device", [None, (2, 0)], ids=["host", "cuda:0"])
def test_cuda_entry_refuses_a_tensor_off_tokens_device(position, arg, device):
    arguments = on_devices({position: device}, default=(2, 1))
    with pytest.raises(ValueError, match=f"^{arg}: must be on cuda:1 like tokens$"):
        _core.reroute_cuda(*arguments, 0, host_scratch())


@needs_cuda_backend
def test_cuda_entry_refuses_host_scratch():
    with pytest.raises(ValueError, match="^scratch: must be on cuda:0 like tokens$"):
        _core.reroute_cuda(*on_devices({}, default=(2, 0)), 0, host_scratch())


def test_cpu_entry_names_a_tensor_in_device_memory():
    arguments = on_devices({1: (2, 0)})
    where = "in CPU memory like tokens" if _core.has_cuda else \
        r"in CPU memory \(this build has only the CPU backend\)"
    with pytest.raises(ValueError, match=f"^expert_token_num_per_rank: must be {where}$"):
        _core.reroute(*arguments)
    with pytest.raises(ValueError, match="^tokens: must be in CPU memory"):
        _core.reroute(*on_devices({0: (2, 0)}))


# --- on a GPU -------------------------------------------------------------


def to_cuda(*tensors):
    return [None if t is None else t.cuda() for t in tensors]


def assert_bitwise(actual, expected):
    for a, e in zip(actual, expected):
        assert a.device.type == "cuda" and a.dtype == e.dtype and a.shape == e.shape
        assert torch.equal(a.cpu().view(torch.uint8), e.view(torch.uint8))


TORCH_CASES = [case for case in TOKEN_CASES if case.torch_dtype is not None]


@needs_gpu
@pytest.mark.parametrize("case", TORCH_CASES, ids=lambda c: c.label)
def test_cuda_is_bitwise_the_cpu_backend(case):
    rng = seeded("cuda", case.label)
    for trial in range(4):
        counts, tokens, scales, weight = make_inputs("torch", case, rng, trial)
        counts = torch.from_numpy(counts)
        attributes = dict(expert_token_num_type=trial % 2, idx_type=(trial // 2) % 2,
                          tokens_dtype=case.tokens_dtype)
        expected = moe_reroute.moe_re_routing(tokens, counts, per_token_scales=scales,
                                              expert_topk_weight=weight, **attributes)
        cuda_inputs = to_cuda(tokens, counts, scales, weight)
        result = moe_reroute.moe_re_routing(*cuda_inputs[:2], per_token_scales=cuda_inputs[2],
                                            expert_topk_weight=cuda_inputs[3], **attributes)
        assert_bitwise(result, expected)
        out = to_cuda(*poisoned_outputs("torch", tokens, counts, scales, weight))
        moe_reroute.moe_re_routing(*cuda_inputs[:2], per_token_scales=cuda_inputs[2],
                                   expert_topk_weight=cuda_inputs[3], **attributes, out=out)
        assert_bitwise(out, expected)
        restored = moe_reroute.moe_re_routing_inverse(
            result[0], cuda_inputs[1], per_token_scales=None if scales is None else result[1],
            expert_topk_weight=None if weight is None else result[4],
            tokens_dtype=case.tokens_dtype)
        assert_bitwise([r for r in restored if r is not None],
                       [t for t in (tokens, scales, weight) if t is not None])


def bad_counts_case():
    tokens = torch.randint(-128, 128, (12, 16), dtype=torch.int8, device="cuda")
    return tokens, {"negative": torch.tensor([[13, -1]], dtype=torch.int32, device="cuda"),
                    "sum": torch.tensor([[5, 6]], dtype=torch.int64, device="cuda")}


@needs_gpu
@pytest.mark.parametrize(("bad", "message"), [
    ("negative", "expert_token_num_per_rank: some count is negative"),
    ("sum", "expert_token_num_per_rank: the counts do not sum to the number of rows of tokens"),
])
def test_cuda_bad_counts_raise_value_error_naming_the_argument(bad, message):
    tokens, counts = bad_counts_case()
    with pytest.raises(ValueError, match=message):
        moe_reroute.moe_re_routing(tokens, counts[bad])
    with pytest.raises(ValueError, match=message):
        moe_reroute.moe_re_routing_inverse(tokens, counts[bad])


def random_like(tensor, generator):
    """Random bytes in `tensor`'s shape and dtype, on the CPU."""
    data = torch.randint(0, 256, (tensor.numel() * tensor.element_size(),), dtype=torch.uint8,
                         generator=generator)
    return data.view(tensor.dtype).reshape(tensor.shape)


def poisoned_like(tensor):
    return torch.full_like(tensor.view(torch.uint8), reference.POISON).view(tensor.dtype)


@needs_gpu
def test_cuda_bad_counts_with_the_check_off_write_no_output(status_check):
    status_check("off")
    tokens, counts = bad_counts_case()
    good = moe_reroute.moe_re_routing(tokens, torch.tensor([[5, 7]], device="cuda"))
    out = [poisoned_like(t) for t in good]
    moe_reroute.moe_re_routing(tokens, counts["sum"], out=out)
    torch.cuda.synchronize()
    for t in out:
        assert torch.all(t.view(torch.uint8) == reference.POISON)


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
    expected = moe_reroute.moe_re_routing(tokens, counts, per_token_scales=scales,
                                          expert_topk_weight=weight)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        inputs = to_cuda(tokens, counts, scales, weight)
        result = moe_reroute.moe_re_routing(*inputs[:2], per_token_scales=inputs[2],
                                            expert_topk_weight=inputs[3])
    stream.synchronize()
    assert_bitwise(result, expected)


@needs_gpu
def test_cuda_graph_capture_and_replay():
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
        expected = moe_reroute.moe_re_routing(fresh[0], fresh_counts, per_token_scales=fresh[1],
                                              expert_topk_weight=fresh[2])
        assert_bitwise(captured, expected)


@needs_gpu
def test_cuda_backward_is_the_cpu_backward():
    generator = torch.Generator().manual_seed(5)
    counts = torch.tensor([[3, 0, 2], [1, 4, 0]], dtype=torch.int32)
    tokens = torch.randn(10, 8, generator=generator)
    grad = torch.randn(10, 8, generator=generator)
    results = []
    for device in ("cpu", "cuda"):
        leaf = tokens.to(device).requires_grad_()
        permuted = moe_reroute.moe_re_routing(leaf, counts.to(device))[0]
        permuted.backward(grad.to(device))
        results.append(leaf.grad.cpu())
    assert torch.equal(results[0], results[1])


@needs_gpu
def test_cuda_compile_fullgraph_is_bitwise_eager():
    torch._dynamo.reset()

    def routed(tokens, counts):
        permuted = moe_reroute.moe_re_routing(tokens, counts)
        return (*permuted, moe_reroute.moe_re_routing_inverse(permuted[0], counts)[0])

    compiled = torch.compile(routed, fullgraph=True)
    generator = torch.Generator().manual_seed(6)
    tokens = torch.randn(20, 8, generator=generator).half().cuda()
    counts = torch.tensor([[5, 5], [4, 6]], dtype=torch.int64, device="cuda")
    expected = routed(tokens, counts)
    assert_bitwise(compiled(tokens, counts), [e.cpu() for e in expected])
