#pragma once

/// MoeReRoutingV2: reorders the tokens received by the dispatch AlltoAll from
/// (source rank, local expert) order to (local expert, source rank) order,
/// carrying scales and top-k weights, and its inverse. The contract: docs/spec.md.
///
/// Plan, then run: `plan_reroute` validates every argument, infers the output
/// specs and splits the work; `run_reroute` checks the outputs against the
/// plan and moves the bytes. Nothing is written unless every check passed.

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "moe_reroute/dtype.h"
#include "moe_reroute/error.h"
#include "moe_reroute/export.h"
#include "moe_reroute/tensor.h"

namespace moe_reroute {

inline constexpr int kExpertTokenNumCumsum = 0;
inline constexpr int kExpertTokenNumCount = 1;
inline constexpr int kIdxGather = 0;
inline constexpr int kIdxScatter = 1;

/// The operator's attributes (docs/spec.md section 2 and 9). The inverse reads
/// only expert_alignment and allow_spare_rows. 64-bit like the int attributes
/// of torch and Python, so that a bad value reaches validation whole.
struct Attributes {
  std::int64_t expert_token_num_type = kExpertTokenNumCount;  // 1 = count, 0 = cumsum
  std::int64_t idx_type = kIdxGather;                         // 0 = gather, 1 = scatter
  std::int64_t expert_alignment = 1;  // k: each expert's segment is padded to a multiple of k rows
  bool allow_spare_rows = false;      // the counts may sum to less than A
  bool operator==(const Attributes& other) const = default;
};

struct RerouteInputs {
  TensorView tokens;                         // [A, H], a token dtype
  TensorView expert_token_num_per_rank;      // [N, E] int32 or int64
  std::optional<TensorView> per_token_scales = std::nullopt;    // [A], [A, S] f32; [A, K, 2], [A, S] e8m0
  std::optional<TensorView> expert_topk_weight = std::nullopt;  // [A, 1] or [A] float32
};

struct RerouteOutputs {
  TensorView permute_tokens;
  TensorView permute_per_token_scales;
  TensorView permute_token_idx;
  TensorView expert_token_num;
  TensorView permute_topk_weight;  // shape (0,) when no weight is given
};

struct RerouteOutputSpecs {
  TensorSpec permute_tokens;
  TensorSpec permute_per_token_scales;
  TensorSpec permute_token_idx;
  TensorSpec expert_token_num;
  TensorSpec permute_topk_weight;
  bool operator==(const RerouteOutputSpecs& other) const = default;
};

/// The inverse takes expert-ordered rows (any dtype, any row length) back to
/// rank order by the same counts.
struct InverseInputs {
  TensorView tokens;                             // [A, H], any dtype
  TensorView expert_token_num_per_rank;          // [N, E] int32 or int64
  std::optional<TensorView> per_token_scales = std::nullopt;    // as for the forward
  std::optional<TensorView> expert_topk_weight = std::nullopt;  // as for the forward
};

struct InverseOutputs {
  TensorView restored_tokens;
  std::optional<TensorView> restored_per_token_scales = std::nullopt;  // exactly when scales are given
  std::optional<TensorView> restored_topk_weight = std::nullopt;  // exactly when weights are given
};

struct InverseOutputSpecs {
  TensorSpec restored_tokens;
  std::optional<TensorSpec> restored_per_token_scales;
  std::optional<TensorSpec> restored_topk_weight;
  bool operator==(const InverseOutputSpecs& other) const = default;
};

/// A run of `num_rows` rows, contiguous in both source and destination;
/// `src_row == kPadRows` marks pad rows, written as zeros (section 9).
struct Chunk {
  std::int64_t src_row = 0;
  std::int64_t dst_row = 0;
  std::int64_t num_rows = 0;
  bool operator==(const Chunk& other) const = default;
};
inline constexpr std::int64_t kPadRows = -1;

enum class Direction { kForward, kInverse };

namespace detail {
struct PlanBuilder;
}

/// Everything a run needs, computed from shapes, attributes and the counts.
/// Opaque: a run checks that its inputs have the planned specs and that the
/// counts are the planned ones (N * E values), and throws Error otherwise.
class MOE_REROUTE_API Plan {
 public:
  Direction direction() const { return direction_; }
  const Attributes& attributes() const { return attributes_; }
  std::int64_t num_tokens() const { return num_tokens_; }    // A
  std::int64_t num_ranks() const { return num_ranks_; }      // N
  std::int64_t num_experts() const { return num_experts_; }  // E
  std::int64_t token_row_bytes() const { return token_row_bytes_; }
  std::int64_t scale_row_bytes() const { return scale_row_bytes_; }    // 0: no scales
  std::int64_t weight_row_bytes() const { return weight_row_bytes_; }  // 0: no weights
  /// tokens, counts, scales?, weight?
  const std::vector<TensorSpec>& input_specs() const { return input_specs_; }
  /// The outputs, in their struct's order.
  const std::vector<TensorSpec>& output_specs() const { return output_specs_; }
  /// The counts the plan was made for, [N * E] row-major.
  const std::vector<std::int64_t>& counts() const { return counts_; }
  /// Rows before block (r, e) at r * E + e in rank order and in (padded) expert order.
  const std::vector<std::int64_t>& src_offset() const { return src_offset_; }
  const std::vector<std::int64_t>& dst_offset() const { return dst_offset_; }
  /// [E]: the values written to expert_token_num (forward).
  const std::vector<std::int64_t>& expert_token_num() const { return expert_token_num_; }
  /// The work split: thread t moves chunks()[thread_begin()[t] .. thread_begin()[t+1]).
  /// The chunks run in destination row order, each where the last ended, so a
  /// thread's chunks write one contiguous run of destination rows.
  const std::vector<Chunk>& chunks() const { return chunks_; }
  const std::vector<std::int64_t>& thread_begin() const { return thread_begin_; }
  int num_threads() const { return static_cast<int>(thread_begin_.size()) - 1; }
  /// The rows the counts cover (their sum) and the rows of the padded expert
  /// segments (the sum of each expert's total rounded up to expert_alignment).
  std::int64_t num_valid_rows() const { return num_valid_rows_; }
  std::int64_t num_padded_rows() const { return num_padded_rows_; }
  /// Rows the chunks write: padded rows forward, valid rows inverse.
  std::int64_t num_written_rows() const {
    return direction_ == Direction::kForward ? num_padded_rows_ : num_valid_rows_;
  }
  /// Whether the CPU run writes around the cache (streaming stores): the rows
  /// read plus written outgrow last_level_cache_bytes().
  bool streaming_stores() const { return streaming_stores_; }
  /// Bytes one row costs across every output (what the split balances).
  std::int64_t bytes_per_row() const;
  /// A few lines: sizes, row bytes and each thread's chunks and bytes.
  std::string to_string() const;
  bool operator==(const Plan& other) const = default;

