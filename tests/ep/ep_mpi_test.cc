// moe_reroute::ep under mpirun against a single-process reference: every rank
// regenerates every rank's inputs, composes the naive references of
// moe_init_routing, the exchange and moe_re_routing (testing/), and compares
// its dispatch outputs byte for byte and its combine with the naive
// moe_finalize_routing bit for bit. `--errors`: bad input on one rank and on
// all ranks must throw on every rank (ctest's timeout fails a hang).

#include <mpi.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "moe_reroute/ep.h"
#include "reference.h"
#include "routing_reference.h"
#include "workload.h"

namespace {

namespace mr = moe_reroute;
namespace ep = moe_reroute::ep;
namespace mt = moe_reroute::testing;

enum class Routing { kUniform, kSkewed, kFirstRankNoTokens, kLastRankReceivesNothing };

struct Case {
  mr::DType token_dtype = mr::DType::kInt8;
  std::int64_t hidden = 16;
  std::int64_t tokens = 12;  // T per rank
  std::int64_t top_k = 3;
  std::int64_t experts_per_rank = 3;
  std::optional<mr::DType> scale_dtype;  // none: no per_token_scales
  std::vector<std::int64_t> scale_tail;  // {}, {S} or {K, 2}
  bool weights = true;
  mr::DType idx_dtype = mr::DType::kInt32;
  mr::Attributes attributes;  // allow_spare_rows: with capacity
  Routing routing = Routing::kUniform;
  std::uint64_t seed = 1;

