// What the GPU tests share: the CUDA context of gpu:0 (made once), the CPU backend's numerics as
// the oracle, and copies between host vectors and device buffers on the context's stream.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include <doctest/doctest.h>

#include "backends/cuda/check.hpp"
#include "backends/cuda/context.hpp"
#include "device/context.hpp"
#include "../unit/test_support.hpp"

namespace dtrain::gpu_testing {

inline backends::cuda::CudaContext& gpu() {
  static const std::unique_ptr<device::Context> ctx = backends::cuda::make_cuda_context({Device::Kind::gpu, 0});
  return backends::cuda::CudaContext::of(*ctx);
}
inline device::Numerics& gpu_numerics() { return gpu().numerics(); }

// The CPU backend's context and numerics, and random inputs: as the unit tests have them.
using testing::cpu;
using testing::cpu_numerics;
using testing::uniform;

// Device memory holding `host`. Uploads and downloads go on the context's stream: a plain
// cudaMemcpy runs on the legacy stream, which a non-blocking stream does not wait for (the
// zero-fill of allocate() could land after the upload).
template <class T>
device::Buffer upload(const std::vector<T>& host) {
  auto& ctx = gpu();
  device::Buffer b = ctx.allocate(host.size() * sizeof(T));
  DTRAIN_CUDA_CALL(ctx.device(), cudaMemcpyAsync(b.get(), host.data(), host.size() * sizeof(T),
                                                 cudaMemcpyHostToDevice, ctx.stream()));
  ctx.synchronize();
  return b;
}
template <class T>
std::vector<T> download(const device::Buffer& b, std::size_t n) {
  auto& ctx = gpu();
  std::vector<T> host(n);
  DTRAIN_CUDA_CALL(ctx.device(),
                   cudaMemcpyAsync(host.data(), b.get(), n * sizeof(T), cudaMemcpyDeviceToHost, ctx.stream()));
  ctx.synchronize();
  return host;
}
template <class T>
T* ptr(const device::Buffer& b) {
  return static_cast<T*>(b.get());
}

// GPU result against the CPU's: |gpu - cpu| <= 1e-5 |cpu| + 1e-6 (the floor for values that
// cancel to near zero, where a relative bound means nothing). Returns the mismatches; the worst
// relative error and the count of results whose bits differ are reported.
inline std::size_t compare(const char* what, const std::vector<float>& gpu, const std::vector<float>& cpu) {
  REQUIRE(gpu.size() == cpu.size());
  std::size_t bad = 0, bit_differences = 0;
  double worst = 0.0;
  for (std::size_t k = 0; k < cpu.size(); ++k) {
    const double g = gpu[k], c = cpu[k];
    if (std::memcmp(&gpu[k], &cpu[k], sizeof(float)) != 0) ++bit_differences;
    if (std::isnan(c) && std::isnan(g)) continue;
    const double err = std::abs(g - c);
    if (c != 0.0) worst = std::max(worst, err / std::abs(c));
    if (!(err <= 1e-5 * std::abs(c) + 1e-6)) {
      if (bad++ < 3) FAIL_CHECK(what << "[" << k << "]: gpu " << g << ", cpu " << c);
    }
  }
  MESSAGE(what << ": " << cpu.size() << " values, " << bit_differences << " with other bits than the CPU's, worst "
               << "relative error " << worst);
  CHECK_MESSAGE(bad == 0, what);
  return bad;
}

}  // namespace dtrain::gpu_testing
