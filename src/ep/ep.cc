// Expert-parallel dispatch and combine over MPI: local validation, one
// bounded agreement, the core's sort by expert, the counts in one Alltoall,
// then one MPI_Alltoallw whose hindexed datatypes take each row from where it
// is read to where it is read next (docs/spec.md section 11).

#include "moe_reroute/ep.h"

#include <climits>
#include <cstring>
#include <span>
#include <string>
#include <utility>

#include "cpu/copy.h"
#include "moe_reroute/routing.h"

namespace moe_reroute::ep {
namespace {

std::string str(std::int64_t value) { return std::to_string(value); }

[[noreturn]] void fail(ErrorCode code, const std::string& message) { throw Error(code, message); }

void check_mpi(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(rc, text, &length);
  fail(ErrorCode::kBackend, std::string("mpi: ") + call + ": " + std::string(text, static_cast<std::size_t>(length)));
}

void check_data(const TensorView& view, const char* name) {
  if (view.data == nullptr && view.nbytes() > 0) {
    fail(ErrorCode::kInvalidArgument, std::string(name) + ": data is null");
  }
}

// Named values every rank must pass alike.
struct Agreed {
  const char* name;
  std::int64_t value;
};

// The bounded agreement: one MPI_Allreduce in which every rank learns the
// lowest rank whose arguments failed (and its error code), and whether the
// `agreed` values differ between ranks. Throws on every rank when either
// happened: the failing rank its own error, the others an error naming it.
void agree(MPI_Comm comm, const char* step, const std::optional<Error>& local,
           std::span<const Agreed> agreed) {
  int rank = 0, size = 0;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  const std::size_t n = agreed.size();
  // [0]: (size - rank) << 8 | (code + 1), so the maximum is the lowest failing
  // rank; then each value and its negation, whose maxima are max and -min.
  std::vector<std::int64_t> word(1 + 2 * n, 0);
  if (local) word[0] = (std::int64_t{size - rank} << 8) | (static_cast<std::int64_t>(local->code()) + 1);
  for (std::size_t i = 0; i < n; ++i) {
    word[1 + i] = agreed[i].value;
    word[1 + n + i] = -agreed[i].value;
  }
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, word.data(), static_cast<int>(word.size()), MPI_INT64_T,
                          MPI_MAX, comm),
            "MPI_Allreduce");
  if (word[0] != 0) {
    if (local) throw *local;
    const std::int64_t failed = size - (word[0] >> 8);
    fail(static_cast<ErrorCode>((word[0] & 0xff) - 1),
         std::string(step) + ": rank " + str(failed) +
             " refused its arguments (its error names the argument); nothing was sent");
  }
  for (std::size_t i = 0; i < n; ++i) {
    const std::int64_t max = word[1 + i], min = -word[1 + n + i];
    if (max != min) {
      fail(ErrorCode::kInvalidArgument, std::string(agreed[i].name) + " differs across ranks (" +
                                            str(min) + " to " + str(max) +
                                            "); every rank must pass the same");
    }
  }
}

// The values each call's agreement compares; a refusal (refuse_dispatch,
// refuse_combine) reduces as many, so that its MPI_Allreduce matches.
constexpr std::size_t kDispatchAgreed = 12;
constexpr std::size_t kCombineAgreed = 2;

// Joins the agreement of `step` with `error`: throws on every rank.
[[noreturn]] void refuse(MPI_Comm comm, const char* step, const Error& error,
                         std::span<const Agreed> agreed) {
  agree(comm, step, error, agreed);
  throw error;  // not reached: agree throws the local error
}

// Owns committed datatypes (one per peer) and frees them.
class Datatypes {
 public:
  explicit Datatypes(int size) : types_(static_cast<std::size_t>(size), MPI_BYTE), counts_(types_.size(), 0) {}
  Datatypes(const Datatypes&) = delete;
  Datatypes& operator=(const Datatypes&) = delete;
  ~Datatypes() {
    for (MPI_Datatype& type : types_) {
      if (type != MPI_BYTE) MPI_Type_free(&type);
    }
  }

