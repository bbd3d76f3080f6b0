#pragma once

// The per-device CUDA status word the kernels report bad counts in (torch_cuda_status.cc).

#include <c10/core/Device.h>

#include <string>

#include "torch_ops.h"

namespace moe_reroute::torch_ops {

#if MOE_REROUTE_HAS_CUDA
/// The current CUDA stream of `device`, torch's.
void* current_stream(const c10::Device& device);

// A CUDA call's status word, and whether the call reads it when done ("sync" mode).
struct StatusWord {
  Tensor word;
  bool sync;
};

/// The status word of `device` for a call on `stream`. Refused where `stream`
/// is capturing and the call would make the word (the device's first call: it
/// would come from the graph's memory pool and be zeroed only when the graph
/// first replays) or read it (sync mode).
StatusWord status_word(const c10::Device& device, void* stream);

/// Reads the status word (one host sync), clears it and throws for bad counts.
void check_status(const Tensor& word);
#endif

/// Reads and clears every device's status word (one host sync each) and
/// raises ValueError naming the argument when bad counts were seen since the
/// last check.
void cuda_check();

/// Sets the CUDA status check ("deferred" or "sync") and returns the previous one.
std::string set_cuda_status_check(c10::string_view mode);

}  // namespace moe_reroute::torch_ops
