// `bench`: verifies the operator against the naive reference, then times it
// (plan + run, and run alone) against a plain copy of the same bytes with the
// threads the plan uses (the physical limit) and a per-row gather by the
// operator's own index (the naive baseline, with those threads and with one),
// and measures the per-call overhead apart.

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "commands.h"
#include "moe_reroute/reroute.h"

namespace moe_reroute::tools {
namespace {

using Clock = std::chrono::steady_clock;

double seconds(const std::function<void()>& body) {
  const Clock::time_point start = Clock::now();
  body();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n % 2 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

void progress(const std::string& line) { std::cerr << "moe-reroute bench: " << line << std::endl; }

// The per-row gather baseline over every row stream the operator moves, the
// rows split evenly over `num_threads` threads.
struct GatherBaseline {
  struct Stream {
    const std::byte* src;
    std::vector<std::byte> dst;
    std::int64_t row_bytes;
  };
  std::vector<Stream> streams;
  std::vector<std::int32_t> index;  // gather order: output row i reads input row index[i]

  void run(int num_threads) {
    const auto num_rows = static_cast<std::int64_t>(index.size());
#pragma omp parallel for num_threads(num_threads) schedule(static, 1) if (num_threads > 1)
    for (int t = 0; t < num_threads; ++t) {
      const std::int64_t begin = num_rows * t / num_threads;
      const std::int64_t end = num_rows * (t + 1) / num_threads;
      for (Stream& s : streams) {
        testing::per_row_gather(s.dst.data() + begin * s.row_bytes, s.src, index.data() + begin,
                                end - begin, s.row_bytes);
      }
    }
  }
};

GatherBaseline gather_baseline(const testing::Workload& w) {
  const testing::WorkloadConfig& c = w.config();
  const auto num_rows = static_cast<std::size_t>(c.num_tokens);
  GatherBaseline g;
  g.index.resize(num_rows);
  std::vector<std::int32_t> token_idx(num_rows);
  std::memcpy(token_idx.data(), w.token_idx.data(), num_rows * sizeof(std::int32_t));
  for (std::size_t i = 0; i < num_rows; ++i) {
    if (c.attributes.idx_type == kIdxGather) {
      g.index[i] = token_idx[i];
    } else {
      g.index[static_cast<std::size_t>(token_idx[i])] = static_cast<std::int32_t>(i);
    }
  }
  const testing::ReferenceInputs ref = w.reference_inputs();
  g.streams.push_back({ref.tokens, std::vector<std::byte>(w.tokens.size()), ref.token_row_bytes});
  if (c.has_scales) {
    g.streams.push_back({ref.scales, std::vector<std::byte>(w.scales.size()), ref.scale_row_bytes});
  }
  if (c.has_weight) g.streams.push_back({ref.weight, std::vector<std::byte>(w.weight.size()), 4});
  for (auto& s : g.streams) std::fill(s.dst.begin(), s.dst.end(), std::byte{0x5A});
  return g;
}

// Median seconds of one plan_reroute and of one plan + run at A = 1 (same H,
// ranks, experts and optional inputs): the cost a call pays whatever its size.
struct Overhead {
  double plan_s;
  double tiny_call_s;
};

Overhead measure_overhead(const testing::Workload& w, int threads) {
  constexpr int kCalls = 2000;
  const RerouteInputs inputs = w.inputs();
  const Attributes attributes = w.config().attributes;
  std::vector<double> plan_times, tiny_times;
  for (int i = 0; i < kCalls; ++i) {
    plan_times.push_back(seconds([&] { plan_reroute(inputs, attributes, threads); }));
  }
  testing::WorkloadConfig tiny_config = w.config();
  tiny_config.num_tokens = 1;
  testing::Workload tiny(tiny_config);
  const RerouteInputs tiny_inputs = tiny.inputs();
  const RerouteOutputs tiny_outputs = tiny.outputs();
  for (int i = 0; i < kCalls; ++i) {
    tiny_times.push_back(
        seconds([&] { moe_re_routing(tiny_inputs, tiny_outputs, attributes, threads); }));
  }
  return {median(plan_times), median(tiny_times)};
}

// The workload as (name, value) pairs, values already in JSON syntax.
std::vector<std::pair<std::string, std::string>> config_fields(const testing::WorkloadConfig& c,
                                                               int threads, int plan_threads,
                                                               int repeat) {
  const auto quoted = [](std::string_view text) {
    std::string json(1, '"');
    json += text;
    return json + '"';
  };
  std::string scales = "none";
  if (c.has_scales) {
    scales = std::string(dtype_name(c.scale_dtype)) + "[A";
    for (std::int64_t d : c.scale_tail) {
      scales += ',';
      scales += std::to_string(d);
    }
    scales += "]";
  }
  std::ostringstream skew;
  skew << c.skew;
  return {{"A", std::to_string(c.num_tokens)},
          {"H", std::to_string(c.hidden)},
          {"tokens_dtype", quoted(dtype_name(c.token_dtype))},
          {"N", std::to_string(c.num_ranks)},
          {"E", std::to_string(c.num_experts)},
          {"counts_dtype", quoted(dtype_name(c.count_dtype))},
          {"scales", quoted(scales)},
          {"topk_weight", c.has_weight ? "true" : "false"},
          {"skew", skew.str()},
          {"seed", std::to_string(c.seed)},
          {"idx_type", std::to_string(c.attributes.idx_type)},
          {"expert_token_num_type", std::to_string(c.attributes.expert_token_num_type)},
          {"threads", std::to_string(threads)},
          {"plan_threads", std::to_string(plan_threads)},
          {"repeat", std::to_string(repeat)}};
}

}  // namespace

int bench_command(const BenchOptions& o) {
  const testing::WorkloadConfig config = workload_config(o.workload);
  const int threads = o.threads > 0 ? o.threads : hardware_threads();
  const int repeat = std::max(1, o.repeat);
  progress("allocating and filling inputs and outputs");
  testing::Workload w(config);
  const RerouteInputs inputs = w.inputs();
  const RerouteOutputs outputs = w.outputs();
  const Plan plan = plan_reroute(inputs, config.attributes, threads);
  const auto fields = config_fields(config, threads, plan.num_threads(), repeat);
  std::string config_text, config_json;
  for (const auto& [name, value] : fields) {
    config_text += " " + name + "=" + value;
    config_json += (config_json.empty() ? "{" : ", ") + ("\"" + name + "\": " + value);
  }
  config_json += "}";
  std::printf("moe-reroute bench:%s\n", config_text.c_str());

  progress("verifying against the naive reference");
  run_reroute(plan, inputs, outputs);
  const std::string difference = w.compare(testing::reference_reroute(
      w.reference_inputs(), config.attributes.expert_token_num_type, config.attributes.idx_type));
  if (!difference.empty()) {
    std::printf("NOT verified: %s\n", difference.c_str());
    if (o.json) {
      std::printf("{\"verified\": false, \"difference\": \"%s\", \"config\": %s}\n",
                  difference.c_str(), config_json.c_str());
    }
    return 1;
  }
  std::printf("verified\n");

  const std::int64_t bytes = w.bytes_moved();
  const std::size_t copy_bytes = static_cast<std::size_t>(bytes / 2);
  progress("preparing the copy and gather baselines");
  std::vector<std::byte> copy_src(copy_bytes), copy_dst(copy_bytes, std::byte{0x5A});
  testing::fill_random(copy_src.data(), copy_bytes, config.seed + 7);
  GatherBaseline gather = gather_baseline(w);

  // The baselines get the threads the plan chose, which it caps by bytes per thread.
  const int used_threads = plan.num_threads();
  progress("timing " + std::to_string(repeat) + " rounds");
  // Each round times every contender once, so drift hits them alike; each timed
  // call follows an untimed one of the same contender, so each finds the caches
  // as its own previous call left them, not as a rival's did.
  const std::vector<std::function<void()>> contenders = {
      [&] { moe_re_routing(inputs, outputs, config.attributes, threads); },
      [&] { run_reroute(plan, inputs, outputs); },
      [&] { testing::parallel_copy(copy_dst.data(), copy_src.data(), copy_bytes, used_threads); },
      [&] { gather.run(used_threads); }, [&] { gather.run(1); }};
  std::vector<std::vector<double>> times(contenders.size());
  for (int r = 0; r < repeat; ++r) {
    for (std::size_t c = 0; c < contenders.size(); ++c) {
      contenders[c]();
      times[c].push_back(seconds(contenders[c]));
    }
  }
  progress("measuring the per-call overhead");
  const Overhead overhead = measure_overhead(w, threads);

  const double op_s = median(times[0]), run_s = median(times[1]), copy_s = median(times[2]),
               gather_s = median(times[3]), gather1_s = median(times[4]);
  const auto gbps = [bytes](double s) { return static_cast<double>(bytes) / s / 1e9; };
  std::printf("bytes per call: %lld (read + written)\n", static_cast<long long>(bytes));
  std::printf("%-32s %12s %9s %10s\n", "", "median ms", "GB/s", "copy/this");
  const auto row = [&](const char* name, double s) {
    std::printf("%-32s %12.4f %9.2f %10.3f\n", name, s * 1e3, gbps(s), copy_s / s);
  };
  row("moe_re_routing (plan + run)", op_s);
  row("run_reroute (plan made once)", run_s);
  row("plain copy, same bytes", copy_s);
  row("per-row gather, same threads", gather_s);
  row("per-row gather, 1 thread", gather1_s);
  std::printf(
      "moe_re_routing is %.2fx the speed of the per-row gather (%.2fx of the 1-thread one)\n",
      gather_s / op_s, gather1_s / op_s);
  std::printf(
      "per-call overhead, hot caches: plan_reroute alone %.2f us; plan + run at A=1: %.2f us "
      "(medians of 2000 calls)\n",
      overhead.plan_s * 1e6, overhead.tiny_call_s * 1e6);
  if (o.json) {
    std::printf(
        "{\"verified\": true, \"bytes\": %lld, \"op_s\": %.9g, \"copy_s\": %.9g, "
        "\"ratio\": %.6g, \"run_s\": %.9g, \"gather_s\": %.9g, \"gather_ratio\": %.6g, "
        "\"speedup_vs_gather\": %.6g, \"gather_1thread_s\": %.9g, \"plan_s\": %.9g, "
        "\"tiny_call_s\": %.9g, \"config\": %s}\n",
        static_cast<long long>(bytes), op_s, copy_s, copy_s / op_s, run_s, gather_s,
        copy_s / gather_s, gather_s / op_s, gather1_s, overhead.plan_s, overhead.tiny_call_s,
        config_json.c_str());
  }
  return 0;
}

}  // namespace moe_reroute::tools
