// The forward operator beside the parallel copy of the same bytes (the
// physical limit) and the naive per-row gather, over decode and prefill
// shapes. After Google Benchmark's own output it prints one Markdown table of
// medians and ratios.

#include <benchmark/benchmark.h>
#include <malloc.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "moe_reroute/reroute.h"
#include "workload.h"

namespace moe_reroute::bench {
namespace {

using testing::Workload;
using testing::WorkloadConfig;

// Scales are DeepSeek-style float32 blocks: one per 128 token elements.
constexpr std::int64_t kScaleBlock = 128;
// A x H from which the copy ratio target is 0.95 (tokens are one byte each).
constexpr std::int64_t kLargeBytes = 16 * 1024 * 1024;

struct BenchShape {
  std::string phase;  // "Decode", "Prefill" or "Call" (A = 1: the fixed cost)
  std::int64_t num_tokens = 0;
  std::int64_t hidden = 0;
  std::int64_t num_ranks = 0;
  std::int64_t num_experts = 0;
  bool scaled = false;  // scales [A, H / 128] float32 and weights [A, 1]

  std::string name() const {
    return phase + "/H" + std::to_string(hidden) + "/N" + std::to_string(num_ranks) + "xE" +
           std::to_string(num_experts) + (scaled ? "/scaled" : "/plain");
  }

  std::string label() const {
    return "A=" + std::to_string(num_tokens) + " H=" + std::to_string(hidden) +
           " N=" + std::to_string(num_ranks) + " E=" + std::to_string(num_experts) +
           (scaled ? " scaled" : " plain");
  }

  WorkloadConfig config() const {
    WorkloadConfig c;
    c.num_tokens = num_tokens;
    c.hidden = hidden;
    c.token_dtype = DType::kInt8;
    c.num_ranks = num_ranks;
    c.num_experts = num_experts;
    c.has_scales = scaled;
    c.scale_tail = {hidden / kScaleBlock};
    c.has_weight = scaled;
    c.skew = 1.0;
    c.zero_fraction = 0.1;
    c.seed = 7;
    return c;
  }
};

// Buffers of one shape, every page touched before timing. The copy moves as
// many bytes as the operator reads and writes, with the threads its plan uses;
// the gather uses the index the operator wrote.
struct ShapeBuffers {
  explicit ShapeBuffers(const BenchShape& shape)
      : workload(shape.config()), plan(plan_reroute(workload.inputs(), workload.config().attributes)) {
    const std::size_t copy_bytes = static_cast<std::size_t>(workload.bytes_moved() / 2);
    copy_src.resize(copy_bytes);
    testing::fill_random(copy_src.data(), copy_src.size(), 11);
    copy_dst.assign(copy_bytes, std::byte{0xA5});
    run_reroute(plan, workload.inputs(), workload.outputs());
    gather_index.resize(static_cast<std::size_t>(shape.num_tokens));
    std::memcpy(gather_index.data(), workload.token_idx.data(), gather_index.size() * 4);
  }

