// The CPU output cache. A freed output of 4 MiB and more stays mapped: the
// next output of its size reuses its pages instead of faulting fresh ones in
// (the faults were a large part of a prefill call, and pages freed to the kernel
// may come back from the hypervisor: docs/benchmarks.md).

#include "output_cache.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <pthread.h>
#include <sys/mman.h>

#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

namespace moe_reroute::torch_ops {
namespace {

constexpr std::size_t kHugePage = std::size_t{2} << 20;
// NumPy's threshold for asking for huge pages.
constexpr std::size_t kCachedFrom = std::size_t{4} << 20;

// One mapping: whole 2 MiB pages from a 2 MiB boundary.
struct Block {
  void* base = nullptr;
  std::size_t bytes = 0;
};

Block map(std::size_t bytes) {
  // Map a huge page more than asked and cut it to the aligned part.
  const std::size_t span = bytes + kHugePage;
  void* const raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK_WITH(OutOfMemoryError, raw != MAP_FAILED, "moe_reroute: cannot map ", bytes,
                   " bytes for a CPU output");
  const auto start = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t aligned = (start + kHugePage - 1) & ~(kHugePage - 1);
  if (aligned > start) munmap(raw, aligned - start);
  if (start + span > aligned + bytes) {
    munmap(reinterpret_cast<void*>(aligned + bytes), start + span - (aligned + bytes));
  }
  void* const base = reinterpret_cast<void*>(aligned);
  madvise(base, bytes, MADV_HUGEPAGE);  // advice only: without THP, 4 KiB pages
  return {base, bytes};
}

void unmap(const std::vector<Block>& blocks) {
  for (const Block& block : blocks) munmap(block.base, block.bytes);
}

// Maps outputs of kCachedFrom bytes and more, and keeps them when freed, up
// to `limit_` bytes; smaller ones are torch's.
class OutputAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(std::size_t n) override {
    if (n < kCachedFrom) return c10::GetCPUAllocator()->allocate(n);
    const std::size_t bytes = (n + kHugePage - 1) & ~(kHugePage - 1);
    Block block = take(bytes);
    if (block.base == nullptr) block = map(bytes);
    return {block.base, new Block(block), &release, c10::Device(c10::kCPU)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  std::int64_t set_limit(std::size_t limit) {
    std::vector<Block> evicted;
    std::size_t previous;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      previous = limit_;
      limit_ = limit;
      auto kept = cached_.begin();  // the oldest block that stays
      for (; cached_bytes_ > limit_; ++kept) cached_bytes_ -= kept->bytes;
      evicted.assign(cached_.begin(), kept);
      cached_.erase(cached_.begin(), kept);
    }
    unmap(evicted);  // outside the lock: unmapping a prefill output takes milliseconds
    return static_cast<std::int64_t>(previous);
  }

  void lock() { mutex_.lock(); }
  void unlock() { mutex_.unlock(); }

  std::int64_t cached_bytes() {
    const std::lock_guard<std::mutex> lock(mutex_);
    return static_cast<std::int64_t>(cached_bytes_);
  }

 private:
  static void release(void* context);

  // The most recently cached block of exactly `bytes`, or none.
  Block take(std::size_t bytes) {
    const std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = cached_.rbegin(); it != cached_.rend(); ++it) {
      if (it->bytes == bytes) {
        const Block block = *it;
        cached_.erase(std::next(it).base());
        cached_bytes_ -= bytes;
        return block;
      }
    }
    return {};
  }

  // Caches a freed block, or unmaps it where it would pass the limit.
  void put(const Block& block) {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      if (cached_bytes_ + block.bytes <= limit_) {
        cached_.push_back(block);
        cached_bytes_ += block.bytes;
        return;
      }
    }
    unmap({block});
  }

  std::mutex mutex_;
  std::vector<Block> cached_;  // oldest first
  std::size_t cached_bytes_ = 0;
  std::size_t limit_ = std::size_t{1} << 30;
};

// Never destroyed: tensors freed during the process's exit still come back
// here. Its lock is held across fork(), so that a child never inherits it
// held by a thread the child does not have.
OutputAllocator& the_allocator() {
  static OutputAllocator* const allocator = [] {
    auto* const made = new OutputAllocator;
    pthread_atfork([] { the_allocator().lock(); }, [] { the_allocator().unlock(); },
                   [] { the_allocator().unlock(); });
    return made;
  }();
  return *allocator;
}

void OutputAllocator::release(void* context) {
  const std::unique_ptr<Block> block(static_cast<Block*>(context));
  the_allocator().put(*block);
}

}  // namespace

c10::Allocator* output_allocator() { return &the_allocator(); }

std::int64_t set_output_cache_limit(std::int64_t limit_bytes) {
  return the_allocator().set_limit(static_cast<std::size_t>(limit_bytes));
}

std::int64_t output_cache_bytes() { return the_allocator().cached_bytes(); }

}  // namespace moe_reroute::torch_ops
