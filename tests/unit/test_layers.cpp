// oneDNN layers against the reference layers, and the reference layers against finite
// differences. Shapes are drawn to cover strides, both paddings (odd sizes make 'same' pad
// asymmetrically), every activation, and stacks where oneDNN's blocked layouts meet.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <span>
#include <utility>
#include <vector>
#include <string>

#include <fmt/format.h>

#include "core/rng.hpp"
#include "kernels/cpu/dnnl_context.hpp"
#include "layer_oracle.hpp"
#include "nn/model.hpp"

using namespace dtrain;
using testing::RefStack;
using testing::Vec;
using config::Activation;
using config::Padding;

namespace {

double rel_err(const Vec<double>& a, const Vec<double>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

Vec<double> to_double(const Tensor& t) {
  auto s = t.span<float>();
  return Vec<double>(s.begin(), s.end());
}

Vec<double> random_vec(std::size_t n, Rng& rng) {
  Vec<double> v(n);
  for (auto& x : v) x = rng.uniform(-1.0f, 1.0f);
  return v;
}

config::LayerConfig layer(config::LayerOptions o, std::string name) { return config::LayerConfig{std::move(name), std::move(o), {}}; }

struct Case {
  std::string label;
  Shape input;  // per example
  std::vector<config::LayerOptions> layers;
  std::int64_t batch;
};

// Runs one case: oneDNN vs reference (1e-5 relative) for outputs, every gradient and dx; then a
// finite-difference check of the reference in double.
void check_case(const Case& c) {
  CAPTURE(c.label);
  config::ModelConfig mc;
  mc.input_shape = c.input.to_vector();
  for (std::size_t i = 0; i < c.layers.size(); ++i) mc.layers.push_back(layer(c.layers[i], fmt::format("l{}", i)));
  nn::Sequential model(mc, 7, /*input_gradient=*/true);
  kernels::cpu::Context ctx;
  Rng rng(11, RngStream::test);

  RefStack<double> ref;
  ref.layers = c.layers;
  ref.n = c.batch;
  ref.shapes.push_back(c.input);
  for (auto& o : c.layers) ref.shapes.push_back(testing::ref_output_shape(o, ref.shapes.back()));
  REQUIRE(ref.shapes.back() == model.output_shape());

  // Random variables (biases too: zero biases would hide bias bugs), shared by both paths.
  for (std::size_t l = 0; l < model.num_layers(); ++l) {
    ref.vars.emplace_back();
    for (auto& v : model.layer(l).variables()) {
      Vec<double> values = random_vec(static_cast<std::size_t>(v.value.numel()), rng);
      for (std::size_t i = 0; i < values.size(); ++i) v.value.data<float>()[i] = static_cast<float>(values[i]);
      ref.vars.back().push_back(to_double(v.value));
    }
  }

  Tensor x(c.input.with_batch(c.batch));
  for (auto& v : x.span<float>()) v = rng.uniform(-1.0f, 1.0f);
  const Vec<double> xd = to_double(x);

  const Tensor& y = model.forward(ctx, x);
  const Vec<double>& y_ref = ref.forward(xd);
  CHECK(rel_err(to_double(y), y_ref) < 1e-5);

  Tensor& dy = model.output_gradient();
  for (auto& v : dy.span<float>()) v = rng.uniform(-1.0f, 1.0f);
  const Vec<double> dyd = to_double(dy);
  model.backward(ctx);
  std::vector<std::vector<Vec<double>>> dvars;
  const Vec<double> dx_ref = ref.backward(dyd, dvars);
  CHECK(rel_err(to_double(model.input_gradient()), dx_ref) < 1e-5);
  for (std::size_t l = 0; l < model.num_layers(); ++l) {
    auto vars = model.layer(l).variables();
    for (std::size_t k = 0; k < vars.size(); ++k) {
      CAPTURE(vars[k].name);
      CHECK(rel_err(to_double(vars[k].grad), dvars[l][k]) < 1e-5);
    }
  }

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
  for (std::size_t l = 0; l < ref.vars.size(); ++l)
    for (std::size_t k = 0; k < ref.vars[l].size(); ++k) fd_check(ref.vars[l][k], dvars[l][k], fmt::format("layer {} variable {}", l, k));
}

config::Conv2DConfig conv(int filters, int k, int s, Padding p, Activation a, bool bias = true) {
  config::Conv2DConfig c;
  c.filters = filters;
  c.kernel_size = {k, k};
  c.strides = {s, s};
  c.padding = p;
  c.activation = a;
  c.use_bias = bias;
  return c;
}

config::DenseConfig dense(int units, Activation a, bool bias = true) {
  config::DenseConfig d;
  d.units = units;
  d.activation = a;
  d.use_bias = bias;
  return d;
}

// conv2d (3x3, relu) -> flatten -> dense (linear), with Keras's default names.
config::ModelConfig conv_flatten_dense(std::vector<std::int64_t> input, int filters, int units) {
  config::ModelConfig mc;
  mc.input_shape = std::move(input);
  mc.layers.push_back(layer(conv(filters, 3, 1, Padding::valid, Activation::relu), "conv2d"));
  mc.layers.push_back(layer(config::FlattenConfig{}, "flatten"));
  mc.layers.push_back(layer(dense(units, Activation::linear), "dense"));
  return mc;
}

config::MaxPool2DConfig pool(int p, int s, Padding pad) {
  config::MaxPool2DConfig m;
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
}

TEST_CASE("max_pool2d matches the reference and finite differences") {
  check_case({"2x2 valid", Shape{6, 6, 3}, {pool(2, 2, Padding::valid)}, 2});
  check_case({"2x2 valid odd input", Shape{7, 5, 2}, {pool(2, 2, Padding::valid)}, 2});
  check_case({"3x3 stride 2 same", Shape{7, 8, 3}, {pool(3, 2, Padding::same)}, 2});
  check_case({"2x2 stride 1 overlapping", Shape{5, 5, 2}, {pool(2, 1, Padding::valid)}, 1});
}

TEST_CASE("dense matches the reference and finite differences") {
  check_case({"relu", Shape{12}, {dense(5, Activation::relu)}, 3});
  check_case({"linear no bias", Shape{7}, {dense(4, Activation::linear, false)}, 2});
  check_case({"sigmoid", Shape{6}, {dense(3, Activation::sigmoid)}, 4});
  check_case({"tanh", Shape{6}, {dense(3, Activation::tanh)}, 4});
  check_case({"softmax", Shape{6}, {dense(5, Activation::softmax)}, 3});
}

TEST_CASE("flatten, reshape and activation layers") {
  config::ReshapeConfig r;
  r.target_shape = {3, -1, 2};
  config::ActivationConfig relu{Activation::relu}, sm{Activation::softmax}, th{Activation::tanh}, sg{Activation::sigmoid},
      lin{Activation::linear};
  check_case({"flatten after conv", Shape{5, 5, 3}, {conv(4, 3, 1, Padding::valid, Activation::relu), config::FlattenConfig{}}, 2});
  check_case({"reshape", Shape{12}, {dense(12, Activation::linear), r, conv(2, 1, 1, Padding::valid, Activation::linear)}, 2});
  check_case({"activation relu", Shape{4, 4, 3}, {conv(3, 3, 1, Padding::same, Activation::linear), relu}, 2});
  check_case({"activation softmax", Shape{8}, {dense(6, Activation::linear), sm}, 3});
  check_case({"activation tanh/sigmoid/linear", Shape{8}, {dense(6, Activation::linear), th, sg, lin}, 2});
}

TEST_CASE("the seed CNN as a stack: blocked layouts between layers agree with the reference") {
  check_case({"seed cnn",
              Shape{28, 28, 1},
              {conv(32, 3, 1, Padding::valid, Activation::relu), pool(2, 2, Padding::valid),
               conv(64, 3, 1, Padding::valid, Activation::relu), pool(2, 2, Padding::valid), config::FlattenConfig{},
               dense(64, Activation::relu), dense(10, Activation::linear)},
              4});
}

TEST_CASE("a model reuses its plan across steps and handles a second batch size") {
  config::ModelConfig mc;
  mc.input_shape = {6, 6, 2};
  mc.layers.push_back(layer(conv(3, 3, 1, Padding::valid, Activation::relu), "c"));
  mc.layers.push_back(layer(config::FlattenConfig{}, "f"));
  mc.layers.push_back(layer(dense(2, Activation::linear), "d"));
  nn::Sequential model(mc, 1);
  kernels::cpu::Context ctx;
  Tensor a(Shape{4, 6, 6, 2}), b(Shape{3, 6, 6, 2});
  Rng rng(1, RngStream::test);
  for (auto& v : a.span<float>()) v = rng.uniform();
  for (auto& v : b.span<float>()) v = rng.uniform();
  Tensor ya = model.forward(ctx, a).clone();
  const void* out_ptr = model.forward(ctx, a).raw();
  model.forward(ctx, b);
  const Tensor& ya2 = model.forward(ctx, a);
  CHECK(ya2.raw() == out_ptr);
  for (std::int64_t i = 0; i < ya.numel(); ++i) CHECK(ya.data<float>()[i] == ya2.data<float>()[i]);
  // The first 3 rows of a batch of 4 equal a batch of 3 of the same rows.
  Tensor a3 = a.slice_rows(0, 3).clone();
  const Tensor& y3 = model.forward(ctx, a3);
  for (std::int64_t i = 0; i < y3.numel(); ++i) CHECK(y3.data<float>()[i] == doctest::Approx(ya.data<float>()[i]).epsilon(1e-5));
}

TEST_CASE("glorot_uniform kernels, zero biases, Keras names") {
  const config::ModelConfig mc = conv_flatten_dense({8, 8, 1}, 16, 10);
  nn::Sequential model(mc, 42);
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
  nn::Sequential again(mc, 42);
  CHECK(std::equal(vars[0]->value.span<float>().begin(), vars[0]->value.span<float>().end(),
                   again.variables()[0]->value.span<float>().begin()));
}

TEST_CASE("the gradients of a model are one contiguous arena, in variables() order") {
  nn::Sequential model(conv_flatten_dense({8, 8, 1}, 4, 3), 1);
  const auto& vars = model.variables();
  REQUIRE(model.gradient_sizes().size() == vars.size());
  std::span<float> arena = model.gradient_arena();
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
  config::Conv2DConfig c = conv(3, 3, 1, Padding::valid, Activation::relu);
  c.kernel_regularizer.l2 = 0.5;
  config::DenseConfig d1 = dense(4, Activation::relu);
  d1.kernel_regularizer.l2 = 0.25;
  mc.layers = {layer(c, "c"), layer(config::FlattenConfig{}, "f"), layer(d1, "d1"), layer(dense(2, Activation::linear), "d2")};
  nn::Sequential plain(mc, 3), hooked(mc, 3);
  kernels::cpu::Context ctx;
  Tensor x(Shape{5, 6, 6, 2}), dy(Shape{5, 2});
  Rng rng(2, RngStream::test);
  for (auto& v : x.span<float>()) v = rng.uniform(-1.0f, 1.0f);
  for (auto& v : dy.span<float>()) v = rng.uniform(-1.0f, 1.0f);

  // The reference: the whole backward, then the regularization gradient.
  plain.forward(ctx, x);
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
  hooked.forward(ctx, x);
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
