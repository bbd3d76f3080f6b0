// The CUDA backend on a GPU against the CPU backend and the naive reference,
// byte for byte: randomized cases of every token dtype, A = 0, sparse and
// skewed counts, misaligned views, bad counts and graph replay. Every output
// and the guard bytes around it start as 0xA5 poison. Skips without a GPU.

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "moe_reroute/cuda.h"
#include "moe_reroute/reroute.h"
#include "reference.h"
#include "workload.h"

namespace moe_reroute::cuda {
namespace {

using testing::Workload;
using testing::WorkloadConfig;

constexpr std::byte kPoison{0xA5};
constexpr std::size_t kGuardBytes = 64;

void check(cudaError_t error) { ASSERT_EQ(error, cudaSuccess) << cudaGetErrorString(error); }

int device_count() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}

// Device bytes at `offset` past an aligned allocation, between poisoned guards.
class DeviceBuffer {
 public:
  DeviceBuffer(std::size_t bytes, std::size_t offset) : bytes_(bytes), offset_(offset) {
    check(cudaMalloc(&base_, total()));
    check(cudaMemset(base_, std::to_integer<int>(kPoison), total()));
    check(cudaDeviceSynchronize());
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { cudaFree(base_); }

  std::byte* data() const { return static_cast<std::byte*>(base_) + kGuardBytes + offset_; }
  // Both complete before returning: the tests' stream does not wait for the
  // legacy stream these run on.
  void upload(const std::vector<std::byte>& host) const {
    check(cudaMemcpy(data(), host.data(), bytes_, cudaMemcpyHostToDevice));
    check(cudaDeviceSynchronize());
  }
  void poison() const { poison_with(std::to_integer<int>(kPoison)); }
  void poison_with(int value) const {
    check(cudaMemset(data(), value, bytes_));
    check(cudaDeviceSynchronize());
  }
  std::vector<std::byte> download() const {
    std::vector<std::byte> host(bytes_);
    check(cudaMemcpy(host.data(), data(), bytes_, cudaMemcpyDeviceToHost));
    return host;
  }
  /// "" when nothing outside [data, data + bytes) was written.
  std::string guards(const char* name) const {
    std::vector<std::byte> all(total());
    check(cudaMemcpy(all.data(), base_, total(), cudaMemcpyDeviceToHost));
    for (std::size_t i = 0; i < all.size(); ++i) {
      const bool inside = i >= kGuardBytes + offset_ && i < kGuardBytes + offset_ + bytes_;
      if (!inside && all[i] != kPoison) return std::string(name) + ": guard byte written";
    }
    return "";
  }

 private:
  std::size_t total() const { return bytes_ + offset_ + 2 * kGuardBytes; }
  void* base_ = nullptr;
  std::size_t bytes_;
  std::size_t offset_;
};

TensorView on_device(const TensorView& host, const DeviceBuffer& buffer) {
  return TensorView(host.data == nullptr ? nullptr : buffer.data(), host.dtype(), host.shape());
}

// The device side of a Workload: one buffer per tensor, each at its own
// misalignment (element-aligned for the int tensors).
struct DeviceWorkload {
  DeviceWorkload(const Workload& w, bool misaligned, std::uint64_t seed)
      : rng(seed),
        tokens(w.tokens.size(), shift(misaligned, 1)),
        counts(w.counts_storage.size(), shift(misaligned, 8)),
        scales(w.scales.size(), shift(misaligned, 1)),
        weight(w.weight.size(), shift(misaligned, 1)),
        permute_tokens(w.permute_tokens.size(), shift(misaligned, 1)),
        permute_scales(w.permute_scales.size(), shift(misaligned, 1)),
        permute_weight(w.permute_weight.size(), shift(misaligned, 1)),
        token_idx(w.token_idx.size(), shift(misaligned, 4)),
        expert_token_num(w.expert_token_num.size(), shift(misaligned, 8)),
        status(4, 0),
        workspace_bytes(required_workspace_bytes(w.config().num_ranks, w.config().num_experts)),
        workspace(workspace_bytes, 0) {
    tokens.upload(w.tokens);
    counts.upload(w.counts_storage);
    scales.upload(w.scales);
    weight.upload(w.weight);
    status.poison_with(0);  // sticky: the kernels only OR bits in
  }

  std::size_t shift(bool misaligned, std::size_t alignment) {
    return misaligned
               ? std::uniform_int_distribution<std::size_t>(0, 15)(rng) / alignment * alignment
               : 0;
  }

