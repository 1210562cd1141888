// What happens around the training loop, as Keras callbacks (on_train_batch_end, on_epoch_end,
// ...): checkpoints, the agreement to stop on a signal, the end on a non-finite loss and a test's
// hold, and the seam where what observes the run (observe/: progress, metrics.jsonl, TensorBoard,
// curves) is added. fit() stays the custom-loop template — for each epoch, for each batch run the
// step, then test, then print — and calls these at the template's seams, in the order they were
// added.
//
// Every worker runs the same callbacks at the same points: a callback that makes a collective
// (the stop agreement, a checkpoint's metric merge) is thereby entered by every worker together.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "config/experiment.hpp"
#include "core/error.hpp"
#include "distribute/strategy.hpp"
#include "train/epoch_log.hpp"

namespace dtrain::train {

class Trainer;

// Where the loop stands, and what callbacks tell it.
struct LoopState {
  int epoch = 0;                 // 0-based, the epoch running
  std::int64_t step = 0;         // steps of this epoch done
  std::int64_t steps = 0;        // steps per epoch
  std::int64_t global_step = 0;  // steps done in the whole run
  double loss_sum = 0.0;         // this epoch's step losses so far
  std::int64_t samples = 0;      // this epoch's training samples so far
  // Where this process began the epoch: a resumed epoch's checkpoint had `first_step` steps and
  // `first_samples` samples of it done (0 otherwise). Its figures per second count the rest.
  std::int64_t first_step = 0, first_samples = 0;
  // Set by a callback: the loop ends after this batch (or this epoch's end) and reports where.
  bool stop_training = false;
  // The newest checkpoint a callback saved ("" before any).
  std::string checkpoint;
};

// fit() stopped on request after saving `checkpoint`.
struct Interrupted {
  std::string checkpoint;
  std::int64_t epoch = 0, step_in_epoch = 0;
};

class Callback {
 public:
  virtual ~Callback() = default;
  virtual void on_train_begin(LoopState&) {}
  virtual void on_epoch_begin(LoopState&) {}
  virtual void on_train_batch_end(LoopState&) {}
  virtual void on_epoch_end(LoopState&, const EpochLog&) {}
  virtual void on_train_end(LoopState&) {}
};

// The callbacks in order.
class CallbackList {
 public:
  void add(std::unique_ptr<Callback> callback) { callbacks_.push_back(std::move(callback)); }
  void on_train_begin(LoopState& s) {
    for (auto& c : callbacks_) c->on_train_begin(s);
  }
  void on_epoch_begin(LoopState& s) {
    for (auto& c : callbacks_) c->on_epoch_begin(s);
  }
  void on_train_batch_end(LoopState& s) {
    for (auto& c : callbacks_) c->on_train_batch_end(s);
  }
  void on_epoch_end(LoopState& s, const EpochLog& log) {
    for (auto& c : callbacks_) c->on_epoch_end(s, log);
  }
  void on_train_end(LoopState& s) {
    for (auto& c : callbacks_) c->on_train_end(s);
  }

 private:
  std::vector<std::unique_ptr<Callback>> callbacks_;
};

// A test's hold on the loop: after global step `step` (0: before the model is built, while the
// run is set up), before any other callback sees that step,
// this process writes `<dir>/held.rank<R>` and waits there until it is asked to stop (a signal:
// `released_by` is set) or `<dir>/release` exists. A test that signals or kills a run acts while
// it is held, so the moment it acts is a step it chose, on a fast machine as on a slow one, and
// never a guess made with sleep. Set by apps/ from DTRAIN_TEST_HOLD_AT_STEP and
// DTRAIN_TEST_HOLD_DIR; off (step < 0) otherwise.
struct StepHold {
  std::int64_t step = -1;
  std::string dir;
  const std::atomic<int>* released_by = nullptr;
  // A hold nobody releases ends after this long, with a warning: a forgotten test must not hang.
  double limit_seconds = 600.0;
  bool active() const { return step >= 0 && !dir.empty(); }
};

// Writes `<dir>/held.rank<R>` (saying `where`) and waits until released as StepHold says.
void hold_here(const StepHold& hold, int rank, const std::string& where);

class HoldAtStep final : public Callback {
 public:
  HoldAtStep(StepHold hold, int rank) : hold_(std::move(hold)), rank_(rank) {}
  void on_train_batch_end(LoopState& s) override;

 private:
  StepHold hold_;
  int rank_;
};

// Asks every worker, after each batch and each epoch, whether one was asked to stop (SIGINT,
// SIGTERM: `requested` is set by the signal watcher), and stops the loop when any was.
class StopOnRequest final : public Callback {
 public:
  StopOnRequest(const std::atomic<int>* requested, distribute::Strategy& strategy)
      : requested_(requested), strategy_(strategy) {}
  void on_train_batch_end(LoopState& s) override { s.stop_training = s.stop_training || agreed(); }
  void on_epoch_end(LoopState& s, const EpochLog&) override { s.stop_training = s.stop_training || agreed(); }

 private:
  bool agreed();
  const std::atomic<int>* requested_;
  distribute::Strategy& strategy_;
};

// tf.train.CheckpointManager's saving policy: after every checkpoint.every_steps global steps,
// after every checkpoint.every_epochs epochs, and when the loop stops on request (where it stands).
class CheckpointSaver final : public Callback {
 public:
  CheckpointSaver(Trainer& trainer, const config::CheckpointConfig& config) : trainer_(trainer), config_(config) {}
  // Opens the checkpoint directory: an unwritable one is an IoError now, not after an epoch.
  void on_train_begin(LoopState& s) override;
  void on_train_batch_end(LoopState& s) override;
  void on_epoch_end(LoopState& s, const EpochLog& log) override;

 private:
  bool epoch_due(int epoch) const { return config_.every_epochs > 0 && (epoch + 1) % config_.every_epochs == 0; }
  Trainer& trainer_;
  config::CheckpointConfig config_;
};

// Training stopped on a non-finite loss: the experiment diverges (exit 2, as a bad experiment).
struct TrainingDiverged : ConfigError {
  using ConfigError::ConfigError;
};

// Keras' TerminateOnNaN: a step whose loss is NaN or infinite ends training at once (before the
// checkpoint saver, which runs after it, could write the spoilt weights) with a TrainingDiverged.
// Every worker sees the same all-reduced loss, so every worker stops at the same step.
class TerminateOnNaN final : public Callback {
 public:
  void on_train_batch_end(LoopState& s) override;
};

// What fit() tells the callbacks that observe the run from outside the loop (observe/: progress,
// metrics.jsonl, TensorBoard, the curves) when it makes its callbacks.
struct RunView {
  const config::Experiment& experiment;
  std::string run_dir;  // empty where this process writes no run directory (not the chief)
  std::FILE* out;       // where the epoch lines go (nowhere on a process that does not print)
  bool out_is_tty;      // TrainerOptions::out_is_tty
  // A resumed run: the 0-based epoch it continues in, and the global step of its checkpoint.
  std::optional<std::int64_t> resumed_epoch, resumed_global_step;
  // The learning rate the next step uses (the optimizer every replica computes with).
  std::function<double()> learning_rate;
};

// Adds the callbacks that observe the run, after the loop's own (the test hold, the stop
// agreement, TerminateOnNaN, the checkpoint saver). The loop knows none of them: apps/ installs
// observe::add_observers (TrainerOptions::observers); without it a run prints its epoch lines
// only.
using Observers = std::function<void(CallbackList& callbacks, const RunView& run)>;

}  // namespace dtrain::train
