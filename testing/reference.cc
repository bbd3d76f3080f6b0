#include "reference.h"

namespace moe_reroute::testing {
namespace {

std::int64_t count(const ReferenceInputs& in, std::int64_t r, std::int64_t e) {
  return in.counts[static_cast<std::size_t>(r * in.num_experts + e)];
}

std::int64_t expert_total(const ReferenceInputs& in, std::int64_t e) {
  std::int64_t total = 0;
  for (std::int64_t r = 0; r < in.num_ranks; ++r) total += count(in, r, e);
  return total;
}

// The rows of expert e's segment: its total rounded up to a multiple of k.
std::int64_t padded_total(const ReferenceInputs& in, std::int64_t e) {
  const std::int64_t total = expert_total(in, e);
  return (total + in.expert_alignment - 1) / in.expert_alignment * in.expert_alignment;
}

std::int64_t total_rows(const ReferenceInputs& in) {
  std::int64_t rows = 0;
  for (std::int64_t c : in.counts) rows += c;
  return rows;
}

// A: the rows in rank order.
std::int64_t rank_rows(const ReferenceInputs& in) {
  return in.num_tokens >= 0 ? in.num_tokens : total_rows(in);
}

// R: the rows in expert order.
std::int64_t expert_rows(const ReferenceInputs& in) {
  return in.expert_alignment == 1 ? rank_rows(in)
                                  : rank_rows(in) + in.num_experts * (in.expert_alignment - 1);
}

// Rows before block (r, e) in rank-major (source) order.
std::int64_t rank_order_offset(const ReferenceInputs& in, std::int64_t r, std::int64_t e) {
  std::int64_t offset = 0;
  for (std::int64_t rr = 0; rr < in.num_ranks; ++rr) {
    for (std::int64_t ee = 0; ee < in.num_experts; ++ee) {
      if (rr == r && ee == e) return offset;
      offset += count(in, rr, ee);
    }
  }
  return offset;
}

// Rows before block (r, e) in expert-major (destination) order: the padded
// segments of experts 0..e-1, then ranks 0..r-1 of expert e.
std::int64_t expert_order_offset(const ReferenceInputs& in, std::int64_t r, std::int64_t e) {
  std::int64_t offset = 0;
  for (std::int64_t ee = 0; ee < e; ++ee) offset += padded_total(in, ee);
  for (std::int64_t rr = 0; rr < r; ++rr) offset += count(in, rr, e);
  return offset;
}

void copy_row(const std::byte* src, std::int64_t src_row, std::vector<std::byte>& dst,
              std::int64_t dst_row, std::int64_t row_bytes) {
  for (std::int64_t b = 0; b < row_bytes; ++b) {
    dst[static_cast<std::size_t>(dst_row * row_bytes + b)] = src[src_row * row_bytes + b];
  }
}

// Moves every row from `from(r, e) + k` to `to(r, e) + k` into `rows` zeroed rows.
template <typename From, typename To>
ReferenceOutputs move_rows(const ReferenceInputs& in, std::int64_t rows, bool zero_scales,
                           From from, To to) {
  ReferenceOutputs out;
  out.tokens.assign(static_cast<std::size_t>(rows * in.token_row_bytes), std::byte{0});
  const std::int64_t scale_row_bytes = in.scales ? in.scale_row_bytes : 4;
  if (in.scales || zero_scales) {
    out.scales.assign(static_cast<std::size_t>(rows * scale_row_bytes), std::byte{0});
  }
  if (in.weight) out.weight.assign(static_cast<std::size_t>(rows * 4), std::byte{0});
  for (std::int64_t r = 0; r < in.num_ranks; ++r) {
    for (std::int64_t e = 0; e < in.num_experts; ++e) {
      const std::int64_t src_offset = from(r, e);
      const std::int64_t dst_offset = to(r, e);
      for (std::int64_t k = 0; k < count(in, r, e); ++k) {
        const std::int64_t src = src_offset + k;
        const std::int64_t dst = dst_offset + k;
        copy_row(in.tokens, src, out.tokens, dst, in.token_row_bytes);
        if (in.scales) copy_row(in.scales, src, out.scales, dst, scale_row_bytes);
        if (in.weight) copy_row(in.weight, src, out.weight, dst, 4);
      }
    }
  }
  return out;
}

}  // namespace

ReferenceOutputs reference_reroute(const ReferenceInputs& in, std::int64_t expert_token_num_type,
                                   std::int64_t idx_type) {
  const auto src = [&](std::int64_t r, std::int64_t e) { return rank_order_offset(in, r, e); };
  const auto dst = [&](std::int64_t r, std::int64_t e) { return expert_order_offset(in, r, e); };
  ReferenceOutputs out = move_rows(in, expert_rows(in), /*zero_scales=*/true, src, dst);
  for (std::int64_t e = 0; e < in.num_experts; ++e) out.specified_rows += padded_total(in, e);
  out.token_idx.assign(static_cast<std::size_t>(idx_type == 0 ? expert_rows(in) : rank_rows(in)),
                       -1);
  for (std::int64_t r = 0; r < in.num_ranks; ++r) {
    for (std::int64_t e = 0; e < in.num_experts; ++e) {
      const std::int64_t src_offset = src(r, e);
      const std::int64_t dst_offset = dst(r, e);
      for (std::int64_t k = 0; k < count(in, r, e); ++k) {
        if (idx_type == 0) {
          out.token_idx[static_cast<std::size_t>(dst_offset + k)] =
              static_cast<std::int32_t>(src_offset + k);
        } else {
          out.token_idx[static_cast<std::size_t>(src_offset + k)] =
              static_cast<std::int32_t>(dst_offset + k);
        }
      }
    }
  }
  std::int64_t running = 0;
  for (std::int64_t e = 0; e < in.num_experts; ++e) {
    running += padded_total(in, e);
    out.expert_token_num.push_back(expert_token_num_type == 0 ? running : expert_total(in, e));
  }
  return out;
}

ReferenceOutputs reference_inverse(const ReferenceInputs& in) {
  const auto src = [&](std::int64_t r, std::int64_t e) { return expert_order_offset(in, r, e); };
  const auto dst = [&](std::int64_t r, std::int64_t e) { return rank_order_offset(in, r, e); };
  ReferenceOutputs out = move_rows(in, rank_rows(in), /*zero_scales=*/false, src, dst);
  out.specified_rows = total_rows(in);
  return out;
}

}  // namespace moe_reroute::testing
