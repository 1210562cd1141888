// The CUDA context on a real GPU: what it says of the device, its allocator, its copies and its
// errors.
#include <algorithm>
#include <bit>
#include <cstring>
#include <string>

#include "backends/cuda/math.hpp"
#include "core/error.hpp"
#include "nn/kernel.hpp"
#include "gpu_support.hpp"

using namespace dtrain;
using namespace dtrain::gpu_testing;
namespace cuda = dtrain::backends::cuda;

TEST_CASE("the context says which GPU, CUDA and cuDNN it runs, and whether it computes in bfloat16") {
  auto& ctx = gpu();
  const std::string line = ctx.describe();
  MESSAGE("describe(): " << line);
  CHECK(line.find("CUDA ") == 0);
  CHECK(line.find("sm_") != std::string::npos);
  CHECK(line.find("cuDNN 9.") != std::string::npos);
  CHECK(ctx.backend() == "cuda");
  CHECK(ctx.cannot_compute_in(DType::f32).empty());
  int major = 0;
  REQUIRE(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) == cudaSuccess);
  CHECK(ctx.cannot_compute_in(DType::bf16).empty() == (major >= 8));
  CHECK(ctx.cudnn() != nullptr);  // made on first use, bound to the stream
  CHECK(ctx.cublas() != nullptr);
}

TEST_CASE("the allocator: a second round of the same allocations calls cudaMalloc no more, and memory comes zeroed") {
  auto ctx = cuda::make_cuda_context({Device::Kind::gpu, 0});
  auto& c = cuda::CudaContext::of(*ctx);
  const std::size_t sizes[] = {1, 7, 512, 513, 4096, 1 << 20, (3 << 20) + 5, 1000003 * 4};
  auto round = [&] {
    std::vector<device::Buffer> live;
    for (std::size_t s : sizes) live.push_back(c.allocate(s));
    for (std::size_t s : sizes) live.push_back(c.allocate(s));  // two of each size at once
    c.synchronize();
  };
  round();
  const cuda::AllocatorStats first = c.allocator_stats();
  CHECK(first.device_mallocs == 2 * std::size(sizes));
  CHECK(first.bytes_in_use == 0);
  round();
  const cuda::AllocatorStats second = c.allocator_stats();
  CHECK(second.device_mallocs == first.device_mallocs);
  CHECK(second.cache_hits == first.cache_hits + 2 * std::size(sizes));
  CHECK(second.bytes_reserved == first.bytes_reserved);
  MESSAGE("after two rounds: " << second.device_mallocs << " cudaMalloc calls, " << second.cache_hits
                               << " cache hits, " << second.bytes_reserved << " bytes reserved");

  // A block that comes back from the cache is zero-filled again.
  {
    device::Buffer b = c.allocate(4096);
    REQUIRE(cudaMemsetAsync(b.get(), 0xAB, 4096, c.stream()) == cudaSuccess);
    c.synchronize();
  }
  device::Buffer again = c.allocate(4096);
  std::vector<unsigned char> host(4096, 1);
  REQUIRE(cudaMemcpyAsync(host.data(), again.get(), 4096, cudaMemcpyDeviceToHost, c.stream()) == cudaSuccess);
  c.synchronize();
  CHECK(std::all_of(host.begin(), host.end(), [](unsigned char x) { return x == 0; }));
  CHECK(c.allocator_stats().device_mallocs == second.device_mallocs);
}

TEST_CASE("a Buffer may outlive its context") {
  device::Buffer survivor;
  {
    auto ctx = cuda::make_cuda_context({Device::Kind::gpu, 0});
    survivor = ctx->allocate(1 << 16);
    ctx->synchronize();
  }
  survivor.reset();  // goes back to the allocator, which the Buffer kept alive, and is freed with it
  CHECK(cudaGetLastError() == cudaSuccess);
}

namespace {

std::vector<std::uint32_t> rounding_cases(std::size_t n) {
  const std::uint32_t special[] = {0x00000000u, 0x80000000u, 0x00000001u, 0x807FFFFFu, 0x7F800000u, 0xFF800000u,
                                   0x7FC00000u, 0xFFC00001u, 0x7F800001u, 0x3F808000u, 0x3F818000u, 0x3F807FFFu,
                                   0x7F7FFFFFu, 0x00800000u};
  std::vector<std::uint32_t> bits(n);
  std::mt19937 rng(7);
  for (std::size_t k = 0; k < n; ++k) bits[k] = k < std::size(special) ? special[k] : static_cast<std::uint32_t>(rng());
  return bits;
}

}  // namespace

