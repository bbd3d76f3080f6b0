"""An expert-parallel MoE layer with torch.distributed (gloo, CPU).

By default the layer is moe_reroute.ep.dispatch (the sort by expert, the
exchange and moe_re_routing as one call), one toy expert per local expert,
and moe_reroute.ep.combine (the way back with the weighted top-k sum at the
source rank). --baseline runs the same layer in the steps it replaces:
moe_init_routing (the sort by destination), the counts' all_to_all_single,
the dispatch all_to_all_single, moe_re_routing, the experts,
moe_re_routing_inverse, the return all_to_all_single and
moe_finalize_routing. Rank 0 checks the result bitwise against the same layer
computed in one process, prints a per-stage time table and, last, one JSON
line.

With --fixed-capacity, each rank receives into a buffer sized for the worst
case (every token of every rank routed here; static shapes, as under CUDA
graphs: ep's capacity, or moe_re_routing's allow_spare_rows), and with
--expert-alignment K each expert's segment starts at a multiple of K (the
layout grouped GEMMs want); the experts read their segments from the padded
cumsum.

    python examples/ep_torch.py --ranks 4          # torch.multiprocessing
    python examples/ep_torch.py --ranks 4 --baseline
    python examples/ep_torch.py --ranks 2 --fixed-capacity --expert-alignment 128
    torchrun --nproc-per-node 4 examples/ep_torch.py
"""

import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import moe_reroute
import moe_reroute.ep

STAGES = {
    "ep": ("dispatch", "experts", "combine", "total"),
    "baseline": ("moe_init_routing", "exchange_counts", "dispatch_alltoallv", "moe_re_routing",
                 "experts", "moe_re_routing_inverse", "return_alltoallv", "moe_finalize_routing",
                 "total"),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2, help="processes to spawn (ignored under torchrun)")
    p.add_argument("--tokens-per-rank", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256, help="int8 elements per dispatched token")
    p.add_argument("--out-hidden", type=int, default=192, help="float32 elements per expert output row")
    p.add_argument("--experts-per-rank", type=int, default=4)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--fixed-capacity", action="store_true",
                   help="receive into a worst-case buffer (spare rows allowed)")
    p.add_argument("--expert-alignment", type=int, default=1,
                   help="pad each expert's segment to a multiple of this many rows")
    p.add_argument("--baseline", action="store_true",
                   help="the steps moe_reroute.ep replaces instead of dispatch and combine")
    args = p.parse_args(argv)
    args.mode = "baseline" if args.baseline else "ep"
    for name in ("ranks", "tokens_per_rank", "hidden", "out_hidden", "experts_per_rank", "topk",
                 "repeat", "threads", "expert_alignment"):
        if getattr(args, name) < (0 if name == "tokens_per_rank" else 1):
            p.error(f"--{name.replace('_', '-')}: {getattr(args, name)} is out of range")
    return args


def rank_input(args, num_ranks, rank):
    """Rank `rank`'s seeded input: int8 tokens [T, H], float32 scales [T], and
    its top-k global experts [T, K] (int64) with float32 weights [T, K].
    Routing is skewed: expert g has popularity 1 / (1 + g)."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)
    t, k = args.tokens_per_rank, args.topk
    num_experts = num_ranks * args.experts_per_rank
    tokens = torch.randint(-127, 128, (t, args.hidden), dtype=torch.int8, generator=gen)
    scales = 0.001 + 0.02 * torch.rand(t, generator=gen)
    # Weighted sampling without replacement: the K smallest exponential keys.
    popularity = torch.arange(1, num_experts + 1, dtype=torch.float32)
    keys = -torch.log1p(-torch.rand(t, num_experts, generator=gen)) * popularity
    topk_expert = torch.topk(keys, k, dim=1, largest=False).indices
    weight = 0.05 + torch.rand(t, k, generator=gen)
    return tokens, scales, topk_expert, weight / weight.sum(dim=1, keepdim=True)


def expert_coefficients(args, num_ranks):
    """Per global expert and output element: a, b in [-2, 2), multiples of 1/256."""
    gen = torch.Generator().manual_seed(args.seed)
    shape = (2, num_ranks * args.experts_per_rank, args.out_hidden)
    ab = torch.randint(-512, 512, shape, generator=gen).to(torch.float32) / 256
    return ab[0], ab[1]


def expert_rows(args, a, b, tokens, scales):
    """a * (tokens[:, o % H] * scale) + b, as float32 [n, O]; a and b are [O]
    (one expert) or [n, O] (one expert per row)."""
    source = torch.arange(args.out_hidden) % args.hidden
    x = tokens[:, source].to(torch.float32) * scales[:, None]
    return a * x + b


def reference_output(args, num_ranks, rank, a, b):
    """The layer output of `rank` in one process, all experts local: [T, O],
    0 + w_0 * y_0 + w_1 * y_1 + ..., each float32 step rounded in that order,
    as moe_finalize_routing sums."""
    tokens, scales, topk_expert, weight = rank_input(args, num_ranks, rank)
    out = torch.zeros(tokens.shape[0], args.out_hidden)
    for k in range(args.topk):
        rows = expert_rows(args, a[topk_expert[:, k]], b[topk_expert[:, k]], tokens, scales)
        out = out + rows * weight[:, k:k + 1]
    return out


def capacity(args, num_ranks):
    """The worst case of receive rows: each of every rank's tokens sends min(K, E) rows here."""
    return num_ranks * args.tokens_per_rank * min(args.topk, args.experts_per_rank)


