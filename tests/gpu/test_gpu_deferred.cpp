// What lets a GPU training step run without waiting for its stream: copies from the host staged in
// pinned memory (copy_from_host returns at once), the per-example losses and the accuracy's label
// hits read back deferred (complete_reads), and every Adam variable of a step in one launch.
// Against the CPU backend as the oracle, and against the GPU's own immediate forms bit for bit.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/error.hpp"
#include "gpu_support.hpp"
#include "losses/loss.hpp"
#include "metrics/metric.hpp"

using namespace dtrain;
using namespace dtrain::gpu_testing;

TEST_CASE("copy_from_host returns at once, and the host's buffer may be reused: more copies than staging buffers") {
  backends::cuda::CudaContext& ctx = gpu();
  // Sizes that make the staging buffers grow, then fit.
  const std::vector<std::size_t> sizes = {3, 70000, 5, 300000, 1, 4096, 70000, 17, 300000, 2, 9, 123457};
  std::vector<device::Buffer> buffers;
  std::vector<float> host;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    host.assign(sizes[i], static_cast<float>(i) + 0.5f);
    buffers.push_back(ctx.allocate(sizes[i] * sizeof(float)));
    ctx.copy_from_host(host.data(), buffers.back().get(), sizes[i] * sizeof(float));
    host.assign(sizes[i], -1.0f);  // reused at once: the copy must not see this
  }
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    CAPTURE(i);
    const std::vector<float> got = download<float>(buffers[i], sizes[i]);
    CHECK(got == std::vector<float>(sizes[i], static_cast<float>(i) + 0.5f));
  }
}

TEST_CASE("deferred per-example losses and label hits arrive by complete_reads, with the immediate results") {
  for (const std::int64_t N : {1, 64, 3001}) {
    CAPTURE(N);
    const std::int64_t C = 10;
    std::vector<float> pred = uniform(static_cast<std::size_t>(N * C), -4, 4, 81);
    std::vector<std::int32_t> labels(static_cast<std::size_t>(N));
    for (std::int64_t i = 0; i < N; ++i) labels[i] = static_cast<std::int32_t>((i * 3) % C);
    device::Buffer d_pred = upload(pred), d_labels = upload(labels);
    device::Buffer d_grad = gpu().allocate(pred.size() * sizeof(float));
    device::Buffer d_grad_now = gpu().allocate(pred.size() * sizeof(float));

    device::LossBatch b;
    b.rows = N;
    b.columns = C;
    b.pred = ptr<float>(d_pred);
    b.labels = ptr<std::int32_t>(d_labels);
    b.scale = 1.0f / static_cast<float>(N);
    std::vector<float> now(static_cast<std::size_t>(N)), later(static_cast<std::size_t>(N), -1.0f);
    b.per_example = now.data();
    b.grad = ptr<float>(d_grad_now);
    gpu_numerics().loss(b);
    b.per_example = later.data();
    b.grad = ptr<float>(d_grad);
    b.deferred = true;
    gpu_numerics().loss(b);
    std::vector<std::int32_t> hits(static_cast<std::size_t>(N), -2);
    gpu_numerics().label_hits(ptr<float>(d_pred), ptr<std::int32_t>(d_labels), N, C, hits.data(), true);
    gpu_numerics().complete_reads();
    CHECK(later == now);
    CHECK(download<float>(d_grad, pred.size()) == download<float>(d_grad_now, pred.size()));

    // The CPU's losses and hits.
    std::vector<float> cpu_loss(static_cast<std::size_t>(N));
    device::LossBatch c = b;
    c.pred = pred.data();
    c.labels = labels.data();
    c.per_example = cpu_loss.data();
    c.grad = nullptr;
    c.deferred = false;
    cpu_numerics().loss(c);
    compare("deferred per-example losses", later, cpu_loss);
    std::vector<std::int32_t> cpu_hits(static_cast<std::size_t>(N));
    cpu_numerics().label_hits(pred.data(), labels.data(), N, C, cpu_hits.data(), false);
    CHECK(hits == cpu_hits);
  }
}

