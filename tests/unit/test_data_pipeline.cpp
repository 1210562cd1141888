// Input pipeline: shuffle order, batching, conversion, prefetch, exact restart.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "core/error.hpp"
#include "data/dataset.hpp"
#include "data/pipeline.hpp"

using namespace dtrain;
using namespace dtrain::data;

namespace {

// n samples of 3 pixels; pixel values encode the sample (i % 256, i / 256 % 256, 255) and y = i,
// so every batch says which samples it holds.
Dataset numbered(std::int64_t n) {
  Dataset ds;
  ds.x = Tensor(Shape{n, 3}, DType::u8);
  ds.y = Tensor(Shape{n}, DType::i32);
  for (std::int64_t i = 0; i < n; ++i) {
    ds.x.data<std::uint8_t>()[i * 3 + 0] = static_cast<std::uint8_t>(i % 256);
    ds.x.data<std::uint8_t>()[i * 3 + 1] = static_cast<std::uint8_t>(i / 256 % 256);
    ds.x.data<std::uint8_t>()[i * 3 + 2] = 255;
    ds.y.data<std::int32_t>()[i] = static_cast<std::int32_t>(i);
  }
  ds.num_classes = static_cast<int>(n);
  ds.x_scale = 1.0f / 255.0f;
  ds.description = "numbered";
  return ds;
}

// All batches of one epoch from `first_step` on, as (step, sample ids) pairs, plus the raw floats.
struct EpochRecord {
  std::vector<std::int64_t> steps;
  std::vector<std::int32_t> ids;
  std::vector<float> x;
  std::vector<std::int64_t> sizes;
  bool operator==(const EpochRecord&) const = default;
};

EpochRecord run_epoch(Pipeline& p, std::int64_t epoch, std::int64_t first_step = 0) {
  EpochRecord r;
  p.start_epoch(epoch, first_step);
  while (const Batch* b = p.next()) {
    r.steps.push_back(b->step);
    r.sizes.push_back(b->size);
    REQUIRE(b->x.shape()[0] == b->size);
    REQUIRE(b->y.shape()[0] == b->size);
    auto y = b->y.span<const std::int32_t>();
    r.ids.insert(r.ids.end(), y.begin(), y.end());
    auto x = b->x.span<const float>();
    r.x.insert(r.x.end(), x.begin(), x.end());
  }
  CHECK(p.next() == nullptr);  // stays at the end
  return r;
}

bool is_permutation_of_range(std::vector<std::int64_t> v, std::int64_t n) {
  if (static_cast<std::int64_t>(v.size()) != n) return false;
  std::sort(v.begin(), v.end());
  for (std::int64_t i = 0; i < n; ++i)
    if (v[static_cast<std::size_t>(i)] != i) return false;
  return true;
}

}  // namespace

TEST_CASE("shuffle_order follows tf.data shuffle(buffer) semantics") {
  const std::int64_t n = 500;
  for (std::int64_t buffer : {0, 1, 2, 17, 499, 500, 10000}) {
    CAPTURE(buffer);
    auto order = shuffle_order(n, buffer, 42, 3);
    CHECK(is_permutation_of_range(order, n));
    CHECK(order == shuffle_order(n, buffer, 42, 3));
    // Output i is drawn from a buffer that has seen only inputs 0 .. i + buffer - 1.
    for (std::size_t i = 0; i < order.size(); ++i) CHECK(order[i] < static_cast<std::int64_t>(i) + std::max<std::int64_t>(buffer, 1));
    std::vector<std::int64_t> identity(static_cast<std::size_t>(n));
    std::iota(identity.begin(), identity.end(), 0);
    if (buffer <= 1) {
      CHECK(order == identity);
    } else {
      CHECK(order != identity);
      CHECK(order != shuffle_order(n, buffer, 42, 4));  // reshuffled every epoch
      CHECK(order != shuffle_order(n, buffer, 43, 3));  // and per seed
    }
  }
  CHECK(shuffle_order(0, 10, 1, 0).empty());
}

