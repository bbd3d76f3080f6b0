// The kernels. Rows are bytes: no dtype dispatch but the counts' int width.
// The index math is in layout.h; here are the barriers, the block scans and
// the loads and stores.

#include <algorithm>
#include <cstdint>

#include "kernels.h"

namespace moe_reroute::cuda::detail {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
// 256 threads, 4 resident blocks: ptxas keeps every kernel at 64 registers.
constexpr int kMinBlocks = 4;

// Exclusive scan of (a, b) over the CTA; `scratch` holds 2 x 32 int64.
// Returns the totals; a and b become this thread's prefixes.
__device__ void block_scan(std::int64_t& a, std::int64_t& b, std::int64_t& total_a,
                           std::int64_t& total_b, std::int64_t* scratch) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int num_warps = static_cast<int>(blockDim.x) / kWarpSize;
  std::int64_t inclusive_a = a;
  std::int64_t inclusive_b = b;
  for (int offset = 1; offset < kWarpSize; offset *= 2) {
    const std::int64_t up_a = __shfl_up_sync(kFullMask, inclusive_a, offset);
    const std::int64_t up_b = __shfl_up_sync(kFullMask, inclusive_b, offset);
    if (lane >= offset) {
      inclusive_a += up_a;
      inclusive_b += up_b;
    }
  }
  if (lane == kWarpSize - 1) {
    scratch[warp] = inclusive_a;
    scratch[kWarpSize + warp] = inclusive_b;
  }
  __syncthreads();
  std::int64_t before_a = 0;
  std::int64_t before_b = 0;
  total_a = 0;
  total_b = 0;
  for (int w = 0; w < num_warps; ++w) {
    if (w == warp) {
      before_a = total_a;
      before_b = total_b;
    }
    total_a += scratch[w];
    total_b += scratch[kWarpSize + w];
  }
  a = before_a + inclusive_a - a;
  b = before_b + inclusive_b - b;
  __syncthreads();  // scratch is reused by the next scan
}

// The phases of layout.h with a barrier between each; every thread of the
// CTA returns the same Totals. expert_token_num is written through `etn`
// (null: not by this CTA) only when the counts are good.
template <typename Count>
__device__ Totals build_tables(const KernelParams& p, const Tables& t, Count* etn,
                               std::int64_t* scratch) {
  const Layout& l = p.layout;
  const int thread = static_cast<int>(threadIdx.x);
  const int threads = static_cast<int>(blockDim.x);
  const std::int32_t seen = load_counts(l, static_cast<const Count*>(p.counts), t, thread, threads);
  const int negative = __syncthreads_or(seen & kBitNegative);
  const int too_large = __syncthreads_or(seen & kBitSum);
  SliceSums prefix = slice_sums(l, t, thread, threads);
  std::int64_t total = 0;
  std::int64_t same_total = 0;
  block_scan(prefix.rank, prefix.expert, total, same_total, scratch);
  write_begins(l, t, thread, threads, prefix);
  __syncthreads();
  std::int64_t pad_prefix = slice_pads(l, t, thread, threads, total);
  std::int64_t unused = 0;
  std::int64_t pad_total = 0;
  std::int64_t unused_total = 0;
  block_scan(pad_prefix, unused, pad_total, unused_total, scratch);
  const std::int32_t status =
      status_bits(l, (negative ? kBitNegative : 0) | (too_large ? kBitSum : 0), total);
  write_pads(l, t, thread, threads, total, pad_prefix, status == 0 ? etn : nullptr, p.cumsum);
  __syncthreads();
  add_pads(l, t, thread, threads);
  __syncthreads();
  return {narrow(total), narrow(l.forward ? total + pad_total : total), status};
}

// Output word w is 16 bytes at 4 * Q + bits / 8 of aligned input words w
// and w + 1; words + 1 aligned words are read, each holding needed bytes.
// The upper word comes from the next lane (lane 31: the next group's lane 0,
// or one more load at the end).
__device__ Word word_of(const uint4& v) { return {v.x, v.y, v.z, v.w}; }

