// moe-reroute-ep-bench, run under mpirun: moe_reroute::ep's dispatch and
// combine against the three-step baseline in the same run. The baseline
// dispatch packs by moe_init_routing (a gather of the rows), exchanges the
// counts (MPI_Alltoall) and the rows, scales and weights (MPI_Alltoallv),
// then reorders with moe_re_routing; its combine is moe_re_routing_inverse,
// MPI_Alltoallv back and moe_finalize_routing. Both allocate every buffer per
// call, as NumPy and torch callers do (freed memory kept, as a caching
// allocator keeps it). The first round checks that both give
// the same bytes; then rounds alternate which goes first, each call timed
// between barriers as the slowest rank's time.

#include <malloc.h>
#include <mpi.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "moe_reroute/ep.h"
#include "moe_reroute/moe_reroute.h"
#include "timing.h"
#include "workload.h"

namespace moe_reroute::bench {
namespace {

using ep::Tensor;

struct Options {
  std::string size = "prefill";
  std::int64_t tokens = 0;  // T per rank (0: the size's)
  std::int64_t hidden = 7168;
  std::int64_t top_k = 8;
  std::int64_t num_experts = 256;
  int repeat = 20;
  std::uint64_t seed = 1;
};

// One rank's inputs: prefill int8 tokens with float32 per-token scales,
// decode bfloat16 tokens; float32 top-k weights; expert outputs bfloat16 [R, H].
struct Inputs {
  DType dtype = DType::kInt8;
  std::int64_t tokens = 0;
  bool scales = false;
  std::vector<std::byte> x;
  std::vector<std::int32_t> ids;
  std::vector<float> weights;
  std::vector<float> per_token_scales;
};

Inputs make_inputs(const Options& o, int rank) {
  Inputs in;
  const bool prefill = o.size == "prefill";
  in.dtype = prefill ? DType::kInt8 : DType::kBFloat16;
  in.tokens = o.tokens > 0 ? o.tokens : prefill ? 2048 : 64;
  in.scales = prefill;
  in.x.resize(static_cast<std::size_t>(dtype_bytes(in.dtype, in.tokens * o.hidden)));
  testing::fill_random(in.x.data(), in.x.size(), o.seed + static_cast<std::uint64_t>(rank));
  std::mt19937_64 rng(o.seed * 7919 + static_cast<std::uint64_t>(rank));
  // Each token's k distinct experts, uniformly.
  std::vector<std::int32_t> experts(static_cast<std::size_t>(o.num_experts));
  std::iota(experts.begin(), experts.end(), 0);
  for (std::int64_t t = 0; t < in.tokens; ++t) {
    std::shuffle(experts.begin(), experts.end(), rng);
    in.ids.insert(in.ids.end(), experts.begin(), experts.begin() + o.top_k);
    for (std::int64_t j = 0; j < o.top_k; ++j) in.weights.push_back(static_cast<float>(rng() % 1000) / 999.0f);
    if (in.scales) in.per_token_scales.push_back(static_cast<float>(rng() % 1000) / 37.0f);
  }
  return in;
}

ep::DispatchInputs views(const Options& o, const Inputs& in) {
  ep::DispatchInputs v{.x = {in.x.data(), in.dtype, {in.tokens, o.hidden}},
                       .expert_idx = {in.ids.data(), DType::kInt32, {in.tokens, o.top_k}},
                       .expert_scales = TensorView(in.weights.data(), DType::kFloat32, {in.tokens, o.top_k})};
  if (in.scales) v.per_token_scales = TensorView(in.per_token_scales.data(), DType::kFloat32, {in.tokens});
  return v;
}

// The three-step path's dispatch outputs and what its combine needs.
struct Baseline {
  ep::DispatchOutputs outputs;
  std::vector<std::int32_t> row_idx;        // [T * k]: sorted position of each pair
  std::vector<std::int32_t> recv_counts;    // [N * E]
  std::vector<int> send_rows, recv_rows;    // per rank
  std::int64_t num_recv = 0;                // A
};

std::vector<int> displs_of(const std::vector<int>& counts, int scale) {
  std::vector<int> displs(counts.size(), 0);
  for (std::size_t r = 1; r < counts.size(); ++r) displs[r] = displs[r - 1] + counts[r - 1] * scale;
  return displs;
}

std::vector<int> scaled(const std::vector<int>& counts, std::int64_t scale) {
  std::vector<int> out;
  for (const int c : counts) out.push_back(static_cast<int>(c * scale));
  return out;
}

void alltoallv(const void* send, const std::vector<int>& send_rows, void* recv,
               const std::vector<int>& recv_rows, std::int64_t row_bytes) {
  const std::vector<int> sc = scaled(send_rows, row_bytes), rc = scaled(recv_rows, row_bytes);
  MPI_Alltoallv(send, sc.data(), displs_of(send_rows, static_cast<int>(row_bytes)).data(), MPI_BYTE, recv,
                rc.data(), displs_of(recv_rows, static_cast<int>(row_bytes)).data(), MPI_BYTE, MPI_COMM_WORLD);
}

Baseline baseline_dispatch(const Options& o, const Inputs& in, int size) {
  Baseline b;
  const std::int64_t pairs = in.tokens * o.top_k, experts_per_rank = o.num_experts / size;
  const std::int64_t row_bytes = dtype_bytes(in.dtype, o.hidden);
  const Tensor expanded({in.dtype, {pairs, o.hidden}});
  b.row_idx.resize(static_cast<std::size_t>(pairs));
  std::vector<std::int32_t> send_counts(static_cast<std::size_t>(o.num_experts));
  InitRoutingAttributes init;
  init.expert_num = o.num_experts;
  init.expert_tokens_count_or_cumsum_flag = kExpertTokensCount;
  moe_init_routing({.x = {in.x.data(), in.dtype, {in.tokens, o.hidden}},
                    .expert_idx = {in.ids.data(), DType::kInt32, {in.tokens, o.top_k}}},
                   {.expanded_x = expanded.view(),
                    .expanded_row_idx = {b.row_idx.data(), DType::kInt32, {pairs}},
                    .expert_tokens_count_or_cumsum = {send_counts.data(), DType::kInt32, {o.num_experts}},
                    .expert_tokens_before_capacity = {nullptr, DType::kInt32, {0}}},
                   init, 1);
  // The scales and weights follow the rows (a fancy-index pack).
  const Tensor send_weights({DType::kFloat32, {pairs}}), send_scales({DType::kFloat32, {in.scales ? pairs : 0}});
  auto* w = static_cast<float*>(send_weights.data());
  auto* sc = static_cast<float*>(send_scales.data());
  for (std::int64_t p = 0; p < pairs; ++p) {
    const auto to = static_cast<std::size_t>(b.row_idx[static_cast<std::size_t>(p)]);
    w[to] = in.weights[static_cast<std::size_t>(p)];
    if (in.scales) sc[to] = in.per_token_scales[static_cast<std::size_t>(p / o.top_k)];
  }
  b.recv_counts.resize(send_counts.size());
  MPI_Alltoall(send_counts.data(), static_cast<int>(experts_per_rank), MPI_INT32_T, b.recv_counts.data(),
               static_cast<int>(experts_per_rank), MPI_INT32_T, MPI_COMM_WORLD);
  b.send_rows.assign(static_cast<std::size_t>(size), 0);
  b.recv_rows.assign(static_cast<std::size_t>(size), 0);
  for (std::size_t g = 0; g < send_counts.size(); ++g) {
    b.send_rows[g / static_cast<std::size_t>(experts_per_rank)] += send_counts[g];
    b.recv_rows[g / static_cast<std::size_t>(experts_per_rank)] += b.recv_counts[g];
  }
  for (const int rows : b.recv_rows) b.num_recv += rows;
  const Tensor recv({in.dtype, {b.num_recv, o.hidden}}), recv_weights({DType::kFloat32, {b.num_recv}}),
      recv_scales({DType::kFloat32, {in.scales ? b.num_recv : 0}});
  alltoallv(expanded.data(), b.send_rows, recv.data(), b.recv_rows, row_bytes);
  alltoallv(send_weights.data(), b.send_rows, recv_weights.data(), b.recv_rows, 4);
  if (in.scales) alltoallv(send_scales.data(), b.send_rows, recv_scales.data(), b.recv_rows, 4);

  RerouteInputs reroute{recv.view(), TensorView(b.recv_counts.data(), DType::kInt32, {size, experts_per_rank})};
  if (in.scales) reroute.per_token_scales = recv_scales.view();
  reroute.expert_topk_weight = recv_weights.view();
  const RerouteOutputSpecs specs = infer_reroute(reroute);
  ep::DispatchOutputs& out = b.outputs;
  out.permute_tokens = Tensor(specs.permute_tokens);
  out.permute_per_token_scales = Tensor(specs.permute_per_token_scales);
  out.permute_token_idx = Tensor(specs.permute_token_idx);
  out.expert_token_num = Tensor(specs.expert_token_num);
  out.permute_topk_weight = Tensor(specs.permute_topk_weight);
  moe_re_routing(reroute,
                 {out.permute_tokens.view(), out.permute_per_token_scales.view(), out.permute_token_idx.view(),
                  out.expert_token_num.view(), out.permute_topk_weight.view()},
                 {}, 1);
  return b;
}

Tensor baseline_combine(const Options& o, const Inputs& in, const Baseline& b, const TensorView& expert_out,
                        int size) {
  const std::int64_t pairs = in.tokens * o.top_k, hidden = expert_out.shape()[1];
  const std::int64_t row_bytes = expert_out.nbytes() / std::max<std::int64_t>(1, expert_out.shape()[0]);
  const Tensor restored({expert_out.dtype(), {b.num_recv, hidden}});
  InverseInputs inverse;
  inverse.tokens = expert_out;
  inverse.expert_token_num_per_rank =
      TensorView(b.recv_counts.data(), DType::kInt32, {size, o.num_experts / size});
  moe_re_routing_inverse(inverse, {.restored_tokens = restored.view()}, {}, 1);
  const Tensor returned({expert_out.dtype(), {pairs, hidden}});
  alltoallv(restored.data(), b.recv_rows, returned.data(), b.send_rows, row_bytes);
  Tensor out({expert_out.dtype(), {in.tokens, hidden}});
  FinalizeRoutingInputs finalize{.expanded_x = returned.view(),
                                 .expanded_row_idx = {b.row_idx.data(), DType::kInt32, {pairs}}};
  finalize.scales = TensorView(in.weights.data(), DType::kFloat32, {in.tokens, o.top_k});
  moe_finalize_routing(finalize, {.out = out.view()}, {kFinalizeRowMajor}, 1);
  return out;
}

bool same_bytes(const Tensor& a, const Tensor& b, std::int64_t rows) {
  const std::int64_t row_bytes = a.spec().shape[0] == 0 ? 0 : a.spec().nbytes() / a.spec().shape[0];
  return a.spec() == b.spec() &&
         std::memcmp(a.data(), b.data(), static_cast<std::size_t>(rows * row_bytes)) == 0;
}

// The slowest rank's seconds for `body`, started together.
double timed(const std::function<void()>& body) {
  MPI_Barrier(MPI_COMM_WORLD);
  double t = seconds(body);
  MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return t;
}

int run(const Options& o, int rank, int size) {
  const Inputs in = make_inputs(o, rank);
  const std::int64_t hidden = o.hidden;
  const ep::DispatchAttributes attributes{o.num_experts};

  // The check: the same bytes from both paths.
  ep::DispatchResult ours = ep::dispatch(MPI_COMM_WORLD, views(o, in), attributes, 1);
  const Baseline base = baseline_dispatch(o, in, size);
  const std::int64_t rows = ours.handle.num_rows();
  const Tensor expert_out({DType::kBFloat16, {rows, hidden}});
  testing::fill_random(expert_out.data(), static_cast<std::size_t>(expert_out.spec().nbytes()), o.seed);
  // bfloat16 values without NaN or infinity, so that sums compare as bytes.
  auto* bits = static_cast<std::uint16_t*>(expert_out.data());
  for (std::int64_t i = 0; i < rows * hidden; ++i) bits[i] = static_cast<std::uint16_t>(bits[i] & 0xBFFF);
  const ep::DispatchOutputs& a = ours.outputs;
  const ep::DispatchOutputs& b = base.outputs;
  int ok = same_bytes(a.permute_tokens, b.permute_tokens, rows) &&
           same_bytes(a.permute_per_token_scales, b.permute_per_token_scales, rows) &&
           same_bytes(a.permute_token_idx, b.permute_token_idx, rows) &&
           same_bytes(a.expert_token_num, b.expert_token_num, a.expert_token_num.spec().shape[0]) &&
           same_bytes(a.permute_topk_weight, b.permute_topk_weight, rows) &&
           same_bytes(ep::combine(expert_out.view(), ours.handle, 1),
                      baseline_combine(o, in, base, expert_out.view(), size), in.tokens);
  MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);

