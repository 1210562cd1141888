#include <doctest/doctest.h>
#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <numbers>
#include <thread>
#include <vector>

#include "core/error.hpp"
#include "core/variable.hpp"
#include "optim/optimizer.hpp"
#include "test_support.hpp"
#include "optim/schedule.hpp"

using namespace dtrain;
using namespace dtrain::optim;

namespace {

config::LearningRateConfig constant_lr(double lr) {
  config::LearningRateConfig c;
  c.initial_learning_rate = lr;
  return c;
}

config::OptimizerConfig optimizer_config(config::OptimizerKind kind, double lr) {
  config::OptimizerConfig c;
  c.kind = kind;
  c.learning_rate = constant_lr(lr);
  return c;
}

// Two small variables with fixed starting values, and a gradient that differs per step and element.
struct Model {
  Variable kernel{"dense/kernel", Tensor(Shape{2, 3}), Tensor(Shape{2, 3})};
  Variable bias{"dense/bias", Tensor(Shape{3}), Tensor(Shape{3})};
  std::vector<Variable*> vars{&kernel, &bias};

  Model() {
    for (int k = 0; k < 6; ++k) kernel.value.data<float>()[k] = 0.5f - 0.25f * static_cast<float>(k);
    for (int k = 0; k < 3; ++k) bias.value.data<float>()[k] = 0.1f * static_cast<float>(k);
  }
  void set_gradients(int step) {
    for (int k = 0; k < 6; ++k) kernel.grad.data<float>()[k] = gradient(step, k);
    for (int k = 0; k < 3; ++k) bias.grad.data<float>()[k] = gradient(step, 6 + k);
  }
  static float gradient(int step, int k) { return static_cast<float>(std::sin(1.7 * k + 0.9 * step + 0.3)) * (1.0f + k); }
  std::vector<double> flat() const {
    std::vector<double> all;
    for (float v : kernel.value.span<float>()) all.push_back(v);
    for (float v : bias.value.span<float>()) all.push_back(v);
    return all;
  }
};

// Runs `steps` updates of `optimizer` and of the double `reference` (w, g, step) and compares.
template <class Reference>
void check_against_reference(Optimizer& optimizer, int steps, Reference reference) {
  Model model;
  std::vector<double> w = model.flat();
  const std::vector<double> start = w;
  for (int step = 0; step < steps; ++step) {
    model.set_gradients(step);
    std::vector<double> g(w.size());
    for (std::size_t k = 0; k < g.size(); ++k) g[k] = Model::gradient(step, static_cast<int>(k));
    optimizer.apply_gradients(model.vars);
    reference(w, g, step);
  }
  CHECK(optimizer.iterations() == steps);
  const std::vector<double> got = model.flat();
  double moved = 0.0;
  for (std::size_t k = 0; k < w.size(); ++k) {
    CAPTURE(k);
    CHECK(got[k] == doctest::Approx(w[k]).epsilon(1e-5).scale(1.0));
    moved = std::max(moved, std::abs(w[k] - start[k]));
  }
  CHECK(moved > 0.01);  // the comparison is not vacuous
}

}  // namespace

// ---------------------------------------------------------------- schedules

TEST_CASE("constant and exponential decay schedules") {
  CHECK((*make_schedule(constant_lr(0.01)))(12345) == 0.01);

  config::LearningRateConfig c;
  c.kind = config::ScheduleKind::exponential_decay;
  c.initial_learning_rate = 0.1;
  c.decay_steps = 10;
  c.decay_rate = 0.5;
  auto smooth = make_schedule(c);
  CHECK((*smooth)(0) == doctest::Approx(0.1));
  CHECK((*smooth)(5) == doctest::Approx(0.1 * std::pow(0.5, 0.5)));
  CHECK((*smooth)(10) == doctest::Approx(0.05));
  CHECK((*smooth)(25) == doctest::Approx(0.1 * std::pow(0.5, 2.5)));
  c.staircase = true;
  auto stairs = make_schedule(c);
  CHECK((*stairs)(9) == doctest::Approx(0.1));
  CHECK((*stairs)(10) == doctest::Approx(0.05));
  CHECK((*stairs)(25) == doctest::Approx(0.025));

  c.decay_steps = 0;
  CHECK_THROWS_AS(make_schedule(c), ConfigError);
}