 private:
  friend struct detail::PlanBuilder;

  Direction direction_ = Direction::kForward;
  Attributes attributes_;
  std::int64_t num_tokens_ = 0;
  std::int64_t num_ranks_ = 0;
  std::int64_t num_experts_ = 0;
  std::int64_t token_row_bytes_ = 0;
  std::int64_t scale_row_bytes_ = 0;
  std::int64_t weight_row_bytes_ = 0;
  std::vector<TensorSpec> input_specs_;
  std::vector<TensorSpec> output_specs_;
  std::vector<std::int64_t> counts_;
  std::vector<std::int64_t> src_offset_;
  std::vector<std::int64_t> dst_offset_;
  std::vector<std::int64_t> expert_token_num_;
  std::vector<Chunk> chunks_;
  std::vector<std::int64_t> thread_begin_;
  std::int64_t num_valid_rows_ = 0;
  std::int64_t num_padded_rows_ = 0;
  bool streaming_stores_ = false;
};

/// Output specs from shapes, dtypes and attributes alone (reads no data);
/// throws Error for any violation of docs/spec.md section 4 but rule 5.
MOE_REROUTE_API RerouteOutputSpecs infer_reroute(const RerouteInputs& inputs,
                                                 const Attributes& attributes = {});
MOE_REROUTE_API InverseOutputSpecs infer_inverse(const InverseInputs& inputs,
                                                 const Attributes& attributes = {});

/// Validates everything (reading the counts), computes int64 offsets and
/// splits the rows over at most `num_threads` threads (0: all hardware
/// threads), balanced by bytes. Throws Error.
MOE_REROUTE_API Plan plan_reroute(const RerouteInputs& inputs, const Attributes& attributes = {},
                                  int num_threads = 0);
MOE_REROUTE_API Plan plan_inverse(const InverseInputs& inputs, const Attributes& attributes = {},
                                  int num_threads = 0);

/// Rule 10 without the data: each of `outputs` has the spec `specs` gives it,
/// checked in struct order; throws Error naming the first that differs, with
/// run_reroute's message. For callers that check preallocated outputs before
/// any data exists (the torch fake kernel of out=); the checks that need
/// memory (null data, overlaps) stay with the run.
MOE_REROUTE_API void check_output_specs(const RerouteOutputSpecs& specs,
                                        const RerouteOutputs& outputs);

/// The bytes [begin, end) an argument's memory spans (a strided view: from its
/// lowest to its highest byte; begin == end when it has none), named for errors.
struct ByteSpan {
  const char* name;
  std::uintptr_t begin;
  std::uintptr_t end;
};

/// Rule 10's overlap check: throws Error naming the first of `outputs` that
/// overlaps one of `inputs` or an earlier output, with run_reroute's message.
/// For callers that copy a strided input before the run (the copy is what
/// the run sees), to check the outputs against the caller's own memory.
MOE_REROUTE_API void check_disjoint(std::span<const ByteSpan> inputs,
                                    std::span<const ByteSpan> outputs);
/// The same for the forward's five outputs (non-null where they have bytes).
MOE_REROUTE_API void check_disjoint(std::span<const ByteSpan> inputs,
                                    const RerouteOutputs& outputs);

/// Moves the bytes on the CPU. Throws Error, before writing anything, when the
/// inputs differ from the planned specs or an output has the wrong spec or
/// overlaps an input or another output.
MOE_REROUTE_API void run_reroute(const Plan& plan, const RerouteInputs& inputs,
                                 const RerouteOutputs& outputs);
MOE_REROUTE_API void run_inverse(const Plan& plan, const InverseInputs& inputs,
                                 const InverseOutputs& outputs);

/// Plan and run in one call. Each thread plans into one plan of its own,
/// kept between calls so that its memory is reused: it holds the largest
/// N * E this thread has called with (about 100 bytes per count).
MOE_REROUTE_API void moe_re_routing(const RerouteInputs& inputs, const RerouteOutputs& outputs,
                                    const Attributes& attributes = {}, int num_threads = 0);
MOE_REROUTE_API void moe_re_routing_inverse(const InverseInputs& inputs,
                                            const InverseOutputs& outputs,
                                            const Attributes& attributes = {},
                                            int num_threads = 0);

/// The number of threads `num_threads = 0` means here.
MOE_REROUTE_API int hardware_threads();

/// The last-level cache the CPU backend sizes its streaming threshold by, in
/// bytes (sysfs, then sysconf, else 32 MiB), read once.
MOE_REROUTE_API std::int64_t last_level_cache_bytes();

}  // namespace moe_reroute
