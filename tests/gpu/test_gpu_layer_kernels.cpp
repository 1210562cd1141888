// The CUDA layer kernels (lib/backends/cuda/<kind>.cpp) inside nn::Sequential models on gpu:0:
// every layer kind's forward and backward against the layer's oracle (Layer::reference_forward /
// reference_backward, in double), as tests/unit/test_layers.cpp checks the CPU backend's kernels,
// within 1e-5 relative (norm-wise) in float32 and 3e-2 in mixed_bfloat16 (8-bit mantissas, rounded at every layer); each case runs a batch,
// a short batch (a plan of its own) and the first batch again. Variables and inputs are uploaded
// from host vectors, results downloaded through the context (the model's memory is the GPU's).
// Then: dropout's masks and outputs bit-identical to the CPU backend's for the same step keys,
// synchronized batch normalization through a group of replicas, a second step that allocates
// nothing, and one small CNN (conv2d, max pooling, batch normalization, dropout, dense) on gpu:0
// and on the CPU backend: outputs and every gradient within 1e-5 relative. Last, random models of
// every layer kind (tests/unit/random_models.hpp) against the oracle, as the CPU's loops are.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "../unit/layer_oracle.hpp"
#include "../unit/random_models.hpp"
#include "config/parse.hpp"
#include "config/schema.hpp"
#include "core/rng.hpp"
#include "gpu_support.hpp"
#include "nn/activation.hpp"
#include "nn/average_pooling2d.hpp"
#include "nn/batch_normalization.hpp"
#include "nn/conv2d.hpp"
#include "nn/dense.hpp"
#include "nn/dropout.hpp"
#include "nn/global_average_pooling2d.hpp"
#include "nn/kernel.hpp"
#include "nn/max_pool2d.hpp"
#include "nn/model.hpp"
#include "nn/registry.hpp"
#include "nn/reshape.hpp"

using namespace dtrain;
using namespace dtrain::gpu_testing;
using config::Activation;
using config::Padding;
using testing::RefStack;

