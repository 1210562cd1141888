// The CUDA backend's context and its registration for gpu:N (every layer kind has its kernel in
// this folder; a kind added without one is refused by nn::make_kernels, naming it).
#include "backends/cuda/context.hpp"

#include <cstring>

#include <fmt/format.h>

#include "backends/cuda/check.hpp"
#include "backends/cuda/convert.hpp"
#include "backends/cuda/numerics.hpp"
#include "core/error.hpp"

namespace dtrain::backends::cuda {

namespace {

// A prepared copy between two memories of the same shape; the addresses are read at run() so
// that a movable memory's latest address is used.
class CudaCopy final : public Copy {
 public:
  CudaCopy(CudaContext& ctx, Memory from, Memory to) : ctx_(ctx), from_(std::move(from)), to_(std::move(to)) {}
  void run() override {
    ctx_.activate();
    const void* src = CudaContext::address(from_);
    void* dst = CudaContext::address(to_);
    const DType a = from_.layout->dtype(), b = to_.layout->dtype();
    const auto n = static_cast<std::size_t>(from_.layout->shape().numel());
    if (a == b) {
      // cudaMemcpyDefault: unified addressing tells device from host memory.
      DTRAIN_CUDA_CALL(ctx_.device(),
                       cudaMemcpyAsync(dst, src, from_.layout->bytes(), cudaMemcpyDefault, ctx_.stream()));
    } else if (a == DType::f32 && b == DType::bf16) {
      f32_to_bf16(static_cast<const float*>(src), static_cast<std::uint16_t*>(dst), n, ctx_.stream(), ctx_.device());
    } else {
      bf16_to_f32(static_cast<const std::uint16_t*>(src), static_cast<float*>(dst), n, ctx_.stream(), ctx_.device());
    }
  }

 private:
  CudaContext& ctx_;
  Memory from_, to_;
};

// What a movable memory's handle holds: the address set_address() gave it last.
struct MovableAddress {
  void* data = nullptr;
};

// The registered factory: every layer kind has its kernel here. A machine without the device (or
// without a GPU or NVIDIA's driver at all) is the context's ConfigError, naming how many it has.
std::unique_ptr<Context> make(Device device) { return make_cuda_context(device); }

// "CUDA runtime 13.0 (built with 13.0), driver 13.0; cuDNN 9.13.0 (built with 9.13.0); NCCL ..."
// and one line per GPU: what `dtrain info` prints, whether or not the machine has a GPU.
std::vector<std::string> inventory() {
  const auto version = [](int v) { return fmt::format("{}.{}", v / 1000, v % 1000 / 10); };
  int runtime = 0, driver = 0;
  const bool have_runtime = cudaRuntimeGetVersion(&runtime) == cudaSuccess;
  const bool have_driver = cudaDriverGetVersion(&driver) == cudaSuccess && driver > 0;
  const std::size_t cudnn = cudnnGetVersion();
  std::vector<std::string> lines;
  lines.push_back(fmt::format(
      "CUDA runtime {} (built with {}), driver {}; cuDNN {}.{}.{} (built with {}.{}.{})",
      have_runtime ? version(runtime) : "unknown", version(CUDART_VERSION),
      have_driver ? version(driver) : "none (no NVIDIA driver on this machine)", cudnn / 10000, cudnn % 10000 / 100,
      cudnn % 100, CUDNN_MAJOR, CUDNN_MINOR, CUDNN_PATCHLEVEL));
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  (void)cudaGetLastError();
  if (status != cudaSuccess) {
    lines.push_back(fmt::format("GPUs: none usable ({})", cudaGetErrorString(status)));
    return lines;
  }
  lines.push_back(fmt::format("GPUs: {}", count));
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, i) != cudaSuccess) {
      (void)cudaGetLastError();
      lines.push_back(fmt::format("  gpu:{}: its properties cannot be read", i));
      continue;
    }
    lines.push_back(fmt::format("  gpu:{}: {}, {:.1f} GiB, compute capability {}.{}, {} multiprocessors", i, p.name,
                                static_cast<double>(p.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0), p.major, p.minor,
                                p.multiProcessorCount));
  }
  return lines;
}

// What `devices: auto` takes: every GPU the runtime shows (CUDA_VISIBLE_DEVICES applies); none
// where the machine has no GPU or no driver.
int count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    n = 0;
  }
  return n;
}

const bool registered = (device::register_backend(Device::Kind::gpu, kName, &make, &inventory, &count), true);

}  // namespace

std::unique_ptr<Context> make_cuda_context(Device device) { return std::make_unique<CudaContext>(device); }

bool CudaLayout::same_as(const Layout& other) const {
  const auto* o = dynamic_cast<const CudaLayout*>(&other);
  return o && o->shape_ == shape_ && o->dtype_ == dtype_;
}

