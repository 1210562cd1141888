// The evaluator task of a multi-worker job (TensorFlow's side-car evaluator): a rank that takes
// no part in training. It watches the run's checkpoint directory, evaluates each new checkpoint
// on the test split as soon as the manifest lists it (the newest one when several arrived since
// the last look), prints an "Evaluator:" line and appends it to <run dir>/evaluator.jsonl. It
// stops when the chief says training has ended, after evaluating the final checkpoint.
#pragma once

#include <atomic>
#include <cstdio>
#include <string>

#include "distribute/worker_group.hpp"
#include "train/trainer.hpp"

namespace dtrain::train {

struct EvaluatorOptions {
  std::string run_dir;  // where evaluator.jsonl goes; empty = nowhere
  std::FILE* out = stdout;
  const std::atomic<int>* stop_requested = nullptr;  // a signal ends the loop
  double poll_seconds = 0.2;
};

// Returns the number of checkpoints evaluated. A checkpoint that fails to read (removed by
// max_to_keep meanwhile, or damaged) is skipped with a warning.
int run_evaluator(Trainer& trainer, distribute::WorkerGroup& workers, const EvaluatorOptions& options);

// Until the chief says training has ended (or a signal asks to stop): what an evaluator that
// cannot evaluate does, so that its error ends no training rank.
void wait_for_training(distribute::WorkerGroup& workers, const std::atomic<int>* stop_requested,
                       double poll_seconds = EvaluatorOptions{}.poll_seconds);

// "Evaluator: ckpt-70.h5 (after epoch 1, global step 70), Test Loss: 0.4012, Test Accuracy: 85.60", or
// "(epoch 2, step 5 of it, ...)" for a checkpoint saved within an epoch.
std::string evaluator_line(const std::string& checkpoint, const checkpoint::TrainingState& state, const EvalResult& r);

}  // namespace dtrain::train
