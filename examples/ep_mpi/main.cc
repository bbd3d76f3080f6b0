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

// The local experts over moe_re_routing's R expert-major rows: expert e's
// segment starts where expert e - 1's ends (segment_end, cumsum mode), and the
// ranks' counts [P, E] say how many of its rows are valid (the rest pad).
// Returns [R, O] float32.
std::vector<float> run_experts(const toy::LayerConfig& c, int rank, std::int64_t num_rows,
                               const std::int8_t* tokens, const float* scales,
                               const std::int32_t* segment_end, const std::int32_t* counts) {
  const auto hidden = static_cast<std::size_t>(c.hidden);
  const auto out_hidden = static_cast<std::size_t>(c.out_hidden);
  std::vector<float> out(static_cast<std::size_t>(num_rows) * out_hidden);
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

  const mr::ep::DispatchOutputs& d = dispatched.outputs;
  const std::int64_t num_rows = dispatched.handle.num_rows();
  const std::vector<float> expert_out = run_experts(
      c, rank, num_rows, static_cast<const std::int8_t*>(d.permute_tokens.data()),
      static_cast<const float*>(d.permute_per_token_scales.data()),
      static_cast<const std::int32_t*>(d.expert_token_num.data()),
      static_cast<const std::int32_t*>(d.expert_token_num_per_rank.data()));
  laps.lap();

  mr::ep::Tensor out = mr::ep::combine({expert_out.data(), mr::DType::kFloat32, {num_rows, c.out_hidden}},
                                       dispatched.handle, options.threads);
  laps.lap();
  return out;
}

constexpr const char* kBaselineStages[] = {
    "moe_init_routing", "exchange_counts",        "dispatch_alltoallv", "moe_re_routing",
    "experts",          "moe_re_routing_inverse", "return_alltoallv",   "moe_finalize_routing"};

// Per-destination-rank row counts and displacements of one Alltoallv, scaled
// to elements by `row_elements`.
struct Exchange {
  std::vector<int> counts;
  std::vector<int> displs;
};

Exchange exchange_of(const std::vector<std::int64_t>& rows_per_rank, std::int64_t row_elements) {
  Exchange x;
  int offset = 0;
  for (const std::int64_t rows : rows_per_rank) {
    x.counts.push_back(static_cast<int>(rows * row_elements));
    x.displs.push_back(offset);
    offset += x.counts.back();
  }
  return x;
}

// Rows per rank from a [P, E] count matrix (row sums).
std::vector<std::int64_t> rank_totals(const std::vector<std::int32_t>& counts, int num_ranks,
                                      int experts_per_rank) {
  std::vector<std::int64_t> totals(static_cast<std::size_t>(num_ranks), 0);
  for (std::size_t i = 0; i < counts.size(); ++i) totals[i / static_cast<std::size_t>(experts_per_rank)] += counts[i];
  return totals;
}

template <typename T>
void alltoallv(const std::vector<T>& send, const Exchange& send_x, std::vector<T>& recv,
               const Exchange& recv_x, MPI_Datatype type) {
  MPI_Alltoallv(send.data(), send_x.counts.data(), send_x.displs.data(), type, recv.data(),
                recv_x.counts.data(), recv_x.displs.data(), type, MPI_COMM_WORLD);
}

