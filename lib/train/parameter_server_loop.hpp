// The three loops of ParameterServerStrategy (distribute/parameter_server.hpp), one per role, run
// by Trainer::fit() in place of its own loop:
//
//   coordinator (the chief)  schedules steps_per_epoch steps per epoch over the workers, at most
//       kInFlightPerWorker each (ClusterCoordinator.schedule), folds each step's loss and exact
//       metric counts into the epoch's figures as results arrive, and at the end of the epoch
//       (join: every scheduled step done) reads the variables back from the servers, evaluates
//       the test split once on them and prints the epoch lines. Checkpoints are written only where
//       no step is in flight (the scheduling stops at each checkpoint.every_steps boundary, and a
//       stop request lets the steps in flight finish first), so a checkpoint's "continue at step
//       k" has exactly k steps' updates in it. A worker that has not answered for
//       communication.timeout_seconds is marked lost; its unfinished steps go to the others.
//   worker  for each order: pull the variables from every server, run one batch of its own input
//       (auto_shard as multi_worker_mirrored), push the gradients (and the moving statistics'
//       changes) to the servers, report.
//   server  holds its shards and their optimizer slots; applies each push at once.
#pragma once

#include <vector>

#include "train/report.hpp"

namespace dtrain::train {

class Trainer;

class ParameterServerLoop {
 public:
  static constexpr int kInFlightPerWorker = 2;
  explicit ParameterServerLoop(Trainer& trainer) : t_(trainer) {}
  // This rank's part; the epochs' logs on the chief, nothing elsewhere.
  std::vector<EpochLog> fit();

 private:
  std::vector<EpochLog> coordinate();
  void work();
  void serve();
  Trainer& t_;
};

}  // namespace dtrain::train
