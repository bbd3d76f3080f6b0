#pragma once

// Where the torch operators' fresh CPU outputs come from: outputs of 4 MiB and
// more are 2 MiB-aligned mappings with transparent huge pages, kept in a cache
// when freed and handed to the next output of the same size. Smaller ones come
// from torch's CPU allocator. Why: docs/torch.md.

#include <c10/core/Allocator.h>

#include <cstdint>

namespace moe_reroute::torch_ops {

/// The allocator of fresh CPU outputs (lives as long as the process).
c10::Allocator* output_allocator();

/// Sets the most bytes the cache keeps (0: none), unmapping the oldest cached
/// blocks above it; returns the limit it replaces. Default: 1 GiB.
std::int64_t set_output_cache_limit(std::int64_t limit_bytes);

/// The bytes the cache keeps now (freed outputs not yet handed out again).
std::int64_t output_cache_bytes();

}  // namespace moe_reroute::torch_ops
