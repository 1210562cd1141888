// The input pipeline: shuffle (tf.data shuffle(buffer_size) semantics over sample indices),
// batch, convert to f32, and optionally prepare the next batch on a background thread.
//
// Batch shapes: x (b, ...dataset feature dims) f32 = dataset x * x_scale;
//               y (b,) i32 labels or (b, k) f32 targets; b = batch_size except a short last batch.
//
// Iterator state is (epoch, step): the order of epoch e comes from Rng(seed, shuffle, e) alone,
// so start_epoch(e, k) resumes exactly where a run that iterated k batches of epoch e stood.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "core/tensor.hpp"
#include "data/dataset.hpp"

namespace dtrain::data {

// The sample order of one epoch, as tf.data's shuffle(buffer) would produce it: a buffer holds the
// first `buffer` indices; each output takes a uniformly random slot and refills it with the next
// input index; once the input is exhausted the buffer drains in random order. buffer >= size is a
// uniform permutation; buffer <= 1 is the identity. Draws from Rng(seed, RngStream::shuffle, epoch).
// Kept separate from Pipeline so sharding (every k-th sample of this order) can reuse it.
std::vector<std::int64_t> shuffle_order(std::int64_t size, std::int64_t buffer, std::uint64_t seed, std::int64_t epoch);

struct PipelineOptions {
  std::int64_t batch_size = 32;
  std::int64_t shuffle_buffer = 0;  // 0 or 1 = dataset order
  bool drop_remainder = false;
  std::uint64_t seed = 0;
  bool prefetch = true;
  // tf.data Dataset.shard(shard_count, shard_index) after the shuffle: keep every shard_count-th
  // sample of the epoch's order, starting at position shard_index. Workers that share a seed and
  // take shards 0..count-1 together see every sample once per epoch, none twice.
  int shard_count = 1;
  int shard_index = 0;
  // A part of every batch (multi-worker split_global_batch over one shared order): batch_size is
  // the global batch, each batch is divided over `parts` replicas as one process divides it over
  // its replicas (replica_offset), and this pipeline keeps the rows of replicas
  // [part_begin, part_end). The default keeps whole batches.
  int parts = 1;
  int part_begin = 0;
  int part_end = 1;
  // The rows every part boundary falls on (reproducibility: replica_invariant's micro-batch size):
  // the batch is divided in units of `part_granule` rows (the last one short when the batch is),
  // each part taking whole units. 1 = row by row. It also divides the batches of the iterators
  // (data/distributed.hpp) over their replicas.
  std::int64_t part_granule = 1;
};

// The first row of part `part` when `size` rows are divided over `parts` as evenly as possible,
// the first parts one more: in rows (granule 1) or in whole units of `granule` rows, the last unit
// short when size is not a multiple of it. For work shared by a replica's threads.
std::int64_t part_offset(std::int64_t size, int parts, int part, std::int64_t granule = 1);

// The first row of replica `replica`'s rows when a batch of `size` rows is split over `replicas`
// replicas in sync, as tf.distribute's experimental_distribute_dataset splits a global batch
// (measured with TensorFlow 2.21, docs/strategies.md): ceil(size / replicas) rows each, in replica
// order, until the batch runs out,
// so the last replicas may get fewer or none (64 over 3: 22, 22, 20; 9 over 4: 3, 3, 3, 0). In rows
// (granule 1) or in whole units of `granule` rows (replica_invariant's micro-batches), the last
// unit short when size is not a multiple of it.
std::int64_t replica_offset(std::int64_t size, int replicas, int replica, std::int64_t granule = 1);

struct Batch {
  Tensor x;
  Tensor y;
  // Per sample: its position in the epoch's order over every shard (shard_count * position in this
  // shard + shard_index), the same for a sample whichever worker or replica takes it. It keys the
  // sample's random draws (dropout masks).
  std::vector<std::int64_t> ids;
  std::int64_t size = 0;  // samples in this batch (== x.shape()[0]); this part's under options.parts
  std::int64_t step = 0;  // 0-based index of this batch in its epoch
};

class Pipeline {
 public:
  // Keeps a shallow copy of `dataset` (tensors share storage). Throws ConfigError on a batch size < 1.
  Pipeline(const Dataset& dataset, PipelineOptions options);
  ~Pipeline();
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  // Samples per epoch: the dataset's, or this shard's share of it (with parts: of every part).
  std::int64_t size() const;
  std::int64_t steps_per_epoch() const;
  const PipelineOptions& options() const { return options_; }

  // Starts epoch `epoch` at batch `first_step` (0 <= first_step <= steps_per_epoch()); stops any
  // batch still being prepared for the previous epoch.
  void start_epoch(std::int64_t epoch, std::int64_t first_step = 0);

  // The next batch of the current epoch, or nullptr at its end. The batch stays valid until the
  // following next() or start_epoch(); copy its tensors' contents to keep them longer.
  const Batch* next();

 private:
  void fill(Batch& batch, std::int64_t step) const;
  void stop_worker();
  void worker_loop();

  Dataset dataset_;
  PipelineOptions options_;
  std::vector<std::int64_t> order_;
  std::int64_t epoch_steps_ = 0;
  bool started_ = false;

  // Two slots: the caller reads slot (k % 2) while the worker fills slot ((k + 1) % 2).
  Batch slots_[2];
  std::int64_t delivered_ = 0;  // next step next() hands out (== steps handed out so far)

  // Prefetch handoff. The worker may fill step s only when s <= delivered_ (the slot it writes
  // then belongs to a batch the caller has released); next() waits until prepared_ > delivered_.
  std::thread worker_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::int64_t prepared_ = 0;  // steps [.., prepared_) are ready in their slots
  bool stop_ = false;
  std::exception_ptr worker_error_;
};

}  // namespace dtrain::data
