"""Peer benchmark of the Python entry points: moe_reroute (allocating and out=)
beside torch.index_select by a precomputed index, Megatron-Core's unfused
split/cat path, NumPy fancy indexing, and the copy limit (clone, copy_) of the
same tensors, for decode (A = 256) and prefill (A = 16384), H = 7168 int8
tokens, 16 x 16 counts, float32 scales and weights, then the per-call cost
of one-token calls. Prints medians and ratios, and the load average: on a
machine whose cores other jobs share, a parallel region waits for a preempted
thread, so run there with OMP_NUM_THREADS=1 (torch and the core alike).

    python bench/peers.py [--repeats N] [--hidden H] [--only decode|prefill|overhead]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

import moe_reroute

NUM_RANKS = NUM_EXPERTS = 16


def workload(num_tokens, hidden, seed=0):
    rng = np.random.default_rng(seed)
    cells = rng.multinomial(num_tokens, rng.dirichlet(np.ones(NUM_RANKS * NUM_EXPERTS)))
    counts = torch.from_numpy(cells.reshape(NUM_RANKS, NUM_EXPERTS).astype(np.int32))
    tokens = torch.randint(-128, 128, (num_tokens, hidden), dtype=torch.int8)
    scales = torch.rand(num_tokens)
    weight = torch.rand(num_tokens, 1)
    return tokens, counts, scales, weight


def megatron_unfused(tokens, counts, scales, weight):
    """Megatron-Core's unfused sort_chunks_by_idxs: split by the counts in
    (rank, expert) order, concatenate in (expert, rank) order."""
    split = counts.flatten().tolist()
    order = [r * NUM_EXPERTS + e for e in range(NUM_EXPERTS) for r in range(NUM_RANKS)]
    return tuple(torch.cat([chunks[i] for i in order])
                 for chunks in (torch.split(t, split) for t in (tokens, scales, weight)))


def medians_us(fns, repeats):
    """name -> median microseconds of fns[name](), the contenders interleaved
    call by call so that a change in the machine's load hits all of them."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    clock = time.perf_counter_ns
    for _ in range(repeats):
        for name, fn in fns.items():
            start = clock()
            fn()
            times[name].append(clock() - start)
    return {name: statistics.median(t) / 1e3 for name, t in times.items()}


def methods(tokens, counts, scales, weight):
    """name -> (callable, result to check against the operator or None)."""
    kwargs = dict(per_token_scales=scales, expert_topk_weight=weight)
    reference = moe_reroute.moe_re_routing(tokens, counts, **kwargs)
    out = [torch.empty_like(t) for t in reference]
    index = reference[2].long()
    np_tokens, np_scales, np_weight, np_index = (t.numpy() for t in (tokens, scales, weight,
                                                                     index))
    copies = [torch.empty_like(t) for t in (tokens, scales, weight)]

    def copy_into():
        for dst, src in zip(copies, (tokens, scales, weight)):
            dst.copy_(src)

    def op_out():
        return moe_reroute.moe_re_routing(tokens, counts, **kwargs, out=out)

    return {
        "moe_reroute": (lambda: moe_reroute.moe_re_routing(tokens, counts, **kwargs),
                        lambda r: (r[0], r[1], r[4])),
        "moe_reroute out=": (op_out, lambda r: (r[0], r[1], r[4])),
        "torch.index_select": (lambda: tuple(torch.index_select(t, 0, index)
                                             for t in (tokens, scales, weight)), None),
        "megatron split+cat": (lambda: megatron_unfused(tokens, counts, scales, weight), None),
        "numpy fancy index": (lambda: (np_tokens[np_index], np_scales[np_index],
                                       np_weight[np_index]), None),
        "clone (copy limit)": (lambda: tuple(t.clone() for t in (tokens, scales, weight)), None),
        "copy_ (same bytes)": (copy_into, None),
    }, (reference[0], reference[1], reference[4])


