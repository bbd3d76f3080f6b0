"""The Python peer benchmark: moe_reroute's torch operator (and its NumPy
entry) beside torch.index_select by a precomputed index, Megatron-Core's
unfused split/cat path, NumPy fancy indexing and torch clone (the copy limit
of the same bytes), all in one process, contenders interleaved call by call
(block by block in the loops table).

- overhead: A = 1 (bf16 H = 7168), per-call cost against one index_select of
  the tokens, plain, under torch.inference_mode and with tokens that require
  grad (both record a graph node), and the NumPy call beside NumPy fancy
  indexing (bf16 as uint16 storage named by tokens_dtype); index_select
  called through torch.ops too (torch.ops.aten.index_select.default), which
  shows what torch.ops' Python layer costs any operator;
- decode: A = 256 bf16 H = 7168, float32 scales [A] and weights [A, 1],
  against index_select of the tokens alone (and the NumPy call beside fancy
  indexing of the tokens);
- loops: decode again, in blocks of back-to-back calls of one contender
  (the public function and the ops with fresh outputs and with out=,
  index_select with and without out=), as a caller looping over one operator
  sees it;
- cold: the loops table's contenders interleaved, each call after a read of
  256 MiB that empties the caches, as a model's decode step sees it between
  layers;
- prefill: A = 16384 int8 H = 7168 with scales and weights, against clone of
  the same three tensors (fresh outputs every call, as in a model);
- vmap: torch.vmap over 256 entries that share their counts (A = 64 float32,
  H = 16) and torch.func.jacrev of permute_tokens, against the same of
  index_select, and a loop of calls stacked;
- routing: moe_init_routing against index_select of the same rows (its
  index made once, and with the stable sort of the ids first), and
  moe_finalize_routing (drop_pad_mode 2, float32 scales) against torch's
  composition (index_select, multiply, sum over k) and against clone of as
  many bytes as it reads and writes; bf16, k = 8 of 256 experts, at prefill
  (T = 4096) and decode (T = 32) sizes, each verified first (finalize bit for
  bit against the sum over k one float32 step at a time).

Each table is printed for torch's default allocator settings, then again in a
child process with THP_MEM_ALLOC_ENABLE=1 (--allocator picks one). Prints
medians, the ratios, each row's slowest timed call and its first call over
its median (outliers; WARMUP_CALLS untimed calls come first), and at prefill
one call of the operator and of clone after a few seconds idle.

--processes N runs the tables in N fresh processes per allocator, then prints
each row's ratio to its table's baseline in every process and their median:
where the tensors and outputs lie in memory differs from process to process,
and at decode that moves a ratio by more than anything left in the call does
(docs/benchmarks.md).

--hidden H sets the H of every table but vmap (default 7168): --hidden 8
leaves the bytes out, so that the decode tables show each call's fixed cost
at decode's counts.

    python bench/peers.py [--repeats N] [--only overhead|decode|loops|cold|prefill|vmap|routing]
                          [--allocator default|thp|both] [--processes N] [--hidden H]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import ml_dtypes
import numpy as np
import torch

import moe_reroute

NUM_RANKS = NUM_EXPERTS = 16
HIDDEN = 7168
OPS = torch.ops.moe_reroute
ATEN_INDEX_SELECT = torch.ops.aten.index_select.default


def workload(num_tokens, dtype, seed=0):
    rng = np.random.default_rng(seed)
    cells = rng.multinomial(num_tokens, rng.dirichlet(np.ones(NUM_RANKS * NUM_EXPERTS)))
    counts = torch.from_numpy(cells.reshape(NUM_RANKS, NUM_EXPERTS).astype(np.int32))
    if dtype == torch.int8:
        tokens = torch.randint(-128, 128, (num_tokens, HIDDEN), dtype=torch.int8)
    else:
        tokens = torch.randn(num_tokens, HIDDEN).to(dtype)
    return tokens, counts, torch.rand(num_tokens), torch.rand(num_tokens, 1)


def megatron_unfused(tokens, counts, scales, weight):
    """Megatron-Core's unfused sort_chunks_by_idxs: split by the counts in
    (rank, expert) order, concatenate in (expert, rank) order."""
    split = counts.flatten().tolist()
    order = [r * NUM_EXPERTS + e for e in range(NUM_EXPERTS) for r in range(NUM_RANKS)]
    return tuple(torch.cat([chunks[i] for i in order])
                 for chunks in (torch.split(t, split) for t in (tokens, scales, weight)))


WARMUP_CALLS = 4


def summary_us(fns, timed_ns):
    """name -> (median, slowest, first) microseconds per call: one first call
    of each of `fns`, timed alone, then `timed_ns(clock)`, which returns
    name -> the nanoseconds per call it timed."""
    clock = time.perf_counter_ns
    first = {}
    for name, fn in fns.items():
        start = clock()
        fn()
        first[name] = clock() - start
    return {name: (statistics.median(t) / 1e3, max(t) / 1e3, first[name] / 1e3)
            for name, t in timed_ns(clock).items()}


def timings_us(fns, repeats, before_each=lambda: None):
    """name -> (median, slowest, first) microseconds of fns[name](): the
    contenders interleaved call by call so that a change in load hits all of
    them, timed after WARMUP_CALLS calls each, the first of which is reported;
    `before_each()` runs, untimed, before each timed call."""
    def interleaved(clock):
        for _ in range(WARMUP_CALLS - 1):
            for fn in fns.values():
                fn()
        times = {name: [] for name in fns}
        order = list(fns.items())
        for round_ in range(repeats):
            # A rotating order: no contender always follows the same one (whose
            # frees decide where the allocator puts the next outputs).
            shift = round_ % len(order)
            for name, fn in order[shift:] + order[:shift]:
                before_each()
                start = clock()
                fn()
                times[name].append(clock() - start)
        return times
    return summary_us(fns, interleaved)


def block_timings_us(fns, blocks, calls):
    """name -> (median, slowest, first) microseconds per call of fns[name]()
    in `blocks` blocks of `calls` back-to-back calls, the contenders' blocks
    alternating: what a caller looping over one operator sees, each call
    reusing the memory its predecessor freed. Slowest is the slowest block;
    first the first call. Each block follows WARMUP_CALLS untimed calls."""
    def in_blocks(clock):
        per_call = {name: [] for name in fns}
        for _ in range(blocks):
            for name, fn in fns.items():
                for _ in range(WARMUP_CALLS):
                    fn()
                start = clock()
                for _ in range(calls):
                    fn()
                per_call[name].append((clock() - start) / calls)
        return per_call
    return summary_us(fns, in_blocks)


def check(name, got, want):
    for g, w in zip(got, want):
        g = torch.from_numpy(g) if isinstance(g, np.ndarray) else g
        if not torch.equal(g.view(torch.uint8), w.view(torch.uint8)):
            raise SystemExit(f"{name}: result differs from index_select by the gather index")


def poisoned_like(tensors):
    """Outputs for out= calls, each like one of `tensors` with every byte 0xA5:
    a byte the call leaves unwritten fails check."""
    outputs = [torch.empty_like(t) for t in tensors]
    for output in outputs:
        output.view(torch.uint8).fill_(0xA5)
    return outputs


# Where print_table also appends each row's ratio (JSON lines), for --processes.
RECORD = None


def print_table(title, times, baseline):
    print(f"\n{title}")
    print(f"| {'method':<52} | {'median us':>10} | {'x ' + baseline:>22} | {'slowest/median':>14} "
          f"| {'first call/median':>17} |")
    print(f"|{'-' * 54}|{'-' * 12}|{'-' * 24}|{'-' * 16}|{'-' * 19}|")
    base = times[baseline][0]
    for name, (median, slowest, first) in times.items():
        print(f"| {name:<52} | {median:>10.1f} | {median / base:>22.2f} | "
              f"{slowest / median:>14.1f} | {first / median:>17.1f} |")
    if RECORD:
        allocator = "THP" if os.environ.get("THP_MEM_ALLOC_ENABLE") == "1" else "default"
        with open(RECORD, "a") as record:
            for name, (median, _, _) in times.items():
                record.write(json.dumps({"allocator": allocator, "table": title.split(":")[0],
                                         "method": name, "ratio": median / base}) + "\n")


def numpy_of(tokens, counts):
    """The bf16 tokens as NumPy uint16 storage (named by tokens_dtype) and the counts."""
    return tokens.view(torch.uint16).numpy(), counts.numpy()


def overhead(repeats):
    tokens, counts, _, _ = workload(1, torch.bfloat16)
    index = OPS.moe_re_routing(tokens, counts)[2].long()
    check("overhead", OPS.moe_re_routing(tokens, counts)[:1], [torch.index_select(tokens, 0, index)])
    np_tokens, np_counts = numpy_of(tokens, counts)
    np_index = index.numpy()
    check("overhead (numpy)",
          moe_reroute.moe_re_routing(np_tokens, np_counts, tokens_dtype="bfloat16")[:1],
          [torch.index_select(tokens, 0, index).view(torch.uint16)])
    forward = OPS.moe_re_routing.default
    rows = {
        "torch.index_select": lambda: torch.index_select(tokens, 0, index),
        "torch.ops.aten.index_select.default": lambda: ATEN_INDEX_SELECT(tokens, 0, index),
        "torch.ops.moe_reroute.moe_re_routing": lambda: forward(tokens, counts),
        "moe_reroute.moe_re_routing": lambda: moe_reroute.moe_re_routing(tokens, counts),
    }
    numpy_rows = {
        "numpy fancy index": lambda: np_tokens[np_index],
        "moe_reroute.moe_re_routing (numpy)": lambda: moe_reroute.moe_re_routing(
            np_tokens, np_counts, tokens_dtype="bfloat16"),
    }
    # With tokens that require grad, each call also records its graph node.
    tracked = tokens.detach().requires_grad_()
    grad_rows = {
        "torch.index_select (requires grad)": lambda: torch.index_select(tracked, 0, index),
        "torch.ops.moe_reroute.moe_re_routing (requires grad)": lambda: forward(tracked, counts),
    }
    times = timings_us(rows | grad_rows | numpy_rows, repeats)
    with torch.inference_mode():
        inference = timings_us(rows, repeats)
    times |= {f"{name} (inference_mode)": t for name, t in inference.items()}
    print_table(f"overhead: A=1 bf16 H={HIDDEN}, counts {NUM_RANKS}x{NUM_EXPERTS}, "
                f"median of {repeats}", times, "torch.index_select")


def checked_workload(num_tokens, dtype):
    """The inputs, the keyword arguments with scales and weights, the op's
    gather index, and the op's result, checked against index_select by it."""
    tokens, counts, scales, weight = workload(num_tokens, dtype)
    kwargs = dict(per_token_scales=scales, expert_topk_weight=weight)
    result = moe_reroute.moe_re_routing(tokens, counts, **kwargs)
    index = result[2].long()
    check("moe_reroute", (result[0], result[1], result[4]),
          [torch.index_select(t, 0, index) for t in (tokens, scales, weight)])
    return tokens, counts, scales, weight, kwargs, index, result


