// The kernels. Rows are bytes: no dtype dispatch but the counts' int width.

#include <cub/block/block_scan.cuh>

#include "kernels.h"
#include "moe_reroute/cuda.h"

namespace moe_reroute::cuda::detail {
namespace {

struct SaturatingAdd {
  std::int64_t cap;
  __device__ std::int64_t operator()(std::int64_t a, std::int64_t b) const {
    return saturating_add(a, b, cap);
  }
};

// Feeds each tile of a block-wide scan the running total of the tiles before.
// cub calls it from warp 0 only, so thread 0 ends up holding the grand total.
struct RunningPrefix {
  SaturatingAdd add;
  std::int64_t total = 0;
  __device__ std::int64_t operator()(std::int64_t tile_total) {
    const std::int64_t prefix = total;
    total = add(total, tile_total);
    return prefix;
  }
};

// Clamped into [0, cap] so that a bad count can neither overflow the scan nor
// make an offset negative; the status word records that it was bad.
template <typename Count>
__device__ std::int64_t clamped(Count count, std::int64_t cap) {
  return count < 0 ? 0 : (static_cast<std::int64_t>(count) > cap ? cap : count);
}

// Scans the counts in rank order (row-major) and in expert order
// (column-major) into the workspace, then writes the status word and, only
// when it is 0, expert_token_num. cap = A + 1: a valid scan never reaches it.
template <typename Count>
__global__ void __launch_bounds__(kOffsetsThreads) offsets_kernel(OffsetsParams p) {
  using Scan = cub::BlockScan<std::int64_t, kOffsetsThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ std::int64_t total;
  const auto* counts = static_cast<const Count*>(p.counts);
  const std::int64_t num_blocks = p.num_ranks * p.num_experts;
  const SaturatingAdd add{p.num_tokens + 1};
  int negative = 0;

  RunningPrefix rank_order{add};
  for (std::int64_t tile = 0; tile < num_blocks; tile += kOffsetsThreads) {
    const std::int64_t block = tile + threadIdx.x;
    std::int64_t count = 0;
    if (block < num_blocks) {
      const Count raw = counts[block];
      negative |= raw < 0;
      count = clamped(raw, add.cap);
    }
    std::int64_t begin;
    Scan(scan_storage).ExclusiveScan(count, begin, add, rank_order);
    if (block < num_blocks) p.rank_begin[block] = begin;
    __syncthreads();
  }

  RunningPrefix expert_order{add};
  for (std::int64_t tile = 0; tile < num_blocks; tile += kOffsetsThreads) {
    const std::int64_t position = tile + threadIdx.x;  // e * N + r
    const std::int64_t expert = position / p.num_ranks;
    const std::int64_t block = (position - expert * p.num_ranks) * p.num_experts + expert;
    const std::int64_t count = position < num_blocks ? clamped(counts[block], add.cap) : 0;
    std::int64_t begin;
    Scan(scan_storage).ExclusiveScan(count, begin, add, expert_order);
    if (position < num_blocks) p.expert_begin[block] = begin;
    __syncthreads();
  }

  negative = __syncthreads_or(negative);
  if (threadIdx.x == 0) total = rank_order.total;
  __syncthreads();
  const std::int32_t status = (negative ? kStatusNegativeCount : 0) |
                              (total != p.num_tokens ? kStatusCountSumMismatch : 0);
  if (threadIdx.x == 0) *p.status = status;
  if (status != 0 || p.expert_token_num == nullptr) return;
  auto* expert_token_num = static_cast<Count*>(p.expert_token_num);
  for (std::int64_t e = threadIdx.x; e < p.num_experts; e += kOffsetsThreads) {
    // expert_begin of block (0, e) is where expert e starts.
    const std::int64_t end = e + 1 < p.num_experts ? p.expert_begin[e + 1] : p.num_tokens;
    expert_token_num[e] = static_cast<Count>(p.cumsum ? end : end - p.expert_begin[e]);
  }
}

// The warp copies num_words words; each lane keeps kMoveUnroll loads in flight
// and consecutive lanes touch consecutive words (coalesced).
template <typename Word>
__device__ void copy_words(std::byte* dst, const std::byte* src, std::int64_t num_words,
                           int lane) {
  auto* to = reinterpret_cast<Word*>(dst);
  const auto* from = reinterpret_cast<const Word*>(src);
  for (std::int64_t base = lane; base < num_words; base += kWarpSize * kMoveUnroll) {
    Word words[kMoveUnroll];
#pragma unroll
    for (int u = 0; u < kMoveUnroll; ++u) {
      const std::int64_t w = base + u * kWarpSize;
      if (w < num_words) words[u] = from[w];
    }
#pragma unroll
    for (int u = 0; u < kMoveUnroll; ++u) {
      const std::int64_t w = base + u * kWarpSize;
      if (w < num_words) to[w] = words[u];
    }
  }
}

// The warp copies n bytes, 16 bytes an access when dst - src allows it.
__device__ void copy_range(std::byte* dst, const std::byte* src, std::int64_t n, int lane) {
  const RangeSplit split = split_range(reinterpret_cast<std::uintptr_t>(dst),
                                       reinterpret_cast<std::uintptr_t>(src), n);
  if (lane < split.head) dst[lane] = src[lane];
  std::byte* body_dst = dst + split.head;
  const std::byte* body_src = src + split.head;
  if (split.width == 16) {
    copy_words<uint4>(body_dst, body_src, split.words, lane);
  } else if (split.width == 8) {
    copy_words<uint2>(body_dst, body_src, split.words, lane);
  } else if (split.width == 4) {
    copy_words<std::uint32_t>(body_dst, body_src, split.words, lane);
  } else if (split.width == 2) {
    copy_words<std::uint16_t>(body_dst, body_src, split.words, lane);
  } else {
    copy_words<std::uint8_t>(body_dst, body_src, split.words, lane);
  }
  const std::int64_t tail = split.head + split.words * split.width;
  if (lane < split.tail) dst[tail + lane] = src[tail + lane];
}

__device__ void move_row(const RowMove& move, std::int64_t dst_row, std::int64_t src_row,
                         int lane) {
  if (move.dst == nullptr) return;
  std::byte* to = move.dst + dst_row * move.row_bytes;
  if (move.src == nullptr) {
    for (std::int64_t b = lane; b < move.row_bytes; b += kWarpSize) to[b] = std::byte{0};
    return;
  }
  copy_range(to, move.src + src_row * move.row_bytes, move.row_bytes, lane);
}

__global__ void __launch_bounds__(kMoveThreads) move_kernel(MoveParams p) {
  if (*p.status != 0) return;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const std::int64_t num_threads = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const std::int64_t first =
      (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
  const std::int64_t token_row_bytes = p.tokens.row_bytes;
  for (std::int64_t task = first; task < p.num_tasks; task += num_threads / kWarpSize) {
    const std::int64_t row = task / p.segments_per_row;
    const std::int64_t segment = task - row * p.segments_per_row;
    const std::int64_t src_row = source_row(p.tables, row);
    const std::int64_t begin = segment * kSegmentBytes;
    const std::int64_t bytes =
        token_row_bytes - begin < kSegmentBytes ? token_row_bytes - begin : kSegmentBytes;
    copy_range(p.tokens.dst + row * token_row_bytes + begin,
               p.tokens.src + src_row * token_row_bytes + begin, bytes, lane);
    if (segment != 0) continue;
    move_row(p.scales, row, src_row, lane);
    move_row(p.weight, row, src_row, lane);
    if (p.index != nullptr && lane == 0) {
      if (p.gather) {
        p.index[row] = static_cast<std::int32_t>(src_row);
      } else {
        p.index[src_row] = static_cast<std::int32_t>(row);
      }
    }
  }
}

}  // namespace

cudaError_t launch_offsets(const OffsetsParams& params, cudaStream_t stream) {
  if (params.count_dtype == DType::kInt32) {
    offsets_kernel<std::int32_t><<<1, kOffsetsThreads, 0, stream>>>(params);
  } else {
    offsets_kernel<std::int64_t><<<1, kOffsetsThreads, 0, stream>>>(params);
  }
  return cudaGetLastError();
}

cudaError_t launch_move(const MoveParams& params, const MoveLaunch& launch, cudaStream_t stream) {
  if (launch.grid == 0) return cudaSuccess;
  move_kernel<<<static_cast<unsigned>(launch.grid), launch.block, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace moe_reroute::cuda::detail
