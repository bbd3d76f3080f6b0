// The per-device CUDA status word: made, read under the status check's mode, and cuda_check.

#include "torch_cuda_status.h"

#include <atomic>
#include <cstdint>
#include <mutex>
#include <vector>

#include "adapter.h"
#if MOE_REROUTE_HAS_CUDA
#include <ATen/ops/zeros.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>

#include "moe_reroute/cuda.h"

// The current CUDA stream from torch's C shim (libtorch_cuda), which declares
// it only when torch's own build defines USE_CUDA.
extern "C" AOTITorchError aoti_torch_get_current_cuda_stream(std::int32_t device_index,
                                                             void** ret_stream);
#endif

namespace moe_reroute::torch_ops {
namespace {

using adapter::fail;

// Whether every CUDA call reads its device's status word ("sync" mode).
std::atomic<bool> sync_mode{false};

#if MOE_REROUTE_HAS_CUDA
// The status word of each CUDA device: sticky (kernels OR their bits in), read
// and cleared only by cuda_check or, in "sync" mode, after every call.
std::mutex status_mutex;
std::vector<Tensor> status_words;
#endif

}  // namespace

#if MOE_REROUTE_HAS_CUDA
void* current_stream(const c10::Device& device) {
  void* stream = nullptr;
  if (aoti_torch_get_current_cuda_stream(device.index(), &stream) != AOTI_TORCH_SUCCESS) {
    fail(ErrorCode::kBackend, "tokens: cannot get the current CUDA stream of " + device.str());
  }
  return stream;
}

// The capture status is asked only where capture would refuse the call, not
// on every deferred call.
StatusWord status_word(const c10::Device& device, void* stream) {
  StatusWord status;
  {
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
    status.word = status_words[index];
  }
  status.sync = sync_mode.load(std::memory_order_relaxed);
  if (status.sync && cuda::stream_is_capturing(stream)) {
    fail(ErrorCode::kBackend,
         "set_cuda_status_check: \"sync\" reads the status word after every call, which "
         "cannot happen under CUDA graph capture; capture in \"deferred\" mode");
  }
  return status;
}

void check_status(const Tensor& word) {
  const std::int32_t status = word[0].item<std::int32_t>();
  if (status == 0) return;
  word.zero_();
  fail(ErrorCode::kInvalidArgument, cuda::status_message(status));
}
#endif

void cuda_check() {
#if MOE_REROUTE_HAS_CUDA
  translated([] {
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
  });
#endif
}

std::string set_cuda_status_check(c10::string_view mode) {
  return translated([&] {
    if (mode != "deferred" && mode != "sync") {
      fail(ErrorCode::kInvalidArgument,
           "mode: must be \"deferred\" or \"sync\"; got \"" + std::string(mode) + "\"");
    }
    return std::string(sync_mode.exchange(mode == "sync") ? "sync" : "deferred");
  });
}

}  // namespace moe_reroute::torch_ops