  // Peer `peer`'s rows: for each part (tokens, scales, weights), `blocks`
  // runs of rows at absolute addresses; one struct type over all parts.
  struct Part {
    std::int64_t row_bytes;
    std::vector<MPI_Aint> address;  // of each block's first row
    std::vector<int> rows;          // of each block
  };
  void set(int peer, std::span<const Part> parts) {
    std::vector<MPI_Datatype> members;
    for (const Part& part : parts) {
      if (part.row_bytes == 0 || part.rows.empty()) continue;
      MPI_Datatype row = MPI_DATATYPE_NULL, blocks = MPI_DATATYPE_NULL;
      check_mpi(MPI_Type_contiguous(static_cast<int>(part.row_bytes), MPI_BYTE, &row), "MPI_Type_contiguous");
      check_mpi(MPI_Type_create_hindexed(static_cast<int>(part.rows.size()), part.rows.data(),
                                         part.address.data(), row, &blocks),
                "MPI_Type_create_hindexed");
      MPI_Type_free(&row);
      members.push_back(blocks);
    }
    if (members.empty()) return;
    const std::vector<int> ones(members.size(), 1);
    const std::vector<MPI_Aint> zeros(members.size(), 0);
    MPI_Datatype& type = types_[static_cast<std::size_t>(peer)];
    check_mpi(MPI_Type_create_struct(static_cast<int>(members.size()), ones.data(), zeros.data(),
                                     members.data(), &type),
              "MPI_Type_create_struct");
    for (MPI_Datatype& member : members) MPI_Type_free(&member);
    check_mpi(MPI_Type_commit(&type), "MPI_Type_commit");
    counts_[static_cast<std::size_t>(peer)] = 1;
  }

  const int* counts() const { return counts_.data(); }
  const MPI_Datatype* types() const { return types_.data(); }

 private:
  std::vector<MPI_Datatype> types_;
  std::vector<int> counts_;
};

// Both sides of one exchange at absolute addresses (MPI_BOTTOM).
void alltoallw(MPI_Comm comm, const Datatypes& send, const Datatypes& recv, int size) {
  const std::vector<int> displs(static_cast<std::size_t>(size), 0);
  check_mpi(MPI_Alltoallw(MPI_BOTTOM, send.counts(), displs.data(), send.types(), MPI_BOTTOM,
                          recv.counts(), displs.data(), recv.types(), comm),
            "MPI_Alltoallw");
}

MPI_Aint address_of(const void* base, std::int64_t offset) {
  MPI_Aint address = 0;
  MPI_Get_address(static_cast<const std::byte*>(base) + offset, &address);
  return address;
}

// Bytes of one row (everything past dim 0), also of a view with no rows.
std::int64_t row_bytes_of(const TensorSpec& spec) {
  std::int64_t elements = 1;
  for (int d = 1; d < spec.shape.ndim; ++d) elements *= spec.shape[d];
  return dtype_bytes(spec.dtype, elements);
}

// Refuses rows MPI's int counts cannot describe.
void check_int_bytes(std::int64_t bytes, const char* name) {
  if (bytes > INT_MAX) {
    fail(ErrorCode::kOutOfRange,
         std::string(name) + ": rows of " + str(bytes) + " bytes exceed MPI's int count limit");
  }
}

}  // namespace

Tensor::Tensor(const TensorSpec& spec)
    : spec_(spec), data_(std::make_unique_for_overwrite<std::byte[]>(static_cast<std::size_t>(spec.nbytes()))) {}

