// moe-reroute-routing-bench: moe_init_routing and moe_finalize_routing on the
// CPU, each verified against the naive reference (testing/routing_reference)
// before it is timed, then medians against their physical limits measured in
// the same rounds: init against a per-row gather of the same rows (its
// index made once) and that gather plus a stable sort of the ids; finalize
// against a plain copy of the bytes it must read and write.

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "moe_reroute/moe_reroute.h"
#include "options.h"
#include "reference.h"
#include "routing_reference.h"
#include "timing.h"

namespace moe_reroute::bench {
namespace {

struct RoutingOptions {
  std::int64_t tokens = 4096;
  std::int64_t top_k = 8;
  std::int64_t hidden = 7168;
  std::int64_t experts = 256;
  int threads = 0;
  int repeat = 20;
};

void progress(const std::string& line) {
  std::cerr << "moe-reroute-routing-bench: " << line << std::endl;
}

std::size_t at(std::int64_t i) { return static_cast<std::size_t>(i); }

// Random bfloat16 values in [-4, 4): finite, as activations are.
std::vector<std::uint16_t> random_bfloat16(std::mt19937_64& rng, std::int64_t count) {
  std::uniform_real_distribution<float> value(-4.0f, 4.0f);
  std::vector<std::uint16_t> out(at(count));
  for (std::uint16_t& v : out) {
    const std::vector<std::byte> bytes =
        testing::reference_store(testing::FloatType::kBFloat16, value(rng));
    std::memcpy(&v, bytes.data(), 2);
  }
  return out;
}

template <typename T>
std::vector<T> poisoned(std::int64_t count) {
  std::vector<T> v(at(count));
  std::memset(v.data(), 0xA5, v.size() * sizeof(T));
  return v;
}

void print_row(const char* name, double s, std::int64_t bytes, double limit_s) {
  std::printf("%-44s %12.4f %9.2f %10.3f\n", name, s * 1e3,
              static_cast<double>(bytes) / s / 1e9, s / limit_s);
}

int run(const RoutingOptions& o) {
  const std::int64_t T = o.tokens, k = o.top_k, H = o.hidden, E = o.experts;
  const int threads = o.threads > 0 ? o.threads : hardware_threads();
  const double start_load = load_average();
  std::printf("moe-reroute-routing-bench: T=%lld k=%lld H=%lld E=%lld bfloat16 threads=%d "
              "repeat=%d\n",
              static_cast<long long>(T), static_cast<long long>(k), static_cast<long long>(H),
              static_cast<long long>(E), threads, o.repeat);
  progress("allocating and filling inputs");
  std::mt19937_64 rng(1);
  const std::vector<std::uint16_t> x = random_bfloat16(rng, T * H);
  std::vector<std::int32_t> ids(at(T * k));
  for (std::int64_t t = 0; t < T; ++t) {  // k distinct experts a token, as top-k gives
    std::vector<std::int32_t> pick(at(E));
    std::iota(pick.begin(), pick.end(), 0);
    std::shuffle(pick.begin(), pick.end(), rng);
    std::copy_n(pick.begin(), k, ids.begin() + t * k);
  }

  // ---- init ----
  InitRoutingAttributes init_attributes;
  init_attributes.expert_num = E;
  init_attributes.expert_tokens_count_or_cumsum_flag = kExpertTokensCount;
  const InitRoutingInputs init_inputs{TensorView(x.data(), DType::kBFloat16, {T, H}),
                                      TensorView(ids.data(), DType::kInt32, {T, k})};
  const InitRoutingOutputSpecs init_specs = infer_init_routing(init_inputs, init_attributes);
  auto expanded = poisoned<std::uint16_t>(init_specs.expanded_x.shape.numel());
  auto row_idx = poisoned<std::int32_t>(T * k);
  auto counts = poisoned<std::int32_t>(E);
  std::int32_t none = 0;
  const InitRoutingOutputs init_outputs{
      TensorView(expanded.data(), DType::kBFloat16, init_specs.expanded_x.shape),
      TensorView(row_idx.data(), DType::kInt32, {T * k}),
      TensorView(counts.data(), DType::kInt32, {E}), TensorView(&none, DType::kInt32, {0})};
  progress("verifying moe_init_routing against the naive reference");
  moe_init_routing(init_inputs, init_outputs, init_attributes, threads);
  const testing::InitReferenceOutputs want_init = testing::reference_init_routing(
      {reinterpret_cast<const std::byte*>(x.data()), T, 2 * H,
       std::vector<std::int64_t>(ids.begin(), ids.end()), k, 0, 0, E, 0, kExpertTokensCount,
       false});
  const auto same = [](const void* got, const void* want, std::size_t bytes) {
    return std::memcmp(got, want, bytes) == 0;
  };
  if (!same(expanded.data(), want_init.expanded_x.data(), want_init.expanded_x.size()) ||
      !same(row_idx.data(), want_init.expanded_row_idx.data(), 4 * row_idx.size()) ||
      !same(counts.data(), want_init.count_or_cumsum.data(), 4 * counts.size())) {
    std::printf("NOT verified: moe_init_routing differs from the reference\n");
    return 1;
  }

  // The gather peer: the same rows by an index made once, split as evenly.
  std::vector<std::int32_t> source(at(T * k));
  for (std::int64_t p = 0; p < T * k; ++p) {
    source[at(row_idx[at(p)])] = static_cast<std::int32_t>(p / k);
  }
  std::vector<std::uint16_t> gathered(expanded.size());
  const std::int64_t row_bytes = 2 * H;
  const auto gather = [&] {
    for_each_thread(threads, [&](int t) {
      const std::int64_t begin = T * k * t / threads, end = T * k * (t + 1) / threads;
      for (std::int64_t i = begin; i < end; ++i) {
        std::memcpy(gathered.data() + i * H, x.data() + std::int64_t{source[at(i)]} * H,
                    at(row_bytes));
      }
    });
  };
  std::vector<std::int32_t> order(at(T * k));
  const auto sort_and_gather = [&] {
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](std::int32_t a, std::int32_t b) { return ids[at(a)] < ids[at(b)]; });
    gather();
  };
  const std::int64_t init_bytes = 2 * T * k * row_bytes;  // rows read and written
  std::vector<std::byte> copy_src(at(init_bytes / 2), std::byte{1}), copy_dst(copy_src.size());
  const auto copy = [&] { parallel_copy(copy_dst.data(), copy_src.data(), copy_src.size(), threads); };
  progress("timing moe_init_routing");
  const std::vector<double> ti = interleaved_medians(
      {[&] { moe_init_routing(init_inputs, init_outputs, init_attributes, threads); }, gather,
       sort_and_gather, copy},
      o.repeat);
  std::printf("verified\n\nmoe_init_routing (dropless, counts), %lld rows of %lld bytes:\n",
              static_cast<long long>(T * k), static_cast<long long>(row_bytes));
  std::printf("%-44s %12s %9s %10s\n", "", "median ms", "GB/s", "x gather");
  print_row("moe_init_routing", ti[0], init_bytes, ti[1]);
  print_row("per-row gather of the same rows", ti[1], init_bytes, ti[1]);
  print_row("stable sort of the ids + that gather", ti[2], init_bytes, ti[1]);
  print_row("plain copy, same bytes", ti[3], init_bytes, ti[1]);
  std::printf("moe_init_routing: %.3fx the gather (target <= 1.1), %.3fx the plain copy\n",
              ti[0] / ti[1], ti[0] / ti[3]);
  copy_src = {};
  copy_dst = {};
  gathered = {};

