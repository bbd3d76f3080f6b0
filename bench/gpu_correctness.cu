// The CUDA backend's correctness on a GPU, needing only the CUDA toolkit and
// the core (no GTest, no CLI11), for bench/gpu_check.sh and ctest: every case
// runs on poisoned outputs between poisoned guard zones and is compared byte
// for byte with the naive reference (testing/), the status word exactly.
// Each group prints one line; the exit status is 0 when every group passed,
// 1 when one failed, 77 (ctest's skip) without a GPU.
//
// Usage: moe_reroute_gpu_correctness [--list] [--quick] [GROUP...]
//   --list   print the groups and what each covers, launching nothing
//   --quick  leave out the groups marked big (over 2 GiB of device memory)
//   GROUP    run only these groups (compute-sanitizer's reduced list)

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/api.h"
#include "cuda/kernels.h"
#include "moe_reroute/cuda.h"
#include "reference.h"
#include "routing_reference.h"
#include "workload.h"

namespace {

using namespace moe_reroute;
using cuda::detail::Path;
using testing::kPoison;
using testing::Workload;
using testing::WorkloadConfig;

constexpr std::size_t kGuardBytes = 64;

void check(cudaError_t error, const char* what) {
  if (error != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(error));
}

// Device bytes `offset` past a 256-byte aligned allocation, between guard
// zones; everything starts as poison.
class DeviceBuffer {
 public:
  DeviceBuffer(std::size_t bytes, std::size_t offset) : bytes_(bytes), offset_(offset) {
    check(cudaMalloc(&base_, total()), "cudaMalloc");
    fill(base_, total(), kPoison);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { cudaFree(base_); }

  std::byte* data() const { return static_cast<std::byte*>(base_) + kGuardBytes + offset_; }
  void upload(const std::vector<std::byte>& host) const {
    check(cudaMemcpy(data(), host.data(), bytes_, cudaMemcpyHostToDevice), "upload");
  }
  void poison() const { fill(data(), bytes_, kPoison); }
  std::vector<std::byte> download() const {
    std::vector<std::byte> host(bytes_);
    check(cudaMemcpy(host.data(), data(), bytes_, cudaMemcpyDeviceToHost), "download");
    return host;
  }
  /// "" when nothing outside [data, data + size) was written.
  std::string guards(const char* name) const {
    std::vector<std::byte> all(total());
    check(cudaMemcpy(all.data(), base_, total(), cudaMemcpyDeviceToHost), "download");
    for (std::size_t i = 0; i < all.size(); ++i) {
      const bool inside = i >= kGuardBytes + offset_ && i < kGuardBytes + offset_ + bytes_;
      if (!inside && all[i] != kPoison) return std::string(name) + ": guard byte written";
    }
    return "";
  }

 private:
  // cudaMemset runs on the legacy stream, asynchronously: the wait orders it
  // before the calls on the test's non-blocking stream.
  static void fill(void* at, std::size_t bytes, std::byte value) {
    check(cudaMemset(at, std::to_integer<int>(value), bytes), "cudaMemset");
    check(cudaDeviceSynchronize(), "cudaMemset");
  }
  std::size_t total() const { return bytes_ + offset_ + 2 * kGuardBytes; }
  void* base_ = nullptr;
  std::size_t bytes_;
  std::size_t offset_;
};

TensorView on(const TensorView& host, const DeviceBuffer& buffer) {
  return TensorView(host.data == nullptr ? nullptr : buffer.data(), host.dtype(), host.shape());
}

// Where a case puts its tensors: byte offsets from 256-byte alignment.
struct Placement {
  std::size_t tokens = 0;   // of tokens, scales and weight
  std::size_t outputs = 0;  // of permute_tokens, its scales and weight
};

// One forward call's device tensors, from a Workload's host ones.
class ForwardCall {
 public:
  ForwardCall(Workload& w, Placement at, Path path)
      : w_(w),
        path_(path),
        tokens_(w.tokens.size(), at.tokens),
        scales_(w.scales.size(), at.tokens),
        weight_(w.weight.size(), at.tokens),
        counts_(w.counts_storage.size(), 0),
        permute_tokens_(w.permute_tokens.size(), at.outputs),
        permute_scales_(w.permute_scales.size(), at.outputs),
        permute_weight_(w.permute_weight.size(), at.outputs),
        token_idx_(w.token_idx.size(), 0),
        expert_token_num_(w.expert_token_num.size(), 0),
        status_(4, 0),
        workspace_bytes_(
            cuda::detail::workspace_bytes(w.config().num_ranks, w.config().num_experts, path)),
        workspace_(workspace_bytes_, 0) {
    tokens_.upload(w.tokens);
    scales_.upload(w.scales);
    weight_.upload(w.weight);
    counts_.upload(w.counts_storage);
    clear_status();
  }

  void upload_counts() const { counts_.upload(w_.counts_storage); }
  void clear_status() const { check(cudaMemset(status_.data(), 0, 4), "status"); }
  void poison_outputs() const {
    for (const DeviceBuffer* b : outputs()) b->poison();
  }

  void enqueue(cudaStream_t stream) const {
    const RerouteInputs host = w_.inputs();
    RerouteInputs in{on(host.tokens, tokens_), on(host.expert_token_num_per_rank, counts_),
                     std::nullopt, std::nullopt};
    if (host.per_token_scales) in.per_token_scales = on(*host.per_token_scales, scales_);
    if (host.expert_topk_weight) in.expert_topk_weight = on(*host.expert_topk_weight, weight_);
    const RerouteOutputs o = w_.outputs();
    const RerouteOutputs out{
        on(o.permute_tokens, permute_tokens_), on(o.permute_per_token_scales, permute_scales_),
        on(o.permute_token_idx, token_idx_), on(o.expert_token_num, expert_token_num_),
        on(o.permute_topk_weight, permute_weight_)};
    cuda::detail::moe_re_routing(in, out, w_.config().attributes,
                                 {stream, reinterpret_cast<std::int32_t*>(status_.data()),
                                  workspace_.data(), workspace_bytes_},
                                 path_);
  }

  std::int32_t status() const {
    std::int32_t value = 0;
    check(cudaMemcpy(&value, status_.data(), 4, cudaMemcpyDeviceToHost), "status");
    return value;
  }

  /// "" when the outputs equal the naive reference and no guard was written.
  std::string compare() const {
    if (const std::int32_t s = status(); s != 0) return "status " + std::to_string(s);
    w_.permute_tokens = permute_tokens_.download();
    w_.permute_scales = permute_scales_.download();
    w_.permute_weight = permute_weight_.download();
    w_.token_idx = token_idx_.download();
    w_.expert_token_num = expert_token_num_.download();
    const Attributes& a = w_.config().attributes;
    const std::string diff = w_.compare(
        testing::reference_reroute(w_.reference_inputs(), a.expert_token_num_type, a.idx_type));
    return diff.empty() ? guards() : diff;
  }

  /// "" when the status is exactly `bits` and every output still holds poison.
  std::string untouched(std::int32_t bits) const {
    if (const std::int32_t s = status(); s != bits) {
      return "status " + std::to_string(s) + ", expected " + std::to_string(bits);
    }
    for (const DeviceBuffer* b : outputs()) {
      for (const std::byte v : b->download()) {
        if (v != kPoison) return "bad counts wrote an output";
      }
    }
    return guards();
  }