  DeviceContext context(cudaStream_t stream) const {
    return {stream, reinterpret_cast<std::int32_t*>(status.data()), workspace.data(),
            workspace_bytes};
  }

  RerouteInputs inputs(const Workload& w) const {
    const RerouteInputs host = w.inputs();
    RerouteInputs in{on_device(host.tokens, tokens),
                     on_device(host.expert_token_num_per_rank, counts), std::nullopt, std::nullopt};
    if (host.per_token_scales) in.per_token_scales = on_device(*host.per_token_scales, scales);
    if (host.expert_topk_weight)
      in.expert_topk_weight = on_device(*host.expert_topk_weight, weight);
    return in;
  }

  RerouteOutputs outputs(Workload& w) const {
    const RerouteOutputs host = w.outputs();
    return {on_device(host.permute_tokens, permute_tokens),
            on_device(host.permute_per_token_scales, permute_scales),
            on_device(host.permute_token_idx, token_idx),
            on_device(host.expert_token_num, expert_token_num),
            on_device(host.permute_topk_weight, permute_weight)};
  }

  const DeviceBuffer* forward_outputs[5] = {&permute_tokens, &permute_scales, &permute_weight,
                                            &token_idx, &expert_token_num};
  void poison_outputs() const {
    for (const DeviceBuffer* buffer : forward_outputs) buffer->poison();
  }
  /// Copies the device outputs into w's output buffers.
  void download_outputs(Workload& w) const {
    w.permute_tokens = permute_tokens.download();
    w.permute_scales = permute_scales.download();
    w.permute_weight = permute_weight.download();
    w.token_idx = token_idx.download();
    w.expert_token_num = expert_token_num.download();
  }
  std::string guards() const {
    const std::pair<const char*, const DeviceBuffer*> all[] = {
        {"tokens", &tokens},
        {"counts", &counts},
        {"scales", &scales},
        {"weight", &weight},
        {"permute_tokens", &permute_tokens},
        {"permute_scales", &permute_scales},
        {"permute_weight", &permute_weight},
        {"token_idx", &token_idx},
        {"expert_token_num", &expert_token_num},
        {"status", &status}};
    for (const auto& [name, buffer] : all) {
      const std::string bad = buffer->guards(name);
      if (!bad.empty()) return bad;
    }
    return "";
  }
  std::int32_t read_status() const {
    std::int32_t value = 0;
    check(cudaMemcpy(&value, status.data(), sizeof(value), cudaMemcpyDeviceToHost));
    return value;
  }

  std::mt19937_64 rng;
  DeviceBuffer tokens, counts, scales, weight;
  DeviceBuffer permute_tokens, permute_scales, permute_weight, token_idx, expert_token_num;
  DeviceBuffer status;
  std::size_t workspace_bytes;
  DeviceBuffer workspace;
};

// Stores w.counts into w.counts_storage in the counts dtype.
void encode_counts(Workload& w) {
  const bool int32 = w.config().count_dtype == DType::kInt32;
  for (std::size_t i = 0; i < w.counts.size(); ++i) {
    const auto value32 = static_cast<std::int32_t>(w.counts[i]);
    std::memcpy(w.counts_storage.data() + i * (int32 ? 4 : 8),
                int32 ? static_cast<const void*>(&value32) : &w.counts[i], int32 ? 4 : 8);
  }
}

// What the CPU backend writes for the same workload.
Workload cpu_result(const WorkloadConfig& config, const std::vector<std::int64_t>& counts) {
  Workload cpu(config);
  cpu.counts = counts;
  encode_counts(cpu);
  moe_re_routing(cpu.inputs(), cpu.outputs(), config.attributes);
  return cpu;
}

std::string differs_from_cpu(const Workload& gpu, const Workload& cpu) {
  const std::pair<const char*,
                  std::pair<const std::vector<std::byte>*, const std::vector<std::byte>*>>
      all[] = {{"permute_tokens", {&gpu.permute_tokens, &cpu.permute_tokens}},
               {"permute_per_token_scales", {&gpu.permute_scales, &cpu.permute_scales}},
               {"permute_topk_weight", {&gpu.permute_weight, &cpu.permute_weight}},
               {"permute_token_idx", {&gpu.token_idx, &cpu.token_idx}},
               {"expert_token_num", {&gpu.expert_token_num, &cpu.expert_token_num}}};
  for (const auto& [name, pair] : all) {
    const std::string diff =
        testing::first_difference(name, *pair.first, pair.second->data(), pair.second->size());
    if (!diff.empty()) return diff;
  }
  return "";
}

// The naive reference is quadratic in N x E; past this the CPU backend alone judges.
constexpr std::int64_t kNaiveBlocks = 4096;

class CudaGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // Runs one forward case on the GPU and checks it against the CPU backend,
  // the naive reference, the guards and the status word.
  void run_forward(const WorkloadConfig& config, bool misaligned) {
    SCOPED_TRACE("A=" + std::to_string(config.num_tokens) + " H=" + std::to_string(config.hidden) +
                 " N=" + std::to_string(config.num_ranks) +
                 " E=" + std::to_string(config.num_experts) + " " +
                 std::string(dtype_name(config.token_dtype)) +
                 " seed=" + std::to_string(config.seed) + (misaligned ? " misaligned" : ""));
    Workload w(config);
    const DeviceWorkload d(w, misaligned, config.seed);
    moe_re_routing(d.inputs(w), d.outputs(w), config.attributes, d.context(stream_));
    check(cudaStreamSynchronize(stream_));
    EXPECT_EQ(d.read_status(), 0);
    d.download_outputs(w);
    EXPECT_EQ(differs_from_cpu(w, cpu_result(config, w.counts)), "");
    if (config.num_ranks * config.num_experts <= kNaiveBlocks) {
      EXPECT_EQ(w.compare(testing::reference_reroute(w.reference_inputs(),
                                                     config.attributes.expert_token_num_type,
                                                     config.attributes.idx_type)),
                "");
    }
    EXPECT_EQ(d.guards(), "");
  }

