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

// The routing operators' valid calls get past every host check to the device guard.
TEST(CudaNoGpu, RoutingThrowsInsteadOfLaunching) {
  if (device_count() > 0) GTEST_SKIP() << "a CUDA device is present";
  std::vector<std::int64_t> memory(256);
  auto* base = reinterpret_cast<std::byte*>(memory.data());
  std::int32_t status = 0;
  InitRoutingInputs init{TensorView(base, DType::kInt8, {4, 8}),
                         TensorView(base + 64, DType::kInt32, {4, 2})};
  const InitRoutingAttributes attributes{.expert_num = 3};
  const std::size_t init_bytes = init_routing_workspace_bytes(init, attributes);
  std::vector<std::int64_t> workspace(init_bytes / 8 + 1);
  const InitRoutingOutputs init_out{
      TensorView(base + 128, DType::kInt8, {8, 8}), TensorView(base + 192, DType::kInt32, {8}),
      TensorView(nullptr, DType::kInt32, {0}), TensorView(nullptr, DType::kInt32, {0})};
  FinalizeRoutingInputs finalize{TensorView(base + 256, DType::kFloat32, {8, 4}),
                                 TensorView(base + 384, DType::kInt32, {8})};
  const FinalizeRoutingOutputs finalize_out{TensorView(base + 448, DType::kFloat32, {8, 4})};
  const auto backend_error = [](const auto& call) {
    try {
      call();
      ADD_FAILURE() << "no error";
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kBackend);
      EXPECT_EQ(std::string(error.what()).rfind("cuda: ", 0), 0u) << error.what();
    }
  };
  backend_error([&] {
    moe_init_routing(init, init_out, attributes, {nullptr, &status, workspace.data(), init_bytes});
  });
  backend_error([&] {
    moe_finalize_routing(
        finalize, finalize_out, {},
        {nullptr, &status, workspace.data(), finalize_routing_workspace_bytes(finalize)});
  });
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
