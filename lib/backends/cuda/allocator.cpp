#include "backends/cuda/allocator.hpp"

#include <bit>

#include <cuda_runtime_api.h>

#include "backends/cuda/check.hpp"

namespace dtrain::backends::cuda {

CachingAllocator::~CachingAllocator() {
  // Errors are ignored here: at exit the CUDA runtime may already be gone, and the driver frees
  // a process's memory anyway.
  int current = 0;
  const bool switched = cudaGetDevice(&current) == cudaSuccess && current != device_.index &&
                        cudaSetDevice(device_.index) == cudaSuccess;
  for (auto& [size, blocks] : free_)
    for (void* b : blocks) (void)cudaFree(b);
  if (switched) (void)cudaSetDevice(current);
  (void)cudaGetLastError();
}

std::size_t CachingAllocator::rounded(std::size_t bytes) {
  constexpr std::size_t small_granule = 512;
  constexpr std::size_t small_limit = std::size_t{1} << 20;
  if (bytes == 0) bytes = 1;
  if (bytes <= small_limit) return (bytes + small_granule - 1) / small_granule * small_granule;
  const std::size_t granule = std::bit_floor(bytes) / 4;
  return (bytes + granule - 1) / granule * granule;
}

void* CachingAllocator::take(std::size_t bytes) {
  const std::size_t size = rounded(bytes);
  {
    std::lock_guard lock(mutex_);
    auto it = free_.find(size);
    if (it != free_.end() && !it->second.empty()) {
      void* block = it->second.back();
      it->second.pop_back();
      ++stats_.cache_hits;
      stats_.bytes_in_use += size;
      return block;
    }
  }
  void* block = nullptr;
  cudaError_t status = cudaMalloc(&block, size);
  if (status == cudaErrorMemoryAllocation) {
    // The cache may hold what this request needs in blocks of other sizes: give them back to
    // CUDA and try once more before reporting the device full.
    (void)cudaGetLastError();
    release_cached();
    status = cudaMalloc(&block, size);
  }
  if (status != cudaSuccess) throw_cuda_error(status, "cudaMalloc", device_);
  std::lock_guard lock(mutex_);
  ++stats_.device_mallocs;
  stats_.bytes_reserved += size;
  stats_.bytes_in_use += size;
  return block;
}

void CachingAllocator::give_back(void* block, std::size_t bytes) noexcept {
  const std::size_t size = rounded(bytes);
  std::lock_guard lock(mutex_);
  try {
    free_[size].push_back(block);
  } catch (...) {
    // No host memory for the cache's bookkeeping: free the block instead of keeping it.
    (void)cudaFree(block);
    stats_.bytes_reserved -= size;
  }
  stats_.bytes_in_use -= size;
}

void CachingAllocator::release_cached() {
  std::lock_guard lock(mutex_);
  for (auto& [size, blocks] : free_) {
    for (void* b : blocks) {
      (void)cudaFree(b);
      stats_.bytes_reserved -= size;
    }
    blocks.clear();
  }
  (void)cudaGetLastError();
}

AllocatorStats CachingAllocator::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

}  // namespace dtrain::backends::cuda