namespace {

// The sender's side, from the core's moe_init_routing: the sorted position of
// each pair and the pairs per global expert.
struct SortedPairs {
  std::vector<std::int32_t> row_idx;     // [T * k]
  std::vector<std::int32_t> order;       // [T * k]: the pair at each sorted position
  std::vector<std::int32_t> per_expert;  // [num_experts]
};

SortedPairs sort_pairs(const DispatchInputs& inputs, std::int64_t num_experts, int num_threads) {
  const std::int64_t tokens = inputs.x.shape()[0], top_k = inputs.expert_idx.shape()[1];
  const std::int64_t pairs = tokens * top_k;
  SortedPairs sorted;
  sorted.row_idx.resize(static_cast<std::size_t>(pairs));
  sorted.per_expert.resize(static_cast<std::size_t>(num_experts));
  // The core's sort on a one-byte view of each token: the order alone, not the rows.
  std::vector<std::uint8_t> token_byte(static_cast<std::size_t>(tokens)), pair_byte(sorted.row_idx.size());
  InitRoutingAttributes init;
  init.expert_num = num_experts;
  init.expert_tokens_count_or_cumsum_flag = kExpertTokensCount;
  moe_init_routing({.x = {token_byte.data(), DType::kUInt8, {tokens, 1}}, .expert_idx = inputs.expert_idx},
                   {.expanded_x = {pair_byte.data(), DType::kUInt8, {pairs, 1}},
                    .expanded_row_idx = {sorted.row_idx.data(), DType::kInt32, {pairs}},
                    .expert_tokens_count_or_cumsum = {sorted.per_expert.data(), DType::kInt32, {num_experts}},
                    .expert_tokens_before_capacity = {nullptr, DType::kInt32, {0}}},
                   init, num_threads);
  sorted.order.resize(sorted.row_idx.size());
  for (std::size_t p = 0; p < sorted.row_idx.size(); ++p) {
    sorted.order[static_cast<std::size_t>(sorted.row_idx[p])] = static_cast<std::int32_t>(p);
  }
  return sorted;
}

// Every check one rank can make alone; throws Error naming the argument.
void validate(const DispatchInputs& inputs, const DispatchAttributes& attributes, int size) {
  const std::int64_t num_experts = attributes.num_experts;
  if (num_experts < 1 || num_experts % size != 0) {
    fail(ErrorCode::kInvalidArgument, "num_experts: must be a positive multiple of the " +
                                          str(size) + " ranks of comm, got " + str(num_experts));
  }
  if (attributes.capacity < -1) {
    fail(ErrorCode::kInvalidArgument,
         "capacity: must be >= 0 (or -1: the rows received), got " + str(attributes.capacity));
  }
  InitRoutingAttributes init;
  init.expert_num = num_experts;
  init.expert_tokens_count_or_cumsum_flag = kExpertTokensCount;
  infer_init_routing({inputs.x, inputs.expert_idx}, init);
  const std::int64_t tokens = inputs.x.shape()[0], top_k = inputs.expert_idx.shape()[1];
  if (inputs.expert_scales) {
    const TensorView& weights = *inputs.expert_scales;
    if (weights.dtype() != DType::kFloat32 || !(weights.shape() == Shape{tokens, top_k})) {
      fail(ErrorCode::kInvalidArgument, "expert_scales: must be float32 [T, k] = " +
                                            Shape{tokens, top_k}.to_string() + ", got " +
                                            weights.spec.to_string());
    }
    check_data(weights, "expert_scales");
  }
  // moe_re_routing's rules on the scales' form and the attributes, on the
  // shapes the receiver will have.
  const std::int64_t experts_per_rank = num_experts / size;
  const Attributes reroute{attributes.expert_token_num_type, attributes.idx_type,
                           attributes.expert_alignment, attributes.capacity >= 0};
  infer_reroute({TensorView(nullptr, inputs.x.dtype(), inputs.x.shape()),
                 TensorView(nullptr, DType::kInt32, {size, experts_per_rank}), inputs.per_token_scales},
                reroute);
  check_data(inputs.x, "x");
  if (inputs.per_token_scales) check_data(*inputs.per_token_scales, "per_token_scales");
  check_int_bytes(row_bytes_of(inputs.x.spec), "x");
}

}  // namespace

