"""The torch.distributed benchmark of moe_reroute.ep (gloo, CPU): dispatch,
combine and both against the three-step baseline and the physical limit, in
the same run, on --ranks processes (torch.multiprocessing, fork).

The baseline is bench/ep_bench.cc's: its dispatch packs by moe_init_routing
(the sort and the gather of the rows) and index_copy_ of the scales and
weights to the rows' places, exchanges the counts (all_to_all_single) and the
rows, scales and weights (one all_to_all_single each), then reorders with
moe_re_routing; its combine is moe_re_routing_inverse, all_to_all_single back
and moe_finalize_routing (drop_pad_mode 2, the float32 weights). Both paths
allocate their outputs every call, as a model does. The limit is one
all_to_all_single of the same bytes alone, into a buffer allocated once:
dispatch's rows with their scales and weight as one byte row each, combine's
expert_out rows back.

- prefill: T = 2048 tokens a rank, top-8 of 256 experts, int8 H = 7168 with
  float32 per-token scales and float32 weights;
- decode: T = 64 tokens a rank, top-8 of 256, bfloat16 H = 7168, float32
  weights;
- combine: expert_out bfloat16 H' = H, in permute_tokens' row order.

Each case checks ep's outputs (dispatch's six and combine's) against the
baseline's, byte for byte, before timing anything (a mismatch exits
non-zero). Then --repeats rounds time each contender's dispatch and its
combine, each call between barriers as the slowest rank's time, the
contenders' order rotating from round to round. Prints per case the medians
(ms), ep's ratio to the baseline and each path's ratio to the limit.

--processes N (default 5, about a minute and a half on 2 cores) runs the
cases in N fresh processes and then prints the medians of their medians:
where the buffers lie in memory differs from process to process
(docs/benchmarks.md); --processes 1 times in this process alone.

    python bench/ep.py [--only prefill|decode] [--repeats N] [--processes N]
                       [--ranks N] [--tokens T] [--hidden H]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import moe_reroute
import moe_reroute.ep
from peers import cpu_model  # bench/peers.py, beside this file

# tokens a rank, their dtype, whether they carry float32 per-token scales,
# and the rounds each process times by default.
CASES = {
    "prefill": dict(tokens=2048, dtype=torch.int8, scales=True, repeats=5),
    "decode": dict(tokens=64, dtype=torch.bfloat16, scales=False, repeats=50),
}
CONTENDERS = ("ep", "baseline", "limit")
STEPS = ("dispatch", "combine", "both")


def progress(message):
    print(f"bench/ep.py: {message}", file=sys.stderr, flush=True)


def rank_inputs(args, case, rank):
    """This rank's x [T, H], expert_idx [T, k] int32 (k distinct experts a
    token, uniformly), float32 weights [T, k] and scales [T] (or None)."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)
    t = args.tokens or case["tokens"]
    if case["dtype"] == torch.int8:
        x = torch.randint(-128, 128, (t, args.hidden), dtype=torch.int8, generator=gen)
    else:
        x = torch.randn(t, args.hidden, generator=gen).to(case["dtype"])
    ids = torch.rand(t, args.experts, generator=gen).argsort(dim=1)[:, :args.topk].to(torch.int32)
    weights = torch.rand(t, args.topk, generator=gen)
    scales = 0.001 + torch.rand(t, generator=gen) if case["scales"] else None
    return x, ids, weights, scales


