#pragma once

// float16, bfloat16 and float32 to and from float32 N lanes at a time, in
// GCC/Clang vector extensions (N = 16: one AVX-512 register; 8: one AVX2
// register; 4: one SSE2 register), with exactly the bits of float_bits.h's
// one-element conversions: moe_finalize_routing's CPU kernel sums whole
// vectors. Everything is inlined into that kernel, which is compiled once per
// instruction set, so no vector crosses a call (the ABI -Wpsabi warns of).
//
// A unit is what one load brings: N float32 elements, or 2N 16-bit ones
// split into two float vectors, the even elements and the odd ones. The sum
// is elementwise, so it runs on the split vectors as they are and the store
// interleaves them again: no lane is moved across the register.

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace moe_reroute::detail::cpu {

template <std::int64_t N>
struct Lanes {
  static constexpr std::int64_t kLanes = N;
  // typedef, not using: GCC drops the attribute from a dependent alias (and
  // from these types as template arguments: __builtin_bit_cast, not std::bit_cast).
  typedef float Floats __attribute__((vector_size(N * 4)));
  typedef std::uint32_t Words __attribute__((vector_size(N * 4)));
  typedef std::int32_t Ints __attribute__((vector_size(N * 4)));

  /// mask ? a : b lane by lane, for a mask of comparison results (all ones or zero).
  [[gnu::always_inline]] static Words select(Ints mask, Words a, Words b) {
    const Words ones = __builtin_bit_cast(Words, mask);
    return (ones & a) | (~ones & b);
  }

  /// The lanes of `x` as signed: SSE2 compares only signed lanes, and every
  /// comparison below is of values under 2^31.
  [[gnu::always_inline]] static Ints signed_lanes(Words x) { return __builtin_bit_cast(Ints, x); }

  [[gnu::always_inline]] static Words broadcast(std::uint32_t value) { return Words{} + value; }

  /// Whether each lane of float32 bits `x` is a NaN.
  [[gnu::always_inline]] static Ints is_nan(Words x) {
    return signed_lanes(x & 0x7fffffffu) > 0x7f800000;
  }
};

/// `count` (at most a unit) elements from `from`; the rest of the unit is zero.
template <typename Unit, typename E>
[[gnu::always_inline]] inline Unit load_unit(const E* from, std::int64_t count) {
  Unit unit{};
  std::memcpy(&unit, from, static_cast<std::size_t>(count) * sizeof(E));
  return unit;
}

template <typename Unit, typename E>
[[gnu::always_inline]] inline void store_unit(E* to, Unit unit, std::int64_t count) {
  std::memcpy(to, &unit, static_cast<std::size_t>(count) * sizeof(E));
}

/// 16-bit elements: a unit of 2N, split into the even and the odd ones.
template <std::int64_t N>
struct SixteenBitLanes : Lanes<N> {
  using Storage = std::uint16_t;
  using Unit = typename Lanes<N>::Words;
  static constexpr std::int64_t kParts = 2;
};

template <std::int64_t N>
struct HalfLanes : SixteenBitLanes<N> {
  using L = Lanes<N>;
  using Unit = typename L::Words;

  [[gnu::always_inline]] static void widen(Unit unit, typename L::Floats* parts) {
    parts[0] = to_float(unit & 0xffffu);
    parts[1] = to_float(unit >> 16);
  }

  [[gnu::always_inline]] static Unit narrow(const typename L::Floats* parts) {
    return to_half(parts[0]) | (to_half(parts[1]) << 16);
  }

  // float16 bits in the low half of each lane, exactly.
  [[gnu::always_inline]] static typename L::Floats to_float(typename L::Words h) {
    using Words = typename L::Words;
    const Words sign = (h & 0x8000u) << 16, magnitude = h & 0x7fffu;
    const typename L::Ints exponent = L::signed_lanes(magnitude >> 10);
    // Zero or subnormal: mantissa * 2^-24, exact in float32 (and without a
    // subnormal operand, which a flush-to-zero mode would read as 0).
    const typename L::Floats subnormal =
        __builtin_convertvector(magnitude, typename L::Floats) * 0x1p-24f;
    const Words normal = (magnitude << 13) + (112u << 23);
    const Words special = (magnitude << 13) | 0x7f800000u;  // infinity, NaN
    const Words bits = L::select(exponent == 0, __builtin_bit_cast(Words, subnormal),
                                 L::select(exponent == 0x1f, special, normal));
    return __builtin_bit_cast(typename L::Floats, bits | sign);
  }

  // float16 bits in the low half of each lane: rounding to nearest, ties to
  // even; a NaN is 0x7e00.
  [[gnu::always_inline]] static typename L::Words to_half(typename L::Floats value) {
    using Words = typename L::Words;
    const Words all = __builtin_bit_cast(Words, value);
    const Words sign = (all >> 16) & 0x8000u, x = all & 0x7fffffffu;
    const Words normal = (x - 0x38000000u + 0xfffu + ((x >> 13) & 1u)) >> 13;
    // Below the smallest normal float16: adding 0.5 leaves the float16
    // subnormal's bits in the low mantissa, rounded by the addition itself.
    const typename L::Floats half = typename L::Floats{} + 0.5f;
    const typename L::Floats shifted = __builtin_bit_cast(typename L::Floats, x) + half;
    const Words subnormal = __builtin_bit_cast(Words, shifted) - __builtin_bit_cast(Words, half);
    const typename L::Ints magnitude = L::signed_lanes(x);
    Words bits = L::select(magnitude >= 0x38800000, normal, subnormal);
    bits = L::select(magnitude >= 0x477ff000, L::broadcast(0x7c00u), bits) | sign;  // 65520 up
    return L::select(L::is_nan(all), L::broadcast(0x7e00u), bits);
  }
};

template <std::int64_t N>
struct BFloat16Lanes : SixteenBitLanes<N> {
  using L = Lanes<N>;
  using Unit = typename L::Words;

  [[gnu::always_inline]] static void widen(Unit unit, typename L::Floats* parts) {
    parts[0] = __builtin_bit_cast(typename L::Floats, unit << 16);
    parts[1] = __builtin_bit_cast(typename L::Floats, unit & 0xffff0000u);
  }

  [[gnu::always_inline]] static Unit narrow(const typename L::Floats* parts) {
    return (high(parts[0]) >> 16) | high(parts[1]);
  }

  // bfloat16 bits in the high half of each lane: rounding to nearest, ties to
  // even; a NaN is 0x7fc0.
  [[gnu::always_inline]] static typename L::Words high(typename L::Floats value) {
    const typename L::Words x = __builtin_bit_cast(typename L::Words, value);
    const typename L::Words rounded = (x + 0x7fffu + ((x >> 16) & 1u)) & 0xffff0000u;
    return L::select(L::is_nan(x), L::broadcast(0x7fc00000u), rounded);
  }
};

template <std::int64_t N>
struct Float32Lanes : Lanes<N> {
  using L = Lanes<N>;
  using Storage = float;
  using Unit = typename L::Floats;
  static constexpr std::int64_t kParts = 1;

  [[gnu::always_inline]] static void widen(Unit unit, typename L::Floats* parts) {
    parts[0] = unit;
  }

  // A NaN is 0x7fc00000.
  [[gnu::always_inline]] static Unit narrow(const typename L::Floats* parts) {
    const typename L::Words x = __builtin_bit_cast(typename L::Words, parts[0]);
    return __builtin_bit_cast(typename L::Floats,
                              L::select(L::is_nan(x), L::broadcast(0x7fc00000u), x));
  }
};

}  // namespace moe_reroute::detail::cpu
