// The conv2d and dense compute cores (backends/cuda/conv2d_core.hpp, dense_core.hpp) on a real
// GPU against the reference oracle (nn/reference/layers.hpp) run in double on the host: forward,
// dx, dk and db on small shapes (valid and same padding, strides 1 and 2, odd sizes, TensorFlow's
// asymmetric SAME padding, batch 1 and 5, bias on and off), then a second identical step that
// must allocate nothing and give the same bits. The bfloat16 dense core against the reference on
// the bfloat16-rounded inputs.
//
// Tolerance: |gpu - ref| <= 1e-5 |ref| + 1e-6 sqrt(terms), where `terms` is the length of the sums
// behind each result: float32 rounding grows with the square root of it (values and weights in
// [-1, 1]), and a result that cancels to near zero has no meaningful relative error.
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "backends/cuda/conv2d_core.hpp"
#include "backends/cuda/dense_core.hpp"
#include "backends/cuda/math.hpp"
#include "nn/reference/layers.hpp"
#include "gpu_support.hpp"

using namespace dtrain;
using namespace dtrain::gpu_testing;
namespace cuda = dtrain::backends::cuda;
using config::Padding;

namespace {

std::vector<double> widen(const std::vector<float>& v) { return {v.begin(), v.end()}; }

void compare_to_reference(const char* what, const std::vector<float>& gpu, const std::vector<double>& ref,
                          std::int64_t terms, double relative = 1e-5) {
  REQUIRE(gpu.size() == ref.size());
  const double floor = 1e-6 * std::sqrt(static_cast<double>(terms));
  std::size_t bad = 0;
  double worst = 0.0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double err = std::abs(static_cast<double>(gpu[i]) - ref[i]);
    if (ref[i] != 0.0) worst = std::max(worst, err / std::abs(ref[i]));
    if (!(err <= relative * std::abs(ref[i]) + floor)) {
      if (bad++ < 3) FAIL_CHECK(what << "[" << i << "]: gpu " << gpu[i] << ", reference " << ref[i]);
    }
  }
  MESSAGE(what << ": " << ref.size() << " values, worst relative error " << worst);
  CHECK_MESSAGE(bad == 0, what << ": " << bad << " values off");
}

// bfloat16 bits of v (the CPU backend's rounding), and their float values.
std::vector<std::uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<std::uint16_t> r(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) r[i] = cuda::math::bf16_from_f32_bits(std::bit_cast<std::uint32_t>(v[i]));
  return r;
}
std::vector<float> from_bf16(const std::vector<std::uint16_t>& v) {
  std::vector<float> r(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) r[i] = std::bit_cast<float>(cuda::math::f32_bits_from_bf16(v[i]));
  return r;
}

struct DenseCase {
  std::int64_t batch, in, out;
  bool bias;
  std::size_t nx() const { return static_cast<std::size_t>(batch * in); }
  std::size_t nk() const { return static_cast<std::size_t>(in * out); }
  std::size_t ny() const { return static_cast<std::size_t>(batch * out); }
  std::size_t nb() const { return static_cast<std::size_t>(out); }
};

// The reference layer's outputs and gradients, in double, for the inputs as the GPU sees them.
struct DenseReference {
  std::vector<double> y, dx, dk, db;
};
DenseReference dense_reference(const DenseCase& t, const std::vector<float>& x, const std::vector<float>& k,
                               const std::vector<float>& b, const std::vector<float>& dy) {
  const auto xd = widen(x), kd = widen(k), bd = widen(b), dyd = widen(dy);
  DenseReference r{std::vector<double>(t.ny()), std::vector<double>(t.nx()), std::vector<double>(t.nk()),
                   std::vector<double>(t.nb())};
  nn::reference::dense_forward(xd.data(), kd.data(), t.bias ? bd.data() : nullptr, r.y.data(), t.batch, t.in, t.out);
  nn::reference::dense_backward(xd.data(), kd.data(), dyd.data(), r.dx.data(), r.dk.data(),
                                t.bias ? r.db.data() : nullptr, t.batch, t.in, t.out);
  return r;
}


bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

struct ConvCase {
  std::int64_t n, h, w, c, f, kh, kw, sh, sw;
  Padding padding;
  bool bias;
};