def decode(repeats):
    tokens, counts, scales, weight, kwargs, index, result = checked_workload(256, torch.bfloat16)
    out = poisoned_like(result)
    moe_reroute.moe_re_routing(tokens, counts, **kwargs, out=out)
    check("decode (out=)", out, result)
    np_tokens, np_counts = numpy_of(tokens, counts)
    np_kwargs = dict(per_token_scales=scales.numpy(), expert_topk_weight=weight.numpy(),
                     tokens_dtype="bfloat16")
    np_index = index.numpy()
    check("decode (numpy)", moe_reroute.moe_re_routing(np_tokens, np_counts, **np_kwargs)[:1],
          [torch.index_select(tokens, 0, index).view(torch.uint16)])
    times = timings_us({
        "torch.index_select (tokens)": lambda: torch.index_select(tokens, 0, index),
        "torch.ops.aten.index_select.default": lambda: ATEN_INDEX_SELECT(tokens, 0, index),
        "moe_reroute (tokens, scales, weight)": lambda: moe_reroute.moe_re_routing(
            tokens, counts, **kwargs),
        "moe_reroute out=": lambda: moe_reroute.moe_re_routing(tokens, counts, **kwargs, out=out),
        "3 x torch.index_select": lambda: [torch.index_select(t, 0, index)
                                           for t in (tokens, scales, weight)],
        "megatron split+cat": lambda: megatron_unfused(tokens, counts, scales, weight),
        "clone (tokens)": lambda: tokens.clone(),
        "numpy fancy index (tokens)": lambda: np_tokens[np_index],
        "moe_reroute (numpy)": lambda: moe_reroute.moe_re_routing(np_tokens, np_counts,
                                                                  **np_kwargs),
    }, repeats)
    print_table(f"decode: A=256 bf16 H={HIDDEN}, f32 scales [A], weights [A,1], "
                f"median of {repeats}", times, "torch.index_select (tokens)")