__device__ uint4 shuffle(const uint4& v, int from) {
  return make_uint4(__shfl_sync(kFullMask, v.x, from), __shfl_sync(kFullMask, v.y, from),
                    __shfl_sync(kFullMask, v.z, from), __shfl_sync(kFullMask, v.w, from));
}

// Evict-first stores only where the call's bytes pass the L2 (streaming_stores).
// A template argument of the kernels: a choice at run time costs the fused
// kernel spills.
template <bool Streaming>
__device__ void store_word(uint4* to, const uint4& v) {
  if constexpr (Streaming) {
    __stcs(to, v);
  } else {
    *to = v;
  }
}

template <int Q, bool Streaming>
__device__ void store_shifted(uint4* to, const uint4& lo, const uint4& hi, int bits) {
  const Word word = shifted_word<Q>(word_of(lo), word_of(hi), bits);
  store_word<Streaming>(to, make_uint4(word.x, word.y, word.z, word.w));
}

// Output word w is 16 bytes at 4 * Q + bits / 8 of aligned input words w
// and w + 1; words + 1 aligned words are read, each holding needed bytes.
// The upper word comes from the next lane; lane 31 takes the next group's
// lane 0 or loads it.
template <int Q, bool Streaming>
__device__ void shifted_move(uint4* out, const uint4* in, std::int32_t words, int bits, int lane) {
  constexpr int kWordsInFlight = kShiftedWordsInFlight;
  constexpr std::int32_t kStep = kWarpSize * kWordsInFlight;
  const int from = (lane + 1) % kWarpSize;
  const bool edge = lane == kWarpSize - 1;
  const std::int32_t whole = words - words % kStep;
  for (std::int32_t first = 0; first < whole; first += kStep) {
    uint4 v[kWordsInFlight];
#pragma unroll
    for (int u = 0; u < kWordsInFlight; ++u) v[u] = __ldcs(in + first + lane + u * kWarpSize);
    // In bounds: first + kStep <= whole <= words.
    const uint4 last = edge ? __ldcs(in + first + kStep) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < kWordsInFlight; ++u) {
      // Lane 0 hands lane 31 its word u + 1 (the last u: lane 31 has `last`).
      uint4 hi = shuffle(lane != 0 ? v[u] : v[u + 1 < kWordsInFlight ? u + 1 : u], from);
      if (edge && u + 1 == kWordsInFlight) hi = last;
      store_shifted<Q, Streaming>(out + first + lane + u * kWarpSize, v[u], hi, bits);
    }
  }
  for (std::int32_t first = whole; first < words; first += kWarpSize) {
    const std::int32_t w = first + lane;
    const uint4 lo = w <= words ? __ldcs(in + w) : make_uint4(0, 0, 0, 0);
    uint4 hi = shuffle(lo, from);
    if (edge && w < words) hi = __ldcs(in + w + 1);
    if (w < words) store_shifted<Q, Streaming>(out + w, lo, hi, bits);
  }
}

