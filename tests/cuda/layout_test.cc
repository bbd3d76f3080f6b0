// The CUDA kernels' index math (src/cuda/layout.h) on the CPU: the table
// build run phase by phase for every thread of a block, then every token
// tile and small task of the call moved with memcpy as the kernels move them
// (head bytes, aligned or shifted 16-byte words, tail bytes), against the
// naive reference, byte for byte, over the static-shape sweep. Only the
// device's loads and stores are left to a GPU.

#include "cuda/layout.h"

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "reference.h"
#include "workload.h"

namespace moe_reroute::cuda::detail {
namespace {

using testing::kPoison;

// Host bytes at `offset` past a 16-byte aligned base, so that the split and
// the shifted words see every alignment.
class Buffer {
 public:
  Buffer(std::size_t bytes, std::size_t offset)
      : storage_(bytes + offset + 32, kPoison),
        offset_(offset + (16 - base() % 16) % 16),
        bytes_(bytes) {}
  std::byte* data() { return storage_.data() + offset_; }
  const std::byte* data() const { return storage_.data() + offset_; }
  std::size_t size() const { return bytes_; }

 private:
  std::uintptr_t base() const { return reinterpret_cast<std::uintptr_t>(storage_.data()); }
  std::vector<std::byte> storage_;
  std::size_t offset_;
  std::size_t bytes_;
};

struct Case {
  bool forward = true;
  std::int64_t num_ranks = 2;
  std::int64_t num_experts = 3;
  std::int64_t num_tokens = 6;  // A
  std::int64_t valid_rows = 6;  // sum of the counts (< A: spare rows)
  std::int64_t token_row_bytes = 14;
  std::int64_t scale_row_bytes = 0;  // 0: no scales
  bool weight = true;
  std::int64_t alignment = 1;
  bool gather = true;
  bool cumsum = false;
  bool int64_counts = false;
  double skew = 0.0;
  double zero_fraction = 0.0;
  int threads = kThreads;
  std::size_t misalign = 0;  // each buffer is offset by a different amount from it
  std::uint64_t seed = 1;

