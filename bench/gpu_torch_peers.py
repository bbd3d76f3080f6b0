"""The operator's PyTorch peers on the GPU, for the table of bench/gpu_check.sh:
torch.index_select by a precomputed gather index and torch split + cat, each
moving tokens, scales and weights, against Tensor.copy_ of the same bytes;
plain and in CUDA graph replay, medians of CUDA events. Skipped (exit 0)
where torch has no CUDA.

Usage: python3 bench/gpu_torch_peers.py [repetitions]
"""

import statistics
import sys

import torch

HIDDEN, RANKS, EXPERTS = 7168, 16, 16
SHAPES = [("decode", 256), ("prefill", 16384), ("prefill", 131072)]
DTYPES = [torch.int8, torch.bfloat16]


def median_us(fn, reps):
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1000.0)
    return statistics.median(times)


def graphed(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up allocations outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def counts_for(num_tokens, generator):
    picks = torch.randint(0, RANKS * EXPERTS, (num_tokens,), generator=generator)
    return torch.bincount(picks, minlength=RANKS * EXPERTS).view(RANKS, EXPERTS)


def main():
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    if not torch.cuda.is_available():
        print("torch has no CUDA device: peers skipped")
        return
    device = torch.device("cuda")
    generator = torch.Generator().manual_seed(42)
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}; H = {HIDDEN}, "
          f"N = {RANKS}, E = {EXPERTS}, with [A] scales and [A, 1] weights; median of {reps}, us")
    print(f"{'shape':<8} {'A':>7} {'dtype':<9} {'mode':<6} {'index_select':>12} "
          f"{'split_cat':>10} {'copy_':>9} {'idx_vs_copy':>11} {'cat_vs_copy':>11}")
    for name, num_tokens in SHAPES:
        counts = counts_for(num_tokens, generator)
        # Source blocks in rank order, reordered to expert order: the gather
        # index and the split sizes are precomputed on the host.
        src_begin = torch.cumsum(counts.flatten(), 0) - counts.flatten()
        order = [r * EXPERTS + e for e in range(EXPERTS) for r in range(RANKS)]
        index = torch.cat([torch.arange(int(src_begin[b]), int(src_begin[b]) + int(counts.flatten()[b]))
                           for b in order]).to(device)
        sizes = counts.flatten().tolist()
        for dtype in DTYPES:
            if dtype == torch.int8:
                tokens = torch.randint(-128, 127, (num_tokens, HIDDEN), dtype=dtype, device=device)
            else:
                tokens = torch.randn(num_tokens, HIDDEN, device=device).to(dtype)
            scales = torch.randn(num_tokens, device=device)
            weight = torch.randn(num_tokens, 1, device=device)
            flat = torch.empty(tokens.numel() * tokens.element_size() + 8 * num_tokens,
                               dtype=torch.uint8, device=device)
            flat_out = torch.empty_like(flat)

            def select():
                return (tokens.index_select(0, index), scales.index_select(0, index),
                        weight.index_select(0, index))

            def split_cat():
                return tuple(torch.cat([parts[b] for b in order])
                             for parts in (tokens.split(sizes), scales.split(sizes),
                                           weight.split(sizes)))

            def copy():
                flat_out.copy_(flat)

            shape_reps = max(5, reps // 5) if num_tokens >= 131072 else reps
            for mode in ("plain", "graph"):
                run = (lambda fn: fn) if mode == "plain" else graphed
                t_select = median_us(run(select), shape_reps)
                t_cat = median_us(run(split_cat), shape_reps)
                t_copy = median_us(run(copy), shape_reps)
                print(f"{name:<8} {num_tokens:>7} {str(dtype).removeprefix('torch.'):<9} "
                      f"{mode:<6} {t_select:>12.2f} {t_cat:>10.2f} {t_copy:>9.2f} "
                      f"{t_copy / t_select:>11.3f} {t_copy / t_cat:>11.3f}")
            del tokens, scales, weight, flat, flat_out
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