DispatchResult dispatch(MPI_Comm comm, const DispatchInputs& inputs,
                        const DispatchAttributes& attributes, int num_threads) {
  int rank = 0, size = 0;
  check_mpi(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(comm, &size), "MPI_Comm_size");

  SortedPairs sorted;
  std::optional<Error> local;
  try {
    validate(inputs, attributes, size);
    sorted = sort_pairs(inputs, attributes.num_experts, num_threads);
  } catch (const Error& error) {
    local = error;
  }
  const std::optional<TensorView>& scales = inputs.per_token_scales;
  const Shape& scale_shape = scales ? scales->shape() : Shape{};
  const Agreed agreed[kDispatchAgreed] = {
      {"num_experts", attributes.num_experts},
      {"x: dtype", static_cast<std::int64_t>(inputs.x.dtype())},
      {"x: H", inputs.x.shape()[1]},
      {"expert_scales: presence", inputs.expert_scales.has_value()},
      {"per_token_scales: dtype", scales ? static_cast<std::int64_t>(scales->dtype()) : -1},
      {"per_token_scales: dims", scale_shape.ndim},
      {"per_token_scales: dim 1", scale_shape.ndim > 1 ? scale_shape[1] : 0},
      {"per_token_scales: dim 2", scale_shape.ndim > 2 ? scale_shape[2] : 0},
      {"expert_token_num_type", attributes.expert_token_num_type},
      {"idx_type", attributes.idx_type},
      {"expert_alignment", attributes.expert_alignment},
      {"capacity", attributes.capacity}};
  agree(comm, "dispatch", local, agreed);

  const std::int64_t experts_per_rank = attributes.num_experts / size;
  const auto num_blocks = static_cast<std::size_t>(attributes.num_experts);
  std::vector<std::int32_t> recv_counts(num_blocks);
  check_mpi(MPI_Alltoall(sorted.per_expert.data(), static_cast<int>(experts_per_rank), MPI_INT32_T,
                         recv_counts.data(), static_cast<int>(experts_per_rank), MPI_INT32_T, comm),
            "MPI_Alltoall");

  // The receiver's layout is moe_re_routing's plan for these counts, made on
  // views without data: A rows of x's row and of the scales' row.
  std::int64_t received = 0;
  for (const std::int32_t count : recv_counts) received += count;
  const std::int64_t num_recv = attributes.capacity >= 0 ? attributes.capacity : received;
  const auto with_rows = [&](const TensorView& view) {
    Shape shape = view.shape();
    shape.dims[0] = num_recv;
    return TensorView(nullptr, view.dtype(), shape);
  };
  const Attributes reroute{attributes.expert_token_num_type, attributes.idx_type,
                           attributes.expert_alignment, attributes.capacity >= 0};
  RerouteInputs recv_inputs{with_rows(inputs.x),
                            TensorView(recv_counts.data(), DType::kInt32, {size, experts_per_rank}),
                            scales ? std::optional(with_rows(*scales)) : std::nullopt,
                            inputs.expert_scales ? std::optional(TensorView(nullptr, DType::kFloat32, {num_recv}))
                                                 : std::nullopt};
  std::optional<Plan> plan;
  local.reset();
  try {
    if (received > num_recv) {
      fail(ErrorCode::kInvalidArgument, "capacity: rank " + str(rank) + " receives " + str(received) +
                                            " rows, more than capacity = " + str(num_recv));
    }
    plan = plan_reroute(recv_inputs, reroute, 1);
  } catch (const Error& error) {
    local = error;
  }
  agree(comm, "dispatch", local, {});

  DispatchResult result;
  DispatchOutputs& out = result.outputs;
  const std::vector<TensorSpec>& specs = plan->output_specs();
  out.permute_tokens = Tensor(specs[0]);
  out.permute_per_token_scales = Tensor(specs[1]);
  out.permute_token_idx = Tensor(specs[2]);
  out.expert_token_num = Tensor(specs[3]);
  out.permute_topk_weight = Tensor(specs[4]);
  out.expert_token_num_per_rank = Tensor({DType::kInt32, {size, experts_per_rank}});
  std::memcpy(out.expert_token_num_per_rank.data(), recv_counts.data(), recv_counts.size() * sizeof(std::int32_t));

  Handle& handle = result.handle;
  const std::int64_t top_k = inputs.expert_idx.shape()[1];
  handle.comm_ = comm;
  handle.rank_ = rank;
  handle.num_tokens_ = inputs.x.shape()[0];
  handle.top_k_ = top_k;
  handle.num_rows_ = specs[0].shape[0];
  handle.experts_per_rank_ = experts_per_rank;
  handle.recv_counts_.assign(recv_counts.begin(), recv_counts.end());
  handle.dst_offset_ = plan->dst_offset();
  handle.send_rows_.assign(static_cast<std::size_t>(size), 0);
  handle.send_offset_.assign(static_cast<std::size_t>(size), 0);
  for (std::size_t g = 0; g < num_blocks; ++g) {
    handle.send_rows_[g / static_cast<std::size_t>(experts_per_rank)] += sorted.per_expert[g];
  }
  for (int r = 1; r < size; ++r) {
    handle.send_offset_[static_cast<std::size_t>(r)] =
        handle.send_offset_[static_cast<std::size_t>(r) - 1] + handle.send_rows_[static_cast<std::size_t>(r) - 1];
  }
  // Weight 1 without expert_scales: moe_finalize_routing's k comes from its scales.
  handle.weights_.assign(sorted.order.size(), 1.0f);
  if (inputs.expert_scales && !handle.weights_.empty()) {  // no pairs: its data may be null
    std::memcpy(handle.weights_.data(), inputs.expert_scales->data, handle.weights_.size() * sizeof(float));
  }

  // Row bytes of each part: tokens, scales (0: none travel), weights.
  const std::int64_t part_bytes[] = {plan->token_row_bytes(), plan->scale_row_bytes(),
                                     plan->weight_row_bytes()};
  const void* send_base[] = {inputs.x.data, scales ? scales->data : nullptr,
                             inputs.expert_scales ? inputs.expert_scales->data : nullptr};
  void* recv_base[] = {out.permute_tokens.data(), out.permute_per_token_scales.data(),
                       out.permute_topk_weight.data()};
  // Sorted position i sends token row order[i] / k (and its weight, element order[i]).
  const auto send_row = [&](int part, std::int64_t i) {
    const std::int64_t pair = sorted.order[static_cast<std::size_t>(i)];
    return part == 2 ? pair : pair / top_k;
  };
  Datatypes send_types(size), recv_types(size);
  for (int peer = 0; peer < size; ++peer) {
    if (peer == rank) continue;  // copied below, without MPI's pack and unpack
    std::vector<Datatypes::Part> send_parts, recv_parts;
    const std::int64_t first = handle.send_offset_[static_cast<std::size_t>(peer)];
    const std::int64_t rows = handle.send_rows_[static_cast<std::size_t>(peer)];
    for (int part = 0; part < 3; ++part) {
      Datatypes::Part send{part_bytes[part], {}, {}}, recv{part_bytes[part], {}, {}};
      if (part_bytes[part] == 0) continue;
      for (std::int64_t i = first; i < first + rows; ++i) {
        send.address.push_back(address_of(send_base[part], send_row(part, i) * part_bytes[part]));
        send.rows.push_back(1);
      }
      for (std::int64_t e = 0; e < experts_per_rank; ++e) {
        const std::size_t block = static_cast<std::size_t>(peer * experts_per_rank + e);
        if (recv_counts[block] == 0) continue;
        recv.address.push_back(address_of(recv_base[part], handle.dst_offset_[block] * part_bytes[part]));
        recv.rows.push_back(recv_counts[block]);
      }
      send_parts.push_back(std::move(send));
      recv_parts.push_back(std::move(recv));
    }
    send_types.set(peer, send_parts);
    recv_types.set(peer, recv_parts);
  }
  alltoallw(comm, send_types, recv_types, size);

  // This rank's own pairs, straight into place with the core's copy.
  const bool stream = 2 * plan->num_padded_rows() * plan->bytes_per_row() > last_level_cache_bytes();
  std::int64_t i = handle.send_offset_[static_cast<std::size_t>(rank)];
  for (std::int64_t e = 0; e < experts_per_rank; ++e) {
    const std::size_t block = static_cast<std::size_t>(rank * experts_per_rank + e);
    const std::int64_t dst = handle.dst_offset_[block];
    for (std::int32_t c = 0; c < recv_counts[block]; ++c, ++i) {
      for (int part = 0; part < 3; ++part) {
        if (part_bytes[part] == 0) continue;
        detail::copy_bytes(static_cast<std::byte*>(recv_base[part]) + (dst + c) * part_bytes[part],
                           static_cast<const std::byte*>(send_base[part]) + send_row(part, i) * part_bytes[part],
                           static_cast<std::size_t>(part_bytes[part]), stream);
      }
    }
  }
  detail::stream_fence();

  // What moe_re_routing writes besides the moved rows: zero pad rows (and
  // zero scales without scales), the index, the per-expert numbers.
  const std::int64_t scale_row_bytes = row_bytes_of(specs[1]);
  auto* index = static_cast<std::int32_t*>(out.permute_token_idx.data());
  const bool gather = attributes.idx_type == kIdxGather;
  std::fill_n(index, out.permute_token_idx.spec().shape[0], -1);
  // memset may not take a null pointer even for 0 bytes (an absent or empty part).
  const auto zero = [](void* at, std::int64_t bytes) {
    if (bytes > 0) std::memset(at, 0, static_cast<std::size_t>(bytes));
  };
  if (!scales) zero(recv_base[1], plan->num_padded_rows() * scale_row_bytes);
  for (const Chunk& chunk : plan->chunks()) {
    if (chunk.src_row == kPadRows) {
      for (int part = 0; part < 3; ++part) {
        zero(static_cast<std::byte*>(recv_base[part]) + chunk.dst_row * part_bytes[part],
             chunk.num_rows * part_bytes[part]);
      }
      continue;
    }
    for (std::int64_t r = 0; r < chunk.num_rows; ++r) {
      const std::int64_t src = chunk.src_row + r, dst = chunk.dst_row + r;
      index[gather ? dst : src] = static_cast<std::int32_t>(gather ? src : dst);
    }
  }
  auto* expert_token_num = static_cast<std::int32_t*>(out.expert_token_num.data());
  for (std::size_t e = 0; e < plan->expert_token_num().size(); ++e) {
    expert_token_num[e] = static_cast<std::int32_t>(plan->expert_token_num()[e]);
  }
  handle.row_idx_ = std::move(sorted.row_idx);
  return result;
}