def decode_contenders():
    """The loops and cold tables' contenders, each checked: the public
    function and each op at its torch.ops overload, fresh outputs and out=
    beside index_select's."""
    tokens, counts, scales, weight, kwargs, index, result = checked_workload(256, torch.bfloat16)
    out = poisoned_like(result)
    (selected,) = poisoned_like([tokens])
    forward, forward_out = OPS.moe_re_routing.default, OPS.moe_re_routing_out.default
    fns = {
        "torch.index_select (tokens)": lambda: torch.index_select(tokens, 0, index),
        "torch.index_select (tokens) out=": lambda: torch.index_select(tokens, 0, index,
                                                                       out=selected),
        "moe_reroute.moe_re_routing": lambda: moe_reroute.moe_re_routing(tokens, counts,
                                                                          **kwargs),
        "moe_reroute.moe_re_routing out=": lambda: moe_reroute.moe_re_routing(
            tokens, counts, **kwargs, out=out),
        "torch.ops.moe_reroute.moe_re_routing": lambda: forward(tokens, counts, scales, weight),
        "torch.ops.moe_reroute.moe_re_routing_out": lambda: forward_out(tokens, counts, *out,
                                                                        scales, weight),
    }
    for fn in fns.values():
        fn()
    check("decode contenders (out=)", (selected, out[0], out[1], out[4], out[2], out[3]),
          [torch.index_select(t, 0, index) for t in (tokens, tokens, scales, weight)]
          + [result[2], result[3]])
    return fns


