#pragma once

// The host-side helpers every CUDA call shares: runtime errors as Error, the
// alignment checks and the device guard.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "moe_reroute/tensor.h"

namespace moe_reroute::cuda::detail {

/// Throws Error with ErrorCode::kBackend, "cuda: <what>: <message>", unless
/// `error` is cudaSuccess.
void check_cuda(cudaError_t error, const char* what);

/// Throws Error naming `name` unless `data` is `alignment`-byte aligned.
void check_aligned(const void* data, std::int64_t alignment, const std::string& name);

/// Indices and counts are read and written as whole elements.
void check_element_aligned(const TensorView& view, const char* name);

/// The device a call on `stream` runs on (call_device in launch.h), current
/// for the guard's lifetime; the caller's current device comes back after.
class CallDevice {
 public:
  explicit CallDevice(cudaStream_t stream);
  CallDevice(const CallDevice&) = delete;
  CallDevice& operator=(const CallDevice&) = delete;
  ~CallDevice() {
    if (device_ != previous_) cudaSetDevice(previous_);
  }
  int device() const { return device_; }

 private:
  int previous_ = 0;
  int device_ = 0;
};

}  // namespace moe_reroute::cuda::detail
