// A training step allocates nothing once its batch size has been seen: the model's plans, the
// loss gradient buffer, the optimizer slots and the metrics all reuse their storage, and so do the
// strategies' replica threads and collectives. Counted by
// replacing the global operator new for this test binary.
//
// One exception we cannot remove: oneDNN's dnnl_primitive_execute() builds a small std::
// unordered_map of the call's arguments inside the library on every call (a few nodes per
// primitive). dtrain already hands it a prebuilt argument array (BoundPrimitive), so the model's
// forward/backward must allocate the same small number of nodes every step, and no more.
#include <doctest/doctest.h>

#include <atomic>
#include <cstdlib>
#include <new>
#include <vector>

#include "config/experiment.hpp"
#include "core/rng.hpp"
#include "distribute/single_communicator.hpp"
#include "distribute/strategy.hpp"
#include "nn/activation.hpp"
#include "nn/average_pooling2d.hpp"
#include "nn/batch_normalization.hpp"
#include "nn/conv2d.hpp"
#include "nn/dropout.hpp"
#include "nn/global_average_pooling2d.hpp"
#include "nn/dense.hpp"
#include "nn/max_pool2d.hpp"
#include "nn/registry.hpp"
#include "nn/reshape.hpp"
#include "test_support.hpp"
#include "losses/loss.hpp"
#include "metrics/metric.hpp"
#include "nn/model.hpp"
#include "optim/optimizer.hpp"
#include "train/lanes.hpp"

namespace {
std::atomic<bool> counting{false};
std::atomic<long> allocations{0};
}  // namespace

