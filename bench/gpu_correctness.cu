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
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/api.h"
#include "cuda/kernels.h"
#include "moe_reroute/cuda.h"
#include "reference.h"
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
      if (chosen(g)) std::printf("%-11s %s%s\n", g.name, g.covers, g.big ? " (big)" : "");
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
    std::printf("%-4s %-11s %4d cases %7.2f s  %s\n", ok ? "ok" : "FAIL", g.name, v.cases(),
                seconds, ok ? g.covers : v.first_failure().c_str());
    std::fflush(stdout);
  }
  cudaStreamDestroy(stream);
  return failed == 0 ? 0 : 1;
}