  cudaStream_t stream_ = nullptr;
};

WorkloadConfig random_config(std::mt19937_64& rng, DType token_dtype, std::uint64_t seed) {
  const auto pick = [&rng](auto... options) {
    const std::int64_t values[] = {static_cast<std::int64_t>(options)...};
    return values[std::uniform_int_distribution<std::size_t>(0, sizeof...(options) - 1)(rng)];
  };
  WorkloadConfig c;
  c.seed = seed;
  c.token_dtype = token_dtype;
  c.num_tokens = pick(0, 1, 37, 256, 1000, 3000);
  c.hidden = pick(1, 2, 7, 64, 385, 1000, 7168);
  if (dtype_info(token_dtype).bits < 8) c.hidden += c.hidden % 2;
  c.num_ranks = pick(1, 2, 8, 16);
  c.num_experts = pick(1, 3, 16, 32);
  c.count_dtype = pick(0, 1) ? DType::kInt64 : DType::kInt32;
  c.skew = static_cast<double>(pick(0, 1, 3));
  c.zero_fraction = static_cast<double>(pick(0, 5, 9)) / 10.0;
  switch (pick(0, 1, 2, 3)) {
    case 0:
      c.has_scales = false;
      break;
    case 1:
      c.scale_tail = {};
      break;
    case 2:
      c.scale_tail = {pick(1, 3, 56)};
      break;
    default:
      c.scale_dtype = DType::kFloat8E8M0;
      c.scale_tail = {pick(1, 7, 112), 2};
  }
  c.has_weight = pick(0, 1) != 0;
  c.attributes.expert_token_num_type = static_cast<int>(pick(0, 1));
  c.attributes.idx_type = static_cast<int>(pick(0, 1));
  // The static-shape layout: aligned segments, counts covering part of A.
  c.attributes.expert_alignment = pick(1, 1, 2, 16, 128);
  if (pick(0, 1) != 0) {
    c.attributes.allow_spare_rows = true;
    c.num_valid_tokens = c.num_tokens * pick(0, 1, 3, 4) / 4;
  }
  return c;
}

TEST_F(CudaGpu, ForwardMatchesTheCpuForEveryTokenDtype) {
  std::mt19937_64 rng(11);
  std::uint64_t seed = 100;
  for (const DTypeInfo& info : dtype_table()) {
    if (!(info.roles & kRoleToken)) continue;
    for (int i = 0; i < 6; ++i) run_forward(random_config(rng, info.dtype, seed++), i % 2 == 1);
  }
}

TEST_F(CudaGpu, ForwardHandlesEmptyInputs) {
  WorkloadConfig c;
  c.num_tokens = 0;
  c.hidden = 7168;
  c.num_ranks = 4;
  c.num_experts = 4;
  for (const int type : {kExpertTokenNumCount, kExpertTokenNumCumsum}) {
    c.attributes.expert_token_num_type = type;
    run_forward(c, false);
  }
}

TEST_F(CudaGpu, ForwardHandlesLargeSparseAndSkewedCounts) {
  const struct {
    std::int64_t ranks, experts, tokens;
    double skew, zero_fraction;
  } cases[] = {{64, 512, 3000, 0.0, 0.95},
               {300, 400, 5000, 0.0, 0.99},
               {16, 16, 20000, 4.0, 0.0},
               {1, 2048, 4000, 2.0, 0.5},
               {2048, 1, 4000, 2.0, 0.5}};
  std::uint64_t seed = 900;
  for (const auto& c : cases) {
    WorkloadConfig config;
    config.num_tokens = c.tokens;
    config.hidden = 129;
    config.token_dtype = DType::kBFloat16;
    config.num_ranks = c.ranks;
    config.num_experts = c.experts;
    config.skew = c.skew;
    config.zero_fraction = c.zero_fraction;
    config.seed = seed++;
    config.attributes.idx_type = static_cast<int>(seed % 2);
    run_forward(config, seed % 2 == 0);
  }
}

TEST_F(CudaGpu, InverseMatchesTheCpu) {
  std::mt19937_64 rng(12);
  std::uint64_t seed = 500;
  for (const DType dtype : {DType::kBFloat16, DType::kInt8, DType::kFloat4E2M1, DType::kFloat32}) {
    for (int i = 0; i < 4; ++i) {
      // The forward's inputs as the inverse's: k = 1, every row valid (the
      // static-shape inverse is StaticShapeRoundTripRestoresTheValidRows).
      WorkloadConfig config = random_config(rng, dtype, seed++);
      config.attributes = {};
      config.num_valid_tokens = -1;
      SCOPED_TRACE("seed=" + std::to_string(config.seed));
      Workload w(config);
      const DeviceWorkload d(w, i % 2 == 1, config.seed);
      const RerouteInputs in = d.inputs(w);
      const RerouteOutputs out = d.outputs(w);
      // The forward's inputs in expert order go back to rank order in the
      // forward's output buffers.
      const InverseInputs inverse{in.tokens, in.expert_token_num_per_rank, in.per_token_scales,
                                  in.expert_topk_weight};
      InverseOutputs restored{out.permute_tokens, std::nullopt, std::nullopt};
      if (in.per_token_scales) restored.restored_per_token_scales = out.permute_per_token_scales;
      if (in.expert_topk_weight) restored.restored_topk_weight = out.permute_topk_weight;
      moe_re_routing_inverse(inverse, restored, {}, d.context(stream_));
      check(cudaStreamSynchronize(stream_));
      EXPECT_EQ(d.read_status(), 0);

      Workload cpu(config);
      const RerouteInputs host_in = cpu.inputs();
      const RerouteOutputs host_out = cpu.outputs();
      InverseOutputs host_restored{host_out.permute_tokens, std::nullopt, std::nullopt};
      if (host_in.per_token_scales)
        host_restored.restored_per_token_scales = host_out.permute_per_token_scales;
      if (host_in.expert_topk_weight)
        host_restored.restored_topk_weight = host_out.permute_topk_weight;
      moe_re_routing_inverse({host_in.tokens, host_in.expert_token_num_per_rank,
                              host_in.per_token_scales, host_in.expert_topk_weight},
                             host_restored);
      const testing::ReferenceOutputs naive = testing::reference_inverse(w.reference_inputs());
      EXPECT_EQ(testing::first_difference("restored_tokens", d.permute_tokens.download(),
                                          cpu.permute_tokens.data(), cpu.permute_tokens.size()),
                "");
      EXPECT_EQ(testing::first_difference("restored_tokens", d.permute_tokens.download(),
                                          naive.tokens.data(), naive.tokens.size()),
                "");
      if (config.has_scales) {
        EXPECT_EQ(
            testing::first_difference("restored_per_token_scales", d.permute_scales.download(),
                                      naive.scales.data(), naive.scales.size()),
            "");
      } else {
        EXPECT_EQ(d.permute_scales.download(), cpu.permute_scales);  // untouched poison
      }
      EXPECT_EQ(testing::first_difference("restored_topk_weight", d.permute_weight.download(),
                                          naive.weight.data(), naive.weight.size()),
                "");
      EXPECT_EQ(d.token_idx.download(), cpu.token_idx);  // the inverse writes no index
      EXPECT_EQ(d.guards(), "");
    }
  }
}

// Bad counts set the status word; nothing else is written, in bounds or out.
TEST_F(CudaGpu, BadCountsSetTheStatusAndWriteNothing) {
  constexpr std::int64_t kMax64 = std::numeric_limits<std::int64_t>::max();
  using Counts = std::vector<std::int64_t>;
  const struct {
    const char* name;
    DType count_dtype;
    void (*spoil)(Counts&);
    std::int32_t expected;  // bits that must be set
    bool exact;             // and no other
  } cases[] = {
      {"sum short by one", DType::kInt32,
       [](Counts& c) { *std::max_element(c.begin(), c.end()) -= 1; }, kStatusCountSumMismatch,
       true},
      {"sum over by one", DType::kInt64, [](Counts& c) { c.back() += 1; }, kStatusCountSumMismatch,
       true},
      {"negative, true sum kept", DType::kInt32,
       [](Counts& c) {
         c.back() += c.front() + 5;
         c.front() = -5;
       },
       kStatusNegativeCount, false},
      {"int32 max", DType::kInt32,
       [](Counts& c) { c.front() = std::numeric_limits<std::int32_t>::max(); },
       kStatusCountSumMismatch, true},
      {"int64 sum overflows", DType::kInt64,
       [](Counts& c) {
         c.front() = kMax64;
         c.back() = kMax64;
       },
       kStatusCountSumMismatch, true},
      {"int64 min", DType::kInt64,
       [](Counts& c) { c.front() = std::numeric_limits<std::int64_t>::min(); },
       kStatusNegativeCount, false},
  };
  std::uint64_t seed = 700;
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    WorkloadConfig config;
    config.num_tokens = 500;
    config.hidden = 77;
    config.num_ranks = 4;
    config.num_experts = 8;
    config.count_dtype = c.count_dtype;
    config.seed = seed++;
    Workload w(config);
    c.spoil(w.counts);
    encode_counts(w);
    const DeviceWorkload d(w, true, config.seed);
    moe_re_routing(d.inputs(w), d.outputs(w), config.attributes, d.context(stream_));
    check(cudaStreamSynchronize(stream_));
    const std::int32_t status = d.read_status();
    if (c.exact) {
      EXPECT_EQ(status, c.expected);
    } else {
      EXPECT_EQ(status & c.expected, c.expected);
    }
    EXPECT_FALSE(status_message(status).empty());
    for (const DeviceBuffer* buffer : d.forward_outputs) {
      for (const std::byte b : buffer->download()) ASSERT_EQ(b, kPoison);
    }
    EXPECT_EQ(d.guards(), "");

    // The status word is sticky: cleared by the caller, then good counts work.
    Workload good(config);
    d.counts.upload(good.counts_storage);
    d.status.poison_with(0);
    moe_re_routing(d.inputs(good), d.outputs(good), config.attributes, d.context(stream_));
    check(cudaStreamSynchronize(stream_));
    EXPECT_EQ(d.read_status(), 0);
    d.download_outputs(good);
    EXPECT_EQ(differs_from_cpu(good, cpu_result(config, good.counts)), "");
  }
}