CudaContext::CudaContext(Device device) : device_(device) {
  if (device.kind != Device::Kind::gpu) throw InternalError("the CUDA backend runs gpu devices only");
  // A machine without a GPU or without NVIDIA's driver has no device: a configuration the user
  // can change (exit 2), not a failure of the backend.
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    count = 0;
  }
  if (device.index < 0 || device.index >= count)
    throw ConfigError(fmt::format("device {}: this machine has {} CUDA device{}{}{}; use one of those or cpu:N devices",
                                  device.to_string(), count, count == 1 ? "" : "s",
                                  count > 0 ? fmt::format(" (gpu:0 to gpu:{})", count - 1) : "",
                                  status != cudaSuccess ? fmt::format(" ({})", cudaGetErrorString(status)) : ""));
  DTRAIN_CUDA_CALL(device_, cudaSetDevice(device_.index));
  DTRAIN_CUDA_CALL(device_, cudaGetDeviceProperties(&properties_, device_.index));
  // Non-blocking: the legacy default stream must not serialize the replicas' streams.
  DTRAIN_CUDA_CALL(device_, cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  try {
    DTRAIN_CUBLAS_CALL(device_, cublasCreate(&cublas_));
    DTRAIN_CUBLAS_CALL(device_, cublasSetStream(cublas_, stream_));
  } catch (...) {
    if (cublas_) cublasDestroy(cublas_);
    cudaStreamDestroy(stream_);
    throw;
  }
  allocator_ = std::make_shared<CachingAllocator>(device_);
  numerics_ = std::make_unique<CudaNumerics>(*this);
}

CudaContext::~CudaContext() {
  // Work in flight may still use buffers; errors are ignored (a destructor must not throw, and a
  // device fault was reported where it happened).
  (void)cudaSetDevice(device_.index);
  (void)cudaStreamSynchronize(stream_);
  numerics_.reset();
  for (Staging& s : staging_) {
    if (s.pinned) (void)cudaFreeHost(s.pinned);
    if (s.copied) (void)cudaEventDestroy(s.copied);
  }
  if (cudnn_) cudnnDestroy(cudnn_);
  if (cublas_) cublasDestroy(cublas_);
  (void)cudaStreamDestroy(stream_);
  (void)cudaGetLastError();
}

CudaContext& CudaContext::of(Context& ctx) {
  auto* c = dynamic_cast<CudaContext*>(&ctx);
  DTRAIN_CHECK(c != nullptr, "a CUDA kernel was made for a context of another backend");
  return *c;
}

void CudaContext::activate() const { DTRAIN_CUDA_CALL(device_, cudaSetDevice(device_.index)); }

cudnnHandle_t CudaContext::cudnn() {
  if (!cudnn_) {
    activate();
    DTRAIN_CUDNN_CALL(device_, cudnnCreate(&cudnn_));
    DTRAIN_CUDNN_CALL(device_, cudnnSetStream(cudnn_, stream_));
  }
  return cudnn_;
}

LayoutPtr CudaContext::canonical_layout(const Shape& shape, DType dtype) const {
  return std::make_shared<CudaLayout>(shape, dtype);
}

Buffer CudaContext::allocate(std::size_t bytes) {
  activate();
  void* block = allocator_->take(bytes);
  // The Buffer's deleter holds the allocator, which may outlive this context.
  Buffer buffer(block, [allocator = allocator_, bytes](void* b) { allocator->give_back(b, bytes); });
  DTRAIN_CUDA_CALL(device_, cudaMemsetAsync(block, 0, CachingAllocator::rounded(bytes), stream_));
  return buffer;
}

Memory CudaContext::movable_memory(const LayoutPtr& layout) {
  Memory m;
  m.layout = layout;
  m.handle = std::make_shared<MovableAddress>();
  return m;
}

void CudaContext::set_address(const Memory& m, void* data) {
  DTRAIN_CHECK(m.handle != nullptr, "set_address() on memory that movable_memory() did not make");
  static_cast<MovableAddress*>(m.handle.get())->data = data;
}

void* CudaContext::address(const Memory& m) {
  return m.handle ? static_cast<MovableAddress*>(m.handle.get())->data : m.data;
}

std::unique_ptr<Copy> CudaContext::make_copy(const Memory& from, const Memory& to) {
  DTRAIN_CHECK(from.layout && to.layout, "a copy between memories without layouts");
  DTRAIN_CHECK(dynamic_cast<const CudaLayout*>(from.layout.get()) && dynamic_cast<const CudaLayout*>(to.layout.get()),
               "a layout of another backend reached the CUDA backend");
  if (!(from.layout->shape() == to.layout->shape()))
    throw InternalError(fmt::format("a copy between shapes {} and {}: a copy keeps the logical shape",
                                    from.layout->shape().to_string(), to.layout->shape().to_string()));
  if (from.data == to.data && !from.handle && !to.handle && from.layout->same_as(*to.layout)) return nullptr;
  const DType a = from.layout->dtype(), b = to.layout->dtype();
  const bool convertible = a == b || (a == DType::f32 && b == DType::bf16) || (a == DType::bf16 && b == DType::f32);
  if (!convertible)
    throw InternalError(fmt::format("the CUDA backend copies {} to {}: it converts only between f32 and bf16",
                                    dtype_name(a), dtype_name(b)));
  return std::make_unique<CudaCopy>(*this, from, to);
}