class Baseline:
    """The three steps each way, as bench/ep_bench.cc's baseline."""

    def __init__(self, args, num_ranks, x, ids, weights, scales):
        self.num_ranks, self.num_experts = num_ranks, args.experts
        self.x, self.ids, self.weights, self.scales = x, ids, weights, scales

    def dispatch(self):
        """moe_re_routing's five outputs on what arrived, and the counts [N, E]."""
        n = self.num_ranks
        expanded, self.row_idx, send_counts, _ = moe_reroute.moe_init_routing(
            self.x, self.ids, expert_num=self.num_experts, expert_tokens_count_or_cumsum_flag=2)
        # The scales and weights go where moe_init_routing put their rows.
        rows = self.row_idx.long()
        k = self.ids.shape[1]
        send = [expanded, torch.empty(rows.shape[0]).index_copy_(0, rows, self.weights.view(-1))]
        if self.scales is not None:
            send.append(torch.empty(rows.shape[0]).index_copy_(
                0, rows, self.scales.repeat_interleave(k)))
        self.counts = torch.empty_like(send_counts)
        dist.all_to_all_single(self.counts, send_counts)
        self.counts = self.counts.view(n, -1)
        self.send_rows = send_counts.view(n, -1).sum(dim=1).tolist()
        self.recv_rows = self.counts.sum(dim=1).tolist()
        recv = [torch.empty(sum(self.recv_rows), *s.shape[1:], dtype=s.dtype) for s in send]
        for r, s in zip(recv, send):
            dist.all_to_all_single(r, s, output_split_sizes=self.recv_rows,
                                   input_split_sizes=self.send_rows)
        outputs = moe_reroute.moe_re_routing(
            recv[0], self.counts, per_token_scales=recv[2] if len(recv) > 2 else None,
            expert_topk_weight=recv[1])
        return (*outputs, self.counts)

    def combine(self, expert_out):
        restored = moe_reroute.moe_re_routing_inverse(expert_out, self.counts)[0]
        returned = torch.empty(self.row_idx.shape[0], expert_out.shape[1], dtype=expert_out.dtype)
        dist.all_to_all_single(returned, restored, output_split_sizes=self.send_rows,
                               input_split_sizes=self.recv_rows)
        return moe_reroute.moe_finalize_routing(returned, self.row_idx, scales=self.weights,
                                                drop_pad_mode=2)


class Ep:
    """moe_reroute.ep's dispatch and combine."""

    def __init__(self, args, num_ranks, x, ids, weights, scales):
        self.num_experts = args.experts
        self.x, self.ids, self.weights, self.scales = x, ids, weights, scales

    def dispatch(self):
        result = moe_reroute.ep.dispatch(self.x, self.ids, self.num_experts,
                                         expert_scales=self.weights, per_token_scales=self.scales)
        self.handle = result.handle  # what combine needs, as the baseline keeps its counts
        return result[:6]

    def combine(self, expert_out):
        return moe_reroute.ep.combine(expert_out, self.handle)


class Limit:
    """all_to_all_single of the same bytes alone, into buffers allocated once:
    each row the baseline sends (its token, weight and scale bytes) one way,
    each row of expert_out the other."""

    def __init__(self, baseline, expert_out):
        send_rows, recv_rows = baseline.send_rows, baseline.recv_rows
        x = baseline.x
        row_bytes = x.shape[1] * x.element_size() + 4 * (1 + (baseline.scales is not None))
        out_bytes = expert_out.shape[1] * expert_out.element_size()
        self.dispatch_args = (torch.empty(sum(recv_rows), row_bytes, dtype=torch.uint8),
                              torch.ones(sum(send_rows), row_bytes, dtype=torch.uint8),
                              recv_rows, send_rows)
        self.combine_args = (torch.empty(sum(send_rows), out_bytes, dtype=torch.uint8),
                             torch.ones(sum(recv_rows), out_bytes, dtype=torch.uint8),
                             send_rows, recv_rows)

    def dispatch(self):
        dist.all_to_all_single(*self.dispatch_args)

    def combine(self, expert_out):
        dist.all_to_all_single(*self.combine_args)


def same_bytes(got, want):
    return (got.dtype == want.dtype and got.numel() == want.numel()
            and torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)))