namespace {

using Doubles = std::vector<double>;

// ||a - b|| / ||b||, as tests/unit/test_layers.cpp measures a kernel against its oracle.
double rel_err(const Doubles& a, const Doubles& b) {
  REQUIRE(a.size() == b.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

// Values that vanish analytically (the bias gradient of a layer right below a batch
// normalization) come out as float32 rounding noise: compared by absolute error there.
double error_against(const Doubles& a, const Doubles& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1.0);
}

// How many entries are not finite (a NaN or an infinity says more than a relative error).
std::size_t not_finite(const Doubles& a) {
  return static_cast<std::size_t>(std::count_if(a.begin(), a.end(), [](double v) { return !std::isfinite(v); }));
}

// A tensor of `ctx` (the GPU's or the CPU backend's) read back through the context.
std::vector<float> read(device::Context& ctx, const Tensor& t) {
  const Tensor host = ctx.download(t);
  const auto s = host.span<float>();
  return {s.begin(), s.end()};
}
Doubles widen(const std::vector<float>& v) { return {v.begin(), v.end()}; }
void write(device::Context& ctx, const std::vector<float>& host, Tensor& t) {
  REQUIRE(static_cast<std::int64_t>(host.size()) == t.numel());
  ctx.copy_from_host(host.data(), t);
}

std::vector<float> draw(Rng& rng, std::int64_t n, float lo = -1.0f, float hi = 1.0f) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (float& x : v) x = rng.uniform(lo, hi);
  return v;
}

config::ModelConfig model_config(const Shape& input, const std::vector<config::LayerConfig>& layers) {
  config::ModelConfig mc;
  mc.input_shape = input.to_vector();
  for (std::size_t i = 0; i < layers.size(); ++i) {
    mc.layers.push_back(layers[i]);
    mc.layers.back().name = fmt::format("l{}", i);
  }
  return mc;
}

// Random variables (biases too: zero biases would hide bias bugs; a variance positive), written
// into the model's memory; returned as the oracle reads them (vars[layer][variable]).
std::vector<std::vector<Doubles>> set_variables(nn::Sequential& model, device::Context& ctx, std::uint64_t seed) {
  Rng rng(seed, RngStream::test);
  std::vector<std::vector<Doubles>> vars;
  for (std::size_t l = 0; l < model.num_layers(); ++l) {
    vars.emplace_back();
    for (Variable& v : model.layer(l).variables()) {
      const bool variance = v.name.ends_with("moving_variance");
      const std::vector<float> values = draw(rng, v.value.numel(), variance ? 0.5f : -1.0f, variance ? 1.5f : 1.0f);
      write(ctx, values, v.value);
      vars.back().push_back(widen(values));
    }
  }
  return vars;
}

// What a case sums over the other replicas: a group of two replicas holding the same data, so the
// sums double and the statistics are those of this replica alone (what the oracle computes).
class TwinReplicas final : public nn::CrossReplica {
 public:
  void all_reduce_sum(std::span<double> values, const char*) override {
    for (double& v : values) v *= 2.0;
    ++calls;
  }
  int calls = 0;
};

nn::StepContext step_for(nn::Mode mode, std::int64_t batch, std::span<const std::int64_t> ids = {}) {
  nn::StepContext step = testing::step_of(mode, batch);
  step.seed = 1234;
  step.global_step = 17;
  step.sample_ids = ids;
  return step;
}

struct Case {
  std::string label;
  Shape input;  // per example
  std::vector<config::LayerConfig> layers;
  std::vector<std::int64_t> batches{4, 3, 4};  // a batch, a short one, the first again
  nn::Mode mode = nn::Mode::training;
  DType compute = DType::f32;
  nn::CrossReplica* group = nullptr;  // StepContext::cross_replica
};

// The GPU model against the oracle, for each batch of the case.
void check_case(const Case& c) {
  CAPTURE(c.label);
  CAPTURE(dtype_name(c.compute));
  auto& ctx = gpu();
  if (c.compute == DType::bf16 && !ctx.cannot_compute_in(DType::bf16).empty()) {
    MESSAGE("skipped: " << ctx.cannot_compute_in(DType::bf16));
    return;
  }
  const double tol = c.compute == DType::bf16 ? 3e-2 : 1e-5;
  nn::Sequential model(model_config(c.input, c.layers), 7, ctx,
                       nn::ModelOptions{.compute = c.compute, .input_gradient = true});
  RefStack ref;
  for (std::size_t l = 0; l < model.num_layers(); ++l) ref.layers.push_back(&model.layer(l));
  ref.vars = set_variables(model, ctx, 11);
  Rng rng(12, RngStream::test);
  for (const std::int64_t batch : c.batches) {
    CAPTURE(batch);
    std::vector<std::int64_t> ids(static_cast<std::size_t>(batch));
    for (std::int64_t i = 0; i < batch; ++i) ids[static_cast<std::size_t>(i)] = 3 * i + 5;  // not 0 .. batch - 1
    nn::StepContext step = step_for(c.mode, batch, ids);
    step.cross_replica = c.group;
    ref.n = batch;
    ref.step = step;

    const std::vector<float> x = draw(rng, batch * c.input.numel());
    const Tensor x_gpu = ctx.upload([&] {
      Tensor t(c.input.with_batch(batch));
      std::copy(x.begin(), x.end(), t.span<float>().begin());
      return t;
    }());
    const Doubles y = widen(read(ctx, model.forward(x_gpu, step)));
    CHECK(rel_err(y, ref.forward(widen(x))) < tol);
    if (c.mode == nn::Mode::inference) continue;  // backward is a training step's

    const std::vector<float> dy = draw(rng, static_cast<std::int64_t>(y.size()));
    write(ctx, dy, model.output_gradient());
    model.backward(step);
    std::vector<std::vector<Doubles>> dvars;
    const Doubles dx_ref = ref.backward(widen(dy), dvars);
    CHECK(rel_err(widen(read(ctx, model.input_gradient())), dx_ref) < tol);
    for (std::size_t l = 0; l < model.num_layers(); ++l) {
      auto vars = model.layer(l).variables();
      for (std::size_t k = 0; k < vars.size(); ++k) {
        CAPTURE(vars[k].name);
        const Doubles g = widen(read(ctx, vars[k].grad));
        CHECK(std::min(rel_err(g, dvars[l][k]), error_against(g, dvars[l][k])) < tol);
      }
    }
  }
}

template <class Options>
config::LayerConfig layer(Options o) {
  return nn::layer_config("", std::move(o));
}

config::LayerConfig conv(int filters, int k, int s, Padding p, Activation a, bool bias = true) {
  return layer(testing::conv_options(filters, k, s, p, a, bias));
}

config::LayerConfig dense(int units, Activation a, bool bias = true) {
  nn::DenseOptions d;
  d.units = units;
  d.activation = a;
  d.use_bias = bias;
  return layer(d);
}

template <class Options>
config::LayerConfig pool(int ph, int pw, int s, Padding padding) {
  Options o;
  o.pool_size = {ph, pw};
  o.strides = std::array<int, 2>{s, s};
  o.padding = padding;
  return layer(o);
}

config::LayerConfig activation(Activation a) {
  nn::ActivationOptions o;
  o.activation = a;
  return layer(o);
}

config::LayerConfig dropout(double rate) {
  nn::DropoutOptions o;
  o.rate = rate;
  return layer(o);
}

config::LayerConfig batch_norm(bool center = true, bool scale = true, bool synchronized = false) {
  nn::BatchNormalizationOptions o;
  o.center = center;
  o.scale = scale;
  o.synchronized = synchronized;
  o.momentum = 0.9;
  return layer(o);
}

config::LayerConfig flatten() { return layer(nn::FlattenOptions{}); }

config::LayerConfig reshape(std::vector<std::int64_t> target) {
  nn::ReshapeOptions o;
  o.target_shape = std::move(target);
  return layer(o);
}

// The same small CNN on two contexts.
config::ModelConfig small_cnn() {
  return model_config(Shape{8, 8, 2}, {conv(4, 3, 1, Padding::same, Activation::relu),
                                        pool<nn::MaxPool2DOptions>(2, 2, 2, Padding::valid), batch_norm(),
                                        dropout(0.25), flatten(), dense(10, Activation::linear)});
}

}  // namespace

