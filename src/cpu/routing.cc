// The CPU backend of moe_init_routing (a gather of rows, as bytes) and
// moe_finalize_routing (each token's k rows summed in float32, in the
// original's order of operations; this file is compiled without contraction
// into fused multiply-adds, so every step rounds on its own).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../check.h"
#include "../float_bits.h"
#include "../routing.h"
#include "copy.h"
#include "float_lanes.h"
#include "moe_reroute/reroute.h"
#include "parallel.h"

namespace moe_reroute::detail::cpu {
namespace {

// Threads for `bytes` of work: a thread is worth its start-up past about 256 KiB.
int threads_for(std::int64_t bytes, int num_threads) {
  const std::int64_t requested = num_threads > 0 ? num_threads : hardware_threads();
  return static_cast<int>(std::clamp<std::int64_t>(bytes >> 18, 1, requested));
}

// [begin, end) of `size` items for thread t of `threads`.
std::pair<std::int64_t, std::int64_t> slice_of(std::int64_t size, int t, int threads) {
  return {size * t / threads, size * (t + 1) / threads};
}

template <typename T>
void copy_vector(const std::vector<T>& from, const TensorView& to) {
  if (!from.empty()) std::memcpy(to.data, from.data(), from.size() * sizeof(T));
}

template <typename E>
const E* elements(const std::optional<TensorView>& view) {
  return view ? static_cast<const E*>(view->data) : nullptr;
}

// Float vectors of out that finalize sums in registers at once: independent
// sums that hide the latency of each addition.
constexpr std::int64_t kSumVectors = 8;

// One (t, j) pair that is not skipped: its row, its bias row and its weight.
template <typename Storage>
struct Pair {
  const Storage* row;
  const Storage* bias;
  float scale;
};

// Elements of unit u of a block of `count` elements (whole units unless kTail).
template <typename F, bool kTail>
[[gnu::always_inline]] inline std::int64_t unit_elements(std::int64_t count, std::int64_t u) {
  constexpr std::int64_t kElements = F::kLanes * F::kParts;
  return kTail ? std::clamp<std::int64_t>(count - u * kElements, 0, kElements) : kElements;
}

// Unit u of a block, as float32 vectors.
template <typename F, bool kTail>
[[gnu::always_inline]] inline void load_floats(const typename F::Storage* block, std::int64_t u,
                                               std::int64_t count, typename F::Floats* parts) {
  const std::int64_t elements = unit_elements<F, kTail>(count, u);
  const typename F::Unit unit =
      elements == 0 ? typename F::Unit{}
                    : load_unit<typename F::Unit>(block + u * F::kLanes * F::kParts, elements);
  F::widen(unit, parts);
}

// out[h] for h < count (a block, less at the end of a row) of one token: y
// starts as x1 + x2, x1 or 0 and takes (v + b) * scale of each pair in j
// order, each step rounded on its own. y stays in registers: all of a
// token's rows advance together, each is read once, and y never goes to
// memory.
template <typename F, bool kBias, bool kScales, bool kTail>
[[gnu::always_inline]] inline void sum_block(typename F::Storage* out,
                                             const typename F::Storage* x1,
                                             const typename F::Storage* x2,
                                             const Pair<typename F::Storage>* pairs,
                                             std::int64_t num_pairs, std::int64_t at,
                                             std::int64_t count) {
  using Floats = typename F::Floats;
  constexpr std::int64_t kUnits = kSumVectors / F::kParts;
  Floats y[kSumVectors], value[F::kParts], more[F::kParts];
  for (std::int64_t u = 0; u < kUnits; ++u) {
    Floats* part = y + u * F::kParts;
    if (x1 == nullptr) {
      for (std::int64_t i = 0; i < F::kParts; ++i) part[i] = Floats{};
    } else {
      load_floats<F, kTail>(x1, u, count, part);
    }
    if (x2 != nullptr) {
      load_floats<F, kTail>(x2, u, count, more);
      for (std::int64_t i = 0; i < F::kParts; ++i) part[i] = part[i] + more[i];
    }
  }
  for (std::int64_t p = 0; p < num_pairs; ++p) {
    for (std::int64_t u = 0; u < kUnits; ++u) {
      load_floats<F, kTail>(pairs[p].row + at, u, count, value);
      if constexpr (kBias) load_floats<F, kTail>(pairs[p].bias + at, u, count, more);
      for (std::int64_t i = 0; i < F::kParts; ++i) {
        if constexpr (kBias) value[i] = value[i] + more[i];
        if constexpr (kScales) value[i] = value[i] * pairs[p].scale;
        y[u * F::kParts + i] = y[u * F::kParts + i] + value[i];
      }
    }
  }
  for (std::int64_t u = 0; u < kUnits; ++u) {
    const std::int64_t elements = unit_elements<F, kTail>(count, u);
    if (elements > 0) {
      store_unit(out + u * F::kLanes * F::kParts, F::narrow(y + u * F::kParts), elements);
    }
  }
}

// Tokens [begin, end) of a finalize call: rows of F's elements, scales of S's.
template <typename F, typename S, bool kBias, bool kScales>
[[gnu::always_inline]] inline void finalize_tokens(const FinalizeRoutingCall& call,
                                                   const FinalizeRoutingInputs& inputs,
                                                   const FinalizeRoutingOutputs& outputs,
                                                   std::int64_t begin, std::int64_t end,
                                                   Pair<typename F::Storage>* pairs) {
  using Storage = typename F::Storage;
  const std::int64_t tokens = call.num_tokens, k = call.top_k, hidden = call.hidden;
  const std::int64_t mode = call.attributes.drop_pad_mode;
  const bool row_major = mode == kFinalizeRowMajor || mode == kFinalizeRowMajorCapacity;
  const auto* expanded = static_cast<const Storage*>(inputs.expanded_x.data);
  const auto* row_idx = static_cast<const std::int32_t*>(inputs.expanded_row_idx.data);
  const auto* x1 = elements<Storage>(inputs.x1);
  const auto* x2 = elements<Storage>(inputs.x2);
  const auto* bias = elements<Storage>(inputs.bias);
  const auto* scales = elements<typename S::Storage>(inputs.scales);
  const auto* ids = elements<std::int32_t>(inputs.expert_idx);
  auto* out = static_cast<Storage*>(outputs.out.data);
  for (std::int64_t t = begin; t < end; ++t) {
    std::int64_t num_pairs = 0;
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int64_t row = row_idx[row_major ? t * k + j : j * tokens + t];
      if (row < 0 || row >= call.expanded_rows) continue;  // dropped, or past active_num
      Pair<Storage>& pair = pairs[num_pairs++];
      pair.row = expanded + row * hidden;
      pair.bias = kBias ? bias + std::int64_t{ids[t * k + j]} * hidden : nullptr;
      pair.scale = kScales ? S::load(scales[t * k + j]) : 1.0f;
    }
    const std::int64_t at = t * hidden;
    const auto* token_x1 = x1 ? x1 + at : nullptr;
    const auto* token_x2 = x2 ? x2 + at : nullptr;
    constexpr std::int64_t kBlock = kSumVectors * F::kLanes;  // elements
    std::int64_t h = 0;
    for (; h + kBlock <= hidden; h += kBlock) {
      sum_block<F, kBias, kScales, false>(out + at + h, token_x1 ? token_x1 + h : nullptr,
                                          token_x2 ? token_x2 + h : nullptr, pairs, num_pairs, h,
                                          kBlock);
    }
    if (h < hidden) {
      sum_block<F, kBias, kScales, true>(out + at + h, token_x1 ? token_x1 + h : nullptr,
                                         token_x2 ? token_x2 + h : nullptr, pairs, num_pairs, h,
                                         hidden - h);
    }
  }
}

// The kernel's signature, and its instances for each instruction set: the
// library is built for any x86-64 and picks the widest its CPU runs.
template <typename Storage>
using FinalizeKernel = void (*)(const FinalizeRoutingCall&, const FinalizeRoutingInputs&,
                                const FinalizeRoutingOutputs&, std::int64_t, std::int64_t,
                                Pair<Storage>*);

template <template <std::int64_t> class F, typename S, bool kBias, bool kScales>
void finalize_portable(const FinalizeRoutingCall& call, const FinalizeRoutingInputs& inputs,
                       const FinalizeRoutingOutputs& outputs, std::int64_t begin,
                       std::int64_t end, Pair<typename F<4>::Storage>* pairs) {
  finalize_tokens<F<4>, S, kBias, kScales>(call, inputs, outputs, begin, end, pairs);
}

#if defined(__x86_64__)
template <template <std::int64_t> class F, typename S, bool kBias, bool kScales>
__attribute__((target("avx2"))) void finalize_avx2(
    const FinalizeRoutingCall& call, const FinalizeRoutingInputs& inputs,
    const FinalizeRoutingOutputs& outputs, std::int64_t begin, std::int64_t end,
    Pair<typename F<8>::Storage>* pairs) {
  finalize_tokens<F<8>, S, kBias, kScales>(call, inputs, outputs, begin, end, pairs);
}

template <template <std::int64_t> class F, typename S, bool kBias, bool kScales>
__attribute__((target("avx512f,avx512bw"))) void finalize_avx512(
    const FinalizeRoutingCall& call, const FinalizeRoutingInputs& inputs,
    const FinalizeRoutingOutputs& outputs, std::int64_t begin, std::int64_t end,
    Pair<typename F<16>::Storage>* pairs) {
  finalize_tokens<F<16>, S, kBias, kScales>(call, inputs, outputs, begin, end, pairs);
}
#endif

// The instruction sets of finalize's kernel, narrowest first.
enum class Isa { kPortable, kAvx2, kAvx512 };

[[noreturn]] Isa fail_isa(const std::string& name) {
  fail(ErrorCode::kInvalidArgument, "MOE_REROUTE_MAX_CPU_ISA: \"" + name +
                                        "\" is none of portable, avx2, avx512");
}

// The widest the CPU runs, capped by MOE_REROUTE_MAX_CPU_ISA (portable, avx2
// or avx512; docs/spec.md section 13), read once: the tests run every kernel
// the machine can, and a user can keep AVX-512 off.
Isa kernel_isa() {
  static const Isa isa = [] {
    Isa widest = Isa::kPortable;
#if defined(__x86_64__)
    if (__builtin_cpu_supports("avx2")) widest = Isa::kAvx2;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) {
      widest = Isa::kAvx512;
    }
#endif
    const char* cap = std::getenv("MOE_REROUTE_MAX_CPU_ISA");
    if (cap == nullptr || *cap == '\0') return widest;
    const std::string name = cap;
    const Isa limit = name == "portable" ? Isa::kPortable
                      : name == "avx2"   ? Isa::kAvx2
                      : name == "avx512" ? Isa::kAvx512
                                         : fail_isa(name);
    return std::min(widest, limit);
  }();
  return isa;
}