 private:
  std::vector<const DeviceBuffer*> outputs() const {
    return {&permute_tokens_, &permute_scales_, &permute_weight_, &token_idx_, &expert_token_num_};
  }
  std::string guards() const {
    const std::pair<const char*, const DeviceBuffer*> all[] = {
        {"tokens", &tokens_},
        {"scales", &scales_},
        {"weight", &weight_},
        {"counts", &counts_},
        {"permute_tokens", &permute_tokens_},
        {"permute_scales", &permute_scales_},
        {"permute_weight", &permute_weight_},
        {"token_idx", &token_idx_},
        {"expert_token_num", &expert_token_num_},
        {"status", &status_}};
    for (const auto& [name, buffer] : all) {
      if (std::string bad = buffer->guards(name); !bad.empty()) return bad;
    }
    return "";
  }

  Workload& w_;
  Path path_;
  DeviceBuffer tokens_, scales_, weight_, counts_;
  DeviceBuffer permute_tokens_, permute_scales_, permute_weight_, token_idx_, expert_token_num_;
  DeviceBuffer status_;
  std::size_t workspace_bytes_;
  DeviceBuffer workspace_;
};

// w.counts into w.counts_storage, in the counts dtype.
void set_counts(Workload& w, const std::vector<std::int64_t>& counts) {
  w.counts = counts;
  const bool int32 = w.config().count_dtype == DType::kInt32;
  for (std::size_t i = 0; i < counts.size(); ++i) {
    const auto value32 = static_cast<std::int32_t>(counts[i]);
    std::memcpy(w.counts_storage.data() + i * (int32 ? 4 : 8),
                int32 ? static_cast<const void*>(&value32) : &counts[i], int32 ? 4 : 8);
  }
}

// Counts the cases of a group and keeps its first failure.
class Verdict {
 public:
  void add(const std::string& what, const std::string& difference) {
    ++cases_;
    if (!difference.empty() && first_.empty()) first_ = what + ": " + difference;
  }
  int cases() const { return cases_; }
  const std::string& first_failure() const { return first_; }

