// oneDNN layers against the reference layers, and the reference layers against finite
// differences. Shapes are drawn to cover strides, both paddings (odd sizes make 'same' pad
// asymmetrically), every activation, and stacks where oneDNN's blocked layouts meet.
#include <doctest/doctest.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <functional>
#include <optional>
#include <span>
#include <thread>
#include <utility>
#include <vector>
#include <string>

#include <fmt/format.h>

#include "backends/onednn/weighted_op.hpp"
#include "core/rng.hpp"
#include "core/shared_work.hpp"
#include "layer_oracle.hpp"
#include "nn/activation.hpp"
#include "nn/average_pooling2d.hpp"
#include "nn/batch_normalization.hpp"
#include "nn/dropout.hpp"
#include "nn/global_average_pooling2d.hpp"
#include "nn/conv2d.hpp"
#include "nn/dense.hpp"
#include "nn/max_pool2d.hpp"
#include "nn/model.hpp"
#include "nn/registry.hpp"
#include "nn/reshape.hpp"
#include "loop_levels.hpp"
#include "random_models.hpp"
#include "test_support.hpp"

using namespace dtrain;
using testing::bf16_value;
using testing::cpu_has_bf16;
using testing::RefStack;
using testing::Vec;
using config::Activation;
using config::Padding;

namespace {

using testing::distance;
using testing::norm;

double rel_err(const Vec<double>& a, const Vec<double>& b) { return distance(a, b) / std::max(norm(b), 1e-30); }

Vec<double> to_double(const Tensor& t) {
  auto s = t.span<float>();
  return Vec<double>(s.begin(), s.end());
}

// A layer of a test case: its kind comes from its options' type.
struct L {
  template <class Options>
  L(Options o) : config(nn::layer_config("", std::move(o))) {}  // NOLINT: test shorthand
  explicit L(config::LayerConfig c) : config(std::move(c)) {}
  config::LayerConfig config;
};

config::LayerConfig named(L l, std::string name) {
  l.config.name = std::move(name);
  return l.config;
}

struct Case {
  std::string label;
  Shape input;  // per example
  std::vector<L> layers;
  std::int64_t batch;
  nn::Mode mode = nn::Mode::training;
  DType compute = DType::f32;
  double gradient_tolerance = 0;  // 0: the compute dtype's (tolerance())
  // Whether the model computes d(loss)/d(input), as a layer below would want it. Without it a
  // first convolution may compute the max pooling above it (nn::Sequential::computed_by_layer_below).
  bool input_gradient = true;
  // The layers each model must compute with the one below (computed_by_layer_below), checked.
  std::vector<std::size_t> computed_below = {};
  // Where given, the layers whose backward (forward) must move nothing (backward_moves_nothing,
  // forward_moves_nothing), checked once the model has planned its layouts.
  std::optional<std::vector<std::size_t>> backward_moves_nothing = std::nullopt;
  std::optional<std::vector<std::size_t>> forward_moves_nothing = std::nullopt;
  // Where given, the layers whose output's gradient the layer above writes over that output
  // (gradient_over_output), checked at the case's batch.
  std::optional<std::vector<std::size_t>> gradient_over_output = std::nullopt;
  // A generated model (random_models.hpp), compared within these tolerances: which layers fuse
  // is the model's to choose; its kernels keep their initial values and the rest is drawn
  // (draw_offsets); gradients are measured against the largest of their layer's; no finite
  // differences (across a relu's kink or a pooling window's tie they test the draw, not the
  // oracle), and none of the gradients where a pooling window nearly ties.
  std::optional<testing::RandomModelTolerances> generated = std::nullopt;
};

// bfloat16 keeps 8 significant bits: one rounding is 2^-9 relative, and a layer rounds its
// inputs, its weights and its output. f32 kernels agree with the oracle to float's precision.
double tolerance(DType compute) { return compute == DType::bf16 ? 2e-2 : 1e-5; }

// With relu, max pooling and batch statistics in bfloat16, a rounding that flips a relu's sign,
// the argmax of a pooling window (bfloat16 makes near-ties exact ties) or a normalised value sends
// that element's whole gradient elsewhere: the gradients of the layers below differ by several
// percent (measured: up to 12 % on the seed CNN; 2.7 % on a first convolution under a max pooling,
// on a Sapphire Rapids Xeon). Forward outputs still agree to 2e-2; a wrong layout or weight order
// would be off by 100 %.
constexpr double kBf16RoutedGradientTolerance = 0.2;

// Every variable of `model` drawn from `rng`, in [-1, 1]; a variance in [0.5, 1.5] (positive).
void randomize_variables(nn::Sequential& model, Rng& rng) {
  for (std::size_t l = 0; l < model.num_layers(); ++l)
    for (auto& v : model.layer(l).variables()) {
      const bool variance = v.name.ends_with("moving_variance");
      for (float& value : v.value.span<float>()) value = variance ? rng.uniform(0.5f, 1.5f) : rng.uniform(-1.0f, 1.0f);
    }
}

// Runs one case: the backend vs the oracle (to the compute dtype's precision) for outputs, every
// gradient and dx; then a finite-difference check of the oracle in double (f32 cases: the
// oracle does not depend on the dtype the backend computes in).
void check_case(const Case& c, device::Context& ctx = testing::cpu()) {
  CAPTURE(c.label);
  CAPTURE(std::string(dtype_name(c.compute)));
  const double tol = c.generated ? c.generated->outputs : tolerance(c.compute);
  const double grad_tol = c.generated ? c.generated->gradients : c.gradient_tolerance > 0 ? c.gradient_tolerance : tol;
  config::ModelConfig mc;
  mc.input_shape = c.input.to_vector();
  for (std::size_t i = 0; i < c.layers.size(); ++i) mc.layers.push_back(named(c.layers[i], fmt::format("l{}", i)));
  nn::Sequential model(mc, 7, ctx, nn::ModelOptions{.compute = c.compute, .input_gradient = c.input_gradient});
  for (std::size_t l = 0; l < model.num_layers(); ++l) {
    CAPTURE(l);
    const bool expected = std::find(c.computed_below.begin(), c.computed_below.end(), l) != c.computed_below.end();
    if (!c.generated) CHECK(model.computed_by_layer_below(l) == expected);
  }
  const nn::StepContext step = testing::step_of(c.mode, c.batch);
  Rng rng(11, RngStream::test);

  // Random variables (biases too: zero biases would hide bias bugs), shared by both paths.
  if (c.generated) {
    for (std::size_t l = 0; l < model.num_layers(); ++l)
      for (auto& v : model.layer(l).variables()) testing::draw_offsets(v.name, v.value.span<float>(), rng);
  } else {
    randomize_variables(model, rng);
  }
  RefStack ref = RefStack::of(model, c.batch, step);
  REQUIRE(model.output_shape() == ref.layers.back()->output_shape());

  Tensor x(c.input.with_batch(c.batch));
  for (auto& v : x.span<float>()) v = rng.uniform(-1.0f, 1.0f);
  const Vec<double> xd = to_double(x);

  const Tensor& y = model.forward(x, step);
  const Vec<double>& y_ref = ref.forward(xd);
  CHECK(rel_err(to_double(y), y_ref) < tol);
  // After the first step's plan: a reshape moves nothing only where its input came canonical.
  const auto listed = [](const std::optional<std::vector<std::size_t>>& list, std::size_t l) {
    return std::find(list->begin(), list->end(), l) != list->end();
  };
  for (std::size_t l = 0; l < model.num_layers(); ++l) {
    CAPTURE(l);
    if (c.backward_moves_nothing) CHECK(model.backward_moves_nothing(l) == listed(c.backward_moves_nothing, l));
    if (c.forward_moves_nothing) CHECK(model.forward_moves_nothing(l) == listed(c.forward_moves_nothing, l));
    if (c.gradient_over_output)
      CHECK(model.gradient_over_output(c.batch, l) == listed(c.gradient_over_output, l));
  }
  if (c.mode == nn::Mode::inference) return;  // backward is a training step's
  if (c.generated && testing::nearest_pooling_tie(ref) < c.generated->nearest_tie) {
    MESSAGE(c.label << ": a max pooling window's two largest inputs lie within " << c.generated->nearest_tie
                    << " of each other; gradients not compared");
    return;
  }

  Tensor& dy = model.output_gradient();
  for (auto& v : dy.span<float>()) v = rng.uniform(-1.0f, 1.0f);
  const Vec<double> dyd = to_double(dy);
  model.backward(step);
  std::vector<std::vector<Vec<double>>> dvars;
  const Vec<double> dx_ref = ref.backward(dyd, dvars);
  if (c.input_gradient) CHECK(rel_err(to_double(model.input_gradient()), dx_ref) < grad_tol);
  for (std::size_t l = 0; l < model.num_layers(); ++l) {
    auto vars = model.layer(l).variables();
    const double layer_gradient = testing::largest_norm(dvars[l]);
    for (std::size_t k = 0; k < vars.size(); ++k) {
      CAPTURE(vars[k].name);
      const double scale = c.generated ? layer_gradient : norm(dvars[l][k]);
      CHECK(distance(to_double(vars[k].grad), dvars[l][k]) / std::max(scale, 1e-30) < grad_tol);
    }
  }
  if (c.compute != DType::f32 || c.generated) return;

  // Finite differences on the reference, in double: L = sum(dy * y), perturbing the input and
  // every variable in place.
  Vec<double> input = xd;
  auto loss = [&]() {
    const Vec<double>& out = ref.forward(input);
    double s = 0;
    for (std::size_t i = 0; i < out.size(); ++i) s += dyd[i] * out[i];
    return s;
  };
  const double h = 1e-6;
  auto fd_check = [&](Vec<double>& param, const Vec<double>& analytic, const std::string& what) {
    CAPTURE(what);
    Rng pick(3, RngStream::test, param.size());
    Vec<double> fd, an;
    const std::size_t checks = std::min<std::size_t>(param.size(), 40);
    for (std::size_t t = 0; t < checks; ++t) {
      const std::size_t i = checks == param.size() ? t : pick.below(param.size());
      const double saved = param[i];
      param[i] = saved + h;
      const double up = loss();
      param[i] = saved - h;
      const double down = loss();
      param[i] = saved;
      fd.push_back((up - down) / (2 * h));
      an.push_back(analytic[i]);
    }
    CHECK(rel_err(an, fd) < 1e-6);
  };
  fd_check(input, dx_ref, "input");
  // Non-trainable variables (moving statistics) get an update contribution, not a gradient.
  for (std::size_t l = 0; l < ref.vars.size(); ++l)
    for (std::size_t k = 0; k < ref.vars[l].size(); ++k)
      if (model.layer(l).variables()[k].trainable)
        fd_check(ref.vars[l][k], dvars[l][k], fmt::format("layer {} variable {}", l, k));
}

nn::Conv2DOptions conv(int filters, int k, int s, Padding p, Activation a, bool bias = true) {
  return testing::conv_options(filters, k, s, p, a, bias);
}

nn::DenseOptions dense(int units, Activation a, bool bias = true) {
  nn::DenseOptions d;
  d.units = units;
  d.activation = a;
  d.use_bias = bias;
  return d;
}

// conv2d (3x3, relu) -> flatten -> dense (linear), with Keras's default names.
config::ModelConfig conv_flatten_dense(std::vector<std::int64_t> input, int filters, int units) {
  config::ModelConfig mc;
  mc.input_shape = std::move(input);
  mc.layers.push_back(nn::layer_config("conv2d", conv(filters, 3, 1, Padding::valid, Activation::relu)));
  mc.layers.push_back(nn::layer_config("flatten", nn::FlattenOptions{}));
  mc.layers.push_back(nn::layer_config("dense", dense(units, Activation::linear)));
  return mc;
}

nn::MaxPool2DOptions pool(int p, int s, Padding pad) {
  nn::MaxPool2DOptions m;
  m.pool_size = {p, p};
  m.strides = std::array<int, 2>{s, s};
  m.padding = pad;
  return m;
}

}  // namespace

TEST_CASE("conv2d matches the reference and finite differences") {
  check_case({"3x3 valid relu", Shape{7, 7, 3}, {conv(5, 3, 1, Padding::valid, Activation::relu)}, 2});
  check_case({"3x3 same stride 2 odd", Shape{7, 9, 2}, {conv(4, 3, 2, Padding::same, Activation::linear)}, 3});
  check_case({"2x2 same even (asymmetric pad)", Shape{6, 6, 3}, {conv(3, 2, 1, Padding::same, Activation::tanh)}, 2});
  check_case({"1x1 sigmoid no bias", Shape{4, 5, 6}, {conv(7, 1, 1, Padding::valid, Activation::sigmoid, false)}, 2});
  check_case({"softmax over channels", Shape{5, 5, 2}, {conv(4, 3, 1, Padding::same, Activation::softmax)}, 2});
  check_case({"one input channel, 32 filters", Shape{10, 10, 1}, {conv(32, 3, 1, Padding::valid, Activation::relu)}, 4});
  // The weight gradients of few input channels are the CPU backend's own loops: several sample
  // chunks (11 samples), taps over several passes (4 channels x 9), 'same' padding, 16 lanes.
  check_case({"4 input channels, 16 filters, same, 11 samples", Shape{7, 6, 4},
              {conv(16, 3, 1, Padding::same, Activation::linear)}, 11});
  check_case({"1 input channel, 5x5 stride 2 same, 24 filters", Shape{9, 9, 1},
              {conv(24, 5, 2, Padding::same, Activation::relu)}, 3});
  check_case({"3 input channels, 2x2 no bias", Shape{5, 5, 3}, {conv(8, 2, 1, Padding::valid, Activation::linear, false)}, 9});
  // Middle layers, whose input comes in channel blocks: the same loops with taps in passes over
  // pairs of filter vectors (and one vector alone when their count is odd), 12 channels filling
  // one block and a half, stride 2 'same'; and the seed CNN's second layer's channel counts.
  check_case({"middle layer: 12 channels in blocks, 40 filters, stride 2 same", Shape{9, 8, 2},
              {conv(12, 3, 1, Padding::valid, Activation::relu), conv(40, 3, 2, Padding::same, Activation::linear)}, 10});
  check_case({"middle layer: 32 channels, 64 filters, 13 samples", Shape{8, 8, 3},
              {conv(32, 3, 1, Padding::same, Activation::relu), conv(64, 3, 1, Padding::valid, Activation::relu)}, 13});
  // A padded sample above the loops' cache bound (38 x 38 x 24 floats): oneDNN's kernel, below a
  // one-channel first layer that stays the loops' whatever its size.
  check_case({"a large middle layer (oneDNN's kernel) above a one-channel layer", Shape{36, 36, 1},
              {conv(24, 3, 1, Padding::same, Activation::relu), conv(8, 3, 1, Padding::same, Activation::linear)}, 2});
}