TEST_CASE("copies: f32 <-> bf16 bit-equal to the CPU backend's, device to device, movable memory") {
  auto& g = gpu();
  for (const std::size_t n : {std::size_t{1}, std::size_t{7}, std::size_t{1000003}}) {
    CAPTURE(n);
    const std::vector<std::uint32_t> bits = rounding_cases(n);
    std::vector<float> f32(n);
    std::memcpy(f32.data(), bits.data(), n * sizeof(float));
    const Shape shape{static_cast<std::int64_t>(n)};

    // The CPU backend's conversion (a oneDNN reorder) is the oracle.
    std::vector<std::uint16_t> cpu_bf16(n);
    auto& c = cpu();
    c.make_copy(device::Memory(c.canonical_layout(shape, DType::f32), f32.data()),
                device::Memory(c.canonical_layout(shape, DType::bf16), cpu_bf16.data()))
        ->run();
    c.synchronize();

    device::Buffer src = upload(f32);
    device::Buffer bf16 = g.allocate(n * 2);
    device::Buffer back = g.allocate(n * 4);
    const auto f32_layout = g.canonical_layout(shape, DType::f32);
    const auto bf16_layout = g.canonical_layout(shape, DType::bf16);
    g.make_copy(device::Memory(f32_layout, src.get()), device::Memory(bf16_layout, bf16.get()))->run();
    g.make_copy(device::Memory(bf16_layout, bf16.get()), device::Memory(f32_layout, back.get()))->run();
    const std::vector<std::uint16_t> gpu_bf16 = download<std::uint16_t>(bf16, n);
    CHECK(std::memcmp(gpu_bf16.data(), cpu_bf16.data(), n * 2) == 0);
    const std::vector<std::uint32_t> widened = download<std::uint32_t>(back, n);
    std::size_t wrong = 0;
    for (std::size_t k = 0; k < n; ++k) wrong += widened[k] != cuda::math::f32_bits_from_bf16(cpu_bf16[k]);
    CHECK(wrong == 0);

    // Same dtype: a device-to-device copy; same memory: no copy at all.
    device::Buffer dst = g.allocate(n * 4);
    g.make_copy(device::Memory(f32_layout, src.get()), device::Memory(f32_layout, dst.get()))->run();
    CHECK(download<std::uint32_t>(dst, n) == bits);
    CHECK(g.make_copy(device::Memory(f32_layout, src.get()), device::Memory(f32_layout, src.get())) == nullptr);

    // A movable source: the copy reads the address set last.
    device::Memory movable = g.movable_memory(f32_layout);
    auto copy = g.make_copy(movable, device::Memory(bf16_layout, bf16.get()));
    g.set_address(movable, dst.get());
    copy->run();
    CHECK(download<std::uint16_t>(bf16, n) == gpu_bf16);
    device::Buffer zeros = g.allocate(n * 4);
    g.set_address(movable, zeros.get());
    copy->run();
    const std::vector<std::uint16_t> zeroed = download<std::uint16_t>(bf16, n);
    CHECK(std::all_of(zeroed.begin(), zeroed.end(), [](std::uint16_t h) { return h == 0; }));
  }
}

TEST_CASE("errors name the device and say what to do") {
  int count = 0;
  REQUIRE(cudaGetDeviceCount(&count) == cudaSuccess);
  for (const int index : {count, 999, -1}) {
    CAPTURE(index);
    try {
      (void)cuda::make_cuda_context({Device::Kind::gpu, index});
      FAIL("no error for a device the machine lacks");
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      MESSAGE(what);
      CHECK(what.find("gpu:" + std::to_string(index)) != std::string::npos);
      CHECK(what.find("this machine has " + std::to_string(count) + " CUDA device") != std::string::npos);
    }
  }
  // A failed CUDA call names itself, and the device.
  try {
    DTRAIN_CUDA_CALL((Device{Device::Kind::gpu, 0}), cudaSetDevice(count + 5));
    FAIL("cudaSetDevice of a missing device succeeded");
  } catch (const ConfigError& e) {
    CHECK(std::string(e.what()).find("cudaSetDevice(count + 5) failed") != std::string::npos);
  }
  CHECK(cudaGetLastError() == cudaSuccess);  // the failure is not left pending for the next check
}

TEST_CASE("the registered factory makes gpu:N's context, now that every layer kind has a CUDA kernel") {
  REQUIRE(nn::kinds_without_kernel("cuda").empty());
  const std::unique_ptr<device::Context> ctx = device::make_context({Device::Kind::gpu, 0});
  CHECK(ctx->backend() == "cuda");
  CHECK_FALSE(ctx->host_accessible());
}