TEST_CASE("every registered layer kind has a CUDA kernel") {
  const auto missing = nn::kinds_without_kernel("cuda");
  CHECK_MESSAGE(missing.empty(), "kinds without a CUDA kernel: " << config::join(missing));
}

TEST_CASE("CUDA conv2d kernel against the oracle: paddings, strides, activations, no bias, short batches") {
  check_case({"3x3 valid relu", Shape{7, 7, 3}, {conv(5, 3, 1, Padding::valid, Activation::relu)}});
  check_case({"3x3 same stride 2, odd input", Shape{7, 9, 2}, {conv(4, 3, 2, Padding::same, Activation::linear)}});
  check_case({"2x2 same, even input (asymmetric padding)", Shape{6, 6, 3},
              {conv(3, 2, 1, Padding::same, Activation::tanh)}});
  check_case({"1x1 sigmoid, no bias", Shape{4, 5, 6}, {conv(7, 1, 1, Padding::valid, Activation::sigmoid, false)}});
  check_case({"softmax over the filters", Shape{5, 5, 2}, {conv(4, 3, 1, Padding::same, Activation::softmax)}});
  check_case({"5x5 stride 2 same, one channel", Shape{9, 9, 1}, {conv(24, 5, 2, Padding::same, Activation::relu)},
              {3, 1, 3}});
  check_case({"two layers, stride 2 same above", Shape{9, 8, 2},
              {conv(12, 3, 1, Padding::valid, Activation::relu), conv(16, 3, 2, Padding::same, Activation::linear)}});
}

TEST_CASE("CUDA dense kernel against the oracle: activations, no bias, stacks, mixed_bfloat16") {
  check_case({"relu", Shape{13}, {dense(7, Activation::relu)}});
  check_case({"linear, no bias", Shape{9}, {dense(5, Activation::linear, false)}});
  check_case({"sigmoid, tanh, softmax stack", Shape{11},
              {dense(8, Activation::sigmoid), dense(6, Activation::tanh), dense(4, Activation::softmax)}});
  check_case({"batch 1", Shape{6}, {dense(3, Activation::relu)}, {1, 2, 1}});
  // mixed_bfloat16: the layers but the last in bfloat16 (the last, and a softmax, in float32), so
  // the inputs cross dtypes both ways.
  check_case({"bf16 relu, tanh, then float32", Shape{24},
              {dense(16, Activation::relu), dense(12, Activation::tanh), dense(5, Activation::linear)},
              {4, 3, 4}, nn::Mode::training, DType::bf16});
  check_case({"bf16 after a float32 conv2d, before dropout", Shape{6, 6, 2},
              {conv(3, 3, 1, Padding::valid, Activation::relu), flatten(), dense(10, Activation::sigmoid), dropout(0.3),
               dense(4, Activation::softmax), dense(3, Activation::linear)},
              {4, 3, 4}, nn::Mode::training, DType::bf16});
}