// The layer on this rank the three-step way, each row packed, sent and
// reordered on its own pass; returns its output [T, O].
mr::ep::Tensor run_baseline(const Options& options, const toy::RankInput& input, int rank, Laps& laps) {
  const toy::LayerConfig& c = options.config;
  const mr::ep::DispatchInputs in = inputs_of(c, input);
  const auto num_tokens = static_cast<std::size_t>(c.tokens_per_rank);
  const auto hidden = static_cast<std::size_t>(c.hidden);
  const auto out_hidden = static_cast<std::size_t>(c.out_hidden);
  const auto topk = static_cast<std::size_t>(c.topk);

  // Global expert g = rank * E + e, so sorting the (token, k) pairs by g orders
  // them by destination rank, then its local expert, as the dispatch needs;
  // send_row[t * K + k] is where pair (t, k) went, which the combine reads back.
  const std::size_t num_send = num_tokens * topk;
  const auto sends = static_cast<std::int64_t>(num_send);
  std::vector<std::int8_t> send_tokens(num_send * hidden);
  std::vector<std::int32_t> send_row(num_send);
  std::vector<std::int32_t> send_count(static_cast<std::size_t>(c.num_experts()));
  mr::InitRoutingAttributes init;
  init.expert_num = c.num_experts();
  init.expert_tokens_count_or_cumsum_flag = mr::kExpertTokensCount;
  mr::moe_init_routing(
      {.x = in.x, .expert_idx = in.expert_idx},
      {.expanded_x = {send_tokens.data(), mr::DType::kInt8, {sends, c.hidden}},
       .expanded_row_idx = {send_row.data(), mr::DType::kInt32, {sends}},
       .expert_tokens_count_or_cumsum = {send_count.data(), mr::DType::kInt32, {c.num_experts()}},
       .expert_tokens_before_capacity = {nullptr, mr::DType::kInt32, {0}}},
      init, options.threads);
  std::vector<float> send_scales(num_send);
  for (std::size_t p = 0; p < num_send; ++p) {
    send_scales[static_cast<std::size_t>(send_row[p])] = input.scales[p / topk];
  }
  laps.lap();

  std::vector<std::int32_t> recv_count(send_count.size());
  MPI_Alltoall(send_count.data(), c.experts_per_rank, MPI_INT32_T, recv_count.data(),
               c.experts_per_rank, MPI_INT32_T, MPI_COMM_WORLD);
  laps.lap();

  const auto send_rows = rank_totals(send_count, c.num_ranks, c.experts_per_rank);
  const auto recv_rows = rank_totals(recv_count, c.num_ranks, c.experts_per_rank);
  // A: the rows received, or the fixed capacity they land in.
  const std::int64_t num_recv = options.fixed_capacity
                                    ? options.capacity()
                                    : std::accumulate(recv_rows.begin(), recv_rows.end(), std::int64_t{0});
  const auto recv_size = static_cast<std::size_t>(num_recv);
  std::vector<std::int8_t> recv_tokens(recv_size * hidden);
  std::vector<float> recv_scales(recv_size);
  alltoallv(send_tokens, exchange_of(send_rows, c.hidden), recv_tokens,
            exchange_of(recv_rows, c.hidden), MPI_INT8_T);
  alltoallv(send_scales, exchange_of(send_rows, 1), recv_scales, exchange_of(recv_rows, 1), MPI_FLOAT);
  laps.lap();

  // ep's attributes (run_ep) for moe_re_routing and its inverse.
  const mr::Attributes attributes{mr::kExpertTokenNumCumsum, mr::kIdxGather,
                                  options.expert_alignment, options.fixed_capacity};
  const mr::TensorView counts_view(recv_count.data(), mr::DType::kInt32,
                                   {c.num_ranks, c.experts_per_rank});
  const mr::RerouteInputs reroute_in{
      .tokens = {recv_tokens.data(), mr::DType::kInt8, {num_recv, c.hidden}},
      .expert_token_num_per_rank = counts_view,
      .per_token_scales = mr::TensorView(recv_scales.data(), mr::DType::kFloat32, {num_recv})};
  const mr::Plan plan = mr::plan_reroute(reroute_in, attributes, options.threads);
  // R output rows: A, plus room for the padding when k > 1.
  const std::int64_t num_rows = plan.output_specs()[0].shape[0];
  const auto rows = static_cast<std::size_t>(num_rows);
  std::vector<std::int8_t> permute_tokens(rows * hidden);
  std::vector<float> permute_scales(rows);
  std::vector<std::int32_t> permute_idx(rows);
  std::vector<std::int32_t> segment_end(static_cast<std::size_t>(c.experts_per_rank));
  mr::run_reroute(
      plan, reroute_in,
      {.permute_tokens = {permute_tokens.data(), mr::DType::kInt8, {num_rows, c.hidden}},
       .permute_per_token_scales = {permute_scales.data(), mr::DType::kFloat32, {num_rows}},
       .permute_token_idx = {permute_idx.data(), mr::DType::kInt32, {num_rows}},
       .expert_token_num = {segment_end.data(), mr::DType::kInt32, {c.experts_per_rank}},
       .permute_topk_weight = {nullptr, mr::DType::kFloat32, {0}}});
  laps.lap();

  std::vector<float> expert_out = run_experts(c, rank, num_rows, permute_tokens.data(), permute_scales.data(),
                                              segment_end.data(), recv_count.data());
  laps.lap();

  std::vector<float> restored(recv_size * out_hidden);
  mr::InverseInputs inverse_in;
  inverse_in.tokens = {expert_out.data(), mr::DType::kFloat32, {num_rows, c.out_hidden}};
  inverse_in.expert_token_num_per_rank = counts_view;
  mr::InverseOutputs inverse_out;
  inverse_out.restored_tokens = {restored.data(), mr::DType::kFloat32, {num_recv, c.out_hidden}};
  mr::moe_re_routing_inverse(inverse_in, inverse_out, attributes, options.threads);
  laps.lap();

  std::vector<float> returned(num_send * out_hidden);
  alltoallv(restored, exchange_of(recv_rows, c.out_hidden), returned,
            exchange_of(send_rows, c.out_hidden), MPI_FLOAT);
  laps.lap();

  // Each token's K expert rows, weighted by its routing weights, summed in order.
  mr::ep::Tensor out({mr::DType::kFloat32, {c.tokens_per_rank, c.out_hidden}});
  mr::FinalizeRoutingInputs combine{
      .expanded_x = {returned.data(), mr::DType::kFloat32, {sends, c.out_hidden}},
      .expanded_row_idx = {send_row.data(), mr::DType::kInt32, {sends}}};
  combine.scales = in.expert_scales;
  mr::moe_finalize_routing(combine, {.out = out.view()}, {mr::kFinalizeRowMajor}, options.threads);
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
  // Every Alltoallv count must fit an int: a rank receives at most P * T * K rows.
  const std::int64_t max_rows = std::int64_t{c.num_ranks} * c.tokens_per_rank * c.topk;
  if (options.baseline && max_rows * std::max<std::int64_t>(c.hidden, c.out_hidden) > INT_MAX) {
    return "--tokens-per-rank: " + std::to_string(c.tokens_per_rank) +
           " tokens make a --baseline Alltoallv count past INT_MAX";
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
  app.add_option("--threads", options.threads, "threads per rank for the re-routing (0: all)")->check(CLI::Range(0, 1024));
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
