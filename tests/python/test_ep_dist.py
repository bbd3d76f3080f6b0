"""moe_reroute.ep on torch.distributed (gloo) at 2, 3 and 4 ranks against the
naive reference ep_reference.py, byte for byte: every token dtype torch has,
every scales form, weights present and absent, both index types and count
modes, expert_alignment with capacity, ranks with no tokens and ranks that
receive nothing, skewed routing; combine after dispatch (identity experts
bit for bit); autograd against loops; bad input on one rank and on all;
each case with combine's rows moved a message per block, a message per peer
and each part its own way.

Each rank count is one launch (this file run as a script, which spawns the
ranks), run with a timeout so that a hang fails, naming the case each rank
was in. Every rank runs every case, builds every rank's inputs from the
case's seed and checks its own outputs; a case makes all its collective
calls before it checks anything, so a failed check cannot leave the other
ranks waiting."""

from __future__ import annotations

import faulthandler
import json
import math
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import traceback

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("moe_reroute")

import cases  # noqa: E402
import ep_reference  # noqa: E402
import reference  # noqa: E402

TIMEOUT_S = 600  # a launch's whole run: torch's import per rank takes seconds on a busy machine
CASE_TIMEOUT_S = 90  # a rank stuck this long in one case prints its stack and exits
NUMPY_FLOAT = {torch.float16: np.float16, torch.bfloat16: ml_dtypes.bfloat16,
               torch.float32: np.float32}