Tensor combine(const TensorView& expert_out, const Handle& handle, int num_threads) {
  MPI_Comm comm = handle.comm();
  int size = 0;
  check_mpi(MPI_Comm_size(comm, &size), "MPI_Comm_size");
  const int rank = handle.rank_;
  std::optional<Error> local;
  const Shape& shape = expert_out.shape();
  const std::int64_t pairs = handle.num_tokens() * handle.top_k();
  // moe_finalize_routing's inputs, its rows still to arrive: checked now, before anything is sent.
  FinalizeRoutingInputs finalize{
      .expanded_x = TensorView(nullptr, expert_out.dtype(), {pairs, shape.ndim == 2 ? shape[1] : 0}),
      .expanded_row_idx = {handle.row_idx_.data(), DType::kInt32, {pairs}}};
  finalize.scales = TensorView(handle.weights_.data(), DType::kFloat32, {handle.num_tokens(), handle.top_k()});
  try {
    const DType dtype = expert_out.dtype();
    if (dtype != DType::kFloat16 && dtype != DType::kBFloat16 && dtype != DType::kFloat32) {
      fail(ErrorCode::kUnsupported, "expert_out: dtype " + std::string(dtype_name(dtype)) +
                                        " is not float16, bfloat16 or float32");
    }
    if (shape.ndim != 2 || shape[0] != handle.num_rows() || shape[1] < 1) {
      fail(ErrorCode::kInvalidArgument, "expert_out: must be [R, H'] with R = " +
                                            str(handle.num_rows()) +
                                            " rows (dispatch's permute_tokens), got " +
                                            expert_out.spec.to_string());
    }
    infer_finalize_routing(finalize, {kFinalizeRowMajor});
    check_data(expert_out, "expert_out");
    check_int_bytes(row_bytes_of(expert_out.spec), "expert_out");
  } catch (const Error& error) {
    local = error;
  }
  const Agreed agreed[kCombineAgreed] = {{"expert_out: dtype", static_cast<std::int64_t>(expert_out.dtype())},
                           {"expert_out: H'", shape.ndim == 2 ? shape[1] : 0}};
  agree(comm, "combine", local, agreed);

  // Each (token, slot) pair's row comes back to its sorted position, where
  // moe_finalize_routing reads it through the row index.
  const std::int64_t row_bytes = row_bytes_of(expert_out.spec);
  const Tensor expanded({expert_out.dtype(), {pairs, shape[1]}});
  const std::int64_t experts = handle.experts_per_rank_;
  Datatypes send_types(size), recv_types(size);
  for (int peer = 0; peer < size; ++peer) {
    if (peer == rank) continue;
    Datatypes::Part send{row_bytes, {}, {}}, recv{row_bytes, {}, {}};
    for (std::int64_t e = 0; e < experts; ++e) {
      const std::size_t block = static_cast<std::size_t>(peer * experts + e);
      if (handle.recv_counts_[block] == 0) continue;
      send.address.push_back(address_of(expert_out.data, handle.dst_offset_[block] * row_bytes));
      send.rows.push_back(static_cast<int>(handle.recv_counts_[block]));
    }
    const std::int64_t rows = handle.send_rows_[static_cast<std::size_t>(peer)];
    if (rows > 0) {
      recv.address.push_back(address_of(expanded.data(), handle.send_offset_[static_cast<std::size_t>(peer)] * row_bytes));
      recv.rows.push_back(static_cast<int>(rows));
    }
    send_types.set(peer, std::span(&send, 1));
    recv_types.set(peer, std::span(&recv, 1));
  }
  alltoallw(comm, send_types, recv_types, size);
  // This rank's own rows, with the core's copy (streaming stores past the cache).
  const bool stream = 2 * pairs * row_bytes > last_level_cache_bytes();
  auto* own = static_cast<std::byte*>(expanded.data()) + handle.send_offset_[static_cast<std::size_t>(rank)] * row_bytes;
  for (std::int64_t e = 0; e < experts; ++e) {
    const std::size_t block = static_cast<std::size_t>(rank * experts + e);
    const std::int64_t bytes = handle.recv_counts_[block] * row_bytes;
    detail::copy_bytes(own, static_cast<const std::byte*>(expert_out.data) + handle.dst_offset_[block] * row_bytes,
                       static_cast<std::size_t>(bytes), stream);
    own += bytes;
  }
  detail::stream_fence();

  Tensor out({expert_out.dtype(), {handle.num_tokens(), shape[1]}});
  finalize.expanded_x = expanded.view();
  moe_finalize_routing(finalize, {.out = out.view()}, {kFinalizeRowMajor}, num_threads);
  return out;
}

void refuse_dispatch(MPI_Comm comm, const Error& error) {
  const Agreed unused[kDispatchAgreed]{};  // not compared: the refusal decides
  refuse(comm, "dispatch", error, unused);
}

void refuse_combine(const Handle& handle, const Error& error) {
  const Agreed unused[kCombineAgreed]{};
  refuse(handle.comm(), "combine", error, unused);
}

}  // namespace moe_reroute::ep
