// What a layer knows about the step it runs in: training or inference, which replica it is, and
// the keys of the step's random streams. A layer never knows the strategy or the backend; what it
// needs of the other replicas (synchronized batch statistics) comes through CrossReplica.
#pragma once

#include <cstdint>
#include <span>

namespace dtrain {
class SharedWork;
}

namespace dtrain::nn {

enum class Mode {
  training,   // dropout drops, batch normalization uses and updates batch statistics
  inference,  // evaluation and prediction: dropout is the identity, moving statistics are used
};

// Sums small vectors over every replica in sync (each replica of each worker). Every replica calls
// it the same number of times in the same order, also a replica that has no samples this step.
class CrossReplica {
 public:
  virtual ~CrossReplica() = default;
  virtual void all_reduce_sum(std::span<double> values, const char* what) = 0;
  // Seconds the caller has spent in these sums waiting for the others to arrive, over every sum so
  // far (0 where that is not measured). dtrain bench subtracts it from the layer that made the
  // sum: the time belongs to the imbalance of the layers before, not to this layer's work.
  virtual double waited_seconds() const { return 0.0; }
};

// dtrain bench's mark inside a layer's backward: a kernel that computes the gradients of its
// weights and then the gradient of its input calls weights_done() between the two, so that the
// bench can split the layer's backward time. Null except while a bench times the layers.
// A kernel that computes the input's gradient first calls input_done() instead.
class BackwardMarks {
 public:
  virtual ~BackwardMarks() = default;
  virtual void weights_done() = 0;
  virtual void input_done() = 0;
};

struct StepContext {
  Mode mode = Mode::inference;
  // Key of every per-step random stream: Rng streams are fixed by (seed, step, sample).
  std::uint64_t seed = 0;
  std::int64_t global_step = 0;
  // This replica among all replicas in sync (worker index * local replicas + local replica).
  int replica = 0;
  int replicas_in_sync = 1;
  // Samples of the whole step, over every replica (the global batch, or fewer on a short last one).
  std::int64_t step_samples = 0;
  // One id per sample of this replica's batch: its position in the epoch's order over all workers,
  // so that a sample's random draws do not depend on which replica or rank computes it. Empty
  // outside training.
  std::span<const std::int64_t> sample_ids;
  // The other replicas; null when this replica is alone (then a sum is its own values).
  CrossReplica* cross_replica = nullptr;
  // When the replica's batch is split over lanes (train.parallelism: batch), this lane's index and
  // the other lanes of its replica: together they are one replica, so a layer that keeps batch
  // statistics sums them over `lanes` (cross_replica then sums over the lanes and the replicas).
  // Null with one lane.
  int lane = 0;
  CrossReplica* lanes = nullptr;
  // Where a kernel may hand the items of a loop to the other lanes of its replica (worker `lane`,
  // core/shared_work.hpp). Null with one lane.
  SharedWork* shared_work = nullptr;
  // See BackwardMarks.
  BackwardMarks* backward_marks = nullptr;

  bool training() const { return mode == Mode::training; }
};

}  // namespace dtrain::nn