namespace {

// One training step of the model `mc` on `batch` samples of 7x6x3 with `threads` OpenMP threads,
// and, with `shared`, as lane 0 of a SharedWork: its output, then every variable's gradient, as
// one vector (the same seeds whatever the count).
std::vector<float> step_bits_on_threads(const config::ModelConfig& mc, std::int64_t batch, int threads,
                                        SharedWork* shared = nullptr) {
  Tensor x(Shape{batch, 7, 6, 3});
  Rng rng(5, RngStream::test);
  for (auto& v : x.span<float>()) v = rng.uniform(-1.0f, 1.0f);
  const int threads_before = omp_get_max_threads();
  omp_set_num_threads(threads);
  nn::Sequential model(mc, 3, testing::cpu());
  nn::StepContext step = testing::step_of(nn::Mode::training, batch);
  step.shared_work = shared;
  const Tensor& y = model.forward(x, step);
  std::vector<float> bits(y.span<float>().begin(), y.span<float>().end());
  Rng grads(6, RngStream::test);
  for (auto& v : model.output_gradient().span<float>()) v = grads.uniform(-1.0f, 1.0f);
  model.backward(step);
  for (std::size_t l = 0; l < model.num_layers(); ++l)
    for (auto& v : model.layer(l).variables())
      bits.insert(bits.end(), v.grad.span<float>().begin(), v.grad.span<float>().end());
  omp_set_num_threads(threads_before);
  return bits;
}

}  // namespace

TEST_CASE("the weight gradients of a few-channel input have the same bits on 1, 2 and 3 OpenMP threads") {
  // The CPU backend's own loops sum samples in fixed chunks of 8 and add the chunks in order,
  // whichever thread took a chunk: 19 samples are 3 chunks, 16 filters 2 vectors of 8 on AVX2.
  config::ModelConfig mc;
  mc.input_shape = {7, 6, 3};
  mc.layers.push_back(nn::layer_config("conv2d", conv(16, 3, 1, Padding::same, Activation::relu)));
  const std::vector<float> one = step_bits_on_threads(mc, 19, 1);
  CHECK(step_bits_on_threads(mc, 19, 2) == one);
  CHECK(step_bits_on_threads(mc, 19, 3) == one);
  // With the max pooling above it computed by the convolution (7 x 6 -> 3 x 3, a row in no window).
  mc.layers.push_back(nn::layer_config("max_pooling2d", pool(2, 2, Padding::valid)));
  mc.layers.push_back(nn::layer_config("flatten", nn::FlattenOptions{}));
  mc.layers.push_back(nn::layer_config("dense", dense(3, Activation::linear)));
  const std::vector<float> pooled = step_bits_on_threads(mc, 19, 1);
  CHECK(step_bits_on_threads(mc, 19, 2) == pooled);
  CHECK(step_bits_on_threads(mc, 19, 3) == pooled);
}

TEST_CASE("the weight loops' items have the same bits whichever lane runs them") {
  // A first layer of few channels and a middle layer in channel blocks, both the CPU backend's own
  // weight loops: 19 samples are 3 chunks, 40 filters 3 groups of filter vectors on AVX2. Lane 0
  // shares its items (SharedWork) with a second thread that helps whenever a job is open; lane 0
  // leaves the first item of every job to that helper (FirstItem::helper), so each job is shared
  // however the threads are scheduled, and each step must give the bits of one thread.
  // The second model: the first convolution computes the max pooling above it, and its items
  // expand the pooled gradient in the scratch of whichever lane runs them.
  config::ModelConfig blocks, pooled;
  blocks.input_shape = pooled.input_shape = {7, 6, 3};
  blocks.layers.push_back(nn::layer_config("conv2d", conv(12, 3, 1, Padding::valid, Activation::relu)));
  blocks.layers.push_back(nn::layer_config("conv2d", conv(40, 3, 1, Padding::same, Activation::linear)));
  pooled.layers.push_back(nn::layer_config("conv2d", conv(24, 3, 1, Padding::same, Activation::relu)));
  pooled.layers.push_back(nn::layer_config("max_pooling2d", pool(2, 2, Padding::valid)));
  pooled.layers.push_back(nn::layer_config("flatten", nn::FlattenOptions{}));
  pooled.layers.push_back(nn::layer_config("dense", dense(3, Activation::linear)));
  for (const config::ModelConfig* mc : {&blocks, &pooled}) {
    const std::vector<float> one = step_bits_on_threads(*mc, 19, 1);
    SharedWork work(2, SharedWork::FirstItem::helper);
    std::atomic<bool> stop{false};
    std::atomic<std::int64_t> helped{0};
    std::thread helper([&] {
      while (!stop.load(std::memory_order_acquire)) helped.fetch_add(work.help(1), std::memory_order_relaxed);
    });
    for (int attempt = 0; attempt < 3; ++attempt) {
      CAPTURE(attempt);
      CHECK(step_bits_on_threads(*mc, 19, 1, &work) == one);
    }
    stop.store(true, std::memory_order_release);
    helper.join();
    // Each step shared at least one job.
    CHECK(helped.load() >= 3);
  }
}

TEST_CASE("max_pool2d matches the reference and finite differences") {
  check_case({"2x2 valid", Shape{6, 6, 3}, {pool(2, 2, Padding::valid)}, 2});
  check_case({"2x2 valid odd input", Shape{7, 5, 2}, {pool(2, 2, Padding::valid)}, 2});
  check_case({"3x3 stride 2 same", Shape{7, 8, 3}, {pool(3, 2, Padding::same)}, 2});
  check_case({"2x2 stride 1 overlapping", Shape{5, 5, 2}, {pool(2, 1, Padding::valid)}, 1});
  // The CPU loops' layouts and geometries: channels in blocks after a convolution (16 and 8 lanes),
  // channels-last with 8 and with 5 lanes, windows cut by 'same' padding, stride above the pool
  // size (rows and columns no window reads), and ties among a relu's zeros.
  check_case({"after conv, 16 channels, 3x3 stride 2 same",
              Shape{9, 7, 2},
              {conv(16, 3, 1, Padding::same, Activation::linear), pool(3, 2, Padding::same)},
              3});
  check_case({"after conv relu, 8 channels, 2x2 same odd", Shape{7, 7, 3},
              {conv(8, 3, 1, Padding::valid, Activation::relu), pool(2, 2, Padding::same)}, 2});
  check_case({"channels last, 8 channels, stride 3 over pool 2", Shape{8, 7, 8}, {pool(2, 3, Padding::valid)}, 2});
  check_case({"channels last, 5 channels, 3x3 same", Shape{6, 5, 5}, {pool(3, 3, Padding::same)}, 2});
  check_case({"after conv, 24 channels, stride 1 overlapping", Shape{6, 6, 1},
              {conv(24, 2, 1, Padding::valid, Activation::relu), pool(3, 1, Padding::valid)}, 2});
  // A window of 256 positions is oneDNN's pooling, which then applies the relu's derivative after it.
  // With a 1x1 convolution a channel whose bias outweighs its weight is zero everywhere, so some
  // maxima are zero and the derivative matters.
  check_case({"16x16 window after conv relu (oneDNN's pooling)", Shape{16, 16, 1},
              {conv(8, 1, 1, Padding::valid, Activation::relu), pool(16, 16, Padding::valid)}, 2});
}

TEST_CASE("dense matches the reference and finite differences") {
  check_case({"relu", Shape{12}, {dense(5, Activation::relu)}, 3});
  check_case({"linear no bias", Shape{7}, {dense(4, Activation::linear, false)}, 2});
  check_case({"sigmoid", Shape{6}, {dense(3, Activation::sigmoid)}, 4});
  check_case({"tanh", Shape{6}, {dense(3, Activation::tanh)}, 4});
  check_case({"softmax", Shape{6}, {dense(5, Activation::softmax)}, 3});
  // The CPU backend's own loops run the small layers above (backends::onednn::dense_loops_pay);
  // a layer above their size runs oneDNN's matmuls (x, the kernel and its gradient where they lie,
  // two of them read transposed) where oneDNN has brgemm kernels for them (AVX-512), else its
  // inner product: each activation's post-op or primitive, with and without a bias.
  REQUIRE_FALSE(backends::onednn::dense_loops_pay(2, 300, 400));
  check_case({"above the own loops' size, relu", Shape{300}, {dense(400, Activation::relu), dense(3, Activation::linear)}, 2});
  check_case({"above the own loops' size, tanh, no bias", Shape{260},
              {dense(400, Activation::tanh, false), dense(3, Activation::linear)}, 3});
  check_case({"above the own loops' size, softmax", Shape{300}, {dense(400, Activation::softmax)}, 2});
  check_case({"above the own loops' size, after a flatten, 5 rows", Shape{10, 10, 4},
              {nn::FlattenOptions{}, dense(130, Activation::sigmoid), dense(3, Activation::linear)}, 5});
  // Kernels whose rows lie a multiple of 2 KiB apart (512, 1024, ... units): without brgemm kernels
  // the forward is oneDNN's matmul on a padded copy of the kernel, made at each forward.
  REQUIRE_FALSE(backends::onednn::dense_loops_pay(2, 200, 512));
  check_case({"512 units, relu", Shape{200}, {dense(512, Activation::relu), dense(3, Activation::linear)}, 2});
  check_case({"1024 units, tanh, no bias", Shape{100}, {dense(1024, Activation::tanh, false), dense(3, Activation::linear)}, 3});
  check_case({"512 units above a relu", Shape{100},
              {dense(600, Activation::relu), dense(512, Activation::sigmoid), dense(3, Activation::linear)}, 2});
}

TEST_CASE("a dense layer above a relu applies its derivative, writing the input's gradient over the input") {
  // A dense layer above a dense relu applies the relu's derivative to the gradient it hands down
  // (Sequential::applies_activation_backward_below). Its own loops write that gradient over the
  // relu's output, which nothing else reads in backward, where the rows are whole vectors (32
  // inputs: on every ISA's lanes); with 6 inputs, or on oneDNN's matmuls (above the loops' size),
  // the gradient has its own memory.
  const auto over = [](std::string label, std::int64_t in, std::int64_t units, std::int64_t out, Activation top,
                       std::int64_t batch, std::vector<std::size_t> over_output, DType compute = DType::f32) {
    Case c{std::move(label), Shape{in}, {dense(static_cast<int>(units), Activation::relu), dense(static_cast<int>(out), top)},
           batch};
    c.gradient_over_output = std::move(over_output);
    c.compute = compute;
    return c;
  };
  REQUIRE(backends::onednn::dense_loops_pay(3, 32, 5));
  REQUIRE_FALSE(backends::onednn::dense_loops_pay(2, 300, 400));
  const std::vector<Case> cases{
      over("32 inputs of whole vectors: over the relu's output", 40, 32, 5, Activation::linear, 3, {0}),
      over("softmax above", 9, 32, 10, Activation::softmax, 4, {0}),
      over("6 inputs: vectors past a row's end", 7, 6, 3, Activation::linear, 5, {}),
      over("oneDNN's matmuls above, then the relu's backward", 20, 300, 400, Activation::linear, 2, {})};
  for (const Case& c : cases) {
    check_case(c);
    CAPTURE(c.label);
    config::ModelConfig mc;
    mc.input_shape = c.input.to_vector();
    for (const L& l : c.layers) mc.layers.push_back(l.config);
    const nn::Sequential model(mc, 7, testing::cpu(), nn::ModelOptions{});
    CHECK(model.applies_activation_backward_below(1));
  }
  // Below an Activation layer's relu (fused into the dense below it): the Activation then passes
  // its gradient through, and the gradient keeps a memory of its own.
  Case activation{"an Activation relu between", Shape{40},
                  {dense(32, Activation::linear), nn::ActivationOptions{Activation::relu}, dense(5, Activation::linear)}, 3};
  activation.gradient_over_output = std::vector<std::size_t>{};
  activation.backward_moves_nothing = std::vector<std::size_t>{1};
  check_case(activation);
  if (cpu_has_bf16()) {  // a bfloat16 relu's output (the dense above computes in float32, on its codes)
    Case bf16 = over("bfloat16 below", 40, 32, 5, Activation::linear, 3, {0}, DType::bf16);
    bf16.gradient_tolerance = kBf16RoutedGradientTolerance;
    check_case(bf16);
  }
}

// One training step of `model` on x with every output gradient `dy`: each variable's gradient, in
// order.
std::vector<float> gradients_after_step(nn::Sequential& model, const Tensor& x, const nn::StepContext& step, float dy) {
  model.forward(x, step);
  for (auto& v : model.output_gradient().span<float>()) v = dy;
  model.backward(step);
  std::vector<float> grads;
  for (std::size_t l = 0; l < model.num_layers(); ++l)
    for (auto& v : model.layer(l).variables())
      grads.insert(grads.end(), v.grad.span<float>().begin(), v.grad.span<float>().end());
  return grads;
}

TEST_CASE("without the model's input gradient, nothing below the lowest layer with variables runs backward") {
  // A flatten and a max pooling under the first dense layer: the gradient they would pass down
  // feeds nothing. The variables' gradients are the bits of a model that computes its input's.
  config::ModelConfig mc;
  mc.input_shape = {10, 10, 3};
  mc.layers.push_back(named(pool(2, 2, Padding::valid), "l0"));
  mc.layers.push_back(named(nn::FlattenOptions{}, "l1"));
  mc.layers.push_back(named(dense(400, Activation::relu), "l2"));
  mc.layers.push_back(named(dense(3, Activation::linear), "l3"));
  const nn::StepContext step = testing::step_of(nn::Mode::training, 2);
  Tensor x(Shape{2, 10, 10, 3});
  Rng rng(9, RngStream::test);
  for (auto& v : x.span<float>()) v = rng.uniform(-1.0f, 1.0f);
  nn::Sequential lean(mc, 7, testing::cpu()), whole(mc, 7, testing::cpu(), nn::ModelOptions{.input_gradient = true});
  CHECK(gradients_after_step(lean, x, step, 0.5f) == gradients_after_step(whole, x, step, 0.5f));
  for (std::size_t l = 0; l < 4; ++l) {
    CAPTURE(l);
    CHECK(lean.backward_runs(l) == (l >= 2));
    CHECK(lean.computes_input_gradient(l) == (l == 3));
    CHECK(whole.backward_runs(l));
    CHECK(whole.computes_input_gradient(l));
  }
}

