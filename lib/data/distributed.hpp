// Distributed input: one step's batch for every replica in sync.
//
//   split_global_batch (tf.distribute experimental_distribute_dataset): one pipeline makes global
//     batches; each is split as evenly as possible, in order (with n samples and R replicas the
//     first n % R replicas get one more), as views (no copy). On a short last batch some replicas
//     get fewer samples or none. With several input pipelines (workers) every one makes the same
//     global batches from the same seed and keeps its own replicas' rows: no sample is read twice
//     and the replicas together see exactly what one process would.
//   per_replica (distribute_datasets_from_function): one pipeline per input pipeline, batched
//     with InputContext::get_per_replica_batch_size(global batch); each step hands consecutive
//     batches to the replicas in order. At the end of an epoch the last replicas may get none.
//
// With the same seed and full batches both modes give replica r the same samples in the same
// order; the state of either is (epoch, step), as for the Pipeline.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "config/experiment.hpp"
#include "core/tensor.hpp"
#include "data/dataset.hpp"
#include "data/input_context.hpp"
#include "data/pipeline.hpp"

namespace dtrain::data {

struct ReplicaBatch {
  Tensor x, y;            // (size, ...) views or replica-owned buffers; undefined when size == 0
  std::int64_t size = 0;
};

class DistributedIterator {
 public:
  // options.batch_size is ignored. per_replica mode needs global_batch to divide evenly.
  DistributedIterator(const Dataset& dataset, config::DistributeMode mode, const InputContext& context,
                      std::int64_t global_batch, PipelineOptions options);

  std::int64_t steps_per_epoch() const { return steps_; }
  std::int64_t global_batch_size() const { return global_batch_; }
  void start_epoch(std::int64_t epoch, std::int64_t first_step = 0);
  // The next step's batches, one per replica of this input pipeline (some may be empty); nullptr
  // at the end of the epoch. Valid until the next call.
  const std::vector<ReplicaBatch>* next();
  // Samples of the last step over every replica in sync, all input pipelines included (known
  // without communication in split_global_batch mode; per_replica mode knows its own only).
  std::int64_t global_samples() const { return global_samples_; }

 private:
  config::DistributeMode mode_;
  int replicas_;        // this pipeline's replicas
  int first_replica_;   // the global index of this pipeline's first replica
  int replicas_in_sync_;
  std::int64_t global_samples_ = 0;
  std::int64_t global_batch_, steps_ = 0;
  std::unique_ptr<Pipeline> pipeline_;
  std::vector<ReplicaBatch> out_;
  std::vector<Tensor> own_x_, own_y_;  // per_replica mode: each replica's copy of its batch
};

}  // namespace dtrain::data
