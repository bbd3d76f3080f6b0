// The CUDA backend where no GPU is usable: calls throw Error with
// ErrorCode::kBackend instead of launching or guessing. Skips where a GPU
// is present; the device suite is bench/gpu_correctness.cu (every case
// against the naive reference), which ctest runs as gpu_correctness.

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "moe_reroute/cuda.h"
#include "moe_reroute/reroute.h"
#include "workload.h"

namespace moe_reroute::cuda {
namespace {

using testing::Workload;
using testing::WorkloadConfig;

int device_count() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}

// Where no GPU is usable the call throws instead of launching.
TEST(CudaNoGpu, ThrowsInsteadOfLaunching) {
  if (device_count() > 0) GTEST_SKIP() << "a CUDA device is present";
  WorkloadConfig config;
  config.num_tokens = 10;
  config.hidden = 8;
  config.num_ranks = 2;
  config.num_experts = 2;
  Workload w(config);
  std::vector<std::int64_t> workspace(required_workspace_bytes(2, 2) / 8);
  std::int32_t status = 0;
  try {
    moe_re_routing(w.inputs(), w.outputs(), {},
                   {nullptr, &status, workspace.data(), required_workspace_bytes(2, 2)});
    ADD_FAILURE() << "no error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kBackend);
    EXPECT_EQ(std::string(error.what()).rfind("cuda: ", 0), 0u) << error.what();
  }
}

TEST(CudaNoGpu, StreamIsCapturingThrowsInsteadOfGuessing) {
  if (device_count() > 0) GTEST_SKIP() << "a CUDA device is present";
  try {
    stream_is_capturing(nullptr);
    ADD_FAILURE() << "no error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kBackend);
    EXPECT_EQ(std::string(error.what()).rfind("cuda: cudaStreamIsCapturing: ", 0), 0u)
        << error.what();
  }
}

}  // namespace
}  // namespace moe_reroute::cuda