TEST_CASE("a large dense first layer follows the model's input from step to step") {
  // The model's input moves between steps (the batch is read where it lies); a large float32
  // dense layer reads it twice, once transposed for its kernel's gradient (oneDNN's matmuls on
  // AVX-512). A step on a second input gives the bits of a fresh model's step on it alone.
  config::ModelConfig mc;
  mc.input_shape = {300};
  mc.layers.push_back(named(dense(400, Activation::relu), "l0"));
  mc.layers.push_back(named(dense(3, Activation::linear), "l1"));
  REQUIRE_FALSE(backends::onednn::dense_loops_pay(2, 300, 400));
  const nn::StepContext step = testing::step_of(nn::Mode::training, 2);
  const auto inputs = [] {
    std::vector<Tensor> x(2, Tensor(Shape{2, 300}));
    Rng rng(5, RngStream::test);
    for (auto& t : x)
      for (auto& v : t.span<float>()) v = rng.uniform(-1.0f, 1.0f);
    return x;
  }();
  nn::Sequential moved(mc, 7, testing::cpu()), fresh(mc, 7, testing::cpu());
  gradients_after_step(moved, inputs[0], step, 0.25f);
  CHECK(gradients_after_step(moved, inputs[1], step, 0.25f) == gradients_after_step(fresh, inputs[1], step, 0.25f));
}

TEST_CASE("a dense layer of 512 units computes with its kernel as it is at each forward") {
  // Its forward may read a copy of the kernel (above): a kernel changed between two steps (as the
  // optimizer changes it) must reach the second, which then gives a fresh model's bits.
  config::ModelConfig mc;
  mc.input_shape = {200};
  mc.layers.push_back(named(dense(512, Activation::relu), "l0"));
  mc.layers.push_back(named(dense(3, Activation::linear), "l1"));
  const nn::StepContext step = testing::step_of(nn::Mode::training, 2);
  Tensor x(Shape{2, 200});
  Rng rng(5, RngStream::test);
  for (auto& v : x.span<float>()) v = rng.uniform(-1.0f, 1.0f);
  nn::Sequential changed(mc, 7, testing::cpu()), fresh(mc, 7, testing::cpu());
  const std::vector<float> before = gradients_after_step(changed, x, step, 0.25f);
  for (nn::Sequential* m : {&changed, &fresh})
    for (auto& v : m->layer(0).variables()[nn::Dense::kKernel].value.span<float>()) v = -0.5f * v;
  const std::vector<float> after = gradients_after_step(changed, x, step, 0.25f);
  CHECK(after != before);
  CHECK(after == gradients_after_step(fresh, x, step, 0.25f));
}

TEST_CASE("flatten, reshape and activation layers") {
  nn::ReshapeOptions r;
  r.target_shape = {3, -1, 2};
  nn::ActivationOptions relu{Activation::relu}, sm{Activation::softmax}, th{Activation::tanh}, sg{Activation::sigmoid},
      lin{Activation::linear};
  check_case({"flatten after conv", Shape{5, 5, 3}, {conv(4, 3, 1, Padding::valid, Activation::relu), nn::FlattenOptions{}}, 2});
  check_case({"reshape", Shape{12}, {dense(12, Activation::linear), r, conv(2, 1, 1, Padding::valid, Activation::linear)}, 2});
  check_case({"activation relu", Shape{4, 4, 3}, {conv(3, 3, 1, Padding::same, Activation::linear), relu}, 2});
  check_case({"activation softmax", Shape{8}, {dense(6, Activation::linear), sm}, 3});
  check_case({"activation tanh/sigmoid/linear", Shape{8}, {dense(6, Activation::linear), th, sg, lin}, 2});
  // Past rank 5 (the batch included) oneDNN has no channels-last tag: the backend spells the same
  // order with strides, up to Shape::kMaxRank.
  nn::ReshapeOptions rank8;
  rank8.target_shape = {2, 1, 1, 1, 1, 3, 4};
  check_case({"reshape to rank 8", Shape{12}, {dense(24, Activation::linear), rank8, relu, nn::FlattenOptions{},
                                               dense(3, Activation::linear)}, 2});
  check_case({"an input of rank 7", Shape{1, 2, 1, 1, 3, 2}, {th, nn::FlattenOptions{}, dense(3, Activation::linear)}, 2});
}

TEST_CASE("the seed CNN as a stack: blocked layouts between layers agree with the reference") {
  check_case({"seed cnn",
              Shape{28, 28, 1},
              {conv(32, 3, 1, Padding::valid, Activation::relu), pool(2, 2, Padding::valid),
               conv(64, 3, 1, Padding::valid, Activation::relu), pool(2, 2, Padding::valid), nn::FlattenOptions{},
               dense(64, Activation::relu), dense(10, Activation::linear)},
              4});
}

TEST_CASE("a first convolution computes the max pooling above it, as the two layers apart") {
  // Training does not want the input's gradient, so a first convolution on few channels computes
  // the pooling of its output (conv2d.cpp); the oracle computes the two layers apart.
  auto fused = [](std::string label, Shape input, std::vector<L> layers, std::int64_t batch) {
    Case c{std::move(label), std::move(input), std::move(layers), batch};
    c.input_gradient = false;
    c.computed_below = {1};
    return c;
  };
  check_case(fused("the seed CNN, 9 samples (a short chunk)", Shape{28, 28, 1},
                   {conv(32, 3, 1, Padding::valid, Activation::relu), pool(2, 2, Padding::valid),
                    conv(64, 3, 1, Padding::valid, Activation::relu), pool(2, 2, Padding::valid), nn::FlattenOptions{},
                    dense(10, Activation::linear)},
                   9));
  // 7 x 7 outputs: the last row and column in no window.
  check_case(fused("odd output, no bias", Shape{9, 9, 1},
                   {conv(8, 3, 1, Padding::valid, Activation::relu, false), pool(2, 2, Padding::valid),
                    nn::FlattenOptions{}, dense(3, Activation::linear)},
                   5));
  // RGB, stride 2 'same', no activation, 3 x 3 windows (not unrolled), 24 filters (three vectors
  // of 8; on AVX-512 one and a half of 16, the padded lanes zero).
  check_case(fused("rgb, stride 2 same, linear, 3x3 windows, 24 filters", Shape{13, 11, 3},
                   {conv(24, 3, 2, Padding::same, Activation::linear), pool(3, 3, Padding::valid),
                    nn::FlattenOptions{}, dense(4, Activation::linear)},
                   3));
  // 2 x 2 windows pooled in registers for two filter vectors, then one (24 filters of 8 lanes).
  check_case(fused("2x2 windows, 24 filters, 2 channels", Shape{10, 9, 2},
                   {conv(24, 3, 1, Padding::valid, Activation::relu), pool(2, 2, Padding::valid),
                    nn::FlattenOptions{}, dense(3, Activation::linear)},
                   3));
  // Windows with gaps between them (stride 3 over 2 x 2), 5 x 5 kernel on 2 channels (50 taps).
  check_case(fused("gaps between windows, 5x5 kernel, 2 channels", Shape{12, 12, 2},
                   {conv(16, 5, 1, Padding::valid, Activation::relu), pool(2, 3, Padding::valid), nn::FlattenOptions{},
                    dense(3, Activation::linear)},
                   4));
  // In inference only the forward.
  Case inference = fused("inference", Shape{10, 10, 1},
                         {conv(16, 3, 1, Padding::valid, Activation::relu), pool(2, 2, Padding::valid),
                          nn::FlattenOptions{}, dense(3, Activation::linear)},
                         3);
  inference.mode = nn::Mode::inference;
  check_case(inference);
  if (cpu_has_bf16()) {  // (mixed_bfloat16's cases say where not)
    Case bf16 = fused("bfloat16", Shape{10, 10, 1},
                      {conv(16, 3, 1, Padding::valid, Activation::relu), pool(2, 2, Padding::valid),
                       nn::FlattenOptions{}, dense(3, Activation::linear)},
                      3);
    bf16.compute = DType::bf16;
    bf16.gradient_tolerance = kBf16RoutedGradientTolerance;
    check_case(bf16);
  }
}

namespace {

// The kernel's gradient of a first convolution (layer 0) with the max pooling above it (layer 1),
// in double, on x and a kernel already rounded to bfloat16: each position's activation rounded to
// bfloat16, a window's max the first of its largest rounded values, its gradient (dy, pooled and
// flattened) routed there (under relu, nowhere where that max is not positive).
Vec<double> rounded_winner_kernel_gradient(const nn::Sequential& model, const Tensor& x, std::span<const float> dy,
                                           std::int64_t batch) {
  const auto& conv = static_cast<const nn::Conv2D&>(model.layer(0));
  const auto& pool = static_cast<const nn::MaxPool2D&>(model.layer(1));
  const auto& o = conv.options();
  const auto rounded = [](double v) { return static_cast<double>(bf16_value(static_cast<float>(v))); };
  const Shape in = conv.input_shape();
  const std::int64_t h = in[0], w = in[1], c = in[2], f = o.filters, kh = o.kernel_size[0], kw = o.kernel_size[1];
  const std::int64_t oh = conv.padding_h().out, ow = conv.padding_w().out;
  const std::int64_t ph_n = pool.output_shape()[0], pw_n = pool.output_shape()[1];
  const auto& win = pool.params().pool_size;
  const auto& stride = pool.strides();
  const bool relu = o.activation == Activation::relu;
  const auto vars = model.layer(0).variables();
  const auto kernel = vars[nn::Conv2D::kKernel].value.span<float>();  // HWIO
  const auto xs = x.span<float>();
  // fn(x's index, the kernel's index) for the taps of sample n's output position (r, q), filter k,
  // that fall inside the input.
  const auto each_tap = [&](std::int64_t n, std::int64_t r, std::int64_t q, std::int64_t k, auto&& fn) {
    for (std::int64_t i = 0; i < kh; ++i)
      for (std::int64_t j = 0; j < kw; ++j) {
        const std::int64_t ih = r * o.strides[0] - conv.padding_h().before + i;
        const std::int64_t iw = q * o.strides[1] - conv.padding_w().before + j;
        if (ih < 0 || ih >= h || iw < 0 || iw >= w) continue;
        for (std::int64_t ch = 0; ch < c; ++ch)
          fn(static_cast<std::size_t>(((n * h + ih) * w + iw) * c + ch),
             static_cast<std::size_t>(((i * kw + j) * c + ch) * f + k));
      }
  };
  // Every output position's rounded activation, then the windows.
  Vec<double> act(static_cast<std::size_t>(batch * oh * ow * f));
  for (std::int64_t n = 0; n < batch; ++n)
    for (std::int64_t r = 0; r < oh; ++r)
      for (std::int64_t q = 0; q < ow; ++q)
        for (std::int64_t k = 0; k < f; ++k) {
          double sum = o.use_bias ? static_cast<double>(vars[nn::Conv2D::kBias].value.span<float>()[k]) : 0.0;
          each_tap(n, r, q, k, [&](std::size_t xi, std::size_t ki) { sum += double{xs[xi]} * rounded(kernel[ki]); });
          act[((n * oh + r) * ow + q) * f + k] = rounded(relu ? std::max(sum, 0.0) : sum);
        }
  Vec<double> dw(kernel.size(), 0.0);
  for (std::int64_t n = 0; n < batch; ++n)
    for (std::int64_t pr = 0; pr < ph_n; ++pr)
      for (std::int64_t pq = 0; pq < pw_n; ++pq)
        for (std::int64_t k = 0; k < f; ++k) {
          std::int64_t best_r = -1, best_q = -1;
          double best = 0;
          for (std::int64_t i = 0; i < win[0]; ++i)
            for (std::int64_t j = 0; j < win[1]; ++j) {
              const std::int64_t r = pr * stride[0] + i, q = pq * stride[1] + j;
              const double a = act[((n * oh + r) * ow + q) * f + k];
              if (best_r < 0 || a > best) best = a, best_r = r, best_q = q;
            }
          if (relu && !(best > 0)) continue;
          const double g = dy[static_cast<std::size_t>(((n * ph_n + pr) * pw_n + pq) * f + k)];
          each_tap(n, best_r, best_q, k, [&](std::size_t xi, std::size_t ki) { dw[ki] += g * xs[xi]; });
        }
  return dw;
}

}  // namespace

