// Multi-worker input: auto_shard plans, the pipeline's shard option, and W workers' iterators
// simulated in one process (each its own DistributedIterator, the all-gather of share sizes
// replaced by the sizes every worker would report).
#include <doctest/doctest.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "data/dataset.hpp"
#include "data/distributed.hpp"
#include "data/pipeline.hpp"
#include "data/sharding.hpp"

using namespace dtrain;

namespace {

// x holds the sample id, so a batch says which samples it got.
data::Dataset numbered(std::int64_t n, std::int64_t first = 0) {
  data::Dataset d;
  d.x = Tensor(Shape{n, 1});
  d.y = Tensor(Shape{n}, DType::i32);
  for (std::int64_t i = 0; i < n; ++i) {
    d.x.data<float>()[i] = static_cast<float>(first + i);
    d.y.data<std::int32_t>()[i] = static_cast<std::int32_t>(i % 3);
  }
  d.num_classes = 3;
  d.description = "numbered";
  return d;
}

using Step = std::vector<std::vector<int>>;  // one step: each local replica's sample ids

struct WorkerEpoch {
  std::vector<Step> steps;
  std::vector<std::int64_t> global_samples;  // what the iterator says the whole step holds
};

WorkerEpoch run_epoch(data::DistributedIterator& it, std::int64_t epoch) {
  WorkerEpoch out;
  it.start_epoch(epoch);
  while (const auto* batches = it.next()) {
    out.steps.emplace_back();
    for (const auto& b : *batches) {
      out.steps.back().emplace_back();
      for (std::int64_t i = 0; i < b.size; ++i) out.steps.back().back().push_back(static_cast<int>(b.x.data<float>()[i]));
    }
    out.global_samples.push_back(it.global_samples());
  }
  return out;
}

struct Job {
  int workers = 1;
  int local_replicas = 1;
  std::int64_t global_batch = 8;
  config::DistributeMode mode = config::DistributeMode::split_global_batch;
  bool drop_remainder = false;
  bool shard_by_data = true;  // false: each worker's dataset is its own (as by file)
};

// Every worker's epoch. `datasets` holds one dataset per worker (by file) or one for all.
std::vector<WorkerEpoch> run_job(const Job& job, const std::vector<data::Dataset>& datasets, std::int64_t epoch) {
  std::vector<std::int64_t> sizes;
  for (int w = 0; w < job.workers; ++w) {
    const std::int64_t n = datasets[job.shard_by_data ? 0 : static_cast<std::size_t>(w)].size();
    // Under split_global_batch every data-sharded worker holds the whole order and takes its
    // replicas' rows of each global batch; per_replica keeps every W-th sample.
    const bool whole = job.mode == config::DistributeMode::split_global_batch && job.workers > 1;
    sizes.push_back(job.shard_by_data ? (whole ? n : n > w ? (n - w + job.workers - 1) / job.workers : 0) : n);
  }
  std::vector<WorkerEpoch> out;
  for (int w = 0; w < job.workers; ++w) {
    data::InputContext ctx;
    ctx.num_input_pipelines = job.workers;
    ctx.input_pipeline_id = w;
    ctx.num_replicas_in_sync = job.workers * job.local_replicas;
    data::PipelineOptions po;
    po.shuffle_buffer = 1000;
    po.seed = 17;
    po.prefetch = w % 2 == 0;
    po.drop_remainder = job.drop_remainder;
    po.shard_count = job.shard_by_data ? job.workers : 1;
    po.shard_index = job.shard_by_data ? w : 0;
    auto share = [&, w](std::int64_t mine) {
      CHECK(mine == sizes[static_cast<std::size_t>(w)]);
      return sizes;
    };
    data::DistributedIterator it(datasets[job.shard_by_data ? 0 : static_cast<std::size_t>(w)], job.mode, ctx,
                                 job.global_batch, po, share);
    out.push_back(run_epoch(it, epoch));
  }
  return out;
}

// The samples of step s over all workers and replicas, sorted.
std::vector<int> step_union(const std::vector<WorkerEpoch>& workers, std::size_t s) {
  std::vector<int> all;
  for (const WorkerEpoch& w : workers)
    for (const auto& replica : w.steps[s]) all.insert(all.end(), replica.begin(), replica.end());
  std::sort(all.begin(), all.end());
  return all;
}

// Every worker runs the same steps, agrees on each step's global sample count, and that count is
// what the workers really hold.
void check_consistent(const std::vector<WorkerEpoch>& workers) {
  for (const WorkerEpoch& w : workers) {
    REQUIRE(w.steps.size() == workers[0].steps.size());
    CHECK(w.global_samples == workers[0].global_samples);
  }
  for (std::size_t s = 0; s < workers[0].steps.size(); ++s)
    CHECK(static_cast<std::int64_t>(step_union(workers, s).size()) == workers[0].global_samples[s]);
}

std::vector<int> epoch_union(const std::vector<WorkerEpoch>& workers) {
  std::vector<int> all;
  for (std::size_t s = 0; s < workers[0].steps.size(); ++s) {
    const auto step = step_union(workers, s);
    all.insert(all.end(), step.begin(), step.end());
  }
  std::sort(all.begin(), all.end());
  return all;
}

std::vector<int> iota_ids(int first, int n) {
  std::vector<int> v(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = first + i;
  return v;
}

}  // namespace

TEST_CASE("the pipeline's shards of one order take every k-th sample and partition the epoch") {
  const data::Dataset ds = numbered(23);
  data::PipelineOptions po;
  po.batch_size = 100;
  po.shuffle_buffer = 50;
  po.seed = 3;
  po.prefetch = false;
  data::Pipeline whole(ds, po);
  whole.start_epoch(4);
  const data::Batch* all = whole.next();
  REQUIRE(all);
  for (int index = 0; index < 4; ++index) {
    CAPTURE(index);
    po.shard_count = 4;
    po.shard_index = index;
    data::Pipeline shard(ds, po);
    CHECK(shard.size() == (23 - index + 3) / 4);
    shard.start_epoch(4);
    const data::Batch* b = shard.next();
    REQUIRE(b);
    REQUIRE(b->size == shard.size());
    for (std::int64_t k = 0; k < b->size; ++k) CHECK(b->x.data<float>()[k] == all->x.data<float>()[index + 4 * k]);
  }
  po.shard_count = 30;
  po.shard_index = 25;
  CHECK(data::Pipeline(ds, po).size() == 0);
  po.shard_index = 30;
  CHECK_THROWS_AS(data::Pipeline(ds, po), InternalError);
}

TEST_CASE("data sharding: W workers take together exactly the single process's global batch each step") {
  const std::vector<data::Dataset> ds = {numbered(100)};
  for (auto mode : {config::DistributeMode::split_global_batch, config::DistributeMode::per_replica})
    for (int workers : {2, 4})
      for (int local : {1, 2}) {
        CAPTURE(workers);
        CAPTURE(local);
        CAPTURE(static_cast<int>(mode));
        const std::int64_t global = 8 * local;  // divides among every replica
        const auto single = run_job({1, workers * local, global, mode}, ds, 3);
        const auto many = run_job({workers, local, global, mode}, ds, 3);
        check_consistent(many);
        REQUIRE(many[0].steps.size() == single[0].steps.size());
        for (std::size_t s = 0; s < single[0].steps.size(); ++s) {
          CAPTURE(s);
          CHECK(step_union(many, s) == step_union(single, s));
          CHECK(many[0].global_samples[s] == single[0].global_samples[s]);
        }
        CHECK(epoch_union(many) == iota_ids(0, 100));
      }
}

TEST_CASE("data sharding with a global batch that does not divide among the workers still sees every sample once") {
  const std::vector<data::Dataset> ds = {numbered(41)};
  const auto many = run_job({3, 1, 10}, ds, 0);
  check_consistent(many);
  CHECK(epoch_union(many) == iota_ids(0, 41));
  // As tf.distribute splits 10 over 3: 4, 4 and 2.
  CHECK(many[0].steps[0][0].size() == 4);
  CHECK(many[1].steps[0][0].size() == 4);
  CHECK(many[2].steps[0][0].size() == 2);
}

TEST_CASE("data sharding: for any global batch, W workers' replicas take one process's replicas' rows of every step") {
  // Odd global batches, worker and replica counts, a short last batch and drop_remainder: the
  // replicas of all workers, in (worker, local replica) order, get exactly the rows one process's
  // replicas get (65 = 33 + 32 over 2 workers, 22 + 22 + 21 over 3; by replica, 17 + 17 + 17 + 14 over
  // 2 workers of 2).
  for (std::int64_t n : {41, 130, 2000})
    for (std::int64_t global : {7, 10, 65})
      for (int workers : {2, 3})
        for (int local : {1, 2})
          for (bool drop : {false, true}) {
            CAPTURE(n);
            CAPTURE(global);
            CAPTURE(workers);
            CAPTURE(local);
            CAPTURE(drop);
            const std::vector<data::Dataset> ds = {numbered(n)};
            const auto single = run_job({1, workers * local, global, config::DistributeMode::split_global_batch, drop}, ds, 2);
            const auto many = run_job({workers, local, global, config::DistributeMode::split_global_batch, drop}, ds, 2);
            check_consistent(many);
            const std::size_t steps = static_cast<std::size_t>(drop ? n / global : (n + global - 1) / global);
            REQUIRE(single[0].steps.size() == steps);
            REQUIRE(many[0].steps.size() == steps);
            for (std::size_t s = 0; s < steps; ++s) {
              CAPTURE(s);
              Step replicas;
              for (const WorkerEpoch& w : many) replicas.insert(replicas.end(), w.steps[s].begin(), w.steps[s].end());
              CHECK(replicas == single[0].steps[s]);
              CHECK(many[0].global_samples[s] == single[0].global_samples[s]);
            }
          }
}

TEST_CASE("file sharding and auto_shard off refuse a global batch the workers do not divide; data takes any") {
  config::DataConfig d;
  for (auto policy : {config::AutoShardPolicy::file, config::AutoShardPolicy::off}) {
    d.auto_shard = policy;
    d.shards = {"a.h5", "b.h5", "c.h5"};
    const data::ShardPlan plan = data::plan_shards(d, 2, 1);
    CHECK_NOTHROW(data::check_global_batch(plan, 64));
    try {
      data::check_global_batch(plan, 65);
      FAIL("expected ConfigError");
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      CHECK(what.find("data.global_batch_size 65 does not divide among the 2 workers") != std::string::npos);
      CHECK(what.find("data.auto_shard") != std::string::npos);
    }
    CHECK_NOTHROW(data::check_global_batch(data::plan_shards(d, 1, 0), 65));
  }
  d.auto_shard = config::AutoShardPolicy::data;
  CHECK_NOTHROW(data::check_global_batch(data::plan_shards(d, 2, 1), 65));
}

TEST_CASE("file sharding: workers with unequal shares run the same steps; the one that runs out gets empty batches") {
  const std::vector<data::Dataset> files = {numbered(30, 0), numbered(9, 1000), numbered(17, 2000)};
  for (bool drop : {false, true})
    for (auto mode : {config::DistributeMode::split_global_batch, config::DistributeMode::per_replica}) {
      CAPTURE(drop);
      Job job{3, 2, 12, mode, drop, false};
      const auto many = run_job(job, files, 1);
      check_consistent(many);
      // Each worker batches 4 a step (2 replicas of 2): the 30-sample worker needs 8 steps; only
      // 7 are full, but per_replica drops per replica batch of 2, so its 8th still has one.
      const bool split = mode == config::DistributeMode::split_global_batch;
      const int unit = split ? 4 : 2;
      CHECK(many[0].steps.size() == (drop && split ? 7u : 8u));
      CHECK(many[1].steps.back()[0].empty());
      CHECK(many[1].steps.back()[1].empty());
      std::vector<int> expected;
      for (const auto& [first, n] : std::vector<std::pair<int, int>>{{0, 30}, {1000, 9}, {2000, 17}}) {
        const int kept = drop ? n / unit * unit : n;
        std::set<int> seen;
        for (int id : epoch_union(many))
          if (id >= first && id < first + n) seen.insert(id);
        CHECK(static_cast<int>(seen.size()) == kept);
      }
      if (!drop) CHECK(epoch_union(many).size() == 56u);
    }
}

TEST_CASE("a multi-worker iterator resumes at step k, the exhausted worker included") {
  const std::vector<data::Dataset> files = {numbered(30, 0), numbered(9, 1000)};
  std::vector<std::int64_t> sizes = {30, 9};
  for (int w = 0; w < 2; ++w) {
    data::InputContext ctx{2, w, 2};
    data::PipelineOptions po;
    po.shuffle_buffer = 100;
    po.seed = 5;
    data::DistributedIterator it(files[static_cast<std::size_t>(w)], config::DistributeMode::split_global_batch, ctx, 8, po,
                                 [&](std::int64_t) { return sizes; });
    const auto all = run_epoch(it, 2);
    REQUIRE(all.steps.size() == 8);
    for (std::int64_t k : {1, 3, 7, 8}) {
      it.start_epoch(2, k);
      std::size_t s = static_cast<std::size_t>(k);
      while (const auto* batches = it.next()) {
        REQUIRE(s < all.steps.size());
        std::vector<int> got;
        for (std::int64_t i = 0; i < (*batches)[0].size; ++i) got.push_back(static_cast<int>((*batches)[0].x.data<float>()[i]));
        CHECK(got == all.steps[s][0]);
        CHECK(it.global_samples() == all.global_samples[s]);
        ++s;
      }
      CHECK(s == all.steps.size());
    }
    CHECK_THROWS_AS(it.start_epoch(2, 9), InputError);
  }
}

TEST_CASE("a global batch smaller than the workers, or sizes the peers were not told, are refused") {
  data::InputContext ctx{4, 1, 4};
  data::PipelineOptions po;
  const std::vector<std::int64_t> sizes = {3, 3, 2, 2};
  CHECK_THROWS_AS(data::DistributedIterator(numbered(10), config::DistributeMode::split_global_batch, ctx, 3, po,
                                            [&](std::int64_t) { return sizes; }),
                  ConfigError);
  CHECK_THROWS_AS(data::DistributedIterator(numbered(10), config::DistributeMode::split_global_batch, ctx, 8, po,
                                            [&](std::int64_t) { return sizes; }),
                  InternalError);
}

TEST_CASE("plan_shards resolves auto_shard as TensorFlow does") {
  config::DataConfig d;
  d.source = config::SourceKind::hdf5;
  d.shards = {"a.h5", "b.h5", "c.h5", "d.h5", "e.h5"};

  SUBCASE("auto: by file with at least one file per worker, else by data") {
    const data::ShardPlan by_file = data::plan_shards(d, 2, 1);
    CHECK(by_file.policy == config::AutoShardPolicy::file);
    CHECK(by_file.files == std::vector<std::string>{"b.h5", "d.h5"});
    CHECK(by_file.train_shard_count() == 1);
    CHECK(by_file.eval_shard_count() == 1);
    CHECK(by_file.note == "data.auto_shard auto: by file (5 shard files over 2 workers)");
    const data::ShardPlan by_data = data::plan_shards(d, 8, 3);
    CHECK(by_data.policy == config::AutoShardPolicy::data);
    CHECK(by_data.files == d.shards);
    CHECK(by_data.train_shard_count() == 8);
    CHECK(by_data.shard_index() == 3);
    CHECK(by_data.note.find("by data (5 shard files are fewer than the 8 workers") != std::string::npos);
    CHECK(data::plan_shards(d, 1, 0).note.empty());
  }
  SUBCASE("file: fewer files than workers is an error") {
    d.auto_shard = config::AutoShardPolicy::file;
    CHECK(data::plan_shards(d, 5, 4).files == std::vector<std::string>{"e.h5"});
    try {
      data::plan_shards(d, 6, 0);
      FAIL("expected ConfigError");
    } catch (const ConfigError& e) {
      CHECK(std::string(e.what()).find("5 shard files for 6 workers") != std::string::npos);
    }
  }
  SUBCASE("off: everything, its own shuffle per worker, a warning; evaluation still by data") {
    d.auto_shard = config::AutoShardPolicy::off;
    const data::ShardPlan off = data::plan_shards(d, 3, 2);
    CHECK(off.train_shard_count() == 1);
    CHECK(off.eval_shard_count() == 3);
    CHECK(off.train_seed(7) != 7);
    CHECK(data::plan_shards(d, 3, 0).train_seed(7) == 7);
    CHECK(off.warning.find("each of the 3 workers trains on the whole dataset") != std::string::npos);
  }
  SUBCASE("data: the same seed everywhere") {
    d.auto_shard = config::AutoShardPolicy::data;
    CHECK(data::plan_shards(d, 3, 2).train_seed(7) == 7);
    CHECK(data::plan_shards(d, 3, 2).eval_shard_count() == 3);
  }
}

TEST_CASE("shard files load concatenated in order; shards of different kinds are refused") {
  config::DataConfig d;
  d.source = config::SourceKind::hdf5;
  const std::string small = std::string(DTRAIN_SOURCE_DIR) + "/data/fashion_mnist_small.h5";
  d.shards = {small};
  const data::DataSplits one = data::load_splits(d, 0);
  const data::DataSplits two = data::load_splits(d, 0, {small, small});
  REQUIRE(two.train.size() == 2 * one.train.size());
  CHECK(two.test.size() == 2 * one.test.size());
  CHECK(two.train.num_classes == 10);
  const std::int64_t n = one.train.size(), row = 28 * 28;
  CHECK(std::equal(one.train.x.data<std::uint8_t>(), one.train.x.data<std::uint8_t>() + n * row,
                   two.train.x.data<std::uint8_t>() + n * row));
  CHECK(std::equal(one.train.y.data<std::int32_t>(), one.train.y.data<std::int32_t>() + n, two.train.y.data<std::int32_t>() + n));

  data::Dataset floats = numbered(4);
  CHECK_THROWS_AS(data::concatenate({one.train, floats}, "mixed"), InputError);
}

TEST_CASE("check_batch_reaches_workers: refuses a global batch that leaves a worker without samples") {
  const auto check = [](int workers, int local, bool shared, std::int64_t batch) {
    data::check_batch_reaches_workers(workers, local, shared, batch, "data.global_batch_size");
  };
  // Fewer samples than workers, whatever the order.
  CHECK_THROWS_WITH_AS(check(4, 1, false, 3), doctest::Contains("3 leaves some of the 4 workers without samples"),
                       ConfigError);
  // One shared order: 9 over 4 is 3, 3, 3, 0; 9 over 8 workers is 2 each to workers 0..4, none
  // to 5..7; 4 over 4 workers of 2 replicas is 1 to each of the first 4 replicas, so workers 2 and
  // 3 get none.
  CHECK_THROWS_WITH_AS(check(4, 1, true, 9), doctest::Contains("9 leaves worker 3 without samples"), ConfigError);
  CHECK_THROWS_WITH_AS(check(8, 1, true, 9), doctest::Contains("9 leaves workers 5..7 without samples"), ConfigError);
  CHECK_THROWS_WITH_AS(check(4, 2, true, 4), doctest::Contains("give a multiple of 8 (such as 8)"), ConfigError);
  // Each worker batching its own share (file sharding, auto_shard off for training): batch / workers.
  CHECK_NOTHROW(check(4, 1, false, 9));
  CHECK_NOTHROW(check(4, 1, true, 8));
  CHECK_NOTHROW(check(4, 1, true, 10));  // 3, 3, 3, 1
  CHECK_NOTHROW(check(2, 2, true, 5));   // 2, 2, 1, 0: worker 1 still has a row
  CHECK_NOTHROW(check(1, 3, true, 1));   // one worker: its replicas may go without
}
