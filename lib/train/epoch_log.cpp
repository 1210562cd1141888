#include "train/epoch_log.hpp"

#include <fmt/format.h>

namespace dtrain::train {

std::string epoch_line(const EpochLog& log) {
  std::string s = fmt::format("Epoch {}, Loss: {:.4f}", log.epoch, log.loss);
  if (log.accuracy) s += fmt::format(", Accuracy: {:.2f}", 100.0 * *log.accuracy);
  auto eval = [&](const std::optional<EvalResult>& r, const char* label) {
    if (!r) return;
    s += fmt::format(", {} Loss: {:.4f}", label, r->loss);
    if (r->accuracy) s += fmt::format(", {} Accuracy: {:.2f}", label, 100.0 * *r->accuracy);
  };
  eval(log.validation, "Validation");
  eval(log.test, "Test");
  return s;
}

std::string throughput_line(const EpochLog& log) {
  const double eval_seconds = (log.validation ? log.validation->seconds : 0.0) + (log.test ? log.test->seconds : 0.0);
  std::string s = fmt::format("  train {:.1f} samples/s ({} steps, {:.2f} s), eval {:.2f} s",
                              log.train_seconds > 0 ? static_cast<double>(log.samples) / log.train_seconds : 0.0,
                              log.steps, log.train_seconds, eval_seconds);
  if (log.staleness_mean >= 0)
    s += fmt::format(", staleness mean {:.2f} max {} updates", log.staleness_mean, log.staleness_max);
  if (log.steps <= 0 || log.allreduce_seconds < 0) return s;
  const double steps = static_cast<double>(log.steps);
  if (log.allreduce_wait_seconds >= 0) {
    // In flight while backward computes costs little; what the step waited for is the cost.
    s += fmt::format(", all-reduce across workers {:.2f} ms/step in flight overlapping backward, {:.2f} ms/step waited for",
                     1e3 * log.allreduce_seconds / steps, 1e3 * log.allreduce_wait_seconds / steps);
  } else {
    s += fmt::format(", all-reduce across workers {:.2f} ms/step", 1e3 * log.allreduce_seconds / steps);
  }
  return s;
}

}  // namespace dtrain::train
