// The loop of a strategy that schedules its own steps (distribute::Strategy::schedules_steps: a
// parameter-server coordinator dispatching steps to workers), and what the trainer lends it.
//
// Such a strategy's kind registers its loop here, from its own file (in train/strategies/, as the
// loop needs the trainer's pieces, which distribute/ may not see), as its strategy file
// registered the strategy (distribute/strategy.hpp: StrategyPlacement::own_loop). Trainer::fit()
// then hands the loop a LoopHost instead of running its own: the loop reaches the trainer only
// through it, never its members.
//
// In train/strategies/<kind>_loop.cpp (before main):
//   const StrategyLoopRegistration registered(MyOptions::kind, &make_my_loop);
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string_view>
#include <vector>

#include "config/experiment.hpp"
#include "core/error.hpp"
#include "data/distributed.hpp"
#include "device/numerics.hpp"
#include "distribute/strategy.hpp"
#include "metrics/metric.hpp"
#include "nn/model.hpp"
#include "optim/optimizer.hpp"
#include "train/callbacks.hpp"
#include "train/epoch_log.hpp"

namespace dtrain::train {

// The trainer as a strategy's own loop sees it. Such a strategy has one replica per process:
// "the replica" is it.
class LoopHost {
 public:
  virtual ~LoopHost() = default;

  virtual const config::Experiment& experiment() const = 0;
  virtual distribute::Strategy& strategy() = 0;
  // Where the epoch lines go (nowhere on a process that does not print).
  virtual std::FILE* out() const = 0;

  // ---- the replica's pieces
  virtual nn::Sequential& replica_model() = 0;
  virtual optim::Optimizer& replica_optimizer() = 0;
  virtual device::Numerics& replica_numerics() = 0;
  // Training metric `index` of this process (every lane's counts), and a state merged into it.
  virtual metrics::MetricState train_metric_state(std::size_t index) const = 0;
  virtual void merge_train_metric(std::size_t index, const metrics::MetricState& state) = 0;

  // ---- input
  // From now on this process reads its share of the data as worker `index` of `workers` (auto_shard
  // as across worker processes); ConfigError naming the experiment when the data cannot be split so.
  virtual void read_input_share(int workers, int index) = 0;
  // The training split's iterator (this process's share of it).
  virtual std::unique_ptr<data::DistributedIterator> training_input() = 0;
  // train.steps_per_epoch over `input` as the trainer's loop counts it; ConfigError when an
  // epoch would have no step.
  virtual std::int64_t steps_per_epoch(const data::DistributedIterator& input) const = 0;

  // ---- steps
  // One training step of the replica on `batches` (of `samples` samples in all) as global step
  // `global_step`: its gradients and its loss (returned) and metrics (reset first), nothing applied
  // (the strategy's update() says where updates go).
  virtual double run_step(const std::vector<data::ReplicaBatch>& batches, std::int64_t samples,
                          std::int64_t global_step) = 0;
  virtual std::int64_t global_step() const = 0;
  virtual void set_global_step(std::int64_t step) = 0;

  // ---- epochs
  // The epoch training starts at (a resumed run's).
  virtual int first_epoch() const = 0;
  // The trainer's callbacks, seeing `stop_requested` as the stop request (a loop that must drain
  // its steps first passes the request on itself).
  virtual CallbackList make_callbacks(const std::atomic<int>* stop_requested) = 0;
  // The request to stop at the next step boundary (a signal); may be null.
  virtual const std::atomic<int>* stop_requested() const = 0;
  // Where epoch state.epoch starts (a resumed one where the checkpoint stood), and its figures
  // when it is done (loss, metrics, validation, test), as the trainer's loop has them.
  virtual void begin_epoch(LoopState& state, data::DistributedIterator& input) = 0;
  virtual EpochLog end_epoch(const LoopState& state, double train_seconds) = 0;

 protected:
  LoopHost() = default;
  LoopHost(const LoopHost&) = default;
  LoopHost& operator=(const LoopHost&) = default;
};

class StrategyLoop {
 public:
  virtual ~StrategyLoop() = default;
  // This process's part of training: the epochs' logs where they are printed, nothing elsewhere.
  // Throws Interrupted (callbacks.hpp) when stopped on request.
  virtual std::vector<EpochLog> fit(LoopHost& host) = 0;
};

using StrategyLoopFactory = std::unique_ptr<StrategyLoop> (*)(distribute::Strategy& strategy);

struct StrategyLoopRegistration {
  // InternalError when `kind` already has a loop (a programming error).
  StrategyLoopRegistration(std::string_view kind, StrategyLoopFactory factory);
};

// The loop of `kind` over `strategy`; InternalError when the kind registered none.
std::unique_ptr<StrategyLoop> make_strategy_loop(std::string_view kind, distribute::Strategy& strategy);

// The strategy as its kind's own class, for the loop its kind registered.
template <class S>
S& strategy_as(distribute::Strategy& strategy) {
  S* typed = dynamic_cast<S*>(&strategy);
  DTRAIN_CHECK(typed != nullptr, "a strategy loop given another kind's strategy");
  return *typed;
}

}  // namespace dtrain::train