  Workload workload;
  Plan plan;
  std::vector<std::byte> copy_src, copy_dst;
  std::vector<std::int32_t> gather_index;
};

// One shape's buffers at a time: the prefill shapes need up to 1 GB each.
ShapeBuffers& buffers_for(const BenchShape& shape) {
  static std::unique_ptr<ShapeBuffers> current;
  static std::string current_name;
  if (current == nullptr || current_name != shape.name()) {
    current.reset();
    current = std::make_unique<ShapeBuffers>(shape);
    current_name = shape.name();
  }
  return *current;
}

void set_counters(benchmark::State& state, const ShapeBuffers& b, int threads) {
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * b.workload.bytes_moved());
  state.counters["threads"] = threads;
  state.counters["chunks"] = static_cast<double>(b.plan.chunks().size());
}

void bench_plan_run(benchmark::State& state, const BenchShape& shape) {
  ShapeBuffers& b = buffers_for(shape);
  const RerouteInputs inputs = b.workload.inputs();
  const RerouteOutputs outputs = b.workload.outputs();
  for (auto _ : state) {
    moe_re_routing(inputs, outputs, b.workload.config().attributes);
    benchmark::ClobberMemory();
  }
  set_counters(state, b, b.plan.num_threads());
}

void bench_run(benchmark::State& state, const BenchShape& shape) {
  ShapeBuffers& b = buffers_for(shape);
  const RerouteInputs inputs = b.workload.inputs();
  const RerouteOutputs outputs = b.workload.outputs();
  for (auto _ : state) {
    run_reroute(b.plan, inputs, outputs);
    benchmark::ClobberMemory();
  }
  set_counters(state, b, b.plan.num_threads());
}

void bench_copy(benchmark::State& state, const BenchShape& shape) {
  ShapeBuffers& b = buffers_for(shape);
  for (auto _ : state) {
    testing::parallel_copy(b.copy_dst.data(), b.copy_src.data(), b.copy_src.size(),
                           b.plan.num_threads());
    benchmark::ClobberMemory();
  }
  set_counters(state, b, b.plan.num_threads());
}

void bench_gather(benchmark::State& state, const BenchShape& shape) {
  ShapeBuffers& b = buffers_for(shape);
  Workload& w = b.workload;
  const std::int32_t* index = b.gather_index.data();
  for (auto _ : state) {
    testing::per_row_gather(w.permute_tokens.data(), w.tokens.data(), index, shape.num_tokens,
                            b.plan.token_row_bytes());
    if (shape.scaled) {
      testing::per_row_gather(w.permute_scales.data(), w.scales.data(), index, shape.num_tokens,
                              b.plan.scale_row_bytes());
      testing::per_row_gather(w.permute_weight.data(), w.weight.data(), index, shape.num_tokens,
                              b.plan.weight_row_bytes());
    }
    benchmark::ClobberMemory();
  }
  set_counters(state, b, 1);
}

// The kinds a shape is measured by, as the last component of the name.
constexpr const char* kPlanRun = "plan_run";
constexpr const char* kRun = "run";
constexpr const char* kCopy = "copy";
constexpr const char* kGather = "gather";

std::vector<BenchShape> shapes() {
  std::vector<BenchShape> all;
  for (bool scaled : {false, true}) all.push_back({"Call", 1, 7168, 64, 4, scaled});
  for (const auto& [phase, num_tokens] : {std::pair{"Decode", 256}, std::pair{"Prefill", 16384}}) {
    for (std::int64_t hidden : {2048, 7168, 16384}) {
      for (const auto& [num_ranks, num_experts] : {std::pair{64, 4}, std::pair{256, 1}}) {
        for (bool scaled : {false, true}) {
          all.push_back({phase, num_tokens, hidden, num_ranks, num_experts, scaled});
        }
      }
    }
  }
  return all;
}

void register_benchmarks(const std::vector<BenchShape>& all) {
  using Body = void (*)(benchmark::State&, const BenchShape&);
  const std::pair<const char*, Body> kinds[] = {
      {kPlanRun, bench_plan_run}, {kRun, bench_run}, {kCopy, bench_copy}, {kGather, bench_gather}};
  for (const BenchShape& shape : all) {
    for (const auto& [kind, body] : kinds) {
      benchmark::RegisterBenchmark((shape.name() + "/" + kind).c_str(), body, shape)
          ->UseRealTime()
          ->Unit(benchmark::kMicrosecond);
    }
  }
}

struct Target {
  double ratio = 0.0;        // copy / plan_run at least this; 0: none
  double max_call_us = 0.0;  // plan_run under this; 0: none
  bool beats_gather = true;
};

Target target_for(const BenchShape& shape) {
  if (shape.phase == "Call") return {0.0, 5.0, false};
  if (shape.num_tokens * shape.hidden >= kLargeBytes) return {0.95, 0.0, true};
  if (shape.phase == "Decode" && shape.hidden == 7168) return {0.8, 0.0, true};
  return {};
}

// Google Benchmark's console output, then the summary table of medians (of
// the single run when there is one repetition).
class SummaryReporter : public benchmark::ConsoleReporter {
 public:
  explicit SummaryReporter(std::vector<BenchShape> all)
      : benchmark::ConsoleReporter(OO_Tabular), shapes_(std::move(all)), start_load_(load_average()) {}

  void ReportRuns(const std::vector<Run>& runs) override {
    benchmark::ConsoleReporter::ReportRuns(runs);
    for (const Run& run : runs) {
      const bool median = run.run_type == Run::RT_Aggregate && run.aggregate_name == "median";
      const bool single = run.run_type == Run::RT_Iteration && run.repetitions <= 1;
      if (run.error_occurred || !(median || single)) continue;
      const std::string& name = run.run_name.function_name;
      const std::size_t slash = name.rfind('/');
      const std::string kind = name.substr(slash + 1);
      Medians& m = medians_[name.substr(0, slash)];
      m.time_us[kind] = run.GetAdjustedRealTime();
      repetitions_ = run.repetitions;
      if (kind == kPlanRun) m.threads = static_cast<int>(run.counters.at("threads").value);
    }
  }

