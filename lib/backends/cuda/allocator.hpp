// The CUDA backend's device memory: a caching allocator. cudaMalloc and cudaFree synchronize the
// device and cost tens of microseconds, so a block whose last owner lets go goes back to a cache
// keyed by its rounded size, and the next request of that size takes it without a CUDA call: a
// training step that allocates the same sizes every time calls cudaMalloc in its first step only.
//
// Blocks are reused only by the stream that owns the allocator (one per context): the stream
// orders a block's next use after its last one, so no event is needed. The cached blocks are
// freed when the allocator goes, which is when the context and every Buffer from it have gone.
//
// Sizes: up to 1 MiB rounded up to a multiple of 512 bytes; above, to a quarter of the power of
// two below (at most 25% more than asked), so that sizes that differ a little share a bucket.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

#include "core/tensor.hpp"

namespace dtrain::backends::cuda {

struct AllocatorStats {
  std::uint64_t device_mallocs = 0;   // cudaMalloc calls (cache misses)
  std::uint64_t cache_hits = 0;       // requests served from the cache
  std::size_t bytes_reserved = 0;     // held from CUDA: in use + cached
  std::size_t bytes_in_use = 0;       // held by live Buffers
};

class CachingAllocator {
 public:
  explicit CachingAllocator(Device device) : device_(device) {}
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // The size a request of `bytes` is served with.
  static std::size_t rounded(std::size_t bytes);
  // A block of at least `bytes` (rounded(bytes) long), from the cache or from cudaMalloc; the
  // device must be current. Its contents are whatever the last owner left.
  void* take(std::size_t bytes);
  // Gives a block back to the cache; `bytes` as it was taken with.
  void give_back(void* block, std::size_t bytes) noexcept;
  // Frees every cached block (cudaFree), e.g. before a test measures memory.
  void release_cached();
  // A copy: Buffers are given back from any thread.
  AllocatorStats stats() const;

 private:
  Device device_;
  mutable std::mutex mutex_;
  std::map<std::size_t, std::vector<void*>> free_;  // rounded size -> blocks
  AllocatorStats stats_;
};

}  // namespace dtrain::backends::cuda