 private:
  int cases_ = 0;
  std::string first_;
};

std::string describe(const WorkloadConfig& c) {
  const Attributes& a = c.attributes;
  return std::string(dtype_name(c.token_dtype)) + " A=" + std::to_string(c.num_tokens) +
         " H=" + std::to_string(c.hidden) + " " + std::to_string(c.num_ranks) + "x" +
         std::to_string(c.num_experts) + " " + std::string(dtype_name(c.count_dtype)) +
         (a.idx_type == kIdxGather ? " gather" : " scatter") +
         (a.expert_token_num_type == kExpertTokenNumCount ? " count" : " cumsum") +
         " k=" + std::to_string(a.expert_alignment) + (a.allow_spare_rows ? " spare" : "") +
         " seed=" + std::to_string(c.seed);
}

// One forward call of `c` on poisoned outputs, against the naive reference.
void forward_case(Verdict& v, const WorkloadConfig& c, cudaStream_t stream, Placement at = {},
                  Path path = Path::kAuto) {
  Workload w(c);
  const ForwardCall call(w, at, path);
  call.enqueue(stream);
  check(cudaStreamSynchronize(stream), "call");
  v.add(describe(c) + (path == Path::kTwoKernels ? " two kernels" : "") + " at +" +
            std::to_string(at.tokens) + "/+" + std::to_string(at.outputs),
        call.compare());
}

WorkloadConfig shape(std::int64_t num_tokens, std::int64_t hidden, DType dtype, std::int64_t ranks,
                     std::int64_t experts, std::uint64_t seed) {
  WorkloadConfig c;
  c.num_tokens = num_tokens;
  c.hidden = hidden;
  c.token_dtype = dtype;
  c.num_ranks = ranks;
  c.num_experts = experts;
  c.seed = seed;
  return c;
}

// Every source and destination misalignment of the token rows (mod 16).
void misalignments(Verdict& v, cudaStream_t stream) {
  WorkloadConfig c = shape(200, 385, DType::kBFloat16, 4, 8, 1);
  c.scale_tail = {3};
  for (std::size_t src = 0; src < 16; ++src) {
    for (std::size_t dst = 0; dst < 16; ++dst) {
      c.seed = 16 * src + dst;
      forward_case(v, c, stream, {src, dst});
    }
  }
}

// H across the tile and word edges for int8, FP4 and bf16, with both count
// dtypes, both index types and both count modes.
void hidden_sizes(Verdict& v, cudaStream_t stream) {
  std::uint64_t seed = 300;
  for (const DType dtype : {DType::kInt8, DType::kFloat4E2M1, DType::kBFloat16}) {
    for (const std::int64_t h : {1, 7, 385, 3584, 7168}) {
      WorkloadConfig c =
          shape(300, dtype == DType::kFloat4E2M1 ? h + h % 2 : h, dtype, 8, 16, seed++);
      c.count_dtype = seed % 2 == 0 ? DType::kInt32 : DType::kInt64;
      c.attributes.idx_type = static_cast<int>(seed / 2 % 2);
      c.attributes.expert_token_num_type = static_cast<int>(seed / 4 % 2);
      c.skew = 1.0;
      forward_case(v, c, stream, {seed % 16, seed * 7 % 16});
    }
  }
}

// A = 0, one rank, one expert, one token.
void edge_shapes(Verdict& v, cudaStream_t stream) {
  std::uint64_t seed = 400;
  for (const auto& [a, n, e] :
       {std::tuple{0, 4, 4}, {0, 1, 1}, {100, 1, 16}, {100, 16, 1}, {1, 1, 1}, {1, 8, 8}}) {
    for (const DType counts : {DType::kInt32, DType::kInt64}) {
      WorkloadConfig c = shape(a, 7168, DType::kBFloat16, n, e, seed++);
      c.count_dtype = counts;
      c.attributes.expert_token_num_type = static_cast<int>(seed % 2);
      forward_case(v, c, stream);
    }
  }
}

// N x E at the launch limits: 8192 blocks in one launch; 12 x 640, whose
// tables take over 48 KiB of shared memory; 64 x 512, two kernels with
// programmatic dependent launch where the code has the wait; and the
// two-kernel path at a size that would take one launch.
void block_counts(Verdict& v, cudaStream_t stream) {
  std::uint64_t seed = 500;
  for (const auto& [n, e] : {std::pair{1024, 8}, {12, 640}, {64, 512}}) {
    for (const DType counts : {DType::kInt32, DType::kInt64}) {
      WorkloadConfig c = shape(5000, 129, DType::kInt8, n, e, seed++);
      c.count_dtype = counts;
      c.zero_fraction = 0.5;
      c.attributes.idx_type = static_cast<int>(seed % 2);
      forward_case(v, c, stream, {seed % 16, 3});
    }
  }
  WorkloadConfig c = shape(3000, 7168, DType::kBFloat16, 16, 16, seed++);
  forward_case(v, c, stream, {}, Path::kTwoKernels);
  c.attributes.expert_alignment = 128;
  c.attributes.allow_spare_rows = true;
  c.num_valid_tokens = 2000;
  forward_case(v, c, stream, {5, 9}, Path::kTwoKernels);
}

// Static shapes: k in {1, 16, 128} with spare rows, both index types and
// both count modes, on both paths.
void alignments(Verdict& v, cudaStream_t stream) {
  std::uint64_t seed = 600;
  for (const std::int64_t k : {1, 16, 128}) {
    for (int mode = 0; mode < 4; ++mode) {
      WorkloadConfig c = shape(1000, 385, DType::kBFloat16, 8, 16, seed++);
      c.attributes.expert_alignment = k;
      c.attributes.allow_spare_rows = true;
      c.num_valid_tokens = 1000 * (mode + 1) / 5;
      c.attributes.idx_type = mode % 2;
      c.attributes.expert_token_num_type = mode / 2;
      forward_case(v, c, stream, {}, mode == 3 ? Path::kTwoKernels : Path::kAuto);
    }
  }
}

// The inverse on both paths: R rows in expert order back to rank order,
// against the naive reference.
void inverses(Verdict& v, cudaStream_t stream) {
  std::uint64_t seed = 700;
  for (const DType dtype : {DType::kBFloat16, DType::kInt8, DType::kFloat4E2M1, DType::kFloat32}) {
    for (const Path path : {Path::kAuto, Path::kTwoKernels}) {
      WorkloadConfig c = shape(777, 386, dtype, 4, 8, seed++);
      c.attributes.expert_alignment = 16;
      c.attributes.allow_spare_rows = true;
      c.num_valid_tokens = 500;
      Workload w(c);
      // The forward's inputs as the inverse's R expert-ordered rows: R = A + E * 15.
      const std::int64_t rows = w.num_output_rows();
      const std::int64_t row_bytes = dtype_bytes(dtype, c.hidden);
      std::vector<std::byte> expert_rows(static_cast<std::size_t>(rows * row_bytes));
      std::vector<std::byte> expert_weight(static_cast<std::size_t>(rows * 4));
      testing::fill_random(expert_rows.data(), expert_rows.size(), c.seed);
      testing::fill_random(expert_weight.data(), expert_weight.size(), c.seed + 1);
      DeviceBuffer tokens(expert_rows.size(), seed % 16), weight(expert_weight.size(), 2);
      DeviceBuffer counts(w.counts_storage.size(), 0), status(4, 0);
      DeviceBuffer restored(static_cast<std::size_t>(c.num_tokens * row_bytes), 7);
      DeviceBuffer restored_weight(static_cast<std::size_t>(c.num_tokens * 4), 1);
      const std::size_t workspace_bytes = cuda::detail::workspace_bytes(4, 8, path);
      DeviceBuffer workspace(workspace_bytes, 0);
      tokens.upload(expert_rows);
      weight.upload(expert_weight);
      counts.upload(w.counts_storage);
      check(cudaMemset(status.data(), 0, 4), "status");
      const InverseInputs in{TensorView(tokens.data(), dtype, {rows, c.hidden}),
                             TensorView(counts.data(), c.count_dtype, {4, 8}), std::nullopt,
                             TensorView(weight.data(), DType::kFloat32, {rows, 1})};
      const InverseOutputs out{
          TensorView(restored.data(), dtype, {c.num_tokens, c.hidden}), std::nullopt,
          TensorView(restored_weight.data(), DType::kFloat32, {c.num_tokens, 1})};
      cuda::detail::moe_re_routing_inverse(in, out, c.attributes,
                                           {stream, reinterpret_cast<std::int32_t*>(status.data()),
                                            workspace.data(), workspace_bytes},
                                           path);
      check(cudaStreamSynchronize(stream), "inverse");
      testing::ReferenceInputs ref;
      ref.num_ranks = 4;
      ref.num_experts = 8;
      ref.counts = w.counts;
      ref.tokens = expert_rows.data();
      ref.token_row_bytes = row_bytes;
      ref.weight = expert_weight.data();
      ref.num_tokens = c.num_tokens;
      ref.expert_alignment = 16;
      const testing::ReferenceOutputs want = testing::reference_inverse(ref);
      const std::vector<std::byte> got = restored.download();
      const std::vector<std::byte> got_weight = restored_weight.download();
      std::string diff = testing::rows_difference("restored_tokens", got.data(), got.size(),
                                                  want.tokens, want.specified_rows, row_bytes);
      if (diff.empty()) {
        diff = testing::rows_difference("restored_topk_weight", got_weight.data(),
                                        got_weight.size(), want.weight, want.specified_rows, 4);
      }
      if (diff.empty())
        diff = restored.guards("restored_tokens") + restored_weight.guards("restored_topk_weight");
      v.add("inverse " + describe(c) + (path == Path::kTwoKernels ? " two kernels" : ""), diff);
    }
  }
}

// Bad counts on both paths: the status bits exactly, every output still
// poison; then, the word cleared, good counts in the same buffers work.
void bad_counts(Verdict& v, cudaStream_t stream) {
  constexpr std::int64_t kMax64 = std::numeric_limits<std::int64_t>::max();
  using Counts = std::vector<std::int64_t>;
  const struct {
    const char* name;
    DType count_dtype;
    void (*spoil)(Counts&);
    std::int32_t status;
  } cases[] = {
      {"sum short by one", DType::kInt32, [](Counts& c) { c[1] += 5, c[0] -= 6; },
       cuda::kStatusCountSumMismatch},
      {"sum over by one", DType::kInt64, [](Counts& c) { c.back() += 1; },
       cuda::kStatusCountSumMismatch},
      {"negative, sum kept", DType::kInt32,
       [](Counts& c) {
         c.back() += c.front() + 5;
         c.front() = -5;
       },
       cuda::kStatusNegativeCount | cuda::kStatusCountSumMismatch},
      {"int32 max", DType::kInt32,
       [](Counts& c) { c.front() = std::numeric_limits<std::int32_t>::max(); },
       cuda::kStatusCountSumMismatch},
      {"int64 sum overflows", DType::kInt64,
       [](Counts& c) {
         c.front() = kMax64;
         c.back() = kMax64;
       },
       cuda::kStatusCountSumMismatch},
      {"int64 min", DType::kInt64,
       [](Counts& c) { c.front() = std::numeric_limits<std::int64_t>::min(); },
       cuda::kStatusNegativeCount | cuda::kStatusCountSumMismatch},
  };
  std::uint64_t seed = 800;
  for (const auto& [n, e] : {std::pair{4, 8}, {64, 512}}) {
    for (const auto& bad : cases) {
      WorkloadConfig c = shape(5000, 77, DType::kBFloat16, n, e, seed++);
      c.count_dtype = bad.count_dtype;
      Workload w(c);
      const Counts good = w.counts;
      Counts spoilt = good;
      bad.spoil(spoilt);
      set_counts(w, spoilt);
      const ForwardCall call(w, {seed % 16, 5}, Path::kAuto);
      call.enqueue(stream);
      check(cudaStreamSynchronize(stream), "call");
      const std::string what = std::string(bad.name) + " " + describe(c);
      v.add(what, call.untouched(bad.status));
      set_counts(w, good);
      call.upload_counts();
      call.clear_status();
      call.enqueue(stream);
      check(cudaStreamSynchronize(stream), "call");
      v.add(what + ", then good counts", call.compare());
    }
  }
}

// One captured call replayed with new counts written between replays, on
// both paths, one replay with bad counts (it must write nothing), with
// static shapes on one of them.
void graph_replays(Verdict& v, cudaStream_t stream) {
  std::uint64_t seed = 900;
  for (const auto& [n, e, static_shapes] :
       {std::tuple{8, 16, false}, {64, 512, false}, {8, 16, true}, {64, 512, true}}) {
    WorkloadConfig c = shape(4000, 7168, DType::kInt8, n, e, seed++);
    if (static_shapes) {
      c.attributes.expert_alignment = 128;
      c.attributes.allow_spare_rows = true;
      c.attributes.idx_type = kIdxScatter;
      c.attributes.expert_token_num_type = kExpertTokenNumCumsum;
    }
    Workload w(c);
    const ForwardCall call(w, {}, Path::kAuto);
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    const bool before = cuda::stream_is_capturing(stream);
    check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "begin capture");
    try {
      v.add("stream_is_capturing", before || !cuda::stream_is_capturing(stream) ? "wrong" : "");
      call.enqueue(stream);
    } catch (...) {
      cudaStreamEndCapture(stream, &graph);
      if (graph != nullptr) cudaGraphDestroy(graph);
      throw;
    }
    check(cudaStreamEndCapture(stream, &graph), "end capture");
    check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
    for (int replay = 0; replay < 4; ++replay) {
      const std::int64_t valid = static_shapes ? c.num_tokens * (replay + 1) / 4 : c.num_tokens;
      std::vector<std::int64_t> counts =
          testing::random_counts(n, e, valid, replay, 0.3 * replay, seed * 10 + replay);
      if (replay == 2) counts.front() += 1;  // a sum past A: nothing written
      set_counts(w, counts);
      call.upload_counts();
      call.poison_outputs();
      call.clear_status();
      check(cudaGraphLaunch(exec, stream), "graph launch");
      check(cudaStreamSynchronize(stream), "replay");
      const std::string what = describe(c) + " replay " + std::to_string(replay);
      v.add(what, replay == 2 ? call.untouched(cuda::kStatusCountSumMismatch) : call.compare());
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
}

// One tensor past 2^31 bytes: 64-bit byte offsets (2.15 GB of bf16 tokens).
void past_2gib(Verdict& v, cudaStream_t stream) {
  WorkloadConfig c = shape(150000, 7168, DType::kBFloat16, 16, 16, 1000);
  c.has_weight = false;
  forward_case(v, c, stream, {0, 0});
}

// A stream of device 1 while device 0 is current: the call runs on device 1
// and device 0 is current again after it.
void device_guard(Verdict& v, cudaStream_t) {
  int devices = 0;
  check(cudaGetDeviceCount(&devices), "cudaGetDeviceCount");
  if (devices < 2) return;
  check(cudaSetDevice(1), "cudaSetDevice");
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  WorkloadConfig c = shape(1000, 385, DType::kBFloat16, 4, 8, 1100);
  Workload w(c);
  const ForwardCall call(w, {}, Path::kAuto);
  check(cudaSetDevice(0), "cudaSetDevice");
  call.enqueue(stream);
  int current = -1;
  check(cudaGetDevice(&current), "cudaGetDevice");
  check(cudaStreamSynchronize(stream), "call");
  v.add("stream of device 1, device 0 current",
        current == 0 ? call.compare() : "the current device changed to " + std::to_string(current));
  cudaStreamDestroy(stream);
}

// moe_init_routing and moe_finalize_routing: every device tensor of a call
// between guard zones, its outputs poisoned, by name.
class DeviceTensors {
 public:
  TensorView add(const char* name, const TensorSpec& spec, std::size_t offset, bool output,
                 const std::vector<std::byte>& host = {}) {
    const auto& added = tensors_.emplace_back(
        Named{name, output, std::make_unique<DeviceBuffer>(spec.nbytes(), offset)});
    if (!host.empty()) added.buffer->upload(host);
    return TensorView(added.buffer->data(), spec.dtype, spec.shape);
  }
  void upload(const char* name, const std::vector<std::byte>& host) const {
    find(name).upload(host);
  }
  std::vector<std::byte> download(const char* name) const { return find(name).download(); }
  void poison_outputs() const {
    for (const Named& t : tensors_) {
      if (t.output) t.buffer->poison();
    }
  }
  /// "" when no guard byte was written.
  std::string guards() const {
    for (const Named& t : tensors_) {
      if (std::string bad = t.buffer->guards(t.name.c_str()); !bad.empty()) return bad;
    }
    return "";
  }
  /// "" when every output still holds poison and no guard was written.
  std::string untouched() const {
    for (const Named& t : tensors_) {
      if (!t.output) continue;
      for (const std::byte b : t.buffer->download()) {
        if (b != kPoison) return t.name + ": written by a refused call";
      }
    }
    return guards();
  }

 private:
  struct Named {
    std::string name;
    bool output;
    std::unique_ptr<DeviceBuffer> buffer;
  };
  const DeviceBuffer& find(const char* name) const {
    for (const Named& t : tensors_) {
      if (t.name == name) return *t.buffer;
    }
    throw std::logic_error(std::string("no tensor ") + name);
  }
  std::vector<Named> tensors_;
};

template <typename T>
std::vector<std::byte> bytes_of(const std::vector<T>& values) {
  std::vector<std::byte> bytes(values.size() * sizeof(T));
  if (!bytes.empty()) std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

// "" when `name`'s bytes are `expected`'s, else where they first differ.
std::string differs(const DeviceTensors& d, const char* name,
                    const std::vector<std::byte>& expected) {
  const std::vector<std::byte> got = d.download(name);
  if (got.size() != expected.size()) return std::string(name) + ": size differs";
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (got[i] != expected[i])
      return std::string(name) + ": byte " + std::to_string(i) + " differs";
  }
  return "";
}

std::int32_t status_of(const DeviceTensors& d) {
  std::int32_t status = 0;
  std::memcpy(&status, d.download("status").data(), 4);
  return status;
}

std::string status_is(const DeviceTensors& d, std::int32_t bits) {
  const std::int32_t status = status_of(d);
  return status == bits ? ""
                        : "status " + std::to_string(status) + ", expected " + std::to_string(bits);
}

// What both routing calls keep beside their tensors: the status word and
// the workspace, and the checks of a refused call.
class RoutingCall {
 public:
  void reset() const {
    d_.poison_outputs();
    d_.upload("status", std::vector<std::byte>(4));
  }
  /// "" when the status is exactly `bits` and no output was written.
  std::string untouched(std::int32_t bits) const {
    if (std::string bad = status_is(d_, bits); !bad.empty()) return bad;
    return d_.untouched();
  }

 protected:
  void add_context(std::size_t workspace_bytes) {
    workspace_bytes_ = workspace_bytes;
    status_ = d_.add("status", {DType::kInt32, {1}}, 0, false, std::vector<std::byte>(4));
    workspace_ = d_.add("workspace", {DType::kUInt8, {static_cast<std::int64_t>(workspace_bytes)}},
                        0, false);
  }
  cuda::DeviceContext context(cudaStream_t stream) const {
    return {stream, static_cast<std::int32_t*>(status_.data), workspace_.data, workspace_bytes_};
  }
  DeviceTensors d_;

 private:
  std::size_t workspace_bytes_ = 0;
  TensorView status_;
  TensorView workspace_;
};

// One call on poisoned outputs: "" when they are the naive reference's.
template <typename Call>
std::string run(const Call& call, cudaStream_t stream) {
  call.reset();
  call.enqueue(stream);
  check(cudaStreamSynchronize(stream), "routing call");
  return call.compare();
}

// One call with a bad value: "" when the status is exactly `bits` and no
// output was written.
template <typename Call>
std::string run_refused(const Call& call, cudaStream_t stream, std::int32_t bits) {
  call.reset();
  call.enqueue(stream);
  check(cudaStreamSynchronize(stream), "routing call");
  return call.untouched(bits);
}

struct InitCase {
  DType dtype = DType::kBFloat16;
  std::int64_t tokens = 0;
  std::int64_t hidden = 1;
  std::int64_t top_k = 1;
  DType id_dtype = DType::kInt32;
  InitRoutingAttributes attributes;
  double skew = 0;         // the share of ids that are expert 0
  std::size_t offset = 0;  // of x and expanded_x from 256-byte alignment
  std::uint64_t seed = 0;
};

std::string describe(const InitCase& c) {
  const InitRoutingAttributes& a = c.attributes;
  return std::string(dtype_name(c.dtype)) + " T=" + std::to_string(c.tokens) +
         " H=" + std::to_string(c.hidden) + " k=" + std::to_string(c.top_k) + " " +
         std::string(dtype_name(c.id_dtype)) + " E=" + std::to_string(a.expert_num) +
         " mode=" + std::to_string(a.drop_pad_mode) + " C=" + std::to_string(a.expert_capacity) +
         " active=" + std::to_string(a.active_num) +
         " flag=" + std::to_string(a.expert_tokens_count_or_cumsum_flag) +
         (a.expert_tokens_before_capacity_flag ? " before" : "") + " at +" +
         std::to_string(c.offset) + " seed=" + std::to_string(c.seed);
}

std::vector<std::int64_t> random_ids(const InitCase& c, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> share(0, 1);
  std::vector<std::int64_t> ids(static_cast<std::size_t>(c.tokens * c.top_k));
  for (std::int64_t& id : ids) {
    id = share(rng) < c.skew ? 0 : static_cast<std::int64_t>(rng() % c.attributes.expert_num);
  }
  return ids;
}

std::vector<std::byte> id_bytes(const std::vector<std::int64_t>& ids, DType dtype) {
  if (dtype == DType::kInt64) return bytes_of(ids);
  return bytes_of(std::vector<std::int32_t>(ids.begin(), ids.end()));
}

std::vector<std::byte> random_bytes(std::size_t size, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> bytes(size);
  for (std::byte& b : bytes) b = static_cast<std::byte>(rng() & 0xff);
  return bytes;
}

// One moe_init_routing call's device tensors; enqueue may be captured.
class InitCall : public RoutingCall {
 public:
  InitCall(const InitCase& c, const std::vector<std::int64_t>& ids) : c_(c), ids_(ids) {
    const std::int64_t row_bytes = dtype_bytes(c.dtype, c.hidden);
    x_ = random_bytes(static_cast<std::size_t>(c.tokens * row_bytes), c.seed);
    inputs_ = {d_.add("x", {c.dtype, {c.tokens, c.hidden}}, c.offset, false, x_),
               d_.add("expert_idx", {c.id_dtype, {c.tokens, c.top_k}}, 0, false,
                      id_bytes(ids, c.id_dtype))};
    const InitRoutingOutputSpecs specs = infer_init_routing(inputs_, c.attributes);
    outputs_ = {
        d_.add("expanded_x", specs.expanded_x, c.offset, true),
        d_.add("expanded_row_idx", specs.expanded_row_idx, 0, true),
        d_.add("expert_tokens_count_or_cumsum", specs.expert_tokens_count_or_cumsum, 0, true),
        d_.add("expert_tokens_before_capacity", specs.expert_tokens_before_capacity, 0, true)};
    add_context(cuda::init_routing_workspace_bytes(inputs_, c.attributes));
  }

  void set_ids(const std::vector<std::int64_t>& ids) {
    ids_ = ids;
    d_.upload("expert_idx", id_bytes(ids, c_.id_dtype));
  }
  void enqueue(cudaStream_t stream) const {
    cuda::moe_init_routing(inputs_, outputs_, c_.attributes, context(stream));
  }

  /// "" when every output is the naive reference's.
  std::string compare() const {
    if (std::string bad = status_is(d_, 0); !bad.empty()) return bad;
    const InitRoutingAttributes& a = c_.attributes;
    const testing::InitReferenceOutputs expected = testing::reference_init_routing(
        {x_.data(), c_.tokens, dtype_bytes(c_.dtype, c_.hidden), ids_, c_.top_k, a.active_num,
         a.expert_capacity, a.expert_num, a.drop_pad_mode, a.expert_tokens_count_or_cumsum_flag,
         a.expert_tokens_before_capacity_flag});
    for (const auto& [name, bytes] :
         {std::pair{"expanded_x", expected.expanded_x},
          {"expanded_row_idx", bytes_of(expected.expanded_row_idx)},
          {"expert_tokens_count_or_cumsum", bytes_of(expected.count_or_cumsum)},
          {"expert_tokens_before_capacity", bytes_of(expected.before_capacity)}}) {
      if (std::string bad = differs(d_, name, bytes); !bad.empty()) return bad;
    }
    return d_.guards();
  }

 private:
  InitCase c_;
  std::vector<std::int64_t> ids_;
  std::vector<std::byte> x_;
  InitRoutingInputs inputs_;
  InitRoutingOutputs outputs_;
};

InitCase init_case(DType dtype, std::int64_t tokens, std::int64_t hidden, std::int64_t top_k,
                   std::int64_t experts, std::uint64_t seed) {
  InitCase c;
  c.dtype = dtype;
  c.tokens = tokens;
  c.hidden = hidden;
  c.top_k = top_k;
  c.attributes.expert_num = experts;
  c.seed = seed;
  return c;
}

// Both modes over dtypes, id widths, row alignments, active_num, capacities
// with drops, skewed ids, the count flags, T = 0, k = 1, E = 1 and E past
// what one chunk of positions holds.
void init_routings(Verdict& v, cudaStream_t stream) {
  std::uint64_t seed = 1200;
  std::vector<InitCase> cases;
  for (const DType dtype : {DType::kInt8, DType::kBFloat16, DType::kFloat4E2M1, DType::kFloat32}) {
    for (const std::int64_t hidden : {2, 7168}) {
      for (const std::size_t offset : {0, 3}) {
        InitCase c = init_case(dtype, 300, hidden, 8, 64, seed++);
        c.offset = offset;
        c.id_dtype = offset == 0 ? DType::kInt32 : DType::kInt64;
        c.attributes.expert_tokens_count_or_cumsum_flag = offset == 0 ? 1 : 2;
        cases.push_back(c);
      }
    }
  }
  for (const auto& [tokens, top_k, experts] : {std::tuple{0, 4, 8},
                                               {1, 1, 1},
                                               {5000, 1, 1},
                                               {4096, 8, 256},
                                               {777, 3, 3000},
                                               {64, 16, 100000},
                                               {32, 8, 256}}) {
    for (const double skew : {0.0, 0.9}) {
      InitCase c = init_case(DType::kBFloat16, tokens, 129, top_k, experts, seed++);
      c.skew = skew;
      c.attributes.expert_tokens_count_or_cumsum_flag = 2;
      cases.push_back(c);
      c.attributes.active_num = tokens * top_k / 3 + 1;  // the rows past it are not copied
      cases.push_back(c);
      if (tokens == 0) continue;
      c.attributes = {};
      c.attributes.drop_pad_mode = kDropPad;
      c.attributes.expert_num = std::min<std::int64_t>(experts, 512);
      c.attributes.expert_capacity = std::max<std::int64_t>(1, tokens / 4);  // drops
      c.attributes.expert_tokens_before_capacity_flag = true;
      cases.push_back(c);
      c.attributes.expert_capacity = tokens;  // no drop, slots left zero
      c.attributes.expert_tokens_before_capacity_flag = false;
      cases.push_back(c);
    }
  }
  for (const InitCase& c : cases) {
    const InitCall call(c, random_ids(c, c.seed + 1));
    v.add(describe(c), run(call, stream));
  }
}

// Ids out of range: the status bit exactly, every output still poison; then
// good ids in the same buffers work.
void init_bad_ids(Verdict& v, cudaStream_t stream) {
  std::uint64_t seed = 1300;
  for (const DType id_dtype : {DType::kInt32, DType::kInt64}) {
    for (const std::int64_t bad_id : {std::int64_t{-1}, std::int64_t{40}, std::int64_t{1} << 40,
                                      std::numeric_limits<std::int64_t>::min()}) {
      if (id_dtype == DType::kInt32 && (bad_id >> 31) != 0 && (bad_id >> 31) != -1) continue;
      for (const std::int64_t mode : {kDropless, kDropPad}) {
        InitCase c = init_case(DType::kBFloat16, 1000, 64, 4, 40, seed++);
        c.id_dtype = id_dtype;
        c.attributes.drop_pad_mode = mode;
        c.attributes.expert_capacity = mode == kDropPad ? 30 : 0;
        c.attributes.expert_tokens_count_or_cumsum_flag = mode == kDropPad ? 0 : 1;
        c.attributes.expert_tokens_before_capacity_flag = mode == kDropPad;
        const std::vector<std::int64_t> good = random_ids(c, seed);
        std::vector<std::int64_t> spoilt = good;
        spoilt[seed % spoilt.size()] = bad_id;
        InitCall call(c, spoilt);
        const std::string what = "id " + std::to_string(bad_id) + " " + describe(c);
        v.add(what, run_refused(call, stream, cuda::kStatusExpertIdOutOfRange));
        call.set_ids(good);
        v.add(what + ", then good ids", run(call, stream));
      }
    }
  }
}

struct FinalizeCase {
  DType dtype = DType::kFloat32;
  DType scales_dtype = DType::kFloat32;
  std::int64_t tokens = 0;
  std::int64_t top_k = 1;
  std::int64_t hidden = 1;
  std::int64_t drop_pad_mode = 0;
  std::int64_t rows = 0;      // R, modes 0 and 2 (fewer than T * k: some pairs skipped)
  std::int64_t experts = 1;   // E of [E, C, H] and of bias
  std::int64_t capacity = 1;  // C, modes 1 and 3
  bool x1 = false, x2 = false, bias = false, scales = false;
  std::uint64_t seed = 0;
};

std::string describe(const FinalizeCase& c) {
  return std::string(dtype_name(c.dtype)) +
         (c.scales ? "/" + std::string(dtype_name(c.scales_dtype)) : "") +
         " T=" + std::to_string(c.tokens) + " k=" + std::to_string(c.top_k) +
         " H=" + std::to_string(c.hidden) + " mode=" + std::to_string(c.drop_pad_mode) +
         " R=" + std::to_string(c.rows) + " E=" + std::to_string(c.experts) +
         " C=" + std::to_string(c.capacity) + (c.x1 ? " x1" : "") + (c.x2 ? " x2" : "") +
         (c.bias ? " bias" : "") + (c.scales ? " scales" : "") + " seed=" + std::to_string(c.seed);
}

testing::FloatType float_type(DType dtype) {
  if (dtype == DType::kFloat16) return testing::FloatType::kFloat16;
  return dtype == DType::kBFloat16 ? testing::FloatType::kBFloat16 : testing::FloatType::kFloat32;
}

// Values in [-4, 4] and, now and then, NaN, infinity, past float16's range
// or subnormal, as `dtype`'s bytes.
std::vector<std::byte> random_floats(DType dtype, std::int64_t count, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> value(-4, 4);
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity(), 70000.0f, 1e-7f, -0.0f};
  std::vector<std::byte> bytes;
  for (std::int64_t i = 0; i < count; ++i) {
    const float v = rng() % 97 == 0 ? specials[rng() % 5] : value(rng);
    const std::vector<std::byte> one = testing::reference_store(float_type(dtype), v);
    bytes.insert(bytes.end(), one.begin(), one.end());
  }
  return bytes;
}

bool capacity_mode(std::int64_t mode) {
  return mode == kFinalizeColumnMajorCapacity || mode == kFinalizeRowMajorCapacity;
}

// Row indices as moe_init_routing leaves them: a permutation of T * k rows
// (those past R skipped), or slots of [E, C] with -1 for dropped pairs.
std::vector<std::int32_t> random_rows(const FinalizeCase& c, std::mt19937_64& rng) {
  std::vector<std::int32_t> rows(static_cast<std::size_t>(c.tokens * c.top_k));
  if (capacity_mode(c.drop_pad_mode)) {
    for (std::int32_t& row : rows) {
      row = rng() % 5 == 0 ? -1 : static_cast<std::int32_t>(rng() % (c.experts * c.capacity));
    }
  } else {
    std::iota(rows.begin(), rows.end(), 0);
    std::shuffle(rows.begin(), rows.end(), rng);
  }
  return rows;
}

// One moe_finalize_routing call's device tensors; enqueue may be captured.
class FinalizeCall : public RoutingCall {
 public:
  FinalizeCall(const FinalizeCase& c, const std::vector<std::int32_t>& rows,
               const std::vector<std::int32_t>& ids)
      : c_(c), rows_(rows), ids_(ids) {
    std::mt19937_64 rng(c.seed);
    const bool capacity = capacity_mode(c.drop_pad_mode);
    const Shape expanded =
        capacity ? Shape{c.experts, c.capacity, c.hidden} : Shape{c.rows, c.hidden};
    host_["expanded_x"] = random_floats(c.dtype, expanded.numel(), rng);
    inputs_.expanded_x = d_.add("expanded_x", {c.dtype, expanded}, 2, false, host_["expanded_x"]);
    inputs_.expanded_row_idx =
        d_.add("expanded_row_idx", {DType::kInt32, {c.tokens * c.top_k}}, 0, false, bytes_of(rows));
    const auto optional = [&](bool given, const char* name, DType dtype, Shape shape) {
      if (!given) return std::optional<TensorView>();
      host_[name] = random_floats(dtype, shape.numel(), rng);
      return std::optional<TensorView>(d_.add(name, {dtype, shape}, 4, false, host_[name]));
    };
    inputs_.x1 = optional(c.x1, "x1", c.dtype, {c.tokens, c.hidden});
    inputs_.x2 = optional(c.x2, "x2", c.dtype, {c.tokens, c.hidden});
    inputs_.bias = optional(c.bias, "bias", c.dtype, {c.experts, c.hidden});
    inputs_.scales = optional(c.scales, "scales", c.scales_dtype, {c.tokens, c.top_k});
    if (c.bias) {
      inputs_.expert_idx =
          d_.add("expert_idx", {DType::kInt32, {c.tokens, c.top_k}}, 0, false, bytes_of(ids));
    }
    outputs_.out = d_.add("out", infer_finalize_routing(inputs_, attributes()).out, 6, true);
    add_context(cuda::finalize_routing_workspace_bytes(inputs_, attributes()));
  }

