#include "routing_reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <utility>

namespace moe_reroute::testing {
namespace {

std::size_t at(std::int64_t i) { return static_cast<std::size_t>(i); }

// The value of bfloat16 `bits`, infinity counting as 2^128 with its sign (the
// next step past the largest finite value, for bfloat16_of's distances).
double bfloat16_value(std::uint16_t bits) {
  if ((bits & 0x7fff) == 0x7f80) {
    return (bits & 0x8000) ? -std::ldexp(1.0, 128) : std::ldexp(1.0, 128);
  }
  std::uint32_t wide = std::uint32_t{bits} << 16;
  float value;
  std::memcpy(&value, &wide, 4);
  return value;
}

// The nearer of the two bfloat16 values around `value`, ties to the even one.
std::uint16_t bfloat16_of(float value) {
  if (std::isnan(value)) return 0x7fc0;
  std::uint32_t bits;
  std::memcpy(&bits, &value, 4);
  const auto below = static_cast<std::uint16_t>(bits >> 16);  // toward zero
  if ((bits & 0xffff) == 0) return below;
  const auto above = static_cast<std::uint16_t>(below + 1);
  const double distance_below = std::fabs(double{value} - bfloat16_value(below));
  const double distance_above = std::fabs(bfloat16_value(above) - double{value});
  if (distance_below != distance_above) return distance_below < distance_above ? below : above;
  return (below & 1) ? above : below;
}

#if !defined(__FLT16_MANT_DIG__)
// Compilers without _Float16 on this target (clang before 15 on x86-64): the
// float16 value of magnitude bits `bits`, infinity counting as 2^16, the
// nearer of two candidates as for bfloat16, and NaNs quiet with their sign.
double float16_magnitude(std::uint16_t bits) {
  const int exponent = (bits >> 10) & 0x1f, mantissa = bits & 0x3ff;
  if (exponent == 0x1f) return std::ldexp(1.0, 16);
  if (exponent == 0) return std::ldexp(mantissa, -24);
  return std::ldexp(1024 + mantissa, exponent - 25);
}

float float16_to_float(std::uint16_t bits) {
  const double magnitude = float16_magnitude(bits & 0x7fff);
  const bool negative = bits & 0x8000;
  if ((bits & 0x7c00) == 0x7c00) {
    if ((bits & 0x3ff) == 0) return negative ? -INFINITY : INFINITY;
    const std::uint32_t wide = (negative ? 0xffc00000u : 0x7fc00000u) | ((bits & 0x3ffu) << 13);
    float value;
    std::memcpy(&value, &wide, 4);
    return value;
  }
  return static_cast<float>(negative ? -magnitude : magnitude);
}

std::uint16_t float16_of(float value) {
  const std::uint16_t sign = std::signbit(value) ? 0x8000 : 0;
  if (std::isnan(value)) return 0x7e00;
  const double magnitude = std::fabs(double{value});
  std::uint16_t below = 0;  // the largest magnitude at most `magnitude`, by bisection
  for (std::uint16_t step = 0x4000; step > 0; step >>= 1) {
    const auto next = static_cast<std::uint16_t>(below + step);
    if (next <= 0x7c00 && float16_magnitude(next) <= magnitude) below = next;
  }
  if (below == 0x7c00 || float16_magnitude(below) == magnitude) return sign | below;
  const auto above = static_cast<std::uint16_t>(below + 1);
  const double distance_below = magnitude - float16_magnitude(below);
  const double distance_above = float16_magnitude(above) - magnitude;
  if (distance_below != distance_above) {
    return sign | (distance_below < distance_above ? below : above);
  }
  return sign | ((below & 1) ? above : below);
}
#endif

}  // namespace

InitReferenceOutputs reference_init_routing(const InitReferenceInputs& in) {
  const std::int64_t positions = in.num_tokens * in.top_k;
  std::vector<std::pair<std::int64_t, std::int64_t>> sorted;  // (id, position)
  for (std::int64_t p = 0; p < positions; ++p) sorted.emplace_back(in.expert_idx[at(p)], p);
  std::sort(sorted.begin(), sorted.end());

  InitReferenceOutputs out;
  out.expanded_row_idx.assign(at(positions), 0);
  const auto copy_row = [&](std::int64_t to, std::int64_t token) {
    for (std::int64_t b = 0; b < in.row_bytes; ++b) {
      out.expanded_x[at(to * in.row_bytes + b)] = in.x[at(token * in.row_bytes + b)];
    }
  };
  // Each id's count, as E of them only where an output holds them (E may be
  // far larger than the ids a call has).
  std::map<std::int64_t, std::int32_t> per_id;
  for (const auto& [id, p] : sorted) ++per_id[id];
  const auto counts_of_experts = [&] {
    std::vector<std::int32_t> counts(at(in.expert_num), 0);
    for (const auto& [id, count] : per_id) counts[at(id)] = count;
    return counts;
  };
  if (in.drop_pad_mode == 0) {
    const std::int64_t rows =
        in.active_num > 0 ? std::min(in.active_num, positions) : positions;
    out.expanded_x.assign(at(rows * in.row_bytes), std::byte{0});
    for (std::int64_t i = 0; i < positions; ++i) {
      const std::int64_t p = sorted[at(i)].second;
      out.expanded_row_idx[at(p)] = static_cast<std::int32_t>(i);
      if (i < rows) copy_row(i, p / in.top_k);
    }
    if (in.count_or_cumsum_flag != 0) {
      out.count_or_cumsum = counts_of_experts();
      if (in.count_or_cumsum_flag == 1) {
        for (std::size_t e = 1; e < out.count_or_cumsum.size(); ++e) {
          out.count_or_cumsum[e] += out.count_or_cumsum[e - 1];
        }
      }
    }
    return out;
  }
  out.expanded_x.assign(at(in.expert_num * in.expert_capacity * in.row_bytes), std::byte{0});
  std::map<std::int64_t, std::int64_t> seen;
  for (const auto& [id, p] : sorted) {
    const std::int64_t c = seen[id]++;
    if (c < in.expert_capacity) {
      const std::int64_t slot = id * in.expert_capacity + c;
      out.expanded_row_idx[at(p)] = static_cast<std::int32_t>(slot);
      copy_row(slot, p / in.top_k);
    } else {
      out.expanded_row_idx[at(p)] = -1;
    }
  }
  if (in.before_capacity_flag) out.before_capacity = counts_of_experts();
  return out;
}

float reference_load(FloatType type, const void* data, std::int64_t i) {
  if (type == FloatType::kFloat32) {
    float value;
    std::memcpy(&value, static_cast<const std::byte*>(data) + 4 * i, 4);
    return value;
  }
  std::uint16_t bits;
  std::memcpy(&bits, static_cast<const std::byte*>(data) + 2 * i, 2);
  if (type == FloatType::kFloat16) {
#if defined(__FLT16_MANT_DIG__)
    _Float16 half;
    std::memcpy(&half, &bits, 2);
    return static_cast<float>(half);
#else
    return float16_to_float(bits);
#endif
  }
  return static_cast<float>(bfloat16_value(bits));
}

std::vector<std::byte> reference_store(FloatType type, float value) {
  std::vector<std::byte> bytes(type == FloatType::kFloat32 ? 4 : 2);
  if (type == FloatType::kFloat32) {
    const std::uint32_t nan = 0x7fc00000;  // the contract's one NaN
    std::memcpy(bytes.data(), std::isnan(value) ? static_cast<const void*>(&nan) : &value, 4);
  } else if (type == FloatType::kFloat16) {
#if defined(__FLT16_MANT_DIG__)
    const auto half = static_cast<_Float16>(value);
    std::memcpy(bytes.data(), &half, 2);
    if (std::isnan(value)) {  // the contract's one NaN, whatever its sign
      const std::uint16_t nan = 0x7e00;
      std::memcpy(bytes.data(), &nan, 2);
    }
#else
    const std::uint16_t bits = float16_of(value);
    std::memcpy(bytes.data(), &bits, 2);
#endif
  } else {
    const std::uint16_t bits = bfloat16_of(value);
    std::memcpy(bytes.data(), &bits, 2);
  }
  return bytes;
}

std::vector<std::byte> reference_finalize_routing(const FinalizeReferenceInputs& in) {
  const std::int64_t T = in.num_tokens, k = in.top_k, H = in.hidden;
  const bool row_major = in.drop_pad_mode >= 2;
  std::vector<std::byte> out;
  for (std::int64_t t = 0; t < T; ++t) {
    for (std::int64_t h = 0; h < H; ++h) {
      float y = 0.0f;
      if (in.x1) y = reference_load(in.dtype, in.x1, t * H + h);
      if (in.x2) y = y + reference_load(in.dtype, in.x2, t * H + h);
      for (std::int64_t j = 0; j < k; ++j) {
        const std::int32_t row = in.expanded_row_idx[row_major ? t * k + j : j * T + t];
        if (row == -1 || row >= in.expanded_rows) continue;
        float v = reference_load(in.dtype, in.expanded_x, row * H + h);
        if (in.bias) v = v + reference_load(in.dtype, in.bias, in.expert_idx[t * k + j] * H + h);
        if (in.scales) v = v * reference_load(in.scales_dtype, in.scales, t * k + j);
        y = y + v;
      }
      const std::vector<std::byte> bytes = reference_store(in.dtype, y);
      out.insert(out.end(), bytes.begin(), bytes.end());
    }
  }
  return out;
}

}  // namespace moe_reroute::testing