  // Each round: ours and the baseline, dispatch then combine, in alternating order.
  std::vector<double> t_ours[2], t_base[2];
  for (int round = 0; round < o.repeat; ++round) {
    for (int i = 0; i < 2; ++i) {
      if ((round + i) % 2 == 0) {
        std::optional<ep::DispatchResult> d;
        t_ours[0].push_back(timed([&] { d = ep::dispatch(MPI_COMM_WORLD, views(o, in), attributes, 1); }));
        t_ours[1].push_back(timed([&] { ep::combine(expert_out.view(), d->handle, 1); }));
      } else {
        std::optional<Baseline> d;
        t_base[0].push_back(timed([&] { d = baseline_dispatch(o, in, size); }));
        t_base[1].push_back(timed([&] { baseline_combine(o, in, *d, expert_out.view(), size); }));
      }
    }
  }
  if (rank == 0) {
    std::vector<double> both_ours, both_base;
    for (int r = 0; r < o.repeat; ++r) {
      both_ours.push_back(t_ours[0][static_cast<std::size_t>(r)] + t_ours[1][static_cast<std::size_t>(r)]);
      both_base.push_back(t_base[0][static_cast<std::size_t>(r)] + t_base[1][static_cast<std::size_t>(r)]);
    }
    const char* names[] = {"dispatch", "combine", "both"};
    const double m_ours[] = {median(t_ours[0]), median(t_ours[1]), median(both_ours)};
    const double m_base[] = {median(t_base[0]), median(t_base[1]), median(both_base)};
    std::printf("moe-reroute-ep-bench %s: %d ranks, T = %lld tokens each, top-%lld of %lld experts, %s H = %lld%s; "
                "combine bfloat16 H' = %lld; %d rounds, the slowest rank's time; %s\n",
                o.size.c_str(), size, static_cast<long long>(in.tokens), static_cast<long long>(o.top_k),
                static_cast<long long>(o.num_experts), std::string(dtype_name(in.dtype)).c_str(),
                static_cast<long long>(hidden), in.scales ? " with float32 scales" : "",
                static_cast<long long>(hidden), o.repeat, ok ? "verified" : "NOT verified");
    std::printf("%-10s %12s %12s %8s\n", "step", "ep_ms", "baseline_ms", "ratio");
    for (int s = 0; s < 3; ++s) {
      std::printf("%-10s %12.3f %12.3f %8.2f\n", names[s], m_ours[s] * 1e3, m_base[s] * 1e3, m_ours[s] / m_base[s]);
    }
  }
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace moe_reroute::bench

int main(int argc, char** argv) {
  // Both paths allocate their buffers every call. Freed memory stays with the
  // process, as with a caching allocator: otherwise each call's page faults on
  // fresh mappings cost more than its copies, by the allocator's history.
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  MPI_Init(&argc, &argv);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  moe_reroute::bench::Options o;
  CLI::App app("moe_reroute::ep dispatch and combine against the three-step baseline, under mpirun");
  app.add_option("--size", o.size, "prefill (int8 with float32 scales, 2048 tokens) or decode (bfloat16, 64 tokens)")
      ->check(CLI::IsMember({"prefill", "decode"}));
  app.add_option("--tokens", o.tokens, "tokens per rank (default: the size's)")->check(CLI::Range(1, 1 << 20));
  app.add_option("--hidden", o.hidden, "H of the tokens and of the expert outputs")->check(CLI::Range(1, 1 << 16));
  app.add_option("--top-k", o.top_k, "experts per token")->check(CLI::Range(1, 64));
  app.add_option("--experts", o.num_experts, "global experts, a multiple of the ranks")->check(CLI::Range(1, 1 << 16));
  app.add_option("--repeat", o.repeat, "timed rounds")->check(CLI::Range(1, 100000));
  app.add_option("--seed", o.seed, "seed of the inputs");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = rank == 0 ? app.exit(e) : e.get_exit_code();
    MPI_Finalize();
    return rc;
  }
  int rc = 0;
  try {
    rc = moe_reroute::bench::run(o, rank, size);
  } catch (const moe_reroute::Error& e) {
    std::fprintf(stderr, "moe-reroute-ep-bench: rank %d: %s\n", rank, e.what());
    rc = 2;
  }
  MPI_Finalize();
  return rc;
}