TEST_CASE("in bfloat16 a first convolution computes the pooling above it as float32 does on rounded values") {
  // The bfloat16 loops round x and the kernel to bfloat16, sum in f32 in the float32 loops' order,
  // and round each position before it is pooled. So on x and a kernel already rounded (and an
  // output gradient already rounded), the float32 loops compute the same sums: the bfloat16
  // output is the float32 output rounded (rounding keeps order, so the max of the rounded values
  // is the rounded max), bit for bit, and the bias's gradient is the same sum. Where two positions
  // of a window round to the same max the first wins in bfloat16, as the pooling layer apart
  // would pick it, so the kernel's gradient is checked against an oracle in double that routes
  // each window's gradient that way.
  if (!cpu_has_bf16()) {
    MESSAGE("this CPU has no bfloat16 instructions: mixed_bfloat16 is refused here, its fused loops not run");
    return;
  }
  struct Shapes {
    std::string label;
    Shape input;
    std::vector<L> layers;
    std::int64_t batch;
  };
  const std::vector<Shapes> cases{
      {"the seed CNN's first layers, 2x2 windows pooled in registers", Shape{28, 28, 1},
       {conv(32, 3, 1, Padding::valid, Activation::relu), pool(2, 2, Padding::valid)}, 9},
      {"rgb, 'same', linear, 3x3 windows (the plane of sums), 24 filters", Shape{13, 11, 3},
       {conv(24, 3, 2, Padding::same, Activation::linear), pool(3, 3, Padding::valid)}, 4},
      {"gaps between windows, 5x5 kernel on 2 channels, no bias", Shape{12, 12, 2},
       {conv(16, 5, 1, Padding::valid, Activation::relu, false), pool(2, 3, Padding::valid)}, 5},
      // Vectors of 16 filters a window: two then one (48), four (64); a 7 x 7 output whose last
      // row and column are in no window.
      {"48 filters on 2 channels: a pair of vectors, then one", Shape{12, 11, 2},
       {conv(48, 3, 1, Padding::valid, Activation::relu), pool(2, 2, Padding::valid)}, 3},
      {"64 filters, odd output", Shape{9, 9, 1},
       {conv(64, 3, 1, Padding::valid, Activation::relu), pool(2, 2, Padding::valid)}, 4},
  };
  for (const Shapes& c : cases) {
    CAPTURE(c.label);
    config::ModelConfig mc;
    mc.input_shape = c.input.to_vector();
    std::vector<L> layers = c.layers;
    // Flatten computes in bfloat16 and passes the pooled output through; a last layer computes in f32.
    layers.push_back(nn::FlattenOptions{});
    layers.push_back(nn::ActivationOptions{Activation::linear});
    for (std::size_t i = 0; i < layers.size(); ++i) mc.layers.push_back(named(layers[i], fmt::format("l{}", i)));
    nn::Sequential bf16(mc, 7, testing::cpu(), nn::ModelOptions{.compute = DType::bf16, .input_gradient = false});
    nn::Sequential f32(mc, 7, testing::cpu(), nn::ModelOptions{.compute = DType::f32, .input_gradient = false});
    REQUIRE(bf16.computed_by_layer_below(1));
    REQUIRE(f32.computed_by_layer_below(1));
    Rng rng(23, RngStream::test);
    for (std::size_t k = 0; k < bf16.layer(0).variables().size(); ++k) {
      auto from = bf16.layer(0).variables()[k].value.span<float>();
      auto to = f32.layer(0).variables()[k].value.span<float>();
      const bool kernel = k == nn::Conv2D::kKernel;
      for (std::size_t i = 0; i < from.size(); ++i) {
        from[i] = rng.uniform(-1.0f, 1.0f);
        to[i] = kernel ? bf16_value(from[i]) : from[i];  // (the bias stays f32 in both)
      }
    }
    const nn::StepContext step = testing::step_of(nn::Mode::training, c.batch);
    Tensor x(c.input.with_batch(c.batch)), x_rounded(c.input.with_batch(c.batch));
    for (std::size_t i = 0; i < x.span<float>().size(); ++i) {
      x.span<float>()[i] = rng.uniform(-1.0f, 1.0f);
      x_rounded.span<float>()[i] = bf16_value(x.span<float>()[i]);
    }
    const auto y16 = bf16.forward(x, step).span<float>();
    const auto y32 = f32.forward(x_rounded, step).span<float>();
    REQUIRE(y16.size() == y32.size());
    std::size_t unequal = 0;
    for (std::size_t i = 0; i < y16.size(); ++i)
      unequal += std::bit_cast<std::uint32_t>(y16[i]) != std::bit_cast<std::uint32_t>(bf16_value(y32[i]));
    CHECK(unequal == 0);

    auto dy16 = bf16.output_gradient().span<float>(), dy32 = f32.output_gradient().span<float>();
    for (std::size_t i = 0; i < dy16.size(); ++i) {
      dy16[i] = rng.uniform(-1.0f, 1.0f);
      dy32[i] = bf16_value(dy16[i]);  // as the bfloat16 model stores its gradient below its last layer
    }
    bf16.backward(step);
    f32.backward(step);
    const auto vars16 = bf16.layer(0).variables(), vars32 = f32.layer(0).variables();
    const Vec<double> dw16 = to_double(vars16[nn::Conv2D::kKernel].grad);
    const Vec<double> dw = rounded_winner_kernel_gradient(bf16, x_rounded, dy32, c.batch);
    // (Routed by the float32 max instead, the seed CNN's shapes here differ by 4.9 %: near-ties.)
    CHECK(rel_err(dw16, dw) < 1e-5);
    if (vars16.size() > nn::Conv2D::kBias) {
      const auto db16 = vars16[nn::Conv2D::kBias].grad.span<float>();
      const auto db32 = vars32[nn::Conv2D::kBias].grad.span<float>();
      for (std::size_t i = 0; i < db16.size(); ++i) CHECK(db16[i] == db32[i]);
    }
  }
}

TEST_CASE("a max pooling stays its own layer where the convolution below cannot compute it") {
  auto apart = [](std::string label, Shape input, std::vector<L> layers, bool input_gradient = false) {
    Case c{std::move(label), std::move(input), std::move(layers), 3};
    c.input_gradient = input_gradient;
    return c;
  };
  const std::vector<L> seed{conv(16, 3, 1, Padding::valid, Activation::relu), pool(2, 2, Padding::valid),
                            nn::FlattenOptions{}, dense(3, Activation::linear)};
  check_case(apart("the input's gradient is wanted", Shape{10, 10, 1}, seed, true));
  check_case(apart("overlapping windows", Shape{10, 10, 1},
                   {conv(16, 3, 1, Padding::valid, Activation::relu), pool(3, 2, Padding::valid), nn::FlattenOptions{},
                    dense(3, Activation::linear)}));
  check_case(apart("'same' pooling", Shape{9, 9, 1},
                   {conv(16, 3, 1, Padding::valid, Activation::relu), pool(2, 2, Padding::same), nn::FlattenOptions{},
                    dense(3, Activation::linear)}));
  check_case(apart("tanh", Shape{10, 10, 1},
                   {conv(16, 3, 1, Padding::valid, Activation::tanh), pool(2, 2, Padding::valid), nn::FlattenOptions{},
                    dense(3, Activation::linear)}));
  check_case(apart("12 filters (not whole vectors)", Shape{10, 10, 1},
                   {conv(12, 3, 1, Padding::valid, Activation::relu), pool(2, 2, Padding::valid), nn::FlattenOptions{},
                    dense(3, Activation::linear)}));
  check_case(apart("8 input channels", Shape{10, 10, 8}, {conv(16, 3, 1, Padding::valid, Activation::relu),
                                                          pool(2, 2, Padding::valid), nn::FlattenOptions{},
                                                          dense(3, Activation::linear)}));
  check_case(apart("the pooling is the last layer", Shape{10, 10, 1},
                   {conv(16, 3, 1, Padding::valid, Activation::relu), pool(2, 2, Padding::valid)}));
}

namespace {

nn::AveragePooling2DOptions avg_pool(int p, int s, Padding pad) {
  nn::AveragePooling2DOptions a;
  a.pool_size = {p, p};
  a.strides = std::array<int, 2>{s, s};
  a.padding = pad;
  return a;
}

TEST_CASE("a flatten above a pooling moves nothing where the pooling writes its output channels-last") {
  // The pooling's own loops write the canonical (channels-last) layout for the reshape above, from
  // channel blocks that fill the channels exactly; the flatten's output is then the pooling's
  // memory and neither direction of the flatten moves anything (nn/kernel.hpp,
  // reinterprets_input). With padding lanes (20 channels in blocks of 16) the pooling keeps the
  // blocks and the flatten reorders.
  const auto flat_above = [](std::string label, Shape input, std::vector<L> layers, std::int64_t batch,
                             std::vector<std::size_t> nothing, DType compute = DType::f32) {
    Case c{std::move(label), std::move(input), std::move(layers), batch};
    c.compute = compute;
    c.gradient_tolerance = compute == DType::bf16 ? kBf16RoutedGradientTolerance : 0.0;
    c.forward_moves_nothing = nothing;
    c.backward_moves_nothing = nothing;
    return c;
  };
  const L relu32 = conv(32, 3, 1, Padding::valid, Activation::relu);
  check_case(flat_above("max pooling of 32 channels in blocks", Shape{9, 9, 3},
                        {relu32, pool(2, 2, Padding::valid), nn::FlattenOptions{}, dense(5, Activation::linear)}, 3, {2}));
  check_case(flat_above("max pooling 3x3 stride 2 'same', odd planes", Shape{10, 9, 2},
                        {relu32, pool(3, 2, Padding::same), nn::FlattenOptions{}, dense(4, Activation::relu)}, 2, {2}));
  check_case(flat_above("average pooling of 16 channels", Shape{8, 8, 2},
                        {conv(16, 3, 1, Padding::valid, Activation::linear), avg_pool(2, 2, Padding::valid),
                         nn::FlattenOptions{}, dense(3, Activation::linear)},
                        4, {2}));
  check_case(flat_above("max pooling on the model's input (channels-last already)", Shape{6, 6, 5},
                        {pool(2, 2, Padding::valid), nn::FlattenOptions{}, dense(3, Activation::linear)}, 2, {1}));
  check_case(flat_above("20 channels: padding lanes, the flatten reorders", Shape{7, 7, 3},
                        {conv(20, 3, 1, Padding::valid, Activation::relu), pool(2, 2, Padding::valid),
                         nn::FlattenOptions{}, dense(3, Activation::linear)},
                        2, {}));
  if (testing::cpu_has_bf16())
    check_case(flat_above("bfloat16 max pooling of 32 channels", Shape{9, 9, 3},
                          {relu32, pool(2, 2, Padding::valid), nn::FlattenOptions{}, dense(5, Activation::linear)}, 3,
                          {2}, DType::bf16));
  else
    MESSAGE("the bfloat16 case skipped: this CPU has no bfloat16 instructions");
}

nn::BatchNormalizationOptions batch_norm(bool center = true, bool scale = true) {
  nn::BatchNormalizationOptions b;
  b.center = center;
  b.scale = scale;
  return b;
}

}  // namespace

TEST_CASE("a convolution computes only the output rows and columns the pooling above reads") {
  // The pooling's last window ends before its input does: the gradient there is zero. On 32 input
  // channels the convolution's oneDNN primitives run on copies cropped to the rows and columns
  // read (where a tenth or more are left out), in float32 and bfloat16, and its own weight loops
  // (float32, a sample's planes in the caches) sum over the positions read; the input's gradient
  // past what the crop reads is +0. The oracle computes every position.
  struct Read {
    std::string label;
    Shape input;
    std::vector<L> layers;
    std::optional<nn::Layer::InputExtent> extent;  // what the pooling (layer 1) reads of its input
  };
  const std::vector<Read> cases{
      {"2x2 windows over 11 x 11 (the seed CNN's second convolution)", Shape{13, 13, 32},
       {conv(16, 3, 1, Padding::valid, Activation::relu), pool(2, 2, Padding::valid), nn::FlattenOptions{},
        dense(3, Activation::linear)},
       nn::Layer::InputExtent{10, 10}},
      {"3x3 average windows at stride 2 over 12 x 10", Shape{14, 12, 32},
       {conv(8, 3, 1, Padding::valid, Activation::linear), avg_pool(3, 2, Padding::valid), nn::FlattenOptions{},
        dense(3, Activation::linear)},
       nn::Layer::InputExtent{11, 9}},
      {"gaps between windows (2 x 2 at stride 3), 'same' convolution", Shape{12, 12, 32},
       {conv(8, 3, 1, Padding::same, Activation::relu), pool(2, 3, Padding::valid), nn::FlattenOptions{},
        dense(3, Activation::linear)},
       nn::Layer::InputExtent{11, 11}},
      {"'same' pooling reads every row", Shape{13, 13, 32},
       {conv(8, 3, 1, Padding::valid, Activation::relu), pool(2, 2, Padding::same), nn::FlattenOptions{},
        dense(3, Activation::linear)},
       std::nullopt},
  };
  for (const Read& r : cases) {
    CAPTURE(r.label);
    config::ModelConfig mc;
    mc.input_shape = r.input.to_vector();
    for (std::size_t i = 0; i < r.layers.size(); ++i) mc.layers.push_back(named(r.layers[i], fmt::format("l{}", i)));
    const nn::Sequential model(mc, 7, testing::cpu());
    const auto extent = model.layer(1).input_extent_read();
    REQUIRE(extent.has_value() == r.extent.has_value());
    if (extent) {
      CHECK(extent->rows == r.extent->rows);
      CHECK(extent->columns == r.extent->columns);
    }
    Case c{r.label, r.input, r.layers, 3};
    c.input_gradient = true;
    check_case(c);
    if (cpu_has_bf16()) {  // (mixed_bfloat16's cases say where not)
      c.compute = DType::bf16;
      c.gradient_tolerance = kBf16RoutedGradientTolerance;
      check_case(c);
    }
  }
}

// One training step of `layers` on a batch of 3 (variables, input and output gradient drawn from
// fixed seeds): the output, every variable's gradient and, with input_gradient, the input's.
std::vector<std::vector<float>> one_step(const Shape& input, const std::vector<L>& layers, DType compute,
                                         bool input_gradient) {
  config::ModelConfig mc;
  mc.input_shape = input.to_vector();
  for (std::size_t i = 0; i < layers.size(); ++i) mc.layers.push_back(named(layers[i], fmt::format("l{}", i)));
  nn::Sequential model(mc, 7, testing::cpu(), nn::ModelOptions{.compute = compute, .input_gradient = input_gradient});
  Rng rng(11, RngStream::test);
  randomize_variables(model, rng);
  const nn::StepContext step = testing::step_of(nn::Mode::training, 3);
  Tensor x(input.with_batch(3));
  for (auto& v : x.span<float>()) v = rng.uniform(-1.0f, 1.0f);
  const auto copy = [](const Tensor& t) { return std::vector<float>(t.span<float>().begin(), t.span<float>().end()); };
  std::vector<std::vector<float>> out{copy(model.forward(x, step))};
  for (auto& v : model.output_gradient().span<float>()) v = rng.uniform(-1.0f, 1.0f);
  model.backward(step);
  for (std::size_t l = 0; l < model.num_layers(); ++l)
    for (auto& v : model.layer(l).variables()) out.push_back(copy(v.grad));
  if (input_gradient) out.push_back(copy(model.input_gradient()));
  return out;
}