TEST_CASE("sparse categorical accuracy on labels in GPU memory: deferred, settled, the CPU's counts") {
  const std::int64_t N = 200, C = 10;
  std::vector<float> pred = uniform(static_cast<std::size_t>(N * C), -1, 1, 91);
  std::vector<std::int32_t> labels(static_cast<std::size_t>(N));
  for (std::int64_t i = 0; i < N; ++i) labels[i] = static_cast<std::int32_t>((i * 7) % C);
  Tensor host_pred(Shape{N, C}), host_labels(Shape{N}, DType::i32);
  std::copy(pred.begin(), pred.end(), host_pred.data<float>());
  std::copy(labels.begin(), labels.end(), host_labels.data<std::int32_t>());
  const Tensor d_pred = gpu().upload(host_pred), d_labels = gpu().upload(host_labels);

  metrics::SparseCategoricalAccuracy on_cpu(cpu_numerics()), on_gpu(gpu_numerics());
  for (int step = 0; step < 3; ++step) {
    on_cpu.update(host_labels, host_pred);
    on_gpu.update_deferred(d_labels, d_pred);
    gpu_numerics().complete_reads();
    on_gpu.settle();
  }
  CHECK(on_gpu.state() == on_cpu.state());
  CHECK(on_gpu.result() == on_cpu.result());

  // A label out of range is the metric's error, at settle().
  host_labels.data<std::int32_t>()[5] = static_cast<std::int32_t>(C);
  const Tensor bad = gpu().upload(host_labels);
  on_gpu.update_deferred(bad, d_pred);
  gpu_numerics().complete_reads();
  CHECK_THROWS_AS(on_gpu.settle(), InputError);
}

TEST_CASE("adam_update_all: one launch, each variable's adam_update bits, the CPU's within 1e-5") {
  const device::AdamStep step{0.001f * 0.3f, 0.1f, 0.001f, 1e-7f};
  // More variables than one launch takes, and an empty one.
  std::vector<std::size_t> sizes;
  for (int i = 0; i < 19; ++i) sizes.push_back(i == 4 ? 0 : static_cast<std::size_t>(1 + i * 997 % 5003));
  std::vector<std::vector<float>> w, g, m, v;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const auto seed = static_cast<std::uint32_t>(100 + 4 * i);
    w.push_back(uniform(sizes[i], -1, 1, seed));
    g.push_back(uniform(sizes[i], -2, 2, seed + 1));
    m.push_back(uniform(sizes[i], -0.5f, 0.5f, seed + 2));
    v.push_back(uniform(sizes[i], 0.1f, 0.5f, seed + 3));
  }
  std::vector<device::Buffer> keep;
  std::vector<device::AdamVariable> all, one_by_one;
  auto place = [&](std::size_t i) {
    device::AdamVariable a;
    keep.push_back(upload(w[i]));
    a.w = ptr<float>(keep.back());
    keep.push_back(upload(g[i]));
    a.g = ptr<float>(keep.back());
    keep.push_back(upload(m[i]));
    a.m = ptr<float>(keep.back());
    keep.push_back(upload(v[i]));
    a.v = ptr<float>(keep.back());
    a.n = sizes[i];
    return a;
  };
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    all.push_back(place(i));
    one_by_one.push_back(place(i));
  }
  gpu_numerics().adam_update_all(step, all);
  for (const device::AdamVariable& a : one_by_one) gpu_numerics().adam_update(step, a.w, a.g, a.m, a.v, a.n);
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    CAPTURE(i);
    const device::AdamVariable &a = all[i], &b = one_by_one[i];
    auto read = [&](const float* p) {
      std::vector<float> out(sizes[i]);
      if (!out.empty()) gpu().copy_to_host(p, out.data(), out.size() * sizeof(float));
      return out;
    };
    CHECK(read(a.w) == read(b.w));
    CHECK(read(a.m) == read(b.m));
    CHECK(read(a.v) == read(b.v));
    std::vector<float> cw = w[i], cm = m[i], cv = v[i];
    cpu_numerics().adam_update(step, cw.data(), g[i].data(), cm.data(), cv.data(), sizes[i]);
    compare("adam_update_all w", read(a.w), cw);
  }
}
