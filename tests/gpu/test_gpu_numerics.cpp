// Every function of the CUDA numerics against the CPU backend's (the oracle) on random inputs of
// odd sizes: floats within 1e-5 relative (gpu_support.hpp's compare), counts and indices exactly.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "gpu_support.hpp"

using namespace dtrain;
using namespace dtrain::gpu_testing;
using config::LossKind;

namespace {

const std::size_t kSizes[] = {1, 7, 1000003};

// One optimizer step on the GPU and the CPU from the same start; `run` takes a Numerics and the
// pointers (w, g, slot 0, slot 1, slot 2; a slot may be unused) and the element count.
template <class Run>
void check_update(const char* what, std::size_t n, int slots, Run run) {
  CAPTURE(n);
  const std::vector<float> w0 = uniform(n, -1, 1, 1), g = uniform(n, -2, 2, 2);
  // Second moments and velocities start at 0.1 or more: centered RMSprop then never takes the
  // square root of a negative number, so every result is a number to compare.
  std::vector<std::vector<float>> s0 = {uniform(n, -0.5f, 0.5f, 3), uniform(n, 0.1f, 0.5f, 4),
                                        uniform(n, -0.1f, 0.1f, 5)};
  // The CPU.
  std::vector<float> w = w0;
  std::vector<std::vector<float>> s = s0;
  run(cpu_numerics(), w.data(), g.data(), s[0].data(), s[1].data(), s[2].data(), n);
  // The GPU.
  device::Buffer dw = upload(w0), dg = upload(g), d0 = upload(s0[0]), d1 = upload(s0[1]), d2 = upload(s0[2]);
  run(gpu_numerics(), ptr<float>(dw), ptr<float>(dg), ptr<float>(d0), ptr<float>(d1), ptr<float>(d2), n);
  compare(what, download<float>(dw, n), w);
  const device::Buffer* slot_buffers[] = {&d0, &d1, &d2};
  for (int k = 0; k < slots; ++k) compare(what, download<float>(*slot_buffers[k], n), s[k]);
}

}  // namespace

TEST_CASE("sgd, adam, rmsprop, axpy and axpby on the GPU agree with the CPU") {
  for (const std::size_t n : kSizes) {
    for (const auto& [momentum, nesterov] : {std::pair{0.0f, false}, {0.9f, false}, {0.9f, true}}) {
      const device::SgdStep step{0.01f, momentum, nesterov};
      check_update("sgd", n, momentum > 0 ? 1 : 0, [&](device::Numerics& num, float* w, const float* g, float* m,
                                                        float*, float*, std::size_t k) {
        num.sgd_update(step, w, g, m, k);
      });
    }
    const device::AdamStep adam{0.001f * 0.3f, 0.1f, 0.001f, 1e-7f};
    check_update("adam", n, 2, [&](device::Numerics& num, float* w, const float* g, float* m, float* v, float*,
                                   std::size_t k) { num.adam_update(adam, w, g, m, v, k); });
    for (const bool centered : {false, true}) {
      for (const float mu : {0.0f, 0.9f}) {
        const device::RmspropStep step{0.001f, 0.9f, mu, 1e-7f, centered};
        // Slots in check_update's order: momentum, velocity, average.
        check_update("rmsprop", n, 3, [&](device::Numerics& num, float* w, const float* g, float* mom, float* vel,
                                          float* avg, std::size_t k) {
          num.rmsprop_update(step, w, g, vel, mu > 0 ? mom : nullptr, centered ? avg : nullptr, k);
        });
      }
    }
    check_update("axpy", n, 0, [&](device::Numerics& num, float* w, const float* g, float*, float*, float*,
                                   std::size_t k) { num.axpy(-0.37f, g, w, k); });
    check_update("axpby", n, 0, [&](device::Numerics& num, float* w, const float* g, float*, float*, float*,
                                    std::size_t k) { num.axpby(0.01f, g, 0.99f, w, k); });
  }
}

