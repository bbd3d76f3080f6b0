// The CUDA operator at the benchmark shapes: verified byte for byte against
// the naive reference (poisoned outputs, unspecified rows must stay poison),
// then timed against cudaMemcpyAsync device-to-device of the same bytes, as
// plain launches and as CUDA graph replays. Decode-sized shapes rotate over
// enough buffer sets to pass the 60 MB L2 of an H200, so they time HBM.
// Rows one256 .. two8192 time decode at N x E = 256, 2048 and 8192 blocks in
// one launch and in two kernels. Prints a table (medians over batches) and
// writes it as TSV for bench/gpu_check.sh; a shape that fails is reported
// and the next one runs. Needs only the CUDA toolkit and the core library.
//
// Usage: moe_reroute_gpu_bench [--dry-run] [--reps N] [--tsv FILE] [--no-big]

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/api.h"
#include "moe_reroute/cuda.h"
#include "reference.h"
#include "workload.h"

namespace {

using namespace moe_reroute;
using cuda::detail::Path;

constexpr std::size_t kRotationBytes = std::size_t{256} << 20;  // > 4x the H200's L2
constexpr std::size_t kAlign = 256;

// A failure ends its shape, not the run (main reports it and goes on).
void check(cudaError_t error, const char* what) {
  if (error != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(error));
  }
}