// `step` once more: it must neither allocate device memory nor take a block from the cache.
template <class Context, class Step>
void step_allocates_nothing(Context& ctx, Step& step) {
  const cuda::AllocatorStats before = ctx.allocator_stats();
  step();
  const cuda::AllocatorStats after = ctx.allocator_stats();
  CHECK(after.device_mallocs == before.device_mallocs);
  CHECK(after.cache_hits == before.cache_hits);
  CHECK(after.bytes_in_use == before.bytes_in_use);
}

}  // namespace

TEST_CASE("conv2d core on the GPU, cuDNN and GEMM: forward, dx, dk and db against the reference, and a second step "
          "allocates nothing") {
  const ConvCase cases[] = {
      {1, 7, 9, 3, 4, 3, 3, 1, 1, Padding::valid, true},    // valid, batch 1
      {5, 7, 9, 3, 4, 3, 3, 1, 1, Padding::same, true},     // same, symmetric padding
      {5, 7, 9, 3, 4, 4, 4, 1, 1, Padding::same, false},    // same, kernel 4: 1 before, 2 after on both axes
      {2, 8, 9, 3, 4, 3, 3, 2, 2, Padding::same, true},     // stride 2: rows 0 before 1 after, columns 1 and 1
      {5, 7, 9, 2, 5, 4, 3, 2, 1, Padding::same, true},     // rows asymmetric with stride 2, columns symmetric
      {1, 7, 9, 4, 6, 4, 4, 2, 2, Padding::valid, false},   // valid, stride 2, unused last row and column
      {3, 6, 6, 8, 16, 1, 1, 2, 2, Padding::same, true},    // 1x1 kernel, stride 2: no padding
      {5, 16, 16, 16, 32, 3, 3, 1, 1, Padding::same, true}, // enough channels for cuDNN's real algorithms
      {4, 28, 28, 1, 32, 3, 3, 1, 1, Padding::valid, true}, // the seed CNN's first layer: one input channel
  };
  auto& ctx = gpu();
  using Method = cuda::Conv2dCore::Method;
  for (const Method method : {Method::cudnn, Method::gemm, Method::automatic}) {
    std::uint32_t seed = 100;
    for (const ConvCase& t : cases) {
      CAPTURE(static_cast<int>(method));
      CAPTURE(t.n);
      CAPTURE(t.h);
      CAPTURE(t.w);
      CAPTURE(t.c);
      CAPTURE(t.f);
      CAPTURE(t.kh);
      CAPTURE(t.kw);
      CAPTURE(t.sh);
      CAPTURE(t.sw);
      CAPTURE(t.padding == Padding::same);
      CAPTURE(t.bias);
      const cuda::Conv2dGeometry g =
          cuda::conv2d_geometry(t.n, t.h, t.w, t.c, t.f, t.kh, t.kw, t.sh, t.sw, t.padding);
      const auto nx = static_cast<std::size_t>(g.x_elements()), nk = static_cast<std::size_t>(g.kernel_elements()),
                 ny = static_cast<std::size_t>(g.y_elements()), nb = static_cast<std::size_t>(g.f);
      const auto x = uniform(nx, -1, 1, seed++), k = uniform(nk, -1, 1, seed++), b = uniform(nb, -1, 1, seed++),
                 dy = uniform(ny, -1, 1, seed++);

      // The oracle, in double.
      const nn::reference::ConvDims d{g.n, g.h,     g.w,     g.c,            g.f,           g.kh, g.kw,
                                      g.sh, g.sw,   g.oh(), g.ow(),         g.pad_h.before, g.pad_w.before};
      const auto xd = widen(x), kd = widen(k), bd = widen(b), dyd = widen(dy);
      std::vector<double> y_ref(ny), dx_ref(nx), dk_ref(nk), db_ref(nb);
      nn::reference::conv2d_forward(xd.data(), kd.data(), t.bias ? bd.data() : nullptr, y_ref.data(), d);
      nn::reference::conv2d_backward(xd.data(), kd.data(), dyd.data(), dx_ref.data(), dk_ref.data(),
                                     t.bias ? db_ref.data() : nullptr, d);

      cuda::Conv2dCore core(ctx, g, t.bias, cuda::Conv2dCore::kDefaultWorkspaceLimit, method);
      MESSAGE("conv2d core: " << core.describe());
      CHECK(core.gemm() == (method != Method::cudnn));  // these shapes' columns fit
      // Preferred, not promised: cuDNN may offer no deterministic algorithm for a pass.
      WARN(core.deterministic());
      device::Buffer d_x = upload(x), d_k = upload(k), d_b = upload(b), d_dy = upload(dy);
      device::Buffer d_y = ctx.allocate(ny * sizeof(float)), d_dx = ctx.allocate(nx * sizeof(float)),
                     d_dk = ctx.allocate(nk * sizeof(float)), d_db = ctx.allocate(nb * sizeof(float));
      auto step = [&] {
        core.set_kernel(ptr<float>(d_k));
        core.forward(ptr<float>(d_x), t.bias ? ptr<float>(d_b) : nullptr, ptr<float>(d_y));
        core.backward_data(ptr<float>(d_dy), ptr<float>(d_dx));
        core.backward_filter(ptr<float>(d_x), ptr<float>(d_dy), ptr<float>(d_dk), t.bias ? ptr<float>(d_db) : nullptr);
        ctx.synchronize();
      };
      step();
      const auto y1 = download<float>(d_y, ny), dx1 = download<float>(d_dx, nx), dk1 = download<float>(d_dk, nk),
                 db1 = download<float>(d_db, nb);
      compare_to_reference("conv2d y", y1, y_ref, g.kh * g.kw * g.c + 1);
      compare_to_reference("conv2d dx", dx1, dx_ref, g.kh * g.kw * g.f);
      compare_to_reference("conv2d dk", dk1, dk_ref, g.n * g.oh() * g.ow());
      if (t.bias) compare_to_reference("conv2d db", db1, db_ref, g.n * g.oh() * g.ow());

      // The second identical step: no allocation at all, and (deterministic algorithms) the same bits.
      step_allocates_nothing(ctx, step);
      if (core.deterministic()) {
        CHECK(same_bits(download<float>(d_y, ny), y1));
        CHECK(same_bits(download<float>(d_dx, nx), dx1));
        CHECK(same_bits(download<float>(d_dk, nk), dk1));
        if (t.bias) CHECK(same_bits(download<float>(d_db, nb), db1));
      }
    }
  }
}

