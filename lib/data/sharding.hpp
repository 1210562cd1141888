// Which part of the experiment's data one worker of a multi-worker job reads: the auto_shard
// policy (tf.data.experimental.AutoShardPolicy) resolved for this worker.
//
//   file  worker w of W loads the shard files w, w + W, w + 2W, ... whole (more files than
//         workers is fine; fewer is an error, as in TensorFlow)
//   data  every worker loads everything and keeps every W-th sample of the same shuffled order,
//         starting at its index (the pipeline's shard option)
//   off   every worker loads and trains on everything, in its own shuffled order, so an epoch
//         shows each sample W times; evaluation still splits the test set by data
//   auto  file when data.shards lists at least W files, else data
//
// Evaluation always covers each test sample exactly once over all workers: by its own files
// under file, by data otherwise.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "config/experiment.hpp"

namespace dtrain::data {

struct ShardPlan {
  config::AutoShardPolicy policy = config::AutoShardPolicy::off;  // file, data or off (auto resolved)
  int workers = 1;
  int worker = 0;
  // source hdf5 with data.shards: the files this worker loads (its own under file, else all).
  std::vector<std::string> files;
  // For the chief to print when there are several workers: what auto chose; off's warning.
  std::string note, warning;

  // The pipeline shard (count, index) for training and for evaluation.
  int train_shard_count() const { return policy == config::AutoShardPolicy::data ? workers : 1; }
  int eval_shard_count() const { return policy == config::AutoShardPolicy::file ? 1 : workers; }
  int shard_index() const { return worker; }
  // Under off every worker shuffles with its own seed, so their batches differ.
  std::uint64_t train_seed(std::uint64_t seed) const;
};

// Throws ConfigError when auto_shard file has fewer files than workers.
ShardPlan plan_shards(const config::DataConfig& data, int workers, int worker);

// Under file sharding or auto_shard off each worker batches only its own data, so a global batch
// the workers do not divide cannot be split as one process splits it (under data every worker
// holds the whole order and any global batch works). Throws ConfigError naming the keys then.
void check_global_batch(const ShardPlan& plan, std::int64_t global_batch);
// Throws ConfigError when a global batch of `batch` (`key` names it) leaves one of `workers`
// without samples: fewer samples than workers, or, where the workers share one order of the data
// (`shared_order`: ShardPlan's train_shard_count() or eval_shard_count() above 1), a split over
// their `local_replicas` replicas each (data/pipeline.hpp's replica_offset) that runs out first.
void check_batch_reaches_workers(int workers, int local_replicas, bool shared_order, std::int64_t batch,
                                 std::string_view key);

}  // namespace dtrain::data
