// The CUDA backend of the torch kernels: the current stream, a workspace from
// torch's caching allocator, and the per-device status word the kernels report
// bad counts in. Built only where the CUDA backend and torch's CUDA are.

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>

#include <cstdint>
#include <mutex>
#include <vector>

#include "adapter.h"
#include "moe_reroute/cuda.h"
#include "torch_backend.h"

// The current CUDA stream from torch's C shim (libtorch_cuda), which declares
// it only when torch's own build defines USE_CUDA.
extern "C" AOTITorchError aoti_torch_get_current_cuda_stream(std::int32_t device_index,
                                                             void** ret_stream);

namespace moe_reroute::torch_ops {
namespace {

using adapter::fail;

// The status word of each CUDA device: sticky (kernels OR their bits in), read
// and cleared only by check_status: from cuda_check or, in "sync" mode, after
// every call.
std::mutex status_mutex;
std::vector<Tensor> status_words;

void* current_stream(const c10::Device& device) {
  void* stream = nullptr;
  if (aoti_torch_get_current_cuda_stream(device.index(), &stream) != AOTI_TORCH_SUCCESS) {
    fail(ErrorCode::kBackend, "tokens: cannot get the current CUDA stream of " + device.str());
  }
  return stream;
}

// The status word of `device` for a call on `stream`. Refused where `stream`
// is capturing and the call would make the word (the device's first call: it
// would come from the graph's memory pool and be zeroed only when the graph
// first replays). The capture status is asked only then, not on every call.
Tensor status_word(const c10::Device& device, void* stream) {
  std::lock_guard<std::mutex> lock(status_mutex);
  const auto index = static_cast<std::size_t>(device.index());
  if (status_words.size() <= index) status_words.resize(index + 1);
  if (!status_words[index].defined()) {
    if (cuda::stream_is_capturing(stream)) {
      fail(ErrorCode::kBackend,
           "tokens: the first call on " + device.str() +
               " makes its status word, which cannot happen under CUDA graph capture; call "
               "the operator once on " + device.str() + " before capturing (a warm-up call)");
    }
    status_words[index] = at::zeros({2}, at::TensorOptions().dtype(c10::kInt).device(device));
  }
  return status_words[index];
}

// Reads the status word (one host sync), clears it and throws for bad counts.
void check_status(const Tensor& word) {
  const std::int32_t status = word[0].item<std::int32_t>();
  if (status == 0) return;
  word.zero_();
  fail(ErrorCode::kInvalidArgument, cuda::status_message(status));
}

std::int64_t dim_or_zero(const Tensor& tensor, std::int64_t d) {
  return tensor.dim() > d ? tensor.size(d) : 0;
}

// Runs `launch(context)` on the current stream of `device` with `bytes` of
// workspace from the caching allocator (graph-capturable: no host sync).
// Under capture, what capture cannot do (make the status word, sync mode's
// read) is refused before anything is launched.
template <typename Launch>
void run_cuda(const c10::Device& device, std::size_t bytes, Launch launch) {
  const c10::DeviceGuard guard(device);
  void* const stream = current_stream(device);
  const Tensor word = status_word(device, stream);
  const bool sync = sync_checks();
  if (sync && cuda::stream_is_capturing(stream)) {
    fail(ErrorCode::kBackend,
         "set_cuda_status_check: \"sync\" reads the status word after every call, which "
         "cannot happen under CUDA graph capture; capture in \"deferred\" mode");
  }
  const Tensor workspace = at::empty({static_cast<std::int64_t>(bytes)},
                                     at::TensorOptions().dtype(c10::kByte).device(device));
  launch(cuda::DeviceContext{stream, word.data_ptr<std::int32_t>(), workspace.data_ptr(), bytes});
  if (sync) check_status(word);
}

// moe_re_routing and its inverse, whose workspace depends on the counts' shape.
template <typename Launch>
void run_cuda(const Call& call, Launch launch) {
  run_cuda(call.device,
           cuda::required_workspace_bytes(dim_or_zero(call.counts, 0), dim_or_zero(call.counts, 1)),
           launch);
}

// Every device's status word, refused under capture (a host sync each).
void check_devices() {
  std::vector<Tensor> words;
  {
    std::lock_guard<std::mutex> lock(status_mutex);
    words = status_words;
  }
  for (const Tensor& word : words) {
    if (word.defined() && cuda::stream_is_capturing(current_stream(word.device()))) {
      fail(ErrorCode::kBackend,
           "cuda_check: reads the status words (a host sync), which cannot happen under CUDA "
           "graph capture; call it after the capture");
    }
  }
  for (const Tensor& word : words) {
    if (word.defined()) check_status(word);
  }
}

[[maybe_unused]] const bool registered = register_backend(
    c10::DeviceType::CUDA,
    {[](const Call& call, const RerouteInputs& inputs, const RerouteOutputs& outputs,
        const Attributes& attributes) {
       run_cuda(call, [&](const cuda::DeviceContext& context) {
         cuda::moe_re_routing(inputs, outputs, attributes, context);
       });
     },
     [](const Call& call, const InverseInputs& inputs, const InverseOutputs& outputs,
        const Attributes& attributes) {
       run_cuda(call, [&](const cuda::DeviceContext& context) {
         cuda::moe_re_routing_inverse(inputs, outputs, attributes, context);
       });
     },
     check_devices,
     [](const c10::Device& device, const InitRoutingInputs& inputs,
        const InitRoutingOutputs& outputs, const InitRoutingAttributes& attributes) {
       run_cuda(device, cuda::init_routing_workspace_bytes(inputs, attributes),
                [&](const cuda::DeviceContext& context) {
                  cuda::moe_init_routing(inputs, outputs, attributes, context);
                });
     },
     [](const c10::Device& device, const FinalizeRoutingInputs& inputs,
        const FinalizeRoutingOutputs& outputs, const FinalizeRoutingAttributes& attributes) {
       run_cuda(device, cuda::finalize_routing_workspace_bytes(inputs, attributes),
                [&](const cuda::DeviceContext& context) {
                  cuda::moe_finalize_routing(inputs, outputs, attributes, context);
                });
     }});

}  // namespace
}  // namespace moe_reroute::torch_ops