  std::int64_t expert_rows() const {
    return alignment == 1 ? num_tokens : num_tokens + num_experts * (alignment - 1);
  }
  std::string name() const {
    return std::string(forward ? "forward" : "inverse") + " N=" + std::to_string(num_ranks) +
           " E=" + std::to_string(num_experts) + " A=" + std::to_string(num_tokens) +
           " valid=" + std::to_string(valid_rows) + " row=" + std::to_string(token_row_bytes) +
           " scale=" + std::to_string(scale_row_bytes) + " k=" + std::to_string(alignment) +
           (gather ? " gather" : " scatter") + (cumsum ? " cumsum" : " count") +
           (int64_counts ? " int64" : " int32") + " threads=" + std::to_string(threads) +
           " misalign=" + std::to_string(misalign) + " seed=" + std::to_string(seed);
  }
};

// The output rows and bytes one call writes, as the kernels would.
struct Result {
  Buffer tokens, scales, weight;
  std::vector<std::int32_t> index;
  std::vector<std::int64_t> expert_token_num;
  Totals totals;
};

template <int Q>
Word shifted(const Word& lo, const Word& hi, int bits) {
  return shifted_word<Q>(lo, hi, bits);
}

// The four instantiations the kernel's switch picks from.
Word shifted_any(const Word& lo, const Word& hi, int shift) {
  const int bits = (shift & 3) * 8;
  switch (shift >> 2) {
    case 0:
      return shifted<0>(lo, hi, bits);
    case 1:
      return shifted<1>(lo, hi, bits);
    case 2:
      return shifted<2>(lo, hi, bits);
    default:
      return shifted<3>(lo, hi, bits);
  }
}

Word load_word(const std::byte* at) {
  Word w;
  std::memcpy(&w, at, sizeof(w));
  return w;
}

// warp_move: head bytes, 16-byte words (aligned, or shifted out of the
// aligned words around them), tail bytes; src null writes zeros.
void warp_move(std::byte* dst, const std::byte* src, std::int32_t n) {
  const ByteSplit split =
      split_bytes(reinterpret_cast<std::uintptr_t>(dst), reinterpret_cast<std::uintptr_t>(src), n);
  if (split.words > 0) ASSERT_EQ(reinterpret_cast<std::uintptr_t>(dst + split.head) % 16, 0u);
  for (std::int32_t b = 0; b < split.head; ++b) dst[b] = src ? src[b] : std::byte{0};
  const std::int32_t after = split.head + split.words * 16;
  for (std::int32_t b = 0; b < split.tail; ++b)
    dst[after + b] = src ? src[after + b] : std::byte{0};
  std::byte* out = dst + split.head;
  if (src == nullptr) {
    std::memset(out, 0, static_cast<std::size_t>(split.words) * 16);
    return;
  }
  if (split.shift == 0) {
    if (split.words > 0) ASSERT_EQ(reinterpret_cast<std::uintptr_t>(src + split.head) % 16, 0u);
    std::memcpy(out, src + split.head, static_cast<std::size_t>(split.words) * 16);
    return;
  }
  const std::byte* in = src + split.head - split.shift;
  ASSERT_EQ(reinterpret_cast<std::uintptr_t>(in) % 16, 0u);
  for (std::int32_t w = 0; w < split.words; ++w) {
    const Word word =
        shifted_any(load_word(in + 16 * w), load_word(in + 16 * (w + 1)), split.shift);
    std::memcpy(out + 16 * w, &word, sizeof(word));
  }
}

void move_small_row(std::byte* dst, const std::byte* src, std::int64_t row_bytes,
                    std::int32_t dst_row, std::int32_t src_row) {
  std::byte* to = dst + dst_row * row_bytes;
  if (src == nullptr || src_row < 0) {
    std::memset(to, 0, static_cast<std::size_t>(row_bytes));
  } else {
    std::memcpy(to, src + src_row * row_bytes, static_cast<std::size_t>(row_bytes));
  }
}

// One CTA's table build (each phase for every thread, the scans in plain
// loops), then the whole grid's moves.
template <typename Count>
void emulate(const Case& c, const std::vector<Count>& counts, const std::byte* tokens,
             const std::byte* scales, const std::byte* weight, Result& out) {
  Layout l;
  l.num_ranks = static_cast<std::int32_t>(c.num_ranks);
  l.num_experts = static_cast<std::int32_t>(c.num_experts);
  l.num_tokens = c.num_tokens;
  l.expert_alignment = c.alignment;
  l.allow_spare_rows = c.valid_rows != c.num_tokens;
  l.forward = c.forward;
  std::vector<std::int32_t> words(static_cast<std::size_t>(table_words(c.num_ranks, c.num_experts)),
                                  -7);
  const Tables t = tables_at(words.data(), l.num_blocks());
  const int threads = c.threads;

  std::int32_t bits = 0;
  for (int i = 0; i < threads; ++i) bits |= load_counts(l, counts.data(), t, i, threads);
  std::vector<SliceSums> prefix(static_cast<std::size_t>(threads));
  SliceSums total;
  for (int i = 0; i < threads; ++i) {
    const SliceSums sums = slice_sums(l, t, i, threads);
    prefix[static_cast<std::size_t>(i)] = total;
    total.rank += sums.rank;
    total.expert += sums.expert;
  }
  ASSERT_EQ(total.rank, total.expert);
  for (int i = 0; i < threads; ++i)
    write_begins(l, t, i, threads, prefix[static_cast<std::size_t>(i)]);
  std::vector<std::int64_t> pad_prefix(static_cast<std::size_t>(threads));
  std::int64_t pad_total = 0;
  for (int i = 0; i < threads; ++i) {
    pad_prefix[static_cast<std::size_t>(i)] = pad_total;
    pad_total += slice_pads(l, t, i, threads, total.rank);
  }
  const std::int32_t status = status_bits(l, bits, total.rank);
  std::vector<Count> etn(static_cast<std::size_t>(c.num_experts), static_cast<Count>(-9));
  for (int i = 0; i < threads; ++i) {
    write_pads(l, t, i, threads, total.rank, pad_prefix[static_cast<std::size_t>(i)],
               c.forward && status == 0 ? etn.data() : nullptr, c.cumsum);
  }
  for (int i = 0; i < threads; ++i) add_pads(l, t, i, threads);
  out.totals = {narrow(total.rank), narrow(c.forward ? total.rank + pad_total : total.rank),
                status};
  out.expert_token_num.assign(etn.begin(), etn.end());
  if (status != 0) return;

  const std::int64_t output_rows = c.forward ? c.expert_rows() : c.num_tokens;
  TileShape tiles;
  tiles.row_bytes = c.token_row_bytes;
  tiles.tiles_per_row =
      static_cast<std::int32_t>((c.token_row_bytes + kTileBytes - 1) / kTileBytes);
  const IndexMode index{c.forward, c.gather, static_cast<std::int32_t>(c.expert_rows()),
                        static_cast<std::int32_t>(c.num_tokens)};
  const std::int64_t scale_row_bytes = c.scale_row_bytes > 0 ? c.scale_row_bytes : 4;
  const bool has_scales = c.scale_row_bytes > 0 || c.forward;
  const MoveTasks tasks = move_tasks(tiles, out.totals, index, has_scales || c.weight || c.forward);
  // A few warps walk the tasks as the kernels' warps do.
  constexpr std::int32_t kWarps = 3;
  for (std::int32_t warp = 0; warp < kWarps; ++warp) {
    for (std::int32_t tile = warp; tile < tasks.num_tiles;
         tile = next_index(tile, kWarps, tasks.num_tiles)) {
      const TileSpan span = tile_span(tiles, tile);
      ASSERT_LT(span.row, output_rows);
      ASSERT_GT(span.bytes, 0);
      const std::int32_t src_row = source_of(t, l.num_blocks(), span.row).src_row;
      std::byte* dst = out.tokens.data() + span.row * c.token_row_bytes + span.begin;
      const std::byte* src =
          src_row < 0 ? nullptr : tokens + src_row * c.token_row_bytes + span.begin;
      warp_move(dst, src, span.bytes);
    }
    for (std::int32_t group = tasks.first_group(warp, kWarps); group < tasks.num_groups();
         group = next_index(group, kWarps, tasks.num_groups())) {
      for (int lane = 0; lane < kWarpSize; ++lane) {
        const std::int32_t i = group * kWarpSize + lane;
        if (i >= tasks.num_small) continue;
        const SmallTask small = small_task(t, l.num_blocks(), index, out.totals, i);
        if (small.dst_row >= 0) {
          ASSERT_LT(small.dst_row, output_rows);
          if (has_scales) {
            move_small_row(out.scales.data(), scales, scale_row_bytes, small.dst_row,
                           small.src_row);
          }
          if (c.weight) move_small_row(out.weight.data(), weight, 4, small.dst_row, small.src_row);
        }
        if (small.index_at >= 0) {
          ASSERT_LT(small.index_at, static_cast<std::int64_t>(out.index.size()));
          out.index[static_cast<std::size_t>(small.index_at)] = small.index_value;
        }
      }
    }
  }
}

template <typename Count>
std::vector<Count> as(const std::vector<std::int64_t>& counts) {
  return std::vector<Count>(counts.begin(), counts.end());
}

// Runs one case against the naive reference; `counts` may be bad, then only
// the status bits `bad` are expected and nothing may be written.
void check_case(const Case& c, const std::vector<std::int64_t>& counts, std::int32_t bad = 0) {
  SCOPED_TRACE(c.name());
  const std::int64_t in_rows = c.forward ? c.num_tokens : c.expert_rows();
  const std::int64_t out_rows = c.forward ? c.expert_rows() : c.num_tokens;
  const std::int64_t scale_row_bytes = c.scale_row_bytes > 0 ? c.scale_row_bytes : 4;
  std::size_t shift = c.misalign;
  const auto next_shift = [&shift] { return shift = (shift * 7 + 3) % 16; };
  Buffer tokens(static_cast<std::size_t>(in_rows * c.token_row_bytes), next_shift());
  Buffer scales(static_cast<std::size_t>(in_rows * c.scale_row_bytes), next_shift());
  Buffer weight(static_cast<std::size_t>(c.weight ? in_rows * 4 : 0), next_shift());
  testing::fill_random(tokens.data(), tokens.size(), c.seed);
  testing::fill_random(scales.data(), scales.size(), c.seed + 1);
  testing::fill_random(weight.data(), weight.size(), c.seed + 2);
  const bool has_scales = c.scale_row_bytes > 0 || c.forward;
  Result got{
      Buffer(static_cast<std::size_t>(out_rows * c.token_row_bytes), next_shift()),
      Buffer(static_cast<std::size_t>(has_scales ? out_rows * scale_row_bytes : 0), next_shift()),
      Buffer(static_cast<std::size_t>(c.weight ? out_rows * 4 : 0), next_shift()),
      std::vector<std::int32_t>(static_cast<std::size_t>(c.gather ? out_rows : in_rows), -5),
      {},
      {}};
  if (!c.forward) got.index.clear();
  const std::byte* scale_data = c.scale_row_bytes > 0 ? scales.data() : nullptr;
  const std::byte* weight_data = c.weight ? weight.data() : nullptr;
  if (c.int64_counts) {
    emulate(c, counts, tokens.data(), scale_data, weight_data, got);
  } else {
    emulate(c, as<std::int32_t>(counts), tokens.data(), scale_data, weight_data, got);
  }
  if (::testing::Test::HasFatalFailure()) return;

  if (bad != 0) {
    EXPECT_EQ(got.totals.status, bad);
    for (const Buffer* b : {&got.tokens, &got.scales, &got.weight}) {
      for (std::size_t i = 0; i < b->size(); ++i) ASSERT_EQ(b->data()[i], kPoison) << "byte " << i;
    }
    for (const std::int32_t v : got.index) ASSERT_EQ(v, -5);
    for (const std::int64_t v : got.expert_token_num) ASSERT_EQ(v, -9);
    return;
  }
  ASSERT_EQ(got.totals.status, 0);
  testing::ReferenceInputs in;
  in.num_ranks = c.num_ranks;
  in.num_experts = c.num_experts;
  in.counts = counts;
  in.tokens = tokens.data();
  in.token_row_bytes = c.token_row_bytes;
  in.scales = scale_data;
  in.scale_row_bytes = c.scale_row_bytes;
  in.weight = weight_data;
  in.num_tokens = c.num_tokens;
  in.expert_alignment = c.alignment;
  const testing::ReferenceOutputs want =
      c.forward ? testing::reference_reroute(in, c.cumsum ? 0 : 1, c.gather ? 0 : 1)
                : testing::reference_inverse(in);
  EXPECT_EQ(got.totals.output_rows, want.specified_rows);
  EXPECT_EQ(testing::rows_difference("tokens", got.tokens.data(), got.tokens.size(), want.tokens,
                                     want.specified_rows, c.token_row_bytes),
            "");
  if (has_scales) {
    EXPECT_EQ(testing::rows_difference("scales", got.scales.data(), got.scales.size(), want.scales,
                                       want.specified_rows, scale_row_bytes),
              "");
  }
  if (c.weight) {
    EXPECT_EQ(testing::rows_difference("weight", got.weight.data(), got.weight.size(), want.weight,
                                       want.specified_rows, 4),
              "");
  }
  if (c.forward) {
    EXPECT_EQ(got.index, want.token_idx);
    EXPECT_EQ(got.expert_token_num, want.expert_token_num);
  }
}

std::vector<std::int64_t> counts_for(const Case& c) {
  return testing::random_counts(c.num_ranks, c.num_experts, c.valid_rows, c.skew, c.zero_fraction,
                                c.seed);
}

// The sweep: row bytes across the tile and word edges, scale rows of every
// width, both directions, index types and count modes, k in {1, 2, 16, 128},
// spare rows, zero and skewed counts, A = 0, one rank, one expert, the
// kernels' block sizes and an odd one.
TEST(CudaLayout, MatchesTheNaiveReferenceOverTheSweep) {
  std::mt19937_64 rng(2026);
  const auto pick = [&rng](std::initializer_list<std::int64_t> options) {
    return options.begin()[std::uniform_int_distribution<std::size_t>(0, options.size() - 1)(rng)];
  };
  int cases = 0;
  for (const bool forward : {true, false}) {
    for (const std::int64_t k : {1, 2, 16, 128}) {
      for (const bool spare : {false, true}) {
        for (int i = 0; i < 24; ++i) {
          Case c;
          c.forward = forward;
          c.alignment = k;
          c.num_ranks = pick({1, 2, 3, 8, 16});
          c.num_experts = pick({1, 1, 3, 16, 33});
          c.num_tokens = pick({0, 1, 5, 37, 256, 700});
          c.valid_rows = spare ? c.num_tokens * pick({0, 1, 2, 3}) / 4 : c.num_tokens;
          c.token_row_bytes = pick({1, 2, 3, 15, 16, 17, 64, 100, 2047, 2048, 2049, 4100, 14336});
          c.scale_row_bytes = pick({0, 0, 1, 4, 12, 224, 112});
          c.weight = pick({0, 1}) != 0;
          c.gather = pick({0, 1}) != 0;
          c.cumsum = pick({0, 1}) != 0;
          c.int64_counts = pick({0, 1}) != 0;
          c.skew = static_cast<double>(pick({0, 1, 3}));
          c.zero_fraction = static_cast<double>(pick({0, 5, 9})) / 10.0;
          c.threads = static_cast<int>(pick({kThreads, kTablesThreads, 7}));
          c.misalign = static_cast<std::size_t>(pick({0, 1, 4, 8, 13}));
          c.seed = static_cast<std::uint64_t>(++cases);
          check_case(c, counts_for(c));
          if (::testing::Test::HasFailure()) return;
        }
      }
    }
  }
}

TEST(CudaLayout, HandlesTheWorkedExampleAndEdgeShapes) {
  Case c;  // docs/spec.md's worked example
  check_case(c, {1, 0, 2, 2, 1, 0});
  c.gather = false;
  c.cumsum = true;
  check_case(c, {1, 0, 2, 2, 1, 0});
  c.alignment = 4;  // segments 3 -> 4, 1 -> 4, 2 -> 4
  check_case(c, {1, 0, 2, 2, 1, 0});
  c.forward = false;
  check_case(c, {1, 0, 2, 2, 1, 0});
  Case all_zero;  // every count 0 with spare rows: every output row a tail row
  all_zero.valid_rows = 0;
  all_zero.alignment = 16;
  check_case(all_zero, std::vector<std::int64_t>(6, 0));
  all_zero.gather = false;  // scatter: every index -1
  check_case(all_zero, std::vector<std::int64_t>(6, 0));
  Case big;  // past kMaxFusedBlocks: the two-kernel path runs the same phases
  big.num_ranks = 96;
  big.num_experts = 100;
  big.num_tokens = 3000;
  big.valid_rows = 3000;
  big.zero_fraction = 0.8;
  big.alignment = 2;
  big.threads = kTablesThreads;
  check_case(big, counts_for(big));
}

TEST(CudaLayout, BadCountsGiveTheStatusAndWriteNothing) {
  constexpr std::int64_t kMax64 = std::numeric_limits<std::int64_t>::max();
  Case c;
  c.num_ranks = 4;
  c.num_experts = 8;
  c.num_tokens = 100;
  c.valid_rows = 100;
  c.token_row_bytes = 33;
  const std::vector<std::int64_t> good = counts_for(c);
  const auto spoiled = [&good](std::size_t at, std::int64_t value) {
    std::vector<std::int64_t> counts = good;
    counts[at] = value;
    return counts;
  };
  std::vector<std::int64_t> short_by_one = good;
  for (std::int64_t& v : short_by_one) {
    if (v > 0) {
      --v;
      break;
    }
  }
  check_case(c, short_by_one, kBitSum);  // sum < A without spare rows
  std::vector<std::int64_t> over_by_one = good;
  over_by_one.back() += 1;
  check_case(c, over_by_one, kBitSum);
  // A negative count is clamped to 0: the sum is off too unless the count it
  // replaced was 0.
  check_case(c, spoiled(0, -1), kBitNegative | (good[0] != 0 ? kBitSum : 0));
  std::vector<std::int64_t> negative_kept_sum = good;
  negative_kept_sum.back() += negative_kept_sum.front() + 5;
  negative_kept_sum.front() = -5;
  check_case(c, negative_kept_sum, kBitNegative | kBitSum);  // clamped to 0: the sum is off too
  check_case(c, spoiled(3, std::numeric_limits<std::int32_t>::max()), kBitSum);
  c.int64_counts = true;
  std::vector<std::int64_t> overflow = good;
  overflow.front() = kMax64;
  overflow.back() = kMax64;
  check_case(c, overflow, kBitSum);
  check_case(c, spoiled(5, std::numeric_limits<std::int64_t>::min()),
             kBitNegative | (good[5] != 0 ? kBitSum : 0));
  c.valid_rows = 50;  // spare rows allowed: more than A is still bad
  check_case(c, over_by_one, kBitSum);
}

TEST(CudaLayout, ShiftedWordsAreTheBytesAtEveryShift) {
  std::byte bytes[32];
  testing::fill_random(bytes, sizeof(bytes), 3);
  for (int shift = 0; shift < 16; ++shift) {
    const Word got = shifted_any(load_word(bytes), load_word(bytes + 16), shift);
    EXPECT_EQ(std::memcmp(&got, bytes + shift, 16), 0) << "shift " << shift;
  }
}

// Every (dst, src) alignment and short length, plus long ones: the split
// covers the range once, its words start at an aligned dst, and the shift
// names where src's bytes sit in the aligned words.
TEST(CudaLayout, SplitBytesCoversTheRange) {
  std::vector<std::int32_t> lengths;
  for (std::int32_t n = 0; n <= 80; ++n) lengths.push_back(n);
  for (std::int32_t n : {255, 256, 257, 2047, 2048, 2049}) lengths.push_back(n);
  for (std::uintptr_t dst = 4096; dst < 4096 + 32; ++dst) {
    for (std::uintptr_t src = 8192; src < 8192 + 32; ++src) {
      for (const std::int32_t n : lengths) {
        const ByteSplit split = split_bytes(dst, src, n);
        ASSERT_EQ(split.head + split.words * 16 + split.tail, n);
        ASSERT_LT(split.head, 16);
        ASSERT_LT(split.tail, 16);
        ASSERT_GE(split.tail, 0);
        if (split.words > 0) ASSERT_EQ((dst + static_cast<std::uintptr_t>(split.head)) % 16, 0u);
        ASSERT_EQ(split.shift,
                  static_cast<int>((src + static_cast<std::uintptr_t>(split.head)) % 16));
      }
    }
  }
}

TEST(CudaLayout, TileSpansCoverEachRowOnce) {
  for (const std::int64_t row_bytes : {1, 16, 2047, 2048, 2049, 7168, 14336, 100000}) {
    TileShape shape;
    shape.row_bytes = row_bytes;
    shape.tiles_per_row = static_cast<std::int32_t>((row_bytes + kTileBytes - 1) / kTileBytes);
    std::int64_t covered = 0;
    for (std::int32_t tile = 0; tile < 3 * shape.tiles_per_row; ++tile) {
      const TileSpan span = tile_span(shape, tile);
      EXPECT_EQ(span.row, tile / shape.tiles_per_row);
      EXPECT_EQ(span.begin % 16, 0);
      if (span.row == 1) {
        EXPECT_EQ(span.begin, covered);
        covered += span.bytes;
      }
    }
    EXPECT_EQ(covered, row_bytes);
  }
}

// 2^31 - 1 one-byte rows with a gather index: 2^31 - 1 tiles and as many
// small tasks, 2^26 warp tasks more, which one int32 walk wrapped into
// negative tiles. Each walk stops at its end.
TEST(CudaLayout, MoveTasksNeverPassInt32) {
  TileShape tiles;
  tiles.row_bytes = 1;
  tiles.tiles_per_row = 1;
  const Totals totals{kInt32Max, kInt32Max, 0};
  const MoveTasks tasks =
      move_tasks(tiles, totals, IndexMode{true, true, kInt32Max, kInt32Max}, true);
  EXPECT_EQ(tasks.num_tiles, kInt32Max);
  EXPECT_EQ(tasks.num_groups(), 1 << 26);
  EXPECT_EQ((tasks.num_groups() - 1) * kWarpSize + (kWarpSize - 1), kInt32Max);  // the last i
  const std::int32_t warps = 132 * 4 * 8;
  EXPECT_EQ(next_index(kInt32Max - 5, warps, kInt32Max), kInt32Max);
  EXPECT_EQ(next_index(kInt32Max - warps - 1, warps, kInt32Max), kInt32Max - 1);
  EXPECT_EQ(next_index(3, warps, 2), 2);
  // The groups start where one walk over tiles and groups would take each warp.
  EXPECT_EQ(tasks.first_group(0, warps), (warps - kInt32Max % warps) % warps);
  EXPECT_EQ(move_tasks(tiles, totals, IndexMode{}, false).num_groups(), 0);
}

// Every tile and every group is walked by exactly one warp, for any warps.
TEST(CudaLayout, WarpWalksCoverEachTaskOnce) {
  for (const std::int32_t warps : {1, 3, 8, 64}) {
    for (const std::int32_t num_tiles : {0, 1, 7, 64, 100}) {
      const MoveTasks tasks{num_tiles, 200};
      std::vector<int> tiles(static_cast<std::size_t>(num_tiles));
      std::vector<int> groups(static_cast<std::size_t>(tasks.num_groups()));
      for (std::int32_t warp = 0; warp < warps; ++warp) {
        for (std::int32_t i = warp; i < num_tiles; i = next_index(i, warps, num_tiles))
          ++tiles[static_cast<std::size_t>(i)];
        for (std::int32_t g = tasks.first_group(warp, warps); g < tasks.num_groups();
             g = next_index(g, warps, tasks.num_groups())) {
          ++groups[static_cast<std::size_t>(g)];
          // Its task number in one walk is a multiple of warps past the warp.
          EXPECT_EQ((num_tiles + g - warp) % warps, 0);
        }
      }
      for (const int n : tiles) EXPECT_EQ(n, 1);
      for (const int n : groups) EXPECT_EQ(n, 1);
    }
  }
}

TEST(CudaLayout, SlicesPartitionTheRange) {
  for (const std::int32_t n : {0, 1, 7, 256, 257, 8192, 9600}) {
    for (const int threads : {1, 7, kThreads, kTablesThreads}) {
      std::int32_t next = 0;
      for (int t = 0; t < threads; ++t) {
        const Slice s = slice_of(n, t, threads);
        ASSERT_EQ(s.begin, next);
        ASSERT_GE(s.end, s.begin);
        next = s.end;
      }
      ASSERT_EQ(next, n);
    }
  }
}

}  // namespace
}  // namespace moe_reroute::cuda::detail
