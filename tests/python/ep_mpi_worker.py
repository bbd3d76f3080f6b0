"""One rank of moe_reroute.ep over mpi4py, started by test_ep_mpi.py under
mpirun: every case of the sweep, then the refusals, each checked on every
rank. Every rank makes every rank's inputs from the case's seed and runs
the naive reference (ep_reference.py) itself. Rank 0 prints one line per
case, "ok <case>" or "FAIL <case>: rank <r>: <what>", then "passed <n> cases
on <N> ranks" and exits 0 only when every rank passed every case."""

from __future__ import annotations

import sys
import traceback
import zlib

# No rank needs torch, and 4 ranks importing it on 2 cores cost seconds:
# None in sys.modules makes `import torch` (cases.py) and find_spec
# (moe_reroute) see no torch.
sys.modules["torch"] = None

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import ep_reference  # noqa: E402
from cases import SCALE_CASES, TOKEN_CASES, byte_rows, pairs  # noqa: E402
from moe_reroute import ep  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
FLOATS = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
# uniform; skewed to one expert; rank 0 with T = 0; the last rank receives nothing
ROUTINGS = ("uniform", "skewed", "rank0-empty", "last-receives-nothing")
VARIANTS = ((1, False), (1, True), (3, False), (2, True))  # (expert_alignment, a capacity)


def rng_for(*labels) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32("/".join(map(str, labels)).encode()))


def routing_ids(rng, routing, tokens, top_k, num_experts, per_rank):
    if routing == "skewed":
        ids = rng.integers(0, num_experts, (tokens, top_k))
        ids[rng.random((tokens, top_k)) < 0.8] = num_experts - 1
        return ids
    high = num_experts - per_rank if routing == "last-receives-nothing" else num_experts
    return rng.integers(0, high, (tokens, top_k))