// Not inlined, nor the deletes below: GCC would otherwise see malloc() or free() meet a pointer
// from the other family and warn (-Wmismatched-new-delete), though the replacements match.
[[gnu::noinline]] void* operator new(std::size_t n) {
  if (counting.load(std::memory_order_relaxed)) allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
[[gnu::noinline]] void operator delete(void* p) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete(void* p, std::size_t) noexcept { std::free(p); }

using namespace dtrain;

namespace {

// Two warm-up steps, then five counted ones: the loss, regularization, optimizer and metric
// allocate nothing at all; the model only oneDNN's per-call bookkeeping, the same every step.
void check_steps_allocate_nothing(const config::ModelConfig& mc) {
  device::Context& ctx = testing::cpu();
  nn::Sequential model(mc, 1, ctx);
  nn::StepContext training = testing::step_of(nn::Mode::training, 16);
  config::LossConfig lc;
  lc.from_logits = true;
  lc.reduction = config::Reduction::none;
  auto loss = losses::make_loss(lc, ctx.numerics());
  auto metric = metrics::make_metric(config::MetricKind::sparse_categorical_accuracy, lc, 10, ctx.numerics());
  config::OptimizerConfig oc;
  auto optimizer = optim::make_optimizer(oc, ctx.numerics());
  Tensor x(Shape{16, 28, 28, 1}), y(Shape{16}, DType::i32);
  Rng rng(1, RngStream::test);
  for (auto& v : x.span<float>()) v = rng.uniform();
  for (auto& v : y.span<std::int32_t>()) v = static_cast<std::int32_t>(rng.below(10));
  std::vector<float> per_example(16);

  auto step = [&] {
    const Tensor& logits = model.forward(x, training);
    loss->per_example(logits, y, per_example);
    loss->gradient(logits, y, {}, 1.0f / 16, model.output_gradient());
    model.backward(training);
    model.add_regularization_gradient(1.0f);
    optimizer->apply_gradients(model.trainable_variables());
    model.apply_updates();
    metric->update(y, logits);
    ++training.global_step;
  };
  step();
  step();
  std::vector<long> model_allocs;
  model_allocs.reserve(5);
  allocations = 0;
  counting = true;
  for (int i = 0; i < 5; ++i) {
    const long before = allocations;
    const Tensor& logits = model.forward(x, training);
    const long after_forward = allocations;
    loss->per_example(logits, y, per_example);
    loss->gradient(logits, y, {}, 1.0f / 16, model.output_gradient());
    const long after_loss = allocations;
    model.backward(training);
    const long after_backward = allocations;
    model.add_regularization_gradient(1.0f);
    optimizer->apply_gradients(model.trainable_variables());
    model.apply_updates();
    metric->update(y, logits);
    ++training.global_step;
    model_allocs.push_back(after_backward - after_loss + after_forward - before);
    CHECK(allocations.load() - after_backward == 0);  // regularization, optimizer, metric
    CHECK(after_loss - after_forward == 0);          // loss and its gradient
  }
  counting = false;
  // oneDNN's per-call bookkeeping only: the same count each step, a handful per primitive run.
  for (long n : model_allocs) CHECK(n == model_allocs.front());
  CHECK(model_allocs.front() < 200);
}

}  // namespace

TEST_CASE("a training step of the seed CNN allocates nothing after the first") {
  config::ModelConfig mc;
  mc.input_shape = {28, 28, 1};
  nn::Conv2DOptions c1, c2;
  c1.filters = 8;
  c1.activation = config::Activation::relu;
  c2.filters = 16;
  c2.activation = config::Activation::relu;
  nn::DenseOptions d1, d2;
  d1.units = 16;
  d1.activation = config::Activation::relu;
  d1.kernel_regularizer.l2 = 1e-4;
  d2.units = 10;
  mc.layers = {nn::layer_config("c1", c1),  nn::layer_config("p1", nn::MaxPool2DOptions{}),
               nn::layer_config("c2", c2),  nn::layer_config("p2", nn::MaxPool2DOptions{}),
               nn::layer_config("f", nn::FlattenOptions{}), nn::layer_config("d1", d1), nn::layer_config("d2", d2)};
  check_steps_allocate_nothing(mc);
}

TEST_CASE("so does a step with batch normalization, dropout and average pooling") {
  config::ModelConfig mc;
  mc.input_shape = {28, 28, 1};
  nn::Conv2DOptions c;
  c.filters = 8;
  c.use_bias = false;
  nn::DenseOptions d;
  d.units = 10;
  mc.layers = {nn::layer_config("c", c),
               nn::layer_config("bn", nn::BatchNormalizationOptions{}),
               nn::layer_config("relu", nn::ActivationOptions{config::Activation::relu}),
               nn::layer_config("avg", nn::AveragePooling2DOptions{}),
               nn::layer_config("drop", nn::DropoutOptions{0.3}),
               nn::layer_config("gap", nn::GlobalAveragePooling2DOptions{}),
               nn::layer_config("d", d)};
  check_steps_allocate_nothing(mc);
}

TEST_CASE("a replica's lanes allocate nothing per step: run, the lanes' gradient and statistics sums") {
  train::Lanes lanes(3);
  std::vector<std::vector<float>> arenas(3, std::vector<float>(1330, 1.0f));
  std::vector<std::vector<double>> statistics(3, std::vector<double>(5, 0.5));
  std::vector<std::int64_t> rows(3, 0);
  auto step = [&](int lane) {
    const auto l = static_cast<std::size_t>(lane);
    rows[l] = lanes.rows(64, lane).size();
    train::LaneStatistics(lanes, lane).all_reduce_sum(statistics[l], "statistics");
    lanes.endpoint(lane).reduce_sum_to(arenas[l], 0, "lane gradients");
  };
  lanes.run(step);
  allocations = 0;
  counting = true;
  for (int i = 0; i < 3; ++i) lanes.run(step);
  counting = false;
  CHECK(allocations.load() == 0);
  CHECK(rows == std::vector<std::int64_t>{22, 21, 21});
  CHECK(arenas[0][0] == 9.0f);  // lanes 1 and 2 (1 each) added into lane 0 on each of 4 runs: 1 + 4 x 2
}

TEST_CASE("a strategy's step allocates nothing after the first: run, gradient sums, in-replica sums, reduce") {
  const char* const cases[] = {
      "{kind: mirrored, devices: [cpu:0, cpu:1, cpu:2], cross_device_ops: reduction_to_one_device}",
      "{kind: mirrored, devices: [cpu:0, cpu:1, cpu:2], cross_device_ops: hierarchical_copy}",
      "{kind: mirrored, devices: [cpu:0, cpu:1, cpu:2], cross_device_ops: ring}",
      "{kind: central_storage, devices: [cpu:0, cpu:1, cpu:2]}",
      "{kind: multi_worker_mirrored, devices: [cpu:0, cpu:1, cpu:2]}",
      "{kind: default}"};
  distribute::SingleCommunicator alone;
  for (const char* c : cases) {
    CAPTURE(c);
    auto strategy = distribute::make_strategy(config::parse_strategy_section(c, "test.yaml"), 3, alone);
    const auto n = static_cast<std::size_t>(strategy->num_local_replicas());
    const std::vector<std::size_t> sizes = {288, 32, 1000, 10};
    std::vector<std::vector<float>> arenas(n, std::vector<float>(1330, 1.0f));
    std::vector<std::vector<double>> in_replica(n, std::vector<double>(3, 0.5));
    std::vector<double> losses(n, 0.25);
    for (std::size_t r = 0; r < n; ++r)
      strategy->bind_gradients(static_cast<int>(r), testing::cpu(), Tensor::borrowed(arenas[r].data(), Shape{1330}), sizes);
    const distribute::Strategy::ReplicaFn step = [&](const distribute::ReplicaContext& rc) {
      const auto r = static_cast<std::size_t>(rc.replica_id);
      strategy->sum_gradients(rc);
      strategy->update(rc, [] {});
      strategy->all_reduce_sum_in_replica(rc, in_replica[r], "in replica");
    };
    strategy->run(step);
    strategy->reduce_sum(losses);
    allocations = 0;
    counting = true;
    for (int i = 0; i < 3; ++i) {
      strategy->run(step);
      strategy->reduce_sum(losses);
    }
    counting = false;
    CHECK(allocations.load() == 0);
  }
}
