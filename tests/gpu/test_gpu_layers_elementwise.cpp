// The CUDA layer cores of elementwise_cores.hpp (pooling, activations, dropout, batch
// normalization) on the GPU against the reference oracle (nn/reference/, in double) on small odd
// shapes: N 1 and 3, H 7, W 9, C 5; pools 2, 3 and 2x3, strides 1 and 2, valid and same.
// Floats within 1e-5 relative (gpu_support.hpp's compare); max pooling and dropout exactly (the
// reference in float, bit for bit), dropout masks bit-identical to the CPU's (nn::dropout_mask) for
// the same key, batch-norm statistics within 1e-5 of the oracle and the same bits on a repeat run.
#include <cstdint>
#include <cstring>
#include <vector>

#include <fmt/format.h>

#include "backends/cuda/elementwise_cores.hpp"
#include "gpu_support.hpp"
#include "nn/dropout.hpp"
#include "nn/padding.hpp"
#include "nn/reference/average_pooling.hpp"
#include "nn/reference/batch_normalization.hpp"
#include "nn/reference/dropout.hpp"
#include "nn/reference/layers.hpp"

using namespace dtrain;
using namespace dtrain::gpu_testing;
namespace cuda = dtrain::backends::cuda;
using config::Activation;
using config::Padding;
using nn::reference::PoolDims;

namespace {

std::vector<double> widen(const std::vector<float>& v) { return {v.begin(), v.end()}; }
std::vector<float> narrow(const std::vector<double>& v) {
  std::vector<float> f(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) f[i] = static_cast<float>(v[i]);
  return f;
}

// Exactly the expected bits.
void exact(const char* what, const std::vector<float>& gpu, const std::vector<float>& expected) {
  REQUIRE(gpu.size() == expected.size());
  std::size_t differ = 0;
  for (std::size_t k = 0; k < gpu.size(); ++k) {
    if (std::memcmp(&gpu[k], &expected[k], sizeof(float)) == 0) continue;
    if (differ++ < 3) FAIL_CHECK(what << "[" << k << "]: gpu " << gpu[k] << ", expected " << expected[k]);
  }
  MESSAGE(what << ": " << gpu.size() << " values, " << differ << " with other bits");
  CHECK_MESSAGE(differ == 0, what);
}

// Small integers: ties inside the max pooling windows (the first maximum must win).
std::vector<float> with_ties(std::size_t n, std::uint32_t seed) {
  std::vector<float> v = uniform(n, -3.5f, 3.5f, seed);
  for (float& x : v) x = static_cast<float>(static_cast<int>(x));
  return v;
}

PoolDims pool_dims(std::int64_t n, std::int64_t ph, std::int64_t pw, std::int64_t s, Padding padding) {
  const std::int64_t h = 7, w = 9, c = 5;
  const nn::Padding1D py = nn::padding_1d(h, ph, s, padding), px = nn::padding_1d(w, pw, s, padding);
  return {n, h, w, c, ph, pw, s, s, py.out, px.out, py.before, px.before};
}

std::vector<PoolDims> geometries() {
  std::vector<PoolDims> all;
  for (const std::int64_t n : {1, 3})
    for (const Padding padding : {Padding::valid, Padding::same})
      for (const auto& [ph, pw] : {std::pair<std::int64_t, std::int64_t>{2, 2}, {3, 3}, {2, 3}})
        for (const std::int64_t s : {1, 2}) all.push_back(pool_dims(n, ph, pw, s, padding));
  return all;
}

std::string describe(const PoolDims& d) {
  return fmt::format("N {} pool {}x{} stride {} padding top {} left {} -> {}x{}", d.n, d.ph, d.pw, d.sh, d.pad_top,
                     d.pad_left, d.oh, d.ow);
}

}  // namespace

