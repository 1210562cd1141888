// The CPU's GEMM peak for `dtrain bench`: oneDNN matmuls of square matrices, src and weights in the
// compute dtype and the result in f32 (what the layers' primitives accumulate in), run on the
// replica's stream with the run's thread count. A short sweep of sizes, the best rate kept: small
// sizes do not fill the cores' vector units, large ones leave the caches.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>

#include <fmt/format.h>

#include "device/gemm_peak.hpp"
#include "backends/onednn/context.hpp"

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

// GFLOP/s of an n x n x n matmul, timed for about `seconds` after one untimed run.
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
  std::int64_t runs = 0;
  const auto start = Clock::now();
  double elapsed = 0.0;
  do {
    matmul.execute(ctx.stream, args);
    ctx.stream.wait();
    ++runs;
    elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  } while (elapsed < seconds);
  return 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(runs) /
         elapsed * 1e-9;
}

device::GemmPeak measure(Context& context, DType dtype, int threads) {
  device::GemmPeak peak;
  if (dtype != DType::f32 && dtype != DType::bf16) {
    peak.why_not = "no GEMM peak for this dtype";
    return peak;
  }
  OnednnContext& ctx = OnednnContext::of(context);
  const int before = omp_get_max_threads();
  omp_set_num_threads(std::max(1, threads));
  for (const std::int64_t n : {512, 1024, 2048}) {
    const double gflops = rate(ctx, dtype, n, 0.15);
    if (gflops > peak.gflops) {
      peak.gflops = gflops;
      peak.size = n;
    }
  }
  omp_set_num_threads(before);
  peak.available = true;
  const std::string_view name = dtype == DType::bf16 ? "bf16" : "f32";
  peak.what = fmt::format("oneDNN matmul {} x {} -> f32", name, name);
  return peak;
}

const device::GemmPeakRegistration registered(kName, &measure);

}  // namespace

}  // namespace dtrain::backends::onednn
