// An expert-parallel MoE layer over MPI, by default with moe_reroute::ep:
// ep::dispatch (the sort by expert, then one MPI_Alltoallw straight into
// moe_re_routing's expert-major layout), one toy expert per local expert, and
// ep::combine (one MPI_Alltoallw back, then moe_finalize_routing's weighted
// top-k sum at the source rank). --baseline runs the three steps ep folds:
// moe_init_routing, MPI_Alltoallv, moe_re_routing, the experts,
// moe_re_routing_inverse, MPI_Alltoallv back and moe_finalize_routing.
// Rank 0 checks either bitwise against the single-process layer (layer.h).

#include <mpi.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "layer.h"
#include "moe_reroute/ep.h"
#include "moe_reroute/moe_reroute.h"

namespace {

namespace mr = moe_reroute;

struct Options {
  toy::LayerConfig config{.tokens_per_rank = 256, .hidden = 256, .out_hidden = 192,
                          .experts_per_rank = 4, .topk = 4, .seed = 1};
  int repeat = 10;
  int threads = 1;
  bool baseline = false;
  // Static shapes (docs/spec.md section 9): receive into a buffer of the worst
  // case P * T * K rows, the counts covering fewer (allow_spare_rows), with each
  // expert's segment padded to a multiple of expert_alignment rows.
  bool fixed_capacity = false;
  std::int64_t expert_alignment = 1;

  // ep's capacity: the worst-case rows with --fixed-capacity, else -1 (the rows received).
  std::int64_t capacity() const {
    return fixed_capacity ? std::int64_t{config.num_ranks} * config.tokens_per_rank * config.topk : -1;
  }
};

// The time of each stage of one run of the layer (ms), in the order they ran.
struct Laps {
  std::vector<double> ms;
  double mark = MPI_Wtime();