  void set(const char* name, const std::vector<std::byte>& bytes) {
    host_[name] = bytes;
    d_.upload(name, bytes);
  }
  void set_rows(const std::vector<std::int32_t>& rows) {
    rows_ = rows;
    d_.upload("expanded_row_idx", bytes_of(rows));
  }
  void set_ids(const std::vector<std::int32_t>& ids) {
    ids_ = ids;
    d_.upload("expert_idx", bytes_of(ids));
  }
  void enqueue(cudaStream_t stream) const {
    cuda::moe_finalize_routing(inputs_, outputs_, attributes(), context(stream));
  }

  std::string compare() const {
    if (std::string bad = status_is(d_, 0); !bad.empty()) return bad;
    const auto host = [&](const char* name) -> const void* {
      const auto found = host_.find(name);
      return found == host_.end() ? nullptr : found->second.data();
    };
    testing::FinalizeReferenceInputs in;
    in.dtype = float_type(c_.dtype);
    in.scales_dtype = float_type(c_.scales_dtype);
    in.num_tokens = c_.tokens;
    in.top_k = c_.top_k;
    in.hidden = c_.hidden;
    in.drop_pad_mode = c_.drop_pad_mode;
    in.expanded_x = host("expanded_x");
    in.expanded_rows = capacity_mode(c_.drop_pad_mode) ? c_.experts * c_.capacity : c_.rows;
    in.expanded_row_idx = rows_.data();
    in.x1 = host("x1");
    in.x2 = host("x2");
    in.bias = host("bias");
    in.scales = host("scales");
    in.expert_idx = c_.bias ? ids_.data() : nullptr;
    if (std::string bad = differs(d_, "out", testing::reference_finalize_routing(in));
        !bad.empty()) {
      return bad;
    }
    return d_.guards();
  }