def ep_dispatch(args, num_ranks, layer_input, lap):
    """moe_reroute.ep's dispatch; returns the permuted tokens and scales, the
    padded cumsum of the expert segments, the counts [N, E] (row r: what rank
    r sent) and the way back, combine(expert_out) -> [T, O]."""
    tokens, scales, topk_expert, weight = layer_input
    result = moe_reroute.ep.dispatch(
        tokens, topk_expert, num_ranks * args.experts_per_rank, expert_scales=weight,
        per_token_scales=scales, expert_alignment=args.expert_alignment,
        capacity=capacity(args, num_ranks) if args.fixed_capacity else None,
        expert_token_num_type=0)
    lap("dispatch")

    def combine(expert_out):
        out = moe_reroute.ep.combine(expert_out, result.handle)
        lap("combine")
        return out

    return (result.permute_tokens, result.permute_per_token_scales, result.expert_token_num,
            result.expert_token_num_per_rank, combine)


def baseline_dispatch(args, num_ranks, layer_input, lap):
    """The same as ep_dispatch in the steps it replaces."""
    tokens, scales, topk_expert, weight = layer_input
    e_per_rank = args.experts_per_rank
    # Global expert g = rank * E + e, so sorting the (token, k) pairs by g orders
    # them by destination rank, then its local expert; send_row[t * K + k] is
    # where pair (t, k) went, which the combine reads back. The weights stay here.
    init = dict(expert_num=num_ranks * e_per_rank, expert_tokens_count_or_cumsum_flag=2)
    send_tokens, send_row, send_count, _ = moe_reroute.moe_init_routing(tokens, topk_expert,
                                                                         **init)
    send_scales = moe_reroute.moe_init_routing(scales.reshape(-1, 1), topk_expert,
                                               **init)[0].reshape(-1)
    lap("moe_init_routing")

    recv_count = torch.empty_like(send_count)
    dist.all_to_all_single(recv_count, send_count)
    recv_count = recv_count.reshape(num_ranks, e_per_rank)
    lap("exchange_counts")

    send_rows = send_count.reshape(num_ranks, e_per_rank).sum(dim=1).tolist()
    recv_rows = recv_count.sum(dim=1).tolist()
    num_recv = sum(recv_rows)
    num_rows = capacity(args, num_ranks) if args.fixed_capacity else num_recv
    recv_tokens = torch.empty(num_rows, args.hidden, dtype=torch.int8)
    recv_scales = torch.empty(num_rows, dtype=torch.float32)
    for recv, send in ((recv_tokens, send_tokens), (recv_scales, send_scales)):
        dist.all_to_all_single(recv[:num_recv], send, output_split_sizes=recv_rows,
                               input_split_sizes=send_rows)
    lap("dispatch_alltoallv")

    static = dict(expert_alignment=args.expert_alignment, allow_spare_rows=args.fixed_capacity)
    permute_tokens, permute_scales, _, segment_end, _ = moe_reroute.moe_re_routing(
        recv_tokens, recv_count, per_token_scales=recv_scales, expert_token_num_type=0, **static)
    lap("moe_re_routing")

    def combine(expert_out):
        restored, _, _ = moe_reroute.moe_re_routing_inverse(expert_out, recv_count, **static)
        lap("moe_re_routing_inverse")
        returned = torch.empty(sum(send_rows), args.out_hidden, dtype=torch.float32)
        dist.all_to_all_single(returned, restored[:num_recv], output_split_sizes=send_rows,
                               input_split_sizes=recv_rows)
        lap("return_alltoallv")
        # Each token's K rows, weighted by its routing weights, summed in order.
        out = moe_reroute.moe_finalize_routing(returned, send_row, scales=weight, drop_pad_mode=2)
        lap("moe_finalize_routing")
        return out

    return permute_tokens, permute_scales, segment_end, recv_count, combine


DISPATCH = {"ep": ep_dispatch, "baseline": baseline_dispatch}