TEST_CASE("CUDA pooling kernels against the oracle: max, average and global average") {
  for (const Padding padding : {Padding::valid, Padding::same}) {
    const std::string pad = padding == Padding::same ? "same" : "valid";
    check_case({"max 2x2 stride 2 " + pad, Shape{7, 9, 5}, {pool<nn::MaxPool2DOptions>(2, 2, 2, padding)}});
    check_case({"max 3x3 stride 1 (overlapping) " + pad, Shape{7, 9, 5}, {pool<nn::MaxPool2DOptions>(3, 3, 1, padding)}});
    check_case({"max 2x3 stride 2 " + pad, Shape{7, 9, 5}, {pool<nn::MaxPool2DOptions>(2, 3, 2, padding)}});
    check_case({"average 2x2 stride 2 " + pad, Shape{7, 9, 5}, {pool<nn::AveragePooling2DOptions>(2, 2, 2, padding)}});
    check_case({"average 3x3 stride 1 " + pad, Shape{7, 9, 5}, {pool<nn::AveragePooling2DOptions>(3, 3, 1, padding)}});
  }
  // Above a relu convolution, as in the seed CNN (the relu's derivative stays the convolution's).
  check_case({"conv relu -> max pooling", Shape{8, 8, 2},
              {conv(6, 3, 1, Padding::same, Activation::relu), pool<nn::MaxPool2DOptions>(2, 2, 2, Padding::valid)}});
  check_case({"global average pooling", Shape{7, 9, 5}, {layer(nn::GlobalAveragePooling2DOptions{})}});
  check_case({"conv -> global average pooling -> dense", Shape{6, 6, 3},
              {conv(8, 3, 1, Padding::valid, Activation::relu), layer(nn::GlobalAveragePooling2DOptions{}),
               dense(4, Activation::linear)}});
}

TEST_CASE("CUDA activation, reshape and flatten kernels against the oracle") {
  for (const Activation a :
       {Activation::linear, Activation::relu, Activation::sigmoid, Activation::tanh, Activation::softmax})
    check_case({fmt::format("activation {}", config::name_of(a)), Shape{3, 4, 5},
                {conv(6, 1, 1, Padding::valid, Activation::linear), activation(a)}});
  check_case({"flatten between conv2d and dense", Shape{5, 5, 2},
              {conv(3, 3, 1, Padding::valid, Activation::relu), flatten(), dense(4, Activation::linear)}});
  check_case({"reshape with -1, flatten, dense, reshape", Shape{4, 6},
              {reshape({3, -1}), flatten(), dense(6, Activation::tanh), reshape({2, 3})}});
}

TEST_CASE("CUDA dropout kernel against the oracle, training and inference") {
  check_case({"rate 0.4 after a dense", Shape{10}, {dense(12, Activation::relu), dropout(0.4)}});
  check_case({"rate 0.5 on images", Shape{5, 7, 3}, {dropout(0.5), conv(2, 3, 1, Padding::valid, Activation::linear)}});
  check_case({"rate 0", Shape{9}, {dropout(0.0), dense(3, Activation::linear)}});
  check_case({"inference is the identity", Shape{9}, {dense(5, Activation::linear), dropout(0.5)}, {4, 3},
              nn::Mode::inference});
}

