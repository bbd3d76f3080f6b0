// moe-reroute-bench, the C++ benchmark of the core: verifies every case
// against the naive reference before timing it, then prints medians against
// a plain copy of the same bytes with the same threads (the physical limit)
// and a per-row gather by the operator's own index (the naive peer); the same
// workload at smaller A, across the last-level cache (where streaming stores
// pay); and the static-shape costs (a quarter of A valid; expert_alignment
// 128 against 1). Bad flags exit with status 2, as moe-reroute's do.

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "moe_reroute/reroute.h"
#include "options.h"
#include "timing.h"
#include "reference.h"
#include "workload.h"

namespace moe_reroute::bench {
namespace {

using tools::WorkloadOptions;

// The limit of the pad rows at k > 1: a memset of their bytes the same way.
void parallel_zero(void* dst, std::size_t bytes, int num_threads) {
  for_each_slice(bytes, num_threads, [&](std::size_t begin, std::size_t end) {
    std::memset(static_cast<std::byte*>(dst) + begin, 0, end - begin);
  });
}

// Gathers rows one at a time by an index, the naive peer.
void per_row_gather(std::byte* dst, const std::byte* src, const std::int32_t* index,
                    std::int64_t num_rows, std::int64_t row_bytes) {
  for (std::int64_t i = 0; i < num_rows; ++i) {
    std::memcpy(dst + i * row_bytes, src + std::int64_t{index[i]} * row_bytes,
                static_cast<std::size_t>(row_bytes));
  }
}

void progress(const std::string& line) { std::cerr << "moe-reroute-bench: " << line << std::endl; }

// The per-row gather peer over every row stream the operator moves, the rows
// split evenly over `num_threads` threads.
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
    for_each_thread(num_threads, [&](int t) {
      const std::int64_t begin = num_rows * t / num_threads;
      const std::int64_t end = num_rows * (t + 1) / num_threads;
      for (Stream& s : streams) {
        per_row_gather(s.dst.data() + begin * s.row_bytes, s.src, index.data() + begin,
                       end - begin, s.row_bytes);
      }
    });
  }
};

// The gather peer of a verified workload: the valid rows, in the order the
// operator wrote them (its own index), gathered into consecutive rows.
GatherBaseline gather_baseline(const testing::Workload& w, const Plan& plan) {
  const testing::WorkloadConfig& c = w.config();
  std::vector<std::int32_t> token_idx(w.token_idx.size() / sizeof(std::int32_t));
  std::memcpy(token_idx.data(), w.token_idx.data(), w.token_idx.size());
  GatherBaseline g;
  if (c.attributes.idx_type == kIdxGather) {
    g.index = token_idx;
  } else {
    g.index.assign(static_cast<std::size_t>(w.num_output_rows()), -1);
    for (std::size_t i = 0; i < token_idx.size(); ++i) {
      if (token_idx[i] >= 0) {
        g.index[static_cast<std::size_t>(token_idx[i])] = static_cast<std::int32_t>(i);
      }
    }
  }
  std::erase(g.index, -1);  // pad, tail and spare rows
  const std::size_t rows = g.index.size();
  const testing::ReferenceInputs ref = w.reference_inputs();
  const auto stream = [&](const std::byte* src, std::int64_t row_bytes) {
    g.streams.push_back({src, std::vector<std::byte>(rows * static_cast<std::size_t>(row_bytes),
                                                     std::byte{0x5A}), row_bytes});
  };
  stream(ref.tokens, plan.token_row_bytes());
  if (c.has_scales) stream(ref.scales, plan.scale_row_bytes());
  if (c.has_weight) stream(ref.weight, plan.weight_row_bytes());
  return g;
}

// Bytes of every output row a call writes (pad rows included).
std::int64_t row_bytes_written(const Plan& plan) {
  return plan.num_written_rows() * plan.bytes_per_row();
}

// Bytes a call reads and writes: its valid input rows, the output rows it
// writes, the counts and expert_token_num.
std::int64_t bytes_moved(const Plan& plan, const testing::WorkloadConfig& c) {
  const std::int64_t input_row_bytes =
      plan.token_row_bytes() + plan.scale_row_bytes() + plan.weight_row_bytes();
  return plan.num_valid_rows() * input_row_bytes + row_bytes_written(plan) +
         (c.num_ranks + 1) * c.num_experts * dtype_bytes(c.count_dtype, 1);
}