def decode_loops(blocks=7, calls=300):
    """Decode in own loops (block_timings_us)."""
    times = block_timings_us(decode_contenders(), blocks, calls)
    print_table(f"loops: A=256 bf16 H={HIDDEN}, f32 scales [A], weights [A,1], median of "
                f"{blocks} blocks of {calls} calls (slowest: the slowest block)", times,
                "torch.index_select (tokens)")


def decode_cold(repeats, flush_mib=256):
    """Decode with the caches emptied before each call by a read of
    `flush_mib` MiB (not timed; read, so that nothing dirty is written back
    during the call), as between a model's layers, whose weights stream
    through the caches: neither the calls before nor where the outputs lie
    against the tokens decides it."""
    scratch = torch.ones(flush_mib << 20, dtype=torch.uint8)
    times = timings_us(decode_contenders(), repeats, before_each=scratch.max)
    print_table(f"cold: A=256 bf16 H={HIDDEN}, f32 scales [A], weights [A,1], caches emptied "
                f"(a read of {flush_mib} MiB) before each call, median of {repeats}", times,
                "torch.index_select (tokens)")


def prefill(repeats):
    tokens, counts, scales, weight, kwargs, index, result = checked_workload(16384, torch.int8)
    arrays = [t.numpy() for t in (tokens, counts, scales, weight)]
    np_index = index.numpy()
    del result
    contenders = {
        "clone (tokens, scales, weight)": lambda: [t.clone() for t in (tokens, scales, weight)],
        "moe_reroute (torch)": lambda: moe_reroute.moe_re_routing(tokens, counts, **kwargs),
        "moe_reroute (numpy)": lambda: moe_reroute.moe_re_routing(
            arrays[0], arrays[1], per_token_scales=arrays[2], expert_topk_weight=arrays[3]),
        "3 x torch.index_select": lambda: [torch.index_select(t, 0, index)
                                           for t in (tokens, scales, weight)],
        "numpy fancy index": lambda: [a[np_index] for a in (arrays[0], arrays[2], arrays[3])],
        "megatron split+cat": lambda: megatron_unfused(tokens, counts, scales, weight),
    }
    times = timings_us(contenders, repeats)
    print_table(f"prefill: A=16384 int8 H={HIDDEN}, f32 scales [A], weights [A,1], "
                f"median of {repeats}", times, "clone (tokens, scales, weight)")
    idle_calls_after_pause(times, {name: contenders[name] for name in (
        "moe_reroute (torch)", "clone (tokens, scales, weight)")})


