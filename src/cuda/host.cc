// The host-side helpers of host.h.

#include "host.h"

#include <cstdint>
#include <string>

#include "../check.h"
#include "launch.h"
#include "moe_reroute/cuda.h"

namespace moe_reroute::cuda::detail {

using moe_reroute::detail::fail;

void check_cuda(cudaError_t error, const char* what) {
  if (error != cudaSuccess) {
    fail(ErrorCode::kBackend, std::string("cuda: ") + what + ": " + cudaGetErrorString(error));
  }
}

void check_aligned(const void* data, std::int64_t alignment, const std::string& name) {
  if (reinterpret_cast<std::uintptr_t>(data) % static_cast<std::uintptr_t>(alignment) != 0) {
    fail(ErrorCode::kInvalidArgument, name + ": data must be " + std::to_string(alignment) +
                                          "-byte aligned for the CUDA backend");
  }
}

void check_element_aligned(const TensorView& view, const char* name) {
  check_aligned(view.data, dtype_info(view.dtype()).bits / 8, name);
}

CallDevice::CallDevice(cudaStream_t stream) {
  check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
  device_ = call_device(
      stream, previous_, [stream] { return stream_is_capturing(stream); },
      [stream] {
        int device = 0;
        check_cuda(cudaStreamGetDevice(stream, &device), "cudaStreamGetDevice");
        return device;
      });
  if (device_ != previous_) check_cuda(cudaSetDevice(device_), "cudaSetDevice");
}

}  // namespace moe_reroute::cuda::detail