TEST_CASE("piecewise constant: boundaries belong to the interval below them") {
  config::LearningRateConfig c;
  c.kind = config::ScheduleKind::piecewise_constant;
  c.boundaries = {10, 20};
  c.values = {1.0, 0.5, 0.1};
  auto s = make_schedule(c);
  CHECK((*s)(0) == 1.0);
  CHECK((*s)(10) == 1.0);
  CHECK((*s)(11) == 0.5);
  CHECK((*s)(20) == 0.5);
  CHECK((*s)(21) == 0.1);
  CHECK((*s)(1000000) == 0.1);

  c.values = {1.0, 0.5};
  CHECK_THROWS_AS(make_schedule(c), ConfigError);
  c.values = {1.0, 0.5, 0.1};
  c.boundaries = {20, 10};
  CHECK_THROWS_AS(make_schedule(c), ConfigError);
}

TEST_CASE("cosine decay") {
  config::LearningRateConfig c;
  c.kind = config::ScheduleKind::cosine_decay;
  c.initial_learning_rate = 0.2;
  c.decay_steps = 100;
  c.alpha = 0.1;
  auto s = make_schedule(c);
  const auto expected = [](double step) {
    return 0.2 * (0.9 * 0.5 * (1 + std::cos(std::numbers::pi * std::min(step, 100.0) / 100.0)) + 0.1);
  };
  CHECK((*s)(0) == doctest::Approx(0.2));
  CHECK((*s)(25) == doctest::Approx(expected(25)));
  CHECK((*s)(50) == doctest::Approx(0.2 * (0.9 * 0.5 + 0.1)));
  CHECK((*s)(100) == doctest::Approx(0.02));
  CHECK((*s)(500) == doctest::Approx(0.02));
}

// ---------------------------------------------------------------- optimizers

TEST_CASE("SGD without momentum") {
  auto opt = make_optimizer(optimizer_config(config::OptimizerKind::sgd, 0.1), testing::cpu_numerics());
  CHECK(opt->slot_names().empty());
  check_against_reference(*opt, 3, [](std::vector<double>& w, const std::vector<double>& g, int) {
    for (std::size_t k = 0; k < w.size(); ++k) w[k] -= 0.1 * g[k];
  });
}

TEST_CASE("SGD with momentum and nesterov") {
  for (bool nesterov : {false, true}) {
    CAPTURE(nesterov);
    auto c = optimizer_config(config::OptimizerKind::sgd, 0.05);
    c.momentum = 0.9;
    c.nesterov = nesterov;
    auto opt = make_optimizer(c, testing::cpu_numerics());
    CHECK(opt->slot_names() == std::vector<std::string>{"momentum"});
    std::vector<double> m(9, 0.0);
    check_against_reference(*opt, 3, [&](std::vector<double>& w, const std::vector<double>& g, int) {
      for (std::size_t k = 0; k < w.size(); ++k) {
        m[k] = 0.9 * m[k] - 0.05 * g[k];
        w[k] += nesterov ? 0.9 * m[k] - 0.05 * g[k] : m[k];
      }
    });
  }
}

TEST_CASE("nesterov and plain momentum give different weights") {
  auto run = [](bool nesterov) {
    auto c = optimizer_config(config::OptimizerKind::sgd, 0.05);
    c.momentum = 0.9;
    c.nesterov = nesterov;
    auto opt = make_optimizer(c, testing::cpu_numerics());
    Model model;
    for (int step = 0; step < 2; ++step) {
      model.set_gradients(step);
      opt->apply_gradients(model.vars);
    }
    return model.flat();
  };
  const auto plain = run(false), nesterov = run(true);
  double diff = 0.0;
  for (std::size_t k = 0; k < plain.size(); ++k) diff = std::max(diff, std::abs(plain[k] - nesterov[k]));
  CHECK(diff > 1e-3);
}