def check(name, result, pick, expected):
    tensors = pick(result) if pick else result
    for got, want in zip(tensors, expected):
        got = torch.from_numpy(got) if isinstance(got, np.ndarray) else got
        if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
            raise SystemExit(f"{name}: result differs from moe_reroute")


def run(label, num_tokens, hidden, repeats):
    inputs = workload(num_tokens, hidden)
    table, expected = methods(*inputs)
    for name, (fn, pick) in table.items():
        if name.startswith("clone") or name.startswith("copy_"):
            continue
        check(name, fn(), pick, expected)
    times = medians_us({name: fn for name, (fn, _) in table.items()}, repeats)
    megabytes = sum(t.numel() * t.element_size() for t in (inputs[0], inputs[2], inputs[3])) / 1e6
    print(f"\n{label}: A={num_tokens} H={hidden} int8, counts {NUM_RANKS}x{NUM_EXPERTS}, "
          f"{megabytes:.1f} MB moved, median of {repeats}, "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"| {'method':<22} | {'median us':>10} | {'x clone':>8} | {'x copy_':>8} "
          f"| {'x index_select':>14} |")
    print(f"|{'-' * 24}|{'-' * 12}|{'-' * 10}|{'-' * 10}|{'-' * 16}|")
    for name, us in times.items():
        print(f"| {name:<22} | {us:>10.1f} | {us / times['clone (copy limit)']:>8.2f} "
              f"| {us / times['copy_ (same bytes)']:>8.2f} "
              f"| {us / times['torch.index_select']:>14.2f} |")


def overhead(repeats):
    """Per-call cost on one token (A = 1, H = 8): Python, dispatch, allocation
    and the core's fixed cost, beside torch's own per-call costs and a pure
    Python loop that says how fast this machine runs Python."""
    tokens, counts, scales, weight = workload(1, 8)
    kwargs = dict(per_token_scales=scales, expert_topk_weight=weight)
    out = moe_reroute.moe_re_routing(tokens, counts, **kwargs)
    index = out[2].long()
    np_args = [t.numpy() for t in (tokens, counts)]
    np_kwargs = {k: v.numpy() for k, v in kwargs.items()}
    rows = {
        "moe_reroute (torch)": lambda: moe_reroute.moe_re_routing(tokens, counts, **kwargs),
        "moe_reroute out= (torch)": lambda: moe_reroute.moe_re_routing(tokens, counts, **kwargs,
                                                                       out=out),
        "inverse (torch)": lambda: moe_reroute.moe_re_routing_inverse(out[0], counts, **kwargs),
        "moe_reroute (numpy)": lambda: moe_reroute.moe_re_routing(*np_args, **np_kwargs),
        "5 x torch.empty_like": lambda: [torch.empty_like(t) for t in out],
        "3 x torch.index_select": lambda: [torch.index_select(t, 0, index)
                                           for t in (tokens, scales, weight)],
        "python sum(range(100))": lambda: sum(range(100)),
    }
    times = medians_us(rows, repeats)
    print(f"\nper-call overhead: A=1 H=8 int8, counts {NUM_RANKS}x{NUM_EXPERTS}, "
          f"median of {repeats}, load average {os.getloadavg()[0]:.2f}")
    print(f"| {'call':<26} | {'median us':>10} |")
    print(f"|{'-' * 28}|{'-' * 12}|")
    for name, us in times.items():
        print(f"| {name:<26} | {us:>10.1f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--only", choices=("decode", "prefill", "overhead"))
    args = parser.parse_args()
    print(f"moe_reroute {moe_reroute.__version__}, torch {torch.__version__}, "
          f"torch threads {torch.get_num_threads()}, "
          f"core threads {moe_reroute._core.hardware_threads()}")
    if args.only in (None, "decode"):
        run("decode", 256, args.hidden, max(args.repeats, 500))
    if args.only in (None, "prefill"):
        run("prefill", 16384, args.hidden, args.repeats)
    if args.only in (None, "overhead"):
        overhead(max(args.repeats, 5000))


if __name__ == "__main__":
    main()