TEST_CASE("dense core on the GPU: forward, dx, dk and db against the reference, and a second step allocates nothing") {
  const DenseCase cases[] = {{1, 7, 5, true}, {5, 33, 17, false}, {5, 1, 1, true}, {64, 300, 129, true}};
  auto& ctx = gpu();
  std::uint32_t seed = 200;
  for (const DenseCase& t : cases) {
    CAPTURE(t.batch);
    CAPTURE(t.in);
    CAPTURE(t.out);
    CAPTURE(t.bias);
    const std::size_t nx = t.nx(), nk = t.nk(), ny = t.ny(), nb = t.nb();
    const auto x = uniform(nx, -1, 1, seed++), k = uniform(nk, -1, 1, seed++), b = uniform(nb, -1, 1, seed++),
               dy = uniform(ny, -1, 1, seed++);
    const DenseReference ref = dense_reference(t, x, k, b, dy);

    cuda::DenseCore core(ctx, t.batch, t.in, t.out, t.bias);
    device::Buffer d_x = upload(x), d_k = upload(k), d_b = upload(b), d_dy = upload(dy);
    device::Buffer d_y = ctx.allocate(ny * sizeof(float)), d_dx = ctx.allocate(nx * sizeof(float)),
                   d_dk = ctx.allocate(nk * sizeof(float)), d_db = ctx.allocate(nb * sizeof(float));
    auto step = [&] {
      core.forward(ptr<float>(d_x), ptr<float>(d_k), t.bias ? ptr<float>(d_b) : nullptr, ptr<float>(d_y));
      core.backward_data(ptr<float>(d_dy), ptr<float>(d_k), ptr<float>(d_dx));
      core.backward_weights(ptr<float>(d_x), ptr<float>(d_dy), ptr<float>(d_dk), t.bias ? ptr<float>(d_db) : nullptr);
      ctx.synchronize();
    };
    step();
    const auto y1 = download<float>(d_y, ny), dx1 = download<float>(d_dx, nx), dk1 = download<float>(d_dk, nk),
               db1 = download<float>(d_db, nb);
    compare_to_reference("dense y", y1, ref.y, t.in + 1);
    compare_to_reference("dense dx", dx1, ref.dx, t.out);
    compare_to_reference("dense dk", dk1, ref.dk, t.batch);
    if (t.bias) compare_to_reference("dense db", db1, ref.db, t.batch);

    step_allocates_nothing(ctx, step);
    CHECK(same_bits(download<float>(d_y, ny), y1));
    CHECK(same_bits(download<float>(d_dx, nx), dx1));
    CHECK(same_bits(download<float>(d_dk, nk), dk1));
    if (t.bias) CHECK(same_bits(download<float>(d_db, nb), db1));
  }
}