TEST_CASE("every loss kind on the GPU agrees with the CPU: logits or probabilities, labels or dense targets, "
          "weights, scale, per-example losses in host memory, gradients") {
  for (const std::size_t rows : kSizes) {
    for (const LossKind kind : {LossKind::sparse_categorical_crossentropy, LossKind::categorical_crossentropy,
                                LossKind::binary_crossentropy, LossKind::mean_squared_error}) {
      for (const bool from_logits : {false, true}) {
        for (const bool dense : {false, true}) {
          const bool crossentropy =
              kind == LossKind::sparse_categorical_crossentropy || kind == LossKind::categorical_crossentropy;
          const std::int64_t N = static_cast<std::int64_t>(rows);
          const std::int64_t C = crossentropy ? (rows > 1000 ? 3 : 10) : (dense ? 4 : 1);
          const auto n = static_cast<std::size_t>(N * C);
          std::vector<float> pred = from_logits || kind == LossKind::mean_squared_error ? uniform(n, -6, 6, 11)
                                                                                        : uniform(n, 0, 1, 12);
          if (!from_logits && kind == LossKind::binary_crossentropy && n > 1) {
            pred[0] = 0.0f;
            pred[1] = 1.0f;
          }
          const std::vector<float> targets = uniform(n, 0, 1, 13);
          std::vector<std::int32_t> labels(rows);
          for (std::int64_t i = 0; i < N; ++i)
            labels[i] = static_cast<std::int32_t>(crossentropy ? (i * 7) % C : i % 2);
          const std::vector<float> weights = uniform(rows, 0, 2, 14);
          device::Buffer d_pred = upload(pred), d_targets = upload(targets), d_labels = upload(labels),
                         d_weights = upload(weights);
          for (const bool weighted : {false, true}) {
            for (const bool want_grad : {false, true}) {
              CAPTURE(rows);
              CAPTURE(static_cast<int>(kind));
              CAPTURE(from_logits);
              CAPTURE(dense);
              CAPTURE(weighted);
              CAPTURE(want_grad);
              device::LossBatch b;
              b.kind = kind;
              b.from_logits = from_logits;
              b.rows = N;
              b.columns = C;
              b.scale = 1.0f / 64;
              std::vector<float> cpu_loss(rows), cpu_grad(n);
              b.pred = pred.data();
              b.dense_targets = dense ? targets.data() : nullptr;
              b.labels = dense ? nullptr : labels.data();
              b.weights = weighted ? weights.data() : nullptr;
              b.per_example = cpu_loss.data();
              b.grad = want_grad ? cpu_grad.data() : nullptr;
              cpu_numerics().loss(b);

              device::Buffer d_grad = gpu().allocate(n * sizeof(float));
              std::vector<float> gpu_loss(rows);
              b.pred = ptr<float>(d_pred);
              b.dense_targets = dense ? ptr<float>(d_targets) : nullptr;
              b.labels = dense ? nullptr : ptr<std::int32_t>(d_labels);
              b.weights = weighted ? ptr<float>(d_weights) : nullptr;
              b.per_example = gpu_loss.data();  // host memory, filled before loss() returns
              b.grad = want_grad ? ptr<float>(d_grad) : nullptr;
              gpu_numerics().loss(b);
              compare("per-example loss", gpu_loss, cpu_loss);
              if (want_grad) compare("loss gradient", download<float>(d_grad, n), cpu_grad);
            }
          }
        }
      }
    }
  }
}