TEST_CASE("CUDA dropout draws the CPU backend's masks: the same outputs and gradients, bit for bit") {
  auto& ctx = gpu();
  const config::ModelConfig mc = model_config(Shape{5, 7, 3}, {dropout(0.4)});
  nn::Sequential on_gpu(mc, 3, ctx, nn::ModelOptions{.input_gradient = true});
  nn::Sequential on_cpu(mc, 3, cpu(), nn::ModelOptions{.input_gradient = true});
  const std::int64_t batch = 6;
  const std::vector<std::int64_t> ids{40, 3, 11, 0, 25, 9};
  Rng rng(21, RngStream::test);
  for (const bool pipeline_ids : {true, false}) {
    CAPTURE(pipeline_ids);
    const nn::StepContext step =
        step_for(nn::Mode::training, batch, pipeline_ids ? std::span<const std::int64_t>(ids) : std::span<const std::int64_t>());
    Tensor x(Shape{batch, 5, 7, 3});
    for (float& v : x.span<float>()) v = rng.uniform(0.5f, 1.5f);  // never zero: a zero output is a drop
    // The inputs stay alive until backward: kernels may read them again there.
    const Tensor x_gpu = ctx.upload(x), x_cpu = cpu().upload(x);
    const std::vector<float> y_gpu = read(ctx, on_gpu.forward(x_gpu, step));
    const std::vector<float> y_cpu = read(cpu(), on_cpu.forward(x_cpu, step));
    REQUIRE(y_gpu.size() == y_cpu.size());
    CHECK(std::memcmp(y_gpu.data(), y_cpu.data(), y_gpu.size() * sizeof(float)) == 0);
    const auto dropped = std::count(y_gpu.begin(), y_gpu.end(), 0.0f);
    MESSAGE(dropped << " of " << y_gpu.size() << " dropped");
    CHECK(dropped > 0);
    CHECK(dropped < static_cast<std::ptrdiff_t>(y_gpu.size()));

    const std::vector<float> dy = draw(rng, static_cast<std::int64_t>(y_gpu.size()));
    write(ctx, dy, on_gpu.output_gradient());
    write(cpu(), dy, on_cpu.output_gradient());
    on_gpu.backward(step);
    on_cpu.backward(step);
    const std::vector<float> dx_gpu = read(ctx, on_gpu.input_gradient());
    const std::vector<float> dx_cpu = read(cpu(), on_cpu.input_gradient());
    CHECK(std::memcmp(dx_gpu.data(), dx_cpu.data(), dx_gpu.size() * sizeof(float)) == 0);
  }
}

TEST_CASE("CUDA batch normalization kernel against the oracle: training, inference, center and scale off") {
  check_case({"images, training", Shape{5, 6, 7}, {batch_norm()}});
  check_case({"after a dense, training", Shape{9}, {dense(6, Activation::relu), batch_norm()}});
  check_case({"no center, no scale", Shape{4, 4, 3}, {conv(5, 3, 1, Padding::same, Activation::linear),
                                                       batch_norm(false, false)}});
  check_case({"center only", Shape{4, 4, 3}, {batch_norm(true, false), flatten(), dense(2, Activation::linear)}});
  check_case({"inference (moving statistics)", Shape{5, 6, 7}, {batch_norm()}, {4, 3}, nn::Mode::inference});
  check_case({"bf16 dense below (converted to float32)", Shape{12},
              {dense(8, Activation::relu), batch_norm(), dense(3, Activation::linear)}, {4, 3, 4}, nn::Mode::training,
              DType::bf16});
}

TEST_CASE("CUDA synchronized batch normalization: the sums cross the replicas through the host") {
  // Two replicas with the same data compute one replica's statistics and gradients (and, as
  // replica 0 of a synchronized layer, the whole moving-statistics contribution).
  TwinReplicas twins;
  Case c{"synchronized over twin replicas", Shape{5, 6, 7},
         {conv(4, 3, 1, Padding::same, Activation::relu), batch_norm(true, true, true)}};
  c.group = &twins;
  check_case(c);
  // Per step: the sums of x and the row count, the squared deviations, the gradient sums.
  CHECK(twins.calls == 3 * static_cast<int>(c.batches.size()));

  // A replica without samples makes the same three collectives; its gradients are zero and, with
  // no rows anywhere, so is its contribution to the moving statistics.
  auto& ctx = gpu();
  nn::Sequential model(model_config(Shape{5, 6, 7}, {conv(4, 3, 1, Padding::same, Activation::relu),
                                                     batch_norm(true, true, true)}),
                       7, ctx);
  twins.calls = 0;
  nn::StepContext step = step_for(nn::Mode::training, 8);
  step.cross_replica = &twins;
  model.step_without_samples(step);
  CHECK(twins.calls == 3);
  for (const Variable* v : model.variables()) {
    CAPTURE(v->name);
    const std::vector<float> g = read(ctx, v->grad);
    CHECK(std::all_of(g.begin(), g.end(), [](float f) { return f == 0.0f; }));
  }
}