TEST_CASE("GPU pooling cores: max, average and global average pooling, forward and backward, against the oracle") {
  auto& ctx = gpu();
  for (const PoolDims& d : geometries()) {
    CAPTURE(describe(d));
    const std::size_t in = static_cast<std::size_t>(d.n * d.h * d.w * d.c);
    const std::size_t out = static_cast<std::size_t>(d.n * d.oh * d.ow * d.c);
    const std::vector<float> dy = uniform(out, -1, 1, 2);
    device::Buffer ddy = upload(dy), dy_out = ctx.allocate(out * sizeof(float)), ddx = ctx.allocate(in * sizeof(float));
    {  // max pooling: exact (values move; gradients add in the reference's order)
      const std::vector<float> x = with_ties(in, 1);
      device::Buffer dxin = upload(x), argmax = ctx.allocate(out * sizeof(std::int32_t));
      cuda::max_pool2d_forward(ctx, d, ptr<float>(dxin), ptr<float>(dy_out), ptr<std::int32_t>(argmax));
      cuda::max_pool2d_backward(ctx, d, ptr<float>(ddy), ptr<std::int32_t>(argmax), ptr<float>(ddx));
      std::vector<double> y_ref(out), dx_ref(in);
      nn::reference::max_pool2d_forward(widen(x).data(), y_ref.data(), d);
      nn::reference::max_pool2d_backward(widen(x).data(), widen(dy).data(), dx_ref.data(), d);
      std::vector<float> dx_ref_f(in);
      nn::reference::max_pool2d_backward(x.data(), dy.data(), dx_ref_f.data(), d);
      exact("max pool forward", download<float>(dy_out, out), narrow(y_ref));
      exact("max pool backward (the reference in float)", download<float>(ddx, in), dx_ref_f);
      compare("max pool backward", download<float>(ddx, in), narrow(dx_ref));
    }
    {  // average pooling (padding excluded from the divisor)
      const std::vector<float> x = uniform(in, -1, 1, 3);
      device::Buffer dxin = upload(x);
      cuda::average_pool2d_forward(ctx, d, ptr<float>(dxin), ptr<float>(dy_out));
      cuda::average_pool2d_backward(ctx, d, ptr<float>(ddy), ptr<float>(ddx));
      std::vector<double> y_ref(out), dx_ref(in);
      nn::reference::average_pool2d_forward(widen(x).data(), y_ref.data(), d);
      nn::reference::average_pool2d_backward(widen(dy).data(), dx_ref.data(), d);
      compare("average pool forward", download<float>(dy_out, out), narrow(y_ref));
      compare("average pool backward", download<float>(ddx, in), narrow(dx_ref));
    }
  }
  for (const std::int64_t n : {1, 3}) {
    CAPTURE(n);
    const std::int64_t h = 7, w = 9, c = 5;
    const std::size_t in = static_cast<std::size_t>(n * h * w * c), out = static_cast<std::size_t>(n * c);
    const std::vector<float> x = uniform(in, -1, 1, 4), dy = uniform(out, -1, 1, 5);
    device::Buffer dxin = upload(x), ddy = upload(dy), dy_out = ctx.allocate(out * sizeof(float)),
                   ddx = ctx.allocate(in * sizeof(float));
    cuda::global_average_pool2d_forward(ctx, n, h, w, c, ptr<float>(dxin), ptr<float>(dy_out));
    cuda::global_average_pool2d_backward(ctx, n, h, w, c, ptr<float>(ddy), ptr<float>(ddx));
    std::vector<double> y_ref(out), dx_ref(in);
    nn::reference::global_average_pool2d_forward(widen(x).data(), y_ref.data(), n, h, w, c);
    nn::reference::global_average_pool2d_backward(widen(dy).data(), dx_ref.data(), n, h, w, c);
    compare("global average pool forward", download<float>(dy_out, out), narrow(y_ref));
    compare("global average pool backward", download<float>(ddx, in), narrow(dx_ref));
  }
}

TEST_CASE("GPU activation cores: every activation forward and backward against the oracle, in place too") {
  auto& ctx = gpu();
  for (const std::int64_t n : {1, 3}) {
    // (N, 7, 9, 5): softmax over the 5 channels of each of N * 63 rows.
    const std::int64_t cols = 5, size = n * 7 * 9 * cols;
    const auto count = static_cast<std::size_t>(size);
    const std::vector<float> z = uniform(count, -6, 6, 6), dy = uniform(count, -1, 1, 7);
    for (const Activation a :
         {Activation::linear, Activation::relu, Activation::sigmoid, Activation::tanh, Activation::softmax}) {
      CAPTURE(n);
      CAPTURE(static_cast<int>(a));
      std::vector<double> y_ref = widen(z), dz_ref(count);
      nn::reference::activation_forward(a, y_ref.data(), size, cols);
      nn::reference::activation_backward(a, y_ref.data(), widen(dy).data(), dz_ref.data(), size, cols);
      // The backward from the reference's output (rounded to float), so that it tests the
      // derivative alone.
      const std::vector<float> y_in = narrow(y_ref);
      device::Buffer dz_in = upload(z), ddy = upload(dy), dyv = upload(y_in), dy_out = ctx.allocate(count * 4),
                     ddz = ctx.allocate(count * 4);
      cuda::activation_forward(ctx, a, ptr<float>(dz_in), ptr<float>(dy_out), size, cols);
      cuda::activation_backward(ctx, a, ptr<float>(dyv), ptr<float>(ddy), ptr<float>(ddz), size, cols);
      compare("activation forward", download<float>(dy_out, count), y_in);
      std::vector<double> dz_from_float(count);
      nn::reference::activation_backward(a, widen(y_in).data(), widen(dy).data(), dz_from_float.data(), size, cols);
      compare("activation backward", download<float>(ddz, count), narrow(dz_from_float));
      compare("activation backward (from the exact output)", download<float>(ddz, count), narrow(dz_ref));
      // In place: y over z, dz over dy.
      cuda::activation_forward(ctx, a, ptr<float>(dz_in), ptr<float>(dz_in), size, cols);
      cuda::activation_backward(ctx, a, ptr<float>(dyv), ptr<float>(ddy), ptr<float>(ddy), size, cols);
      exact("activation forward in place", download<float>(dz_in, count), download<float>(dy_out, count));
      exact("activation backward in place", download<float>(ddy, count), download<float>(ddz, count));
    }
  }
}