def vmap_table(repeats):
    counts = torch.from_numpy(np.full((4, 4), 4, np.int32))
    batch = torch.randn(256, 64, 16)
    index = moe_reroute.moe_re_routing(batch[0], counts)[2].long()
    fns = {
        "torch.vmap(torch.index_select)": lambda: torch.vmap(
            lambda t: torch.index_select(t, 0, index))(batch),
        "torch.vmap(moe_reroute.moe_re_routing)": lambda: torch.vmap(
            lambda t: moe_reroute.moe_re_routing(t, counts)[0])(batch),
        "moe_re_routing per entry, stacked": lambda: torch.stack(
            [moe_reroute.moe_re_routing(t, counts)[0] for t in batch]),
        "torch.func.jacrev(torch.index_select)": lambda: torch.func.jacrev(
            lambda t: torch.index_select(t, 0, index))(batch[0]),
        "torch.func.jacrev(moe_reroute.moe_re_routing)": lambda: torch.func.jacrev(
            lambda t: moe_reroute.moe_re_routing(t, counts)[0])(batch[0]),
    }
    check("vmap", [fns["torch.vmap(moe_reroute.moe_re_routing)"](),
                   fns["torch.func.jacrev(moe_reroute.moe_re_routing)"]()],
          [fns["torch.vmap(torch.index_select)"](),
           fns["torch.func.jacrev(torch.index_select)"]()])
    print_table(f"vmap: 256 entries of A=64 float32 H=16, counts 4x4 shared; jacrev of one entry, "
                f"median of {repeats}", timings_us(fns, repeats),
                "torch.vmap(torch.index_select)")