TEST_CASE("Adam: three steps vs a double reference; the first step moves each weight by lr") {
  auto c = optimizer_config(config::OptimizerKind::adam, 0.01);
  auto opt = make_optimizer(c, testing::cpu_numerics());
  CHECK(opt->slot_names() == std::vector<std::string>{"m", "v"});
  std::vector<double> m(9, 0.0), v(9, 0.0);
  check_against_reference(*opt, 3, [&](std::vector<double>& w, const std::vector<double>& g, int step) {
    const double t = step + 1;
    const double alpha = 0.01 * std::sqrt(1 - std::pow(0.999, t)) / (1 - std::pow(0.9, t));
    for (std::size_t k = 0; k < w.size(); ++k) {
      m[k] = 0.9 * m[k] + 0.1 * g[k];
      v[k] = 0.999 * v[k] + 0.001 * g[k] * g[k];
      w[k] -= alpha * m[k] / (std::sqrt(v[k]) + 1e-7);
    }
  });

  auto first = make_optimizer(c, testing::cpu_numerics());
  Model model;
  const auto before = model.flat();
  model.set_gradients(0);
  first->apply_gradients(model.vars);
  const auto after = model.flat();
  for (std::size_t k = 0; k < before.size(); ++k) {
    CAPTURE(k);
    const double g = Model::gradient(0, static_cast<int>(k));
    REQUIRE(std::abs(g) > 1e-3);
    CHECK(before[k] - after[k] == doctest::Approx(0.01 * (g > 0 ? 1 : -1)).epsilon(2e-4));
  }
}

TEST_CASE("RMSprop in all four variants vs a double reference") {
  for (bool centered : {false, true}) {
    for (double momentum : {0.0, 0.5}) {
      CAPTURE(centered);
      CAPTURE(momentum);
      auto c = optimizer_config(config::OptimizerKind::rmsprop, 0.01);
      c.centered = centered;
      c.momentum = momentum;
      auto opt = make_optimizer(c, testing::cpu_numerics());
      std::vector<std::string> names{"velocity"};
      if (momentum > 0) names.push_back("momentum");
      if (centered) names.push_back("average_gradient");
      CHECK(opt->slot_names() == names);
      std::vector<double> v(9, 0.0), a(9, 0.0), mom(9, 0.0);
      check_against_reference(*opt, 3, [&](std::vector<double>& w, const std::vector<double>& g, int) {
        for (std::size_t k = 0; k < w.size(); ++k) {
          v[k] = 0.9 * v[k] + 0.1 * g[k] * g[k];
          double denominator = v[k] + 1e-7;
          if (centered) {
            a[k] = 0.9 * a[k] + 0.1 * g[k];
            denominator = v[k] - a[k] * a[k] + 1e-7;
          }
          const double increment = 0.01 * g[k] / std::sqrt(denominator);
          if (momentum > 0) {
            mom[k] = momentum * mom[k] + increment;
            w[k] -= mom[k];
          } else {
            w[k] -= increment;
          }
        }
      });
    }
  }
}

TEST_CASE("Adam's step size is Keras 3's, computed in float32 as Keras computes it") {
  // Keras evaluates lr * sqrt(1 - beta_2^t) / (1 - beta_1^t) in the variables' dtype, where 0.999
  // is 0.99900001: the first step then differs from double's by 6e-6 relative, which TensorFlow
  // beside dtrain shows (tests/anchors). One weight, gradient 1, three steps of 0.001.
  auto adam = make_optimizer(optimizer_config(config::OptimizerKind::adam, 0.001), testing::cpu_numerics());
  Variable w{"w", Tensor(Shape{1}), Tensor(Shape{1})};
  std::vector<Variable*> vars{&w};
  float keras = 0.0f, m = 0.0f, v = 0.0f;
  for (int step = 1; step <= 3; ++step) {
    w.grad.data<float>()[0] = 1.0f;
    adam->apply_gradients(vars);
    const float t = static_cast<float>(step);
    const float alpha = 0.001f * std::sqrt(1.0f - std::pow(0.999f, t)) / (1.0f - std::pow(0.9f, t));
    m += (1.0f - m) * 0.1f;
    v += (1.0f - v) * static_cast<float>(1.0 - 0.999);
    keras -= alpha * m / (std::sqrt(v) + 1e-7f);
    CAPTURE(step);
    CHECK(w.value.data<float>()[0] == keras);
  }
}

