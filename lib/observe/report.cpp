#include "observe/report.hpp"

#include <cmath>

#include <fmt/format.h>

namespace dtrain::observe {

using train::EpochLog;
using train::EvalResult;

std::string epoch_json(const EpochLog& log) {
  // JSON has no NaN or infinity: such a figure is written as null, and "non_finite" says which
  // keys were and what they held.
  std::string non_finite;
  const auto number = [&non_finite](const std::string& key, double v) {
    if (std::isfinite(v)) return fmt::format("{:.9g}", v);
    non_finite += fmt::format(R"({}"{}": "{}")", non_finite.empty() ? "" : ", ", key, v);
    return std::string("null");
  };
  std::string s = fmt::format(R"({{"epoch": {}, "global_step": {}, "loss": {})", log.epoch, log.global_step,
                              number("loss", log.loss));
  if (log.accuracy) s += fmt::format(R"(, "accuracy": {})", number("accuracy", *log.accuracy));
  auto eval = [&](const std::optional<EvalResult>& r, const std::string& prefix) {
    if (!r) return;
    s += fmt::format(R"(, "{}_loss": {})", prefix, number(prefix + "_loss", r->loss));
    if (r->accuracy) s += fmt::format(R"(, "{}_accuracy": {})", prefix, number(prefix + "_accuracy", *r->accuracy));
    s += fmt::format(R"(, "{}_samples": {})", prefix, r->samples);
  };
  eval(log.validation, "val");
  eval(log.test, "test");
  if (log.allreduce_seconds >= 0) s += fmt::format(R"(, "allreduce_seconds": {:.4f})", log.allreduce_seconds);
  if (log.allreduce_wait_seconds >= 0)
    s += fmt::format(R"(, "allreduce_wait_seconds": {:.4f})", log.allreduce_wait_seconds);
  if (log.staleness_mean >= 0)
    s += fmt::format(R"(, "staleness_mean": {:.4f}, "staleness_max": {})", log.staleness_mean, log.staleness_max);
  s += fmt::format(R"(, "train_samples": {}, "train_seconds": {:.4f}, "train_samples_per_s": {:.2f})", log.samples,
                   log.train_seconds, log.train_seconds > 0 ? static_cast<double>(log.samples) / log.train_seconds : 0.0);
  if (!non_finite.empty()) s += fmt::format(R"(, "non_finite": {{{}}})", non_finite);
  return s + "}";
}

ProgressBar::ProgressBar(std::FILE* out, std::int64_t total_steps, bool enabled)
    : out_(out), total_(total_steps), enabled_(enabled), start_(std::chrono::steady_clock::now()), last_draw_(start_) {}

void ProgressBar::update(std::int64_t done, double running_loss) {
  if (!enabled_) return;
  const auto now = std::chrono::steady_clock::now();
  if (done < total_ && now - last_draw_ < std::chrono::milliseconds(100)) return;
  last_draw_ = now;
  constexpr int width = 30;
  const double frac = total_ > 0 ? static_cast<double>(done) / static_cast<double>(total_) : 1.0;
  const int filled = static_cast<int>(frac * width);
  std::string bar(static_cast<std::size_t>(width), '.');
  for (int i = 0; i < filled; ++i) bar[static_cast<std::size_t>(i)] = '=';
  if (filled < width) bar[static_cast<std::size_t>(filled)] = '>';
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  const double eta = done > 0 ? elapsed * static_cast<double>(total_ - done) / static_cast<double>(done) : 0.0;
  const int digits = static_cast<int>(fmt::formatted_size("{}", total_));
  fmt::print(out_, "\r{:>{}}/{} [{}] - ETA: {:.0f}s - loss: {:.4f}\x1b[K", done, digits, total_, bar, eta, running_loss);
  std::fflush(out_);
  drawn_ = true;
}

void ProgressBar::finish() {
  if (!enabled_ || !drawn_) return;
  fmt::print(out_, "\r\x1b[K");
  std::fflush(out_);
}

}  // namespace dtrain::observe