  void lap() {
    const double now = MPI_Wtime();
    ms.push_back((now - mark) * 1e3);
    mark = now;
  }
};

// This rank's layer input as moe_reroute's views: int8 tokens [T, H], int32
// top-k experts and their float32 weights [T, K], a float32 scale per token.
mr::ep::DispatchInputs inputs_of(const toy::LayerConfig& c, const toy::RankInput& input) {
  return {.x = {input.tokens.data(), mr::DType::kInt8, {c.tokens_per_rank, c.hidden}},
          .expert_idx = {input.topk_expert.data(), mr::DType::kInt32, {c.tokens_per_rank, c.topk}},
          .expert_scales = mr::TensorView(input.topk_weight.data(), mr::DType::kFloat32,
                                          {c.tokens_per_rank, c.topk}),
          .per_token_scales = mr::TensorView(input.scales.data(), mr::DType::kFloat32, {c.tokens_per_rank})};
}

// The local experts over the R rows of moe_re_routing's expert-major layout
// (cumsum mode): expert e's segment starts where expert e - 1's ends, and the
// ranks' counts [P, E] say how many of its rows are valid (the rest pad).
// Returns [R, O] float32.
std::vector<float> run_experts(const toy::LayerConfig& c, int rank, const mr::ep::DispatchOutputs& d) {
  const auto* tokens = static_cast<const std::int8_t*>(d.permute_tokens.data());
  const auto* scales = static_cast<const float*>(d.permute_per_token_scales.data());
  const auto* segment_end = static_cast<const std::int32_t*>(d.expert_token_num.data());
  const auto* counts = static_cast<const std::int32_t*>(d.expert_token_num_per_rank.data());
  const auto hidden = static_cast<std::size_t>(c.hidden);
  const auto out_hidden = static_cast<std::size_t>(c.out_hidden);
  std::vector<float> out(static_cast<std::size_t>(d.permute_tokens.spec().shape[0]) * out_hidden);
  for (int e = 0; e < c.experts_per_rank; ++e) {
    auto row = static_cast<std::size_t>(e == 0 ? 0 : segment_end[e - 1]);
    std::int64_t valid = 0;
    for (int r = 0; r < c.num_ranks; ++r) valid += counts[r * c.experts_per_rank + e];
    for (std::int64_t i = 0; i < valid; ++i, ++row) {
      toy::expert_row(c, rank * c.experts_per_rank + e, tokens + row * hidden, scales[row],
                      out.data() + row * out_hidden);
    }
  }
  return out;
}

constexpr const char* kEpStages[] = {"ep::dispatch", "experts", "ep::combine"};

// The layer on this rank with moe_reroute::ep; returns its output [T, O].
mr::ep::Tensor run_ep(const Options& options, const toy::RankInput& input, int rank, Laps& laps) {
  const toy::LayerConfig& c = options.config;
  // Cumsum mode: each expert's segment end, the layout a grouped GEMM reads.
  const mr::ep::DispatchResult dispatched = mr::ep::dispatch(
      MPI_COMM_WORLD, inputs_of(c, input),
      {.num_experts = c.num_experts(), .expert_token_num_type = mr::kExpertTokenNumCumsum,
       .idx_type = mr::kIdxGather, .expert_alignment = options.expert_alignment,
       .capacity = options.capacity()},
      options.threads);
  laps.lap();

  const std::vector<float> expert_out = run_experts(c, rank, dispatched.outputs);
  laps.lap();

  mr::ep::Tensor out = mr::ep::combine(
      {expert_out.data(), mr::DType::kFloat32, {dispatched.handle.num_rows(), c.out_hidden}},
      dispatched.handle, options.threads);
  laps.lap();
  return out;
}

constexpr const char* kBaselineStages[] = {
    "moe_init_routing", "exchange_counts",        "dispatch_alltoallv", "moe_re_routing",
    "experts",          "moe_re_routing_inverse", "return_alltoallv",   "moe_finalize_routing"};

// One MPI_Alltoallv of rows of `row_elements` elements: send_rows[r] rows to
// rank r and recv_rows[r] from it, each rank's rows after the previous rank's.
void alltoallv(const void* send, const std::vector<int>& send_rows, void* recv,
               const std::vector<int>& recv_rows, int row_elements, MPI_Datatype element) {
  std::vector<int> send_displs(send_rows.size()), recv_displs(recv_rows.size());
  std::exclusive_scan(send_rows.begin(), send_rows.end(), send_displs.begin(), 0);
  std::exclusive_scan(recv_rows.begin(), recv_rows.end(), recv_displs.begin(), 0);
  MPI_Datatype row;
  MPI_Type_contiguous(row_elements, element, &row);
  MPI_Type_commit(&row);
  MPI_Alltoallv(send, send_rows.data(), send_displs.data(), row, recv, recv_rows.data(),
                recv_displs.data(), row, MPI_COMM_WORLD);
  MPI_Type_free(&row);
}

// The layer on this rank the three-step way, each row packed, sent and
// reordered in passes of their own; returns its output [T, O].
mr::ep::Tensor run_baseline(const Options& options, const toy::RankInput& input, int rank, Laps& laps) {
  const toy::LayerConfig& c = options.config;
  const mr::ep::DispatchInputs in = inputs_of(c, input);
  const std::int64_t num_pairs = std::int64_t{c.tokens_per_rank} * c.topk;

  // Global expert g = rank * E + e, so sorting the (token, k) pairs by g orders
  // them by destination rank, then its local expert, as the dispatch needs;
  // send_row[t * K + k] is where pair (t, k) went, which the combine reads back.
  const mr::ep::Tensor send_tokens({mr::DType::kInt8, {num_pairs, c.hidden}});
  std::vector<std::int32_t> send_row(static_cast<std::size_t>(num_pairs));
  std::vector<std::int32_t> send_count(static_cast<std::size_t>(c.num_experts()));
  mr::moe_init_routing(
      {.x = in.x, .expert_idx = in.expert_idx},
      {.expanded_x = send_tokens.view(),
       .expanded_row_idx = {send_row.data(), mr::DType::kInt32, {num_pairs}},
       .expert_tokens_count_or_cumsum = {send_count.data(), mr::DType::kInt32, {c.num_experts()}},
       .expert_tokens_before_capacity = {nullptr, mr::DType::kInt32, {0}}},
      {.expert_num = c.num_experts(), .expert_tokens_count_or_cumsum_flag = mr::kExpertTokensCount},
      options.threads);
  std::vector<float> send_scales(send_row.size());
  for (std::size_t p = 0; p < send_row.size(); ++p) {
    send_scales[static_cast<std::size_t>(send_row[p])] = input.scales[p / static_cast<std::size_t>(c.topk)];
  }
  laps.lap();

  // What ep::dispatch returns, made here by the exchange and moe_re_routing.
  mr::ep::DispatchOutputs d;
  d.expert_token_num_per_rank = mr::ep::Tensor({mr::DType::kInt32, {c.num_ranks, c.experts_per_rank}});
  auto* recv_count = static_cast<std::int32_t*>(d.expert_token_num_per_rank.data());
  MPI_Alltoall(send_count.data(), c.experts_per_rank, MPI_INT32_T, recv_count, c.experts_per_rank,
               MPI_INT32_T, MPI_COMM_WORLD);
  laps.lap();

  // Rows to and from each rank: the row sums of the [P, E] counts.
  std::vector<int> send_rows(static_cast<std::size_t>(c.num_ranks)), recv_rows(send_rows.size());
  for (std::size_t i = 0; i < send_count.size(); ++i) {
    send_rows[i / static_cast<std::size_t>(c.experts_per_rank)] += send_count[i];
    recv_rows[i / static_cast<std::size_t>(c.experts_per_rank)] += recv_count[i];
  }
  // A: the rows received, or the fixed capacity they land in.
  const std::int64_t num_recv = options.fixed_capacity
                                    ? options.capacity()
                                    : std::accumulate(recv_rows.begin(), recv_rows.end(), std::int64_t{0});
  const mr::ep::Tensor recv_tokens({mr::DType::kInt8, {num_recv, c.hidden}});
  const mr::ep::Tensor recv_scales({mr::DType::kFloat32, {num_recv}});
  alltoallv(send_tokens.data(), send_rows, recv_tokens.data(), recv_rows, c.hidden, MPI_INT8_T);
  alltoallv(send_scales.data(), send_rows, recv_scales.data(), recv_rows, 1, MPI_FLOAT);
  laps.lap();

  // ep's attributes (run_ep) for moe_re_routing and its inverse.
  const mr::Attributes attributes{mr::kExpertTokenNumCumsum, mr::kIdxGather,
                                  options.expert_alignment, options.fixed_capacity};
  const mr::RerouteInputs reroute_in{.tokens = recv_tokens.view(),
                                     .expert_token_num_per_rank = d.expert_token_num_per_rank.view(),
                                     .per_token_scales = recv_scales.view()};
  const mr::Plan plan = mr::plan_reroute(reroute_in, attributes, options.threads);
  const std::vector<mr::TensorSpec>& specs = plan.output_specs();
  d.permute_tokens = mr::ep::Tensor(specs[0]);
  d.permute_per_token_scales = mr::ep::Tensor(specs[1]);
  d.permute_token_idx = mr::ep::Tensor(specs[2]);
  d.expert_token_num = mr::ep::Tensor(specs[3]);
  d.permute_topk_weight = mr::ep::Tensor(specs[4]);
  mr::run_reroute(plan, reroute_in,
                  {d.permute_tokens.view(), d.permute_per_token_scales.view(), d.permute_token_idx.view(),
                   d.expert_token_num.view(), d.permute_topk_weight.view()});
  laps.lap();

  const std::vector<float> expert_out = run_experts(c, rank, d);
  laps.lap();

  const auto out_hidden = static_cast<std::size_t>(c.out_hidden);
  std::vector<float> restored(static_cast<std::size_t>(num_recv) * out_hidden);
  mr::moe_re_routing_inverse(
      {.tokens = {expert_out.data(), mr::DType::kFloat32, {specs[0].shape[0], c.out_hidden}},
       .expert_token_num_per_rank = d.expert_token_num_per_rank.view()},
      {.restored_tokens = {restored.data(), mr::DType::kFloat32, {num_recv, c.out_hidden}}}, attributes,
      options.threads);
  laps.lap();

  std::vector<float> returned(send_row.size() * out_hidden);
  alltoallv(restored.data(), recv_rows, returned.data(), send_rows, c.out_hidden, MPI_FLOAT);
  laps.lap();

  // Each token's K expert rows, weighted by its routing weights, summed in order.
  mr::ep::Tensor out({mr::DType::kFloat32, {c.tokens_per_rank, c.out_hidden}});
  mr::moe_finalize_routing({.expanded_x = {returned.data(), mr::DType::kFloat32, {num_pairs, c.out_hidden}},
                            .expanded_row_idx = {send_row.data(), mr::DType::kInt32, {num_pairs}},
                            .scales = in.expert_scales},
                           {.out = out.view()}, {mr::kFinalizeRowMajor}, options.threads);
  laps.lap();
  return out;
}

// A way to run the layer: its name in the JSON line, its stages, and the run,
// which returns this rank's output [T, O] float32 and times each stage.
struct Mode {
  const char* name;
  std::span<const char* const> stages;
  mr::ep::Tensor (*run)(const Options&, const toy::RankInput&, int rank, Laps&);
};

// Rank 0: compares every rank's output with the single-process layer.
bool verify(const toy::LayerConfig& config, const std::vector<float>& gathered) {
  const std::size_t per_rank = static_cast<std::size_t>(config.tokens_per_rank) * static_cast<std::size_t>(config.out_hidden);
  bool ok = true;
  for (int r = 0; r < config.num_ranks; ++r) {
    const std::vector<float> expect = toy::reference_output(config, toy::make_rank_input(config, r));
    const float* got = gathered.data() + static_cast<std::size_t>(r) * per_rank;
    std::size_t mismatches = 0;
    for (std::size_t i = 0; i < per_rank; ++i) mismatches += std::memcmp(&got[i], &expect[i], sizeof(float)) != 0;
    if (mismatches != 0) {
      std::fprintf(stderr, "rank %d: %zu of %zu output values differ from the single-process layer\n", r,
                   mismatches, per_rank);
      ok = false;
    }
  }
  return ok;
}

// Rank 0: each stage's median, min and max over the runs (each run's time is
// its slowest rank's), then one JSON line with the medians.
void print_times(const Mode& mode, const std::vector<double>& times, const Options& options, bool verified) {
  std::vector<const char*> names(mode.stages.begin(), mode.stages.end());
  names.push_back("total");
  std::string json = std::string("{\"mode\": \"") + mode.name + "\", \"ranks\": " +
                     std::to_string(options.config.num_ranks) +
                     ", \"verified\": " + (verified ? "true" : "false") +
                     ", \"tokens_per_rank\": " + std::to_string(options.config.tokens_per_rank) +
                     ", \"fixed_capacity\": " + (options.fixed_capacity ? "true" : "false") +
                     ", \"expert_alignment\": " + std::to_string(options.expert_alignment) +
                     ", \"times_ms\": {";
  std::printf("%-24s %10s %10s %10s\n", "stage (max over ranks)", "median_ms", "min_ms", "max_ms");
  for (std::size_t s = 0; s < names.size(); ++s) {
    std::vector<double> v;
    for (std::size_t i = s; i < times.size(); i += names.size()) v.push_back(times[i]);
    std::sort(v.begin(), v.end());
    const double median = v[v.size() / 2];
    std::printf("%-24s %10.3f %10.3f %10.3f\n", names[s], median, v.front(), v.back());
    char value[64];
    std::snprintf(value, sizeof(value), "%s\"%s\": %.4f", s == 0 ? "" : ", ", names[s], median);
    json += value;
  }
  std::printf("%s}}\n", json.c_str());
}

// Checks the flags against the number of ranks; returns an error message or "".
std::string check_options(const Options& options) {
  const toy::LayerConfig& c = options.config;
  if (c.topk > c.num_experts()) {
    return "--topk: " + std::to_string(c.topk) + " exceeds the " + std::to_string(c.num_experts()) +
           " experts of " + std::to_string(c.num_ranks) + " ranks x --experts-per-rank " +
           std::to_string(c.experts_per_rank);
  }
  // MPI counts rows in an int: a rank receives at most P * T * K of them.
  if (std::int64_t{c.num_ranks} * c.tokens_per_rank * c.topk > INT_MAX) {
    return "--tokens-per-rank: " + std::to_string(c.tokens_per_rank) + " tokens make more than INT_MAX rows";
  }
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  Options options;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &options.config.num_ranks);

