// Distributed input: one step's batch for every replica in sync.
//
// Each worker (input pipeline) holds its share of the data: a shard of the shuffled order, its
// own files, or everything (see data/sharding.hpp). Its pipeline makes the worker's batches,
// and this iterator hands them to the worker's local replicas:
//
//   split_global_batch (tf.distribute experimental_distribute_dataset): each global batch is
//     split over the replicas in sync as one process splits it over its replicas (ceil(G / R)
//     each in turn, as tf.distribute does: replica_offset), and each worker keeps its replicas'
//     rows, split over its local replicas in order as views (no copy). Under data sharding every
//     worker holds the same shuffled order, so for every G and W the workers' rows of step k
//     together are exactly one process's batch k, in the same replica order. When each worker
//     holds its own data (file sharding, auto_shard off) worker w batches its own share by G / W
//     (the first G % W workers one more), and the trainer refuses a G the workers do not divide.
//   per_replica (distribute_datasets_from_function): the worker's pipeline is batched with
//     InputContext::get_per_replica_batch_size(G); each step hands its local replicas consecutive
//     batches in order. At the end of an epoch the last replicas may get none.
//
// Every worker runs the same number of steps per epoch: the most any worker needs. A worker
// whose share is used up before that gives its replicas empty batches, so the collectives of a
// step never wait for a worker that has stopped. Every worker knows the sample count of each
// worker's share (pipeline_samples), so the samples of a whole step, which the loss is divided
// by, are known everywhere without communication.
//
// With the same seed and full batches both modes give replica r the same samples in the same
// order; the state of either is (epoch, step), as for the Pipeline.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "config/experiment.hpp"
#include "core/tensor.hpp"
#include "data/dataset.hpp"
#include "data/input_context.hpp"
#include "data/pipeline.hpp"

namespace dtrain::data {

struct ReplicaBatch {
  Tensor x, y;            // (size, ...) views or replica-owned buffers; undefined when size == 0
  std::span<const std::int64_t> ids;  // the samples' ids (data/pipeline.hpp's Batch::ids)
  std::int64_t size = 0;
};

class DistributedIterator {
 public:
  // Given this pipeline's samples per epoch, every input pipeline's, in input_pipeline_id order
  // (an all-gather across the workers).
  using ShareSizes = std::function<std::vector<std::int64_t>(std::int64_t)>;

  // options.batch_size is ignored (it follows from global_batch and the context); options' shard
  // fields say which part of `dataset` this worker reads. share_sizes is needed with several
  // input pipelines; with one it may be empty. per_replica mode needs global_batch to divide
  // among the replicas in sync.
  DistributedIterator(const Dataset& dataset, config::DistributeMode mode, const InputContext& context,
                      std::int64_t global_batch, PipelineOptions options, const ShareSizes& share_sizes = {});

  std::int64_t steps_per_epoch() const { return steps_; }
  std::int64_t global_batch_size() const { return global_batch_; }
  void start_epoch(std::int64_t epoch, std::int64_t first_step = 0);
  // The next step's batches, one per replica of this input pipeline (some may be empty); nullptr
  // at the end of the epoch. Valid until the next call.
  const std::vector<ReplicaBatch>* next();
  // Samples of the last step over every replica in sync, all input pipelines included.
  std::int64_t global_samples() const { return global_samples_; }

 private:
  // The batch input pipeline `pipeline` makes (per replica in per_replica mode).
  std::int64_t pipeline_batch_of(int pipeline) const;
  // What a pipeline holding `samples`, batched by `batch`, contributes at `step`; its steps.
  std::int64_t samples_at(std::int64_t samples, std::int64_t batch, std::int64_t step) const;
  std::int64_t steps_of(std::int64_t samples, std::int64_t batch) const;

  config::DistributeMode mode_;
  int replicas_;  // this pipeline's replicas
  std::int64_t global_batch_;
  std::vector<std::int64_t> pipeline_samples_;
  std::int64_t steps_ = 0, step_ = 0;
  std::int64_t global_samples_ = 0;
  // split_global_batch with data sharding: every worker batches the whole order by the global
  // batch and keeps its replicas' rows; pipeline_samples_ then holds that one order's size.
  bool whole_order_ = false;
  std::unique_ptr<Pipeline> pipeline_;
  std::vector<ReplicaBatch> out_;
  std::vector<Tensor> own_x_, own_y_;  // per_replica mode: each replica's copy of its batch
  std::vector<std::vector<std::int64_t>> own_ids_;
};

}  // namespace dtrain::data
