// The GPU backend's context: one CUDA device, one stream per replica (every kernel, copy and
// memset of the replica is ordered on it), cuBLAS and cuDNN handles bound to that stream, a
// caching allocator, row-major layouts and the copies between them (device to device, f32 <->
// bf16).
//
// Only files of backends/cuda/ and the GPU tests (tests/gpu/) include this header.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <cudnn.h>

#include "backends/cuda/allocator.hpp"
#include "device/context.hpp"

namespace dtrain::backends::cuda {

using device::Buffer;
using device::Context;
using device::Copy;
using device::Layout;
using device::LayoutPtr;
using device::Memory;
using device::Numerics;

inline constexpr std::string_view kName = "cuda";

// A working context for `device` (gpu:N), whether or not this build has the layer kernels: for
// the tests of the context and the numerics. The registered factory (what `dtrain run` reaches)
// still refuses gpu:N while layer kinds lack a CUDA kernel. ConfigError when the machine has no
// such device.
std::unique_ptr<Context> make_cuda_context(Device device);

// Dense row-major: the canonical layout is the only one this backend has so far.
class CudaLayout final : public Layout {
 public:
  CudaLayout(Shape shape, DType dtype) : shape_(std::move(shape)), dtype_(dtype) {}
  const Shape& shape() const override { return shape_; }
  DType dtype() const override { return dtype_; }
  std::size_t bytes() const override { return static_cast<std::size_t>(shape_.numel()) * dtype_size(dtype_); }
  bool same_as(const Layout& other) const override;

 private:
  Shape shape_;
  DType dtype_;
};

class CudaContext final : public Context {
 public:
  explicit CudaContext(Device device);
  ~CudaContext() override;
  CudaContext(const CudaContext&) = delete;
  CudaContext& operator=(const CudaContext&) = delete;
  // The CUDA context of a context this backend made (InternalError otherwise).
  static CudaContext& of(Context& ctx);

  std::string_view backend() const override { return kName; }
  Device device() const override { return device_; }
  LayoutPtr canonical_layout(const Shape& shape, DType dtype) const override;
  Buffer allocate(std::size_t bytes) override;
  Memory movable_memory(const LayoutPtr& layout) override;
  void set_address(const Memory& memory, void* data) override;
  std::unique_ptr<Copy> make_copy(const Memory& from, const Memory& to) override;
  void synchronize() override;
  void* native_stream() override { return stream_; }
  bool host_accessible() const override { return false; }
  void copy_to_host(const void* src, void* host, std::size_t bytes) override;
  void copy_from_host(const void* host, void* dst, std::size_t bytes) override;
  void copy_on_device(const void* src, void* dst, std::size_t bytes) override;
  void zero(void* dst, std::size_t bytes) override;
  using Context::copy_from_host;
  using Context::copy_to_host;
  using Context::zero;
  Numerics& numerics() override { return *numerics_; }
  std::string describe() const override;
  std::string cannot_compute_in(DType compute) const override;

  // Makes this context's device current on the calling thread (replicas run on threads of their
  // own, and every CUDA call acts on the thread's current device).
  void activate() const;
  cudaStream_t stream() const { return stream_; }
  cublasHandle_t cublas() const { return cublas_; }
  // Made on first use: creating a cuDNN handle loads its libraries (a second or more), which the
  // numerics and the tests do not need.
  cudnnHandle_t cudnn();
  AllocatorStats allocator_stats() const { return allocator_->stats(); }
  // Where a memory's data is now: its own pointer, or the address set_address() gave it last.
  static void* address(const Memory& m);

 private:
  // copy_from_host() copies the caller's pageable bytes into one of these pinned buffers, in
  // turn, and queues the transfer from there: it returns without waiting for the stream (a
  // training step's batch, labels and dropout's sample ids would otherwise each wait for
  // everything queued before them). A buffer is reused once its event says its transfer is done.
  struct Staging {
    void* pinned = nullptr;
    std::size_t bytes = 0;
    cudaEvent_t copied = nullptr;
  };
  static constexpr std::size_t kStagingBuffers = 8;
  // Larger copies (a restore, an upload of a big variable) wait for the stream as before: the
  // pinned memory kept stays small.
  static constexpr std::size_t kMostStagedBytes = std::size_t{64} << 20;
  // The next staging buffer, holding at least `bytes`, once its last transfer is done.
  Staging& staging_for(std::size_t bytes);

  Device device_;
  cudaDeviceProp properties_{};
  std::array<Staging, kStagingBuffers> staging_{};
  std::size_t next_staging_ = 0;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  cudnnHandle_t cudnn_ = nullptr;
  std::shared_ptr<CachingAllocator> allocator_;  // shared with the Buffers' deleters
  std::unique_ptr<Numerics> numerics_;
};

}  // namespace dtrain::backends::cuda