  toy::LayerConfig& c = options.config;
  CLI::App app("Expert-parallel MoE layer over MPI with moe_reroute::ep; rank 0 verifies it.");
  app.add_option("--tokens-per-rank", c.tokens_per_rank, "tokens T per rank")->check(CLI::Range(0, 1 << 20));
  app.add_option("--hidden", c.hidden, "int8 elements H per dispatched token")->check(CLI::Range(1, 1 << 16));
  app.add_option("--out-hidden", c.out_hidden, "float32 elements per expert output row")->check(CLI::Range(1, 1 << 16));
  app.add_option("--experts-per-rank", c.experts_per_rank, "local experts E per rank")->check(CLI::Range(1, 1024));
  app.add_option("--topk", c.topk, "experts per token")->check(CLI::Range(1, 1024));
  app.add_option("--seed", c.seed, "seed of inputs and routing");
  app.add_option("--repeat", options.repeat, "timed runs of the layer")->check(CLI::Range(1, 100000));
  app.add_option("--threads", options.threads, "threads per rank for moe_reroute's calls (0: all)")->check(CLI::Range(0, 1024));
  app.add_flag("--baseline", options.baseline,
               "the three steps ep folds: moe_init_routing, MPI_Alltoallv, moe_re_routing and back");
  app.add_flag("--fixed-capacity", options.fixed_capacity,
               "receive into a worst-case buffer of P * T * K rows (allow_spare_rows)");
  app.add_option("--expert-alignment", options.expert_alignment,
                 "pad each expert's segment to a multiple of this many rows")
      ->check(CLI::Range(1, 1 << 20));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = rank == 0 ? app.exit(e) : e.get_exit_code();
    MPI_Finalize();
    return rc;
  }
  if (const std::string error = check_options(options); !error.empty()) {
    if (rank == 0) std::fprintf(stderr, "moe-reroute-ep-mpi: %s\n", error.c_str());
    MPI_Finalize();
    return 2;
  }

  const Mode mode = options.baseline ? Mode{"baseline", kBaselineStages, run_baseline}
                                     : Mode{"ep", kEpStages, run_ep};
  const toy::RankInput input = toy::make_rank_input(c, rank);
  std::vector<double> times;  // [repeat, stages + 1] ms: each stage, then the total
  mr::ep::Tensor out;
  try {
    for (int i = 0; i < options.repeat; ++i) {
      MPI_Barrier(MPI_COMM_WORLD);
      Laps laps;
      out = mode.run(options, input, rank, laps);
      times.insert(times.end(), laps.ms.begin(), laps.ms.end());
      times.push_back(std::accumulate(laps.ms.begin(), laps.ms.end(), 0.0));
    }
  } catch (const mr::Error& e) {
    std::fprintf(stderr, "moe-reroute-ep-mpi: rank %d: %s\n", rank, e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  std::vector<double> max_times(times.size());
  MPI_Reduce(times.data(), max_times.data(), static_cast<int>(times.size()), MPI_DOUBLE, MPI_MAX, 0,
             MPI_COMM_WORLD);

  const auto per_rank = static_cast<int>(std::int64_t{c.tokens_per_rank} * c.out_hidden);
  std::vector<float> gathered(rank == 0 ? static_cast<std::size_t>(per_rank) * static_cast<std::size_t>(c.num_ranks) : 0);
  MPI_Gather(out.data(), per_rank, MPI_FLOAT, gathered.data(), per_rank, MPI_FLOAT, 0, MPI_COMM_WORLD);
  int verified = 0;
  if (rank == 0) {
    verified = verify(c, gathered) ? 1 : 0;
    print_times(mode, max_times, options, verified != 0);
  }
  MPI_Bcast(&verified, 1, MPI_INT, 0, MPI_COMM_WORLD);
  MPI_Finalize();
  return verified != 0 ? 0 : 1;
}