// One captured call replays with new counts (same shapes) written to the
// device between replays: offsets really are computed on the device. With
// static shapes (k = 128, spare rows) the counts cover a different part of A
// each time, as in a decode step under a CUDA graph.
void replay_test(cudaStream_t stream, bool static_shapes) {
  WorkloadConfig config;
  config.num_tokens = 2000;
  config.hidden = 7168;
  config.token_dtype = DType::kInt8;
  config.num_ranks = 8;
  config.num_experts = 16;
  config.seed = 1234;
  if (static_shapes) {
    config.attributes.expert_alignment = 128;
    config.attributes.allow_spare_rows = true;
    config.attributes.idx_type = kIdxScatter;
    config.attributes.expert_token_num_type = kExpertTokenNumCumsum;
  }
  Workload w(config);
  const DeviceWorkload d(w, false, config.seed);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  moe_re_routing(d.inputs(w), d.outputs(w), config.attributes, d.context(stream));
  check(cudaStreamEndCapture(stream, &graph));
  check(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 4; ++replay) {
    SCOPED_TRACE("replay " + std::to_string(replay));
    const std::int64_t valid =
        static_shapes ? config.num_tokens * (replay + 1) / 4 : config.num_tokens;
    w.counts = testing::random_counts(config.num_ranks, config.num_experts, valid, replay,
                                      0.3 * replay, 50 + replay);
    // Bad: the replay must write nothing (with spare rows only a sum past A is).
    if (replay == 3) w.counts.front() += 1;
    encode_counts(w);
    d.counts.upload(w.counts_storage);
    d.poison_outputs();
    check(cudaGraphLaunch(exec, stream));
    check(cudaStreamSynchronize(stream));
    if (replay == 3) {
      EXPECT_EQ(d.read_status(), kStatusCountSumMismatch);
      for (const DeviceBuffer* buffer : d.forward_outputs) {
        for (const std::byte b : buffer->download()) ASSERT_EQ(b, kPoison);
      }
    } else {
      EXPECT_EQ(d.read_status(), 0);
      d.download_outputs(w);
      EXPECT_EQ(w.compare(testing::reference_reroute(w.reference_inputs(),
                                                     config.attributes.expert_token_num_type,
                                                     config.attributes.idx_type)),
                "");
    }
  }
  EXPECT_EQ(d.guards(), "");
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

TEST_F(CudaGpu, StreamIsCapturingOnlyBetweenBeginAndEndCapture) {
  EXPECT_FALSE(stream_is_capturing(stream_));
  check(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  const bool during = stream_is_capturing(stream_);
  cudaGraph_t graph = nullptr;
  check(cudaStreamEndCapture(stream_, &graph));
  cudaGraphDestroy(graph);
  EXPECT_TRUE(during);
  EXPECT_FALSE(stream_is_capturing(stream_));
}

TEST_F(CudaGpu, GraphReplayFollowsTheDeviceCounts) { replay_test(stream_, false); }

TEST_F(CudaGpu, GraphReplayWithStaticShapesFollowsTheValidRows) { replay_test(stream_, true); }

// Forward then inverse with k = 16 and spare rows: the R expert-ordered rows
// go back to the first sum(c) rows of rank order, byte for byte.
TEST_F(CudaGpu, StaticShapeRoundTripRestoresTheValidRows) {
  WorkloadConfig config;
  config.num_tokens = 777;
  config.hidden = 385;
  config.token_dtype = DType::kBFloat16;
  config.num_ranks = 4;
  config.num_experts = 8;
  config.num_valid_tokens = 500;
  config.attributes.expert_alignment = 16;
  config.attributes.allow_spare_rows = true;
  config.seed = 31;
  Workload w(config);
  const DeviceWorkload d(w, true, config.seed);
  const RerouteOutputs out = d.outputs(w);
  moe_re_routing(d.inputs(w), out, config.attributes, d.context(stream_));
  const std::int64_t row_bytes = dtype_bytes(config.token_dtype, config.hidden);
  DeviceBuffer restored(static_cast<std::size_t>(config.num_tokens * row_bytes), 3);
  DeviceBuffer restored_scales(static_cast<std::size_t>(config.num_tokens * 4), 1);
  DeviceBuffer restored_weight(static_cast<std::size_t>(config.num_tokens * 4), 2);
  const InverseInputs inverse{out.permute_tokens, d.inputs(w).expert_token_num_per_rank,
                              out.permute_per_token_scales, out.permute_topk_weight};
  const InverseOutputs back{
      TensorView(restored.data(), config.token_dtype, {config.num_tokens, config.hidden}),
      TensorView(restored_scales.data(), DType::kFloat32, {config.num_tokens}),
      TensorView(restored_weight.data(), DType::kFloat32, {config.num_tokens, 1})};
  moe_re_routing_inverse(inverse, back, config.attributes, d.context(stream_));
  check(cudaStreamSynchronize(stream_));
  EXPECT_EQ(d.read_status(), 0);
  const std::size_t valid = 500;
  const std::pair<const DeviceBuffer*, const std::vector<std::byte>*> pairs[] = {
      {&restored, &w.tokens}, {&restored_scales, &w.scales}, {&restored_weight, &w.weight}};
  for (const auto& [device, host] : pairs) {
    const std::vector<std::byte> got = device->download();
    const std::size_t row = got.size() / static_cast<std::size_t>(config.num_tokens);
    EXPECT_EQ(testing::first_difference(
                  "restored", {got.begin(), got.begin() + static_cast<std::ptrdiff_t>(valid * row)},
                  host->data(), valid * row),
              "");
    for (std::size_t i = valid * row; i < got.size(); ++i)
      ASSERT_EQ(got[i], kPoison) << "spare byte " << i;
    EXPECT_EQ(device->guards("restored"), "");
  }
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