// The 16-byte words of a warp_move, from src (null: zeros) to the aligned `out`.
template <bool Streaming>
__device__ void move_words(uint4* out, const std::byte* src, const ByteSplit& split, int lane) {
  const std::int32_t words = split.words;
  constexpr std::int32_t kStep = kWarpSize * kWordsInFlight;
  if (src == nullptr) {
    for (std::int32_t w = lane; w < words; w += kWarpSize)
      store_word<Streaming>(out + w, make_uint4(0, 0, 0, 0));
    return;
  }
  if (split.shift == 0) {
    // Whole steps of kWordsInFlight loads a lane, then the rest, predicated,
    // every load before the first store.
    const uint4* in = reinterpret_cast<const uint4*>(src + split.head) + lane;
    uint4* to = out + lane;
    const std::int32_t whole = words - words % kStep;
    for (std::int32_t w = 0; w < whole; w += kStep) {
      uint4 v[kWordsInFlight];
#pragma unroll
      for (int u = 0; u < kWordsInFlight; ++u) v[u] = __ldcs(in + w + u * kWarpSize);
#pragma unroll
      for (int u = 0; u < kWordsInFlight; ++u) store_word<Streaming>(to + w + u * kWarpSize, v[u]);
    }
    uint4 rest[kWordsInFlight];
#pragma unroll
    for (int u = 0; u < kWordsInFlight; ++u) {
      const bool inside = whole + lane + u * kWarpSize < words;
      rest[u] = inside ? __ldcs(in + whole + u * kWarpSize) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kWordsInFlight; ++u) {
      if (whole + lane + u * kWarpSize < words)
        store_word<Streaming>(to + whole + u * kWarpSize, rest[u]);
    }
    return;
  }
  const auto* in = reinterpret_cast<const uint4*>(src + split.head - split.shift);
  const int bits = (split.shift & 3) * 8;
  switch (split.shift >> 2) {
    case 0:
      shifted_move<0, Streaming>(out, in, words, bits, lane);
      break;
    case 1:
      shifted_move<1, Streaming>(out, in, words, bits, lane);
      break;
    case 2:
      shifted_move<2, Streaming>(out, in, words, bits, lane);
      break;
    default:
      shifted_move<3, Streaming>(out, in, words, bits, lane);
  }
}

// The warp moves n bytes to dst from src (null: zeros): single bytes up to
// an aligned dst, 16-byte words, single bytes after.
template <bool Streaming>
__device__ void warp_move(std::byte* dst, const std::byte* src, std::int32_t n, int lane) {
  const ByteSplit split =
      split_bytes(reinterpret_cast<std::uintptr_t>(dst), reinterpret_cast<std::uintptr_t>(src), n);
  if (lane < split.head) dst[lane] = src == nullptr ? std::byte{0} : src[lane];
  const std::int32_t after = split.head + split.words * 16;
  if (lane < split.tail) dst[after + lane] = src == nullptr ? std::byte{0} : src[after + lane];
  move_words<Streaming>(reinterpret_cast<uint4*>(dst + split.head), src, split, lane);
}

// Not unrolled: the rows are short, and unrolled loops of five widths for
// two tensors would keep their trip counts in registers across the tiles.
template <typename W>
__device__ void copy_row_words(std::byte* dst, const std::byte* src, std::int32_t words) {
  auto* to = reinterpret_cast<W*>(dst);
  const auto* from = reinterpret_cast<const W*>(src);
#pragma unroll 1
  for (std::int32_t w = 0; w < words; ++w) to[w] = src == nullptr ? W{} : from[w];
}

// One thread moves one small row (a scale or weight row) or zero-fills it.
__device__ void move_small_row(const RowMove& m, std::int32_t dst_row, std::int32_t src_row) {
  if (m.dst == nullptr) return;
  std::byte* dst = m.dst + static_cast<std::int64_t>(dst_row) * m.row_bytes;
  const std::byte* src = m.src == nullptr || src_row < 0
                             ? nullptr
                             : m.src + static_cast<std::int64_t>(src_row) * m.row_bytes;
  switch (m.width) {
    case 16:
      copy_row_words<uint4>(dst, src, m.words);
      break;
    case 8:
      copy_row_words<uint2>(dst, src, m.words);
      break;
    case 4:
      copy_row_words<std::uint32_t>(dst, src, m.words);
      break;
    case 2:
      copy_row_words<std::uint16_t>(dst, src, m.words);
      break;
    default:
      copy_row_words<std::uint8_t>(dst, src, m.words);
  }
}

// Task i of small_tasks(): a small row (scales, weight) and an index entry.
__device__ void move_small(const KernelParams& p, const Tables& t, const Totals& totals,
                           std::int32_t i) {
  const SmallTask task = small_task(t, p.layout.num_blocks(), p.index, totals, i);
  if (task.dst_row >= 0) {
    move_small_row(p.scales, task.dst_row, task.src_row);
    move_small_row(p.weight, task.dst_row, task.src_row);
  }
  if (task.index_at >= 0) p.index_data[task.index_at] = task.index_value;
}