def verified_contenders(args, num_ranks, rank, name, case):
    """The three contenders of `case` and expert_out, ep's outputs checked
    against the baseline's on every rank (SystemExit naming the first that
    differs on any rank)."""
    inputs = rank_inputs(args, case, rank)
    ep, baseline = Ep(args, num_ranks, *inputs), Baseline(args, num_ranks, *inputs)
    got, want = ep.dispatch(), baseline.dispatch()
    gen = torch.Generator().manual_seed(args.seed + rank)
    expert_out = torch.randn(got[0].shape[0], args.hidden, generator=gen, dtype=torch.bfloat16)
    got, want = (*got, ep.combine(expert_out)), (*want, baseline.combine(expert_out))
    outputs = (*moe_reroute.ep.DispatchResult._fields[:6], "combine")
    differs = torch.tensor([next((i for i, (g, w) in enumerate(zip(got, want))
                                  if not same_bytes(g, w)), len(outputs))])
    dist.all_reduce(differs, op=dist.ReduceOp.MIN)
    if differs.item() < len(outputs):  # on every rank, told once
        raise SystemExit(f"{name}: ep's {outputs[differs.item()]} differs from the baseline's"
                         if rank == 0 else 1)
    return {"ep": ep, "baseline": baseline, "limit": Limit(baseline, expert_out)}, expert_out


def timed(fn, *args):
    """This rank's seconds for fn(*args), started together."""
    dist.barrier()
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def run_case(args, num_ranks, rank, name, case):
    """Rank 0 gets {contender: {step: [ms per round]}}, the slowest rank's."""
    repeats = args.repeats or case["repeats"]
    if rank == 0:
        progress(f"{name}: checking ep against the baseline, then {repeats} rounds")
    contenders, expert_out = verified_contenders(args, num_ranks, rank, name, case)
    times = torch.zeros(repeats, len(CONTENDERS), 2, dtype=torch.float64)
    shown = time.monotonic()
    for round_ in range(repeats):
        for i in range(len(CONTENDERS)):
            c = (round_ + i) % len(CONTENDERS)
            contender = contenders[CONTENDERS[c]]
            times[round_, c, 0] = timed(contender.dispatch)
            times[round_, c, 1] = timed(contender.combine, expert_out)
        if rank == 0 and time.monotonic() - shown > 2 and round_ + 1 < repeats:
            progress(f"{name}: round {round_ + 1} of {repeats}")
            shown = time.monotonic()
    dist.reduce(times, dst=0, op=dist.ReduceOp.MAX)
    times = torch.cat([times, times.sum(dim=2, keepdim=True)], dim=2) * 1e3
    return {c: {s: times[:, i, j].tolist() for j, s in enumerate(STEPS)}
            for i, c in enumerate(CONTENDERS)}


def title(args, num_ranks, name, case, repeats):
    dtype = str(case["dtype"]).removeprefix("torch.")
    return (f"{name}: {num_ranks} ranks, T = {args.tokens or case['tokens']} tokens each, "
            f"top-{args.topk} of {args.experts} experts, {dtype} H = {args.hidden}"
            f"{' with float32 scales' if case['scales'] else ''}, float32 weights; combine "
            f"bfloat16 H' = {args.hidden}; median of {repeats} rounds, the slowest rank's time, "
            f"verified")


def print_table(heading, rows):
    """rows: (step, ep ms, baseline ms, limit ms)."""
    print(f"\n{heading}")
    print(f"| {'step':<8} | {'ep ms':>9} | {'baseline ms':>11} | {'limit ms':>9} "
          f"| {'ep/baseline':>11} | {'ep/limit':>8} | {'baseline/limit':>14} |")
    print(f"|{'-' * 10}|{'-' * 11}|{'-' * 13}|{'-' * 11}|{'-' * 13}|{'-' * 10}|{'-' * 16}|")
    for step, ep, base, limit in rows:
        print(f"| {step:<8} | {ep:>9.3f} | {base:>11.3f} | {limit:>9.3f} | {ep / base:>11.2f} "
              f"| {ep / limit:>8.2f} | {base / limit:>14.2f} |")


