#pragma once

// The index math of the CUDA kernels, in __host__ __device__ functions so that
// the CPU tests run exactly what the device runs (tests/cuda/layout_test.cc)
// and only the loads and stores are left to a GPU.
//
// A call builds three int32 tables over the N x E blocks, indexed by a block's
// position in output order (forward: expert-major, inverse: rank-major):
// its clamped count, where it begins in the output and where it begins in the
// input (the expert-order side padded to the alignment, from a fourth table
// of the pad rows before each expert). The build is a sequence of phases,
// each a function of (thread, threads); the kernels put a barrier between
// phases, the tests a loop.

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define MOE_REROUTE_HD __host__ __device__ __forceinline__
#else
#define MOE_REROUTE_HD inline
#endif

namespace moe_reroute::cuda::detail {

inline constexpr int kWarpSize = 32;
inline constexpr int kThreads = 256;         // the fused and the move kernel
inline constexpr int kTablesThreads = 1024;  // the tables kernel of the two-kernel path
// Four 16-byte words in flight per lane: one tile is what a warp moves at once.
inline constexpr int kWordsInFlight = 4;
inline constexpr std::int64_t kTileBytes = kWarpSize * 16 * kWordsInFlight;
// Rows whose source and destination disagree mod 16 keep two in flight: the
// shifted words need their neighbours too, and four would pass 64 registers.
inline constexpr int kShiftedWordsInFlight = 2;
// Up to this many blocks the tables live in each CTA's shared memory and a
// call is one launch; past it they go to the workspace (two launches).
inline constexpr std::int64_t kMaxFusedBlocks = 8192;
inline constexpr std::int32_t kInt32Max = 2147483647;

/// Status bits a kernel ORs into the status word (mirrors cuda.h's StatusBit).
inline constexpr std::int32_t kBitNegative = 1;
inline constexpr std::int32_t kBitSum = 2;

/// What the table build needs: shapes and attributes, all from the host.
struct Layout {
  std::int32_t num_ranks = 0;    // N
  std::int32_t num_experts = 0;  // E
  std::int64_t num_tokens = 0;   // A: the rows in rank order
  std::int64_t expert_alignment = 1;
  bool allow_spare_rows = false;
  bool forward = true;
  MOE_REROUTE_HD std::int32_t num_blocks() const { return num_ranks * num_experts; }
};

/// The tables, int32 each: count, out_begin, in_begin [N * E] and pad_before [E].
struct Tables {
  std::int32_t* count = nullptr;
  std::int32_t* out_begin = nullptr;
  std::int32_t* in_begin = nullptr;
  std::int32_t* pad_before = nullptr;
};

/// int32 words the tables take for N x E blocks.
MOE_REROUTE_HD std::int64_t table_words(std::int64_t num_ranks, std::int64_t num_experts) {
  return 3 * num_ranks * num_experts + num_experts;
}

/// Carves the tables out of `words` (at least table_words).
MOE_REROUTE_HD Tables tables_at(std::int32_t* words, std::int32_t num_blocks) {
  return {words, words + num_blocks, words + 2 * num_blocks, words + 3 * num_blocks};
}

/// Thread `thread` of `threads` owns [begin, end) of [0, n): contiguous slices.
struct Slice {
  std::int32_t begin = 0;
  std::int32_t end = 0;
};
MOE_REROUTE_HD Slice slice_of(std::int32_t n, int thread, int threads) {
  const std::int32_t per = (n + threads - 1) / threads;
  const std::int64_t begin = static_cast<std::int64_t>(per) * thread;
  const std::int64_t end = begin + per;
  return {static_cast<std::int32_t>(begin < n ? begin : n),
          static_cast<std::int32_t>(end < n ? end : n)};
}

/// Block (r, e) walked in rank order (i = r * E + e) or expert order
/// (i = e * N + r), and its position in the tables (output order).
struct BlockWalk {
  std::int32_t rank = 0;
  std::int32_t expert = 0;
};
MOE_REROUTE_HD std::int32_t position(const Layout& l, BlockWalk b) {
  return l.forward ? b.expert * l.num_ranks + b.rank : b.rank * l.num_experts + b.expert;
}
MOE_REROUTE_HD BlockWalk rank_order_block(const Layout& l, std::int32_t i) {
  return {i / l.num_experts, i % l.num_experts};
}
MOE_REROUTE_HD BlockWalk expert_order_block(const Layout& l, std::int32_t i) {
  return {i % l.num_ranks, i / l.num_ranks};
}
MOE_REROUTE_HD void next_in_rank_order(const Layout& l, BlockWalk& b) {
  if (++b.expert == l.num_experts) {
    b.expert = 0;
    ++b.rank;
  }
}
MOE_REROUTE_HD void next_in_expert_order(const Layout& l, BlockWalk& b) {
  if (++b.rank == l.num_ranks) {
    b.rank = 0;
    ++b.expert;
  }
}

/// Phase 1: loads the counts (row-major [N, E], coalesced) clamped into
/// [0, A], so that no later sum can overflow or go negative; returns the
/// status bits this thread saw (a negative count, a count past A).
template <typename Count>
MOE_REROUTE_HD std::int32_t load_counts(const Layout& l, const Count* counts, const Tables& t,
                                        int thread, int threads) {
  std::int32_t bits = 0;
  for (std::int32_t i = thread; i < l.num_blocks(); i += threads) {
    const Count raw = counts[i];
    std::int64_t count = static_cast<std::int64_t>(raw);
    if (raw < 0) {
      bits |= kBitNegative;
      count = 0;
    } else if (count > l.num_tokens) {
      bits |= kBitSum;
      count = l.num_tokens;
    }
    t.count[position(l, rank_order_block(l, i))] = static_cast<std::int32_t>(count);
  }
  return bits;
}

/// Phase 2: the sums of this thread's slice, in rank order and in expert order.
struct SliceSums {
  std::int64_t rank = 0;
  std::int64_t expert = 0;
};
MOE_REROUTE_HD SliceSums slice_sums(const Layout& l, const Tables& t, int thread, int threads) {
  const Slice s = slice_of(l.num_blocks(), thread, threads);
  SliceSums sums;
  BlockWalk by_rank = rank_order_block(l, s.begin);
  BlockWalk by_expert = expert_order_block(l, s.begin);
  for (std::int32_t i = s.begin; i < s.end; ++i) {
    sums.rank += t.count[position(l, by_rank)];
    sums.expert += t.count[position(l, by_expert)];
    next_in_rank_order(l, by_rank);
    next_in_expert_order(l, by_expert);
  }
  return sums;
}

// Offsets past int32 only occur with bad counts, whose tables are never read.
MOE_REROUTE_HD std::int32_t narrow(std::int64_t value) {
  return static_cast<std::int32_t>(value < kInt32Max ? value : kInt32Max);
}

/// Phase 3: the exclusive scans, from this thread's prefixes of the block
/// scan of phase 2; the expert-order begins are still without padding.
MOE_REROUTE_HD void write_begins(const Layout& l, const Tables& t, int thread, int threads,
                                 SliceSums prefix) {
  const Slice s = slice_of(l.num_blocks(), thread, threads);
  std::int32_t* rank_begin = l.forward ? t.in_begin : t.out_begin;
  std::int32_t* expert_begin = l.forward ? t.out_begin : t.in_begin;
  BlockWalk by_rank = rank_order_block(l, s.begin);
  BlockWalk by_expert = expert_order_block(l, s.begin);
  for (std::int32_t i = s.begin; i < s.end; ++i) {
    const std::int32_t rank_position = position(l, by_rank);
    const std::int32_t expert_position = position(l, by_expert);
    rank_begin[rank_position] = narrow(prefix.rank);
    expert_begin[expert_position] = narrow(prefix.expert);
    prefix.rank += t.count[rank_position];
    prefix.expert += t.count[expert_position];
    next_in_rank_order(l, by_rank);
    next_in_expert_order(l, by_expert);
  }
}

/// c_e, from the unpadded expert-order begins of phase 3 (total = sum of c).
MOE_REROUTE_HD std::int64_t expert_total(const Layout& l, const Tables& t, std::int32_t expert,
                                         std::int64_t total) {
  const std::int32_t* expert_begin = l.forward ? t.out_begin : t.in_begin;
  const std::int64_t begin = expert_begin[position(l, {0, expert})];
  const std::int64_t end =
      expert + 1 < l.num_experts ? expert_begin[position(l, {0, expert + 1})] : total;
  return end - begin;
}

MOE_REROUTE_HD std::int64_t pad_rows(const Layout& l, std::int64_t expert_rows) {
  const std::int64_t over = expert_rows % l.expert_alignment;
  return over == 0 ? 0 : l.expert_alignment - over;
}

/// Phase 4: the pad rows of this thread's slice of the experts.
MOE_REROUTE_HD std::int64_t slice_pads(const Layout& l, const Tables& t, int thread, int threads,
                                       std::int64_t total) {
  const Slice s = slice_of(l.num_experts, thread, threads);
  std::int64_t pads = 0;
  for (std::int32_t e = s.begin; e < s.end; ++e) pads += pad_rows(l, expert_total(l, t, e, total));
  return pads;
}

/// Phase 5: pad_before[e] from this thread's prefix of the phase-4 scan, and,
/// when `expert_token_num` is given, c_e (count mode) or the end of expert e's
/// padded segment (cumsum mode).
template <typename Count>
MOE_REROUTE_HD void write_pads(const Layout& l, const Tables& t, int thread, int threads,
                               std::int64_t total, std::int64_t pad_prefix, Count* expert_token_num,
                               bool cumsum) {
  const Slice s = slice_of(l.num_experts, thread, threads);
  const std::int32_t* expert_begin = l.forward ? t.out_begin : t.in_begin;
  for (std::int32_t e = s.begin; e < s.end; ++e) {
    const std::int64_t rows = expert_total(l, t, e, total);
    const std::int64_t pads = pad_rows(l, rows);
    t.pad_before[e] = narrow(pad_prefix);
    if (expert_token_num != nullptr) {
      const std::int64_t end = expert_begin[position(l, {0, e})] + pad_prefix + rows + pads;
      expert_token_num[e] = static_cast<Count>(cumsum ? end : rows);
    }
    pad_prefix += pads;
  }
}

/// Phase 6: the pads before each expert added to its expert-order begins.
MOE_REROUTE_HD void add_pads(const Layout& l, const Tables& t, int thread, int threads) {
  if (l.expert_alignment == 1) return;
  const Slice s = slice_of(l.num_blocks(), thread, threads);
  std::int32_t* expert_begin = l.forward ? t.out_begin : t.in_begin;
  BlockWalk b = expert_order_block(l, s.begin);
  for (std::int32_t i = s.begin; i < s.end; ++i) {
    const std::int32_t p = position(l, b);
    expert_begin[p] = narrow(static_cast<std::int64_t>(expert_begin[p]) + t.pad_before[b.expert]);
    next_in_expert_order(l, b);
  }
}

/// The call's verdict from the OR of phase 1's bits and the sum of the
/// clamped counts: 0 when every output may be written.
MOE_REROUTE_HD std::int32_t status_bits(const Layout& l, std::int32_t bits, std::int64_t total) {
  const bool sum_bad = l.allow_spare_rows ? total > l.num_tokens : total != l.num_tokens;
  return bits | (sum_bad ? kBitSum : 0);
}

/// What the tables say about the call, once built (the rows are exact when
/// status is 0: then they are at most R, which the host bounds by int32).
struct Totals {
  std::int32_t valid_rows = 0;   // sum of c: rows read (forward) or written (inverse)
  std::int32_t output_rows = 0;  // forward: sum of p (valid and pad rows); inverse: sum of c
  std::int32_t status = 0;
};

/// Where output row `row` (< Totals::output_rows) comes from.
struct RowSource {
  std::int32_t src_row = -1;  // -1: a pad row (zeros)
};

/// The last position at or below `row` in out_begin (non-decreasing, [0] = 0)
/// holds it; the zero-count blocks sharing its begin come before it. Rows
/// past the block's count are the pad rows after its expert.
MOE_REROUTE_HD RowSource source_of(const Tables& t, std::int32_t num_blocks, std::int32_t row) {
  std::int32_t lo = 0;
  std::int32_t hi = num_blocks - 1;
  while (lo < hi) {
    const std::int32_t mid = lo + (hi - lo + 1) / 2;
    if (t.out_begin[mid] <= row) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const std::int32_t into = row - t.out_begin[lo];
  return {into < t.count[lo] ? t.in_begin[lo] + into : -1};
}

/// The token tiles of a call: each output row is cut into tiles_per_row
/// tiles of tile_bytes (a multiple of 16); tile indices fit in int32.
struct TileShape {
  std::int64_t row_bytes = 0;
  std::int64_t tile_bytes = kTileBytes;
  std::int32_t tiles_per_row = 0;
  bool operator==(const TileShape& other) const = default;
};

struct TileSpan {
  std::int32_t row = 0;
  std::int64_t begin = 0;  // byte offset in the row
  std::int32_t bytes = 0;  // tile_shape keeps tiles below 2^31 bytes
};

MOE_REROUTE_HD TileSpan tile_span(const TileShape& shape, std::int32_t tile) {
  const std::int32_t row = tile / shape.tiles_per_row;
  const std::int64_t begin =
      static_cast<std::int64_t>(tile - row * shape.tiles_per_row) * shape.tile_bytes;
  const std::int64_t left = shape.row_bytes - begin;
  return {row, begin, static_cast<std::int32_t>(left < shape.tile_bytes ? left : shape.tile_bytes)};
}

/// How a warp moves n bytes to dst: `head` single bytes up to a 16-byte
/// aligned dst, `words` 16-byte stores, `tail` single bytes. The stored words
/// come from aligned 16-byte loads of src, shifted right by `shift` bytes
/// (src + head - shift is 16-byte aligned) when src and dst disagree mod 16.
struct ByteSplit {
  std::int32_t head = 0;
  std::int32_t words = 0;
  std::int32_t tail = 0;
  int shift = 0;
};

MOE_REROUTE_HD ByteSplit split_bytes(std::uintptr_t dst, std::uintptr_t src, std::int32_t n) {
  ByteSplit split;
  const auto to_aligned = static_cast<std::int32_t>((16 - (dst & 15)) & 15);
  split.head = to_aligned < n ? to_aligned : n;
  split.words = (n - split.head) / 16;
  split.tail = n - split.head - split.words * 16;
  split.shift = static_cast<int>((src + static_cast<std::uintptr_t>(split.head)) & 15);
  return split;
}

/// The low 32 bits of (hi:lo) >> bits, bits in [0, 32): __funnelshift_r.
MOE_REROUTE_HD std::uint32_t funnel_right(std::uint32_t lo, std::uint32_t hi, int bits) {
#if defined(__CUDA_ARCH__)
  return __funnelshift_r(lo, hi, static_cast<unsigned>(bits));
#else
  return static_cast<std::uint32_t>(((static_cast<std::uint64_t>(hi) << 32) | lo) >> bits);
#endif
}

/// Four 32-bit lanes of a 16-byte word.
struct Word {
  std::uint32_t x, y, z, w;
};

/// Part k of the eight 32-bit parts of lo:hi.
template <int K>
MOE_REROUTE_HD std::uint32_t part(const Word& lo, const Word& hi) {
  const Word& word = K < 4 ? lo : hi;
  return (K & 3) == 0 ? word.x : (K & 3) == 1 ? word.y : (K & 3) == 2 ? word.z : word.w;
}

/// The 16 bytes at byte 4 * Q + bits / 8 of the 32 bytes lo:hi (little
/// endian); Q is a template argument so that no part is selected at run time.
template <int Q>
MOE_REROUTE_HD Word shifted_word(const Word& lo, const Word& hi, int bits) {
  return {funnel_right(part<Q>(lo, hi), part<Q + 1>(lo, hi), bits),
          funnel_right(part<Q + 1>(lo, hi), part<Q + 2>(lo, hi), bits),
          funnel_right(part<Q + 2>(lo, hi), part<Q + 3>(lo, hi), bits),
          funnel_right(part<Q + 3>(lo, hi), part<Q + 4>(lo, hi), bits)};
}

/// One thread's part of the small rows (scales, weight) and the index of a
/// call, task i of small_tasks(): which output row it fills from which input
/// row (src_row -1: zeros; dst_row -1: none), and which index entry it writes.
struct SmallTask {
  std::int32_t dst_row = -1;
  std::int32_t src_row = -1;
  std::int32_t index_at = -1;  // -1: no index entry
  std::int32_t index_value = -1;
};

struct IndexMode {
  bool present = false;          // the forward writes permute_token_idx
  bool gather = true;            // idx_type 0
  std::int32_t output_rows = 0;  // R: the rows of the forward's outputs
  std::int32_t input_rows = 0;   // A: the rows of its inputs
};

/// Forward gather: one task per output row (tail rows only get index -1);
/// scatter: one per valid or pad row, then one per spare input row (index
/// -1); no index (inverse): one per valid row.
MOE_REROUTE_HD std::int32_t small_tasks(const IndexMode& index, const Totals& totals) {
  if (!index.present) return totals.output_rows;
  if (index.gather) return index.output_rows;
  return totals.output_rows + (index.input_rows - totals.valid_rows);
}

MOE_REROUTE_HD SmallTask small_task(const Tables& t, std::int32_t num_blocks,
                                    const IndexMode& index, const Totals& totals,
                                    std::int32_t task) {
  SmallTask s;
  if (task < totals.output_rows) {
    s.dst_row = task;
    s.src_row = source_of(t, num_blocks, task).src_row;
    if (index.present && (index.gather || s.src_row >= 0)) {
      s.index_at = index.gather ? task : s.src_row;
      s.index_value = index.gather ? s.src_row : task;
    }
  } else {
    s.index_at = index.gather ? task : totals.valid_rows + (task - totals.output_rows);
  }
  return s;
}

/// The warp tasks of a call's moves, walked grid-stride by warp: the token
/// tiles (a warp each), then groups of 32 small tasks. Each count fits int32
/// (tile_shape, small_tasks) but their sum need not (2^31 - 1 rows of up to
/// 2 KiB are about that many tiles), so they are two walks whose steps stop
/// at the end instead of wrapping; 64-bit counters would cost the fused
/// kernel spills.
struct MoveTasks {
  std::int32_t num_tiles = 0;
  std::int32_t num_small = 0;
  MOE_REROUTE_HD std::int32_t num_groups() const {
    return num_small / kWarpSize + (num_small % kWarpSize != 0 ? 1 : 0);
  }
  /// Where warp `warp` of `warps` starts on the groups: where one walk over
  /// the tiles and then the groups would take it.
  MOE_REROUTE_HD std::int32_t first_group(std::int32_t warp, std::int32_t warps) const {
    return (warp + warps - num_tiles % warps) % warps;
  }
};

/// `any_small`: the call has scales, weights or an index to write (else no
/// small task runs).
MOE_REROUTE_HD MoveTasks move_tasks(const TileShape& tiles, const Totals& totals,
                                    const IndexMode& index, bool any_small) {
  return {totals.output_rows * tiles.tiles_per_row, any_small ? small_tasks(index, totals) : 0};
}

/// `index` + `step`, or `end` where that would pass it: never past int32.
MOE_REROUTE_HD std::int32_t next_index(std::int32_t index, std::int32_t step, std::int32_t end) {
  return index < end - step ? index + step : end;
}

}  // namespace moe_reroute::cuda::detail
