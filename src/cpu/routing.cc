// The CPU backend of moe_init_routing (a gather of rows, as bytes) and
// moe_finalize_routing (each token's k rows summed in float32, in the
// original's order of operations; this file is compiled without contraction
// into fused multiply-adds, so every step rounds on its own).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../check.h"
#include "../float_bits.h"
#include "../routing.h"
#include "copy.h"
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

template <typename T>
const typename T::Storage* elements(const TensorView& view) {
  return static_cast<const typename T::Storage*>(view.data);
}
template <typename T>
const typename T::Storage* elements(const std::optional<TensorView>& view) {
  return view ? elements<T>(*view) : nullptr;
}

// y[h] += (v[h] + b[h]) * scale for h < count, each step rounded on its own.
template <typename T, bool kBias, bool kScales>
inline void accumulate(float* __restrict y, const typename T::Storage* __restrict v,
                       [[maybe_unused]] const typename T::Storage* __restrict b,
                       [[maybe_unused]] float scale, std::int64_t count) {
  for (std::int64_t h = 0; h < count; ++h) {
    float value = T::load(v[h]);
    if constexpr (kBias) value = value + T::load(b[h]);
    if constexpr (kScales) value = value * scale;
    y[h] = y[h] + value;
  }
}

// Tokens [begin, end) of a finalize call whose expanded rows are T and scales S.
template <typename T, typename S, bool kBias, bool kScales>
void finalize_tokens(const FinalizeRoutingCall& call, const FinalizeRoutingInputs& inputs,
                     const FinalizeRoutingOutputs& outputs, std::int64_t begin, std::int64_t end,
                     std::vector<float>& sum) {
  const std::int64_t tokens = call.num_tokens, k = call.top_k, hidden = call.hidden;
  const std::int64_t mode = call.attributes.drop_pad_mode;
  const bool row_major = mode == kFinalizeRowMajor || mode == kFinalizeRowMajorCapacity;
  const auto* expanded = elements<T>(inputs.expanded_x);
  const auto* row_idx = static_cast<const std::int32_t*>(inputs.expanded_row_idx.data);
  const auto* x1 = elements<T>(inputs.x1);
  const auto* x2 = elements<T>(inputs.x2);
  const auto* bias = elements<T>(inputs.bias);
  const auto* scales = elements<S>(inputs.scales);
  const auto* ids = inputs.expert_idx ? static_cast<const std::int32_t*>(inputs.expert_idx->data)
                                      : nullptr;
  auto* out = static_cast<typename T::Storage*>(outputs.out.data);
  float* const y = sum.data();
  // The row pair (t, j) reads; null where it is skipped (dropped, or past active_num).
  const auto row_of = [&](std::int64_t t, std::int64_t j) -> const typename T::Storage* {
    const std::int64_t row = row_idx[row_major ? t * k + j : j * tokens + t];
    return row < 0 || row >= call.expanded_rows ? nullptr : expanded + row * hidden;
  };
  // Rows are scattered: the hardware prefetchers stop at each page, so the
  // next row is prefetched a cache line for each line of this one.
  constexpr std::int64_t kLine = 64 / sizeof(typename T::Storage);
  for (std::int64_t t = begin; t < end; ++t) {
    const std::int64_t at = t * hidden;
    if (x1 && x2) {
      for (std::int64_t h = 0; h < hidden; ++h) y[h] = T::load(x1[at + h]) + T::load(x2[at + h]);
    } else if (x1) {
      for (std::int64_t h = 0; h < hidden; ++h) y[h] = T::load(x1[at + h]);
    } else {
      std::fill_n(y, hidden, 0.0f);
    }
    for (std::int64_t j = 0; j < k; ++j) {
      const auto* v = row_of(t, j);
      if (v == nullptr) continue;
      const auto* next = j + 1 < k ? row_of(t, j + 1) : t + 1 < end ? row_of(t + 1, 0) : nullptr;
      if (next == nullptr) next = v;
      [[maybe_unused]] const typename T::Storage* b = nullptr;
      if constexpr (kBias) b = bias + std::int64_t{ids[t * k + j]} * hidden;
      [[maybe_unused]] float scale = 1.0f;
      if constexpr (kScales) scale = S::load(scales[t * k + j]);
      std::int64_t line = 0;
      for (; line + kLine <= hidden; line += kLine) {
        __builtin_prefetch(next + line);
        accumulate<T, kBias, kScales>(y + line, v + line, kBias ? b + line : b, scale, kLine);
      }
      accumulate<T, kBias, kScales>(y + line, v + line, kBias ? b + line : b, scale, hidden - line);
    }
    for (std::int64_t h = 0; h < hidden; ++h) out[at + h] = T::store(y[h]);
  }
}

template <typename T, typename S>
void finalize_with(const FinalizeRoutingCall& call, const FinalizeRoutingInputs& inputs,
                   const FinalizeRoutingOutputs& outputs, int num_threads) {
  const std::int64_t element_bytes = sizeof(typename T::Storage);
  const int threads = threads_for(
      call.num_tokens * (call.top_k + 1) * call.hidden * element_bytes, num_threads);
  const auto body = [&](int t) {
    const auto [begin, end] = slice_of(call.num_tokens, t, threads);
    if (begin == end) return;  // no row: no H floats either
    std::vector<float> sum(static_cast<std::size_t>(call.hidden));
    const bool bias = inputs.bias.has_value(), scales = inputs.scales.has_value();
    if (bias && scales) {
      finalize_tokens<T, S, true, true>(call, inputs, outputs, begin, end, sum);
    } else if (bias) {
      finalize_tokens<T, S, true, false>(call, inputs, outputs, begin, end, sum);
    } else if (scales) {
      finalize_tokens<T, S, false, true>(call, inputs, outputs, begin, end, sum);
    } else {
      finalize_tokens<T, S, false, false>(call, inputs, outputs, begin, end, sum);
    }
  };
  run_threads(threads, body);
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
      if (float_scales) return finalize_with<Half, Float32>(call, inputs, outputs, num_threads);
      return finalize_with<Half, Half>(call, inputs, outputs, num_threads);
    case DType::kBFloat16:
      if (float_scales) return finalize_with<BFloat16, Float32>(call, inputs, outputs, num_threads);
      return finalize_with<BFloat16, BFloat16>(call, inputs, outputs, num_threads);
    default:
      return finalize_with<Float32, Float32>(call, inputs, outputs, num_threads);
  }
}

}  // namespace moe_reroute::detail::cpu