template <template <std::int64_t> class F, typename S, bool kBias, bool kScales>
FinalizeKernel<typename F<4>::Storage> finalize_kernel() {
#if defined(__x86_64__)
  if (kernel_isa() == Isa::kAvx512) return finalize_avx512<F, S, kBias, kScales>;
  if (kernel_isa() == Isa::kAvx2) return finalize_avx2<F, S, kBias, kScales>;
#endif
  return finalize_portable<F, S, kBias, kScales>;
}

template <template <std::int64_t> class F, typename S>
void finalize_with(const FinalizeRoutingCall& call, const FinalizeRoutingInputs& inputs,
                   const FinalizeRoutingOutputs& outputs, int num_threads) {
  using Storage = typename F<4>::Storage;
  const bool bias = inputs.bias.has_value(), scales = inputs.scales.has_value();
  const FinalizeKernel<Storage> kernel =
      bias && scales ? finalize_kernel<F, S, true, true>()
      : bias         ? finalize_kernel<F, S, true, false>()
      : scales       ? finalize_kernel<F, S, false, true>()
                     : finalize_kernel<F, S, false, false>();
  const int threads = threads_for(
      call.num_tokens * (call.top_k + 1) * call.hidden * std::int64_t{sizeof(Storage)},
      num_threads);
  run_threads(threads, [&](int t) {
    const auto [begin, end] = slice_of(call.num_tokens, t, threads);
    if (begin == end) return;
    std::vector<Pair<Storage>> pairs(static_cast<std::size_t>(call.top_k));
    kernel(call, inputs, outputs, begin, end, pairs.data());
  });
}

}  // namespace

