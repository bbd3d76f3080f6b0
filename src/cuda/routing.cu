// The kernels of moe_init_routing and moe_finalize_routing (routing_kernels.h).
// Finalize's float32 steps are __fadd_rn and __fmul_rn, which the compiler
// never contracts into a fused multiply-add: each rounds on its own.

#include <algorithm>
#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "../float_bits.h"
#include "routing_kernels.h"

namespace moe_reroute::cuda::detail {
namespace {

using moe_reroute::detail::BFloat16;
using moe_reroute::detail::Float32;
using moe_reroute::detail::Half;

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kLanes = 32;
constexpr int kBlockThreads = 256;
constexpr int kBlockWarps = kBlockThreads / kLanes;
constexpr int kScanThreads = 1024;
// Grid-stride kernels stop growing their grid here: enough to fill any GPU.
constexpr std::int64_t kMaxBlocks = 1 << 16;

__device__ bool flagged(const std::byte* workspace) {
  return *reinterpret_cast<const std::int32_t*>(workspace) != 0;
}

// Sets the call's flag (its later kernels write nothing) and `bits` in the status word.
__device__ void refuse(std::byte* workspace, std::int32_t* status, std::int32_t bits) {
  atomicOr(reinterpret_cast<std::int32_t*>(workspace), 1);
  atomicOr(status, bits);
}

__device__ std::int64_t load_id(const InitRoutingParams& p, std::int64_t position) {
  return p.int64_ids ? static_cast<const std::int64_t*>(p.expert_idx)[position]
                     : static_cast<const std::int32_t*>(p.expert_idx)[position];
}

__device__ std::int64_t global_warp() {
  return (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kLanes;
}

__device__ int lane() { return static_cast<int>(threadIdx.x) % kLanes; }

// This warp's chunk of positions and its row of the table, or false past the last chunk.
struct Chunk {
  std::int64_t begin = 0;
  std::int64_t end = 0;
  std::int32_t* counts = nullptr;
};

__device__ bool chunk_of(const InitRoutingParams& p, Chunk& chunk) {
  const std::int64_t warp = global_warp();
  if (warp >= p.layout.num_chunks) return false;
  chunk.begin = warp * p.layout.chunk;
  chunk.end = min(chunk.begin + p.layout.chunk, p.positions);
  chunk.counts =
      reinterpret_cast<std::int32_t*>(p.workspace + p.layout.table) + warp * p.expert_num;
  return true;
}

// Checks the ids of this warp's chunk and counts them per expert, 32 at a
// time; the lowest lane of each id adds its lanes.
__global__ void __launch_bounds__(kBlockThreads) count_kernel(const InitRoutingParams p) {
  Chunk chunk;
  if (!chunk_of(p, chunk)) return;
  for (std::int64_t base = chunk.begin; base < chunk.end; base += kLanes) {
    const std::int64_t position = base + lane();
    const bool in = position < chunk.end;
    const std::int64_t id = in ? load_id(p, position) : 0;
    if (__any_sync(kFullMask, in && (id < 0 || id >= p.expert_num))) {
      if (lane() == 0) refuse(p.workspace, p.status, kBitExpertId);
      return;
    }
    const int key = in ? static_cast<int>(id) : -1;
    const unsigned peers = __match_any_sync(kFullMask, key);
    if (in && lane() == __ffs(peers) - 1) chunk.counts[key] += __popc(peers);
    __syncwarp();
  }
}

// One block: each expert's counts over the chunks become where each chunk's
// pairs begin among the expert's, the totals are scanned into where each
// expert begins, and the count outputs are written.
__global__ void __launch_bounds__(kScanThreads) scan_kernel(const InitRoutingParams p) {
  using Scan = cub::BlockScan<std::int32_t, kScanThreads>;
  __shared__ typename Scan::TempStorage scratch;
  if (flagged(p.workspace)) return;
  auto* table = reinterpret_cast<std::int32_t*>(p.workspace + p.layout.table);
  auto* begins = reinterpret_cast<std::int32_t*>(p.workspace + p.layout.begins);
  std::int32_t carry = 0;
  for (std::int64_t first = 0; first < p.expert_num; first += kScanThreads) {
    const std::int64_t expert = first + threadIdx.x;
    std::int32_t total = 0;
    if (expert < p.expert_num) {
      for (std::int64_t c = 0; c < p.layout.num_chunks; ++c) {
        std::int32_t& cell = table[c * p.expert_num + expert];
        const std::int32_t count = cell;
        cell = total;
        total += count;
      }
    }
    std::int32_t before = 0;
    std::int32_t sum = 0;
    Scan(scratch).ExclusiveSum(total, before, sum);
    if (expert < p.expert_num) {
      const std::int32_t begin = carry + before;
      begins[expert] = begin;
      if (p.count_or_cumsum) p.count_or_cumsum[expert] = p.cumsum ? begin + total : total;
      if (p.before_capacity) p.before_capacity[expert] = total;
    }
    carry += sum;
    __syncthreads();  // scratch is reused
  }
}

// Walks this warp's chunk again in order: each pair's rank among its
// expert's pairs is the chunk's start for that expert plus the lanes of the
// same id before it, which keeps the sort stable. Writes expanded_row_idx
// and the source row of each row of expanded_x.
__global__ void __launch_bounds__(kBlockThreads) place_kernel(const InitRoutingParams p) {
  Chunk chunk;
  if (!chunk_of(p, chunk) || flagged(p.workspace)) return;
  const auto* begins = reinterpret_cast<const std::int32_t*>(p.workspace + p.layout.begins);
  auto* source = reinterpret_cast<std::int32_t*>(p.workspace + p.layout.source);
  for (std::int64_t base = chunk.begin; base < chunk.end; base += kLanes) {
    const std::int64_t position = base + lane();
    const bool in = position < chunk.end;
    const int key = in ? static_cast<int>(load_id(p, position)) : -1;
    const unsigned peers = __match_any_sync(kFullMask, key);
    const int leader = __ffs(peers) - 1;
    std::int32_t start = 0;
    if (in && lane() == leader) start = chunk.counts[key];
    start = __shfl_sync(kFullMask, start, leader);
    const std::int32_t rank = start + __popc(peers & ((1u << lane()) - 1));
    if (in && lane() == leader) chunk.counts[key] = start + __popc(peers);
    __syncwarp();
    if (!in) continue;
    const auto token = static_cast<std::int32_t>(position / p.top_k);
    std::int32_t row = -1;
    if (p.capacity == 0) {
      row = begins[key] + rank;
      if (row < p.expanded_rows) source[row] = token;
    } else if (rank < p.capacity) {
      row = key * p.capacity + rank;
      source[row] = token;
    }
    p.expanded_row_idx[position] = row;
  }
}

// A warp a row of expanded_x: x's source row, or zeros for an unfilled slot.
template <typename Word>
__global__ void __launch_bounds__(kBlockThreads) gather_kernel(const InitRoutingParams p) {
  if (flagged(p.workspace)) return;
  const auto* source = reinterpret_cast<const std::int32_t*>(p.workspace + p.layout.source);
  const std::int64_t words = p.row_bytes / static_cast<std::int64_t>(sizeof(Word));
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * kBlockWarps;
  for (std::int64_t row = global_warp(); row < p.expanded_rows; row += warps) {
    const std::int32_t token = source[row];
    auto* to = reinterpret_cast<Word*>(p.expanded_x + row * p.row_bytes);
    if (token < 0) {
      for (std::int64_t w = lane(); w < words; w += kLanes) to[w] = Word{};
    } else {
      const auto* from = reinterpret_cast<const Word*>(p.x + token * p.row_bytes);
      for (std::int64_t w = lane(); w < words; w += kLanes) to[w] = from[w];
    }
  }
}

unsigned blocks_for(std::int64_t items, std::int64_t per_block) {
  return static_cast<unsigned>(
      std::clamp<std::int64_t>((items + per_block - 1) / per_block, 1, kMaxBlocks));
}

// Checks every row index (and, with bias, every id) of the call.
__global__ void __launch_bounds__(kBlockThreads) check_rows_kernel(const FinalizeRoutingParams p) {
  const std::int64_t pairs = p.num_tokens * p.top_k;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  std::int32_t bits = 0;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < pairs;
       i += stride) {
    const std::int32_t row = p.expanded_row_idx[i];
    if (row < -1 || (row == -1 && !p.capacity) || (p.capacity && row >= p.expanded_rows)) {
      bits |= kBitRowIndex;
    }
    if (p.bias && (p.expert_idx[i] < 0 || p.expert_idx[i] >= p.bias_rows)) {
      bits |= kBitBiasRow;
    }
  }
  bits = static_cast<std::int32_t>(__reduce_or_sync(kFullMask, static_cast<unsigned>(bits)));
  if (bits != 0 && lane() == 0) refuse(p.workspace, p.status, bits);
}

// A block a token, a thread a column: docs/spec.md section 13's float32 steps.
template <typename T, typename S>
__global__ void __launch_bounds__(kBlockThreads) finalize_kernel(const FinalizeRoutingParams p) {
  using Element = typename T::Storage;
  if (flagged(p.workspace)) return;
  const auto* expanded = static_cast<const Element*>(p.expanded_x);
  const auto* x1 = static_cast<const Element*>(p.x1);
  const auto* x2 = static_cast<const Element*>(p.x2);
  const auto* bias = static_cast<const Element*>(p.bias);
  const auto* scales = static_cast<const typename S::Storage*>(p.scales);
  auto* out = static_cast<Element*>(p.out);
  for (std::int64_t t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    for (std::int64_t h = threadIdx.x; h < p.hidden; h += blockDim.x) {
      const std::int64_t at = t * p.hidden + h;
      float y = 0.0f;
      if (x1) y = T::load(x1[at]);
      if (x2) y = __fadd_rn(y, T::load(x2[at]));
      for (std::int64_t j = 0; j < p.top_k; ++j) {
        const std::int64_t pair = t * p.top_k + j;
        const std::int64_t row =
            __ldg(&p.expanded_row_idx[p.row_major ? pair : j * p.num_tokens + t]);
        if (row < 0 || row >= p.expanded_rows) continue;  // dropped, or past active_num
        float value = T::load(expanded[row * p.hidden + h]);
        if (bias)
          value = __fadd_rn(value, T::load(bias[__ldg(&p.expert_idx[pair]) * p.hidden + h]));
        if (scales) value = __fmul_rn(value, S::load(scales[pair]));
        y = __fadd_rn(y, value);
      }
      out[at] = T::store(y);
    }
  }
}

template <typename T, typename S>
void launch_finalize(const FinalizeRoutingParams& p, cudaStream_t stream) {
  // A warp per 32 columns up to a full block: small H leaves no thread idle.
  const auto threads = static_cast<unsigned>(
      std::min<std::int64_t>(kBlockThreads, (p.hidden + kLanes - 1) / kLanes * kLanes));
  finalize_kernel<T, S><<<blocks_for(p.num_tokens, 1), threads, 0, stream>>>(p);
}

}  // namespace

cudaError_t launch_init_routing(const InitRoutingParams& p, cudaStream_t stream) {
  const InitRoutingWorkspace& l = p.layout;
  // The flag, the begins and the table start at zero: the counting adds to the table.
  cudaError_t error = cudaMemsetAsync(p.workspace, 0, l.source, stream);
  if (error == cudaSuccess && p.capacity > 0) {  // slots no pair fills: -1, zero rows
    error =
        cudaMemsetAsync(p.workspace + l.source, 0xff,
                        static_cast<std::size_t>(p.expanded_rows) * sizeof(std::int32_t), stream);
  }
  if (error != cudaSuccess) return error;
  if (l.num_chunks > 0) {
    count_kernel<<<blocks_for(l.num_chunks, kBlockWarps), kBlockThreads, 0, stream>>>(p);
  }
  scan_kernel<<<1, kScanThreads, 0, stream>>>(p);
  if (l.num_chunks > 0) {
    place_kernel<<<blocks_for(l.num_chunks, kBlockWarps), kBlockThreads, 0, stream>>>(p);
  }
  if (p.expanded_rows > 0) {
    const unsigned blocks = blocks_for(p.expanded_rows, kBlockWarps);
    switch (p.width) {
      case 16:
        gather_kernel<uint4><<<blocks, kBlockThreads, 0, stream>>>(p);
        break;
      case 8:
        gather_kernel<uint2><<<blocks, kBlockThreads, 0, stream>>>(p);
        break;
      case 4:
        gather_kernel<unsigned><<<blocks, kBlockThreads, 0, stream>>>(p);
        break;
      case 2:
        gather_kernel<unsigned short><<<blocks, kBlockThreads, 0, stream>>>(p);
        break;
      default:
        gather_kernel<unsigned char><<<blocks, kBlockThreads, 0, stream>>>(p);
        break;
    }
  }
  return cudaGetLastError();
}

cudaError_t launch_finalize_routing(const FinalizeRoutingParams& p, cudaStream_t stream) {
  const cudaError_t error = cudaMemsetAsync(p.workspace, 0, kFlagBytes, stream);
  if (error != cudaSuccess) return error;
  const std::int64_t pairs = p.num_tokens * p.top_k;
  if (pairs == 0) return cudaGetLastError();
  check_rows_kernel<<<std::min(blocks_for(pairs, kBlockThreads), 1024u), kBlockThreads, 0,
                      stream>>>(p);
  const bool float_scales = p.scales_dtype == FloatKind::kFloat32;
  if (p.dtype == FloatKind::kFloat16) {
    float_scales ? launch_finalize<Half, Float32>(p, stream)
                 : launch_finalize<Half, Half>(p, stream);
  } else if (p.dtype == FloatKind::kBFloat16) {
    float_scales ? launch_finalize<BFloat16, Float32>(p, stream)
                 : launch_finalize<BFloat16, BFloat16>(p, stream);
  } else {
    launch_finalize<Float32, Float32>(p, stream);
  }
  return cudaGetLastError();
}

}  // namespace moe_reroute::cuda::detail