TEST_CASE("the layer below computes only the leading rows and columns the layer above reads") {
  // A pooling whose windows end before its input does (Layer::input_extent_read), and a
  // convolution that computes only the output positions such a pooling reads, which reads only the
  // leading input rows and columns those reach (LayerKernel::input_read_within): the layer below
  // hands over that part alone where it can, in a layout that holds fewer rows and columns than
  // its shape (its planned output bytes say so). A first convolution computing its max pooling (the seed CNN's:
  // 12 x 12 of 13 x 13 pooled), a convolution that crops its own output (12 x 12 of 13 x 13), and
  // a chain of three (the lowest holds 14 x 14 of 15 x 15); and a pooling above a first
  // convolution's max pooling (12 x 12 of 13 x 13 pooled).
  // In float32 against the oracle, which computes every position; in float32 bit for bit against
  // the same model with a linear Activation layer under the layer that reads a part, which then
  // reads the whole input (a convolution through the crop's copies) and adds nothing, and in
  // bfloat16 against it too.
  struct Below {
    std::string label;
    Shape input;
    std::vector<L> layers;
    std::size_t cropped;  // the index of the layer that reads a part (a cropped convolution, a pooling)
    bool input_gradient;
    std::vector<std::size_t> computed_below;
    std::int64_t rows, columns, channels;  // layer 0's output as its layout holds it
  };
  const std::vector<Below> cases{
      {"a first convolution and its max pooling (the seed CNN)", Shape{28, 28, 1},
       {conv(32, 3, 1, Padding::valid, Activation::relu), pool(2, 2, Padding::valid),
        conv(16, 3, 1, Padding::valid, Activation::relu), pool(2, 2, Padding::valid), nn::FlattenOptions{},
        dense(3, Activation::linear)},
       2, false, {1}, 12, 12, 32},
      {"a convolution that crops its own output", Shape{15, 15, 8},
       {conv(16, 3, 1, Padding::valid, Activation::relu), conv(16, 3, 1, Padding::valid, Activation::relu),
        pool(2, 2, Padding::valid), nn::FlattenOptions{}, dense(3, Activation::linear)},
       1, true, {}, 12, 12, 16},
      {"three convolutions, each cropping for the one above", Shape{17, 17, 8},
       {conv(16, 3, 1, Padding::valid, Activation::relu), conv(16, 3, 1, Padding::valid, Activation::relu),
        conv(16, 3, 1, Padding::valid, Activation::relu), pool(2, 2, Padding::valid), nn::FlattenOptions{},
        dense(3, Activation::linear)},
       2, true, {}, 14, 14, 16},
      {"a pooling over a first convolution's max pooling", Shape{28, 28, 1},
       {conv(32, 3, 1, Padding::valid, Activation::relu), pool(2, 2, Padding::valid), pool(2, 2, Padding::valid),
        nn::FlattenOptions{}, dense(3, Activation::linear)},
       2, false, {1}, 12, 12, 32},
  };
  for (const Below& b : cases) {
    CAPTURE(b.label);
    Case c{b.label, b.input, b.layers, 3};
    c.input_gradient = b.input_gradient;
    c.computed_below = b.computed_below;
    check_case(c);
    std::vector<DType> computes{DType::f32};
    if (cpu_has_bf16()) computes.push_back(DType::bf16);  // (mixed_bfloat16's cases say where not)
    for (const DType compute : computes) {
      CAPTURE(std::string(dtype_name(compute)));
      config::ModelConfig mc;
      mc.input_shape = b.input.to_vector();
      for (std::size_t i = 0; i < b.layers.size(); ++i) mc.layers.push_back(named(b.layers[i], fmt::format("l{}", i)));
      nn::Sequential model(mc, 7, testing::cpu(), nn::ModelOptions{.compute = compute, .input_gradient = b.input_gradient});
      const std::size_t element = compute == DType::bf16 ? 2 : 4;
      CHECK(model.output_bytes(3, 0) == static_cast<std::size_t>(3 * b.rows * b.columns * b.channels) * element);
      std::vector<L> whole = b.layers;
      whole.insert(whole.begin() + static_cast<std::ptrdiff_t>(b.cropped), nn::ActivationOptions{Activation::linear});
      const auto part = one_step(b.input, b.layers, compute, b.input_gradient);
      const auto reference = one_step(b.input, whole, compute, b.input_gradient);
      REQUIRE(part.size() == reference.size());
      for (std::size_t i = 0; i < part.size(); ++i) {
        CAPTURE(i);  // the output, the variables' gradients in order, the input's
        REQUIRE(part[i].size() == reference[i].size());
        // oneDNN's bfloat16 backward-weights primitive (a cropping convolution's, where the loops
        // are not this backend's) sums the positions in an order that depends on the plane's size:
        // the same terms, in float32.
        if (compute == DType::bf16 && i > 0)
          CHECK(rel_err(Vec<double>(part[i].begin(), part[i].end()), Vec<double>(reference[i].begin(), reference[i].end())) < 1e-5);
        else CHECK(std::memcmp(part[i].data(), reference[i].data(), part[i].size() * sizeof(float)) == 0);
      }
    }
  }
}

TEST_CASE("average_pooling2d and global_average_pooling2d match the reference and finite differences") {
  check_case({"2x2 valid", Shape{6, 6, 3}, {avg_pool(2, 2, Padding::valid)}, 2});
  check_case({"3x3 stride 2 same: border windows average their real inputs", Shape{7, 8, 3},
              {avg_pool(3, 2, Padding::same)}, 2});
  check_case({"2x2 stride 1 same, odd input", Shape{5, 5, 2}, {avg_pool(2, 1, Padding::same)}, 3});
  check_case({"after a conv (blocked layout in)", Shape{8, 8, 2},
              {conv(16, 3, 1, Padding::same, Activation::relu), avg_pool(2, 2, Padding::valid)}, 2});
  check_case({"global", Shape{5, 4, 3}, {nn::GlobalAveragePooling2DOptions{}}, 3});
  check_case({"global after a conv, then dense", Shape{6, 6, 2},
              {conv(16, 3, 1, Padding::valid, Activation::relu), nn::GlobalAveragePooling2DOptions{},
               dense(4, Activation::linear)},
              2});
}

TEST_CASE("dropout matches the reference with the same masks, and is the identity in inference") {
  check_case({"rate 0.3 after dense", Shape{12}, {dense(16, Activation::relu), nn::DropoutOptions{0.3}}, 5});
  check_case({"rate 0.5 on a blocked conv output", Shape{6, 6, 2},
              {conv(16, 3, 1, Padding::valid, Activation::relu), nn::DropoutOptions{0.5}, nn::FlattenOptions{},
               dense(3, Activation::linear)},
              3});
  // A dense layer's own loops above write the gradient over the dropout's output (backward reads
  // only the mask and the gradient).
  Case over{"rate 0.3 between dense layers, its output's gradient over its output", Shape{12},
            {dense(32, Activation::relu), nn::DropoutOptions{0.3}, dense(5, Activation::linear)}, 5};
  over.gradient_over_output = std::vector<std::size_t>{1};
  check_case(over);
  check_case({"rate 0", Shape{7}, {dense(5, Activation::tanh), nn::DropoutOptions{0.0}}, 2});
  check_case({"inference", Shape{7}, {dense(5, Activation::tanh), nn::DropoutOptions{0.5}}, 2, nn::Mode::inference});
}

TEST_CASE("batch_normalization matches the reference and finite differences") {
  // The layers before batch normalization have no bias, as usual: its gradient would be 0 (the
  // normalization takes the mean out), which a relative comparison cannot check.
  check_case({"dense features", Shape{6}, {dense(5, Activation::linear, false), batch_norm()}, 7});
  check_case({"after a conv (blocked layout in), then relu", Shape{6, 6, 2},
              {conv(16, 3, 1, Padding::same, Activation::linear, false), batch_norm(),
               nn::ActivationOptions{Activation::relu}},
              3});
  // Batch normalization applies the relu layer's derivative (the relu layer's backward moves
  // nothing): on the blocked layout with padding lanes and 'same' convolutions around it, on 2-D
  // input, and below an average pooling, which would otherwise apply it reading the relu's output.
  const std::vector<std::size_t> relu_in_bn{2};
  Case between{"conv, bn, relu layer, conv (20 channels: padding lanes)", Shape{7, 7, 3},
               {conv(20, 3, 1, Padding::same, Activation::linear, false), batch_norm(),
                nn::ActivationOptions{Activation::relu}, conv(6, 3, 1, Padding::same, Activation::linear)},
               3};
  between.backward_moves_nothing = relu_in_bn;
  check_case(between);
  // 2-D: 12 features (vectors of 4 lanes), and 5 (one lane a vector).
  for (const int features : {12, 5}) {
    Case flat{fmt::format("dense, bn over {} features, relu layer, dense", features), Shape{9},
              {dense(features, Activation::linear, false), batch_norm(), nn::ActivationOptions{Activation::relu},
               dense(3, Activation::linear)},
              6};
    flat.backward_moves_nothing = relu_in_bn;
    check_case(flat);
  }
  Case averaged{"conv, bn, relu layer, average pooling", Shape{8, 8, 2},
                {conv(16, 3, 1, Padding::valid, Activation::linear, false), batch_norm(),
                 nn::ActivationOptions{Activation::relu}, avg_pool(2, 2, Padding::valid), nn::FlattenOptions{},
                 dense(3, Activation::linear)},
                4};
  averaged.backward_moves_nothing = {2, 4};  // the relu layer's, and the flatten's (it moves nothing either way)
  check_case(averaged);
  check_case({"no center, no scale", Shape{4, 4, 3}, {batch_norm(false, false)}, 2});
  check_case({"scale only", Shape{5}, {batch_norm(false, true)}, 4});
  check_case({"inference uses the moving statistics", Shape{4, 4, 3}, {batch_norm()}, 2, nn::Mode::inference});
  // The kernel works on the layout the conv chose (channel = group * lanes + lane): several
  // groups, channels that leave padding lanes in the last group (which must come out zero, or the
  // conv below would read them), planes longer than the float blocks its sums flush to double.
  check_case({"two channel groups, planes of 81 positions", Shape{9, 9, 2},
              {conv(32, 3, 1, Padding::same, Activation::linear, false), batch_norm(),
               nn::ActivationOptions{Activation::relu}},
              2});
  check_case({"20 channels: padding lanes in a blocked layout", Shape{6, 6, 3},
              {conv(20, 3, 1, Padding::valid, Activation::linear, false), batch_norm(),
               conv(4, 3, 1, Padding::valid, Activation::linear)},
              3});
  check_case({"inference on a blocked layout with padding lanes", Shape{6, 6, 3},
              {conv(20, 3, 1, Padding::valid, Activation::linear, false), batch_norm()},
              2, nn::Mode::inference});
  // The experiment's block: batch normalization computes the relu and the max pooling above it
  // (the two layers pass their memories through).
  Case block{"conv, bn, relu layer, max pool", Shape{8, 8, 3},
             {conv(32, 3, 1, Padding::valid, Activation::linear, false), batch_norm(),
              nn::ActivationOptions{Activation::relu}, pool(2, 2, Padding::valid), nn::FlattenOptions{},
              dense(3, Activation::linear)},
             3};
  block.computed_below = {3};
  check_case(block);
  // Batch normalization applies the relu layer's activation as it writes (the relu layer then
  // moves nothing forward), in inference too.
  Case inference{"conv, bn, relu layer, max pool in inference", Shape{6, 6, 3},
                 {conv(20, 3, 1, Padding::valid, Activation::linear, false), batch_norm(),
                  nn::ActivationOptions{Activation::relu}, pool(2, 2, Padding::valid)},
                 2, nn::Mode::inference};
  // (The pooling is the last layer here: the model's output, which no layer computes below.)
  check_case(inference);
  // 2-D input over more rows than one plane of the kernel's sums (256).
  check_case({"dense features, 300 rows", Shape{6}, {dense(5, Activation::linear, false), batch_norm()}, 300});
}

TEST_CASE("batch_normalization's statistics and gradients have the same bits on 1, 2 and 3 OpenMP threads") {
  // Each plane (a sample's channel group) is summed in one fixed order and the planes are added in
  // order, whichever thread took a plane.
  config::ModelConfig mc;
  mc.input_shape = {7, 6, 3};
  mc.layers.push_back(nn::layer_config("conv2d", conv(20, 3, 1, Padding::same, Activation::linear, false)));
  mc.layers.push_back(nn::layer_config("batch_normalization", batch_norm()));
  const std::vector<float> one = step_bits_on_threads(mc, 11, 1);
  CHECK(step_bits_on_threads(mc, 11, 2) == one);
  CHECK(step_bits_on_threads(mc, 11, 3) == one);
}