std::size_t aligned(std::size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

struct BenchShape;
int planned_sets(const BenchShape& shape);

struct BenchShape {
  const char* name;
  std::int64_t num_tokens;
  DType dtype;
  std::int64_t alignment = 1;
  std::int64_t valid_quarters = 4;  // counts cover this many quarters of A
  std::int64_t num_ranks = 16;
  std::int64_t num_experts = 16;
  Path path = Path::kAuto;
  const char* blocks = "";  // the cut-off rows: N x E after the name
};

// Buffer sets a shape rotates over: inputs and outputs of all of them pass
// kRotationBytes, so no call finds its bytes in L2.
std::string shape_name(const BenchShape& s) { return std::string(s.name) + s.blocks; }

int planned_sets(const BenchShape& s) {
  const std::int64_t rows = s.alignment == 1 ? s.num_tokens : s.num_tokens + 16 * (s.alignment - 1);
  const auto set_bytes = static_cast<std::size_t>(2 * rows * (dtype_bytes(s.dtype, 7168) + 12));
  return static_cast<int>(std::clamp<std::size_t>(kRotationBytes / set_bytes, 1, 64));
}

testing::WorkloadConfig config_for(const BenchShape& s) {
  testing::WorkloadConfig c;
  c.num_tokens = s.num_tokens;
  c.hidden = 7168;
  c.token_dtype = s.dtype;
  c.num_ranks = s.num_ranks;
  c.num_experts = s.num_experts;
  c.seed = 42;
  c.attributes.expert_alignment = s.alignment;
  if (s.valid_quarters != 4) {
    c.attributes.allow_spare_rows = true;
    c.num_valid_tokens = s.num_tokens * s.valid_quarters / 4;
  }
  return c;
}

// One set of device buffers: the inputs in one allocation (tokens, scales,
// weight, counts) and the outputs in another, so that the copy baseline is
// one cudaMemcpyAsync of what the operator reads.
struct DeviceSet {
  std::byte* in = nullptr;
  std::byte* out = nullptr;
  void* workspace = nullptr;
  Path path = Path::kAuto;
  std::size_t out_bytes = 0;
  RerouteInputs inputs;
  RerouteOutputs outputs;
  cuda::DeviceContext context;
  std::size_t copy_bytes = 0;
};

template <typename T>
TensorView moved(const T& host, std::byte*& next) {
  TensorView view = host;
  view.data = next;
  next += aligned(static_cast<std::size_t>(host.nbytes()));
  return view;
}

std::size_t inputs_bytes(const testing::Workload& w) {
  const RerouteInputs h = w.inputs();
  return aligned(h.tokens.nbytes()) + aligned(h.per_token_scales->nbytes()) +
         aligned(h.expert_topk_weight->nbytes()) + aligned(h.expert_token_num_per_rank.nbytes());
}

std::size_t outputs_bytes(testing::Workload& w) {
  const RerouteOutputs h = w.outputs();
  return aligned(h.permute_tokens.nbytes()) + aligned(h.permute_per_token_scales.nbytes()) +
         aligned(h.permute_token_idx.nbytes()) + aligned(h.expert_token_num.nbytes()) +
         aligned(h.permute_topk_weight.nbytes()) + 2 * kAlign;
}

DeviceSet make_set(testing::Workload& w, std::int64_t valid_rows, Path path) {
  DeviceSet s;
  s.path = path;
  const std::size_t workspace_bytes =
      cuda::detail::workspace_bytes(w.config().num_ranks, w.config().num_experts, path);
  if (workspace_bytes > 0) check(cudaMalloc(&s.workspace, workspace_bytes), "cudaMalloc workspace");
  const std::size_t in_bytes = inputs_bytes(w);
  s.out_bytes = outputs_bytes(w);
  check(cudaMalloc(&s.in, in_bytes), "cudaMalloc inputs");
  check(cudaMalloc(&s.out, s.out_bytes), "cudaMalloc outputs");
  const RerouteInputs h = w.inputs();
  std::byte* next = s.in;
  s.inputs.tokens = moved(h.tokens, next);
  s.inputs.per_token_scales = moved(*h.per_token_scales, next);
  s.inputs.expert_topk_weight = moved(*h.expert_topk_weight, next);
  s.inputs.expert_token_num_per_rank = moved(h.expert_token_num_per_rank, next);
  for (const auto& [device, host] :
       {std::pair{s.inputs.tokens, h.tokens},
        {*s.inputs.per_token_scales, *h.per_token_scales},
        {*s.inputs.expert_topk_weight, *h.expert_topk_weight},
        {s.inputs.expert_token_num_per_rank, h.expert_token_num_per_rank}}) {
    check(cudaMemcpy(device.data, host.data, static_cast<std::size_t>(host.nbytes()),
                     cudaMemcpyHostToDevice),
          "upload");
  }
  const RerouteOutputs o = w.outputs();
  next = s.out;
  s.outputs.permute_tokens = moved(o.permute_tokens, next);
  s.outputs.permute_per_token_scales = moved(o.permute_per_token_scales, next);
  s.outputs.permute_token_idx = moved(o.permute_token_idx, next);
  s.outputs.expert_token_num = moved(o.expert_token_num, next);
  s.outputs.permute_topk_weight = moved(o.permute_topk_weight, next);
  auto* status = reinterpret_cast<std::int32_t*>(next);
  check(cudaMemset(status, 0, sizeof(std::int32_t)), "cudaMemset status");
  s.context = {nullptr, status, s.workspace, workspace_bytes};
  // The bytes of the valid rows of tokens, scales and weight, read once.
  const std::int64_t row_bytes = h.tokens.nbytes() / std::max<std::int64_t>(h.tokens.shape()[0], 1);
  s.copy_bytes = static_cast<std::size_t>(valid_rows * (row_bytes + 8));
  return s;
}

std::vector<std::byte> download(const TensorView& v) {
  std::vector<std::byte> host(static_cast<std::size_t>(v.nbytes()));
  check(cudaMemcpy(host.data(), v.data, host.size(), cudaMemcpyDeviceToHost), "download");
  return host;
}

std::int32_t read_status(const DeviceSet& s) {
  std::int32_t status = -1;
  check(cudaMemcpy(&status, s.context.status, 4, cudaMemcpyDeviceToHost), "status");
  return status;
}

// One call on poisoned outputs against the naive reference: "" or the first difference.
std::string verify(testing::Workload& w, DeviceSet& s, const Attributes& attributes,
                   cudaStream_t stream) {
  // Everything but the status word, which follows the outputs; on the
  // call's stream, which does not wait for the legacy one.
  check(
      cudaMemsetAsync(
          s.out, 0xA5,
          static_cast<std::size_t>(reinterpret_cast<std::byte*>(s.context.status) - s.out), stream),
      "poison");
  s.context.stream = stream;
  cuda::detail::moe_re_routing(s.inputs, s.outputs, attributes, s.context, s.path);
  check(cudaStreamSynchronize(stream), "verify call");
  const std::int32_t status = read_status(s);
  if (status != 0) return "status " + std::to_string(status) + ": " + cuda::status_message(status);
  w.permute_tokens = download(s.outputs.permute_tokens);
  w.permute_scales = download(s.outputs.permute_per_token_scales);
  w.permute_weight = download(s.outputs.permute_topk_weight);
  w.token_idx = download(s.outputs.permute_token_idx);
  w.expert_token_num = download(s.outputs.expert_token_num);
  return w.compare(testing::reference_reroute(
      w.reference_inputs(), attributes.expert_token_num_type, attributes.idx_type));
}

// Median over batches of the mean microseconds per call of `enqueue(i)`,
// called for i = 0 .. batch-1 between two events.
double median_us(cudaStream_t stream, int reps, int batch,
                 const std::function<void(int)>& enqueue) {
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  for (int i = 0; i < batch; ++i) enqueue(i);
  std::vector<float> times;
  for (int r = 0; r < reps; ++r) {
    check(cudaEventRecord(start, stream), "cudaEventRecord");
    for (int i = 0; i < batch; ++i) enqueue(i);
    check(cudaEventRecord(stop, stream), "cudaEventRecord");
    check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    times.push_back(ms * 1000.0f / static_cast<float>(batch));
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  return times[times.size() / 2];
}

// Each of `calls` captured in its own graph, replayed in turn.
double median_graph_us(cudaStream_t stream, int reps,
                       const std::vector<std::function<void()>>& calls) {
  std::vector<cudaGraphExec_t> execs;
  for (const auto& call : calls) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "capture");
    call();
    check(cudaStreamEndCapture(stream, &graph), "end capture");
    check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
    cudaGraphDestroy(graph);
    execs.push_back(exec);
  }
  const double us = median_us(stream, reps, static_cast<int>(execs.size()), [&](int i) {
    check(cudaGraphLaunch(execs[static_cast<std::size_t>(i)], stream), "graph launch");
  });
  for (cudaGraphExec_t exec : execs) cudaGraphExecDestroy(exec);
  return us;
}