// One forward call's buffers, its plan, and a copy of as many bytes as it
// reads and writes, into pre-touched buffers.
struct Case {
  Case(const testing::WorkloadConfig& config, int threads)
      : workload(config),
        inputs(workload.inputs()),
        outputs(workload.outputs()),
        plan(plan_reroute(inputs, config.attributes, threads)),
        bytes(bytes_moved(plan, config)),
        copy_src(static_cast<std::size_t>(bytes / 2)),
        copy_dst(copy_src.size(), std::byte{0x5A}) {
    testing::fill_random(copy_src.data(), copy_src.size(), config.seed + 7);
  }
  Case(const Case&) = delete;  // the views point into the workload
  Case& operator=(const Case&) = delete;

  // "" when a run matches the naive reference byte for byte (the run writes
  // into poisoned outputs), else the first difference.
  std::string verify() {
    workload.poison_outputs();
    run_reroute(plan, inputs, outputs);
    const Attributes& a = workload.config().attributes;
    return workload.compare(testing::reference_reroute(workload.reference_inputs(),
                                                       a.expert_token_num_type, a.idx_type));
  }

  void call(int threads) { moe_re_routing(inputs, outputs, workload.config().attributes, threads); }
  void copy() {
    parallel_copy(copy_dst.data(), copy_src.data(), copy_src.size(), plan.num_threads());
  }

  testing::Workload workload;
  RerouteInputs inputs;
  RerouteOutputs outputs;
  Plan plan;
  std::int64_t bytes;  // read + written by one call
  std::vector<std::byte> copy_src, copy_dst;
};

// Median seconds of one plan_reroute and of one plan + run at A = 1 (same H,
// ranks, experts and optional inputs): the cost a call pays whatever its size.
struct Overhead {
  double plan_s;
  double tiny_call_s;
};

Overhead measure_overhead(Case& main_case, int threads) {
  constexpr int kCalls = 2000;
  const Attributes attributes = main_case.workload.config().attributes;
  std::vector<double> plan_times, tiny_times;
  for (int i = 0; i < kCalls; ++i) {
    plan_times.push_back(seconds([&] { plan_reroute(main_case.inputs, attributes, threads); }));
  }
  testing::WorkloadConfig tiny_config = main_case.workload.config();
  tiny_config.num_tokens = 1;
  tiny_config.num_valid_tokens = -1;
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
          {"expert_alignment", std::to_string(c.attributes.expert_alignment)},
          {"valid_tokens", std::to_string(c.num_valid_tokens)},
          {"threads", std::to_string(threads)},
          {"plan_threads", std::to_string(plan_threads)},
          {"repeat", std::to_string(repeat)}};
}

// Verifies `c`; on a difference prints it (and the JSON line) and returns false.
bool verified(Case& c, const std::string& what, bool json, const std::string& config_json) {
  const std::string difference = c.verify();
  if (difference.empty()) return true;
  std::printf("NOT verified (%s): %s\n", what.c_str(), difference.c_str());
  if (json) {
    std::printf("{\"verified\": false, \"case\": \"%s\", \"difference\": \"%s\", \"config\": %s}\n",
                what.c_str(), difference.c_str(), config_json.c_str());
  }
  return false;
}

const char* yes_no(bool value) { return value ? "yes" : "no"; }

struct BenchOptions {
  WorkloadOptions workload;
  int threads = 0;
  int repeat = 20;
  bool json = false;
};

