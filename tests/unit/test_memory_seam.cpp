// The memory seam (device/context.hpp): memory a backend owns is reached by the host only through
// the context's copies. Proven with the CPU backend's checked mode (DTRAIN_CHECKED_MEMORY=1),
// where a host access outside the backend's calls faults, and by the mutations it catches: a
// collective reading the gradient arena without its staging copy, a model fed a batch that was
// not staged, a loss handed labels still in host memory.
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <numeric>
#include <vector>

#include <doctest/doctest.h>

#include "config/parse.hpp"
#include "core/error.hpp"
#include "device/context.hpp"
#include "distribute/single_communicator.hpp"
#include "distribute/staged_gradients.hpp"
#include "distribute/strategy.hpp"
#include "losses/loss.hpp"
#include "nn/model.hpp"
#include "test_support.hpp"

namespace dtrain {
namespace {

// A CPU context in the checked mode (the variable is read when a context is made).
std::unique_ptr<device::Context> checked_context() {
  setenv("DTRAIN_CHECKED_MEMORY", "1", 1);
  auto ctx = device::make_context(Device{});
  unsetenv("DTRAIN_CHECKED_MEMORY");
  return ctx;
}

// Whether `touch` returns in a child process (false: the child faulted, or a sanitizer reported
// the fault and ended it).
template <class F>
bool returns_in_child(F touch) {
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    // The fault ends the child by its signal: neither doctest's handler nor a sanitizer's reports it.
    std::signal(SIGSEGV, SIG_DFL);
    std::signal(SIGBUS, SIG_DFL);
    touch();
    _exit(0);
  }
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

config::ModelConfig small_model() {
  return config::parse_experiment(R"(
name: seam
strategy: {kind: default}
data: {source: hdf5, path: x.h5, batch_size_per_replica: 4}
model:
  input_shape: [6, 6, 1]
  layers:
    - conv2d: {filters: 2, kernel_size: 3, activation: relu}
    - flatten: {}
    - dense: {units: 3}
loss: {kind: sparse_categorical_crossentropy, from_logits: true}
optimizer: {kind: sgd, learning_rate: 0.1}
)", "seam.yaml").model;
}

}  // namespace

TEST_CASE("checked memory: the host reaches a checked context's memory only through its copies") {
  auto ctx = checked_context();
  CHECK_FALSE(ctx->host_accessible());
  Tensor t = ctx->tensor(Shape{1000});
  CHECK_FALSE(t.host_accessible());
  CHECK_THROWS_AS(t.data<float>(), InternalError);
  CHECK_THROWS_AS(t.zero(), InternalError);

  std::vector<float> values(1000);
  std::iota(values.begin(), values.end(), 0.5f);
  ctx->copy_from_host(values.data(), t);
  Tensor back = ctx->download(t);
  CHECK(std::vector<float>(back.span<float>().begin(), back.span<float>().end()) == values);

  // A stray read through the raw address faults; the same read of a plain CPU context's memory
  // does not.
  CHECK_FALSE(returns_in_child([&] { volatile float x = *t.address<float>(); (void)x; }));
  Tensor plain = testing::cpu().tensor(Shape{10});
  CHECK(returns_in_child([&] { volatile float x = *plain.address<float>(); (void)x; }));
}

TEST_CASE("checked memory: the staging copies of a gradient sum, and the fault without them") {
  auto ctx = checked_context();
  Tensor arena = ctx->tensor(Shape{6});
  const std::vector<float> grads{1, 2, 3, 4, 5, 6};
  ctx->copy_from_host(grads.data(), arena);

  distribute::StagedGradients staged(*ctx, arena);
  CHECK_FALSE(staged.in_place());
  staged.to_host();
  std::vector<float> host(staged.host().begin(), staged.host().end());
  CHECK(host == grads);
  for (float& g : staged.host()) g *= 2.0f;  // what a sum over two equal replicas leaves
  staged.from_host();
  Tensor back = ctx->download(arena);
  CHECK(back.span<float>()[5] == 12.0f);

  // The mutation: a collective handed the arena itself instead of its staged copy reads memory
  // the host may not touch, and faults.
  CHECK_FALSE(returns_in_child([&] {
    const float* g = arena.address<float>();
    volatile float sum = std::accumulate(g, g + 6, 0.0f);
    (void)sum;
  }));
}

TEST_CASE("checked memory: a mirrored strategy sums checked replicas' gradients through the host") {
  std::vector<std::unique_ptr<device::Context>> contexts;
  std::vector<Tensor> arenas;
  distribute::SingleCommunicator alone;
  auto strategy = distribute::make_strategy(
      config::parse_strategy_section("{kind: mirrored, devices: [cpu:0, cpu:1, cpu:2]}", "seam.yaml"), 3, alone);
  const std::vector<std::size_t> sizes{3, 2};
  for (int r = 0; r < 3; ++r) {
    contexts.push_back(checked_context());
    arenas.push_back(contexts.back()->tensor(Shape{5}));
    const std::vector<float> mine(5, static_cast<float>(r + 1));
    contexts.back()->copy_from_host(mine.data(), arenas.back());
    strategy->bind_gradients(r, *contexts.back(), arenas.back(), sizes);
  }
  strategy->run([&](const distribute::ReplicaContext& rc) { strategy->sum_gradients(rc); });
  for (int r = 0; r < 3; ++r) {
    Tensor back = contexts[static_cast<std::size_t>(r)]->download(arenas[static_cast<std::size_t>(r)]);
    for (float g : back.span<float>()) CHECK(g == 6.0f);
  }
}

TEST_CASE("checked memory: a batch or labels left in host memory are refused at the seam") {
  auto ctx = checked_context();
  nn::Sequential model(small_model(), 7, *ctx);
  for (const Variable* v : model.variables()) CHECK_FALSE(v->value.host_accessible());
  CHECK_FALSE(model.gradient_arena().host_accessible());

  const std::vector<float> pixels = testing::uniform(4 * 36, -1.0f, 1.0f, 3);
  Tensor host_x(Shape{4, 6, 6, 1});
  std::copy(pixels.begin(), pixels.end(), host_x.data<float>());
  nn::StepContext step = testing::step_of(nn::Mode::training, 4);
  // The mutation: the trainer's input staging removed.
  CHECK_THROWS_AS(model.forward(host_x, step), InternalError);
  // With it, the model runs and its outputs come back through the copies.
  const Tensor staged_x = ctx->upload(host_x);
  const Tensor& logits = model.forward(staged_x, step);
  CHECK_FALSE(logits.host_accessible());
  CHECK(ctx->download(logits).numel() == 12);

  // Labels: the loss's numerics read device memory only.
  Tensor labels(Shape{4}, DType::i32);
  for (int i = 0; i < 4; ++i) labels.data<std::int32_t>()[i] = i % 3;
  config::LossConfig lc;
  lc.from_logits = true;
  auto loss = losses::make_loss(lc, ctx->numerics());
  std::vector<float> per_example(4);
  CHECK_THROWS_AS(loss->per_example(logits, labels, per_example), InternalError);
  loss->per_example(logits, ctx->upload(labels), per_example);
  for (float l : per_example) CHECK(l > 0.0f);
  loss->gradient(logits, ctx->upload(labels), {}, 0.25f, model.output_gradient());
  model.backward(step);
  CHECK(ctx->download(model.gradient_arena()).numel() == model.num_parameters());
}

}  // namespace dtrain
