#include "data/sharding.hpp"

#include <fmt/format.h>

#include "config/parse.hpp"
#include "core/checked.hpp"
#include "core/error.hpp"
#include "data/pipeline.hpp"

namespace dtrain::data {

std::uint64_t ShardPlan::train_seed(std::uint64_t seed) const {
  if (policy != config::AutoShardPolicy::off || worker == 0) return seed;
  // A fixed odd multiplier spreads the worker index over all bits; worker 0 keeps the seed, so
  // one worker trains exactly as a single process would.
  return seed ^ (0x9E3779B97F4A7C15ull * static_cast<std::uint64_t>(worker));
}

ShardPlan plan_shards(const config::DataConfig& data, int workers, int worker) {
  DTRAIN_CHECK(workers >= 1 && worker >= 0 && worker < workers, "worker index outside the world");
  ShardPlan plan;
  plan.workers = workers;
  plan.worker = worker;
  const auto files = static_cast<int>(data.shards.size());
  switch (data.auto_shard) {
    case config::AutoShardPolicy::auto_select:
      plan.policy = files >= workers && files > 0 ? config::AutoShardPolicy::file : config::AutoShardPolicy::data;
      if (workers > 1)
        plan.note = plan.policy == config::AutoShardPolicy::file
                        ? fmt::format("data.auto_shard auto: by file ({} shard files over {} workers)", files, workers)
                    : files > 0 ? fmt::format("data.auto_shard auto: by data ({} shard files are fewer than the {} "
                                              "workers, so each worker keeps 1 sample in {})",
                                              files, workers, workers)
                                : fmt::format("data.auto_shard auto: by data (each worker keeps 1 sample in {} of "
                                              "the shuffled order)",
                                              workers);
      break;
    case config::AutoShardPolicy::file:
      if (files < workers)
        throw ConfigError(fmt::format("data.auto_shard file: {} shard files for {} workers; every worker needs at least "
                                      "one file (split the data into more files with tools/make_shards, run fewer "
                                      "ranks, or write auto_shard: data)",
                                      files, workers));
      plan.policy = config::AutoShardPolicy::file;
      break;
    case config::AutoShardPolicy::data:
      plan.policy = config::AutoShardPolicy::data;
      break;
    case config::AutoShardPolicy::off:
      plan.policy = config::AutoShardPolicy::off;
      if (workers > 1)
        plan.warning = fmt::format("dtrain: warning: data.auto_shard off: each of the {} workers trains on the whole "
                                "dataset, so an epoch shows every sample {} times (each worker in its own order); "
                                "write auto_shard: data to give each worker its own share",
                                workers, workers);
      break;
  }
  if (plan.policy == config::AutoShardPolicy::file) {
    for (int f = worker; f < files; f += workers) plan.files.push_back(data.shards[static_cast<std::size_t>(f)]);
  } else {
    plan.files = data.shards;
  }
  return plan;
}

void check_global_batch(const ShardPlan& plan, std::int64_t global_batch) {
  if (plan.workers < 2 || plan.policy == config::AutoShardPolicy::data || global_batch % plan.workers == 0) return;
  const bool file = plan.policy == config::AutoShardPolicy::file;
  throw ConfigError(fmt::format(
      "data.global_batch_size {} does not divide among the {} workers, and under data.auto_shard {} each worker "
      "batches only {}, so their batches cannot make up the global batch one process takes; choose a "
      "data.global_batch_size that is a multiple of {}, or data.auto_shard: data",
      global_batch, plan.workers, file ? "file" : "off", file ? "its own files" : "its own order of the data",
      plan.workers));
}

void check_batch_reaches_workers(int workers, int local_replicas, bool shared_order, std::int64_t batch,
                                 std::string_view key) {
  if (batch < workers)
    throw ConfigError(fmt::format("{} {} leaves some of the {} workers without samples; give a global batch of at "
                                  "least {} (one sample per worker), or run fewer ranks",
                                  key, batch, workers, workers));
  if (!shared_order) return;  // each worker batches its own share, batch / workers
  // Over one shared order worker w keeps its replicas' rows of the whole batch (replica_offset's
  // split): the first worker whose first row lies past the batch gets none, nor do those after it.
  const int in_sync = workers * local_replicas;
  int first_empty = workers;
  while (first_empty > 0 && replica_offset(batch, in_sync, (first_empty - 1) * local_replicas) >= batch) --first_empty;
  if (first_empty == workers) return;
  const std::int64_t each = ceil_div(batch, static_cast<std::int64_t>(in_sync));
  throw ConfigError(fmt::format("{} {} leaves worker{} {} without samples: a global batch is split as tf.distribute "
                                "splits it, {} rows to each of the {} replicas in sync in turn, and the batch runs out "
                                "first; give a multiple of {} (such as {}), or run fewer ranks",
                                key, batch, first_empty + 1 == workers ? "" : "s",
                                first_empty + 1 == workers ? fmt::format("{}", first_empty)
                                                           : fmt::format("{}..{}", first_empty, workers - 1),
                                each, in_sync, in_sync, each * in_sync));
}

}  // namespace dtrain::data