TEST_CASE("GPU dropout cores: the CPU's masks bit for bit, forward and backward exactly, inference the identity") {
  auto& ctx = gpu();
  const std::int64_t elements = 7 * 9 * 5;
  for (const std::int64_t batch : {1, 3}) {
    for (const double rate : {0.1, 0.5, 0.9}) {
      for (const bool with_ids : {false, true}) {
        CAPTURE(batch);
        CAPTURE(rate);
        CAPTURE(with_ids);
        const cuda::DropoutKey key{.seed = 0x5eed0000beefull, .global_step = 12345, .layer = 3, .rate = rate};
        std::vector<std::int64_t> ids(static_cast<std::size_t>(batch));
        for (std::int64_t i = 0; i < batch; ++i) ids[static_cast<std::size_t>(i)] = with_ids ? 1000 * i + 77 : i;
        const auto count = static_cast<std::size_t>(batch * elements);
        std::vector<std::uint8_t> cpu_mask(count);
        for (std::int64_t i = 0; i < batch; ++i)
          nn::dropout_mask(key.seed, key.global_step, ids[static_cast<std::size_t>(i)], key.layer, rate, elements,
                           cpu_mask.data() + i * elements);
        device::Buffer dids = upload(ids);
        const std::int64_t* ids_on_gpu = with_ids ? ptr<std::int64_t>(dids) : nullptr;
        device::Buffer mask = ctx.allocate(count), keep = ctx.allocate(count);
        cuda::dropout_mask(ctx, key, ids_on_gpu, batch, elements, ptr<std::uint8_t>(mask));
        CHECK(download<std::uint8_t>(mask, count) == cpu_mask);

        const std::vector<float> x = uniform(count, -2, 2, 8), dy = uniform(count, -1, 1, 9);
        std::vector<float> y_ref(count), dx_ref(count);
        nn::reference::dropout_forward(x.data(), cpu_mask.data(), y_ref.data(), static_cast<std::int64_t>(count), rate);
        nn::reference::dropout_backward(dy.data(), cpu_mask.data(), dx_ref.data(), static_cast<std::int64_t>(count),
                                        rate);
        device::Buffer dxin = upload(x), ddy = upload(dy), dy_out = ctx.allocate(count * 4),
                       ddx = ctx.allocate(count * 4);
        cuda::dropout_forward(ctx, key, true, ids_on_gpu, batch, elements, ptr<float>(dxin), ptr<float>(dy_out),
                              ptr<std::uint8_t>(keep));
        CHECK(download<std::uint8_t>(keep, count) == cpu_mask);
        cuda::dropout_backward(ctx, rate, ptr<std::uint8_t>(keep), ptr<float>(ddy), ptr<float>(ddx),
                               static_cast<std::int64_t>(count));
        exact("dropout forward", download<float>(dy_out, count), y_ref);
        exact("dropout backward", download<float>(ddx, count), dx_ref);
        compare("dropout forward (the oracle in double)", download<float>(dy_out, count), y_ref);
        // Inference: the identity, the mask untouched.
        cuda::dropout_forward(ctx, key, false, ids_on_gpu, batch, elements, ptr<float>(dxin), ptr<float>(dy_out),
                              nullptr);
        exact("dropout in inference", download<float>(dy_out, count), x);
        // In place.
        cuda::dropout_forward(ctx, key, true, ids_on_gpu, batch, elements, ptr<float>(dxin), ptr<float>(dxin),
                              nullptr);
        exact("dropout forward in place", download<float>(dxin, count), y_ref);
      }
    }
  }
  // Rate 0: the identity whatever the mode.
  const std::vector<float> x = uniform(elements, -1, 1, 10);
  device::Buffer dxin = upload(x), dy_out = ctx.allocate(x.size() * 4);
  cuda::dropout_forward(ctx, cuda::DropoutKey{.seed = 1, .global_step = 2, .layer = 0, .rate = 0.0}, true, nullptr, 1,
                        elements, ptr<float>(dxin), ptr<float>(dy_out), nullptr);
  exact("dropout rate 0", download<float>(dy_out, x.size()), x);
  cuda::dropout_backward(ctx, 0.0, nullptr, ptr<float>(dxin), ptr<float>(dy_out), elements);
  exact("dropout backward rate 0", download<float>(dy_out, x.size()), x);
}

