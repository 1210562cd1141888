// tf.distribute.InputContext: what a per-replica input function is told about its place in the
// job, so it can shard and batch for its share.
#pragma once

#include <cstdint>

#include <fmt/format.h>

#include "core/error.hpp"

namespace dtrain::data {

struct InputContext {
  int num_input_pipelines = 1;  // one per worker process
  int input_pipeline_id = 0;
  int num_replicas_in_sync = 1;

  // The batch each replica gets from a global batch; the global batch must divide evenly (as in
  // TensorFlow), since per-replica pipelines cannot split a remainder.
  std::int64_t get_per_replica_batch_size(std::int64_t global_batch_size) const {
    if (num_replicas_in_sync < 1 || global_batch_size % num_replicas_in_sync != 0)
      throw ConfigError(fmt::format(
          "the global batch size {} does not divide among {} replicas in sync; choose a multiple of {}",
          global_batch_size, num_replicas_in_sync, num_replicas_in_sync));
    return global_batch_size / num_replicas_in_sync;
  }
};

}  // namespace dtrain::data