namespace {

// One step of a model on `ctx` with variables and data drawn from fixed seeds: the output and, training, every variable's gradient (moving statistics' shares too)
// and the input's gradient, in model order.
// `powers_of_two`: every variable and input a power of two from 2^-12 to 2^12 with its sign, so
// that products are exact and sums cancel often: a sum taken in another order then rounds to
// another value, even in bfloat16 (a small term added before the large ones cancel is lost).
std::vector<float> step_values(const config::ModelConfig& mc, device::Context& ctx, DType compute, nn::Mode mode,
                               std::int64_t batch, bool input_gradient = true, bool powers_of_two = false) {
  nn::Sequential model(mc, 3, ctx, nn::ModelOptions{.compute = compute, .input_gradient = input_gradient});
  Rng init(17, RngStream::test);
  randomize_variables(model, init);
  const auto scaled = [powers_of_two](float v, Rng& rng) {
    if (!powers_of_two) return v;
    return std::ldexp(v < 0 ? -1.0f : 1.0f, static_cast<int>(std::floor(rng.uniform(-12.0f, 13.0f))));
  };
  for (std::size_t l = 0; l < model.num_layers() && powers_of_two; ++l)
    for (auto& v : model.layer(l).variables())
      for (float& value : v.value.span<float>()) value = scaled(value, init);
  Tensor x(model.input_shape().with_batch(batch));
  Rng rng(5, RngStream::test);
  for (auto& v : x.span<float>()) v = scaled(rng.uniform(-1.0f, 1.0f), rng);
  const nn::StepContext step = testing::step_of(mode, batch);
  const Tensor& y = model.forward(x, step);
  std::vector<float> values(y.span<float>().begin(), y.span<float>().end());
  if (mode == nn::Mode::inference) return values;
  for (auto& v : model.output_gradient().span<float>()) v = rng.uniform(-1.0f, 1.0f);
  model.backward(step);
  for (std::size_t l = 0; l < model.num_layers(); ++l)
    for (auto& v : model.layer(l).variables()) values.insert(values.end(), v.grad.span<float>().begin(), v.grad.span<float>().end());
  if (!input_gradient) return values;
  const auto dx = model.input_gradient().span<float>();
  values.insert(values.end(), dx.begin(), dx.end());
  return values;
}

// A model of `layers` (named l0, l1, ...) on `input`.
config::ModelConfig model_of_layers(const Shape& input, const std::vector<L>& layers) {
  config::ModelConfig mc;
  mc.input_shape = input.to_vector();
  for (std::size_t i = 0; i < layers.size(); ++i) mc.layers.push_back(named(layers[i], fmt::format("l{}", i)));
  return mc;
}

// float32, and bfloat16 where the CPU has it.
std::vector<DType> compute_dtypes_here() {
  std::vector<DType> dtypes{DType::f32};
  if (cpu_has_bf16()) dtypes.push_back(DType::bf16);
  return dtypes;
}

// fn(ctx, compute) for each loop level this CPU runs (testing::loop_isas_here) and each compute
// dtype it has, on a context whose loops are built for that level.
template <class Fn>
void on_each_loop_level(const Fn& fn) {
  for (const backends::onednn::LoopIsa isa : testing::loop_isas_here())
    for (const DType compute : compute_dtypes_here()) {
      CAPTURE(backends::onednn::name_of(isa));
      CAPTURE(std::string(dtype_name(compute)));
      const std::unique_ptr<device::Context> owned = device::make_context(Device{});
      backends::onednn::OnednnContext::of(*owned).set_loop_isa(isa);
      fn(*owned, compute);
    }
}

// How many of step_values' values (outputs, then in training every gradient and dx) differ
// between the two models (+0 and -0 equal).
std::size_t unequal_step_values(const config::ModelConfig& one, const config::ModelConfig& other, device::Context& ctx,
                                DType compute, nn::Mode mode) {
  const std::vector<float> a = step_values(one, ctx, compute, mode, 5);
  const std::vector<float> b = step_values(other, ctx, compute, mode, 5);
  REQUIRE(a.size() == b.size());
  std::size_t unequal = 0;
  for (std::size_t i = 0; i < a.size(); ++i) unequal += !(a[i] == b[i]);
  return unequal;
}

}  // namespace

TEST_CASE("batch normalization computing the relu and max pooling above it gives the values of the three apart") {
  // Apart: a linear Activation between the relu and the pooling keeps them from being fused (the
  // relu layer then applies its own derivative, the pooling none). Windows that leave a row and a
  // column out (their gradient is zero, their dx is not), 3 x 3 and 2 x 3 windows, 20 channels
  // (padding lanes in channel blocks), a first layer on the raw input (canonical nhwc, 3 channels:
  // a lane at a time), synchronized or not, center/scale off; training and inference; on every loop
  // level the machine has (testing::loop_isas_here).
  struct Block {
    std::string label;
    Shape input;
    std::vector<L> below;  // layers before the batch normalization
    nn::MaxPool2DOptions pooling;
    nn::BatchNormalizationOptions norm = batch_norm();
  };
  nn::MaxPool2DOptions two_by_three = pool(2, 2, Padding::valid);
  two_by_three.pool_size = {2, 3};
  two_by_three.strides = std::array<int, 2>{2, 3};
  nn::BatchNormalizationOptions synchronized_plain = batch_norm(false, false);
  synchronized_plain.synchronized = true;
  const std::vector<Block> blocks{
      {"2 x 2 over 7 x 9 after a conv of 32 filters", Shape{9, 11, 2},
       {conv(32, 3, 1, Padding::valid, Activation::linear, false)}, pool(2, 2, Padding::valid)},
      {"3 x 3 over 10 x 10, 20 channels", Shape{12, 12, 3}, {conv(20, 3, 1, Padding::valid, Activation::linear, false)},
       pool(3, 3, Padding::valid)},
      {"2 x 3 windows, no center or scale, synchronized", Shape{8, 9, 3},
       {conv(16, 3, 1, Padding::same, Activation::linear, false)}, two_by_three, synchronized_plain},
      {"the raw input, 3 channels", Shape{7, 6, 3}, {}, pool(2, 2, Padding::valid)},
  };
  const auto model_of = [](const Block& b, bool apart) {
    std::vector<L> layers = b.below;
    layers.push_back(b.norm);
    layers.push_back(nn::ActivationOptions{Activation::relu});
    if (apart) layers.push_back(nn::ActivationOptions{Activation::linear});
    layers.push_back(b.pooling);
    layers.push_back(nn::FlattenOptions{});
    layers.push_back(dense(3, Activation::linear));
    return model_of_layers(b.input, layers);
  };
  for (const Block& b : blocks) {
    CAPTURE(b.label);
    on_each_loop_level([&](device::Context& ctx, DType compute) {
      for (const nn::Mode mode : {nn::Mode::training, nn::Mode::inference}) {
        CAPTURE(mode == nn::Mode::training);
        const config::ModelConfig fused = model_of(b, false), apart = model_of(b, true);
        {
          const nn::Sequential model(fused, 3, ctx, nn::ModelOptions{.compute = compute, .input_gradient = true});
          const std::size_t pooling = b.below.size() + 2;
          REQUIRE(model.computed_by_layer_below(pooling));
          CHECK(model.computing_layer(pooling) == b.below.size());
        }
        CHECK(unequal_step_values(fused, apart, ctx, compute, mode) == 0);
      }
    });
  }
}

TEST_CASE("batch normalization applying the relu layer's derivative gives the values of the layers apart") {
  // Apart: a linear Activation between batch normalization and the relu keeps the relu to its own
  // layer, forward and backward. The relu's input is recomputed from x in backward; its bits must
  // be forward's for the derivative to match. A blocked layout with padding lanes (20 channels), 32
  // channels (two blocks of 16), 2-D input with odd feature counts, and an average pooling above
  // (which would otherwise apply the derivative itself); f32 and, where the CPU has it, bfloat16;
  // on every loop level the machine has.
  struct Block {
    std::string label;
    Shape input;
    std::vector<L> below, above;  // the layers before batch normalization, and after the relu
  };
  const std::vector<Block> blocks{
      {"conv of 20 filters, then a conv", Shape{7, 7, 3}, {conv(20, 3, 1, Padding::same, Activation::linear, false)},
       {conv(6, 3, 1, Padding::same, Activation::linear)}},
      {"conv of 32 filters, then average pooling", Shape{8, 8, 2},
       {conv(32, 3, 1, Padding::valid, Activation::linear, false)},
       {avg_pool(2, 2, Padding::valid), nn::FlattenOptions{}, dense(3, Activation::linear)}},
      {"dense of 12 features", Shape{9}, {dense(12, Activation::linear, false)}, {dense(3, Activation::linear)}},
      {"dense of 5 features", Shape{9}, {dense(5, Activation::linear, false)}, {dense(3, Activation::linear)}},
  };
  const auto model_of = [](const Block& b, bool apart) {
    std::vector<L> layers = b.below;
    layers.push_back(batch_norm());
    if (apart) layers.push_back(nn::ActivationOptions{Activation::linear});
    layers.push_back(nn::ActivationOptions{Activation::relu});
    layers.insert(layers.end(), b.above.begin(), b.above.end());
    return model_of_layers(b.input, layers);
  };
  for (const Block& b : blocks) {
    CAPTURE(b.label);
    on_each_loop_level([&](device::Context& ctx, DType compute) {
      const config::ModelConfig fused = model_of(b, false), apart = model_of(b, true);
      {
        const nn::Sequential model(fused, 3, ctx, nn::ModelOptions{.compute = compute, .input_gradient = true});
        const std::size_t relu = b.below.size() + 1;
        CHECK(model.backward_moves_nothing(relu));
      }
      CHECK(unequal_step_values(fused, apart, ctx, compute, nn::Mode::training) == 0);
    });
  }
}

namespace {

// A training step's values (step_values: powers of two, no input gradient) on each loop level of
// `isas` bit for bit those of the widest; `on_level` (if any) checks each level's context first.
void check_same_bits_on_loop_levels(const config::ModelConfig& mc, DType compute,
                                    const std::vector<backends::onednn::LoopIsa>& isas,
                                    const std::function<void(device::Context&)>& on_level = {}) {
  std::vector<float> widest;
  for (auto isa = isas.rbegin(); isa != isas.rend(); ++isa) {
    CAPTURE(backends::onednn::name_of(*isa));
    const std::unique_ptr<device::Context> owned = device::make_context(Device{});
    backends::onednn::OnednnContext::of(*owned).set_loop_isa(*isa);
    if (on_level) on_level(*owned);
    const std::vector<float> values = step_values(mc, *owned, compute, nn::Mode::training, 9, false, true);
    if (widest.empty()) {
      widest = values;
      continue;
    }
    REQUIRE(values.size() == widest.size());
    std::size_t unequal = 0;
    for (std::size_t i = 0; i < values.size(); ++i)
      unequal += std::bit_cast<std::uint32_t>(values[i]) != std::bit_cast<std::uint32_t>(widest[i]);
    CHECK(unequal == 0);
  }
}

}  // namespace

TEST_CASE("a first convolution computing the max pooling above it gives the same bits on every loop level") {
  // The fused loops (conv2d.cpp) sum each output and each weight's gradient in one order whatever
  // their vectors: 16 lanes on AVX-512, 8 below. In bfloat16 on CPUs with AVX512-BF16 and no AMX,
  // the 16-lane loops take their products two an instruction (VDPBF16PS: two taps forward, a
  // window row's two positions backward), which adds them in that order too: the same bits as the
  // narrower levels' one multiply-add a product. Cases: the seed CNN's first layers (32 filters:
  // two vectors of 16), 27 taps (the last pair a tap alone) with 'same' padding and 48 filters
  // (a pair of vectors, then one), 50 taps on 2 channels with gaps between 2 x 2 windows, no bias,
  // 64 filters (four vectors a window), a linear activation at stride 2 (no pooling on codes; the
  // backward's pairs still), and 2 x 3 windows (no pairs). Powers of two of far apart exponents, so that
  // an order changed shows in bfloat16's rounded outputs too (step_values' powers_of_two). The levels with FMA: plain x86-64's
  // loops (the dense layer's above, here) round a product before adding it.
  struct Block {
    std::string label;
    Shape input;
    nn::Conv2DOptions conv;
    nn::MaxPool2DOptions pooling;
  };
  nn::MaxPool2DOptions gaps = pool(2, 2, Padding::valid);
  gaps.strides = std::array<int, 2>{3, 3};
  nn::MaxPool2DOptions two_by_three = pool(2, 2, Padding::valid);
  two_by_three.pool_size = {2, 3};
  two_by_three.strides = std::array<int, 2>{2, 3};
  const std::vector<Block> blocks{
      {"the seed CNN's first layers", Shape{28, 28, 1}, conv(32, 3, 1, Padding::valid, Activation::relu),
       pool(2, 2, Padding::valid)},
      {"27 taps, 'same', 48 filters", Shape{10, 9, 3}, conv(48, 3, 1, Padding::same, Activation::relu),
       pool(2, 2, Padding::valid)},
      {"50 taps, gaps between windows, no bias, 64 filters", Shape{13, 13, 2},
       conv(64, 5, 1, Padding::valid, Activation::relu, false), gaps},
      {"linear at stride 2", Shape{12, 11, 1}, conv(16, 3, 2, Padding::valid, Activation::linear),
       pool(2, 2, Padding::valid)},
      {"2 x 3 windows", Shape{9, 10, 1}, conv(16, 3, 1, Padding::valid, Activation::relu), two_by_three},
  };
  std::vector<backends::onednn::LoopIsa> isas = testing::loop_isas_here();
  std::erase(isas, backends::onednn::LoopIsa::x86_64);
  if (isas.size() < 2) MESSAGE("skipped: this CPU's loops have one level with FMA");
  for (const Block& b : blocks)
    for (const DType compute : compute_dtypes_here()) {
      CAPTURE(b.label);
      CAPTURE(std::string(dtype_name(compute)));
      const config::ModelConfig mc =
          model_of_layers(b.input, {b.conv, b.pooling, nn::FlattenOptions{}, dense(3, Activation::linear)});
      check_same_bits_on_loop_levels(mc, compute, isas, [&](device::Context& ctx) {
        const nn::Sequential model(mc, 3, ctx, nn::ModelOptions{.compute = compute, .input_gradient = false});
        REQUIRE(model.computed_by_layer_below(1));
      });
    }
}

namespace {

// The values of a training step (step_values, powers of two) of a model without its input's
// gradient whose bits differ from those of the same model computing it: where a first layer takes
// paths of its own when no input gradient is wanted, they must compute the primitives' bits.
std::size_t unequal_without_input_gradient(const config::ModelConfig& mc, device::Context& ctx, DType compute,
                                           std::int64_t batch) {
  const std::vector<float> lean = step_values(mc, ctx, compute, nn::Mode::training, batch, false, true);
  const std::vector<float> whole = step_values(mc, ctx, compute, nn::Mode::training, batch, true, true);
  REQUIRE(whole.size() > lean.size());  // (then the input's gradient)
  std::size_t unequal = 0;
  for (std::size_t i = 0; i < lean.size(); ++i)
    unequal += std::bit_cast<std::uint32_t>(lean[i]) != std::bit_cast<std::uint32_t>(whole[i]);
  return unequal;
}

}  // namespace