 private:
  FinalizeRoutingAttributes attributes() const { return {c_.drop_pad_mode}; }
  FinalizeCase c_;
  std::vector<std::int32_t> rows_;
  std::vector<std::int32_t> ids_;
  std::map<std::string, std::vector<std::byte>> host_;
  FinalizeRoutingInputs inputs_;
  FinalizeRoutingOutputs outputs_;
};

std::vector<std::int32_t> random_expert_ids(const FinalizeCase& c, std::mt19937_64& rng) {
  std::vector<std::int32_t> ids(static_cast<std::size_t>(c.tokens * c.top_k));
  for (std::int32_t& id : ids) id = static_cast<std::int32_t>(rng() % c.experts);
  return ids;
}

FinalizeCase finalize_case(DType dtype, std::int64_t tokens, std::int64_t top_k,
                           std::int64_t hidden, std::int64_t mode, std::uint64_t seed) {
  FinalizeCase c;
  c.dtype = dtype;
  c.scales_dtype = dtype;
  c.tokens = tokens;
  c.top_k = top_k;
  c.hidden = hidden;
  c.drop_pad_mode = mode;
  c.rows = tokens * top_k - tokens / 3;  // the pairs sorted past R are skipped
  c.experts = 5;
  c.capacity = std::max<std::int64_t>(1, tokens / 2);
  c.seed = seed;
  return c;
}

// Every mode, dtype (with float32 scales too) and set of optional
// inputs, k = 1, T = 0, H from 1 to 7168, against the naive reference's
// float32 steps bit for bit.
void finalize_routings(Verdict& v, cudaStream_t stream) {
  std::uint64_t seed = 1400;
  for (const DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
    for (std::int64_t mode = 0; mode < 4; ++mode) {
      for (int optional = 0; optional < 16; ++optional) {
        FinalizeCase c = finalize_case(dtype, 67, 4, 33, mode, seed++);
        c.x1 = optional & 1;
        c.x2 = c.x1 && (optional & 2);
        c.bias = optional & 4;
        c.scales = optional & 8;
        if (optional & 2) c.scales_dtype = DType::kFloat32;
        std::mt19937_64 rng(seed);
        const FinalizeCall call(c, random_rows(c, rng), random_expert_ids(c, rng));
        v.add(describe(c), run(call, stream));
      }
    }
  }
  for (const auto& [tokens, top_k, hidden] :
       {std::tuple{0, 2, 16}, {1, 1, 1}, {32, 8, 7168}, {1000, 1, 5}, {300, 16, 384}}) {
    for (const DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
      FinalizeCase c = finalize_case(dtype, tokens, top_k, hidden, kFinalizeRowMajor, seed++);
      c.x1 = c.x2 = c.bias = c.scales = true;
      c.scales_dtype = DType::kFloat32;
      std::mt19937_64 rng(seed);
      const FinalizeCall call(c, random_rows(c, rng), random_expert_ids(c, rng));
      v.add(describe(c), run(call, stream));
    }
  }
  // docs/spec.md's single value: a fused multiply-add would give 2^-24, not 0.
  FinalizeCase c = finalize_case(DType::kFloat32, 1, 1, 1, kFinalizeRowMajor, seed++);
  c.rows = 1;
  c.x1 = c.scales = true;
  FinalizeCall call(c, {0}, {});
  const std::vector<float> one_plus = {1.0f + 0x1p-12f};
  call.set("expanded_x", bytes_of(one_plus));
  call.set("scales", bytes_of(one_plus));
  call.set("x1", bytes_of(std::vector<float>{-(1.0f + 0x1p-11f)}));
  v.add("single value " + describe(c), run(call, stream));
}

// Bad row indices and bias ids: the status bits exactly, out still poison;
// then good ones in the same buffers work.
void finalize_bad_rows(Verdict& v, cudaStream_t stream) {
  std::uint64_t seed = 1500;
  const struct {
    const char* name;
    std::int64_t mode;
    std::int32_t row;  // written at one pair (0 is a good row)
    std::int32_t id;   // written at one pair (0 is a good id)
    std::int32_t bits;
  } cases[] = {
      {"-1 in mode 0", kFinalizeColumnMajor, -1, 0, cuda::kStatusRowIndexOutOfRange},
      {"-1 in mode 2", kFinalizeRowMajor, -1, 0, cuda::kStatusRowIndexOutOfRange},
      {"-2 in mode 1", kFinalizeColumnMajorCapacity, -2, 0, cuda::kStatusRowIndexOutOfRange},
      {"E * C in mode 3", kFinalizeRowMajorCapacity, 5 * 20, 0, cuda::kStatusRowIndexOutOfRange},
      {"bias id E", kFinalizeRowMajor, 0, 5, cuda::kStatusBiasRowOutOfRange},
      {"bias id -2 and row -7", kFinalizeColumnMajorCapacity, -7, -2,
       cuda::kStatusRowIndexOutOfRange | cuda::kStatusBiasRowOutOfRange},
  };
  for (const auto& bad : cases) {
    FinalizeCase c = finalize_case(DType::kBFloat16, 41, 3, 100, bad.mode, seed++);
    c.x1 = c.bias = c.scales = true;
    std::mt19937_64 rng(seed);
    const std::vector<std::int32_t> rows = random_rows(c, rng);
    const std::vector<std::int32_t> ids = random_expert_ids(c, rng);
    std::vector<std::int32_t> bad_rows = rows, bad_ids = ids;
    bad_rows[seed % bad_rows.size()] = bad.row;
    bad_ids[(seed + 7) % bad_ids.size()] = bad.id;
    FinalizeCall call(c, bad_rows, bad_ids);
    const std::string what = std::string(bad.name) + " " + describe(c);
    v.add(what, run_refused(call, stream, bad.bits));
    call.set_rows(rows);
    call.set_ids(ids);
    v.add(what + ", then good ones", run(call, stream));
  }
}

// Captures `enqueue` on `stream` into an executable graph.
cudaGraphExec_t capture(cudaStream_t stream, const std::function<void()>& enqueue) {
  cudaGraph_t graph = nullptr;
  check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "begin capture");
  try {
    enqueue();
  } catch (...) {
    cudaStreamEndCapture(stream, &graph);
    if (graph != nullptr) cudaGraphDestroy(graph);
    throw;
  }
  check(cudaStreamEndCapture(stream, &graph), "end capture");
  cudaGraphExec_t exec = nullptr;
  const cudaError_t error = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  check(error, "instantiate");
  return exec;
}

void replay(cudaGraphExec_t exec, cudaStream_t stream) {
  check(cudaGraphLaunch(exec, stream), "graph launch");
  check(cudaStreamSynchronize(stream), "replay");
}

// Each operator captured once and replayed with new ids or row indices
// written between replays, one replay with bad ones (it must write nothing).
void routing_graphs(Verdict& v, cudaStream_t stream) {
  std::uint64_t seed = 1600;
  for (const std::int64_t mode : {kDropless, kDropPad}) {
    InitCase c = init_case(DType::kInt8, 2000, 7168, 8, 128, seed++);
    c.attributes.drop_pad_mode = mode;
    c.attributes.expert_capacity = mode == kDropPad ? 100 : 0;
    c.attributes.expert_tokens_count_or_cumsum_flag = mode == kDropPad ? 0 : 1;
    InitCall call(c, random_ids(c, seed));
    const cudaGraphExec_t exec = capture(stream, [&] { call.enqueue(stream); });
    for (int r = 0; r < 4; ++r) {
      c.skew = 0.3 * r;
      std::vector<std::int64_t> ids = random_ids(c, seed * 10 + r);
      if (r == 2) ids.back() = c.attributes.expert_num;
      call.set_ids(ids);
      call.reset();
      replay(exec, stream);
      const std::string what = describe(c) + " replay " + std::to_string(r);
      v.add(what, r == 2 ? call.untouched(cuda::kStatusExpertIdOutOfRange) : call.compare());
    }
    cudaGraphExecDestroy(exec);
  }
  for (const std::int64_t mode : {kFinalizeColumnMajor, kFinalizeRowMajorCapacity}) {
    FinalizeCase c = finalize_case(DType::kBFloat16, 256, 8, 7168, mode, seed++);
    c.x1 = c.x2 = c.bias = c.scales = true;
    c.scales_dtype = DType::kFloat32;
    std::mt19937_64 rng(seed);
    FinalizeCall call(c, random_rows(c, rng), random_expert_ids(c, rng));
    const cudaGraphExec_t exec = capture(stream, [&] { call.enqueue(stream); });
    for (int r = 0; r < 4; ++r) {
      std::vector<std::int32_t> rows = random_rows(c, rng);
      if (r == 2) rows.front() = -3;
      call.set_rows(rows);
      call.set_ids(random_expert_ids(c, rng));
      call.reset();
      replay(exec, stream);
      const std::string what = describe(c) + " replay " + std::to_string(r);
      v.add(what, r == 2 ? call.untouched(cuda::kStatusRowIndexOutOfRange) : call.compare());
    }
    cudaGraphExecDestroy(exec);
  }
}

struct Group {
  const char* name;
  const char* covers;
  bool big;
  void (*run)(Verdict&, cudaStream_t);
};

// Capture first: the first call of the process (its device limits queried)
// is a captured one.
const Group kGroups[] = {
    {"capture", "graph capture and replay with changing and bad counts, both paths", false,
     graph_replays},
    {"misalign", "all 16 x 16 source / destination misalignments of the token rows", false,
     misalignments},
    {"hidden", "H of 1, 7, 385, 3584, 7168 for int8, FP4, bf16; int32 and int64 counts", false,
     hidden_sizes},
    {"edges", "A = 0, one rank, one expert, one token; count and cumsum", false, edge_shapes},
    {"blocks", "N x E = 1024 x 8, 12 x 640 (one launch), 64 x 512 (two kernels, PDL)", false,
     block_counts},
    {"alignment", "expert_alignment 1, 16, 128 with spare rows, gather and scatter", false,
     alignments},
    {"inverse", "the inverse on both paths, static shapes", false, inverses},
    {"bad_counts", "bad counts on both paths: exact status bits, outputs still poison", false,
     bad_counts},
    {"device", "a stream of device 1 with device 0 current (two GPUs; else no case)", false,
     device_guard},
    {"init_routing",
     "moe_init_routing: both modes, 4 dtypes, int32/int64 ids, active_num, drops, skew, T = 0",
     false, init_routings},
    {"init_bad_ids", "moe_init_routing: ids outside [0, E): the status bit, outputs still poison",
     false, init_bad_ids},
    {"finalize_routing", "moe_finalize_routing: every mode, dtype and optional input, bit for bit",
     false, finalize_routings},
    {"finalize_bad_rows",
     "moe_finalize_routing: bad rows and bias ids: the status bits, out poison", false,
     finalize_bad_rows},
    {"routing_graphs", "both routing operators captured, replayed with new ids / rows and bad ones",
     false, routing_graphs},
    {"past_2gib", "one tensor over 2^31 bytes", true, past_2gib},
};

}  // namespace