TEST_CASE("a full-buffer shuffle puts every sample first about equally often") {
  std::vector<int> first(5, 0);
  for (int epoch = 0; epoch < 5000; ++epoch) first[static_cast<std::size_t>(shuffle_order(5, 5, 9, epoch)[0])]++;
  for (int count : first) CHECK((count > 850 && count < 1150));
}

TEST_CASE("pipeline yields every sample exactly once per epoch, in the shuffle order") {
  Dataset ds = numbered(103);
  Pipeline p(ds, {.batch_size = 10, .shuffle_buffer = 1000, .drop_remainder = false, .seed = 5, .prefetch = false});
  CHECK(p.steps_per_epoch() == 11);
  EpochRecord e0 = run_epoch(p, 0);
  CHECK(e0.sizes.back() == 3);
  CHECK(e0.steps == std::vector<std::int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10});
  auto order = shuffle_order(103, 1000, 5, 0);
  CHECK(std::vector<std::int64_t>(e0.ids.begin(), e0.ids.end()) == order);
  CHECK(is_permutation_of_range(std::vector<std::int64_t>(e0.ids.begin(), e0.ids.end()), 103));
  EpochRecord e1 = run_epoch(p, 1);
  CHECK(e1.ids != e0.ids);
  CHECK(run_epoch(p, 0) == e0);  // (seed, epoch) names the order
}

TEST_CASE("shuffle buffer 0 and 1 keep the dataset order") {
  Dataset ds = numbered(20);
  for (std::int64_t buffer : {0, 1}) {
    Pipeline p(ds, {.batch_size = 6, .shuffle_buffer = buffer, .drop_remainder = false, .seed = 1, .prefetch = true});
    EpochRecord r = run_epoch(p, 7);
    std::vector<std::int32_t> identity(20);
    std::iota(identity.begin(), identity.end(), 0);
    CHECK(r.ids == identity);
  }
}

TEST_CASE("batches convert to f32 times x_scale") {
  Dataset ds = numbered(300);
  Pipeline p(ds, {.batch_size = 64, .shuffle_buffer = 50, .drop_remainder = false, .seed = 2, .prefetch = true});
  p.start_epoch(0);
  const Batch* b = p.next();
  REQUIRE(b != nullptr);
  CHECK(b->x.dtype() == DType::f32);
  CHECK(b->x.shape() == Shape{64, 3});
  for (std::int64_t i = 0; i < b->size; ++i) {
    const std::int32_t id = b->y.data<std::int32_t>()[i];
    CHECK(b->x.data<float>()[i * 3 + 0] == static_cast<float>(id % 256) * (1.0f / 255.0f));
    CHECK(b->x.data<float>()[i * 3 + 1] == static_cast<float>(id / 256) * (1.0f / 255.0f));
    CHECK(b->x.data<float>()[i * 3 + 2] == 1.0f);
  }
  for (float v : b->x.span<const float>()) CHECK((v >= 0.0f && v <= 1.0f));
}

TEST_CASE("float features and float targets pass through") {
  Dataset ds = make_repeated({0.5, -2.0}, {1.0, 0.0, 3.0}, 5);
  Pipeline p(ds, {.batch_size = 2, .shuffle_buffer = 5, .drop_remainder = false, .seed = 0, .prefetch = true});
  p.start_epoch(0);
  int batches = 0;
  while (const Batch* b = p.next()) {
    ++batches;
    CHECK(b->y.shape() == Shape{b->size, 3});
    CHECK(b->x.data<float>()[1] == -2.0f);
    CHECK(b->y.data<float>()[2] == 3.0f);
  }
  CHECK(batches == 3);
}

