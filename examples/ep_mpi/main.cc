// An expert-parallel MoE layer over MPI: moe_init_routing (the sort by
// destination), dispatch AlltoAll, moe_re_routing, one toy expert per local
// expert, the inverse, combine AlltoAll and moe_finalize_routing (the
// weighted top-k sum at the source rank). Rank 0 checks the result bitwise
// against the same layer computed in one process.

#include <mpi.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "layer.h"
#include "moe_reroute/moe_reroute.h"

namespace {

namespace mr = moe_reroute;

enum Stage { kPack, kCounts, kDispatch, kReroute, kExperts, kInverse, kReturn, kCombine, kTotal, kNumStages };

constexpr std::array<const char*, kNumStages> kStageName = {
    "moe_init_routing", "exchange_counts", "dispatch_alltoallv", "moe_re_routing", "experts",
    "moe_re_routing_inverse", "return_alltoallv", "moe_finalize_routing", "total"};

struct Options {
  ep::LayerConfig config;
  int repeat = 0;
  int threads = 0;
  // Static shapes (docs/spec.md section 9): receive into a buffer of the worst
  // case P * T * K rows, the counts covering fewer (allow_spare_rows), with each
  // expert's segment padded to a multiple of expert_alignment rows.
  bool fixed_capacity = false;
  std::int64_t expert_alignment = 1;