  std::string name() const {
    return std::string(mr::dtype_name(token_dtype)) + " H=" + std::to_string(hidden) +
           " scales=" + (scale_dtype ? std::string(mr::dtype_name(*scale_dtype)) + "/" + std::to_string(scale_tail.size() + 1) + "d" : "none") +
           " weights=" + std::to_string(weights) + " idx=" + std::string(mr::dtype_name(idx_dtype)) +
           " idx_type=" + std::to_string(attributes.idx_type) +
           " count_type=" + std::to_string(attributes.expert_token_num_type) +
           " align=" + std::to_string(attributes.expert_alignment) +
           " capacity=" + std::to_string(attributes.allow_spare_rows) +
           " routing=" + std::to_string(static_cast<int>(routing));
  }
};

// One rank's inputs, a function of the case and the rank alone.
struct RankInputs {
  std::int64_t tokens = 0;
  std::vector<std::byte> x;
  std::vector<std::int64_t> ids;  // [T * k]
  std::vector<std::byte> idx;     // ids in the case's index dtype
  std::vector<float> weights;
  std::vector<std::byte> scales;
  std::int64_t row_bytes = 0, scale_row_bytes = 0;
};

RankInputs make_inputs(const Case& c, int num_ranks, int rank) {
  RankInputs in;
  std::mt19937_64 rng(c.seed * 1000003 + static_cast<std::uint64_t>(rank));
  in.tokens = c.routing == Routing::kFirstRankNoTokens && rank == 0 ? 0 : c.tokens;
  in.row_bytes = mr::dtype_bytes(c.token_dtype, c.hidden);
  in.x.resize(static_cast<std::size_t>(in.tokens * in.row_bytes));
  mt::fill_random(in.x.data(), in.x.size(), rng());
  const std::int64_t experts = num_ranks * c.experts_per_rank;
  // The last rank's experts get nothing when it must receive nothing.
  const std::int64_t chosen = c.routing == Routing::kLastRankReceivesNothing ? experts - c.experts_per_rank : experts;
  std::uniform_int_distribution<std::int64_t> any(0, chosen - 1);
  for (std::int64_t p = 0; p < in.tokens * c.top_k; ++p) {
    std::int64_t id = any(rng);
    if (c.routing == Routing::kSkewed && rng() % 4 != 0) id = id % 2;  // mostly experts 0 and 1
    in.ids.push_back(id);
    if (c.idx_dtype == mr::DType::kInt32) {
      const auto v = static_cast<std::int32_t>(id);
      in.idx.insert(in.idx.end(), reinterpret_cast<const std::byte*>(&v), reinterpret_cast<const std::byte*>(&v) + 4);
    } else {
      in.idx.insert(in.idx.end(), reinterpret_cast<const std::byte*>(&id), reinterpret_cast<const std::byte*>(&id) + 8);
    }
    // Weights of every sign and magnitude, as float32 bit patterns that are finite.
    in.weights.push_back(std::ldexp(static_cast<float>(static_cast<std::int64_t>(rng() % 2001) - 1000) / 997.0f,
                                    static_cast<int>(rng() % 7) - 3));
  }
  if (c.scale_dtype) {
    std::int64_t per_row = 1;
    for (const std::int64_t d : c.scale_tail) per_row *= d;
    in.scale_row_bytes = mr::dtype_bytes(*c.scale_dtype, per_row);
    in.scales.resize(static_cast<std::size_t>(in.tokens * in.scale_row_bytes));
    mt::fill_random(in.scales.data(), in.scales.size(), rng());
  }
  return in;
}

ep::DispatchInputs views(const Case& c, const RankInputs& in) {
  ep::DispatchInputs v{.x = {in.x.data(), c.token_dtype, {in.tokens, c.hidden}},
                       .expert_idx = {in.idx.data(), c.idx_dtype, {in.tokens, c.top_k}}};
  if (c.weights) v.expert_scales = mr::TensorView(in.weights.data(), mr::DType::kFloat32, {in.tokens, c.top_k});
  if (c.scale_dtype) {
    std::vector<std::int64_t> dims = {in.tokens};
    dims.insert(dims.end(), c.scale_tail.begin(), c.scale_tail.end());
    v.per_token_scales = mr::TensorView(in.scales.data(), *c.scale_dtype, mr::Shape(dims));
  }
  return v;
}

std::int64_t capacity_of(const Case& c, int num_ranks) {
  return c.attributes.allow_spare_rows ? num_ranks * c.tokens * c.top_k + 5 : -1;
}

// The naive sort of one rank's pairs: each sorted position's token row, and the
// row index moe_init_routing gives.
mt::InitReferenceOutputs sorted_rows(const Case& c, const RankInputs& in, std::int64_t num_experts) {
  mt::InitReferenceInputs init;
  init.x = in.x.data();
  init.num_tokens = in.tokens;
  init.row_bytes = in.row_bytes;
  init.expert_idx = in.ids;
  init.top_k = c.top_k;
  init.expert_num = num_experts;
  init.count_or_cumsum_flag = 2;
  return mt::reference_init_routing(init);
}

std::vector<std::string> failures;
std::size_t num_error_checks = 0;

void expect(bool ok, const std::string& what) {
  if (!ok) failures.push_back(what);
}

void expect_bytes(const std::string& name, const void* got, const std::vector<std::byte>& want,
                  std::size_t bytes) {
  // memcmp of 0 bytes may still not take a null pointer (an empty output's data).
  if (want.size() < bytes || (bytes > 0 && std::memcmp(got, want.data(), bytes) != 0)) {
    failures.push_back(name + ": differs from the reference");
  }
}

// expert_out from permute_tokens: for float tokens the identity on finite
// values (the exponent's top bit cleared, as NaN payloads are no part of the
// sum's contract), else float32 [R, 5] of the row's bytes; the same map of a
// sorted x row gives the reference's rows.
struct ExpertMap {
  mr::DType dtype;
  std::int64_t hidden;
  std::vector<std::byte> rows(const std::byte* tokens, std::int64_t num_rows, std::int64_t row_bytes) const {
    if (dtype != mr::DType::kFloat32 || hidden == row_bytes / 4) {
      std::vector<std::byte> out(tokens, tokens + num_rows * row_bytes);
      const std::size_t element = dtype == mr::DType::kFloat32 ? 4 : 2;
      for (std::size_t i = element - 1; i < out.size(); i += element) out[i] &= std::byte{0xBF};
      return out;
    }
    std::vector<std::byte> out(static_cast<std::size_t>(num_rows * hidden * 4));
    for (std::int64_t r = 0; r < num_rows; ++r) {
      for (std::int64_t h = 0; h < hidden; ++h) {
        const float v = static_cast<float>(std::to_integer<int>(tokens[r * row_bytes + h % row_bytes])) - 100.0f + 0.25f * h;
        std::memcpy(&out[static_cast<std::size_t>((r * hidden + h) * 4)], &v, 4);
      }
    }
    return out;
  }
};

mt::FloatType float_type(mr::DType dtype) {
  return dtype == mr::DType::kFloat16 ? mt::FloatType::kFloat16
         : dtype == mr::DType::kBFloat16 ? mt::FloatType::kBFloat16 : mt::FloatType::kFloat32;
}

void run_case(const Case& c, MPI_Comm comm, int rank, int num_ranks) {
  const std::int64_t experts = num_ranks * c.experts_per_rank;
  std::vector<RankInputs> all;
  std::vector<mt::InitReferenceOutputs> sorted;
  for (int r = 0; r < num_ranks; ++r) {
    all.push_back(make_inputs(c, num_ranks, r));
    sorted.push_back(sorted_rows(c, all.back(), experts));
  }
  const RankInputs& mine = all[static_cast<std::size_t>(rank)];
  ep::DispatchAttributes attributes{experts, c.attributes.expert_token_num_type, c.attributes.idx_type,
                                    c.attributes.expert_alignment, capacity_of(c, num_ranks)};
  ep::DispatchResult result = ep::dispatch(comm, views(c, mine), attributes, 1 + rank % 2);

  // What arrives here: each source rank's pairs for this rank's experts, in sorted order.
  mt::ReferenceInputs ref;
  ref.num_ranks = num_ranks;
  ref.num_experts = c.experts_per_rank;
  std::vector<std::byte> tokens, scales, weight;
  for (int s = 0; s < num_ranks; ++s) {
    const RankInputs& in = all[static_cast<std::size_t>(s)];
    const mt::InitReferenceOutputs& so = sorted[static_cast<std::size_t>(s)];
    std::vector<std::int64_t> pair_at(static_cast<std::size_t>(in.tokens * c.top_k));
    for (std::size_t p = 0; p < pair_at.size(); ++p) pair_at[static_cast<std::size_t>(so.expanded_row_idx[p])] = static_cast<std::int64_t>(p);
    std::int64_t position = 0;
    for (std::int64_t g = 0; g < experts; ++g) {
      const std::int64_t count = so.count_or_cumsum[static_cast<std::size_t>(g)];
      if (g / c.experts_per_rank == rank) {
        ref.counts.push_back(count);
        for (std::int64_t i = position; i < position + count; ++i) {
          const std::int64_t pair = pair_at[static_cast<std::size_t>(i)], token = pair / c.top_k;
          tokens.insert(tokens.end(), so.expanded_x.begin() + i * in.row_bytes, so.expanded_x.begin() + (i + 1) * in.row_bytes);
          scales.insert(scales.end(), in.scales.begin() + token * in.scale_row_bytes, in.scales.begin() + (token + 1) * in.scale_row_bytes);
          const auto* w = reinterpret_cast<const std::byte*>(&in.weights[static_cast<std::size_t>(pair)]);
          weight.insert(weight.end(), w, w + 4);
        }
      }
      position += count;
    }
  }
  const std::int64_t received = static_cast<std::int64_t>(tokens.size()) / mine.row_bytes;
  const std::int64_t capacity = capacity_of(c, num_ranks);
  // Spare rows up to the capacity: the contract never reads them.
  tokens.resize(static_cast<std::size_t>((capacity >= 0 ? capacity : received) * mine.row_bytes));
  scales.resize(static_cast<std::size_t>((capacity >= 0 ? capacity : received) * mine.scale_row_bytes));
  weight.resize(static_cast<std::size_t>((capacity >= 0 ? capacity : received) * 4));
  ref.tokens = tokens.data();
  ref.token_row_bytes = mine.row_bytes;
  ref.scales = c.scale_dtype ? scales.data() : nullptr;
  ref.scale_row_bytes = mine.scale_row_bytes;
  ref.weight = c.weights ? weight.data() : nullptr;
  ref.num_tokens = capacity;
  ref.expert_alignment = c.attributes.expert_alignment;
  const mt::ReferenceOutputs want = mt::reference_reroute(ref, c.attributes.expert_token_num_type, c.attributes.idx_type);

  const ep::DispatchOutputs& got = result.outputs;
  const std::string at = "rank " + std::to_string(rank) + ", " + c.name() + ": ";
  const std::int64_t rows = want.specified_rows;
  expect(got.permute_tokens.spec().nbytes() == static_cast<std::int64_t>(want.tokens.size()), at + "permute_tokens: shape");
  expect_bytes(at + "permute_tokens", got.permute_tokens.data(), want.tokens, static_cast<std::size_t>(rows * mine.row_bytes));
  const std::int64_t scale_row = c.scale_dtype ? mine.scale_row_bytes : 4;
  expect(got.permute_per_token_scales.spec().nbytes() == static_cast<std::int64_t>(want.scales.size()), at + "permute_per_token_scales: shape");
  expect_bytes(at + "permute_per_token_scales", got.permute_per_token_scales.data(), want.scales, static_cast<std::size_t>(rows * scale_row));
  expect(got.permute_topk_weight.spec().nbytes() == static_cast<std::int64_t>(want.weight.size()), at + "permute_topk_weight: shape");
  expect_bytes(at + "permute_topk_weight", got.permute_topk_weight.data(), want.weight, static_cast<std::size_t>(c.weights ? rows * 4 : 0));
  const auto* idx = static_cast<const std::int32_t*>(got.permute_token_idx.data());
  expect(std::vector<std::int32_t>(idx, idx + got.permute_token_idx.spec().shape.numel()) == want.token_idx, at + "permute_token_idx");
  const auto* num = static_cast<const std::int32_t*>(got.expert_token_num.data());
  expect(std::vector<std::int64_t>(num, num + c.experts_per_rank) == want.expert_token_num, at + "expert_token_num");
  const auto* per_rank = static_cast<const std::int32_t*>(got.expert_token_num_per_rank.data());
  expect(std::vector<std::int64_t>(per_rank, per_rank + num_ranks * c.experts_per_rank) == ref.counts, at + "expert_token_num_per_rank");

  // combine of the expert map of permute_tokens against the naive weighted sum.
  const bool floats = c.token_dtype == mr::DType::kFloat16 || c.token_dtype == mr::DType::kBFloat16 || c.token_dtype == mr::DType::kFloat32;
  const ExpertMap map{floats ? c.token_dtype : mr::DType::kFloat32, floats ? c.hidden : 5};
  const std::int64_t num_rows = got.permute_tokens.spec().shape[0];
  const std::vector<std::byte> expert_out = map.rows(static_cast<const std::byte*>(got.permute_tokens.data()), num_rows, mine.row_bytes);
  const ep::Tensor out = ep::combine(mr::TensorView(expert_out.data(), map.dtype, {num_rows, map.hidden}), result.handle, 1 + rank % 2);
  const mt::InitReferenceOutputs& so = sorted[static_cast<std::size_t>(rank)];
  const std::vector<std::byte> expanded = map.rows(so.expanded_x.data(), mine.tokens * c.top_k, mine.row_bytes);
  mt::FinalizeReferenceInputs fin;
  fin.dtype = float_type(map.dtype);
  fin.num_tokens = mine.tokens;
  fin.top_k = c.top_k;
  fin.hidden = map.hidden;
  fin.drop_pad_mode = 2;
  fin.expanded_x = expanded.data();
  fin.expanded_rows = mine.tokens * c.top_k;
  fin.expanded_row_idx = so.expanded_row_idx.data();
  if (c.weights) fin.scales = mine.weights.data();
  const std::vector<std::byte> sum = mt::reference_finalize_routing(fin);
  expect(out.spec().nbytes() == static_cast<std::int64_t>(sum.size()), at + "combine: shape");
  expect_bytes(at + "combine", out.data(), sum, sum.size());
}

std::vector<Case> cases() {
  struct Form {
    std::optional<mr::DType> dtype;
    std::vector<std::int64_t> tail;
  };
  const mr::DType f32 = mr::DType::kFloat32, e8m0 = mr::DType::kFloat8E8M0;
  std::vector<Case> list;
  std::uint64_t seed = 1;
  for (const mr::DTypeInfo& info : mr::dtype_table()) {
    if (!(info.roles & mr::kRoleToken)) continue;
    std::vector<Form> forms = {{std::nullopt, {}}, {f32, {}}, {f32, {3}}};
    if (info.dtype == mr::DType::kFloat8E5M2 || info.dtype == mr::DType::kFloat8E4M3FN) {
      forms.push_back({e8m0, {2, 2}});
      forms.push_back({f32, {2, 2}});
    }
    if (info.bits < 8 || info.dtype == mr::DType::kFloat8E4M3FN) forms.push_back({e8m0, {4}});
    for (int v = 0; v < 4; ++v) {
      Case c;
      c.token_dtype = info.dtype;
      c.hidden = 8 + 2 * v;
      const Form& form = forms[static_cast<std::size_t>(v + seed) % forms.size()];
      c.scale_dtype = form.dtype;
      c.scale_tail = form.tail;
      c.weights = v % 2 == 0;
      c.idx_dtype = seed % 3 == 0 ? mr::DType::kInt64 : mr::DType::kInt32;
      c.attributes.idx_type = (seed / 2) % 2;
      c.attributes.expert_token_num_type = (seed / 5) % 2;
      if (v == 3 || seed % 5 == 0) {
        c.attributes.expert_alignment = 4;
        c.attributes.allow_spare_rows = true;
      }
      c.routing = static_cast<Routing>((v + seed) % 4);
      c.top_k = 1 + static_cast<std::int64_t>(seed % 4);
      c.seed = seed++;
      list.push_back(c);
    }
  }
  return list;
}

// Calls `body` expecting Error on this rank whose message contains `want`.
void expect_error(const std::string& name, const std::string& want, const std::function<void()>& body, int rank) {
  ++num_error_checks;
  try {
    body();
    failures.push_back("rank " + std::to_string(rank) + ", " + name + ": no error");
  } catch (const mr::Error& error) {
    if (std::string(error.what()).find(want) == std::string::npos) {
      failures.push_back("rank " + std::to_string(rank) + ", " + name + ": got \"" + error.what() + "\", expected \"" + want + "\"");
    }
  }
}

void run_errors(MPI_Comm comm, int rank, int num_ranks) {
  Case c;
  c.seed = 77;
  const std::int64_t experts = num_ranks * c.experts_per_rank;
  RankInputs in = make_inputs(c, num_ranks, rank);
  const ep::DispatchAttributes good{experts};
  const std::string refused_by_1 = "dispatch: rank 1 refused its arguments";

  RankInputs bad_id = in;
  if (rank == 1) reinterpret_cast<std::int32_t*>(bad_id.idx.data())[4] = static_cast<std::int32_t>(experts);
  expect_error("an expert id out of range on rank 1",
               rank == 1 ? "expert_idx: [1, 1] = " + std::to_string(experts) + " is not below" : refused_by_1,
               [&] { ep::dispatch(comm, views(c, bad_id), good, 1); }, rank);

  expect_error("num_experts not a multiple of the ranks, on all ranks", "num_experts: must be a positive multiple",
               [&] { ep::dispatch(comm, views(c, in), {experts + 1}, 1); }, rank);

  Case wide = c;
  if (rank == num_ranks - 1) wide.hidden = c.hidden + 2;
  const RankInputs wide_in = make_inputs(wide, num_ranks, rank);
  expect_error("H differs on the last rank", "x: H differs across ranks",
               [&] { ep::dispatch(comm, views(wide, wide_in), good, 1); }, rank);

  ep::DispatchInputs int_weights = views(c, in);
  if (rank == 1) int_weights.expert_scales->spec.dtype = mr::DType::kInt32;
  expect_error("expert_scales of int32 on rank 1", rank == 1 ? "expert_scales: must be float32" : refused_by_1,
               [&] { ep::dispatch(comm, int_weights, good, 1); }, rank);

  const mr::Error adapter_error(mr::ErrorCode::kUnsupported, "x: dtype float64 is not supported");
  expect_error("refuse_dispatch on rank 1", rank == 1 ? "x: dtype float64" : refused_by_1, [&] {
    if (rank == 1) ep::refuse_dispatch(comm, adapter_error);
    ep::dispatch(comm, views(c, in), good, 1);
  }, rank);

  // Every pair to expert 0: rank 0 receives N * T * k rows, past a capacity of T * k.
  RankInputs to_zero = in;
  std::fill(to_zero.idx.begin(), to_zero.idx.end(), std::byte{0});
  expect_error("capacity exceeded on rank 0",
               rank == 0 ? "capacity: rank 0 receives " + std::to_string(num_ranks * c.tokens * c.top_k) + " rows, more than capacity = " + std::to_string(c.tokens * c.top_k)
                         : "dispatch: rank 0 refused its arguments",
               [&] { ep::dispatch(comm, views(c, to_zero), {experts, 1, 0, 1, c.tokens * c.top_k}, 1); }, rank);

  ep::DispatchResult result = ep::dispatch(comm, views(c, in), good, 1);
  const std::int64_t rows = result.handle.num_rows();
  std::vector<float> expert_out(static_cast<std::size_t>(rows + 1) * 4);
  expect_error("expert_out with a row too many on rank 1",
               rank == 1 ? "expert_out: must be [R, H'] with R = " + std::to_string(rows) : "combine: rank 1 refused its arguments",
               [&] { ep::combine(mr::TensorView(expert_out.data(), mr::DType::kFloat32, {rank == 1 ? rows + 1 : rows, 4}), result.handle, 1); }, rank);
  const mr::Error combine_error(mr::ErrorCode::kUnsupported, "expert_out: dtype float64 is not supported");
  expect_error("refuse_combine on rank 0",
               rank == 0 ? "expert_out: dtype float64" : "combine: rank 0 refused its arguments", [&] {
    if (rank == 0) ep::refuse_combine(result.handle, combine_error);
    ep::combine(mr::TensorView(expert_out.data(), mr::DType::kFloat32, {rows, 4}), result.handle, 1);
  }, rank);
  expect_error("expert_out int8 on all ranks", "expert_out: dtype int8 is not float16, bfloat16 or float32",
               [&] { ep::combine(mr::TensorView(expert_out.data(), mr::DType::kInt8, {rows, 4}), result.handle, 1); }, rank);
  // After every refusal the communicator still works.
  const ep::Tensor out = ep::combine(mr::TensorView(expert_out.data(), mr::DType::kFloat32, {rows, 4}), result.handle, 1);
  expect(out.spec().shape == mr::Shape({c.tokens, 4}), "rank " + std::to_string(rank) + ": combine after the refusals");
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, num_ranks = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &num_ranks);
  const bool errors = argc > 1 && std::string(argv[1]) == "--errors";
  std::size_t num_cases = 0;
  try {
    if (errors) {
      run_errors(MPI_COMM_WORLD, rank, num_ranks);
      num_cases = num_error_checks;
    } else {
      const std::vector<Case> list = cases();
      num_cases = list.size();
      for (const Case& c : list) run_case(c, MPI_COMM_WORLD, rank, num_ranks);
    }
  } catch (const mr::Error& error) {
    std::fprintf(stderr, "rank %d: unexpected error: %s\n", rank, error.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  for (const std::string& f : failures) std::fprintf(stderr, "%s\n", f.c_str());
  int failed = failures.empty() ? 0 : 1;
  MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0 && failed == 0) {
    std::printf("ep_mpi_test: %zu %s passed on %d ranks\n", num_cases, errors ? "error checks" : "cases", num_ranks);
  }
  MPI_Finalize();
  return failed;
}
