// What a run logs besides the lines the loop prints (train/epoch_log.hpp): a Keras-style progress
// bar on a terminal and the records of runs/<name>/metrics.jsonl.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

#include "train/epoch_log.hpp"

namespace dtrain::observe {

// One JSON object, no trailing newline.
std::string epoch_json(const train::EpochLog& log);

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

}  // namespace dtrain::observe
