#include "train/lanes.hpp"

#include <algorithm>
#include <vector>

#include "data/pipeline.hpp"

namespace dtrain::train {

namespace {

std::vector<distribute::ReplicaContext> lane_contexts(int count) {
  std::vector<distribute::ReplicaContext> contexts(static_cast<std::size_t>(count));
  for (int lane = 0; lane < count; ++lane) {
    contexts[static_cast<std::size_t>(lane)].replica_id = lane;
    contexts[static_cast<std::size_t>(lane)].num_replicas_in_sync = count;
    contexts[static_cast<std::size_t>(lane)].global_replica_id = lane;
  }
  return contexts;
}

}  // namespace

Lanes::Lanes(int count)
    : group_(count, distribute::CrossDeviceOp::reduction_to_one_device),
      shared_work_(count),
      threads_(lane_contexts(count), /*threads_per_replica=*/1, group_.barrier(),
               distribute::ReplicaThreads::CallerRuns::first_replica),
      run_task_([this](const distribute::ReplicaContext& lane) { call_(task_, lane.replica_id); }) {}

void Lanes::run_erased(void* fn, void (*call)(void*, int)) {
  task_ = fn;
  call_ = call;
  threads_.run(run_task_);
  task_ = nullptr;
}

Lanes::Rows Lanes::rows(std::int64_t rows, int lane) const {
  return {data::part_offset(rows, size(), lane), data::part_offset(rows, size(), lane + 1)};
}

void LanesThenReplicas::all_reduce_sum(std::span<double> values, const char* what) {
  distribute::ThreadCommunicator& lanes = lanes_.endpoint(lane_);
  lanes.all_reduce_sum(values, what);
  if (lane_ == 0) replicas_.all_reduce_sum(values, what);
  lanes.broadcast(values, 0, what);
}

void MicroBatchStatistics::all_reduce_sum(std::span<double> values, const char* what) {
  const std::size_t n = values.size();
  slots_.assign(n * static_cast<std::size_t>(micro_batches_), 0.0);
  if (micro_batch_ >= 0)
    std::copy(values.begin(), values.end(), slots_.begin() + static_cast<std::ptrdiff_t>(n * static_cast<std::size_t>(micro_batch_)));
  inner_.all_reduce_sum(slots_, what);
  for (std::size_t j = 0; j < n; ++j) {
    double sum = 0.0;
    for (std::size_t k = 0; k < static_cast<std::size_t>(micro_batches_); ++k) sum += slots_[k * n + j];
    values[j] = sum;
  }
}

}  // namespace dtrain::train
