#include <doctest/doctest.h>

#include <algorithm>
#include <vector>

#include "core/error.hpp"
#include "data/dataset.hpp"
#include "data/distributed.hpp"

using namespace dtrain;

namespace {

// x holds the sample id, so a batch says which samples it got.
data::Dataset numbered(std::int64_t n) {
  data::Dataset d;
  d.x = Tensor(Shape{n, 1});
  d.y = Tensor(Shape{n}, DType::i32);
  for (std::int64_t i = 0; i < n; ++i) {
    d.x.data<float>()[i] = static_cast<float>(i);
    d.y.data<std::int32_t>()[i] = static_cast<std::int32_t>(i % 3);
  }
  d.num_classes = 3;
  return d;
}

std::vector<std::vector<std::vector<int>>> epoch_samples(data::DistributedIterator& it, std::int64_t epoch) {
  std::vector<std::vector<std::vector<int>>> steps;
  it.start_epoch(epoch);
  while (const auto* batches = it.next()) {
    steps.emplace_back();
    for (const auto& b : *batches) {
      steps.back().emplace_back();
      for (std::int64_t i = 0; i < b.size; ++i) steps.back().back().push_back(static_cast<int>(b.x.data<float>()[i]));
    }
  }
  return steps;
}

data::PipelineOptions options(bool prefetch) {
  data::PipelineOptions o;
  o.shuffle_buffer = 100;
  o.seed = 9;
  o.prefetch = prefetch;
  return o;
}

}  // namespace

TEST_CASE("split_global_batch splits each global batch as tf.distribute does, a short last one too") {
  data::InputContext ctx;
  ctx.num_replicas_in_sync = 3;
  data::DistributedIterator it(numbered(10), config::DistributeMode::split_global_batch, ctx, 4, options(true));
  CHECK(it.steps_per_epoch() == 3);
  const auto steps = epoch_samples(it, 0);
  REQUIRE(steps.size() == 3);
  // ceil(4 / 3) = 2 rows to each replica in turn; the short last batch of 2, 1 each.
  const std::vector<std::vector<std::size_t>> sizes = {{2, 2, 0}, {2, 2, 0}, {1, 1, 0}};
  std::vector<int> seen;
  for (std::size_t s = 0; s < 3; ++s)
    for (std::size_t r = 0; r < 3; ++r) {
      CHECK(steps[s][r].size() == sizes[s][r]);
      seen.insert(seen.end(), steps[s][r].begin(), steps[s][r].end());
    }
  std::sort(seen.begin(), seen.end());
  for (int i = 0; i < 10; ++i) CHECK(seen[static_cast<std::size_t>(i)] == i);
}

TEST_CASE("per_replica hands consecutive per-replica batches out, like split_global_batch") {
  data::InputContext ctx;
  ctx.num_replicas_in_sync = 2;
  data::DistributedIterator split(numbered(40), config::DistributeMode::split_global_batch, ctx, 8, options(false));
  data::DistributedIterator per(numbered(40), config::DistributeMode::per_replica, ctx, 8, options(true));
  CHECK(split.steps_per_epoch() == per.steps_per_epoch());
  for (std::int64_t epoch : {0, 1}) CHECK(epoch_samples(split, epoch) == epoch_samples(per, epoch));
}

TEST_CASE("per_replica refuses a global batch that does not divide, as InputContext does") {
  data::InputContext ctx;
  ctx.num_replicas_in_sync = 3;
  CHECK(ctx.get_per_replica_batch_size(12) == 4);
  CHECK_THROWS_AS(ctx.get_per_replica_batch_size(10), ConfigError);
  CHECK_THROWS_AS(data::DistributedIterator(numbered(10), config::DistributeMode::per_replica, ctx, 10, options(false)),
                  ConfigError);
}

TEST_CASE("start_epoch(e, k) resumes at step k in both modes") {
  data::InputContext ctx;
  ctx.num_replicas_in_sync = 2;
  for (auto mode : {config::DistributeMode::split_global_batch, config::DistributeMode::per_replica}) {
    data::DistributedIterator it(numbered(37), mode, ctx, 6, options(true));
    const auto all = epoch_samples(it, 2);
    it.start_epoch(2, 3);
    std::size_t s = 3;
    while (const auto* batches = it.next()) {
      REQUIRE(s < all.size());
      for (std::size_t r = 0; r < batches->size(); ++r) {
        std::vector<int> got;
        for (std::int64_t i = 0; i < (*batches)[r].size; ++i) got.push_back(static_cast<int>((*batches)[r].x.data<float>()[i]));
        CHECK(got == all[s][r]);
      }
      ++s;
    }
    CHECK(s == all.size());
  }
}
