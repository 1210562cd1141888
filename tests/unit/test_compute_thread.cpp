// FTZ and DAZ on every thread that computes a training step: the main thread (one replica), the
// replica threads of a strategy, and every thread of their OpenMP teams. A layer kind that only
// this test binary registers (the registry takes one from any file) records, inside forward and
// backward of real training steps, what the MXCSR says on the thread running it and on each
// thread of its OpenMP team. (The communication thread: tests/mpi, "denormal packs".)
#include <doctest/doctest.h>

#include <omp.h>
#include <xmmintrin.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include <sys/syscall.h>
#include <unistd.h>

#include "backends/onednn/context.hpp"
#include "core/compute_thread.hpp"
#include "nn/kernel.hpp"
#include "nn/registry.hpp"
#include "test_support.hpp"
#include "trainer_support.hpp"

using namespace dtrain;

namespace {

// What the probes saw: every thread that ran one, and whether any of them lacked a bit.
struct Seen {
  std::mutex mutex;
  std::set<std::thread::id> threads;
  int unflushed = 0;
  int calls = 0;
  void record() {
    const bool flushed = denormals_flushed();
    std::lock_guard<std::mutex> lock(mutex);
    threads.insert(std::this_thread::get_id());
    if (!flushed) ++unflushed;
    ++calls;
  }
  void clear() {
    std::lock_guard<std::mutex> lock(mutex);
    threads.clear();
    unflushed = calls = 0;
  }
};
Seen seen;

struct ProbeOptions {
  static constexpr std::string_view kind = "mxcsr_probe";
  bool operator==(const ProbeOptions&) const = default;
};

// The identity, recording the floating-point environment as it goes (its kernel does).
using Probe = testing::IdentityLayer<ProbeOptions>;

class ProbeKernel final : public nn::LayerKernel {
 public:
  ProbeKernel(nn::Layer& layer, device::Context& ctx) : layer_(layer), ctx_(ctx) {}
  device::LayoutPtr plan(std::int64_t batch, const device::LayoutPtr&) override {
    return ctx_.canonical_layout(layer_.output_shape().with_batch(batch), DType::f32);
  }
  void bind(std::int64_t batch, const nn::LayerIO& io) override {
    // The first layer: its input is the model's canonical input batch.
    input_ = backends::onednn::OnednnContext::of(ctx_).wrap(io.src);
    output_ = io.dst.data;
    bytes_ = static_cast<std::size_t>(batch * layer_.output_shape().numel()) * sizeof(float);
  }
  void forward(std::int64_t, const nn::StepContext&) override {
    probe();
    std::memcpy(output_, input_.get_data_handle(), bytes_);
  }
  void backward(std::int64_t, const nn::StepContext&) override { probe(); }

 private:
  static void probe() {
    seen.record();
#pragma omp parallel
    seen.record();
  }
  nn::Layer& layer_;
  device::Context& ctx_;
  dnnl::memory input_;
  void* output_ = nullptr;
  std::size_t bytes_ = 0;
};

config::LayerOptions parse(const config::Section&) { return ProbeOptions{}; }
void write(const config::LayerOptions&, config::OptionsWriter&) {}
std::unique_ptr<nn::LayerKernel> make_kernel(nn::Layer& layer, device::Context& ctx, DType) {
  return std::make_unique<ProbeKernel>(layer, ctx);
}

const nn::LayerRegistration<Probe> probe_layer(
    {.kind = "mxcsr_probe", .aliases = {}, .auto_name = "mxcsr_probe", .keys = {}, .parse = &parse, .write = &write});
const nn::KernelRegistration probe_kernel(backends::onednn::kName, "mxcsr_probe", &make_kernel);

// Clears FTZ and DAZ on the calling thread and its OpenMP team, so that what a test then sees was
// set by the code under test, not inherited from an earlier test.
void unflush() {
  const auto clear = [] { _mm_setcsr(_mm_getcsr() & ~0x8040u); };
  clear();
#pragma omp parallel
  clear();
}

std::string probed_experiment(const std::string& strategy, int threads, const char* parallelism) {
  return testing::small_data_experiment("mxcsr", 1, strategy, 8) + fmt::format(R"(model:
  input_shape: [28, 28, 1]
  layers: [mxcsr_probe: {{}}, flatten: {{}}, dense: {{units: 10}}]
loss: {{kind: sparse_categorical_crossentropy, from_logits: true, reduction: none}}
metrics: [sparse_categorical_accuracy]
train: {{epochs: 1, threads: {}, parallelism: {}, progress: none}}
)",
                                                                                threads, parallelism);
}

}  // namespace