TEST_CASE("a second CUDA training step of the same batch allocates nothing and repeats its bits") {
  auto& ctx = gpu();
  nn::Sequential model(small_cnn(), 5, ctx, nn::ModelOptions{.input_gradient = true});
  (void)set_variables(model, ctx, 2);
  const std::int64_t batch = 5;
  const std::vector<std::int64_t> ids{7, 1, 30, 2, 9};
  const nn::StepContext step = step_for(nn::Mode::training, batch, ids);
  Rng rng(4, RngStream::test);
  Tensor x(Shape{batch, 8, 8, 2});
  for (float& v : x.span<float>()) v = rng.uniform(-1.0f, 1.0f);
  const Tensor x_gpu = ctx.upload(x);
  const std::vector<float> dy = draw(rng, batch * 10);
  std::vector<std::vector<float>> runs;
  backends::cuda::AllocatorStats before{};
  for (int run = 0; run < 2; ++run) {
    if (run == 1) before = ctx.allocator_stats();
    std::vector<float> bits = read(ctx, model.forward(x_gpu, step));
    write(ctx, dy, model.output_gradient());
    model.backward(step);
    if (run == 1) {
      // Not even a cached block: the reads and writes above are host copies, not allocations.
      const backends::cuda::AllocatorStats after = ctx.allocator_stats();
      CHECK(after.device_mallocs == before.device_mallocs);
      CHECK(after.cache_hits == before.cache_hits);
    }
    for (const Variable* v : model.variables()) {
      const std::vector<float> g = read(ctx, v->grad);
      bits.insert(bits.end(), g.begin(), g.end());
    }
    runs.push_back(std::move(bits));
  }
  CHECK(runs[0] == runs[1]);
}

TEST_CASE("one CNN on gpu:0 and on the CPU backend: the same outputs and gradients within 1e-5") {
  auto& ctx = gpu();
  const config::ModelConfig mc = small_cnn();
  nn::Sequential on_gpu(mc, 9, ctx, nn::ModelOptions{.input_gradient = true});
  nn::Sequential on_cpu(mc, 9, cpu(), nn::ModelOptions{.input_gradient = true});
  // The same variables in both (whatever each context's initialization does).
  (void)set_variables(on_gpu, ctx, 31);
  (void)set_variables(on_cpu, cpu(), 31);
  const std::int64_t batch = 5;
  const std::vector<std::int64_t> ids{12, 0, 7, 33, 4};
  Rng rng(32, RngStream::test);
  for (const nn::Mode mode : {nn::Mode::training, nn::Mode::inference}) {
    CAPTURE(mode == nn::Mode::training);
    const nn::StepContext step = step_for(mode, batch, ids);
    Tensor x(Shape{batch, 8, 8, 2});
    for (float& v : x.span<float>()) v = rng.uniform(-1.0f, 1.0f);
    // The inputs stay alive until backward: the CPU backend's convolution reads x again for its
    // weights' gradients (a temporary here gave it freed memory, and NaN gradients).
    const Tensor x_gpu = ctx.upload(x), x_cpu = cpu().upload(x);
    const Doubles y_gpu = widen(read(ctx, on_gpu.forward(x_gpu, step)));
    const Doubles y_cpu = widen(read(cpu(), on_cpu.forward(x_cpu, step)));
    CHECK(rel_err(y_gpu, y_cpu) < 1e-5);
    if (mode == nn::Mode::inference) continue;

    const std::vector<float> dy = draw(rng, static_cast<std::int64_t>(y_gpu.size()));
    write(ctx, dy, on_gpu.output_gradient());
    write(cpu(), dy, on_cpu.output_gradient());
    on_gpu.backward(step);
    on_cpu.backward(step);
    CHECK(rel_err(widen(read(ctx, on_gpu.input_gradient())), widen(read(cpu(), on_cpu.input_gradient()))) < 1e-5);
    REQUIRE(on_gpu.variables().size() == on_cpu.variables().size());
    for (std::size_t i = 0; i < on_gpu.variables().size(); ++i) {
      CAPTURE(on_gpu.variables()[i]->name);
      const Doubles g = widen(read(ctx, on_gpu.variables()[i]->grad));
      const Doubles c = widen(read(cpu(), on_cpu.variables()[i]->grad));
      MESSAGE(on_gpu.variables()[i]->name << ": relative error " << rel_err(g, c) << ", not finite: " << not_finite(g)
                                          << " on the GPU, " << not_finite(c) << " on the CPU");
      CHECK(rel_err(g, c) < 1e-5);
    }
  }
}

