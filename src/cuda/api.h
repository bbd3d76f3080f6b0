#pragma once

// The CUDA calls of cuda.h on a path the caller picks: the GPU benchmark's
// one-launch / two-launch comparison and the GPU tests of the two-kernel path
// at sizes that would take one launch.

#include "launch.h"
#include "moe_reroute/cuda.h"

namespace moe_reroute::cuda::detail {

/// cuda::moe_re_routing on `path`; the workspace must hold
/// workspace_bytes(N, E, path).
void moe_re_routing(const RerouteInputs& inputs, const RerouteOutputs& outputs,
                    const Attributes& attributes, const DeviceContext& context, Path path);

/// cuda::moe_re_routing_inverse on `path`.
void moe_re_routing_inverse(const InverseInputs& inputs, const InverseOutputs& outputs,
                            const Attributes& attributes, const DeviceContext& context, Path path);

}  // namespace moe_reroute::cuda::detail