void CudaContext::synchronize() {
  activate();
  DTRAIN_CUDA_CALL(device_, cudaStreamSynchronize(stream_));
}

void CudaContext::copy_to_host(const void* src, void* host, std::size_t bytes) {
  if (bytes == 0) return;
  activate();
  DTRAIN_CUDA_CALL(device_, cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, stream_));
  DTRAIN_CUDA_CALL(device_, cudaStreamSynchronize(stream_));
}

CudaContext::Staging& CudaContext::staging_for(std::size_t bytes) {
  Staging& s = staging_[next_staging_];
  next_staging_ = (next_staging_ + 1) % kStagingBuffers;
  if (s.copied) DTRAIN_CUDA_CALL(device_, cudaEventSynchronize(s.copied));
  else DTRAIN_CUDA_CALL(device_, cudaEventCreateWithFlags(&s.copied, cudaEventDisableTiming));
  if (s.bytes < bytes) {
    if (s.pinned) DTRAIN_CUDA_CALL(device_, cudaFreeHost(s.pinned));
    s.pinned = nullptr;
    s.bytes = 0;
    // Rounded up to a power of two from 64 KiB, so that a batch that grows a little (or the
    // steps' different copies taking turns) does not reallocate each time.
    std::size_t size = std::size_t{64} << 10;
    while (size < bytes) size *= 2;
    DTRAIN_CUDA_CALL(device_, cudaMallocHost(&s.pinned, size));
    s.bytes = size;
  }
  return s;
}

void CudaContext::copy_from_host(const void* host, void* dst, std::size_t bytes) {
  if (bytes == 0) return;
  activate();
  if (bytes > kMostStagedBytes) {
    DTRAIN_CUDA_CALL(device_, cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, stream_));
    // From pageable memory the runtime may still read `host` after returning; the caller may
    // reuse it as soon as this returns.
    DTRAIN_CUDA_CALL(device_, cudaStreamSynchronize(stream_));
    return;
  }
  // The caller may reuse `host` at once: the bytes are in pinned memory before the transfer is
  // queued, and nothing waits for the stream.
  Staging& s = staging_for(bytes);
  std::memcpy(s.pinned, host, bytes);
  DTRAIN_CUDA_CALL(device_, cudaMemcpyAsync(dst, s.pinned, bytes, cudaMemcpyHostToDevice, stream_));
  DTRAIN_CUDA_CALL(device_, cudaEventRecord(s.copied, stream_));
}

void CudaContext::copy_on_device(const void* src, void* dst, std::size_t bytes) {
  if (bytes == 0) return;
  activate();
  DTRAIN_CUDA_CALL(device_, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
}

void CudaContext::zero(void* dst, std::size_t bytes) {
  if (bytes == 0) return;
  activate();
  DTRAIN_CUDA_CALL(device_, cudaMemsetAsync(dst, 0, bytes, stream_));
}

std::string CudaContext::describe() const {
  int runtime = 0, driver = 0;
  (void)cudaRuntimeGetVersion(&runtime);
  (void)cudaDriverGetVersion(&driver);
  const std::size_t cudnn = cudnnGetVersion();  // major * 10000 + minor * 100 + patch (cuDNN 9)
  constexpr double gib = 1024.0 * 1024.0 * 1024.0;
  return fmt::format("CUDA {}.{} (driver {}.{}), {} sm_{}{}, {:.0f} GiB, cuDNN {}.{}.{}", runtime / 1000,
                     runtime % 1000 / 10, driver / 1000, driver % 1000 / 10, properties_.name, properties_.major,
                     properties_.minor, static_cast<double>(properties_.totalGlobalMem) / gib, cudnn / 10000,
                     cudnn % 10000 / 100, cudnn % 100);
}

std::string CudaContext::cannot_compute_in(DType compute) const {
  switch (compute) {
    case DType::f32: return {};
    case DType::bf16:
      if (properties_.major >= 8) return {};
      return fmt::format("{} is sm_{}{}; bfloat16 kernels need sm_80 (Ampere) or newer", properties_.name,
                         properties_.major, properties_.minor);
    default: return fmt::format("the CUDA backend does not compute in {}", dtype_name(compute));
  }
}

}  // namespace dtrain::backends::cuda
