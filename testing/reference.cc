#include "reference.h"

namespace moe_reroute::testing {
namespace {

std::int64_t count(const ReferenceInputs& in, std::int64_t r, std::int64_t e) {
  return in.counts[static_cast<std::size_t>(r * in.num_experts + e)];
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

// Rows before block (r, e) in expert-major (destination) order.
std::int64_t expert_order_offset(const ReferenceInputs& in, std::int64_t r, std::int64_t e) {
  std::int64_t offset = 0;
  for (std::int64_t ee = 0; ee < in.num_experts; ++ee) {
    for (std::int64_t rr = 0; rr < in.num_ranks; ++rr) {
      if (rr == r && ee == e) return offset;
      offset += count(in, rr, ee);
    }
  }
  return offset;
}

std::int64_t total_rows(const ReferenceInputs& in) {
  std::int64_t rows = 0;
  for (std::int64_t c : in.counts) rows += c;
  return rows;
}

void copy_row(const std::byte* src, std::int64_t src_row, std::vector<std::byte>& dst,
              std::int64_t dst_row, std::int64_t row_bytes) {
  for (std::int64_t b = 0; b < row_bytes; ++b) {
    dst[static_cast<std::size_t>(dst_row * row_bytes + b)] = src[src_row * row_bytes + b];
  }
}

// Moves every row from `from(r, e) + k` to `to(r, e) + k`.
template <typename From, typename To>
ReferenceOutputs move_rows(const ReferenceInputs& in, bool zero_scales, From from, To to) {
  const std::int64_t rows = total_rows(in);
  ReferenceOutputs out;
  out.tokens.resize(static_cast<std::size_t>(rows * in.token_row_bytes));
  const std::int64_t scale_row_bytes = in.scales ? in.scale_row_bytes : 4;
  if (in.scales || zero_scales) {
    out.scales.assign(static_cast<std::size_t>(rows * scale_row_bytes), std::byte{0});
  }
  if (in.weight) out.weight.resize(static_cast<std::size_t>(rows * 4));
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

ReferenceOutputs reference_reroute(const ReferenceInputs& in, int expert_token_num_type,
                                   int idx_type) {
  const auto src = [&](std::int64_t r, std::int64_t e) { return rank_order_offset(in, r, e); };
  const auto dst = [&](std::int64_t r, std::int64_t e) { return expert_order_offset(in, r, e); };
  ReferenceOutputs out = move_rows(in, /*zero_scales=*/true, src, dst);
  out.token_idx.resize(static_cast<std::size_t>(total_rows(in)));
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
    std::int64_t total = 0;
    for (std::int64_t r = 0; r < in.num_ranks; ++r) total += count(in, r, e);
    running += total;
    out.expert_token_num.push_back(expert_token_num_type == 0 ? running : total);
  }
  return out;
}

ReferenceOutputs reference_inverse(const ReferenceInputs& in) {
  const auto src = [&](std::int64_t r, std::int64_t e) { return expert_order_offset(in, r, e); };
  const auto dst = [&](std::int64_t r, std::int64_t e) { return rank_order_offset(in, r, e); };
  return move_rows(in, /*zero_scales=*/false, src, dst);
}

}  // namespace moe_reroute::testing
