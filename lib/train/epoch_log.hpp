// What an epoch of the training loop gives: its figures (EpochLog, with the evaluation of each
// split) and the two lines fit() prints after it, the epoch line of the custom-training-loop
// template and the throughput line. Whatever else shows the run (metrics.jsonl, the progress bar,
// TensorBoard, the curves) is observe/'s, which reads these figures.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace dtrain::train {

struct EvalResult {
  double loss = 0.0;                // mean per-example loss over the whole split
  std::optional<double> accuracy;   // first metric, as a fraction
  std::int64_t samples = 0;
  double seconds = 0.0;
};

struct EpochLog {
  int epoch = 0;                    // 1-based, as printed
  double loss = 0.0;                // mean over the epoch's steps of the global step loss
  std::optional<double> accuracy;   // fraction
  std::optional<EvalResult> validation, test;
  // Training samples and steps this process computed this epoch, in train_seconds (a resumed
  // epoch's steps before its checkpoint are not among them).
  std::int64_t samples = 0;
  std::int64_t steps = 0;
  double train_seconds = 0.0;
  double allreduce_seconds = -1.0;  // gradient sums across workers this epoch; < 0 = one worker
  double allreduce_wait_seconds = -1.0;  // of which backward waited for; < 0 = not overlapped
  std::int64_t global_step = 0;
  // Under parameter servers: updates applied on the servers between a step's read of the variables and
  // its push (mean and max over the epoch's steps); < 0 = synchronous training.
  double staleness_mean = -1.0;
  std::int64_t staleness_max = 0;
};

// "Epoch 1, Loss: 0.5090, Accuracy: 81.58, Test Loss: 0.3914, Test Accuracy: 85.67" (accuracy in
// percent as in the tutorial; validation figures between the train and test ones when present).
std::string epoch_line(const EpochLog& log);
// "  train 3950.2 samples/s (15.19 s), eval 0.81 s"
std::string throughput_line(const EpochLog& log);

}  // namespace dtrain::train