TEST_CASE("a first convolution's weight loops apply its relu's derivative with the bits of the relu's backward") {
  // Without the model's input gradient, a first convolution's weight loops are the only reader of
  // the gradient before its relu, and apply the relu's derivative as they read the gradient after
  // it (conv2d.cpp): every variable's gradient has the bits of a model that computes its input's
  // gradient, where the relu's backward writes that gradient first, on each loop level (16 lanes
  // on AVX-512, 8 below) and in each compute dtype; and agrees with the oracle. Cases: one channel
  // and 32 filters (two vectors of 16) under a convolution, RGB at stride 2 with 'same' padding and
  // 24 filters (padding lanes on AVX-512) without a bias, 50 taps on 2 channels (several passes
  // a sample), and 6 filters (vectors of 8 on every level); 11 samples, a chunk and a short one. Powers of two (step_values): a sum
  // taken in another order rounds to another value.
  struct Block {
    std::string label;
    Shape input;
    std::vector<L> layers;
  };
  const std::vector<Block> blocks{
      {"one channel, 32 filters, a convolution above", Shape{12, 11, 1},
       {conv(32, 3, 1, Padding::valid, Activation::relu), conv(8, 3, 1, Padding::valid, Activation::linear),
        nn::FlattenOptions{}, dense(3, Activation::linear)}},
      {"rgb, stride 2 'same', 24 filters, no bias", Shape{9, 10, 3},
       {conv(24, 3, 2, Padding::same, Activation::relu, false), nn::FlattenOptions{}, dense(3, Activation::linear)}},
      {"50 taps on 2 channels, 16 filters", Shape{11, 9, 2},
       {conv(16, 5, 1, Padding::valid, Activation::relu), nn::FlattenOptions{}, dense(3, Activation::linear)}},
      // 8 lanes on every level: 6 filters (LeNet's), 5 x 5 'same', read from oneDNN's blocks of 16.
      {"6 filters, 5x5 'same'", Shape{10, 9, 1},
       {conv(6, 5, 1, Padding::same, Activation::relu), nn::FlattenOptions{}, dense(3, Activation::linear)}},
  };
  for (const Block& b : blocks) {
    CAPTURE(b.label);
    Case oracle{b.label, b.input, b.layers, 11};
    oracle.input_gradient = false;
    check_case(oracle);
    const config::ModelConfig mc = model_of_layers(b.input, b.layers);
    on_each_loop_level([&](device::Context& ctx, DType compute) {
      CHECK(unequal_without_input_gradient(mc, ctx, compute, 11) == 0);
    });
  }
}

TEST_CASE("a first convolution's own forward: the oracle's values, the primitive's bits, in blocks of 8") {
  // Without the model's input gradient, a float32 first convolution of 8 filters or fewer on a few
  // channels computes its forward in its own loops (conv2d.cpp, plan_own_forward), its output in
  // blocks of 8 channels (oneDNN's AVX-512 kernels pad to 16): each output summed from zero in tap
  // order, as oneDNN's direct convolution sums it, then the bias and the relu; a sigmoid or tanh
  // by oneDNN's eltwise after it. Checked: against the oracle; a linear or relu layer's every value
  // with the bits of the model that computes its input's gradient (the primitive's forward), on
  // each loop level and compute dtype (bfloat16 keeps the primitive); the output's bytes those of
  // blocks of 8. Cases: LeNet's first layer (6 filters, 5 x 5 'same', tanh) under an average
  // pooling, 8 filters without a bias under batch normalization, RGB at stride 2 with 4 filters
  // and a sigmoid, 7 filters on 2 channels under a convolution; 11 samples, a chunk and a short one.
  // Where oneDNN runs its AVX2 kernels (own_forward_fits) the primitive computes the forward, in
  // blocks of 8 itself, and the same checks hold.
  struct Block {
    std::string label;
    Shape input;
    std::vector<L> layers;
    bool primitive_bits;  // linear or relu: the primitive's post-op is the loops' own arithmetic
  };
  const std::vector<Block> blocks{
      {"LeNet's first layer: 6 filters, 5 x 5 'same', tanh", Shape{12, 10, 1},
       {conv(6, 5, 1, Padding::same, Activation::tanh), avg_pool(2, 2, Padding::valid), nn::FlattenOptions{},
        dense(3, Activation::linear)},
       false},
      {"8 filters, no bias, batch normalization above", Shape{9, 9, 1},
       {conv(8, 3, 1, Padding::valid, Activation::linear, false), batch_norm(), nn::FlattenOptions{},
        dense(3, Activation::linear)},
       true},
      {"rgb, stride 2 'same', 4 filters, sigmoid", Shape{9, 10, 3},
       {conv(4, 3, 2, Padding::same, Activation::sigmoid), nn::FlattenOptions{}, dense(3, Activation::linear)}, false},
      {"2 channels, 7 filters, a convolution above", Shape{11, 9, 2},
       {conv(7, 3, 1, Padding::valid, Activation::relu), conv(8, 3, 1, Padding::valid, Activation::linear),
        nn::FlattenOptions{}, dense(3, Activation::linear)},
       true},
  };
  constexpr std::int64_t kBatch = 11;
  for (const Block& b : blocks) {
    CAPTURE(b.label);
    Case oracle{b.label, b.input, b.layers, kBatch};
    oracle.input_gradient = false;
    check_case(oracle);
    const config::ModelConfig mc = model_of_layers(b.input, b.layers);
    on_each_loop_level([&](device::Context& ctx, DType compute) {
      if (compute == DType::f32) {
        nn::Sequential model(mc, 3, ctx, nn::ModelOptions{.compute = compute, .input_gradient = false});
        const Shape& out = model.layer(0).output_shape();
        CHECK(model.output_bytes(kBatch, 0) == static_cast<std::size_t>(kBatch * out[0] * out[1] * 8) * sizeof(float));
      }
      if (b.primitive_bits) CHECK(unequal_without_input_gradient(mc, ctx, compute, kBatch) == 0);
    });
  }
}

TEST_CASE("conv with relu below max pooling, batch norm and dropout, with the input gradient (the GPU tests' CNN)") {
  // Two input channels, SAME padding, a short batch: the CPU side of tests/gpu's whole-model
  // comparison, which found non-finite weight gradients on a Sapphire Rapids.
  for (const std::int64_t batch : {5, 4, 1}) {
    CAPTURE(batch);
    check_case({"conv, max pool, bn, dropout, flatten, dense", Shape{8, 8, 2},
                {conv(4, 3, 1, Padding::same, Activation::relu), pool(2, 2, Padding::valid), batch_norm(),
                 nn::DropoutOptions{0.25}, nn::FlattenOptions{}, dense(10, Activation::linear)},
                batch});
  }
}

TEST_CASE("the GPU tests' CNN on the CPU with their seeds: every gradient finite and as the reference") {
  // tests/gpu's whole-model comparison step for step (its seeds, sample ids and draws), whose CPU
  // side gave non-finite kernel gradients on a Sapphire Rapids where check_case's did not.
  config::ModelConfig mc;
  mc.input_shape = {8, 8, 2};
  const std::vector<L> layers{conv(4, 3, 1, Padding::same, Activation::relu), pool(2, 2, Padding::valid), batch_norm(),
                              nn::DropoutOptions{0.25}, nn::FlattenOptions{}, dense(10, Activation::linear)};
  for (std::size_t i = 0; i < layers.size(); ++i) mc.layers.push_back(named(layers[i], fmt::format("l{}", i)));
  nn::Sequential model(mc, 9, testing::cpu(), nn::ModelOptions{.input_gradient = true});
  Rng init(31, RngStream::test);
  for (std::size_t l = 0; l < model.num_layers(); ++l)
    for (auto& v : model.layer(l).variables()) {
      const bool variance = v.name.ends_with("moving_variance");
      for (float& value : v.value.span<float>()) value = init.uniform(variance ? 0.5f : -1.0f, variance ? 1.5f : 1.0f);
    }
  const std::vector<std::int64_t> ids{12, 0, 7, 33, 4};
  nn::StepContext step = testing::step_of(nn::Mode::training, 5);
  step.seed = 1234;
  step.global_step = 17;
  step.sample_ids = ids;
  RefStack ref = RefStack::of(model, 5, step);
  Rng rng(32, RngStream::test);
  Tensor x(Shape{5, 8, 8, 2});
  for (float& v : x.span<float>()) v = rng.uniform(-1.0f, 1.0f);
  CHECK(rel_err(to_double(model.forward(x, step)), ref.forward(to_double(x))) < 1e-5);
  Tensor& dy = model.output_gradient();
  for (float& v : dy.span<float>()) v = rng.uniform(-1.0f, 1.0f);
  const Vec<double> dyd = to_double(dy);
  model.backward(step);
  std::vector<std::vector<Vec<double>>> dvars;
  const Vec<double> dx_ref = ref.backward(dyd, dvars);
  CHECK(rel_err(to_double(model.input_gradient()), dx_ref) < 1e-5);
  for (std::size_t l = 0; l < model.num_layers(); ++l) {
    auto vars = model.layer(l).variables();
    for (std::size_t k = 0; k < vars.size(); ++k) {
      CAPTURE(vars[k].name);
      const auto g = vars[k].grad.span<float>();
      CHECK(std::all_of(g.begin(), g.end(), [](float v) { return std::isfinite(v); }));
      CHECK(rel_err(to_double(vars[k].grad), dvars[l][k]) < 1e-5);
    }
  }
}

TEST_CASE("a stack of every new layer agrees with the reference") {
  check_case({"conv, bn, relu, avg pool, dropout, global pool, dense",
              Shape{10, 10, 1},
              {conv(8, 3, 1, Padding::same, Activation::linear, false), batch_norm(), nn::ActivationOptions{Activation::relu},
               avg_pool(2, 2, Padding::valid), nn::DropoutOptions{0.25}, nn::GlobalAveragePooling2DOptions{},
               dense(3, Activation::linear)},
              4});
}

namespace {

// A training step's masks depend on the step, the sample and the layer, not on the batch layout.
std::vector<std::uint8_t> masks_of(const nn::Dropout& d, const nn::StepContext& step, std::int64_t batch) {
  std::vector<std::uint8_t> keep(static_cast<std::size_t>(batch * d.output_shape().numel()));
  d.masks(step, batch, keep.data());
  return keep;
}

}  // namespace

TEST_CASE("dropout masks are keyed by (seed, step, sample id, layer) and drop about the rate") {
  config::ModelConfig mc;
  mc.input_shape = {1000};
  mc.layers = {nn::layer_config("a", nn::DropoutOptions{0.3}), nn::layer_config("b", nn::DropoutOptions{0.3})};
  nn::Sequential model(mc, 1, testing::cpu());
  const auto& a = static_cast<const nn::Dropout&>(model.layer(0));
  const auto& b = static_cast<const nn::Dropout&>(model.layer(1));
  nn::StepContext step = testing::step_of(nn::Mode::training, 4);
  step.seed = 9;
  step.global_step = 17;
  const std::vector<std::int64_t> ids{40, 41, 42, 43};
  step.sample_ids = ids;
  const auto whole = masks_of(a, step, 4);
  // The last two samples on another replica: their masks are the same bits.
  nn::StepContext half = step;
  half.sample_ids = std::span<const std::int64_t>(ids).subspan(2);
  const auto second = masks_of(a, half, 2);
  CHECK(std::equal(second.begin(), second.end(), whole.begin() + 2000));
  // Another layer, step or seed draws other masks.
  CHECK(masks_of(b, step, 4) != whole);
  nn::StepContext next = step;
  next.global_step = 18;
  CHECK(masks_of(a, next, 4) != whole);
  nn::StepContext other_seed = step;
  other_seed.seed = 10;
  CHECK(masks_of(a, other_seed, 4) != whole);
  // About 30 % dropped (4000 draws: 3 standard deviations is about 2 %).
  const double dropped = static_cast<double>(std::count(whole.begin(), whole.end(), 0)) / whole.size();
  CHECK(dropped == doctest::Approx(0.3).epsilon(0.07));
}

TEST_CASE("a model reuses its plan across steps and handles a second batch size") {
  nn::Sequential model(conv_flatten_dense({6, 6, 2}, 3, 2), 1, testing::cpu());
  const nn::StepContext ctx = testing::step_of(nn::Mode::inference);
  Tensor a(Shape{4, 6, 6, 2}), b(Shape{3, 6, 6, 2});
  Rng rng(1, RngStream::test);
  for (auto& v : a.span<float>()) v = rng.uniform();
  for (auto& v : b.span<float>()) v = rng.uniform();
  Tensor ya = model.forward(a, ctx).clone();
  const void* out_ptr = model.forward(a, ctx).raw();
  model.forward(b, ctx);
  const Tensor& ya2 = model.forward(a, ctx);
  CHECK(ya2.raw() == out_ptr);
  for (std::int64_t i = 0; i < ya.numel(); ++i) CHECK(ya.data<float>()[i] == ya2.data<float>()[i]);
  // The first 3 rows of a batch of 4 equal a batch of 3 of the same rows.
  Tensor a3 = a.slice_rows(0, 3).clone();
  const Tensor& y3 = model.forward(a3, ctx);
  for (std::int64_t i = 0; i < y3.numel(); ++i) CHECK(y3.data<float>()[i] == doctest::Approx(ya.data<float>()[i]).epsilon(1e-5));
}

TEST_CASE("glorot_uniform kernels, zero biases, Keras names") {
  const config::ModelConfig mc = conv_flatten_dense({8, 8, 1}, 16, 10);
  nn::Sequential model(mc, 42, testing::cpu());
  auto vars = model.variables();
  REQUIRE(vars.size() == 4);
  CHECK(vars[0]->name == "conv2d/kernel");
  CHECK(vars[0]->value.shape() == Shape{3, 3, 1, 16});
  CHECK(vars[2]->value.shape() == Shape{576, 10});
  const float limit = std::sqrt(6.0f / (9 + 9 * 16));
  float mx = 0;
  for (float v : vars[0]->value.span<float>()) mx = std::max(mx, std::abs(v));
  CHECK(mx <= limit);
  CHECK(mx > 0.8f * limit);
  for (float v : vars[1]->value.span<float>()) CHECK(v == 0.0f);
  nn::Sequential again(mc, 42, testing::cpu());
  CHECK(std::equal(vars[0]->value.span<float>().begin(), vars[0]->value.span<float>().end(),
                   again.variables()[0]->value.span<float>().begin()));
}

TEST_CASE("the gradients of a model are one contiguous arena, in variables() order") {
  nn::Sequential model(conv_flatten_dense({8, 8, 1}, 4, 3), 1, testing::cpu());
  const auto& vars = model.variables();
  REQUIRE(model.gradient_sizes().size() == vars.size());
  std::span<float> arena = model.gradient_arena().span<float>();
  CHECK(arena.size() == static_cast<std::size_t>(model.num_parameters()));
  std::size_t at = 0;
  for (std::size_t v = 0; v < vars.size(); ++v) {
    CAPTURE(v);
    CHECK(model.gradient_sizes()[v] == static_cast<std::size_t>(vars[v]->value.numel()));
    CHECK(vars[v]->grad.shape() == vars[v]->value.shape());
    CHECK(vars[v]->grad.data<float>() == arena.data() + at);
    at += model.gradient_sizes()[v];
  }
  CHECK(at == arena.size());
}

