// What a run prints and logs: the epoch line of the custom-training-loop template, the throughput
// line after it, a Keras-style progress bar on a terminal, and runs/<name>/metrics.jsonl.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
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
  std::int64_t samples = 0;         // training samples seen this epoch
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
// One JSON object, no trailing newline.
std::string epoch_json(const EpochLog& log);

// A Keras-style bar, redrawn in place at most 10 times a second:
//   " 312/938 [=========>....................] - ETA: 9s - loss: 0.5123"
// Disabled, it prints nothing.
class ProgressBar {
 public:
  ProgressBar(std::FILE* out, std::int64_t total_steps, bool enabled);
  void update(std::int64_t steps_done, double running_loss);
  // Clears the bar so the epoch line starts on a clean line.
  void finish();

 private:
  std::FILE* out_;
  std::int64_t total_;
  bool enabled_;
  std::chrono::steady_clock::time_point start_, last_draw_;
  bool drawn_ = false;
};

}  // namespace dtrain::train
