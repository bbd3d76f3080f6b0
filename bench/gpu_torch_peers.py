"""Our torch operator against its PyTorch peers on the GPU, on the same data in
the same process: torch.ops.moe_reroute.moe_re_routing, torch.index_select by
a precomputed gather index (tokens, scales and weights) and Tensor.copy_ of the
same bytes, as plain calls and CUDA graph replays; medians over batches of
CUDA events. Decode shapes rotate over buffer sets past the 60 MB L2. Our
operator's outputs are checked against index_select byte for byte. Writes a
TSV for bench/gpu_check.sh's table.

Usage: python3 bench/gpu_torch_peers.py [--dry-run] [--reps N] [--tsv FILE] [--no-big]
"""

import argparse
import statistics
import sys

HIDDEN, RANKS, EXPERTS = 7168, 16, 16
ROTATION_BYTES = 256 << 20
SHAPES = [("decode", 256, "bfloat16"), ("decode", 256, "int8"), ("prefill", 16384, "bfloat16"),
          ("prefill", 16384, "int8")]
BIG = ("prefill", 163840, "bfloat16")


def planned_sets(num_tokens, dtype):
    row_bytes = HIDDEN * (2 if dtype == "bfloat16" else 1)
    return max(1, min(64, ROTATION_BYTES // (2 * num_tokens * (row_bytes + 12))))


def median_us(torch, fns, reps):
    """Median over `reps` batches of the mean microseconds of one call of fns."""
    for fn in fns:
        fn()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        for fn in fns:
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1000.0 / len(fns))
    return statistics.median(times)


def graphed(torch, fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up allocations outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def our_op():
    """torch.ops.moe_reroute.moe_re_routing, or the reason it is missing."""
    try:
        import moe_reroute  # noqa: F401  (registers the ops)
        import torch
        op = torch.ops.moe_reroute.moe_re_routing
        # Timing wants no host sync after each call: "deferred" (the sticky
        # status word, read by cuda_check) where it exists, else "off".
        for mode in ("deferred", "off"):
            try:
                previous = moe_reroute.set_cuda_status_check(mode)
                return op, f"moe_reroute (status check {previous!r} -> {mode!r})"
            except ValueError:
                continue
        return op, "moe_reroute (status check unchanged)"
    except Exception as error:  # noqa: BLE001 (any import or registration failure)
        return None, f"moe_reroute unavailable: {error}"


def make_set(torch, num_tokens, dtype, counts, index, device):
    if dtype == torch.int8:
        tokens = torch.randint(-128, 127, (num_tokens, HIDDEN), dtype=dtype, device=device)
    else:
        tokens = torch.randn(num_tokens, HIDDEN, device=device).to(dtype)
    row_bytes = HIDDEN * tokens.element_size()
    flat = torch.empty(num_tokens * (row_bytes + 8), dtype=torch.uint8, device=device)
    return {"tokens": tokens, "scales": torch.randn(num_tokens, device=device),
            "weight": torch.randn(num_tokens, 1, device=device), "counts": counts.to(device),
            "index": index, "flat": flat, "flat_out": torch.empty_like(flat)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--tsv")
    parser.add_argument("--no-big", action="store_true")
    args = parser.parse_args()
    shapes = SHAPES + ([] if args.no_big else [BIG])
    header = (f"{'shape':<8} {'A':>7} {'dtype':<9} {'sets':>4} {'ours_us':>9} {'ours_graph':>10} "
              f"{'isel_us':>9} {'isel_graph':>10} {'copy_us':>9} {'copy_graph':>10} verified")
    try:
        import torch
    except ImportError:
        print("torch is not installed: peers skipped")
        return 0
    op, op_note = our_op()
    if args.dry_run:
        print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}; {op_note}")
        print(header)
        for name, num_tokens, dtype in shapes:
            print(f"{name:<8} {num_tokens:>7} {dtype:<9} {planned_sets(num_tokens, dtype):>4}  (dry run)")
        return 0
    if not torch.cuda.is_available():
        print("torch has no CUDA device: peers skipped")
        return 0
    device = torch.device("cuda")
    generator = torch.Generator().manual_seed(42)
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}; {op_note}; H = {HIDDEN}, "
          f"N = {RANKS}, E = {EXPERTS}, [A] scales, [A, 1] weights; median of {args.reps} batches, "
          "us a call")
    print(header)
    tsv = open(args.tsv, "w") if args.tsv else None
    if tsv:
        print("shape\tA\tdtype\tours_us\tours_graph_us\tisel_us\tisel_graph_us\tcopy_us\t"
              "copy_graph_us\tverified", file=tsv)
    failures = 0
    for name, num_tokens, dtype_name in shapes:
        dtype = getattr(torch, dtype_name)
        picks = torch.randint(0, RANKS * EXPERTS, (num_tokens,), generator=generator)
        counts = torch.bincount(picks, minlength=RANKS * EXPERTS).view(RANKS, EXPERTS).to(torch.int32)
        flat_counts = counts.flatten().to(torch.int64)
        src_begin = torch.cumsum(flat_counts, 0) - flat_counts
        order = [r * EXPERTS + e for e in range(EXPERTS) for r in range(RANKS)]
        index = torch.cat([torch.arange(int(src_begin[b]), int(src_begin[b] + flat_counts[b]))
                           for b in order]).to(device)
        sets = [make_set(torch, num_tokens, dtype, counts, index, device)
                for _ in range(planned_sets(num_tokens, dtype_name))]
        shape_reps = max(5, args.reps // 5) if num_tokens >= 100000 else args.reps

        def ours(s):
            return lambda: op(s["tokens"], s["counts"], per_token_scales=s["scales"],
                              expert_topk_weight=s["weight"])

        def select(s):
            return lambda: (s["tokens"].index_select(0, s["index"]),
                            s["scales"].index_select(0, s["index"]),
                            s["weight"].index_select(0, s["index"]))

        def copy(s):
            return lambda: s["flat_out"].copy_(s["flat"])

        verified = "no op"
        if op is not None:
            got = ours(sets[0])()
            want = select(sets[0])()
            same = all(torch.equal(g.view(torch.uint8), w.contiguous().view(torch.uint8))
                       for g, w in zip((got[0], got[1], got[4]), want))
            same = same and torch.equal(got[2].to(torch.int64), index.to(torch.int64))
            verified = "yes" if same else "NO"
            failures += 0 if same else 1
        times = {}
        for label, make in (("ours", ours), ("isel", select), ("copy", copy)):
            if label == "ours" and op is None:
                times[label] = times[label + "_graph"] = float("nan")
                continue
            times[label] = median_us(torch, [make(s) for s in sets], shape_reps)
            times[label + "_graph"] = median_us(torch, [graphed(torch, make(s)) for s in sets],
                                                shape_reps)
        print(f"{name:<8} {num_tokens:>7} {dtype_name:<9} {len(sets):>4} {times['ours']:>9.2f} "
              f"{times['ours_graph']:>10.2f} {times['isel']:>9.2f} {times['isel_graph']:>10.2f} "
              f"{times['copy']:>9.2f} {times['copy_graph']:>10.2f} {verified}", flush=True)
        if tsv:
            print(f"{name}\t{num_tokens}\t{dtype_name}\t{times['ours']:.3f}\t{times['ours_graph']:.3f}\t"
                  f"{times['isel']:.3f}\t{times['isel_graph']:.3f}\t{times['copy']:.3f}\t"
                  f"{times['copy_graph']:.3f}\t{verified}", file=tsv, flush=True)
        del sets
        torch.cuda.empty_cache()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
