#pragma once

/// Expert-parallel dispatch and combine over MPI (docs/spec.md section 11),
/// the component `moe_reroute::ep`: the sort by expert, the exchange and
/// moe_re_routing as one step in which each token row crosses once, from the
/// sender's x straight into its expert-major place at the receiver; and the
/// way back straight into the rows moe_finalize_routing sums.
///
/// Both calls are collective over the communicator. A bad argument on any
/// rank makes the call throw Error on every rank before anything is sent:
/// the rank that has it with its own message, the others naming that rank.

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "moe_reroute/ep_export.h"
#include "moe_reroute/error.h"
#include "moe_reroute/reroute.h"
#include "moe_reroute/tensor.h"

namespace moe_reroute::ep {

/// A dense row-major tensor that owns its bytes (uninitialised when made).
class MOE_REROUTE_EP_API Tensor {
 public:
  Tensor() = default;
  explicit Tensor(const TensorSpec& spec);

  const TensorSpec& spec() const { return spec_; }
  TensorView view() const { return TensorView(data_.get(), spec_.dtype, spec_.shape); }
  void* data() const { return data_.get(); }
  /// Hands the bytes to the caller (a framework adapter that keeps them).
  std::unique_ptr<std::byte[]> release() { return std::move(data_); }

 private:
  TensorSpec spec_;
  std::unique_ptr<std::byte[]> data_;
};

struct DispatchInputs {
  TensorView x;           // [T, H], a token dtype
  TensorView expert_idx;  // [T, k] int32 or int64: global experts in [0, num_experts)
  std::optional<TensorView> expert_scales = std::nullopt;     // [T, k] float32, the top-k weights
  std::optional<TensorView> per_token_scales = std::nullopt;  // [T], [T, S], [T, K, 2] (spec rule 7)
};

/// The same on every rank.
struct DispatchAttributes {
  std::int64_t num_experts = 0;  // N * E: global expert g lives on rank g / E as local expert g % E
  std::int64_t expert_token_num_type = kExpertTokenNumCount;
  std::int64_t idx_type = kIdxGather;
  std::int64_t expert_alignment = 1;
  /// Fixed receive rows A (moe_re_routing's allow_spare_rows), so that every
  /// output shape depends on shapes alone; -1: A is the rows received.
  std::int64_t capacity = -1;
};

/// moe_re_routing's outputs on the rows this rank received, and the counts.
struct DispatchOutputs {
  Tensor permute_tokens;            // [R, H], x's dtype
  Tensor permute_per_token_scales;  // the scales' form with R rows; [R] float32 zeros without
  Tensor permute_token_idx;         // [R] (gather) or [A] (scatter) int32
  Tensor expert_token_num;          // [E] int32
  Tensor permute_topk_weight;       // [R] float32; (0,) without expert_scales
  Tensor expert_token_num_per_rank;  // [N, E] int32: row r, what rank r sent
};

struct DispatchResult;
class Handle;

/// Collective over `comm` (N ranks). Validates, agrees on the verdict, sorts
/// the (token, slot) pairs by global expert (moe_init_routing's order),
/// exchanges the counts, then moves each token row, scales row and weight
/// once into the layout moe_re_routing gives. Throws Error on every rank.
MOE_REROUTE_EP_API DispatchResult dispatch(MPI_Comm comm, const DispatchInputs& inputs,
                                           const DispatchAttributes& attributes,
                                           int num_threads = 0);

/// Collective over the handle's communicator. expert_out [R, H'] (float16,
/// bfloat16 or float32, in permute_tokens' row order) goes back to the source
/// ranks; returns [T, H'] of its dtype, out[t] = the float32 sum over j of
/// expert_scales[t, j] * row(t, j) (weight 1 without them), as
/// moe_finalize_routing computes it. Throws Error on every rank.
MOE_REROUTE_EP_API Tensor combine(const TensorView& expert_out, const Handle& handle,
                                  int num_threads = 0);

/// Collective over `comm`, in place of a dispatch that this rank refused
/// before it could make its views (a framework adapter's own checks): throws
/// `error` here and, on every other rank, dispatch's error naming this rank,
/// as if dispatch had refused it.
[[noreturn]] MOE_REROUTE_EP_API void refuse_dispatch(MPI_Comm comm, const Error& error);

/// The same in place of a combine after `handle`'s dispatch.
[[noreturn]] MOE_REROUTE_EP_API void refuse_combine(const Handle& handle, const Error& error);

/// What combine needs of a dispatch: the communicator, the counts both ways,
/// the sorted order and the weights. Keeps no pointer to the caller's memory.
class MOE_REROUTE_EP_API Handle {
 public:
  MPI_Comm comm() const { return comm_; }
  std::int64_t num_tokens() const { return num_tokens_; }  // T
  std::int64_t top_k() const { return top_k_; }            // k
  /// R, the rows of permute_tokens, which combine's expert_out must have.
  std::int64_t num_rows() const { return num_rows_; }

 private:
  friend DispatchResult dispatch(MPI_Comm, const DispatchInputs&, const DispatchAttributes&, int);
  friend Tensor combine(const TensorView&, const Handle&, int);

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  std::int64_t num_tokens_ = 0;
  std::int64_t top_k_ = 0;
  std::int64_t num_rows_ = 0;
  std::int64_t experts_per_rank_ = 0;
  std::vector<std::int64_t> send_rows_;    // [N]: pairs sent to each rank
  std::vector<std::int64_t> send_offset_;  // [N]: the first of them in sorted order
  std::vector<std::int64_t> recv_counts_;  // [N * E]
  std::vector<std::int64_t> dst_offset_;   // [N * E]: block (r, e)'s first row in permute_tokens
  std::vector<std::int32_t> row_idx_;      // [T * k]: sorted position of pair (t, j)
  std::vector<float> weights_;             // [T * k]: expert_scales, or ones without
};

struct DispatchResult {
  DispatchOutputs outputs;
  Handle handle;
};

}  // namespace moe_reroute::ep