  void Finalize() override {
    benchmark::ConsoleReporter::Finalize();
    std::ostream& out = GetOutputStream();
    out << "\nMedians of " << repetitions_ << " repetitions (us, wall time): plan_run = plan + run"
           " per call, run = reused plan, copy = parallel_copy of the same bytes with the plan's"
           " threads, gather = per_row_gather on one thread. Tokens int8; scaled = float32 scales"
           " [A, H/128] and weights.\n";
    // Other processes on the cores stall every fork and join: worth a warning.
    out << "Load average " << fixed(start_load_, 2) << " at the start, " << fixed(load_average(), 2)
        << " at the end, on " << hardware_threads() << " hardware threads"
        << (std::max(start_load_, load_average()) > 0.5 * hardware_threads()
                ? ": other processes shared the cores, the times are not trustworthy"
                : "")
        << ".\n\n";
    out << "| shape | threads | plan_run | run | copy | copy/plan_run | copy/run | "
           "gather/plan_run | plan_run - run | target |\n";
    out << "|---|---|---|---|---|---|---|---|---|---|\n";
    for (const BenchShape& shape : shapes_) {
      const auto found = medians_.find(shape.name());
      if (found == medians_.end()) continue;
      const Medians& m = found->second;
      const double plan_run = m.get(kPlanRun), run = m.get(kRun), copy = m.get(kCopy),
                   gather = m.get(kGather);
      out << "| " << shape.phase << " " << shape.label() << " | " << m.threads << " | "
          << fixed(plan_run, 1) << " | " << fixed(run, 1) << " | " << fixed(copy, 1) << " | "
          << fixed(copy / plan_run, 2) << " | " << fixed(copy / run, 2) << " | "
          << fixed(gather / plan_run, 2) << " | " << fixed(plan_run - run, 1) << " | "
          << verdict(target_for(shape), plan_run, copy, gather) << " |\n";
    }
  }

 private:
  struct Medians {
    std::map<std::string, double> time_us;
    int threads = 0;
    double get(const std::string& kind) const {
      const auto it = time_us.find(kind);
      return it == time_us.end() ? 0.0 : it->second;
    }
  };

  static double load_average() {
    double load = 0.0;
    return getloadavg(&load, 1) == 1 ? load : 0.0;
  }

  static std::string fixed(double value, int digits) {
    char text[32];
    std::snprintf(text, sizeof text, "%.*f", digits, value);
    return text;
  }

  // What the speed targets say about one row.
  static std::string verdict(const Target& target, double plan_run, double copy, double gather) {
    std::vector<std::string> parts;
    if (target.ratio > 0) {
      parts.push_back(">= " + fixed(target.ratio, 2) +
                      (copy / plan_run >= target.ratio ? " met" : " MISSED"));
    }
    if (target.max_call_us > 0) {
      parts.push_back("< " + fixed(target.max_call_us, 0) + " us" +
                      (plan_run < target.max_call_us ? " met" : " MISSED"));
    }
    if (target.beats_gather) {
      parts.push_back(gather > plan_run ? "beats gather" : "SLOWER than gather");
    }
    std::string s;
    for (const std::string& part : parts) s += (s.empty() ? "" : "; ") + part;
    return s;
  }

  std::vector<BenchShape> shapes_;
  std::map<std::string, Medians> medians_;
  double start_load_ = 0.0;
  std::int64_t repetitions_ = 1;
};

}  // namespace
}  // namespace moe_reroute::bench

int main(int argc, char** argv) {
  // Fixes glibc's mmap threshold at its initial 128 KiB, so that every large
  // buffer gets its own mapping at the same page offset whatever was freed
  // before. Packed in the heap, a destination can sit 16 bytes past its source
  // modulo 4 KiB, where rep movsb on AMD Zen runs about 10x slower: the
  // operator and the gather would pay that and the copy not.
  mallopt(M_MMAP_THRESHOLD, 128 * 1024);
  // Defaults first, so that flags given on the command line override them.
  std::vector<std::string> defaults = {"--benchmark_repetitions=5",
                                       "--benchmark_report_aggregates_only=true",
                                       "--benchmark_min_time=0.05",
                                       "--benchmark_min_warmup_time=0.02"};
  std::vector<char*> args = {argv[0]};
  for (std::string& flag : defaults) args.push_back(flag.data());
  args.insert(args.end(), argv + 1, argv + argc);
  int num_args = static_cast<int>(args.size());
  benchmark::Initialize(&num_args, args.data());
  if (benchmark::ReportUnrecognizedArguments(num_args, args.data())) return 1;

  const std::vector<moe_reroute::bench::BenchShape> all = moe_reroute::bench::shapes();
  moe_reroute::bench::register_benchmarks(all);
  moe_reroute::bench::SummaryReporter reporter(all);
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return 0;
}
