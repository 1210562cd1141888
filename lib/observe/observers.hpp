// The callbacks that observe a run (train/callbacks.hpp): the progress bar or lines,
// <run dir>/metrics.jsonl, TensorBoard's event files (tensorboard.hpp) and the curves
// (train.plot), and add_observers, which apps/ installs as TrainerOptions::observers so that fit()
// adds them after the loop's own callbacks. They read what the loop hands every callback (the loop
// state, the epoch's figures); the loop includes nothing of observe/.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <optional>
#include <string>
#include <utility>

#include "observe/report.hpp"
#include "train/callbacks.hpp"

namespace dtrain::observe {

// The observers of `run`, in this order: metrics.jsonl and TensorBoard (with a run directory, the
// latter when train.tensorboard), the progress (train.progress), the curves (train.plot, with a
// run directory: after metrics.jsonl, which has then written the epoch the picture shows).
void add_observers(train::CallbackList& callbacks, const train::RunView& run);

// <run dir>/metrics.jsonl: one JSON object per epoch. A resumed run (resumed_epoch: the 0-based
// epoch it continues in) first cuts the log back to the epochs before that one, atomically, then
// appends: epochs logged after the checkpoint it resumes from are trained again and must not show
// twice.
class MetricsLog final : public train::Callback {
 public:
  MetricsLog(std::string run_dir, std::optional<std::int64_t> resumed_epoch)
      : run_dir_(std::move(run_dir)), resumed_epoch_(resumed_epoch) {}
  void on_train_begin(train::LoopState&) override;
  void on_epoch_end(train::LoopState&, const train::EpochLog& log) override;

 private:
  std::string path() const;
  std::string run_dir_;
  std::optional<std::int64_t> resumed_epoch_;
};

// Whether `train.progress: auto` draws a bar on `out`: only when the output reaches a person's
// terminal. isatty alone is not enough: OpenMPI's mpirun hands every rank a pseudo-terminal of its
// own whatever mpirun's own output is (a file, a batch system's log), and a rank cannot see
// mpirun's output. So under an MPI launcher (OMPI_COMM_WORLD_SIZE, PMIX_RANK or PMI_RANK in the
// environment) auto never draws a bar, nor on a terminal that cannot redraw (TERM unset or
// "dumb"); `progress: bar` still forces one. `env` is getenv, or a table in tests.
bool progress_reaches_a_terminal(bool is_tty, const std::function<const char*(const char*)>& env);
// The same for a stream of this process, with isatty and the real environment.
bool progress_reaches_a_terminal(std::FILE* out);
// The lines of a metrics.jsonl text whose "epoch" is at most `epochs` (what a run resumed at
// 0-based epoch `epochs` keeps); lines without a readable epoch (a line cut short by a crash) go.
std::string metrics_lines_through(const std::string& text, std::int64_t epochs);

// Keras' progress: a bar redrawn in place on a terminal, or a line every tenth of an epoch.
class ProgressLogger final : public train::Callback {
 public:
  enum class Mode { bar, lines, none };
  ProgressLogger(std::FILE* out, Mode mode) : out_(out), mode_(mode) {}
  void on_epoch_begin(train::LoopState& s) override;
  void on_train_batch_end(train::LoopState& s) override;
  void on_epoch_end(train::LoopState&, const train::EpochLog&) override { finish(); }
  void on_train_end(train::LoopState&) override { finish(); }

 private:
  void finish();
  std::FILE* out_;
  Mode mode_;
  std::optional<ProgressBar> bar_;
};

// train.plot: redraws <run dir>/curves.png from metrics.jsonl after each epoch (the chief only: it
// alone has the run directory). A picture is never worth a run: a failure is one warning on
// stderr, and the run goes on without plotting.
class PlotCurves final : public train::Callback {
 public:
  explicit PlotCurves(std::string run_dir) : run_dir_(std::move(run_dir)) {}
  void on_epoch_end(train::LoopState&, const train::EpochLog&) override;

 private:
  std::string run_dir_;
  bool failed_ = false;
};

}  // namespace dtrain::observe