def make_case(index, token_case, variant):
    """Every rank's arguments of case `index` and its attributes."""
    rng = rng_for("case", SIZE, index)
    paired = [None] + [s for s in SCALE_CASES[1:] if pairs(token_case, s)]
    scale_case = paired[index % len(paired)]
    # float8_e8m0 scales as ml_dtypes' or as uint8 (read as float8_e8m0), in turn.
    scale_dtype = scale_case and scale_case.numpy_dtype
    if scale_case and scale_case.dtype_name == "float8_e8m0" and variant % 2:
        scale_dtype = np.uint8
    routing = ROUTINGS[index % len(ROUTINGS)]
    per_rank = int(rng.integers(1, 4))
    num_experts = per_rank * SIZE
    top_k = int(rng.integers(1, 4))
    alignment, with_capacity = VARIANTS[variant]
    attributes = dict(idx_type=index % 2, expert_token_num_type=(index // 2) % 2,
                      expert_alignment=alignment)
    element_bytes = max(1, token_case.bits // 8)
    hidden = 512 if index % 7 == 0 else 2 * int(rng.integers(1, 9))  # logical elements
    columns = hidden * token_case.bits // 8 // element_bytes
    with_weights = index % 2 == 0 or token_case.label in FLOATS
    idx_dtype = (np.int32, np.int64)[(index // 4) % 2]
    ranks = []
    for rank in range(SIZE):
        tokens = 0 if routing == "rank0-empty" and rank == 0 else int(rng.integers(1, 13))
        if token_case.label in FLOATS:  # finite values: the combine sums them
            x = rng.standard_normal((tokens, columns)).astype(token_case.numpy_dtype)
        else:
            x = rng.integers(0, 256, (tokens, columns * element_bytes), np.uint8).view(
                token_case.numpy_dtype)
        args = dict(x=x, expert_idx=routing_ids(rng, routing, tokens, top_k, num_experts,
                                                per_rank).astype(idx_dtype))
        if scale_case is not None:
            shape = (tokens, *scale_case.trailing)
            args["per_token_scales"] = rng.integers(
                0, 256, (tokens, int(np.prod(shape[1:], dtype=np.int64)) * scale_case.itemsize),
                np.uint8).view(scale_dtype).reshape(shape)
        if with_weights:
            args["expert_scales"] = rng.random((tokens, top_k), np.float32)
        ranks.append(args)
    if with_capacity:  # the most any rank receives, and spare rows
        received = np.bincount(np.concatenate([a["expert_idx"].reshape(-1) // per_rank
                                               for a in ranks]), minlength=SIZE)
        attributes["capacity"] = int(received.max() + rng.integers(0, 4))
    name = (f"{index}:{token_case.label} scales={scale_case.label if scale_case else None}"
            f"{'' if scale_dtype is None else '/' + np.dtype(scale_dtype).name} "
            f"weights={with_weights} idx={idx_dtype.__name__} {routing} E={per_rank} k={top_k} "
            + " ".join(f"{k}={v}" for k, v in attributes.items()))
    return name, ranks, num_experts, attributes, scale_case


def mismatch(what, got, want):
    """None where `got` equals `want` (shape and values), else what differs."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape == want.shape and np.array_equal(got, want):
        return None
    return (f"{what}: got {got.dtype}{got.shape} {got.reshape(-1)[:16]}, "
            f"expected {want.dtype}{want.shape} {want.reshape(-1)[:16]}")


def run_case(index, token_case, variant):
    name, ranks, num_experts, attributes, scale_case = make_case(index, token_case, variant)
    mine = ranks[RANK]

    def failing():
        inputs = [ep_reference.RankInputs(
            byte_rows(a["x"]), a["expert_idx"],
            byte_rows(a["per_token_scales"]) if "per_token_scales" in a else None,
            a.get("expert_scales")) for a in ranks]
        expected = ep_reference.dispatch(inputs, num_experts, **attributes)
        want = expected[RANK]
        got = ep.dispatch(**mine, num_experts=num_experts, group=COMM,
                          tokens_dtype=token_case.tokens_dtype, **attributes)
        valid = want.valid_rows
        scales_dtype = (mine["per_token_scales"].dtype if scale_case is not None
                        else np.dtype(np.float32))
        weight = (byte_rows(got.permute_topk_weight.reshape(-1, 1))[:valid]
                  if "expert_scales" in mine else got.permute_topk_weight)
        # Only the rows the call writes: tail rows are unwritten.
        problems = [
            mismatch("permute_tokens: dtype, rows", (str(got.permute_tokens.dtype),
                                                     len(got.permute_tokens)),
                     (str(mine["x"].dtype), len(want.tokens))),
            mismatch("permute_tokens", byte_rows(got.permute_tokens)[:valid],
                     want.tokens[:valid]),
            mismatch("permute_per_token_scales: dtype", str(got.permute_per_token_scales.dtype),
                     str(scales_dtype)),
            mismatch("permute_per_token_scales", byte_rows(got.permute_per_token_scales)[:valid],
                     want.scales[:valid]),
            mismatch("permute_token_idx", got.permute_token_idx, want.idx.astype(np.int32)),
            mismatch("expert_token_num", got.expert_token_num,
                     want.expert_token_num.astype(np.int32)),
            mismatch("permute_topk_weight", weight, want.weight[:valid] if "expert_scales" in mine
                     else np.zeros(0, np.float32)),
            mismatch("expert_token_num_per_rank", got.expert_token_num_per_rank, want.counts),
        ]

        # combine after identity experts: permute_tokens itself where it is a
        # float, else a float32 expert_out of each rank's from the case's seed.
        # Every rank calls it whatever it found above: it is collective.
        if token_case.label in FLOATS:
            outs = [e.tokens.view(token_case.numpy_dtype) for e in expected]
            expert_out = got.permute_tokens
        else:
            outs = [rng_for("expert_out", SIZE, index, r).standard_normal(
                (len(e.tokens), 6)).astype(np.float32) for r, e in enumerate(expected)]
            expert_out = outs[RANK]
        combined = ep.combine(expert_out, got.handle)
        want_out = ep_reference.combine(outs, inputs, expected)[RANK]
        problems += [mismatch("combine: dtype", str(combined.dtype), str(want_out.dtype)),
                     mismatch("combine", byte_rows(combined), byte_rows(want_out))]
        return "; ".join(p for p in problems if p) or None

    return name, failing


def refusal(name, raises, bad_rank_message, bad_ranks, call):
    """A bad call: every rank raises `raises`, the ranks in `bad_ranks` (all:
    None) with a message starting `bad_rank_message`, the others naming the
    lowest bad rank."""
    def failing():
        try:
            call()
        except Exception as error:  # noqa: BLE001: what it is, is the check
            bad = bad_ranks is None or RANK in bad_ranks
            want = (bad_rank_message if bad else
                    f"{name.split(':')[0]}: rank {min(bad_ranks)} refused its arguments")
            if type(error) is not raises or not str(error).startswith(want):
                return f"raised {type(error).__name__}: {error}; expected {raises.__name__}: {want}"
            return None
        return f"returned; expected {raises.__name__}"
    return name, failing


def refusals():
    """Bad input on one rank and on all ranks, for dispatch and combine."""
    rng = rng_for("refusals", SIZE, RANK)
    tokens, per_rank, top_k = 5, 2, 2
    num_experts = per_rank * SIZE
    x = rng.standard_normal((tokens, 8)).astype(np.float32)
    # Every rank sends to every rank: with capacity 0, every rank overflows.
    ids = ((np.arange(tokens * top_k) + RANK) % num_experts).astype(np.int32).reshape(tokens, top_k)
    weights = rng.random((tokens, top_k), np.float32)
    last = SIZE - 1

    def dispatch(**changes):
        args = dict(x=x, expert_idx=ids, num_experts=num_experts, group=COMM,
                    expert_scales=weights) | changes
        return ep.dispatch(**args)

    def on(ranks, bad, good):
        return bad if RANK in ranks else good

    def combine_on(ranks, bad):
        result = dispatch()
        return ep.combine(on(ranks, bad, result.permute_tokens), result.handle)

    def still_in_step():
        result = dispatch()
        out = ep.combine(result.permute_tokens, result.handle)
        return None if out.shape == x.shape else f"combine: shape {out.shape}"

    wide = np.zeros((tokens, 9), np.float32)
    return [
        refusal("dispatch: expert id out of range on the last rank", ValueError, "expert_idx: ",
                {last}, lambda: dispatch(expert_idx=on({last}, ids + num_experts, ids))),
        refusal("dispatch: expert_scales' shape on rank 0", ValueError, "expert_scales: ", {0},
                lambda: dispatch(expert_scales=on({0}, weights[:, :1], weights))),
        refusal("dispatch: x float64 on rank 1", TypeError, "x: dtype float64", {1},
                lambda: dispatch(x=on({1}, x.astype(np.float64), x))),
        refusal("dispatch: expert_idx a list on the last rank", TypeError, "expert_idx: ",
                {last}, lambda: dispatch(expert_idx=on({last}, ids.tolist(), ids))),
        refusal("dispatch: num_experts a str on rank 0", TypeError, "num_experts: ", {0},
                lambda: dispatch(num_experts=on({0}, "4", num_experts))),
        refusal("dispatch: 1-D x on every rank", ValueError, "x: ", None,
                lambda: dispatch(x=x[:, 0])),
        refusal("dispatch: num_experts not a multiple of the ranks", ValueError,
                "num_experts: ", None, lambda: dispatch(num_experts=num_experts + 1)),
        refusal("dispatch: H differs on the last rank", ValueError, "x: H differs across ranks",
                None, lambda: dispatch(x=on({last}, wide[:, :8 + 1], x))),
        refusal("dispatch: capacity 0", ValueError, f"capacity: rank {RANK} receives", None,
                lambda: dispatch(capacity=0)),
        refusal("combine: expert_out int32 on rank 1", TypeError, "expert_out: ", {1},
                lambda: combine_on({1}, np.zeros((0, 4), np.int32))),
        refusal("combine: expert_out a list on rank 0", TypeError, "expert_out: ", {0},
                lambda: combine_on({0}, [[1.0]])),
        refusal("combine: expert_out's rows on every rank", ValueError, "expert_out: ", None,
                lambda: combine_on(range(SIZE), np.zeros((1000, 4), np.float32))),
        ("dispatch and combine after the refusals", still_in_step),
    ]


def main() -> int:
    cases = []
    index = 0
    for variant in range(len(VARIANTS)):
        for token_case in TOKEN_CASES:
            if token_case.numpy_dtype is not None:
                cases.append(run_case(index, token_case, variant))
                index += 1
    cases += refusals()
    failures = {}
    for name, failing in cases:
        try:
            failure = failing()
        except Exception:  # noqa: BLE001: reported by name, after every case ran
            failure = traceback.format_exc(limit=-2).replace("\n", " | ")
        if failure:
            failures[name] = failure
        # A rank that fell out of step (it skipped a collective) hangs here,
        # which the test's timeout turns into a failure.
        COMM.Barrier()
    everything = COMM.gather(failures, root=0)
    if RANK != 0:
        return 0
    failed = 0
    for name, _ in cases:
        bad = [f"rank {r}: {f[name]}" for r, f in enumerate(everything) if name in f]
        failed += bool(bad)
        print(f"FAIL {name}: {'; '.join(bad)}" if bad else f"ok {name}", flush=True)
    if failed:
        print(f"failed {failed} of {len(cases)} cases on {SIZE} ranks", flush=True)
        return 1
    print(f"passed {len(cases)} cases on {SIZE} ranks", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