int run_bench(const BenchOptions& o) {
  const testing::WorkloadConfig config = tools::workload_config(o.workload);
  const int threads = o.threads > 0 ? o.threads : hardware_threads();
  const int repeat = o.repeat;
  const double start_load = load_average();
  progress("allocating and filling inputs and outputs");
  auto main_case = std::make_unique<Case>(config, threads);
  const Plan& plan = main_case->plan;
  const auto fields = config_fields(config, threads, plan.num_threads(), repeat);
  std::string config_text, config_json;
  for (const auto& [name, value] : fields) {
    config_text += " " + name + "=" + value;
    config_json += (config_json.empty() ? "{" : ", ") + ("\"" + name + "\": " + value);
  }
  config_json += "}";
  std::printf("moe-reroute-bench:%s\n", config_text.c_str());

  progress("verifying against the naive reference");
  if (!verified(*main_case, "workload", o.json, config_json)) return 1;
  std::printf("verified\n");

  const std::int64_t bytes = main_case->bytes;
  progress("preparing the gather peer");
  GatherBaseline gather = gather_baseline(main_case->workload, plan);
  // The copy and the gather get the threads the plan chose, which it caps by bytes per thread.
  const int used_threads = plan.num_threads();
  progress("timing " + std::to_string(repeat) + " rounds");
  const std::vector<double> t = interleaved_medians(
      {[&] { main_case->call(threads); },
       [&] { run_reroute(plan, main_case->inputs, main_case->outputs); },
       [&] { main_case->copy(); }, [&] { gather.run(used_threads); }, [&] { gather.run(1); }},
      repeat);
  gather = {};
  progress("measuring the per-call overhead");
  const Overhead overhead = measure_overhead(*main_case, threads);

  const double op_s = t[0], run_s = t[1], copy_s = t[2], gather_s = t[3], gather1_s = t[4];
  const auto gbps = [](std::int64_t n, double s) { return static_cast<double>(n) / s / 1e9; };
  const double llc_mib = static_cast<double>(last_level_cache_bytes()) / (1 << 20);
  std::printf("bytes per call: %lld (read + written); last-level cache %.0f MiB; "
              "streaming stores: %s\n",
              static_cast<long long>(bytes), llc_mib, yes_no(plan.streaming_stores()));
  std::printf("%-32s %12s %9s %10s\n", "", "median ms", "GB/s", "copy/this");
  const auto row = [&](const char* name, double s) {
    std::printf("%-32s %12.4f %9.2f %10.3f\n", name, s * 1e3, gbps(bytes, s), copy_s / s);
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

  // The same workload at A/64, A/16 and A/4: the streaming stores start where
  // the bytes outgrow the last-level cache, and the copy ratio shows whether
  // they pay there.
  std::printf("\nwhen streaming stores pay (the workload at smaller A, same threads):\n");
  std::printf("%10s %10s %10s %12s %12s %10s\n", "A", "MB moved", "streaming", "op ms", "copy ms",
              "copy/op");
  std::string sweep_json;
  for (const std::int64_t divisor : {64, 16, 4, 1}) {
    const std::int64_t num_tokens = config.num_tokens / divisor;
    if (num_tokens < 1 && divisor > 1) continue;
    double size_op_s = op_s, size_copy_s = copy_s;
    std::int64_t size_bytes = bytes;
    bool streaming = plan.streaming_stores();
    if (divisor > 1) {
      testing::WorkloadConfig smaller = config;
      smaller.num_tokens = num_tokens;
      if (config.num_valid_tokens >= 0) {
        smaller.num_valid_tokens = config.num_valid_tokens / divisor;
      }
      Case c(smaller, threads);
      if (!verified(c, "A=" + std::to_string(num_tokens), o.json, config_json)) return 1;
      const std::vector<double> m =
          interleaved_medians({[&] { c.call(threads); }, [&] { c.copy(); }}, repeat);
      size_op_s = m[0];
      size_copy_s = m[1];
      size_bytes = c.bytes;
      streaming = c.plan.streaming_stores();
    }
    std::printf("%10lld %10.1f %10s %12.4f %12.4f %10.3f\n", static_cast<long long>(num_tokens),
                static_cast<double>(size_bytes) / 1e6, yes_no(streaming), size_op_s * 1e3,
                size_copy_s * 1e3, size_copy_s / size_op_s);
    sweep_json += (sweep_json.empty() ? "" : ", ") + ("{\"A\": " + std::to_string(num_tokens)) +
                  ", \"streaming\": " + (streaming ? "true" : "false") +
                  ", \"ratio\": " + std::to_string(size_copy_s / size_op_s) + "}";
  }

  // Static shapes (docs/spec.md section 9) beside the full call (k = 1, the
  // counts summing to A): a quarter of A valid with allow_spare_rows, and
  // expert_alignment 128 on the full call's counts.
  main_case->copy_src = {};
  main_case->copy_dst = {};
  testing::WorkloadConfig full_config = config;
  full_config.attributes.expert_alignment = 1;
  full_config.attributes.allow_spare_rows = false;
  full_config.num_valid_tokens = -1;
  testing::WorkloadConfig quarter_config = full_config;
  quarter_config.num_valid_tokens = config.num_tokens / 4;
  quarter_config.attributes.allow_spare_rows = true;
  testing::WorkloadConfig aligned_config = full_config;
  aligned_config.attributes.expert_alignment = 128;
  progress("verifying and timing the static-shape cases");
  std::unique_ptr<Case> own_full;
  if (full_config.attributes != config.attributes || config.num_valid_tokens >= 0) {
    own_full = std::make_unique<Case>(full_config, threads);
    if (!verified(*own_full, "full call", o.json, config_json)) return 1;
  }
  Case& full = own_full ? *own_full : *main_case;
  Case quarter(quarter_config, threads), aligned(aligned_config, threads);
  if (!verified(quarter, "allow_spare_rows", o.json, config_json) ||
      !verified(aligned, "expert_alignment=128", o.json, config_json)) {
    return 1;
  }
  const Plan& aligned_plan = aligned.plan;
  const std::int64_t pad_rows = aligned_plan.num_padded_rows() - aligned_plan.num_valid_rows();
  const std::int64_t pad_bytes = pad_rows * aligned_plan.bytes_per_row();
  // The pad rows' own limit: a plain memset of their bytes with the same threads.
  std::vector<std::byte> pad_zeros(static_cast<std::size_t>(pad_bytes));
  const auto zero_pad = [&] { parallel_zero(pad_zeros.data(), pad_zeros.size(), threads); };
  const std::vector<double> s = interleaved_medians(
      {[&] { full.call(threads); }, [&] { quarter.call(threads); },
       [&] { aligned.call(threads); }, zero_pad},
      repeat);
  // The pad bytes against what the full call moves (reads + writes) and
  // against what it writes alone: the two readings of "its share".
  const double pad_share = static_cast<double>(pad_bytes) / static_cast<double>(full.bytes);
  const double pad_share_written =
      static_cast<double>(pad_bytes) / static_cast<double>(row_bytes_written(full.plan));
  const double quarter_ratio = s[1] / s[0], aligned_ratio = s[2] / s[0];
  std::printf("\nstatic shapes (each against the full call, k = 1, in the same rounds):\n");
  std::printf("%-44s %12s %10s %s\n", "", "median ms", "x full", "target");
  std::printf("%-44s %12.4f %10.3f\n", "full call, counts sum to A", s[0] * 1e3, 1.0);
  std::printf("%-44s %12.4f %10.3f <= 0.45\n", "A/4 valid rows (allow_spare_rows)", s[1] * 1e3,
              quarter_ratio);
  std::printf("%-44s %12.4f %10.3f <= %.3f (1 + pad / moved), <= %.3f (1 + pad / written)\n",
              "expert_alignment 128, same counts", s[2] * 1e3, aligned_ratio, 1.0 + pad_share,
              1.0 + pad_share_written);
  std::printf("zero pad rows written at k = 128: %lld rows, %lld bytes: %.1f%% of the bytes the "
              "full call moves (reads + writes), %.1f%% of those it writes\n",
              static_cast<long long>(pad_rows), static_cast<long long>(pad_bytes),
              100.0 * pad_share, 100.0 * pad_share_written);
  std::printf("memset of those bytes alone %.4f ms: k = 128 is %.3fx the full call + that memset\n",
              s[3] * 1e3, s[2] / (s[0] + s[3]));

  print_load(start_load);
  if (o.json) {
    std::printf(
        "{\"verified\": true, \"bytes\": %lld, \"op_s\": %.9g, \"copy_s\": %.9g, "
        "\"ratio\": %.6g, \"run_s\": %.9g, \"gather_s\": %.9g, \"gather_ratio\": %.6g, "
        "\"speedup_vs_gather\": %.6g, \"gather_1thread_s\": %.9g, \"plan_s\": %.9g, "
        "\"tiny_call_s\": %.9g, \"streaming_stores\": %s, \"sweep\": [%s], "
        "\"spare_rows_quarter_ratio\": %.6g, \"alignment_128_ratio\": %.6g, "
        "\"pad_share\": %.6g, \"pad_share_written\": %.6g, \"config\": %s}\n",
        static_cast<long long>(bytes), op_s, copy_s, copy_s / op_s, run_s, gather_s,
        copy_s / gather_s, gather_s / op_s, gather1_s, overhead.plan_s, overhead.tiny_call_s,
        plan.streaming_stores() ? "true" : "false", sweep_json.c_str(), quarter_ratio,
        aligned_ratio, pad_share, pad_share_written, config_json.c_str());
  }
  return 0;
}

}  // namespace
}  // namespace moe_reroute::bench

int main(int argc, char** argv) {
  CLI::App app{"moe-reroute-bench: verify moe_re_routing, then time it against a plain copy"};
  moe_reroute::bench::BenchOptions o;
  moe_reroute::tools::add_workload_options(app, o.workload);
  moe_reroute::tools::add_threads_option(app, o.threads);
  app.add_option("--repeat", o.repeat, "timed rounds")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  app.add_flag("--json", o.json, "print a JSON object as the last line");
  return moe_reroute::tools::parse_and_run(app, argc, argv,
                                           [&] { return moe_reroute::bench::run_bench(o); });
}
