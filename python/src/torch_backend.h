#pragma once

// The slot a device backend of the torch kernels fills (torch_backend.cc):
// the CPU's in torch_ops.cc, CUDA's in torch_cuda.cc. A build compiles the
// files of the backends it has (python/CMakeLists.txt); each registers itself
// when the module loads, so a new backend adds a file, not branches here.

#include <c10/core/DeviceType.h>

#include <string>

#include "torch_call.h"

namespace moe_reroute::torch_ops {

struct Backend {
  void (*reroute)(const Call& call, const RerouteInputs& inputs, const RerouteOutputs& outputs,
                  const Attributes& attributes);
  void (*inverse)(const Call& call, const InverseInputs& inputs, const InverseOutputs& outputs,
                  const Attributes& attributes);
  /// Reports what the device found since the last check (the counts it
  /// validates itself), clearing it; null where the backend checks on the host.
  void (*check)() = nullptr;
  /// moe_init_routing and moe_finalize_routing on `device`; null where the
  /// backend has them not (yet), which the kernels refuse naming the input.
  void (*init_routing)(const c10::Device& device, const InitRoutingInputs& inputs,
                       const InitRoutingOutputs& outputs,
                       const InitRoutingAttributes& attributes) = nullptr;
  void (*finalize_routing)(const c10::Device& device, const FinalizeRoutingInputs& inputs,
                           const FinalizeRoutingOutputs& outputs,
                           const FinalizeRoutingAttributes& attributes) = nullptr;
};

/// Registers `backend` for the devices of `type`; returns true, for a static
/// initializer to call it.
bool register_backend(c10::DeviceType type, const Backend& backend);

/// The backend of `type`; null where this build has none.
const Backend* backend_of(c10::DeviceType type);

/// Each registered backend's check, in device-type order.
void check_backends();

/// Whether a backend that checks on the device reads that check after every
/// call ("sync" mode) rather than only in check_backends ("deferred").
bool sync_checks();
/// Sets it and returns the previous setting.
bool set_sync_checks(bool sync);

/// " or on a CUDA device" for each backend but the CPU's, or, with the CPU's
/// alone, " (this build has only the CPU backend)": the end of the message
/// that refuses tokens on another device.
std::string other_devices();

}  // namespace moe_reroute::torch_ops