// This thread's share of the call, grid-strided by warp over what the tables
// say exists: the token tiles (a warp each), then the small tasks (32 a warp,
// none when there are no scales, weights or index to write).
template <bool Streaming>
__device__ void move(const KernelParams& p, const Tables& t, const Totals& totals) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const bool any_small = p.scales.dst != nullptr || p.weight.dst != nullptr || p.index.present;
  const MoveTasks tasks = move_tasks(p.tiles, totals, p.index, any_small);
  const auto warp = static_cast<std::int32_t>((blockIdx.x * blockDim.x + threadIdx.x) / kWarpSize);
  const auto warps = static_cast<std::int32_t>(gridDim.x * blockDim.x / kWarpSize);
  for (std::int32_t tile = warp; tile < tasks.num_tiles;
       tile = next_index(tile, warps, tasks.num_tiles)) {
    const TileSpan span = tile_span(p.tiles, tile);
    const std::int32_t src_row = source_of(t, p.layout.num_blocks(), span.row).src_row;
    const std::int64_t row_bytes = p.tiles.row_bytes;
    std::byte* dst = p.tokens.dst + static_cast<std::int64_t>(span.row) * row_bytes + span.begin;
    const std::byte* src =
        src_row < 0 ? nullptr
                    : p.tokens.src + static_cast<std::int64_t>(src_row) * row_bytes + span.begin;
    warp_move<Streaming>(dst, src, span.bytes, lane);
  }
  const std::int32_t groups = tasks.num_groups();
  for (std::int32_t group = tasks.first_group(warp, warps); group < groups;
       group = next_index(group, warps, groups)) {
    const std::int32_t i = group * kWarpSize + lane;  // at most 2^31 - 1
    if (i < tasks.num_small) move_small(p, t, totals, i);
  }
}

template <typename Count, bool Streaming>
__global__ void __launch_bounds__(kThreads, kMinBlocks) fused_kernel(KernelParams p) {
  extern __shared__ std::int32_t table_words_smem[];
  __shared__ std::int64_t scratch[2 * kWarpSize];
  const Tables t = tables_at(table_words_smem, p.layout.num_blocks());
  Count* etn = blockIdx.x == 0 ? static_cast<Count*>(p.expert_token_num) : nullptr;
  const Totals totals = build_tables<Count>(p, t, etn, scratch);
  if (totals.status != 0) {
    if (blockIdx.x == 0 && threadIdx.x == 0) atomicOr(p.status, totals.status);
    return;
  }
  move<Streaming>(p, t, totals);
}

// The workspace of the two-kernel path: Totals (kTotalsBytes), then the tables.
__device__ Totals* totals_at(void* workspace) { return static_cast<Totals*>(workspace); }
__device__ Tables workspace_tables(const KernelParams& p) {
  return tables_at(
      reinterpret_cast<std::int32_t*>(static_cast<std::byte*>(p.workspace) + kTotalsBytes),
      p.layout.num_blocks());
}

template <typename Count>
__global__ void __launch_bounds__(kTablesThreads, 1) tables_kernel(KernelParams p) {
#if __CUDA_ARCH__ >= 900
  // The move kernel's CTAs may start; they wait for this grid's memory.
  cudaTriggerProgrammaticLaunchCompletion();
#endif
  __shared__ std::int64_t scratch[2 * kWarpSize];
  const Totals totals =
      build_tables<Count>(p, workspace_tables(p), static_cast<Count*>(p.expert_token_num), scratch);
  if (threadIdx.x == 0) {
    *totals_at(p.workspace) = totals;
    if (totals.status != 0) atomicOr(p.status, totals.status);
  }
}

template <bool Streaming>
__global__ void __launch_bounds__(kThreads, kMinBlocks) move_kernel(KernelParams p) {
  // 900 is kProgrammaticArch: the host overlaps the two kernels only where
  // the code it finds for this kernel was compiled with this wait.
#if __CUDA_ARCH__ >= 900
  cudaGridDependencySynchronize();
#endif
  const Totals totals = *totals_at(p.workspace);
  if (totals.status != 0) return;
  move<Streaming>(p, workspace_tables(p), totals);
}