  std::int64_t capacity() const {
    return std::int64_t{config.num_ranks} * config.tokens_per_rank * config.topk;
  }
};

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

// The layer on this rank; returns its output [T, O] and fills the stage times (ms).
std::vector<float> run_layer(const Options& options, const ep::RankInput& input, int rank,
                             std::array<double, kNumStages>& times) {
  const ep::LayerConfig& c = options.config;
  const auto num_tokens = static_cast<std::size_t>(c.tokens_per_rank);
  const auto hidden = static_cast<std::size_t>(c.hidden);
  const auto out_hidden = static_cast<std::size_t>(c.out_hidden);
  const auto topk = static_cast<std::size_t>(c.topk);
  const auto num_experts = static_cast<std::size_t>(c.num_experts());
  double mark = MPI_Wtime();
  const double start = mark;
  const auto lap = [&](Stage stage) {
    const double now = MPI_Wtime();
    times[stage] = (now - mark) * 1e3;
    mark = now;
  };

  // Global expert g = rank * E + e, so sorting the (token, k) pairs by g orders
  // them by destination rank, then its local expert, as the dispatch needs;
  // send_row[t * K + k] is where pair (t, k) went, which the combine reads back.
  const std::size_t num_send = num_tokens * topk;
  const auto sends = static_cast<std::int64_t>(num_send);
  std::vector<std::int8_t> send_tokens(num_send * hidden);
  std::vector<std::int32_t> send_row(num_send);
  std::vector<std::int32_t> send_count(num_experts);
  mr::InitRoutingAttributes init;
  init.expert_num = c.num_experts();
  init.expert_tokens_count_or_cumsum_flag = mr::kExpertTokensCount;
  mr::moe_init_routing(
      {.x = {input.tokens.data(), mr::DType::kInt8, {c.tokens_per_rank, c.hidden}},
       .expert_idx = {input.topk_expert.data(), mr::DType::kInt32, {c.tokens_per_rank, c.topk}}},
      {.expanded_x = {send_tokens.data(), mr::DType::kInt8, {sends, c.hidden}},
       .expanded_row_idx = {send_row.data(), mr::DType::kInt32, {sends}},
       .expert_tokens_count_or_cumsum = {send_count.data(), mr::DType::kInt32, {c.num_experts()}},
       .expert_tokens_before_capacity = {nullptr, mr::DType::kInt32, {0}}},
      init, options.threads);
  std::vector<float> send_scales(num_send);
  for (std::size_t p = 0; p < num_send; ++p) {
    send_scales[static_cast<std::size_t>(send_row[p])] = input.scales[p / topk];
  }
  lap(kPack);

  std::vector<std::int32_t> recv_count(num_experts);
  MPI_Alltoall(send_count.data(), c.experts_per_rank, MPI_INT32_T, recv_count.data(),
               c.experts_per_rank, MPI_INT32_T, MPI_COMM_WORLD);
  lap(kCounts);

  const auto send_rows = rank_totals(send_count, c.num_ranks, c.experts_per_rank);
  const auto recv_rows = rank_totals(recv_count, c.num_ranks, c.experts_per_rank);
  std::int64_t num_valid = 0;
  for (const std::int64_t rows : recv_rows) num_valid += rows;
  // A: the rows received, or the fixed capacity they land in.
  const std::int64_t num_recv = options.fixed_capacity ? options.capacity() : num_valid;
  const auto recv_size = static_cast<std::size_t>(num_recv);
  std::vector<std::int8_t> recv_tokens(recv_size * hidden);
  std::vector<float> recv_scales(recv_size);
  alltoallv(send_tokens, exchange_of(send_rows, c.hidden), recv_tokens,
            exchange_of(recv_rows, c.hidden), MPI_INT8_T);
  alltoallv(send_scales, exchange_of(send_rows, 1), recv_scales, exchange_of(recv_rows, 1), MPI_FLOAT);
  lap(kDispatch);

  // Cumsum mode: each expert's segment end, the layout a grouped GEMM reads.
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
  lap(kReroute);

  // Expert e's rows start where expert e - 1's segment ends; the ranks' counts
  // say how many of them are valid (the rest pad).
  std::vector<float> expert_out(rows * out_hidden);
  for (int e = 0; e < c.experts_per_rank; ++e) {
    const int expert = rank * c.experts_per_rank + e;
    std::size_t row = e == 0 ? 0 : static_cast<std::size_t>(segment_end[static_cast<std::size_t>(e) - 1]);
    std::int64_t valid = 0;
    for (int r = 0; r < c.num_ranks; ++r) valid += recv_count[static_cast<std::size_t>(r * c.experts_per_rank + e)];
    for (std::int64_t i = 0; i < valid; ++i, ++row) {
      ep::expert_row(c, expert, &permute_tokens[row * hidden], permute_scales[row],
                     &expert_out[row * out_hidden]);
    }
  }
  lap(kExperts);

  std::vector<float> restored(recv_size * out_hidden);
  mr::InverseInputs inverse_in;
  inverse_in.tokens = {expert_out.data(), mr::DType::kFloat32, {num_rows, c.out_hidden}};
  inverse_in.expert_token_num_per_rank = counts_view;
  mr::InverseOutputs inverse_out;
  inverse_out.restored_tokens = {restored.data(), mr::DType::kFloat32, {num_recv, c.out_hidden}};
  mr::moe_re_routing_inverse(inverse_in, inverse_out, attributes, options.threads);
  lap(kInverse);

  std::vector<float> returned(num_send * out_hidden);
  alltoallv(restored, exchange_of(recv_rows, c.out_hidden), returned,
            exchange_of(send_rows, c.out_hidden), MPI_FLOAT);
  lap(kReturn);

  // Each token's K expert rows, weighted by its routing weights, summed in order.
  std::vector<float> out(num_tokens * out_hidden);
  mr::FinalizeRoutingInputs combine{
      .expanded_x = {returned.data(), mr::DType::kFloat32, {sends, c.out_hidden}},
      .expanded_row_idx = {send_row.data(), mr::DType::kInt32, {sends}}};
  combine.scales = mr::TensorView(input.topk_weight.data(), mr::DType::kFloat32,
                                  {c.tokens_per_rank, c.topk});
  mr::moe_finalize_routing(
      combine, {.out = {out.data(), mr::DType::kFloat32, {c.tokens_per_rank, c.out_hidden}}},
      {mr::kFinalizeRowMajor}, options.threads);
  lap(kCombine);
  times[kTotal] = (mark - start) * 1e3;
  return out;
}

// Rank 0: compares every rank's output with the single-process layer.
bool verify(const ep::LayerConfig& config, const std::vector<float>& gathered) {
  const std::size_t per_rank = static_cast<std::size_t>(config.tokens_per_rank) * static_cast<std::size_t>(config.out_hidden);
  bool ok = true;
  for (int r = 0; r < config.num_ranks; ++r) {
    const std::vector<float> expect = ep::reference_output(config, ep::make_rank_input(config, r));
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

void print_times(const std::vector<std::array<double, kNumStages>>& times, const Options& options,
                 bool verified) {
  std::array<double, kNumStages> median{};
  std::printf("%-24s %10s %10s %10s\n", "stage (max over ranks)", "median_ms", "min_ms", "max_ms");
  for (int s = 0; s < kNumStages; ++s) {
    std::vector<double> v;
    for (const auto& t : times) v.push_back(t[static_cast<std::size_t>(s)]);
    std::sort(v.begin(), v.end());
    median[static_cast<std::size_t>(s)] = v[v.size() / 2];
    std::printf("%-24s %10.3f %10.3f %10.3f\n", kStageName[static_cast<std::size_t>(s)],
                median[static_cast<std::size_t>(s)], v.front(), v.back());
  }
  std::string json = "{\"ranks\": " + std::to_string(options.config.num_ranks) +
                     ", \"verified\": " + (verified ? "true" : "false") +
                     ", \"tokens_per_rank\": " + std::to_string(options.config.tokens_per_rank) +
                     ", \"fixed_capacity\": " + (options.fixed_capacity ? "true" : "false") +
                     ", \"expert_alignment\": " + std::to_string(options.expert_alignment) +
                     ", \"times_ms\": {";
  for (int s = 0; s < kNumStages; ++s) {
    char value[64];
    std::snprintf(value, sizeof(value), "%s\"%s\": %.4f", s == 0 ? "" : ", ",
                  kStageName[static_cast<std::size_t>(s)], median[static_cast<std::size_t>(s)]);
    json += value;
  }
  std::printf("%s}}\n", json.c_str());
}

// Checks the flags against the number of ranks; returns an error message or "".
std::string check_options(const Options& options) {
  const ep::LayerConfig& c = options.config;
  if (c.topk > c.num_experts()) {
    return "--topk: " + std::to_string(c.topk) + " exceeds the " + std::to_string(c.num_experts()) +
           " experts of " + std::to_string(c.num_ranks) + " ranks x --experts-per-rank " +
           std::to_string(c.experts_per_rank);
  }
  // Every Alltoallv count must fit an int: a rank receives at most P * T * K rows.
  const std::int64_t max_rows = std::int64_t{c.num_ranks} * c.tokens_per_rank * c.topk;
  if (max_rows * std::max<std::int64_t>(c.hidden, c.out_hidden) > INT_MAX) {
    return "--tokens-per-rank: " + std::to_string(c.tokens_per_rank) +
           " tokens make an Alltoallv count past INT_MAX";
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

  ep::LayerConfig& c = options.config;
  c.tokens_per_rank = 256;
  c.hidden = 256;
  c.out_hidden = 192;
  c.experts_per_rank = 4;
  c.topk = 4;
  c.seed = 1;
  options.repeat = 10;
  options.threads = 1;
  CLI::App app("Expert-parallel MoE layer over MPI with moe_re_routing; rank 0 verifies it.");
  app.add_option("--tokens-per-rank", c.tokens_per_rank, "tokens T per rank")->check(CLI::Range(0, 1 << 20));
  app.add_option("--hidden", c.hidden, "int8 elements H per dispatched token")->check(CLI::Range(1, 1 << 16));
  app.add_option("--out-hidden", c.out_hidden, "float32 elements per expert output row")->check(CLI::Range(1, 1 << 16));
  app.add_option("--experts-per-rank", c.experts_per_rank, "local experts E per rank")->check(CLI::Range(1, 1024));
  app.add_option("--topk", c.topk, "experts per token")->check(CLI::Range(1, 1024));
  app.add_option("--seed", c.seed, "seed of inputs and routing");
  app.add_option("--repeat", options.repeat, "timed runs of the layer")->check(CLI::Range(1, 100000));
  app.add_option("--threads", options.threads, "threads per rank for the re-routing (0: all)")->check(CLI::Range(0, 1024));
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

  const ep::RankInput input = ep::make_rank_input(c, rank);
  std::vector<std::array<double, kNumStages>> times(static_cast<std::size_t>(options.repeat));
  std::vector<float> out;
  try {
    for (auto& t : times) {
      MPI_Barrier(MPI_COMM_WORLD);
      out = run_layer(options, input, rank, t);
    }
  } catch (const mr::Error& e) {
    std::fprintf(stderr, "moe-reroute-ep-mpi: rank %d: %s\n", rank, e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  std::vector<std::array<double, kNumStages>> max_times(times.size());
  MPI_Reduce(times.data(), max_times.data(), static_cast<int>(times.size() * kNumStages), MPI_DOUBLE,
             MPI_MAX, 0, MPI_COMM_WORLD);

  std::vector<float> gathered(rank == 0 ? out.size() * static_cast<std::size_t>(c.num_ranks) : 0);
  MPI_Gather(out.data(), static_cast<int>(out.size()), MPI_FLOAT, gathered.data(),
             static_cast<int>(out.size()), MPI_FLOAT, 0, MPI_COMM_WORLD);
  int verified = 0;
  if (rank == 0) {
    verified = verify(c, gathered) ? 1 : 0;
    print_times(max_times, options, verified != 0);
  }
  MPI_Bcast(&verified, 1, MPI_INT, 0, MPI_COMM_WORLD);
  MPI_Finalize();
  return verified != 0 ? 0 : 1;
}