int main(int argc, char** argv) {
  bool list = false;
  bool quick = false;
  std::vector<std::string> only;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--list") {
      list = true;
    } else if (arg == "--quick") {
      quick = true;
    } else if (!arg.empty() && arg[0] != '-') {
      only.push_back(arg);
    } else {
      std::fprintf(stderr, "usage: %s [--list] [--quick] [GROUP...]\n", argv[0]);
      return 2;
    }
  }
  const auto chosen = [&](const Group& g) {
    if (quick && g.big) return false;
    if (only.empty()) return true;
    for (const std::string& name : only) {
      if (name == g.name) return true;
    }
    return false;
  };
  for (const std::string& name : only) {
    bool known = false;
    for (const Group& g : kGroups) known = known || name == g.name;
    if (!known) {
      std::fprintf(stderr, "unknown group: %s\n", name.c_str());
      return 2;
    }
  }
  if (list) {
    for (const Group& g : kGroups) {
      if (chosen(g)) std::printf("%-17s %s%s\n", g.name, g.covers, g.big ? " (big)" : "");
    }
    return 0;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: skipped\n");
    return 77;
  }
  cudaDeviceProp prop;
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  cuda::detail::DeviceLimits limits;
  check(cuda::detail::query_limits(0, limits), "device limits");
  std::printf("device: %s (sm_%d%d, %d SMs); two-kernel path with programmatic launch: %s\n",
              prop.name, prop.major, prop.minor, prop.multiProcessorCount,
              limits.programmatic_launch ? "yes" : "no (the move kernel's code has no wait)");
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  int failed = 0;
  for (const Group& g : kGroups) {
    if (!chosen(g)) continue;
    const auto start = std::chrono::steady_clock::now();
    Verdict v;
    try {
      g.run(v, stream);
    } catch (const std::exception& error) {
      v.add("exception", error.what());
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const bool ok = v.first_failure().empty();
    failed += ok ? 0 : 1;
    std::printf("%-4s %-17s %4d cases %7.2f s  %s\n", ok ? "ok" : "FAIL", g.name, v.cases(),
                seconds, ok ? g.covers : v.first_failure().c_str());
    std::fflush(stdout);
  }
  cudaStreamDestroy(stream);
  return failed == 0 ? 0 : 1;
}
