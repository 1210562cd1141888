#include "train/callbacks.hpp"

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <iterator>
#include <cstdlib>
#include <cstring>
#include <cerrno>
#include <string_view>
#include <filesystem>
#include <fstream>
#include <thread>

#include <fmt/format.h>

#include "core/atomic_file.hpp"
#include "core/error.hpp"
#include "train/plot.hpp"
#include "train/trainer.hpp"

namespace dtrain::train {

namespace fs = std::filesystem;

bool StopOnRequest::agreed() {
  const int local = requested_ ? requested_->load() : 0;
  return strategy_.all_reduce_max(local, "stop request") != 0;
}

void CheckpointSaver::on_train_begin(LoopState&) { trainer_.open_checkpoints(); }

void TerminateOnNaN::on_train_batch_end(LoopState& s) {
  if (std::isfinite(s.loss_sum)) return;
  throw TrainingDiverged(fmt::format(
      "the training loss became {} at epoch {}, step {} of it (global step {}); training stopped without saving, so "
      "the last checkpoint ({}) holds the last finite weights: lower optimizer.learning_rate, or check the data and the "
      "loss",
      s.loss_sum, s.epoch + 1, s.step, s.global_step, s.checkpoint.empty() ? "none this run" : s.checkpoint));
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

std::string metrics_lines_through(const std::string& text, std::int64_t epochs) {
  std::string kept;
  std::size_t begin = 0;
  while (begin < text.size()) {
    std::size_t end = text.find('\n', begin);
    if (end == std::string::npos) break;  // no newline: a line cut short while it was written
    const std::string line = text.substr(begin, end - begin);
    begin = end + 1;
    constexpr std::string_view key = "{\"epoch\": ";
    if (!line.starts_with(key) || line.back() != '}') continue;
    const char* first = line.data() + key.size();
    std::int64_t epoch = 0;
    const auto [next, error] = std::from_chars(first, line.data() + line.size(), epoch);
    if (error == std::errc() && next != first && epoch <= epochs) kept += line + "\n";
  }
  return kept;
}

void MetricsLog::on_train_begin(LoopState&) {
  if (resumed_epoch_) {
    // A resumed run continues the log of the run it continues, cut back to where the checkpoint
    // stood (replaced atomically: a crash now leaves the old log or the cut one, never half).
    std::error_code ec;
    if (fs::exists(path(), ec)) {
      std::ifstream in(path(), std::ios::binary);
      const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      if (!in.good() && !in.eof()) throw IoError(fmt::format("cannot read {} to continue it", path()));
      const std::string kept = metrics_lines_through(text, *resumed_epoch_);
      if (kept != text) write_file_atomically(path(), kept);
    }
  }
  std::ofstream metrics(path(), resumed_epoch_ ? std::ios::app : std::ios::trunc);
  if (!metrics)
    throw IoError(fmt::format("cannot write {} ({}); check that the run directory is writable", path(),
                              std::strerror(errno)));
}

void MetricsLog::on_epoch_end(LoopState&, const EpochLog& log) {
  std::ofstream jsonl(path(), std::ios::app);
  jsonl << epoch_json(log) << "\n";
  jsonl.flush();  // a full disk shows at the flush, not in the destructor where it would be lost
  if (!jsonl) throw IoError(fmt::format("{}: cannot append to it; check the disk's free space", path()));
}

void hold_here(const StepHold& hold, int rank, const std::string& where) {
  const fs::path dir(hold.dir);
  const fs::path release = dir / "release";
  std::error_code ignored;
  fs::create_directories(dir, ignored);
  write_file_atomically((dir / fmt::format("held.rank{}", rank)).string(), where + "\n");
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(hold.limit_seconds);
  while (!(hold.released_by && hold.released_by->load() != 0) && !fs::exists(release, ignored)) {
    if (std::chrono::steady_clock::now() > until) {
      fmt::print(stderr, "dtrain: warning: held at step {} for {} s and never released; going on\n", hold.step,
                 hold.limit_seconds);
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

void HoldAtStep::on_train_batch_end(LoopState& s) {
  if (s.global_step != hold_.step) return;
  hold_here(hold_, rank_, fmt::format("epoch {} step {} global_step {}", s.epoch + 1, s.step, s.global_step));
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