def routing_tables(repeats, num_tokens, name):
    k, experts = 8, 256
    generator = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=generator).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, generator=generator)[:k]
                       for _ in range(num_tokens)]).to(torch.int32)
    init = dict(expert_num=experts, expert_tokens_count_or_cumsum_flag=2)
    expanded, row_idx, counts, _ = moe_reroute.moe_init_routing(x, ids, **init)
    order = torch.sort(ids.flatten(), stable=True).indices
    source = order // k
    check(f"{name} init", [expanded], [x.index_select(0, source)])
    if not (torch.equal(row_idx[order], torch.arange(num_tokens * k, dtype=torch.int32))
            and torch.equal(counts, torch.bincount(ids.flatten(), minlength=experts).int())):
        raise SystemExit(f"{name} init: expanded_row_idx or the counts differ from the sort's")
    x_numpy = x.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    times = timings_us({
        "index_select of the same rows": lambda: x.index_select(0, source),
        "stable sort of the ids + index_select": lambda: x.index_select(
            0, torch.sort(ids.flatten(), stable=True).indices // k),
        "moe_init_routing (torch)": lambda: moe_reroute.moe_init_routing(x, ids, **init),
        "moe_init_routing (numpy)": lambda: moe_reroute.moe_init_routing(
            x_numpy, ids.numpy(), **init),
    }, repeats)
    print_table(f"init_{name}: T={num_tokens} bf16 H={HIDDEN}, top-{k} of {experts}, median of "
                f"{repeats}", times, "index_select of the same rows")

    scales = torch.rand(num_tokens, k, generator=generator)
    finalize = dict(scales=scales, drop_pad_mode=2)
    out = moe_reroute.moe_finalize_routing(expanded, row_idx, **finalize)
    rows = expanded.index_select(0, row_idx.long()).view(num_tokens, k, HIDDEN).float()
    want = torch.zeros(num_tokens, HIDDEN)
    for j in range(k):  # the contract's order, each float32 step rounded
        want = want + rows[:, j] * scales[:, j:j + 1]
    if not torch.equal(out.view(torch.uint16), want.to(torch.bfloat16).view(torch.uint16)):
        raise SystemExit(f"{name} finalize: result differs from the float32 sum over k")
    # As many bytes as finalize reads (k rows a token) and writes (one), read and written.
    same_bytes = torch.empty((num_tokens * (k + 1) * HIDDEN) // 2, dtype=torch.bfloat16)
    long_idx = row_idx.long()
    times = timings_us({
        "clone of as many bytes": same_bytes.clone,
        "torch index_select, multiply, sum over k": lambda: (
            expanded.index_select(0, long_idx).view(num_tokens, k, HIDDEN).float()
            * scales.unsqueeze(-1)).sum(1).to(torch.bfloat16),
        "moe_finalize_routing (torch)": lambda: moe_reroute.moe_finalize_routing(
            expanded, row_idx, **finalize),
    }, repeats)
    print_table(f"finalize_{name}: T={num_tokens} k={k} bf16 H={HIDDEN}, float32 scales, "
                f"median of {repeats}", times, "clone of as many bytes")


def routing(repeats):
    routing_tables(repeats, 4096, "prefill")
    routing_tables(max(repeats, 200), 32, "decode")


def idle_calls_after_pause(times, fns, pause_s=3.0):
    """One call of each of `fns` after `pause_s` seconds idle, over its median:
    in a VM whose kernel reports free memory to the hypervisor (free page
    reporting), the freed output pages are handed back and fault in the host
    on their next touch."""
    report = pathlib.Path("/sys/module/page_reporting/parameters/page_reporting_order")
    order = report.read_text().strip() if report.exists() else None
    print(f"\nafter {pause_s:.0f} s idle (kernel page_reporting_order: "
          f"{order if order else 'none, no free page reporting'}):")
    for name, fn in fns.items():
        time.sleep(pause_s)
        start = time.perf_counter_ns()
        fn()
        elapsed = (time.perf_counter_ns() - start) / 1e3
        print(f"  {name}: {elapsed / 1e3:.1f} ms, {elapsed / times[name][0]:.1f}x its median")


def cpu_model():
    """The processor's name (/proc/cpuinfo): one VM image runs on several hosts."""
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or platform.machine()


def across_processes(args):
    """Runs the tables in args.processes fresh processes per allocator, then
    prints each row's ratio in every process and their median."""
    allocators = ("default", "thp") if args.allocator == "both" else (args.allocator,)
    with tempfile.TemporaryDirectory() as directory:
        record = pathlib.Path(directory) / "ratios.jsonl"
        for allocator in allocators:
            for _ in range(args.processes):
                argv = [sys.executable, __file__, "--repeats", str(args.repeats),
                        "--hidden", str(args.hidden), "--allocator", allocator,
                        "--record", str(record)]
                sys.stdout.flush()
                if subprocess.call(argv + (["--only", args.only] if args.only else [])) != 0:
                    raise SystemExit("a benchmark process failed")
        rows = [json.loads(line) for line in record.read_text().splitlines()]
    ratios = {}
    for row in rows:
        ratios.setdefault((row["allocator"], row["table"], row["method"]), []).append(row["ratio"])
    width = max(len("per process"), 5 * args.processes - 1)
    print(f"\n## ratio to each table's baseline in {args.processes} processes, and their median")
    print(f"| {'allocator':<9} | {'table':<8} | {'method':<52} | {'per process':<{width}} "
          f"| median |")
    print(f"|{'-' * 11}|{'-' * 10}|{'-' * 54}|{'-' * (width + 2)}|--------|")
    for (allocator, table, method), values in ratios.items():
        each = " ".join(f"{value:.2f}" for value in values)
        print(f"| {allocator:<9} | {table:<8} | {method:<52} | {each:<{width}} | "
              f"{statistics.median(values):>6.2f} |")


def main():
    global HIDDEN, RECORD
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--only",
                        choices=("overhead", "decode", "loops", "cold", "prefill", "vmap",
                                 "routing"))
    parser.add_argument("--allocator", choices=("default", "thp", "both"), default="both")
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--record", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.processes < 1:
        parser.error("--processes: must be >= 1")
    if args.hidden < 1:
        parser.error("--hidden: must be >= 1")
    if args.processes > 1:
        across_processes(args)
        return
    HIDDEN, RECORD = args.hidden, args.record
    thp = os.environ.get("THP_MEM_ALLOC_ENABLE") == "1"
    if args.allocator == "thp" and not thp:
        env = os.environ | {"THP_MEM_ALLOC_ENABLE": "1"}
        raise SystemExit(subprocess.call([sys.executable, *sys.argv], env=env))
    print(f"\n## allocator: {'THP_MEM_ALLOC_ENABLE=1' if thp else 'torch default'} "
          f"(moe_reroute {moe_reroute.__version__}, torch {torch.__version__}, "
          f"{cpu_model()}, {os.cpu_count()} CPUs, torch threads "
          f"{torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f})")
    if args.only in (None, "overhead"):
        overhead(max(args.repeats, 5000))
    if args.only in (None, "decode"):
        decode(max(args.repeats, 500))
    if args.only in (None, "loops"):
        decode_loops()
    if args.only in (None, "cold"):
        decode_cold(max(args.repeats, 100))
    if args.only in (None, "prefill"):
        prefill(args.repeats)
    if args.only in (None, "vmap"):
        vmap_table(max(args.repeats, 20))
    if args.only in (None, "routing"):
        routing(args.repeats)
    if args.allocator == "both":
        sys.stdout.flush()
        argv = [a for a in sys.argv if a != "--allocator" and a != "both"]
        env = os.environ | {"THP_MEM_ALLOC_ENABLE": "1"}
        raise SystemExit(subprocess.call([sys.executable, *argv, "--allocator", "thp"], env=env))


if __name__ == "__main__":
    main()