TEST_CASE("FTZ and DAZ are set on every thread that computes a training step") {
  struct Case {
    std::string strategy;
    int threads;
    const char* parallelism;
    std::size_t at_least;  // distinct threads the probes must have run on
  };
  // Under `operations`: one replica with a team of 2 on the main thread; 2 replica threads with
  // teams of 1 and of 2. Under `batch`: 2 lane threads; 2 replica threads with 2 lanes each.
  for (const Case& c : {Case{"{kind: default}", 2, "operations", 2},
                        Case{"{kind: mirrored, devices: [cpu:0, cpu:1]}", 2, "operations", 2},
                        Case{"{kind: mirrored, devices: [cpu:0, cpu:1]}", 4, "operations", 4},
                        Case{"{kind: default}", 2, "batch", 2},
                        Case{"{kind: mirrored, devices: [cpu:0, cpu:1]}", 4, "batch", 4}}) {
    CAPTURE(c.strategy);
    CAPTURE(c.threads);
    CAPTURE(c.parallelism);
    unflush();  // the replica threads the trainer starts inherit this
    REQUIRE_FALSE(denormals_flushed());
    auto trainer = testing::make_trainer(probed_experiment(c.strategy, c.threads, c.parallelism));
    seen.clear();
    trainer->train_steps(0, 3);
    CHECK(seen.calls > 0);
    CHECK(seen.threads.size() >= c.at_least);
    CHECK(seen.unflushed == 0);
  }
}

TEST_CASE("prepare_compute_thread sets the bits on the calling thread and its OpenMP team") {
  std::thread fresh([] {
    unflush();
    CHECK_FALSE(denormals_flushed());
    prepare_compute_thread(3);
    CHECK(denormals_flushed());
    int unflushed = 0;
#pragma omp parallel num_threads(3) reduction(+ : unflushed)
    unflushed += denormals_flushed() ? 0 : 1;
    CHECK(unflushed == 0);
    // A subnormal input reads as zero; a result that would be subnormal is zero.
    volatile float tiny = 1e-40f;
    CHECK(tiny * 1.0f == 0.0f);
    volatile float small = 1e-20f;
    CHECK(small * small == 0.0f);
  });
  fresh.join();
}

TEST_CASE("release_openmp_team ends the team; the next team's new threads have the bits too") {
  std::thread fresh([] {
    unflush();
    prepare_compute_thread(3);
    // Each team thread's kernel id (gettid: the kernel hands out new ids in sequence, where
    // pthread ids are reused with the C library's cached stacks).
    auto team_ids = [](int& unflushed) {
      std::set<long> ids;
      std::mutex m;
      unflushed = 0;
#pragma omp parallel num_threads(3) reduction(+ : unflushed)
      {
        unflushed += denormals_flushed() ? 0 : 1;
        if (omp_get_thread_num() != 0) {
          const std::lock_guard<std::mutex> lock(m);
          ids.insert(static_cast<long>(syscall(SYS_gettid)));
        }
      }
      return ids;
    };
    int unflushed = 0;
    const std::set<long> before = team_ids(unflushed);
    CHECK(unflushed == 0);
    CHECK(team_ids(unflushed) == before);  // the pool keeps its threads between regions
    release_openmp_team();
    const std::set<long> after = team_ids(unflushed);
    CHECK(unflushed == 0);
    REQUIRE(after.size() == 2);
    for (const long id : after) CHECK(before.count(id) == 0);
  });
  fresh.join();
}
