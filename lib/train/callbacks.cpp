#include "train/callbacks.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <string_view>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>

#include "core/error.hpp"
#include "train/plot.hpp"
#include "train/trainer.hpp"

namespace dtrain::train {

namespace fs = std::filesystem;

bool StopOnRequest::agreed() {
  const int local = requested_ ? requested_->load() : 0;
  return strategy_.all_reduce_max(local, "stop request") != 0;
}

void CheckpointSaver::on_train_batch_end(LoopState& s) {
  // An epoch's last step is saved by on_epoch_end when that epoch is due: not twice.
  const bool epoch_save_follows = s.step == s.steps && epoch_due(s.epoch);
  const bool step_due = config_.every_steps > 0 && s.global_step % config_.every_steps == 0 && !epoch_save_follows;
  if (s.stop_training || step_due) {
    const std::string path = trainer_.save_checkpoint(s.epoch, s.step, s.loss_sum, s.samples);
    if (!path.empty()) s.checkpoint = path;
  }
}

void CheckpointSaver::on_epoch_end(LoopState& s, const EpochLog&) {
  // Asked to stop during the evaluation, the epoch is complete: it is saved where the next begins.
  if (!epoch_due(s.epoch) && !s.stop_training) return;
  const std::string path = trainer_.save_checkpoint(s.epoch + 1, 0, 0.0, 0);
  if (!path.empty()) s.checkpoint = path;
}

std::string MetricsLog::path() const { return (fs::path(run_dir_) / "metrics.jsonl").string(); }

void MetricsLog::on_train_begin(LoopState&) {
  // A resumed run appends its epochs to the log of the run it continues.
  std::ofstream metrics(path(), resumed_ ? std::ios::app : std::ios::trunc);
  if (!metrics) throw IoError(fmt::format("cannot write {}; check that the run directory is writable", path()));
}

void MetricsLog::on_epoch_end(LoopState&, const EpochLog& log) {
  std::ofstream jsonl(path(), std::ios::app);
  jsonl << epoch_json(log) << "\n";
  if (!jsonl) throw IoError(fmt::format("cannot append to {}", path()));
}

bool progress_reaches_a_terminal(bool is_tty, const std::function<const char*(const char*)>& env) {
  if (!is_tty) return false;
  for (const char* launcher_variable : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK"})
    if (env(launcher_variable) != nullptr) return false;
  const char* term = env("TERM");
  return term != nullptr && *term != '\0' && std::string_view(term) != "dumb";
}

bool progress_reaches_a_terminal(std::FILE* out) {
  return progress_reaches_a_terminal(isatty(fileno(out)) != 0, [](const char* name) { return std::getenv(name); });
}

void ProgressLogger::on_epoch_begin(LoopState& s) { bar_.emplace(out_, s.steps, mode_ == Mode::bar); }

void ProgressLogger::on_train_batch_end(LoopState& s) {
  const double running = s.loss_sum / static_cast<double>(std::max<std::int64_t>(1, s.step));
  if (bar_) bar_->update(s.step, running);
  if (mode_ == Mode::lines && (s.step % std::max<std::int64_t>(1, s.steps / 10) == 0 || s.step == s.steps))
    fmt::print(out_, "  step {}/{}, loss {:.4f}\n", s.step, s.steps, running);
}

void ProgressLogger::finish() {
  if (bar_) bar_->finish();
  bar_.reset();
}

void PlotCurves::on_epoch_end(LoopState&, const EpochLog&) {
  if (failed_) return;
  const std::string png = (fs::path(run_dir_) / "curves.png").string();
  try {
    plot_curves({read_run_curves(run_dir_)}, png);
  } catch (const std::exception& e) {
    failed_ = true;
    std::fflush(stdout);
    fmt::print(stderr, "dtrain: warning: train.plot: {}; training goes on without {}\n", e.what(), png);
  }
}

}  // namespace dtrain::train