  // ---- finalize, drop_pad_mode 2: the layout init wrote, bfloat16 rows, float32 scales ----
  const std::vector<std::uint16_t> x1 = random_bfloat16(rng, T * H);
  std::vector<float> scales(at(T * k));
  for (float& s : scales) s = std::uniform_real_distribution<float>(0.0f, 1.0f)(rng);
  FinalizeRoutingInputs fin_inputs{TensorView(expanded.data(), DType::kBFloat16, {T * k, H}),
                                   TensorView(row_idx.data(), DType::kInt32, {T * k})};
  fin_inputs.x1 = TensorView(x1.data(), DType::kBFloat16, {T, H});
  fin_inputs.scales = TensorView(scales.data(), DType::kFloat32, {T, k});
  const FinalizeRoutingAttributes fin_attributes{kFinalizeRowMajor};
  auto out = poisoned<std::uint16_t>(T * H);
  const FinalizeRoutingOutputs fin_outputs{TensorView(out.data(), DType::kBFloat16, {T, H})};
  progress("verifying moe_finalize_routing against the naive reference");
  moe_finalize_routing(fin_inputs, fin_outputs, fin_attributes, threads);
  const std::vector<std::byte> want_out = testing::reference_finalize_routing(
      {testing::FloatType::kBFloat16, testing::FloatType::kFloat32, T, k, H, kFinalizeRowMajor,
       expanded.data(), T * k, row_idx.data(), x1.data(), nullptr, nullptr, scales.data(),
       nullptr});
  if (!same(out.data(), want_out.data(), want_out.size())) {
    std::printf("NOT verified: moe_finalize_routing differs from the reference\n");
    return 1;
  }
  // Read: k rows and x1's row a token; written: one row.
  const std::int64_t fin_bytes = (T * k + 2 * T) * row_bytes;
  std::vector<std::byte> fin_src(at(fin_bytes / 2), std::byte{1}), fin_dst(fin_src.size());
  const auto fin_copy = [&] {
    parallel_copy(fin_dst.data(), fin_src.data(), fin_src.size(), threads);
  };
  progress("timing moe_finalize_routing");
  const std::vector<double> tf = interleaved_medians(
      {[&] { moe_finalize_routing(fin_inputs, fin_outputs, fin_attributes, threads); }, fin_copy},
      o.repeat);
  std::printf("\nmoe_finalize_routing (drop_pad_mode 2, x1, float32 scales), T = %lld:\n",
              static_cast<long long>(T));
  std::printf("%-44s %12s %9s %10s\n", "", "median ms", "GB/s", "x copy");
  print_row("moe_finalize_routing", tf[0], fin_bytes, tf[1]);
  print_row("plain copy of the bytes it reads + writes", tf[1], fin_bytes, tf[1]);
  std::printf("moe_finalize_routing: %.3fx the copy of its bytes (target <= 1.2)\n",
              tf[0] / tf[1]);

  print_load(start_load);
  return 0;
}

}  // namespace
}  // namespace moe_reroute::bench

int main(int argc, char** argv) {
  CLI::App app{
      "moe-reroute-routing-bench: verify moe_init_routing and moe_finalize_routing, then time "
      "them against a gather of the same rows and a plain copy of their bytes"};
  moe_reroute::bench::RoutingOptions o;
  app.add_option("--tokens", o.tokens, "T: tokens")->capture_default_str()->check(CLI::Range(1, 1 << 24));
  app.add_option("--top-k", o.top_k, "k: experts a token")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  app.add_option("--hidden", o.hidden, "H: bfloat16 elements a row")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--experts", o.experts, "E: experts (at least k)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 16));
  moe_reroute::tools::add_threads_option(app, o.threads);
  app.add_option("--repeat", o.repeat, "timed rounds")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  return moe_reroute::tools::parse_and_run(app, argc, argv, [&] {
    if (o.experts < o.top_k) {
      std::cerr << "moe-reroute-routing-bench: --experts: must be at least --top-k\n";
      return 2;
    }
    return moe_reroute::bench::run(o);
  });
}