def run_layer(args, num_ranks, rank, layer_input, a, b):
    """The layer on this rank: returns its output [T, O] and the stage times (ms)."""
    times = {}
    mark = start = time.perf_counter()

    def lap(stage):
        nonlocal mark
        now = time.perf_counter()
        times[stage] = (now - mark) * 1e3
        mark = now

    permute_tokens, permute_scales, segment_end, counts, combine = DISPATCH[args.mode](
        args, num_ranks, layer_input, lap)
    # Expert e's rows start where expert e - 1's padded segment ends.
    expert_out = torch.zeros(permute_tokens.shape[0], args.out_hidden, dtype=torch.float32)
    ends = segment_end.tolist()
    for e, (first, count) in enumerate(zip([0, *ends[:-1]], counts.sum(dim=0).tolist())):
        rows = slice(first, first + count)
        g = rank * args.experts_per_rank + e
        expert_out[rows] = expert_rows(args, a[g], b[g], permute_tokens[rows],
                                       permute_scales[rows])
    lap("experts")
    out = combine(expert_out)
    times["total"] = (mark - start) * 1e3
    return out, times


def print_times(args, num_ranks, verified, max_times):
    """max_times: [repeat, stages] ms, each the max over ranks."""
    median = max_times.median(dim=0).values
    stages = STAGES[args.mode]
    print(f"{args.mode + ': stage (max over ranks)':<32} {'median_ms':>10} {'min_ms':>10} "
          f"{'max_ms':>10}")
    for s, name in enumerate(stages):
        column = max_times[:, s]
        print(f"{name:<32} {median[s].item():10.3f} {column.min().item():10.3f} {column.max().item():10.3f}")
    print(json.dumps({"mode": args.mode, "ranks": num_ranks, "verified": verified,
                      "tokens_per_rank": args.tokens_per_rank,
                      "times_ms": {name: round(median[s].item(), 4) for s, name in enumerate(stages)}}),
          flush=True)


def worker(rank, num_ranks, args):
    """One rank of the layer; returns whether rank 0 verified the output."""
    torch.set_num_threads(args.threads)
    a, b = expert_coefficients(args, num_ranks)
    layer_input = rank_input(args, num_ranks, rank)
    times = torch.empty(args.repeat, len(STAGES[args.mode]), dtype=torch.float64)
    for r in range(args.repeat):
        dist.barrier()
        out, stage_ms = run_layer(args, num_ranks, rank, layer_input, a, b)
        times[r] = torch.tensor([stage_ms[name] for name in STAGES[args.mode]],
                                dtype=torch.float64)
    dist.reduce(times, dst=0, op=dist.ReduceOp.MAX)

    gathered = [torch.empty_like(out) for _ in range(num_ranks)] if rank == 0 else None
    dist.gather(out, gathered, dst=0)
    verified = torch.zeros(1, dtype=torch.int32)
    if rank == 0:
        ok = True
        for r, got in enumerate(gathered):
            expect = reference_output(args, num_ranks, r, a, b)
            mismatches = (got.view(torch.int32) != expect.view(torch.int32)).sum().item()
            if mismatches:
                print(f"rank {r}: {mismatches} of {got.numel()} output values differ from the "
                      "single-process layer", file=sys.stderr)
                ok = False
        verified[0] = int(ok)
        print_times(args, num_ranks, ok, times)
    dist.broadcast(verified, src=0)
    return bool(verified.item())


def spawned(rank, num_ranks, port, args):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=num_ranks)
    try:
        verified = worker(rank, num_ranks, args)
    finally:
        dist.destroy_process_group()
    if not verified:
        sys.exit(1)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def warm_up_operators():
    """The first call of a torch custom operator imports torch's compiler stack
    (seconds); making it once in the parent spares every forked rank."""
    counts = torch.tensor([[1, 1]])
    rows = torch.ones(2, 1, dtype=torch.int8)
    moe_reroute.moe_re_routing(rows, counts)
    moe_reroute.moe_re_routing_inverse(rows, counts)


def check_topk(args, num_ranks):
    if args.topk > num_ranks * args.experts_per_rank:
        sys.exit(f"ep_torch.py: --topk: {args.topk} exceeds the {num_ranks * args.experts_per_rank} "
                 f"experts of {num_ranks} ranks x --experts-per-rank {args.experts_per_rank}")


def main(argv=None):
    args = parse_args(argv)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        dist.init_process_group("gloo")
        check_topk(args, dist.get_world_size())
        try:
            verified = worker(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
        return 0 if verified else 1
    check_topk(args, args.ranks)
    warm_up_operators()
    try:
        # fork: the children share the parent's imported torch instead of importing it again.
        mp.start_processes(spawned, args=(args.ranks, free_port(), args), nprocs=args.ranks,
                           start_method="fork")
    except mp.ProcessExitedException:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
