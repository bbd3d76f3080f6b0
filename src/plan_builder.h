#pragma once

// Fills a Plan, whose members are private so that no caller can edit one:
// the backend-neutral part here (src/plan.cc), the CPU's work split in
// src/cpu/schedule.cc.

#include "call.h"
#include "moe_reroute/reroute.h"

namespace moe_reroute::detail {

struct PlanBuilder {
  /// `plan` for `call` with the `counts` read (rules 4 and 5), offsets and the
  /// CPU schedule. Every member is assigned, so that `plan` may be one made
  /// before: its vectors keep their memory.
  static void make(Plan& plan, const Call& call, const TensorView& counts, int num_threads);

 private:
  // src_offset, dst_offset (expert segments padded to multiples of k) and expert_token_num.
  static void offsets(Plan& plan);
  // The CPU's work split: the chunks, at most `num_threads` threads, streaming stores.
  static void schedule(Plan& plan, int num_threads);
};

}  // namespace moe_reroute::detail