void init_routing(const InitRoutingCall& call, const InitRoutingLayout& layout,
                  const InitRoutingInputs& inputs, const InitRoutingOutputs& outputs,
                  int num_threads) {
  copy_vector(layout.row_idx, outputs.expanded_row_idx);
  copy_vector(layout.expert_tokens, outputs.expert_tokens_count_or_cumsum);
  copy_vector(layout.tokens_before_capacity, outputs.expert_tokens_before_capacity);
  const auto rows = static_cast<std::int64_t>(layout.source_token.size());
  const std::int64_t row_bytes = call.row_bytes;
  const std::int64_t bytes = 2 * rows * row_bytes;  // read and written
  const bool streaming = bytes > last_level_cache_bytes();
  const int threads = threads_for(bytes, num_threads);
  const auto* x = static_cast<const std::byte*>(inputs.x.data);
  auto* expanded = static_cast<std::byte*>(outputs.expanded_x.data);
  run_threads(threads, [&](int t) {
    const auto [begin, end] = slice_of(rows, t, threads);
    for (std::int64_t i = begin; i < end; ++i) {
      const std::int64_t source = layout.source_token[static_cast<std::size_t>(i)];
      std::byte* to = expanded + i * row_bytes;
      if (source < 0) {
        zero_bytes(to, static_cast<std::size_t>(row_bytes), streaming);
      } else {
        copy_bytes(to, x + source * row_bytes, static_cast<std::size_t>(row_bytes), streaming);
      }
    }
    stream_fence();
  });
}

void finalize_routing(const FinalizeRoutingCall& call, const FinalizeRoutingInputs& inputs,
                      const FinalizeRoutingOutputs& outputs, int num_threads) {
  const bool float_scales = inputs.scales && inputs.scales->dtype() == DType::kFloat32;
  switch (inputs.expanded_x.dtype()) {
    case DType::kFloat16:
      if (float_scales) {
        return finalize_with<HalfLanes, Float32>(call, inputs, outputs, num_threads);
      }
      return finalize_with<HalfLanes, Half>(call, inputs, outputs, num_threads);
    case DType::kBFloat16:
      if (float_scales) {
        return finalize_with<BFloat16Lanes, Float32>(call, inputs, outputs, num_threads);
      }
      return finalize_with<BFloat16Lanes, BFloat16>(call, inputs, outputs, num_threads);
    default:
      return finalize_with<Float32Lanes, Float32>(call, inputs, outputs, num_threads);
  }
}

}  // namespace moe_reroute::detail::cpu