template <typename Kernel>
cudaError_t occupancy(Kernel kernel, int threads, int& blocks) {
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, 0);
}

// Raises the fused kernel's dynamic shared-memory limit and returns its
// occupancy without shared memory, the smaller of its two store variants.
template <typename Count>
cudaError_t fused_limits(int& blocks) {
  const auto dynamic = static_cast<int>(kMaxFusedSmemBytes);
  int streaming = 0;
  cudaError_t error = cudaFuncSetAttribute(fused_kernel<Count, false>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, dynamic);
  if (error == cudaSuccess) {
    error = cudaFuncSetAttribute(fused_kernel<Count, true>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, dynamic);
  }
  if (error == cudaSuccess) error = occupancy(fused_kernel<Count, false>, kThreads, blocks);
  if (error == cudaSuccess) error = occupancy(fused_kernel<Count, true>, kThreads, streaming);
  blocks = std::min(blocks, streaming);
  return error;
}

template <typename Count, bool Streaming>
void launch_fused(const KernelParams& params, const LaunchPlan& plan, cudaStream_t stream) {
  fused_kernel<Count, Streaming>
      <<<static_cast<unsigned>(plan.grid), kThreads, plan.smem_bytes, stream>>>(params);
}

}  // namespace

cudaError_t query_limits(int device, DeviceLimits& limits) {
  cudaDeviceProp prop;
  cudaError_t error = cudaGetDeviceProperties(&prop, device);
  if (error != cudaSuccess) return error;
  limits.num_sms = prop.multiProcessorCount;
  limits.smem_per_sm = prop.sharedMemPerMultiprocessor;
  limits.reserved_smem_per_block = prop.reservedSharedMemPerBlock;
  limits.l2_bytes = static_cast<std::size_t>(prop.l2CacheSize);
  cudaFuncAttributes move = {};
  error = cudaFuncGetAttributes(&move, move_kernel<true>);
  if (error != cudaSuccess) return error;
  limits.programmatic_launch = programmatic_launch(move.binaryVersion, move.ptxVersion);
  error = fused_limits<std::int32_t>(limits.fused_occupancy[0]);
  if (error == cudaSuccess) error = fused_limits<std::int64_t>(limits.fused_occupancy[1]);
  int streaming = 0;
  if (error == cudaSuccess) error = occupancy(move_kernel<false>, kThreads, limits.move_occupancy);
  if (error == cudaSuccess) error = occupancy(move_kernel<true>, kThreads, streaming);
  limits.move_occupancy = std::min(limits.move_occupancy, streaming);
  return error;
}

cudaError_t launch(const KernelParams& params, const LaunchPlan& plan, cudaStream_t stream) {
  if (plan.fused) {
    if (plan.int64_counts) {
      plan.streaming ? launch_fused<std::int64_t, true>(params, plan, stream)
                     : launch_fused<std::int64_t, false>(params, plan, stream);
    } else {
      plan.streaming ? launch_fused<std::int32_t, true>(params, plan, stream)
                     : launch_fused<std::int32_t, false>(params, plan, stream);
    }
    return cudaGetLastError();
  }
  if (plan.int64_counts) {
    tables_kernel<std::int64_t><<<1, kTablesThreads, 0, stream>>>(params);
  } else {
    tables_kernel<std::int32_t><<<1, kTablesThreads, 0, stream>>>(params);
  }
  cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) return error;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(plan.grid));
  config.blockDim = dim3(kThreads);
  config.stream = stream;
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = plan.programmatic ? 1 : 0;
  return plan.streaming ? cudaLaunchKernelEx(&config, move_kernel<true>, params)
                        : cudaLaunchKernelEx(&config, move_kernel<false>, params);
}

}  // namespace moe_reroute::cuda::detail