TEST_CASE("dense core in bfloat16 on the GPU: y and dx within bfloat16's rounding, dk and db in float32") {
  if (!gpu().cannot_compute_in(DType::bf16).empty()) {
    MESSAGE("skipped: " << gpu().cannot_compute_in(DType::bf16));
    return;
  }
  const DenseCase cases[] = {{1, 7, 5, true}, {5, 33, 17, false}, {64, 300, 129, true}};
  auto& ctx = gpu();
  std::uint32_t seed = 300;
  for (const DenseCase& t : cases) {
    CAPTURE(t.batch);
    CAPTURE(t.in);
    CAPTURE(t.out);
    CAPTURE(t.bias);
    const std::size_t nx = t.nx(), nk = t.nk(), ny = t.ny(), nb = t.nb();
    const auto x = to_bf16(uniform(nx, -1, 1, seed++)), k = to_bf16(uniform(nk, -1, 1, seed++)),
               dy = to_bf16(uniform(ny, -1, 1, seed++));
    const auto b = uniform(nb, -1, 1, seed++);
    const DenseReference ref = dense_reference(t, from_bf16(x), from_bf16(k), b, from_bf16(dy));

    cuda::DenseCoreBf16 core(ctx, t.batch, t.in, t.out, t.bias);
    device::Buffer d_x = upload(x), d_k = upload(k), d_b = upload(b), d_dy = upload(dy);
    device::Buffer d_y = ctx.allocate(ny * 2), d_dx = ctx.allocate(nx * 2), d_dk = ctx.allocate(nk * sizeof(float)),
                   d_db = ctx.allocate(nb * sizeof(float));
    auto step = [&] {
      using bits = std::uint16_t;
      core.forward(ptr<bits>(d_x), ptr<bits>(d_k), t.bias ? ptr<float>(d_b) : nullptr, ptr<bits>(d_y));
      core.backward_data(ptr<bits>(d_dy), ptr<bits>(d_k), ptr<bits>(d_dx));
      core.backward_weights(ptr<bits>(d_x), ptr<bits>(d_dy), ptr<float>(d_dk), t.bias ? ptr<float>(d_db) : nullptr);
      ctx.synchronize();
    };
    step();
    const auto y1 = download<std::uint16_t>(d_y, ny), dx1 = download<std::uint16_t>(d_dx, nx);
    const auto dk1 = download<float>(d_dk, nk), db1 = download<float>(d_db, nb);
    // bfloat16 outputs: rounding to nearest errs by at most 2^-8 relative (3.9e-3).
    compare_to_reference("bf16 dense y", from_bf16(y1), ref.y, t.in + 1, 4e-3);
    compare_to_reference("bf16 dense dx", from_bf16(dx1), ref.dx, t.out, 4e-3);
    // float32 outputs of exact bfloat16 products, summed on tensor cores in float32.
    compare_to_reference("bf16 dense dk", dk1, ref.dk, t.batch, 1e-4);
    if (t.bias) compare_to_reference("bf16 dense db", db1, ref.db, t.batch, 1e-4);

    const cuda::AllocatorStats before = ctx.allocator_stats();
    step();
    const cuda::AllocatorStats after = ctx.allocator_stats();
    CHECK(after.device_mallocs == before.device_mallocs);
    CHECK(after.cache_hits == before.cache_hits);
    CHECK(download<std::uint16_t>(d_y, ny) == y1);
    CHECK(download<std::uint16_t>(d_dx, nx) == dx1);
    CHECK(same_bits(download<float>(d_dk, nk), dk1));
  }
}