TEST_CASE("set_iterations moves the schedule position and Adam's bias correction") {
  auto c = optimizer_config(config::OptimizerKind::sgd, 0.0);
  c.learning_rate.kind = config::ScheduleKind::piecewise_constant;
  c.learning_rate.boundaries = {10};
  c.learning_rate.values = {1.0, 0.5};
  auto opt = make_optimizer(c, testing::cpu_numerics());
  CHECK(opt->learning_rate() == 1.0);
  opt->set_iterations(10);
  CHECK(opt->learning_rate() == 1.0);
  opt->set_iterations(11);
  CHECK(opt->learning_rate() == 0.5);

  Model model;
  const auto before = model.flat();
  model.set_gradients(0);
  opt->apply_gradients(model.vars);
  CHECK(opt->iterations() == 12);
  const auto after = model.flat();
  CHECK(before[0] - after[0] == doctest::Approx(0.5 * Model::gradient(0, 0)).epsilon(1e-5));

  // Adam at iteration 1000 has almost no bias correction left, so fresh slots give a step of
  // lr * sqrt(1 - 0.999^1001) * 0.1 / sqrt(0.001) ~ 2.5 lr instead of the lr of iteration 0.
  auto adam = make_optimizer(optimizer_config(config::OptimizerKind::adam, 0.01), testing::cpu_numerics());
  adam->set_iterations(1000);
  Model fresh;
  fresh.set_gradients(0);
  adam->apply_gradients(fresh.vars);
  const double step = std::abs(fresh.flat()[0] - before[0]);
  const double t = 1001;
  const double alpha = 0.01 * std::sqrt(1 - std::pow(0.999, t)) / (1 - std::pow(0.9, t));
  CHECK(step == doctest::Approx(alpha * 0.1 / std::sqrt(0.001)).epsilon(1e-3));
  CHECK(step > 2 * 0.01);
}

TEST_CASE("slots are lazy, shaped like the variables, reused, and the variable set is checked") {
  auto opt = make_optimizer(optimizer_config(config::OptimizerKind::adam, 0.01), testing::cpu_numerics());
  CHECK_FALSE(opt->built());
  CHECK_THROWS_AS(opt->slot(0, 0), InternalError);
  Model model;
  model.set_gradients(0);
  opt->apply_gradients(model.vars);
  REQUIRE(opt->num_variables() == 2);
  CHECK(opt->slot(0, 1).shape() == Shape{2, 3});
  CHECK(opt->slot(1, 0).shape() == Shape{3});
  CHECK(opt->slot(1, 0).data<float>()[0] != 0.0f);
  const void* storage = opt->slot(0, 0).raw();
  opt->apply_gradients(model.vars);
  CHECK(opt->slot(0, 0).raw() == storage);

  std::vector<Variable*> fewer{&model.kernel};
  CHECK_THROWS_AS(opt->apply_gradients(fewer), InternalError);
  std::vector<Variable*> swapped{&model.bias, &model.kernel};
  CHECK_THROWS_AS(opt->apply_gradients(swapped), InternalError);
  Model other;
  other.bias.value = Tensor(Shape{4});
  other.bias.grad = Tensor(Shape{4});
  CHECK_THROWS_AS(opt->apply_gradients(other.vars), InternalError);
  // A gradient of the wrong shape is refused before any weight moves.
  Model bad;
  bad.bias.grad = Tensor(Shape{5});
  const auto before = bad.flat();
  auto fresh = make_optimizer(optimizer_config(config::OptimizerKind::sgd, 0.1), testing::cpu_numerics());
  CHECK_THROWS_AS(fresh->apply_gradients(bad.vars), InternalError);
  CHECK(bad.flat() == before);
  CHECK(fresh->iterations() == 0);
  CHECK(opt->iterations() == 2);
}

