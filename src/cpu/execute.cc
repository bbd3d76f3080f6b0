// CPU execution: each thread memcpys its planned chunks of token, scale and
// weight rows (zeros for pad rows) and writes the matching index entries. No
// dtype dispatch: rows are bytes.

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <span>
#include <string>

#include "../check.h"
#include "copy.h"
#include "parallel.h"
#include "moe_reroute/reroute.h"

namespace moe_reroute {
namespace {

// Rows of `row_bytes` bytes moved from `src` (null: zeros) to `dst`; a
// stream of 0-byte rows moves nothing. `move` takes a thread's slice of the
// chunks, whose destination rows are one contiguous run (Plan).
struct RowStream {
  const void* src = nullptr;
  void* dst = nullptr;
  std::int64_t row_bytes = 0;
  bool streaming = false;  // write around the cache (see copy_bytes)

  // A whole slice per call: at decode size a chunk is a row or two, so checks
  // made per chunk would weigh on the run.
  void move(std::span<const Chunk> chunks) const {
    if (row_bytes == 0 || chunks.empty()) return;
    auto* const out = static_cast<std::byte*>(dst);
    const auto* const in = static_cast<const std::byte*>(src);
    if (in == nullptr) {
      // A slice's chunks are one run of destination rows: zero it at once
      // rather than in a call per chunk (a row each at decode).
      const std::int64_t begin = chunks.front().dst_row;
      const std::int64_t end = chunks.back().dst_row + chunks.back().num_rows;
      detail::zero_bytes(out + begin * row_bytes,
                         static_cast<std::size_t>((end - begin) * row_bytes), streaming);
      return;
    }
    for (const Chunk& chunk : chunks) {
      std::byte* const to = out + chunk.dst_row * row_bytes;
      const std::size_t bytes = static_cast<std::size_t>(chunk.num_rows * row_bytes);
      if (chunk.src_row == kPadRows) {
        // Pad rows are never read back here and at k = 128 can outweigh the valid
        // rows several times: zeros around the cache skip the read for ownership.
        detail::zero_bytes(to, bytes, /*stream=*/true);
      } else {
        detail::copy_bytes(to, in + chunk.src_row * row_bytes, bytes, streaming);
      }
    }
  }
};

void* data_of(const std::optional<TensorView>& view) { return view ? view->data : nullptr; }

// Runs `body(chunks)` on each thread's planned slice of the chunks.
template <typename Body>
void for_each_slice(const Plan& plan, const Body& body) {
  const int num_threads = plan.num_threads();
  const std::vector<Chunk>& chunks = plan.chunks();
  const std::vector<std::int64_t>& thread_begin = plan.thread_begin();
  const auto slice = [&](int t) {
    body(std::span<const Chunk>(chunks).subspan(
        static_cast<std::size_t>(thread_begin[t]),
        static_cast<std::size_t>(thread_begin[t + 1] - thread_begin[t])));
    detail::stream_fence();
  };
  detail::run_threads(num_threads, slice);
}

void check_direction(const Plan& plan, Direction direction) {
  if (plan.direction() != direction) {
    detail::fail(ErrorCode::kInvalidArgument,
                 direction == Direction::kForward
                     ? "plan: made by plan_inverse, run with run_reroute"
                     : "plan: made by plan_reroute, run with run_inverse");
  }
}

[[noreturn, gnu::cold]] void fail_stale_count(const Plan& plan, std::size_t block,
                                               std::int64_t value) {
  const std::int64_t num_experts = plan.num_experts();
  const auto b = static_cast<std::int64_t>(block);
  detail::fail(ErrorCode::kInvalidArgument,
               "expert_token_num_per_rank: count[" + std::to_string(b / num_experts) + "][" +
                   std::to_string(b % num_experts) + "] is " + std::to_string(value) +
                   " but the plan was made for " + std::to_string(plan.counts()[block]) +
                   "; plan again for new counts");
}

// A plan holds the layout of the counts it was made for: run with other
// counts it would write that layout, so the counts are compared first.
void check_planned_counts(const Plan& plan, const TensorView& counts) {
  const std::vector<std::int64_t>& planned = plan.counts();
  detail::for_each_count(counts, planned.size(), [&](std::size_t i, std::int64_t value) {
    if (value != planned[i]) fail_stale_count(plan, i, value);
  });
}

// Writes -1 to index entries [begin, end): every byte 0xFF.
void fill_unset(void* index, std::int64_t begin, std::int64_t end) {
  if (end > begin) {
    std::memset(static_cast<std::byte*>(index) + begin * 4, 0xFF,
                static_cast<std::size_t>((end - begin) * 4));
  }
}

// The index entries of `chunks`: the gather index maps each output row to its
// source row (-1 for pad rows), the scatter index each source row to its output row.
void write_index(std::span<const Chunk> chunks, void* index, bool gather) {
  for (const Chunk& chunk : chunks) {
    if (chunk.src_row == kPadRows) {
      if (gather) fill_unset(index, chunk.dst_row, chunk.dst_row + chunk.num_rows);
      continue;
    }
    const std::int64_t from = gather ? chunk.src_row : chunk.dst_row;
    const std::int64_t to = gather ? chunk.dst_row : chunk.src_row;
    for (std::int64_t k = 0; k < chunk.num_rows; ++k) {
      detail::store(index, to + k, static_cast<std::int32_t>(from + k));
    }
  }
}

}  // namespace

std::int64_t last_level_cache_bytes() {
  // sysfs first: in VMs sysconf can report the whole package (256 MiB for a
  // 32 MiB L3 on the development EPYC).
  static const std::int64_t bytes = [] {
    std::int64_t kib = 0;
    if (std::FILE* file = std::fopen("/sys/devices/system/cpu/cpu0/cache/index3/size", "r")) {
      long long value = 0;
      char unit = 0;
      if (std::fscanf(file, "%lld%c", &value, &unit) == 2 && unit == 'K') kib = value;
      std::fclose(file);
    }
    if (kib > 0) return kib * 1024;
    const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
    return l3 > 0 ? static_cast<std::int64_t>(l3) : std::int64_t{32} << 20;
  }();
  return bytes;
}

namespace {

// The arguments against the plan's specs (rule 10): before the counts are
// read again, since counts of another dtype would be read past their end.
void check_arguments(const Plan& plan, const RerouteInputs& inputs, const RerouteOutputs& outputs) {
  detail::check_run_arguments(plan.input_specs(), detail::named_inputs(inputs),
                              plan.output_specs(), detail::named_outputs(outputs));
}

void check_arguments(const Plan& plan, const InverseInputs& inputs, const InverseOutputs& outputs) {
  detail::check_run_arguments(plan.input_specs(), detail::named_inputs(inputs),
                              plan.output_specs(), detail::named_outputs(inputs, outputs));
}

// Moves the bytes of checked arguments.
void move_reroute(const Plan& plan, const RerouteInputs& inputs, const RerouteOutputs& outputs) {
  const bool stream = plan.streaming_stores();
  const RowStream tokens{inputs.tokens.data, outputs.permute_tokens.data, plan.token_row_bytes(),
                         stream};
  // Without scales the output is [R] float32 zeros.
  const RowStream scales{data_of(inputs.per_token_scales), outputs.permute_per_token_scales.data,
                         inputs.per_token_scales ? plan.scale_row_bytes()
                                                 : std::int64_t{sizeof(float)},
                         stream};
  const RowStream weight{data_of(inputs.expert_topk_weight), outputs.permute_topk_weight.data,
                         plan.weight_row_bytes(), stream};
  void* index = outputs.permute_token_idx.data;
  const bool gather = plan.attributes().idx_type == kIdxGather;

  for_each_slice(plan, [&](std::span<const Chunk> chunks) {
    tokens.move(chunks);
    scales.move(chunks);
    weight.move(chunks);
    write_index(chunks, index, gather);
  });
  // Gather: -1 at the tail rows; scatter: -1 for the spare rows.
  fill_unset(index, gather ? plan.num_padded_rows() : plan.num_valid_rows(),
             outputs.permute_token_idx.shape()[0]);

  const std::vector<std::int64_t>& expert_token_num = plan.expert_token_num();
  for (std::size_t e = 0; e < expert_token_num.size(); ++e) {
    const auto i = static_cast<std::int64_t>(e);
    if (outputs.expert_token_num.dtype() == DType::kInt32) {
      detail::store(outputs.expert_token_num.data, i,
                    static_cast<std::int32_t>(expert_token_num[e]));
    } else {
      detail::store(outputs.expert_token_num.data, i, expert_token_num[e]);
    }
  }
}

void move_inverse(const Plan& plan, const InverseInputs& inputs, const InverseOutputs& outputs) {
  const bool stream = plan.streaming_stores();
  const RowStream tokens{inputs.tokens.data, outputs.restored_tokens.data,
                         plan.token_row_bytes(), stream};
  const RowStream scales{data_of(inputs.per_token_scales),
                         data_of(outputs.restored_per_token_scales), plan.scale_row_bytes(),
                         stream};
  const RowStream weight{data_of(inputs.expert_topk_weight),
                         data_of(outputs.restored_topk_weight), plan.weight_row_bytes(), stream};
  for_each_slice(plan, [&](std::span<const Chunk> chunks) {
    tokens.move(chunks);
    scales.move(chunks);
    weight.move(chunks);
  });
}

}  // namespace

void run_reroute(const Plan& plan, const RerouteInputs& inputs, const RerouteOutputs& outputs) {
  check_direction(plan, Direction::kForward);
  check_arguments(plan, inputs, outputs);
  check_planned_counts(plan, inputs.expert_token_num_per_rank);
  move_reroute(plan, inputs, outputs);
}

void run_inverse(const Plan& plan, const InverseInputs& inputs, const InverseOutputs& outputs) {
  check_direction(plan, Direction::kInverse);
  check_arguments(plan, inputs, outputs);
  check_planned_counts(plan, inputs.expert_token_num_per_rank);
  move_inverse(plan, inputs, outputs);
}

// The one-shot calls plan into a plan kept per thread, whose memory the next
// call reuses: at decode size the allocations were a tenth of the plan's cost.
// The plan was made from these very inputs, so their counts are not read again.
void moe_re_routing(const RerouteInputs& inputs, const RerouteOutputs& outputs,
                    const Attributes& attributes, int num_threads) {
  thread_local Plan plan;
  detail::plan_reroute(plan, inputs, attributes, num_threads);
  check_arguments(plan, inputs, outputs);
  move_reroute(plan, inputs, outputs);
}

void moe_re_routing_inverse(const InverseInputs& inputs, const InverseOutputs& outputs,
                            const Attributes& attributes, int num_threads) {
  thread_local Plan plan;
  detail::plan_inverse(plan, inputs, attributes, num_threads);
  check_arguments(plan, inputs, outputs);
  move_inverse(plan, inputs, outputs);
}

}  // namespace moe_reroute