TEST_CASE("drop_remainder drops the short last batch") {
  Dataset ds = numbered(103);
  Pipeline p(ds, {.batch_size = 10, .shuffle_buffer = 0, .drop_remainder = true, .seed = 0, .prefetch = true});
  CHECK(p.steps_per_epoch() == 10);
  EpochRecord r = run_epoch(p, 0);
  CHECK(r.ids.size() == 100);
  CHECK(std::all_of(r.sizes.begin(), r.sizes.end(), [](std::int64_t s) { return s == 10; }));
  Pipeline small(numbered(5), {.batch_size = 10, .shuffle_buffer = 0, .drop_remainder = true, .seed = 0, .prefetch = true});
  CHECK(small.steps_per_epoch() == 0);
  CHECK(run_epoch(small, 0).ids.empty());
}

TEST_CASE("start_epoch(e, k) yields what iterating from step 0 yields from step k on") {
  Dataset ds = numbered(257);
  for (bool prefetch : {false, true}) {
    CAPTURE(prefetch);
    Pipeline p(ds, {.batch_size = 16, .shuffle_buffer = 40, .drop_remainder = false, .seed = 11, .prefetch = prefetch});
    EpochRecord whole = run_epoch(p, 2);
    for (std::int64_t k : {0, 1, 7, 16, 17}) {
      CAPTURE(k);
      EpochRecord tail = run_epoch(p, 2, k);
      const std::size_t skipped = static_cast<std::size_t>(std::min<std::int64_t>(k * 16, 257));
      CHECK(std::vector<std::int32_t>(whole.ids.begin() + static_cast<std::ptrdiff_t>(skipped), whole.ids.end()) == tail.ids);
      CHECK(std::vector<float>(whole.x.begin() + static_cast<std::ptrdiff_t>(skipped * 3), whole.x.end()) == tail.x);
      if (!tail.steps.empty()) CHECK(tail.steps.front() == k);
    }
    CHECK_THROWS_AS(p.start_epoch(2, 18), InputError);
  }
}

TEST_CASE("prefetch on and off give identical batches, also when epochs are abandoned") {
  Dataset ds = numbered(1000);
  PipelineOptions options{.batch_size = 32, .shuffle_buffer = 128, .drop_remainder = false, .seed = 3, .prefetch = false};
  Pipeline plain(ds, options);
  options.prefetch = true;
  Pipeline fetched(ds, options);
  for (std::int64_t epoch = 0; epoch < 4; ++epoch) CHECK(run_epoch(plain, epoch) == run_epoch(fetched, epoch));
  // Abandon an epoch midway (the worker is busy or waiting), then restart another.
  fetched.start_epoch(9);
  for (int i = 0; i < 5; ++i) REQUIRE(fetched.next() != nullptr);
  CHECK(run_epoch(fetched, 5, 3) == run_epoch(plain, 5, 3));
  // Destroying a pipeline mid-epoch stops its worker.
  {
    Pipeline dropped(ds, options);
    dropped.start_epoch(0);
    REQUIRE(dropped.next() != nullptr);
  }
}

TEST_CASE("batches reuse their buffers: no allocation per step") {
  Dataset ds = numbered(200);
  for (bool prefetch : {false, true}) {
    Pipeline p(ds, {.batch_size = 16, .shuffle_buffer = 200, .drop_remainder = false, .seed = 4, .prefetch = prefetch});
    std::vector<const void*> buffers;
    for (std::int64_t epoch = 0; epoch < 2; ++epoch) {
      p.start_epoch(epoch);
      while (const Batch* b = p.next()) {
        buffers.push_back(b->x.raw());
        buffers.push_back(b->y.raw());
      }
    }
    std::sort(buffers.begin(), buffers.end());
    buffers.erase(std::unique(buffers.begin(), buffers.end()), buffers.end());
    CHECK(buffers.size() == 4);  // two slots, each with one x and one y buffer
  }
}

TEST_CASE("pipeline options are validated") {
  Dataset ds = numbered(4);
  CHECK_THROWS_AS(Pipeline(ds, {.batch_size = 0, .shuffle_buffer = 0, .drop_remainder = false, .seed = 0, .prefetch = false}),
                  ConfigError);
  CHECK_THROWS_AS(Pipeline(ds, {.batch_size = 1, .shuffle_buffer = -1, .drop_remainder = false, .seed = 0, .prefetch = false}),
                  ConfigError);
}