struct Options {
  bool dry_run = false;
  bool big = true;
  int reps = 30;
  std::string tsv;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--dry-run") {
      o.dry_run = true;
    } else if (arg == "--no-big") {
      o.big = false;
    } else if (arg == "--reps" && i + 1 < argc) {
      o.reps = std::max(3, std::atoi(argv[++i]));
    } else if (arg == "--tsv" && i + 1 < argc) {
      o.tsv = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--dry-run] [--reps N] [--tsv FILE] [--no-big]\n", argv[0]);
      std::exit(2);
    }
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const Options options = parse(argc, argv);
  // bf16 H = 7168, N = E = 16, [A] float32 scales, [A, 1] weights. 163840
  // rows of bf16 are 2.35 GB: one tensor past 2 GiB (64-bit byte offsets).
  std::vector<BenchShape> shapes = {
      {"decode", 256, DType::kBFloat16},          {"decode", 256, DType::kInt8},
      {"decode", 256, DType::kBFloat16, 1, 1},    {"decode", 256, DType::kBFloat16, 128, 1},
      {"decode", 256, DType::kBFloat16, 128},     {"prefill", 16384, DType::kBFloat16},
      {"prefill", 16384, DType::kInt8},
      {"prefill", 16384, DType::kFloat4E2M1},           {"prefill", 16384, DType::kBFloat16, 128},
      {"prefill", 16384, DType::kBFloat16, 1, 1},
  };
  // The one-launch / two-launch cut-off: decode at N x E = 256, 2048 and
  // 8192 blocks, one launch (tables in each CTA's shared memory) against the
  // tables kernel and the move kernel.
  for (const auto& [name, ranks, experts] :
       {std::tuple{"256", 16, 16}, {"2048", 32, 64}, {"8192", 64, 128}}) {
    for (const Path path : {Path::kAuto, Path::kTwoKernels}) {
      shapes.push_back(
          {path == Path::kAuto ? "one" : "two", 256, DType::kBFloat16, 1, 4, ranks, experts, path});
      shapes.back().blocks = name;
    }
  }
  if (options.big) shapes.push_back({"prefill", 163840, DType::kBFloat16});
  std::printf("%-8s %7s %-9s %4s %6s %5s %10s %10s %10s %9s %8s %8s %s\n", "shape", "A", "dtype",
              "k", "valid", "sets", "op_us", "graph_us", "copy_us", "op_GB/s", "vs_copy",
              "graph_vs", "verified");
  if (options.dry_run) {
    for (const BenchShape& s : shapes) {
      const double mb = static_cast<double>(s.num_tokens * s.valid_quarters / 4) *
                        static_cast<double>(dtype_bytes(s.dtype, 7168) + 8) / 1e6;
      std::printf(
          "%-8s %7lld %-9s %4lld %5lld%% %5d  (dry run: %.1f MB read a call, not launched)\n",
          shape_name(s).c_str(), static_cast<long long>(s.num_tokens),
          std::string(dtype_name(s.dtype)).c_str(), static_cast<long long>(s.alignment),
          static_cast<long long>(25 * s.valid_quarters), planned_sets(s), mb);
    }
    return 0;
  }
  int device_count = 0;
  if (cudaGetDeviceCount(&device_count) != cudaSuccess || device_count == 0) {
    std::printf("no CUDA device: nothing timed\n");
    return 1;
  }
  cudaDeviceProp prop;
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::fprintf(stderr, "device: %s, %d SMs, L2 %d MB; median of %d batches, microseconds a call\n",
               prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20, options.reps);
  FILE* tsv = options.tsv.empty() ? nullptr : std::fopen(options.tsv.c_str(), "w");
  if (tsv) std::fprintf(tsv, "shape\tA\tdtype\tk\tvalid\top_us\tgraph_us\tcopy_us\tverified\n");
  cudaStream_t stream;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  int failures = 0;
  for (const BenchShape& shape : shapes) {
    std::vector<DeviceSet> sets;
    try {
      const testing::WorkloadConfig config = config_for(shape);
      testing::Workload w(config);
      const std::int64_t valid =
          config.num_valid_tokens < 0 ? config.num_tokens : config.num_valid_tokens;
      const int num_sets = planned_sets(shape);
      for (int i = 0; i < num_sets; ++i) sets.push_back(make_set(w, valid, shape.path));
      check(cudaDeviceSynchronize(), "setup");
      // Verified before it is timed: a wrong kernel fails here, not in the table.
      const std::string verdict = verify(w, sets[0], config.attributes, stream);
      failures += verdict.empty() ? 0 : 1;
      const int reps = shape.num_tokens >= 100000 ? std::max(5, options.reps / 5) : options.reps;
      const auto call = [&](int i) {
        DeviceSet& s = sets[static_cast<std::size_t>(i)];
        s.context.stream = stream;
        cuda::detail::moe_re_routing(s.inputs, s.outputs, config.attributes, s.context, s.path);
      };
      const auto copy = [&](int i) {
        const DeviceSet& s = sets[static_cast<std::size_t>(i)];
        check(cudaMemcpyAsync(s.out, s.in, s.copy_bytes, cudaMemcpyDeviceToDevice, stream), "copy");
      };
      const double op_us = median_us(stream, reps, num_sets, call);
      std::vector<std::function<void()>> calls;
      for (int i = 0; i < num_sets; ++i) calls.push_back([&, i] { call(i); });
      const double graph_us = median_graph_us(stream, reps, calls);
      const double copy_us = median_us(stream, reps, num_sets, copy);
      for (const DeviceSet& s : sets) {
        if (read_status(s) != 0) {
          failures += 1;
          std::fprintf(stderr, "status after timing: %d\n", read_status(s));
        }
      }
      const double gbps = 2.0 * static_cast<double>(sets[0].copy_bytes) / (op_us * 1e3);
      const std::string dtype(dtype_name(shape.dtype));
      const char* ok = verdict.empty() ? "yes" : verdict.c_str();
      std::printf("%-8s %7lld %-9s %4lld %5lld%% %5d %10.2f %10.2f %10.2f %9.1f %8.3f %8.3f %s\n",
                  shape_name(shape).c_str(), static_cast<long long>(shape.num_tokens),
                  dtype.c_str(), static_cast<long long>(shape.alignment),
                  static_cast<long long>(25 * shape.valid_quarters), num_sets, op_us, graph_us,
                  copy_us, gbps, copy_us / op_us, copy_us / graph_us, ok);
      std::fflush(stdout);
      if (tsv) {
        std::fprintf(tsv, "%s\t%lld\t%s\t%lld\t%lld\t%.3f\t%.3f\t%.3f\t%s\n",
                     shape_name(shape).c_str(), static_cast<long long>(shape.num_tokens),
                     dtype.c_str(), static_cast<long long>(shape.alignment),
                     static_cast<long long>(valid), op_us, graph_us, copy_us,
                     verdict.empty() ? "yes" : "NO");
      }
    } catch (const std::exception& error) {
      failures += 1;
      std::printf("%-8s %7lld FAILED: %s\n", shape_name(shape).c_str(),
                  static_cast<long long>(shape.num_tokens), error.what());
    }
    for (const DeviceSet& s : sets) {
      cudaFree(s.in);
      cudaFree(s.out);
      cudaFree(s.workspace);
    }
  }
  if (tsv) std::fclose(tsv);
  cudaStreamDestroy(stream);
  return failures == 0 ? 0 : 1;
}
