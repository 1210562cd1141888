#include "train/callbacks.hpp"

#include <chrono>
#include <cmath>
#include <filesystem>
#include <string>
#include <system_error>
#include <thread>

#include <fmt/format.h>

#include "core/atomic_file.hpp"
#include "core/error.hpp"
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

void hold_here(const StepHold& hold, int rank, const std::string& where) {
  const fs::path dir(hold.dir);
  const fs::path release = dir / "release";
  std::error_code ignored;
  fs::create_directories(dir, ignored);
  write_file_atomically((dir / fmt::format("held.rank{}", rank)).string(), where + "\n");
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(hold.limit_seconds);
  while (!(hold.released_by && hold.released_by->load() != 0) && !fs::exists(release, ignored)) {
    if (std::chrono::steady_clock::now() > until) {
      fmt::print(stderr, "dtrain: warning: held ({}) for {} s and never released; going on\n", where,
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

}  // namespace dtrain::train