def worker(rank, num_ranks, port, args):
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=num_ranks)
    try:
        for name in (args.only,) if args.only else CASES:
            case = CASES[name]
            times = run_case(args, num_ranks, rank, name, case)
            if rank != 0:
                continue
            medians = {c: {s: statistics.median(v) for s, v in t.items()} for c, t in times.items()}
            print_table(title(args, num_ranks, name, case, args.repeats or case["repeats"]),
                        [(s, *(medians[c][s] for c in CONTENDERS)) for s in STEPS])
            sys.stdout.flush()
            if args.record:
                with open(args.record, "a") as record:
                    record.write(json.dumps({"case": name, "medians_ms": medians}) + "\n")
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_process(args):
    print(f"## moe_reroute {moe_reroute.__version__}, torch {torch.__version__}, gloo, "
          f"{cpu_model()}, {os.cpu_count()} CPUs, torch threads {args.threads} a rank, "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    # The first call of a torch custom operator imports torch's compiler stack
    # (seconds); making it once here spares every forked rank.
    counts = torch.tensor([[1, 1]])
    moe_reroute.moe_re_routing(torch.ones(2, 1, dtype=torch.int8), counts)
    # fork: the ranks share the imported torch instead of importing it again.
    try:
        mp.start_processes(worker, args=(args.ranks, free_port(), args), nprocs=args.ranks,
                           start_method="fork")
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as failed:
        raise SystemExit(f"bench/ep.py: {failed}") from None


def across_processes(args):
    """The cases in args.processes fresh processes, then the medians of their
    medians (ms) and of their ratios."""
    with tempfile.TemporaryDirectory() as directory:
        record = pathlib.Path(directory) / "medians.jsonl"
        argv = [f"--{name}={value}" for name, value in vars(args).items() if value is not None]
        argv += ["--processes=1", f"--record={record}"]  # last, so they count
        for p in range(args.processes):
            progress(f"process {p + 1} of {args.processes}")
            sys.stdout.flush()
            if subprocess.call([sys.executable, __file__, *argv]) != 0:
                raise SystemExit("a benchmark process failed")
        runs = [json.loads(line) for line in record.read_text().splitlines()]
    for name in (args.only,) if args.only else CASES:
        medians = [run["medians_ms"] for run in runs if run["case"] == name]

        def across(figure):
            return statistics.median(figure(m) for m in medians)

        rows = [(s, *(across(lambda m, c=c: m[c][s]) for c in CONTENDERS)) for s in STEPS]
        print_table(f"{name}: the medians of {len(medians)} processes' medians (ms)", rows)
        for s in STEPS:
            ratios = [m["ep"][s] / m["baseline"][s] for m in medians]
            print(f"{s} ep/baseline in each process: {' '.join(f'{r:.2f}' for r in ratios)}; "
                  f"their median {statistics.median(ratios):.2f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=tuple(CASES))
    p.add_argument("--repeats", type=int, default=0, help="rounds a process (0: the case's)")
    p.add_argument("--processes", type=int, default=5,
                   help="fresh processes, then the medians of their medians (1: this one)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--tokens", type=int, default=0, help="tokens a rank (0: the case's)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256, help="global experts, a multiple of ranks")
    p.add_argument("--threads", type=int, default=1, help="torch threads a rank")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--record", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("repeats", "tokens"):
        if getattr(args, name) < 0:
            p.error(f"--{name}: must be >= 0")
    for name in ("processes", "ranks", "hidden", "topk", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: must be >= 1")
    if args.experts % args.ranks or not args.topk <= args.experts:
        p.error(f"--experts {args.experts}: must be a multiple of --ranks {args.ranks} "
                f"and at least --topk {args.topk}")
    if args.processes > 1:
        across_processes(args)
    else:
        one_process(args)


if __name__ == "__main__":
    main()