namespace {

// One batch-norm case on m rows x c channels: training statistics and forward, backward in both
// forms, inference forward, the moving-average update; all against the oracle in double.
struct BatchNormRun {
  std::vector<float> mean, variance, inv_std, mean_contribution, y, dx, dgamma, dbeta;
};

BatchNormRun run_batch_norm(const std::vector<float>& x, const std::vector<float>& dy, const std::vector<float>& gamma,
                            const std::vector<float>& beta, std::int64_t m, std::int64_t c, double epsilon) {
  auto& ctx = gpu();
  const auto C = static_cast<std::size_t>(c), count = static_cast<std::size_t>(m * c);
  device::Buffer dx_in = upload(x), ddy = upload(dy), dgamma_in = upload(gamma), dbeta_in = upload(beta);
  device::Buffer mean = ctx.allocate(C * 4), variance = ctx.allocate(C * 4), inv_std = ctx.allocate(C * 4),
                 contribution = ctx.allocate(C * 4), y = ctx.allocate(count * 4), dx = ctx.allocate(count * 4),
                 dgamma = ctx.allocate(C * 4), dbeta = ctx.allocate(C * 4),
                 workspace = ctx.allocate(cuda::batch_norm_workspace_bytes(m, c));
  cuda::BatchNormStatistics out;
  out.mean = ptr<float>(mean);
  out.variance = ptr<float>(variance);
  out.inv_std = ptr<float>(inv_std);
  out.mean_contribution = ptr<float>(contribution);
  out.weight = 0.25;
  cuda::batch_norm_statistics(ctx, ptr<float>(dx_in), m, c, epsilon, out, workspace.get());
  cuda::batch_norm_forward(ctx, ptr<float>(dx_in), m, c, ptr<float>(mean), ptr<float>(inv_std), ptr<float>(dgamma_in),
                           ptr<float>(dbeta_in), ptr<float>(y));
  cuda::batch_norm_backward(ctx, true, ptr<float>(dx_in), ptr<float>(ddy), m, c, ptr<float>(mean), ptr<float>(inv_std),
                            ptr<float>(dgamma_in), ptr<float>(dx), ptr<float>(dgamma), ptr<float>(dbeta),
                            workspace.get());
  return {download<float>(mean, C),       download<float>(variance, C), download<float>(inv_std, C),
          download<float>(contribution, C), download<float>(y, count),    download<float>(dx, count),
          download<float>(dgamma, C),     download<float>(dbeta, C)};
}

void check_batch_norm(std::int64_t m, std::int64_t c) {
  CAPTURE(m);
  CAPTURE(c);
  auto& ctx = gpu();
  const double epsilon = 1e-3;
  const auto C = static_cast<std::size_t>(c), count = static_cast<std::size_t>(m * c);
  // An offset mean: the two-pass variance must not cancel.
  const std::vector<float> x = uniform(count, 2.0f, 5.0f, 11), dy = uniform(count, -1, 1, 12);
  const std::vector<float> gamma = uniform(C, 0.5f, 1.5f, 13), beta = uniform(C, -1, 1, 14);
  const BatchNormRun first = run_batch_norm(x, dy, gamma, beta, m, c, epsilon);

  std::vector<double> mean(C), variance(C), y(count), dx(count), dgamma(C), dbeta(C), contribution(C);
  const std::vector<double> xd = widen(x), dyd = widen(dy), gd = widen(gamma), bd = widen(beta);
  nn::reference::batch_norm_statistics(xd.data(), m, c, mean.data(), variance.data());
  nn::reference::batch_norm_forward(xd.data(), m, c, mean.data(), variance.data(), gd.data(), bd.data(), epsilon,
                                    y.data());
  nn::reference::batch_norm_backward_training(xd.data(), dyd.data(), m, c, mean.data(), variance.data(), gd.data(),
                                              epsilon, dx.data(), dgamma.data(), dbeta.data());
  std::vector<double> inv_std(C);
  for (std::size_t k = 0; k < C; ++k) {
    inv_std[k] = 1.0 / std::sqrt(variance[k] + epsilon);
    contribution[k] = mean[k] * 0.25;
  }
  compare("batch norm mean", first.mean, narrow(mean));
  compare("batch norm variance", first.variance, narrow(variance));
  compare("batch norm inv_std", first.inv_std, narrow(inv_std));
  compare("batch norm mean contribution", first.mean_contribution, narrow(contribution));
  compare("batch norm training forward", first.y, narrow(y));
  compare("batch norm training dx", first.dx, narrow(dx));
  compare("batch norm dgamma", first.dgamma, narrow(dgamma));
  compare("batch norm dbeta", first.dbeta, narrow(dbeta));

  // Determinism: a second run gives the same bits.
  const BatchNormRun second = run_batch_norm(x, dy, gamma, beta, m, c, epsilon);
  exact("batch norm mean, repeated", second.mean, first.mean);
  exact("batch norm variance, repeated", second.variance, first.variance);
  exact("batch norm training forward, repeated", second.y, first.y);
  exact("batch norm training dx, repeated", second.dx, first.dx);
  exact("batch norm dgamma, repeated", second.dgamma, first.dgamma);
  exact("batch norm dbeta, repeated", second.dbeta, first.dbeta);

  // Inference: the moving statistics, constants for the gradient; gamma and beta absent too.
  const std::vector<float> moving_mean = uniform(C, -0.5f, 0.5f, 15), moving_var = uniform(C, 0.5f, 1.5f, 16);
  device::Buffer dmm = upload(moving_mean), dmv = upload(moving_var), dxin = upload(x), ddy = upload(dy),
                 dg = upload(gamma), db = upload(beta), inv = ctx.allocate(C * 4), dyo = ctx.allocate(count * 4),
                 ddx = ctx.allocate(count * 4), dgam = ctx.allocate(C * 4), dbet = ctx.allocate(C * 4),
                 workspace = ctx.allocate(cuda::batch_norm_workspace_bytes(m, c));
  for (const bool affine : {true, false}) {
    CAPTURE(affine);
    const float* g = affine ? ptr<float>(dg) : nullptr;
    cuda::batch_norm_inv_std(ctx, ptr<float>(dmv), c, epsilon, ptr<float>(inv));
    cuda::batch_norm_forward(ctx, ptr<float>(dxin), m, c, ptr<float>(dmm), ptr<float>(inv), g,
                             affine ? ptr<float>(db) : nullptr, ptr<float>(dyo));
    cuda::batch_norm_backward(ctx, false, ptr<float>(dxin), ptr<float>(ddy), m, c, ptr<float>(dmm), ptr<float>(inv), g,
                              ptr<float>(ddx), ptr<float>(dgam), ptr<float>(dbet), workspace.get());
    const std::vector<double> mmd = widen(moving_mean), mvd = widen(moving_var);
    nn::reference::batch_norm_forward(xd.data(), m, c, mmd.data(), mvd.data(), affine ? gd.data() : nullptr,
                                      affine ? bd.data() : nullptr, epsilon, y.data());
    nn::reference::batch_norm_backward_inference(xd.data(), dyd.data(), m, c, mmd.data(), mvd.data(),
                                                 affine ? gd.data() : nullptr, epsilon, dx.data(), dgamma.data(),
                                                 dbeta.data());
    compare("batch norm inference forward", download<float>(dyo, count), narrow(y));
    compare("batch norm inference dx", download<float>(ddx, count), narrow(dx));
    compare("batch norm inference dgamma", download<float>(dgam, C), narrow(dgamma));
    compare("batch norm inference dbeta", download<float>(dbet, C), narrow(dbeta));
  }

  // The moving averages.
  const double momentum = 0.99;
  cuda::batch_norm_moving_average(ctx, ptr<float>(dmv), ptr<float>(dmm), c, momentum);
  std::vector<float> moving_ref = moving_var;
  nn::reference::moving_average_update(moving_ref.data(), moving_mean.data(), c, momentum);
  exact("batch norm moving average (the reference in float)", download<float>(dmv, C), moving_ref);
}

}  // namespace

TEST_CASE("GPU batch normalization cores: statistics, training and inference forms, moving averages, determinism") {
  // (N, 7, 9, 5) with N 1 and 3; then (N, C) rows; then many rows (every row range of the
  // reduction used) and more channels than one block's 32.
  check_batch_norm(1 * 7 * 9, 5);
  check_batch_norm(3 * 7 * 9, 5);
  check_batch_norm(3, 5);
  check_batch_norm(64 * 16 * 16, 37);
}
