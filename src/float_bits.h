#pragma once

// float16 and bfloat16 to and from float32 on their bits, one code for the
// host and the device: the backends of moe_finalize_routing write the same
// bits, NaN included, where the compilers' own conversions differ.

#include <bit>
#include <cstdint>

#if defined(__CUDACC__)
#define MOE_REROUTE_FLOAT_HD __host__ __device__ __forceinline__
#else
#define MOE_REROUTE_FLOAT_HD inline
#endif

namespace moe_reroute::detail {

MOE_REROUTE_FLOAT_HD std::uint32_t bits_of(float value) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(value);
#else
  return std::bit_cast<std::uint32_t>(value);
#endif
}

MOE_REROUTE_FLOAT_HD float float_of(std::uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  return std::bit_cast<float>(bits);
#endif
}

/// float16 to float32, exactly.
MOE_REROUTE_FLOAT_HD float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float32
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return float_of(bits_of(magnitude) | sign);
  }
  const std::uint32_t bits = exponent == 0x1f ? 0x7f800000u | (mantissa << 13)
                                              : ((exponent + 112) << 23) | (mantissa << 13);
  return float_of(sign | bits);
}

/// float32 to float16, rounding to nearest, ties to even; a NaN is 0x7e00 (whatever its
/// sign: which NaN an operation propagates differs between compilers and backends).
MOE_REROUTE_FLOAT_HD std::uint16_t float_to_half(float value) {
  std::uint32_t x = bits_of(value);
  const auto sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return 0x7e00u;          // NaN
  if (x >= 0x477ff000u) return sign | 0x7c00u;  // 65520 and up round to infinity
  if (x >= 0x38800000u) {                       // normal: rebias, round off 13 bits
    x -= 0x38000000u;
    x += 0xfffu + ((x >> 13) & 1u);
    return static_cast<std::uint16_t>(sign | (x >> 13));
  }
  const std::uint32_t shift = 126u - (x >> 23);  // subnormal: mantissa * 2^-shift
  if (shift > 24) return sign;
  const std::uint32_t mantissa = (x & 0x7fffffu) | 0x800000u;
  std::uint32_t rounded = mantissa >> shift;
  const std::uint32_t rest = mantissa & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rest > half || (rest == half && (rounded & 1u))) ++rounded;
  return static_cast<std::uint16_t>(sign | rounded);
}

/// bfloat16 to float32, exactly.
MOE_REROUTE_FLOAT_HD float bfloat16_to_float(std::uint16_t b) {
  return float_of(std::uint32_t{b} << 16);
}

/// float32 to bfloat16, rounding to nearest, ties to even; a NaN is 0x7fc0, as
/// torch and ml_dtypes give it.
MOE_REROUTE_FLOAT_HD std::uint16_t float_to_bfloat16(float value) {
  const std::uint32_t x = bits_of(value);
  if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<std::uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

/// The element types finalize reads and writes, as float32.
struct Half {
  using Storage = std::uint16_t;
  static MOE_REROUTE_FLOAT_HD float load(std::uint16_t h) { return half_to_float(h); }
  static MOE_REROUTE_FLOAT_HD std::uint16_t store(float value) { return float_to_half(value); }
};

struct BFloat16 {
  using Storage = std::uint16_t;
  static MOE_REROUTE_FLOAT_HD float load(std::uint16_t b) { return bfloat16_to_float(b); }
  static MOE_REROUTE_FLOAT_HD std::uint16_t store(float value) { return float_to_bfloat16(value); }
};

struct Float32 {
  using Storage = float;
  static MOE_REROUTE_FLOAT_HD float load(float value) { return value; }
  // A NaN is 0x7fc00000, whatever its sign and payload, as for the narrower types.
  static MOE_REROUTE_FLOAT_HD float store(float value) {
    return value != value ? float_of(0x7fc00000u) : value;
  }
};

}  // namespace moe_reroute::detail