namespace {

// One random model on gpu:0 against the oracle: its initial kernels (Glorot), offsets drawn;
// outputs, the input's gradient and every variable's gradient (against the largest of its
// layer's), within testing::random_model_tolerances.
void check_random_model(const testing::RandomModel& m, DType compute) {
  CAPTURE(m.label);
  CAPTURE(dtype_name(compute));
  auto& ctx = gpu();
  const testing::RandomModelTolerances tol = testing::random_model_tolerances(compute);
  nn::Sequential model(model_config(m.input, m.layers), 7, ctx,
                       nn::ModelOptions{.compute = compute, .input_gradient = m.input_gradient});
  RefStack ref;
  Rng rng(11, RngStream::test);
  for (std::size_t l = 0; l < model.num_layers(); ++l) {
    ref.layers.push_back(&model.layer(l));
    ref.vars.emplace_back();
    for (Variable& v : model.layer(l).variables()) {
      std::vector<float> values = read(ctx, v.value);
      testing::draw_offsets(v.name, values, rng);
      write(ctx, values, v.value);
      ref.vars.back().push_back(widen(values));
    }
  }
  std::vector<std::int64_t> ids(static_cast<std::size_t>(m.batch));
  for (std::int64_t i = 0; i < m.batch; ++i) ids[static_cast<std::size_t>(i)] = 3 * i + 5;
  const nn::StepContext step = step_for(nn::Mode::training, m.batch, ids);
  ref.n = m.batch;
  ref.step = step;

  const std::vector<float> x = draw(rng, m.batch * m.input.numel());
  const Tensor x_gpu = ctx.upload([&] {
    Tensor t(m.input.with_batch(m.batch));
    std::copy(x.begin(), x.end(), t.span<float>().begin());
    return t;
  }());
  const Doubles y = widen(read(ctx, model.forward(x_gpu, step)));
  CHECK(not_finite(y) == 0);
  CHECK(rel_err(y, ref.forward(widen(x))) < tol.outputs);
  if (testing::nearest_pooling_tie(ref) < tol.nearest_tie) {
    MESSAGE(m.label << ": a max pooling window's two largest inputs lie within " << tol.nearest_tie
                    << " of each other; gradients not compared");
    return;
  }
  const std::vector<float> dy = draw(rng, static_cast<std::int64_t>(y.size()));
  write(ctx, dy, model.output_gradient());
  model.backward(step);
  std::vector<std::vector<Doubles>> dvars;
  const Doubles dx_ref = ref.backward(widen(dy), dvars);
  if (m.input_gradient) CHECK(rel_err(widen(read(ctx, model.input_gradient())), dx_ref) < tol.gradients);
  for (std::size_t l = 0; l < model.num_layers(); ++l) {
    auto vars = model.layer(l).variables();
    const double layer_gradient = testing::largest_norm(dvars[l]);
    for (std::size_t k = 0; k < vars.size(); ++k) {
      CAPTURE(vars[k].name);
      const Doubles g = widen(read(ctx, vars[k].grad));
      CHECK(not_finite(g) == 0);
      CHECK(testing::distance(g, dvars[l][k]) / std::max(layer_gradient, 1e-30) < tol.gradients);
    }
  }
}

}  // namespace

TEST_CASE("CUDA kernels against the oracle on random models of every layer kind") {
  for (const DType compute : {DType::f32, DType::bf16}) {
    if (compute == DType::bf16 && !gpu().cannot_compute_in(DType::bf16).empty()) {
      MESSAGE("skipped: " << gpu().cannot_compute_in(DType::bf16));
      continue;
    }
    Rng rng(testing::random_model_seed(2026), RngStream::test);
    for (int i = 0, n = testing::random_model_count(30); i < n; ++i)
      check_random_model(testing::random_model(rng, i, compute == DType::bf16), compute);
  }
}

