// The CUDA operator against cudaMemcpyAsync device-to-device of the same
// bytes (the limit), plain launches and CUDA graph replay, timed with CUDA
// events; prints medians. Usage: moe_reroute_gpu_bench [repetitions]

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "moe_reroute/cuda.h"
#include "workload.h"

namespace {

using namespace moe_reroute;

void check(cudaError_t error, const char* what) {
  if (error != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(error));
    std::exit(1);
  }
}

void* device_alloc(std::size_t bytes) {
  void* p = nullptr;
  check(cudaMalloc(&p, std::max<std::size_t>(bytes, 1)), "cudaMalloc");
  check(cudaMemset(p, 0x3C, std::max<std::size_t>(bytes, 1)), "cudaMemset");
  return p;
}

// Median microseconds of `enqueue` over `reps` runs, each between two events.
double median_us(cudaStream_t stream, int reps, const std::function<void()>& enqueue) {
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  for (int i = 0; i < 3; ++i) enqueue();
  std::vector<float> times;
  for (int i = 0; i < reps; ++i) {
    check(cudaEventRecord(start, stream), "cudaEventRecord");
    enqueue();
    check(cudaEventRecord(stop, stream), "cudaEventRecord");
    check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    times.push_back(ms * 1000.0f);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  return times[times.size() / 2];
}

// `enqueue` captured once into a graph and replayed.
double median_graph_us(cudaStream_t stream, int reps, const std::function<void()>& enqueue) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "capture");
  enqueue();
  check(cudaStreamEndCapture(stream, &graph), "end capture");
  check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  const double us = median_us(stream, reps, [&] { check(cudaGraphLaunch(exec, stream), "launch"); });
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return us;
}

struct Case {
  const char* name;
  std::int64_t num_tokens;
  DType dtype;
};

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 50;
  int device_count = 0;
  if (cudaGetDeviceCount(&device_count) != cudaSuccess || device_count == 0) {
    std::printf("no CUDA device: skipped\n");
    return 0;
  }
  cudaDeviceProp prop;
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::printf("device: %s, %d SMs; H = 7168, N = 16, E = 16, [A] float32 scales, [A, 1] "
              "weights; median of %d, microseconds\n",
              prop.name, prop.multiProcessorCount, reps);
  std::printf("%-8s %7s %-9s %-6s %10s %10s %9s %9s\n", "shape", "A", "dtype", "mode", "op_us",
              "memcpy_us", "op_GB/s", "vs_copy");
  cudaStream_t stream;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  const Case cases[] = {{"decode", 256, DType::kInt8},     {"decode", 256, DType::kBFloat16},
                          {"prefill", 16384, DType::kInt8},  {"prefill", 16384, DType::kBFloat16},
                          {"prefill", 131072, DType::kInt8}, {"prefill", 131072, DType::kBFloat16}};
  constexpr std::int64_t kHidden = 7168, kRanks = 16, kExperts = 16;
  for (const Case& shape : cases) {
    const std::int64_t a = shape.num_tokens;
    const std::size_t token_bytes = static_cast<std::size_t>(dtype_bytes(shape.dtype, a * kHidden));
    const std::size_t row_bytes = static_cast<std::size_t>(a) * 4;
    const std::vector<std::int64_t> counts64 =
        testing::random_counts(kRanks, kExperts, a, 0.0, 0.0, 42);
    const std::vector<std::int32_t> counts(counts64.begin(), counts64.end());
    void* tokens = device_alloc(token_bytes);
    void* scales = device_alloc(row_bytes);
    void* weight = device_alloc(row_bytes);
    void* count_data = device_alloc(counts.size() * 4);
    check(cudaMemcpy(count_data, counts.data(), counts.size() * 4, cudaMemcpyHostToDevice), "copy");
    void* permute_tokens = device_alloc(token_bytes);
    void* permute_scales = device_alloc(row_bytes);
    void* permute_weight = device_alloc(row_bytes);
    void* index = device_alloc(row_bytes);
    void* expert_token_num = device_alloc(kExperts * 4);
    auto* status = static_cast<std::int32_t*>(device_alloc(4));
    const std::size_t workspace_bytes = cuda::required_workspace_bytes(kRanks, kExperts);
    void* workspace = device_alloc(workspace_bytes);
    // The copy moves what the operator reads (tokens, scales, weights) once.
    const std::size_t copy_bytes = token_bytes + 2 * row_bytes;
    void* copy_src = device_alloc(copy_bytes);
    void* copy_dst = device_alloc(copy_bytes);

    check(cudaDeviceSynchronize(), "setup");
    const RerouteInputs inputs{TensorView(tokens, shape.dtype, {a, kHidden}),
                               TensorView(count_data, DType::kInt32, {kRanks, kExperts}),
                               TensorView(scales, DType::kFloat32, {a}),
                               TensorView(weight, DType::kFloat32, {a, 1})};
    const RerouteOutputs outputs{TensorView(permute_tokens, shape.dtype, {a, kHidden}),
                                 TensorView(permute_scales, DType::kFloat32, {a}),
                                 TensorView(index, DType::kInt32, {a}),
                                 TensorView(expert_token_num, DType::kInt32, {kExperts}),
                                 TensorView(permute_weight, DType::kFloat32, {a, 1})};
    const cuda::DeviceContext context{stream, status, workspace, workspace_bytes};
    const auto op = [&] { cuda::moe_re_routing(inputs, outputs, {}, context); };
    const auto copy = [&] {
      check(cudaMemcpyAsync(copy_dst, copy_src, copy_bytes, cudaMemcpyDeviceToDevice, stream),
            "cudaMemcpyAsync");
    };
    const int shape_reps = a >= 131072 ? std::max(5, reps / 5) : reps;
    for (const bool graph : {false, true}) {
      const double op_us = graph ? median_graph_us(stream, shape_reps, op)
                                 : median_us(stream, shape_reps, op);
      const double copy_us = graph ? median_graph_us(stream, shape_reps, copy)
                                   : median_us(stream, shape_reps, copy);
      std::int32_t host_status = -1;
      check(cudaMemcpy(&host_status, status, 4, cudaMemcpyDeviceToHost), "status");
      if (host_status != 0) {
        std::fprintf(stderr, "status %d: %s\n", host_status, cuda::status_message(host_status).c_str());
        return 1;
      }
      // Bytes read plus written, as for the copy.
      const double gbps = 2.0 * static_cast<double>(copy_bytes) / (op_us * 1e3);
      std::printf("%-8s %7lld %-9s %-6s %10.2f %10.2f %9.1f %9.3f\n", shape.name,
                  static_cast<long long>(a), std::string(dtype_name(shape.dtype)).c_str(),
                  graph ? "graph" : "plain", op_us, copy_us, gbps, copy_us / op_us);
    }
    for (void* p : {tokens, scales, weight, count_data, permute_tokens, permute_scales,
                    permute_weight, index, expert_token_num, static_cast<void*>(status), workspace,
                    copy_src, copy_dst}) {
      cudaFree(p);
    }
  }
  cudaStreamDestroy(stream);
  return 0;
}
