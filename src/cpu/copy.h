#pragma once

// Byte copies for the CPU backend: memcpy, plus the two cases where glibc's
// memcpy leaves speed behind (outputs larger than the last-level cache, and
// destinations 1 to 63 bytes past the source modulo 4 KiB).

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace moe_reroute::detail {

// Copies `bytes` (sizeof(Word) to 2 * sizeof(Word)) as the first and the last
// Word, which overlap when bytes < 2 * sizeof(Word).
template <typename Word>
void copy_ends(std::byte* dst, const std::byte* src, std::size_t bytes) {
  Word head, tail;
  std::memcpy(&head, src, sizeof(Word));
  std::memcpy(&tail, src + bytes - sizeof(Word), sizeof(Word));
  std::memcpy(dst, &head, sizeof(Word));
  std::memcpy(dst + bytes - sizeof(Word), &tail, sizeof(Word));
}

#if defined(__x86_64__)

// Copies whole 64-byte groups of 16-byte vectors; returns the bytes copied.
template <bool kStream>
std::size_t copy_vectors(std::byte* dst, const std::byte* src, std::size_t bytes) {
  const std::size_t whole = bytes & ~std::size_t{63};
  for (std::size_t i = 0; i < whole; i += 64) {
    const auto* from = reinterpret_cast<const __m128i*>(src + i);
    auto* to = reinterpret_cast<__m128i*>(dst + i);
    const __m128i a = _mm_loadu_si128(from);
    const __m128i b = _mm_loadu_si128(from + 1);
    const __m128i c = _mm_loadu_si128(from + 2);
    const __m128i d = _mm_loadu_si128(from + 3);
    if constexpr (kStream) {
      _mm_stream_si128(to, a);
      _mm_stream_si128(to + 1, b);
      _mm_stream_si128(to + 2, c);
      _mm_stream_si128(to + 3, d);
    } else {
      _mm_storeu_si128(to, a);
      _mm_storeu_si128(to + 1, b);
      _mm_storeu_si128(to + 2, c);
      _mm_storeu_si128(to + 3, d);
    }
  }
  return whole;
}

#endif

/// Copies `bytes` from `src` to `dst` (not overlapping). `stream`: the
/// destination will not be read soon, so write around the cache; the thread
/// must call stream_fence() before its writes are read elsewhere.
inline void copy_bytes(std::byte* dst, const std::byte* src, std::size_t bytes, bool stream) {
  // A few scale or weight rows: two overlapping loads and stores here cost less
  // than the call into glibc's memcpy, which a decode call makes hundreds of.
  if (bytes <= 16) {
    if (bytes >= 8) {
      copy_ends<std::uint64_t>(dst, src, bytes);
    } else if (bytes >= 4) {
      copy_ends<std::uint32_t>(dst, src, bytes);
    } else {
      for (std::size_t i = 0; i < bytes; ++i) dst[i] = src[i];
    }
    return;
  }
#if defined(__x86_64__)
  // Streaming stores skip the read for ownership of each destination line: a
  // third less DRAM traffic once the output cannot stay in the cache.
  if (stream && bytes >= 4096) {
    const std::size_t head = (64 - (reinterpret_cast<std::uintptr_t>(dst) & 63)) & 63;
    std::memcpy(dst, src, head);
    const std::size_t done = head + copy_vectors<true>(dst + head, src + head, bytes - head);
    std::memcpy(dst + done, src + done, bytes - done);
    return;
  }
  // glibc's rep movsb runs several times slower on AMD Zen when the destination
  // is 1 to 63 bytes past the source modulo 4 KiB (4K aliasing); a vector loop does not.
  const std::uintptr_t distance =
      (reinterpret_cast<std::uintptr_t>(dst) - reinterpret_cast<std::uintptr_t>(src)) & 4095;
  if (bytes >= 2048 && distance > 0 && distance < 64) {
    const std::size_t done = copy_vectors<false>(dst, src, bytes);
    std::memcpy(dst + done, src + done, bytes - done);
    return;
  }
#else
  (void)stream;
#endif
  std::memcpy(dst, src, bytes);
}

/// Writes `bytes` zeros to `dst`; `stream` as for copy_bytes.
inline void zero_bytes(std::byte* dst, std::size_t bytes, bool stream) {
#if defined(__x86_64__)
  if (stream && bytes >= 4096) {
    const std::size_t head = (64 - (reinterpret_cast<std::uintptr_t>(dst) & 63)) & 63;
    std::memset(dst, 0, head);
    const std::size_t whole = (bytes - head) & ~std::size_t{63};
    const __m128i zero = _mm_setzero_si128();
    for (std::size_t i = head; i < head + whole; i += 64) {
      auto* to = reinterpret_cast<__m128i*>(dst + i);
      _mm_stream_si128(to, zero);
      _mm_stream_si128(to + 1, zero);
      _mm_stream_si128(to + 2, zero);
      _mm_stream_si128(to + 3, zero);
    }
    std::memset(dst + head + whole, 0, bytes - head - whole);
    return;
  }
#else
  (void)stream;
#endif
  std::memset(dst, 0, bytes);
}

/// Orders this thread's streaming stores before anything after it.
inline void stream_fence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

}  // namespace moe_reroute::detail