TEST_CASE("an update split over threads gives every variable and slot the bits of the whole update") {
  // Sizes that cut the 16-float lines anywhere: variables smaller than a line, and more parts
  // than lines (some parts then update nothing).
  struct Odd {
    std::vector<Variable> storage;
    std::vector<Variable*> vars;
    Odd() {
      const std::int64_t sizes[] = {1, 37, 100, 250, 3};
      for (std::int64_t n : sizes) storage.push_back({fmt::format("v{}", n), Tensor(Shape{n}), Tensor(Shape{n})});
      for (auto& v : storage) {
        vars.push_back(&v);
        for (std::int64_t k = 0; k < n_of(v); ++k) v.value.data<float>()[k] = std::cos(0.3f * static_cast<float>(k + n_of(v)));
      }
    }
    static std::int64_t n_of(const Variable& v) { return v.value.numel(); }
    void set_gradients(int step) {
      int at = 0;
      for (auto& v : storage)
        for (std::int64_t k = 0; k < n_of(v); ++k) v.grad.data<float>()[k] = Model::gradient(step, at++);
    }
  };
  std::vector<config::OptimizerConfig> configs;
  configs.push_back(optimizer_config(config::OptimizerKind::sgd, 0.05));
  configs.push_back(optimizer_config(config::OptimizerKind::sgd, 0.05));
  configs.back().momentum = 0.9;
  configs.back().nesterov = true;
  configs.push_back(optimizer_config(config::OptimizerKind::adam, 0.01));
  configs.push_back(optimizer_config(config::OptimizerKind::rmsprop, 0.01));
  configs.back().momentum = 0.5;
  configs.back().centered = true;
  for (std::size_t which = 0; which < configs.size(); ++which) {
    const auto& c = configs[which];
    for (int parts : {1, 2, 3, 7, 40}) {
      CAPTURE(which);
      CAPTURE(parts);
      auto whole = make_optimizer(c, testing::cpu_numerics());
      auto split = make_optimizer(c, testing::cpu_numerics());
      Odd a, b;
      for (int step = 0; step < 3; ++step) {
        a.set_gradients(step);
        b.set_gradients(step);
        whole->apply_gradients(a.vars);
        split->begin_update(b.vars);
        std::vector<std::thread> threads;
        for (int p = 0; p < parts; ++p) threads.emplace_back([&, p] { split->update_part(b.vars, p, parts); });
        for (auto& t : threads) t.join();
        split->end_update();
      }
      CHECK(split->iterations() == 3);
      for (std::size_t i = 0; i < a.vars.size(); ++i) {
        CAPTURE(i);
        const auto n = static_cast<std::size_t>(a.vars[i]->value.numel());
        CHECK(std::memcmp(a.vars[i]->value.raw(), b.vars[i]->value.raw(), n * sizeof(float)) == 0);
        for (std::size_t s = 0; s < whole->slot_names().size(); ++s)
          CHECK(std::memcmp(whole->slot(i, s).raw(), split->slot(i, s).raw(), n * sizeof(float)) == 0);
      }
      // Every element moved: a part that skipped one would leave it where it started.
      Odd start;
      for (std::size_t i = 0; i < b.vars.size(); ++i)
        for (std::int64_t k = 0; k < b.vars[i]->value.numel(); ++k)
          CHECK(b.vars[i]->value.data<float>()[k] != start.vars[i]->value.data<float>()[k]);
    }
  }
}

TEST_CASE("build creates zero slots for a checkpoint restore") {
  auto c = optimizer_config(config::OptimizerKind::sgd, 0.1);
  c.momentum = 0.9;
  auto opt = make_optimizer(c, testing::cpu_numerics());
  Model model;
  opt->build(model.vars);
  CHECK(opt->built());
  CHECK(opt->iterations() == 0);
  for (float v : opt->slot(0, 0).span<float>()) CHECK(v == 0.0f);
  opt->slot(1, 0).fill(1.0f);  // restored momentum
  model.bias.grad.zero();
  model.kernel.grad.zero();
  opt->apply_gradients(model.vars);
  CHECK(model.bias.value.data<float>()[0] == doctest::Approx(0.9f));
}

TEST_CASE("impossible optimizer settings are ConfigErrors") {
  auto c = optimizer_config(config::OptimizerKind::adam, 0.01);
  c.beta_1 = 1.0;
  CHECK_THROWS_AS(make_optimizer(c, testing::cpu_numerics()), ConfigError);
  c = optimizer_config(config::OptimizerKind::sgd, 0.01);
  c.momentum = -0.1;
  CHECK_THROWS_AS(make_optimizer(c, testing::cpu_numerics()), ConfigError);
  c = optimizer_config(config::OptimizerKind::rmsprop, 0.01);
  c.rho = 1.5;
  CHECK_THROWS_AS(make_optimizer(c, testing::cpu_numerics()), ConfigError);
  c = optimizer_config(config::OptimizerKind::sgd, -1.0);
  CHECK_THROWS_WITH_AS(make_optimizer(c, testing::cpu_numerics()), doctest::Contains("optimizer.learning_rate"), ConfigError);
  CHECK(make_optimizer(optimizer_config(config::OptimizerKind::rmsprop, 0.01), testing::cpu_numerics())->name() == "rmsprop");
}
