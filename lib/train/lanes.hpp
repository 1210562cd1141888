// The lanes of one replica (train.parallelism: batch): each of the replica's compute threads takes
// a slice of the replica's batch through its own copy of the model's activations, with one OpenMP
// thread, the way two ranks use two cores. The lanes share the replica's variables; their
// gradients are summed into lane 0's (the replica's), and layers that keep batch statistics
// combine them over the lanes (StepContext::lanes), so together the lanes compute what one thread
// computes on the whole batch, up to the order of float additions.
//
// Why: oneDNN's primitives on a small model split each layer across the OpenMP team, meet at a
// barrier per primitive and spin while they wait. On two cores that wasted most of the second
// core, and with another busy process on the machine the spinning threads collapsed a run to a
// tenth of its speed. Lanes meet twice per step, spin a few microseconds at most, then block.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "core/shared_work.hpp"
#include "distribute/replica_threads.hpp"
#include "distribute/strategy.hpp"
#include "distribute/thread_group.hpp"
#include "nn/step.hpp"

namespace dtrain::train {

class Lanes {
 public:
  // count >= 2 lanes, each with one OpenMP thread and FTZ/DAZ set (core/compute_thread.hpp):
  // lane 0 is the thread calling run() (its OpenMP thread count is 1 while it runs the lane), the
  // others have threads of their own.
  explicit Lanes(int count);
  int size() const { return group_.size(); }

  // Runs fn(lane) on every lane and returns when all have finished; the first exception of a lane
  // is rethrown here (the other lanes are released from any sum they wait in). fn is called
  // through a pointer, never copied into a std::function: a step allocates nothing.
  template <class Fn>
  void run(Fn& fn) {
    run_erased(&fn, [](void* f, int lane) { (*static_cast<Fn*>(f))(lane); });
  }
  // Inside run(): lane's endpoint of the lanes' sums (in lane order, deterministic).
  distribute::ThreadCommunicator& endpoint(int lane) { return group_.endpoint(lane); }
  // Inside run(): where a lane's kernels hand the items of a loop to the other lanes (lane = worker).
  SharedWork& shared_work() { return shared_work_; }

  // Rows [begin, end) of a batch of `rows` that `lane` computes: the first rows % lanes lanes take
  // one row more, as the replicas split a global batch.
  struct Rows {
    std::int64_t begin = 0, end = 0;
    std::int64_t size() const { return end - begin; }
  };
  Rows rows(std::int64_t rows, int lane) const;

 private:
  void run_erased(void* fn, void (*call)(void*, int));

  distribute::ThreadGroup group_;
  SharedWork shared_work_;
  distribute::ReplicaThreads threads_;
  void* task_ = nullptr;
  void (*call_)(void*, int) = nullptr;
  distribute::Strategy::ReplicaFn run_task_;  // built once: calls the task on each lane
};

// What a lane's layers reach of the other lanes: batch statistics summed over the lanes.
class LaneStatistics final : public nn::CrossReplica {
 public:
  LaneStatistics(Lanes& lanes, int lane) : lanes_(lanes), lane_(lane) {}
  void all_reduce_sum(std::span<double> values, const char* what) override {
    lanes_.endpoint(lane_).all_reduce_sum(values, what);
  }
  double waited_seconds() const override { return lanes_.endpoint(lane_).waited_seconds(); }

 private:
  Lanes& lanes_;
  int lane_;
};

// Synchronized layers under lanes: the sum over the replica's lanes, then (lane 0 for them all)
// over every replica in sync, copied back to every lane.
class LanesThenReplicas final : public nn::CrossReplica {
 public:
  LanesThenReplicas(Lanes& lanes, int lane, nn::CrossReplica& replicas) : lanes_(lanes), lane_(lane), replicas_(replicas) {}
  void all_reduce_sum(std::span<double> values, const char* what) override;

 private:
  Lanes& lanes_;
  int lane_;
  nn::CrossReplica& replicas_;
};

// Synchronized layers under reproducibility: replica_invariant, where each lane computes one
// micro-batch: the micro-batch's values go to its own slot of a vector with one slot per
// micro-batch of the step, the vectors are summed over the lanes and replicas (`inner`, every slot
// then holds one term plus zeros: exact in any order) and each lane adds the slots up in
// micro-batch order. The sum is then the same whichever lane, replica or rank held which
// micro-batch.
class MicroBatchStatistics final : public nn::CrossReplica {
 public:
  explicit MicroBatchStatistics(nn::CrossReplica& inner) : inner_(inner) {}
  // This step: the lane's micro-batch (-1 when it has none) among the step's `micro_batches`.
  void set_step(std::int64_t micro_batch, std::int64_t micro_batches) {
    micro_batch_ = micro_batch;
    micro_batches_ = micro_batches;
  }
  void all_reduce_sum(std::span<double> values, const char* what) override;

 private:
  nn::CrossReplica& inner_;
  std::int64_t micro_batch_ = -1, micro_batches_ = 0;
  std::vector<double> slots_;
};

}  // namespace dtrain::train