TEST_CASE("argmax, row matches and the sum of squares on the GPU: counts exactly, the sum in double") {
  for (const std::size_t rows : kSizes) {
    CAPTURE(rows);
    const std::int64_t N = static_cast<std::int64_t>(rows), C = 5;
    std::vector<float> pred = uniform(rows * C, 0, 1, 21);
    for (std::int64_t j = 0; j < C; ++j) pred[j] = 0.5f;  // a tie in row 0: the first maximum
    // Quantized so that exact matches happen.
    for (float& p : pred) p = static_cast<float>(static_cast<int>(p * 4)) / 4;
    device::Buffer d_pred = upload(pred);

    std::vector<std::int32_t> cpu_argmax(rows), gpu_argmax(rows);
    cpu_numerics().argmax_rows(pred.data(), N, C, cpu_argmax.data());
    gpu_numerics().argmax_rows(ptr<float>(d_pred), N, C, gpu_argmax.data());
    CHECK(gpu_argmax == cpu_argmax);

    std::vector<std::int32_t> t_i32(rows * C);
    std::vector<float> t_f32(rows * C);
    for (std::size_t k = 0; k < rows * C; ++k) {
      t_i32[k] = static_cast<std::int32_t>(k % 3 == 0);
      t_f32[k] = k % 2 == 0 ? pred[k] : 0.25f;
    }
    device::Buffer d_i32 = upload(t_i32), d_f32 = upload(t_f32);
    const float threshold = 0.5f;
    for (const bool i32 : {false, true}) {
      for (const float* t : {static_cast<const float*>(nullptr), &threshold}) {
        CAPTURE(i32);
        CAPTURE(t != nullptr);
        std::vector<std::int64_t> cpu_m(rows), gpu_m(rows);
        cpu_numerics().row_matches(pred.data(), i32 ? static_cast<const void*>(t_i32.data()) : t_f32.data(), i32, N,
                                   C, t, cpu_m.data());
        gpu_numerics().row_matches(ptr<float>(d_pred), i32 ? d_i32.get() : d_f32.get(), i32, N, C, t, gpu_m.data());
        CHECK(gpu_m == cpu_m);
      }
    }

    const std::vector<float> x = uniform(rows, -3, 3, 22);
    device::Buffer d_x = upload(x);
    const double cpu_sum = cpu_numerics().sum_of_squares(x.data(), rows);
    const double gpu_sum = gpu_numerics().sum_of_squares(ptr<float>(d_x), rows);
    CHECK(std::abs(gpu_sum - cpu_sum) <= 1e-12 * std::abs(cpu_sum));
    // Deterministic: the same bits every time.
    CHECK(gpu_numerics().sum_of_squares(ptr<float>(d_x), rows) == gpu_sum);
  }
}

TEST_CASE("a second identical step of the numerics allocates nothing") {
  auto ctx = backends::cuda::make_cuda_context({Device::Kind::gpu, 0});
  auto& c = backends::cuda::CudaContext::of(*ctx);
  const std::int64_t N = 64, C = 10;
  const auto n = static_cast<std::size_t>(N * C);
  std::vector<float> per_example(N);
  std::vector<std::int32_t> argmax(N);
  std::vector<std::int64_t> matches(N);
  auto step = [&] {
    device::Buffer pred = c.allocate(n * 4), grad = c.allocate(n * 4), labels = c.allocate(N * 4);
    device::Buffer w = c.allocate(1000003 * 4), g = c.allocate(1000003 * 4), m = c.allocate(1000003 * 4),
                   v = c.allocate(1000003 * 4);
    device::LossBatch b;
    b.rows = N;
    b.columns = C;
    b.from_logits = true;
    b.pred = ptr<float>(pred);
    b.labels = ptr<std::int32_t>(labels);
    b.per_example = per_example.data();
    b.grad = ptr<float>(grad);
    c.numerics().loss(b);
    c.numerics().argmax_rows(ptr<float>(pred), N, C, argmax.data());
    c.numerics().row_matches(ptr<float>(pred), labels.get(), true, N, 1, nullptr, matches.data());
    (void)c.numerics().sum_of_squares(ptr<float>(w), 1000003);
    c.numerics().adam_update({0.001f, 0.1f, 0.001f, 1e-7f}, ptr<float>(w), ptr<float>(g), ptr<float>(m),
                             ptr<float>(v), 1000003);
    c.synchronize();
  };
  step();
  const auto first = c.allocator_stats().device_mallocs;
  step();
  CHECK(c.allocator_stats().device_mallocs == first);
}