TEST_CASE("backward hands each layer's final gradients over, last layer first, regularization included") {
  config::ModelConfig mc;
  mc.input_shape = {6, 6, 2};
  nn::Conv2DOptions c = conv(3, 3, 1, Padding::valid, Activation::relu);
  c.kernel_regularizer.l2 = 0.5;
  nn::DenseOptions d1 = dense(4, Activation::relu);
  d1.kernel_regularizer.l2 = 0.25;
  mc.layers = {nn::layer_config("c", c), nn::layer_config("f", nn::FlattenOptions{}), nn::layer_config("d1", d1),
               nn::layer_config("d2", dense(2, Activation::linear))};
  nn::Sequential plain(mc, 3, testing::cpu()), hooked(mc, 3, testing::cpu());
  const nn::StepContext ctx = testing::step_of(nn::Mode::training, 5);
  Tensor x(Shape{5, 6, 6, 2}), dy(Shape{5, 2});
  Rng rng(2, RngStream::test);
  for (auto& v : x.span<float>()) v = rng.uniform(-1.0f, 1.0f);
  for (auto& v : dy.span<float>()) v = rng.uniform(-1.0f, 1.0f);

  // The reference: the whole backward, then the regularization gradient.
  plain.forward(x, ctx);
  std::copy_n(dy.data<float>(), dy.numel(), plain.output_gradient().data<float>());
  plain.backward(ctx);
  plain.add_regularization_gradient(0.5f);

  // Hooked: what each hand-over shows must already be the final gradient.
  std::vector<std::pair<std::size_t, std::size_t>> calls;
  std::vector<std::vector<float>> at_hand_over(hooked.variables().size());
  const std::function<void(std::size_t, std::size_t)> ready = [&](std::size_t first, std::size_t count) {
    calls.emplace_back(first, count);
    for (std::size_t v = first; v < first + count; ++v) {
      auto g = hooked.variables()[v]->grad.span<float>();
      at_hand_over[v].assign(g.begin(), g.end());
    }
  };
  hooked.forward(x, ctx);
  std::copy_n(dy.data<float>(), dy.numel(), hooked.output_gradient().data<float>());
  hooked.backward(ctx, nn::BackwardOptions{0.5f, &ready});

  // Variables: c kernel, c bias (0, 1), d1 (2, 3), d2 (4, 5); flatten has none and is skipped.
  CHECK(calls == std::vector<std::pair<std::size_t, std::size_t>>{{4, 2}, {2, 2}, {0, 2}});
  for (std::size_t v = 0; v < plain.variables().size(); ++v) {
    CAPTURE(v);
    auto want = plain.variables()[v]->grad.span<float>();
    auto got = hooked.variables()[v]->grad.span<float>();
    REQUIRE(at_hand_over[v].size() == want.size());
    for (std::size_t i = 0; i < want.size(); ++i) {
      CHECK(got[i] == want[i]);  // the same arithmetic in the same order: equal bits
      CHECK(at_hand_over[v][i] == want[i]);
    }
  }
}

namespace {

// Under mixed_bfloat16 a model's last layer computes in f32, so each case ends in a linear
// Activation and the layers under test compute in bf16.
Case in_bf16(Case c, double gradient_tolerance = 0) {
  c.compute = DType::bf16;
  c.gradient_tolerance = gradient_tolerance;
  c.layers.push_back(nn::ActivationOptions{Activation::linear});
  return c;
}

}  // namespace

TEST_CASE("bfloat16 weight loops two positions an instruction: the bits of one multiply-add each") {
  // On AVX512-BF16 without AMX, a bfloat16 convolution's weights' gradients are the weight loops
  // (conv2d.cpp) also above the first layer, x read as the layer below's bfloat16 codes; on AVX-512
  // they take two neighbouring positions of an output row an instruction (VDPBF16PS over a pair
  // image of x and the gradient's words), added in the order of the narrower level's one
  // multiply-add a product: the same bits, which powers of two of far apart exponents would show
  // otherwise (step_values). Against the oracle too. Cases: the seed CNN's shape (the second
  // convolution crops 4 x 4 of 5 x 5 for its pooling; 64 filters: four vectors a pass), 'same'
  // padding at an odd output width (a row's last position alone) with 48 filters (three vectors)
  // and no bias, 5 x 5 at stride 2 on 5 channels (channels not in whole vectors) with 24 filters
  // (two vectors, one half padding), and 16 filters (one vector).
  if (!cpu_has_bf16() || !backends::onednn::cpu_multiplies_bf16_pairs()) {
    MESSAGE("skipped: this CPU has no AVX512-BF16, or has AMX (its bfloat16 weights' gradients are matmuls)");
    return;
  }
  std::vector<backends::onednn::LoopIsa> isas = testing::loop_isas_here();
  std::erase(isas, backends::onednn::LoopIsa::x86_64);
  REQUIRE(isas.size() == 2);  // (AVX512-BF16 comes with AVX-512)
  struct Block {
    std::string label;
    Shape input;
    std::vector<L> layers;
  };
  const std::vector<Block> blocks{
      {"the seed CNN's shape", Shape{16, 16, 1},
       {conv(32, 3, 1, Padding::valid, Activation::relu), pool(2, 2, Padding::valid),
        conv(64, 3, 1, Padding::valid, Activation::relu), pool(2, 2, Padding::valid), nn::FlattenOptions{},
        dense(3, Activation::linear)}},
      {"'same' at an odd width, 48 filters, no bias", Shape{9, 7, 2},
       {conv(16, 3, 1, Padding::same, Activation::relu), conv(48, 3, 1, Padding::same, Activation::relu, false),
        nn::FlattenOptions{}, dense(3, Activation::linear)}},
      {"5 x 5 at stride 2 on 5 channels, 24 filters", Shape{13, 12, 1},
       {conv(5, 3, 1, Padding::valid, Activation::relu), conv(24, 5, 2, Padding::valid, Activation::relu),
        nn::FlattenOptions{}, dense(3, Activation::linear)}},
      {"16 filters", Shape{8, 9, 1},
       {conv(8, 3, 1, Padding::valid, Activation::relu), conv(16, 3, 1, Padding::valid, Activation::linear),
        nn::FlattenOptions{}, dense(3, Activation::linear)}},
  };
  for (const Block& b : blocks) {
    CAPTURE(b.label);
    check_case(in_bf16({b.label, b.input, b.layers, 5}, kBf16RoutedGradientTolerance));
    check_same_bits_on_loop_levels(model_of_layers(b.input, b.layers), DType::bf16, isas);
  }
}

TEST_CASE("mixed_bfloat16: every layer kind against the reference, to bfloat16's precision") {
  if (!cpu_has_bf16()) {
    MESSAGE("this CPU has no bfloat16 instructions: the bf16 kernels are not checked here");
    return;
  }
  const nn::ActivationOptions relu{Activation::relu}, softmax{Activation::softmax};
  check_case(in_bf16({"conv 3x3 same relu", Shape{8, 8, 3}, {conv(16, 3, 1, Padding::same, Activation::relu)}, 4}));
  check_case(in_bf16({"conv 3x3 stride 2 valid tanh, no bias", Shape{9, 9, 4},
                      {conv(8, 3, 2, Padding::valid, Activation::tanh, false)}, 3}));
  // On AMX a bfloat16 convolution's weights' gradients are matmuls over im2col copies of a few
  // samples at a time (conv2d.cpp): 'same' padding on both sides, a kernel and strides that differ
  // by direction, and a batch of 5 in copies of 3 samples (a shorter last copy). Elsewhere
  // oneDNN's backward-weights primitive computes the same case.
  nn::Conv2DOptions uneven = conv(40, 3, 1, Padding::same, Activation::relu);
  uneven.kernel_size = {3, 5};
  uneven.strides = {2, 1};
  check_case(in_bf16({"conv 3x5 strides (2, 1) same relu, 24 channels", Shape{22, 20, 24}, {uneven}, 5},
                     kBf16RoutedGradientTolerance));
  check_case(in_bf16({"dense sigmoid", Shape{20}, {dense(16, Activation::sigmoid)}, 5}));
  // On AMX, from about 32 rows, a bfloat16 dense layer's kernel gradient is a matmul over x read
  // transposed (dense.cpp); below, and elsewhere, oneDNN's backward-weights primitive.
  check_case(in_bf16({"dense relu, 32 rows", Shape{200}, {dense(48, Activation::relu)}, 32},
                     kBf16RoutedGradientTolerance));
  check_case(in_bf16({"dense softmax (a softmax computes in f32)", Shape{20}, {dense(10, Activation::softmax)}, 5}));
  check_case(in_bf16({"activation layers, softmax converts to f32", Shape{8},
                      {dense(6, Activation::linear), relu, softmax}, 3}));
  // A deep stack of smooth layers: rounding errors add up layer by layer but stay bfloat16-sized.
  check_case(in_bf16({"smooth stack: conv tanh, avg pool, conv sigmoid, avg pool, dense tanh, dense",
                      Shape{12, 12, 2},
                      {conv(8, 3, 1, Padding::same, Activation::tanh), avg_pool(2, 2, Padding::valid),
                       conv(8, 3, 1, Padding::valid, Activation::sigmoid), avg_pool(2, 2, Padding::valid),
                       nn::FlattenOptions{}, dense(16, Activation::tanh), dense(5, Activation::linear)},
                      3},
                     3e-2));
  // Relu, max pooling and batch statistics route gradients by rounded values
  // (kBf16RoutedGradientTolerance).
  check_case(in_bf16({"seed cnn",
                      Shape{28, 28, 1},
                      {conv(32, 3, 1, Padding::valid, Activation::relu), pool(2, 2, Padding::valid),
                       conv(64, 3, 1, Padding::valid, Activation::relu), pool(2, 2, Padding::valid),
                       nn::FlattenOptions{}, dense(64, Activation::relu), dense(10, Activation::linear)},
                      4},
                     kBf16RoutedGradientTolerance));
  check_case(in_bf16({"conv, bn, relu, avg pool, dropout, global pool, dense",
                      Shape{10, 10, 1},
                      {conv(8, 3, 1, Padding::same, Activation::linear, false), batch_norm(), relu,
                       avg_pool(2, 2, Padding::valid), nn::DropoutOptions{0.25}, nn::GlobalAveragePooling2DOptions{},
                       dense(3, Activation::linear)},
                      4},
                     kBf16RoutedGradientTolerance));
  // (Batch normalization computes the relu and the max pooling: layer 3 passes through.)
  Case pooled_in_bn = in_bf16({"conv with 20 channels (padding lanes), bn, relu, max pool, dense", Shape{8, 8, 3},
                               {conv(20, 3, 1, Padding::valid, Activation::linear, false), batch_norm(), relu,
                                pool(2, 2, Padding::valid), nn::FlattenOptions{}, dense(3, Activation::linear)},
                               4},
                              kBf16RoutedGradientTolerance);
  pooled_in_bn.computed_below = {3};
  check_case(pooled_in_bn);
  check_case(in_bf16({"dense, bn (2-D bf16 input)", Shape{12},
                      {dense(8, Activation::linear, false), batch_norm(), dense(3, Activation::linear)},
                      5},
                     kBf16RoutedGradientTolerance));
  check_case(in_bf16({"inference", Shape{6, 6, 2},
                      {conv(8, 3, 1, Padding::valid, Activation::relu), batch_norm(), nn::DropoutOptions{0.5},
                       nn::FlattenOptions{}, dense(4, Activation::linear)},
                      2, nn::Mode::inference}));
}

TEST_CASE("mixed_bfloat16 really computes in bfloat16, with float32 variables and gradients") {
  if (!cpu_has_bf16()) {
    MESSAGE("this CPU has no bfloat16 instructions: skipped");
    return;
  }
  config::ModelConfig mc = conv_flatten_dense({8, 8, 3}, 16, 5);
  nn::Sequential f32(mc, 3, testing::cpu(), nn::ModelOptions{.compute = DType::f32});
  nn::Sequential bf16(mc, 3, testing::cpu(), nn::ModelOptions{.compute = DType::bf16});
  for (std::size_t l = 0; l < f32.num_layers(); ++l)
    for (const Variable& v : bf16.layer(l).variables()) CHECK(v.value.dtype() == DType::f32);
  Tensor x(Shape{4, 8, 8, 3});
  Rng rng(5, RngStream::test);
  for (auto& v : x.span<float>()) v = rng.uniform(-1.0f, 1.0f);
  const nn::StepContext step = testing::step_of(nn::Mode::training, 4);
  const Vec<double> y32 = to_double(f32.forward(x, step));
  const Vec<double> y16 = to_double(bf16.forward(x, step));
  // The conv rounds to bfloat16: far more than float32's rounding, far less than a wrong result.
  CHECK(rel_err(y16, y32) > 1e-4);
  CHECK(rel_err(y16, y32) < 2e-2);
  for (auto& v : bf16.output_gradient().span<float>()) v = 1.0f;
  bf16.backward(step);
  double sum = 0;
  for (float g : bf16.gradient_arena().span<float>()) sum += std::abs(g);
  CHECK(std::isfinite(sum));
  CHECK(sum > 0);
}

TEST_CASE("random models of every layer kind agree with the reference on every loop level") {
  on_each_loop_level([&](device::Context& ctx, DType compute) {
    Rng rng(testing::random_model_seed(2026), RngStream::test);
    for (int i = 0, n = testing::random_model_count(40); i < n; ++i) {
      const testing::RandomModel m = testing::random_model(rng, i, compute == DType::bf16);
      Case c;
      c.label = m.label;
      c.input = m.input;
      for (const config::LayerConfig& layer : m.layers) c.layers.emplace_back(layer);
      c.batch = m.batch;
      c.compute = compute;
      c.input_gradient = m.input_gradient;
      c.generated = testing::random_model_tolerances(compute);
      check_case(c, ctx);
    }
  });
}