# The one NaN moe_finalize_routing writes, by dtype.
CANONICAL_NAN = {np.dtype(np.float16): 0x7E00, np.dtype(ml_dtypes.bfloat16): 0x7FC0,
                 np.dtype(np.float32): 0x7FC00000}


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without distributed")
@pytest.mark.parametrize("num_ranks", [2, 3, 4])
def test_ep_on_gloo(num_ranks, tmp_path):
    proc = subprocess.Popen([sys.executable, __file__, str(num_ranks), str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the ranks with it: they are in its session
        log, _ = proc.communicate()
    where = {r: (tmp_path / f"case{r}").read_text() for r in range(num_ranks)
             if (tmp_path / f"case{r}").exists()}
    assert proc.returncode == 0, f"{num_ranks} ranks, each rank's last case {where}:\n{log[-8000:]}"
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(num_ranks)]
    failures = [failure for result in results for failure in result["failures"]]
    assert not failures, "\n".join(failures)[:20000]
    assert [result["cases"] for result in results] == [results[0]["cases"]] * num_ranks
    assert results[0]["cases"] == len(all_cases(num_ranks))


def test_dispatch_without_the_torch_operators(tmp_path):
    """A build without _torch_ops.so (torch installed after it): ep.dispatch
    on torch tensors raises the library's RuntimeError, not an ImportError."""
    import moe_reroute
    shutil.copytree(pathlib.Path(moe_reroute.__file__).parent, tmp_path / "moe_reroute",
                    ignore=shutil.ignore_patterns("_torch_ops.so", "__pycache__"))
    code = ("import torch\nfrom moe_reroute import ep\ntry:\n"
            "    ep.dispatch(torch.zeros(2, 4), torch.zeros(2, 1, dtype=torch.int32), 1)\n"
            "except RuntimeError as error:\n    print(error)\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=TIMEOUT_S,
                         env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert run.stdout.startswith("moe_reroute: this build has no torch operators"), run.stderr


# ---- inputs, every rank's from one seed ----


class Setup:
    """Every rank's inputs, as bytes for the reference (`ranks`) and as
    tensors for the call (`tensors`: keyword arguments of ep.dispatch)."""

    def __init__(self, rng, num_ranks, *, experts=2, top_k=2, tokens=None, hidden=6,
                 token_case=None, scale_case=None, weights=False, idx_dtype=np.int64,
                 route=None, hidden_on=None):
        token_case = token_case or cases.TOKEN_CASES[0]
        self.num_experts = experts * num_ranks
        self.dtype = token_case.torch_dtype
        if tokens is None:
            tokens = [int(rng.integers(0, 13)) for _ in range(num_ranks)]
        element = torch.empty(0, dtype=self.dtype).element_size()
        probabilities = route if route is not None else np.full(self.num_experts,
                                                                1 / self.num_experts)
        self.ranks, self.tensors = [], []
        for r, num_tokens in enumerate(tokens):
            width = (hidden_on or {}).get(r, hidden)
            x = reference.random_bytes(rng, (num_tokens, width * token_case.bits // 8))
            ids = rng.choice(self.num_experts, size=(num_tokens, top_k), p=probabilities)
            scales = w = None
            tensors = dict(x=cases.from_bytes("torch", x, self.dtype,
                                              (num_tokens, x.shape[1] // element)),
                           expert_idx=torch.from_numpy(ids.astype(idx_dtype)),
                           tokens_dtype=token_case.tokens_dtype)
            if scale_case is not None:
                row = math.prod(scale_case.trailing) * scale_case.itemsize
                scales = reference.random_bytes(rng, (num_tokens, row))
                tensors["per_token_scales"] = cases.from_bytes(
                    "torch", scales, scale_case.torch_dtype, (num_tokens, *scale_case.trailing))
            if weights:
                w = rng.standard_normal((num_tokens, top_k)).astype(np.float32)
                tensors["expert_scales"] = torch.from_numpy(w.copy())
            self.ranks.append(ep_reference.RankInputs(x, ids, scales, w))
            self.tensors.append(tensors)

    def expected(self, **attributes):
        return ep_reference.dispatch(self.ranks, self.num_experts, **attributes)


def to_torch(array: np.ndarray, dtype):
    if array.size == 0:  # torch views no dtype of an empty byte tensor as another
        return torch.empty(array.shape, dtype=dtype)
    data = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
    return torch.from_numpy(data.copy()).view(dtype).reshape(array.shape)


def to_numpy(tensor) -> np.ndarray:
    return cases.byte_rows(tensor).view(NUMPY_FLOAT[tensor.dtype]).reshape(tuple(tensor.shape))


def float_bits(array: np.ndarray) -> np.ndarray:
    """The bits of a float array with every NaN the one NaN moe_finalize_routing writes."""
    bits = array.view({2: np.uint16, 4: np.uint32}[array.itemsize]).copy()
    bits[np.isnan(array.astype(np.float32))] = CANONICAL_NAN[array.dtype]
    return bits


def assert_same_floats(got: np.ndarray, want: np.ndarray):
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    np.testing.assert_array_equal(float_bits(got), float_bits(want))


def random_floats(rng, shape, dtype):
    return to_torch(rng.standard_normal(shape).astype(np.float32).astype(NUMPY_FLOAT[dtype]), dtype)


# ---- checks ----


def check_dispatch(result, want, tensors):
    x = tensors["x"]
    num_rows = want.tokens.shape[0]
    valid = want.valid_rows
    assert result.permute_tokens.dtype == x.dtype
    assert tuple(result.permute_tokens.shape) == (num_rows, *x.shape[1:])
    np.testing.assert_array_equal(cases.byte_rows(result.permute_tokens)[:valid],
                                  want.tokens[:valid])
    scales = tensors.get("per_token_scales")
    if scales is not None:
        assert result.permute_per_token_scales.dtype == scales.dtype
        assert tuple(result.permute_per_token_scales.shape) == (num_rows, *scales.shape[1:])
    else:
        assert result.permute_per_token_scales.dtype == torch.float32
        assert tuple(result.permute_per_token_scales.shape) == (num_rows,)
    np.testing.assert_array_equal(cases.byte_rows(result.permute_per_token_scales)[:valid],
                                  want.scales[:valid])
    assert result.permute_token_idx.dtype == torch.int32
    np.testing.assert_array_equal(result.permute_token_idx.numpy(), want.idx)
    assert result.expert_token_num.dtype == torch.int32
    np.testing.assert_array_equal(result.expert_token_num.numpy(), want.expert_token_num)
    if "expert_scales" in tensors:
        assert tuple(result.permute_topk_weight.shape) == (num_rows,)
        weight = cases.byte_rows(result.permute_topk_weight.view(-1, 1))
        np.testing.assert_array_equal(weight[:valid], want.weight[:valid])
    else:
        assert tuple(result.permute_topk_weight.shape) == (0,)
    assert result.permute_topk_weight.dtype == torch.float32
    assert result.expert_token_num_per_rank.dtype == torch.int32
    np.testing.assert_array_equal(result.expert_token_num_per_rank.numpy(), want.counts)


def dispatch_and_combine(setup, rank, rng, out_dtype, out_hidden, group=None, **attributes):
    """A dispatch, then a combine of random expert outputs (every rank's from
    the seed); checks both. `rank` is the rank in `group`."""
    from moe_reroute import ep
    wanted = setup.expected(**attributes)
    expert_outs = [random_floats(rng, (w.tokens.shape[0], out_hidden), out_dtype) for w in wanted]
    tensors = setup.tensors[rank]
    result = ep.dispatch(num_experts=setup.num_experts, group=group, **tensors, **attributes)
    out = ep.combine(expert_outs[rank], result.handle)
    check_dispatch(result, wanted[rank], tensors)
    # Each token went once to each rank that has one of its experts.
    ranks = setup.ranks[rank].expert_idx // (setup.num_experts // len(setup.ranks))
    assert result.handle.unique_sent == [sum(r in row for row in ranks)
                                         for r in range(len(setup.ranks))]
    want = ep_reference.combine([to_numpy(e) for e in expert_outs], setup.ranks, wanted)[rank]
    assert_same_floats(to_numpy(out), want)


def identity_experts(setup, rank, **attributes):
    """combine(permute_tokens) of float tokens: each token's weighted sum of its own rows."""
    from moe_reroute import ep
    wanted = setup.expected(**attributes)
    tensors = setup.tensors[rank]
    result = ep.dispatch(num_experts=setup.num_experts, **tensors, **attributes)
    out = ep.combine(result.permute_tokens, result.handle)
    check_dispatch(result, wanted[rank], tensors)
    np_dtype = NUMPY_FLOAT[setup.dtype]
    expert_outs = [w.tokens.view(np_dtype) for w in wanted]
    want = ep_reference.combine(expert_outs, setup.ranks, wanted)[rank]
    assert_same_floats(to_numpy(out), want)


# ---- the cases ----


def sweep_cases(num_ranks):
    """Every token dtype torch has with every scales form it pairs with, the
    attributes, weights, routing and T = 0 varying with the case."""
    out = []
    i = 0
    for token_case in cases.TOKEN_CASES:
        if token_case.torch_dtype is None:
            continue
        forms = [None] + [s for s in cases.SCALE_CASES[1:]
                          if s.torch_dtype is not None and cases.pairs(token_case, s)]
        for scale_case in forms:
            label = f"sweep {token_case.label} scales {scale_case and scale_case.label}"

            def run(rank, num_ranks, label=label, token_case=token_case, scale_case=scale_case,
                    i=i):
                rng = cases.seeded(label, str(num_ranks))
                tokens = [int(rng.integers(1, 13)) for _ in range(num_ranks)]
                tokens[i % num_ranks] = 0  # a rank with no tokens
                # The case number picks each choice by another digit, so they mix.
                setup = Setup(rng, num_ranks, experts=1 + i % 3, top_k=1 + (i // 2) % 3,
                              tokens=tokens, hidden=2 * int(rng.integers(1, 9)),
                              token_case=token_case, scale_case=scale_case, weights=i % 4 < 2,
                              idx_dtype=(np.int32, np.int64)[(i // 3) % 2])
                attributes = dict(idx_type=i % 2, expert_token_num_type=(i // 2) % 2)
                if i % 5 in (1, 3):  # static shapes: capacity at or past the most any rank receives
                    most = max(w.valid_rows for w in setup.expected())
                    attributes.update(expert_alignment=2 + i % 3,
                                      capacity=most + int(rng.integers(0, 3)))
                elif i % 5 == 4:
                    attributes.update(expert_alignment=3)
                dispatch_and_combine(setup, rank, rng,
                                     (torch.float16, torch.bfloat16, torch.float32)[(i // 4) % 3],
                                     int(rng.integers(1, 12)), **attributes)
            out.append((label, run))
            i += 1
    return out


def routing_cases(num_ranks):
    """Routing shapes: a rank that receives nothing, skew, every rank with no
    tokens, one expert per rank with k = 1, a wide row, more experts than the
    agreement carries counts for, capacity met exactly."""
    def nothing_to_last(rank, num_ranks):
        rng = cases.seeded("nothing to the last rank", str(num_ranks))
        route = np.array([1.0] * (2 * num_ranks - 2) + [0.0, 0.0])
        setup = Setup(rng, num_ranks, route=route / route.sum(), weights=True)
        dispatch_and_combine(setup, rank, rng, torch.bfloat16, 5)

    def skewed(rank, num_ranks):
        rng = cases.seeded("skewed", str(num_ranks))
        route = np.array([0.0] * 3 * num_ranks)
        route[[0, 4]] = [0.9, 0.1]
        setup = Setup(rng, num_ranks, experts=3, top_k=3, tokens=[9] * num_ranks,
                      route=route, weights=True, token_case=cases.TOKEN_CASES[1])
        dispatch_and_combine(setup, rank, rng, torch.float16, 3, expert_alignment=4)

    def no_tokens_anywhere(rank, num_ranks):
        rng = cases.seeded("no tokens anywhere", str(num_ranks))
        setup = Setup(rng, num_ranks, tokens=[0] * num_ranks, weights=True)
        dispatch_and_combine(setup, rank, rng, torch.float32, 4, capacity=0)

    def one_expert_top1(rank, num_ranks):
        rng = cases.seeded("one expert, k = 1", str(num_ranks))
        setup = Setup(rng, num_ranks, experts=1, top_k=1, token_case=cases.TOKEN_CASES[3])
        identity_experts(setup, rank)

    def wide_rows(rank, num_ranks):
        rng = cases.seeded("wide rows", str(num_ranks))
        setup = Setup(rng, num_ranks, experts=2, top_k=2, tokens=[3] * num_ranks,
                      hidden=7168, token_case=cases.TOKEN_CASES[1], weights=True)
        identity_experts(setup, rank, expert_alignment=2)

    def many_experts(rank, num_ranks):
        # More global experts than ride in the agreement: the counts take a second gather.
        rng = cases.seeded("many experts", str(num_ranks))
        setup = Setup(rng, num_ranks, experts=1100 // num_ranks + 1, top_k=3,
                      tokens=[6] * num_ranks, weights=True)
        dispatch_and_combine(setup, rank, rng, torch.float32, 4)

    def capacity_met(rank, num_ranks):
        rng = cases.seeded("capacity met exactly", str(num_ranks))
        setup = Setup(rng, num_ranks, experts=2, top_k=2, weights=True,
                      token_case=cases.TOKEN_CASES[0])
        most = max(int(w.counts.sum()) for w in setup.expected())
        identity_experts(setup, rank, capacity=most, expert_alignment=2, idx_type=1)

    def subgroup(rank, num_ranks):
        # Ranks 1 .. N - 1 as a group of their own (its ranks 0 .. N - 2); rank 0 is outside.
        import torch.distributed as dist
        group = dist.new_group(list(range(1, num_ranks)))
        if rank == 0:
            return
        rng = cases.seeded("subgroup", str(num_ranks))
        setup = Setup(rng, num_ranks - 1, weights=True)
        dispatch_and_combine(setup, rank - 1, rng, torch.float32, 3, group=group,
                             expert_alignment=2)

    return [(f.__name__.replace("_", " "), f) for f in (
        nothing_to_last, skewed, no_tokens_anywhere, one_expert_top1, wide_rows, many_experts,
        capacity_met, subgroup)]


def autograd_cases(num_ranks):
    """Backward passes against loops: dispatch's (a combine without weights,
    and each weight's gradient brought home) and combine's (a dispatch of
    the gradient times the weights, and each weight's dot product); float16
    without weights (weight 1)."""
    out = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        name = str(dtype).removeprefix("torch.")
        weighted = dtype != torch.float16

        def dispatch_backward(rank, num_ranks, dtype=dtype, name=name, weighted=weighted):
            from moe_reroute import ep
            rng = cases.seeded("dispatch backward", name, str(num_ranks))
            setup = Setup(rng, num_ranks, experts=2, top_k=3, weights=weighted)
            wanted = setup.expected(expert_alignment=2)
            tensors = setup.tensors[rank]
            xs = [random_floats(rng, (len(r.x), tensors["x"].shape[1]), dtype) for r in setup.ranks]
            x = xs[rank].requires_grad_()
            weights = tensors["expert_scales"].clone().requires_grad_() if weighted else None
            grads = [(random_floats(rng, (w.tokens.shape[0], x.shape[1]), dtype),
                      random_floats(rng, (w.tokens.shape[0],), torch.float32)) for w in wanted]
            result = ep.dispatch(x, tensors["expert_idx"], setup.num_experts, expert_scales=weights,
                                 expert_alignment=2)
            loss = (result.permute_tokens.float() * grads[rank][0].float()).sum()
            if weighted:
                loss = loss + (result.permute_topk_weight * grads[rank][1]).sum()
            loss.backward()
            grad_tokens = [to_numpy(g) for g, _ in grads]
            grad_weights = [g.numpy() for _, g in grads]
            want_x = np.zeros(tuple(x.shape), NUMPY_FLOAT[dtype])
            top_k = tensors["expert_idx"].shape[1]
            want_w = np.zeros((x.shape[0], top_k), np.float32)
            for t in range(x.shape[0]):
                y = np.zeros(x.shape[1], np.float32)
                for j in range(top_k):
                    r, row = wanted[rank].landing[t * top_k + j]
                    y = y + grad_tokens[r][row].astype(np.float32)
                    want_w[t, j] = grad_weights[r][row]
                want_x[t] = y.astype(NUMPY_FLOAT[dtype])
            assert_same_floats(to_numpy(x.grad), want_x)
            if weighted:
                np.testing.assert_array_equal(weights.grad.numpy(), want_w)

        def combine_backward(rank, num_ranks, dtype=dtype, name=name, weighted=weighted):
            from moe_reroute import ep
            rng = cases.seeded("combine backward", name, str(num_ranks))
            top_k = 2
            setup = Setup(rng, num_ranks, experts=2, top_k=top_k, weights=weighted, tokens=[
                int(rng.integers(0, 9)) for _ in range(num_ranks)])
            wanted = setup.expected(capacity=40, expert_alignment=3)
            tensors = setup.tensors[rank]
            weights = tensors["expert_scales"].clone().requires_grad_() if weighted else None
            out_hidden = 5
            expert_outs = [random_floats(rng, (w.tokens.shape[0], out_hidden), dtype)
                           for w in wanted]
            grads = [random_floats(rng, (len(r.x), out_hidden), dtype) for r in setup.ranks]
            expert_out = expert_outs[rank].clone().requires_grad_()
            result = ep.dispatch(tensors["x"], tensors["expert_idx"], setup.num_experts,
                                 expert_scales=weights, capacity=40, expert_alignment=3)
            out = ep.combine(expert_out, result.handle)
            (out.float() * grads[rank].float()).sum().backward()
            np_dtype = NUMPY_FLOAT[dtype]
            want_out = np.zeros((wanted[rank].tokens.shape[0], out_hidden), np_dtype)
            for s, inputs in enumerate(setup.ranks):  # the pairs that landed here
                g = to_numpy(grads[s]).astype(np.float32)
                for p, (r, row) in enumerate(wanted[s].landing):
                    if r == rank:
                        w = inputs.weights.reshape(-1)[p] if weighted else np.float32(1)
                        want_out[row] = (g[p // top_k] * w).astype(np_dtype)
            assert_same_floats(to_numpy(expert_out.grad), want_out)
            if not weighted:
                return
            rows = [to_numpy(e).astype(np.float32) for e in expert_outs]
            g = to_numpy(grads[rank]).astype(np.float32)
            want_w = np.zeros((len(g), top_k), np.float32)
            for p, (r, row) in enumerate(wanted[rank].landing):
                want_w[p // top_k, p % top_k] = np.dot(g[p // top_k].astype(np.float64),
                                                       rows[r][row])
            np.testing.assert_allclose(weights.grad.numpy(), want_w, rtol=1e-5, atol=1e-5)

        out += [(f"dispatch backward {name}", dispatch_backward),
                (f"combine backward {name}", combine_backward)]
    return out


def refused(call, rank, culprits, own_type, own_message, step="dispatch"):
    """Runs `call` and checks what it raised on this rank: on a culprit rank
    its own error (own_message), on the others the same type naming the
    lowest culprit."""
    try:
        call()
    except Exception as error:  # checked below
        caught = error
    else:
        raise AssertionError(f"rank {rank}: no error")
    want = (own_message if rank in culprits else
            f"{step}: rank {min(culprits)} refused its arguments (its error names the argument); "
            "nothing was sent")
    assert type(caught) is own_type, (type(caught), caught)
    assert str(caught).startswith(want), (str(caught), want)


def error_cases(num_ranks):
    """Bad input on one rank and on every rank: each rank raises, none hangs,
    nothing is sent (the next case runs in step)."""
    from moe_reroute import ep
    last = num_ranks - 1

    def setup_for(label, **kwargs):
        return Setup(cases.seeded(label, str(num_ranks)), num_ranks,
                     tokens=[4] * num_ranks, **kwargs)

    def with_changes(rank, setup, culprits, **changes):
        tensors = dict(setup.tensors[rank])
        if rank in culprits:
            tensors.update(changes)
        return tensors

    def bad_id(rank, num_ranks):
        setup = setup_for("bad id")
        ids = setup.tensors[rank]["expert_idx"].clone()
        ids[1, 0] = setup.num_experts
        tensors = with_changes(rank, setup, {last}, expert_idx=ids)
        refused(lambda: ep.dispatch(num_experts=setup.num_experts, **tensors), rank, {last},
                ValueError, f"expert_idx: [1, 0] = {setup.num_experts} is not below expert_num = "
                f"{setup.num_experts}")

    def bad_ids_everywhere(rank, num_ranks):
        setup = setup_for("bad ids everywhere")
        ids = setup.tensors[rank]["expert_idx"].clone()
        ids[0, 1] = -1
        culprits = set(range(num_ranks))
        tensors = with_changes(rank, setup, culprits, expert_idx=ids)
        refused(lambda: ep.dispatch(num_experts=setup.num_experts, **tensors), rank, culprits,
                ValueError, "expert_idx: [0, 1] = -1 is negative")

    def int32_tokens(rank, num_ranks):
        setup = setup_for("int32 tokens")
        tensors = with_changes(rank, setup, {0}, x=torch.zeros(4, 6, dtype=torch.int32))
        refused(lambda: ep.dispatch(num_experts=setup.num_experts, **tensors), rank, {0},
                TypeError, "x: dtype int32 is not a token dtype (")

    def not_a_tensor(rank, num_ranks):
        setup = setup_for("not a tensor")
        tensors = with_changes(rank, setup, {last}, x=np.zeros((4, 6), np.float16))
        refused(lambda: ep.dispatch(num_experts=setup.num_experts, **tensors), rank, {last},
                TypeError, "x: expected torch.Tensor, got numpy.ndarray")

    def expert_scales_shape(rank, num_ranks):
        setup = setup_for("expert_scales shape", weights=True)
        tensors = with_changes(rank, setup, {last}, expert_scales=torch.ones(4, 3))
        refused(lambda: ep.dispatch(num_experts=setup.num_experts, **tensors), rank, {last},
                ValueError, "expert_scales: must be float32 [T, k] = [4, 2], got float32[4, 3]")

    def scales_form(rank, num_ranks):
        setup = setup_for("scales form")
        tensors = with_changes(rank, setup, {0}, per_token_scales=torch.ones(4, 2, 2))
        refused(lambda: ep.dispatch(num_experts=setup.num_experts, **tensors), rank, {0},
                ValueError, "per_token_scales: float32 scales with float16 tokens must be [A], "
                "[A, S], got float32[4, 2, 2]")

    def num_experts_not_a_multiple(rank, num_ranks):
        setup = setup_for("num_experts")
        culprits = set(range(num_ranks))
        refused(lambda: ep.dispatch(num_experts=num_ranks + 1, **setup.tensors[rank]), rank,
                culprits, ValueError, f"num_experts: must be a positive multiple of the "
                f"{num_ranks} ranks of group, got {num_ranks + 1}")

    def num_experts_not_an_int(rank, num_ranks):
        setup = setup_for("num_experts not an int")
        num_experts = str(setup.num_experts) if rank == last else setup.num_experts
        refused(lambda: ep.dispatch(num_experts=num_experts, **setup.tensors[rank]), rank,
                {last}, TypeError, "num_experts: ")

    def num_experts_differs(rank, num_ranks):
        # The counts' length follows num_experts: the agreement's rows must not.
        setup = setup_for("num_experts differs")
        num_experts = setup.num_experts * (2 if rank == last else 1)
        refused(lambda: ep.dispatch(num_experts=num_experts, **setup.tensors[rank]), rank,
                set(range(num_ranks)), ValueError,
                f"num_experts differs across ranks ({setup.num_experts} to "
                f"{2 * setup.num_experts}); every rank must pass the same")

    def negative_capacity(rank, num_ranks):
        setup = setup_for("negative capacity")
        capacity = -2 if rank == last else None
        refused(lambda: ep.dispatch(num_experts=setup.num_experts, capacity=capacity,
                                    **setup.tensors[rank]), rank, {last}, ValueError,
                "capacity: must be >= 0 (or -1: the rows received), got -2")

    def float8_grad(rank, num_ranks):
        setup = setup_for("float8 requires grad")
        x = setup.tensors[rank]["x"].to(torch.float8_e4m3fn).requires_grad_(rank == 0)
        tensors = dict(setup.tensors[rank], x=x)
        refused(lambda: ep.dispatch(num_experts=setup.num_experts, **tensors), rank, {0},
                TypeError, "x: requires grad, but only float16, bfloat16 and float32 tokens are "
                "differentiable, got float8_e4m3fn")

    def differs(name, low, high, last_arguments=None, hidden_on=None, last_tensors=None):
        """The last rank passes another value of an argument every rank must
        pass alike: `last_arguments`, its tensors changed by `last_tensors`."""
        def run(rank, num_ranks):
            setup = setup_for(name, hidden_on=hidden_on)
            tensors = dict(setup.tensors[rank])
            arguments = {}
            if rank == last:
                arguments = last_arguments or {}
                tensors.update(last_tensors(tensors) if last_tensors else {})
            refused(lambda: ep.dispatch(num_experts=setup.num_experts, **tensors, **arguments),
                    rank, set(range(num_ranks)), ValueError,
                    f"{name} differs across ranks ({low} to {high}); every rank must pass the same")
        return (f"{name} differs", run)

    def capacity_exceeded(rank, num_ranks):
        setup = Setup(cases.seeded("capacity exceeded", str(num_ranks)), num_ranks,
                      tokens=[2] * num_ranks, route=np.array([1.0] + [0.0] * (2 * num_ranks - 1)))
        refused(lambda: ep.dispatch(num_experts=setup.num_experts, capacity=3,
                                    **setup.tensors[rank]), rank, {0}, ValueError,
                f"capacity: rank 0 receives {4 * num_ranks} rows, more than capacity = 3")

    def combine_rows(rank, num_ranks):
        setup = setup_for("combine rows")
        result = ep.dispatch(num_experts=setup.num_experts, **setup.tensors[rank])
        rows = result.permute_tokens.shape[0] + (rank == last)
        refused(lambda: ep.combine(torch.zeros(rows, 3), result.handle), rank, {last},
                ValueError, f"expert_out: must be [R, H'] with R = {rows - 1} rows (dispatch's "
                f"permute_tokens), got float32[{rows}, 3]", step="combine")

    def combine_dtype_differs(rank, num_ranks):
        setup = setup_for("combine dtype differs")
        result = ep.dispatch(num_experts=setup.num_experts, **setup.tensors[rank])
        dtype = torch.float32 if rank == last else torch.float16
        refused(lambda: ep.combine(torch.zeros(result.permute_tokens.shape[0], 3, dtype=dtype),
                                   result.handle), rank, set(range(num_ranks)), ValueError,
                "expert_out: dtype differs across ranks (0 to 8); every rank must pass the same",
                step="combine")

    def combine_int_everywhere(rank, num_ranks):
        setup = setup_for("combine int")
        result = ep.dispatch(num_experts=setup.num_experts, **setup.tensors[rank])
        refused(lambda: ep.combine(torch.zeros(result.permute_tokens.shape[0], 3,
                                               dtype=torch.int32), result.handle),
                rank, set(range(num_ranks)), TypeError,
                "expert_out: dtype int32 is not float16, bfloat16 or float32", step="combine")

    named = [(f.__name__.replace("_", " "), f) for f in (
        bad_id, bad_ids_everywhere, int32_tokens, not_a_tensor, expert_scales_shape, scales_form,
        num_experts_not_a_multiple, num_experts_not_an_int, num_experts_differs,
        negative_capacity, float8_grad, capacity_exceeded,
        combine_rows, combine_dtype_differs, combine_int_everywhere)]
    return named + [
        differs("x: H", 6, 8, hidden_on={last: 8}),
        differs("idx_type", 0, 1, last_arguments=dict(idx_type=1)),
        differs("capacity", -1, 50, last_arguments=dict(capacity=50)),
        differs("x: dtype", 0, 8, last_tensors=lambda t: dict(x=t["x"].float())),
        differs("expert_scales: presence", 0, 1,
                last_tensors=lambda t: dict(expert_scales=torch.ones(4, 2))),
        differs("per_token_scales: dtype", -1, 8,
                last_tensors=lambda t: dict(per_token_scales=torch.ones(4))),
        differs("x: requires grad", 0, 1,
                last_tensors=lambda t: dict(x=t["x"].clone().requires_grad_()))]


# The two ways combine (and dispatch's backward) moves rows back
# (_ep_torch.Handle.by_peer), picked by the threshold: every part a message
# per block, every part a message per peer, and each part by its mean block
# (wide rows by block, the weights' gradient by peer, as at prefill).
EXCHANGES = {"by block": 0, "by peer": 1 << 62, "by part": 256}


def all_cases(num_ranks):
    """(label, exchange, run): every case under each exchange."""
    # Errors between good cases: a call that sent anything would put the next out of step.
    once = (sweep_cases(num_ranks)[:3] + error_cases(num_ranks) + sweep_cases(num_ranks)[3:]
            + routing_cases(num_ranks) + autograd_cases(num_ranks))
    return [(f"{label}, {exchange}", exchange, run) for exchange in EXCHANGES
            for label, run in once]


def rank_main(rank, num_ranks, directory):
    import torch.distributed as dist
    directory = pathlib.Path(directory)
    dist.init_process_group("gloo", init_method=f"file://{directory}/store", rank=rank,
                            world_size=num_ranks)
    from moe_reroute import _ep_torch
    failures, count = [], 0
    for label, exchange, run in all_cases(num_ranks):
        (directory / f"case{rank}").write_text(label)
        _ep_torch.SMALL_BLOCK_BYTES = EXCHANGES[exchange]
        faulthandler.dump_traceback_later(CASE_TIMEOUT_S, exit=True)
        try:
            run(rank, num_ranks)
        except Exception:  # reported with the case's name
            failures.append(f"{num_ranks} ranks, rank {rank}, {label}:\n{traceback.format_exc()}")
        faulthandler.cancel_dump_traceback_later()
        count += 1
    dist.destroy_process_group()
    (directory / f"rank{rank}.json").write_text(json.dumps(dict(cases=count, failures=failures)))


if __name__ == "__main__":
    import torch.multiprocessing
    torch.multiprocessing.spawn(rank_main, args=(int(sys.argv[1]), sys.argv[2]),
                                nprocs=int(sys.argv[1]))
