// The CPU's GEMM peak for `dtrain bench`: oneDNN matmuls of square matrices, src and weights in the
// compute dtype and the result in f32 (what the layers' primitives accumulate in), run on the
// replica's stream with the run's thread count. A short sweep of sizes, the best rate kept: small
// sizes do not fill the cores' vector units, large ones leave the caches; each size's rate is its
// median run. Asked for one size, that size alone.
//
// And its copy bandwidth: memcpy (what the C library does best: wide loads, streaming stores for
// large copies) of a buffer four times the last-level cache, 128 to 512 MiB, split between the
// run's threads; the best of a few passes, bytes read plus bytes written per second.
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <vector>

#include <fmt/format.h>

#include "device/gemm_peak.hpp"
#include "backends/onednn/context.hpp"
#include "core/compute_thread.hpp"

namespace dtrain::backends::onednn {

namespace {

using Clock = std::chrono::steady_clock;
using dnnl::memory;

// Small values everywhere: no subnormal products, no overflow.
void fill(const memory& m, DType dtype) {
  const std::size_t bytes = m.get_desc().get_size();
  auto* data = static_cast<std::uint8_t*>(m.get_data_handle());
  if (dtype == DType::bf16) {
    const std::uint16_t hundredth = 0x3C24;  // bfloat16 of 0.01
    for (std::size_t i = 0; i + 1 < bytes; i += 2) std::memcpy(data + i, &hundredth, 2);
  } else {
    const float hundredth = 0.01f;
    for (std::size_t i = 0; i + 3 < bytes; i += 4) std::memcpy(data + i, &hundredth, 4);
  }
}

// GFLOP/s of an n x n x n matmul: its median run of those in about `seconds`, after one untimed
// run. The median, not the mean: on the shared machines another process's burst slows some runs
// (a mean over them came out at three quarters of the peak now and then, and training "reached"
// 150 % of it); not the fastest either, which is the luckiest run where a training step's time is
// a mean.
double rate(OnednnContext& ctx, DType dtype, std::int64_t n, double seconds) {
  const memory::dims dims{n, n};
  const memory::desc in_md(dims, to_dnnl(dtype), memory::format_tag::ab);
  const memory::desc out_md(dims, memory::data_type::f32, memory::format_tag::ab);
  const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(in_md, in_md, out_md), ctx.engine);
  const dnnl::matmul matmul(pd);
  memory a(in_md, ctx.engine), b(in_md, ctx.engine), c(out_md, ctx.engine);
  fill(a, dtype);
  fill(b, dtype);
  const std::unordered_map<int, memory> args{{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}};
  matmul.execute(ctx.stream, args);
  ctx.stream.wait();
  std::vector<double> runs;
  const auto start = Clock::now();
  for (auto now = start; std::chrono::duration<double>(now - start).count() < seconds;) {
    const auto before = now;
    matmul.execute(ctx.stream, args);
    ctx.stream.wait();
    now = Clock::now();
    runs.push_back(std::chrono::duration<double>(now - before).count());
  }
  const auto middle = runs.begin() + static_cast<std::ptrdiff_t>(runs.size() / 2);
  std::nth_element(runs.begin(), middle, runs.end());
  return 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n) / *middle * 1e-9;
}

device::GemmPeak measure(Context& context, DType dtype, int threads, std::int64_t size) {
  device::GemmPeak peak;
  if (dtype != DType::f32 && dtype != DType::bf16) {
    peak.why_not = "no GEMM peak for this dtype";
    return peak;
  }
  OnednnContext& ctx = OnednnContext::of(context);
  const int before = omp_get_max_threads();
  omp_set_num_threads(std::max(1, threads));
  const std::vector<std::int64_t> sizes = size > 0 ? std::vector<std::int64_t>{size} : std::vector<std::int64_t>{512, 1024, 2048};
  for (const std::int64_t n : sizes) {
    const double gflops = rate(ctx, dtype, n, 0.15);
    if (gflops > peak.gflops) {
      peak.gflops = gflops;
      peak.size = n;
    }
  }
  omp_set_num_threads(before);
  release_openmp_team();  // no thread of the peak's spins beside the training steps that follow
  peak.available = true;
  const std::string_view name = dtype == DType::bf16 ? "bf16" : "f32";
  peak.what = fmt::format("oneDNN matmul {} x {} -> f32", name, name);
  return peak;
}

// The last-level cache's size: Linux's description of CPU 0's caches (the C library's sysconf
// reported ten times the 32 MiB L3 of a 2-core EPYC VM), else sysconf, else 0.
std::int64_t last_level_cache_bytes() {
  std::int64_t bytes = 0;
  for (int index = 0; index < 8; ++index) {
    std::ifstream size(fmt::format("/sys/devices/system/cpu/cpu0/cache/index{}/size", index));
    std::int64_t kib = 0;
    char unit = 0;
    if (size >> kib >> unit && unit == 'K') bytes = std::max(bytes, kib * 1024);
  }
  if (bytes > 0) return bytes;
  for (const int level : {_SC_LEVEL2_CACHE_SIZE, _SC_LEVEL3_CACHE_SIZE, _SC_LEVEL4_CACHE_SIZE})
    bytes = std::max<std::int64_t>(bytes, sysconf(level));
  return bytes;
}

device::CopyBandwidth measure_bandwidth(Context&, int threads) {
  constexpr std::int64_t MiB = 1 << 20;
  const std::int64_t bytes = std::clamp(4 * last_level_cache_bytes(), 128 * MiB, 512 * MiB);
  const int team = std::max(1, threads);
  const auto size = static_cast<std::size_t>(bytes);
  const std::unique_ptr<char[]> from(new char[size]), to(new char[size]);
  // Each thread copies its own slice, after touching it first (so the pages are its NUMA node's).
  const auto pass = [&](bool copy) {
#pragma omp parallel num_threads(team)
    {
      const auto t = static_cast<std::size_t>(omp_get_thread_num()), n = static_cast<std::size_t>(omp_get_num_threads());
      const std::size_t begin = size / n * t, end = t + 1 == n ? size : size / n * (t + 1);
      if (copy) {
        std::memcpy(to.get() + begin, from.get() + begin, end - begin);
      } else {
        std::memset(from.get() + begin, 1, end - begin);
        std::memset(to.get() + begin, 0, end - begin);
      }
    }
  };
  pass(false);
  pass(true);
  double best = 0.0;
  const auto start = Clock::now();
  for (int runs = 0; runs < 3 || std::chrono::duration<double>(Clock::now() - start).count() < 0.25; ++runs) {
    const auto begin = Clock::now();
    pass(true);
    best = std::max(best, 2.0 * static_cast<double>(bytes) / std::chrono::duration<double>(Clock::now() - begin).count());
  }
  release_openmp_team();
  device::CopyBandwidth bandwidth;
  bandwidth.available = true;
  bandwidth.gb_per_s = best * 1e-9;
  bandwidth.bytes = bytes;
  bandwidth.what = fmt::format("memcpy of {} MiB", bytes / MiB);
  return bandwidth;
}

const device::GemmPeakRegistration registered(kName, &measure);
const device::CopyBandwidthRegistration registered_bandwidth(kName, &measure_bandwidth);

}  // namespace

}  // namespace dtrain::backends::onednn
