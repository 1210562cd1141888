#include "observe/observers.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string_view>

#include <fmt/format.h>

#include "core/atomic_file.hpp"
#include "core/error.hpp"
#include "observe/plot.hpp"
#include "observe/tensorboard.hpp"

namespace dtrain::observe {

namespace fs = std::filesystem;
using train::EpochLog;
using train::LoopState;

void add_observers(train::CallbackList& callbacks, const train::RunView& run) {
  const config::TrainConfig& settings = run.experiment.train;
  if (!run.run_dir.empty()) callbacks.add(std::make_unique<MetricsLog>(run.run_dir, run.resumed_epoch));
  if (!run.run_dir.empty() && settings.tensorboard)
    callbacks.add(std::make_unique<TensorBoardLogger>(run.run_dir, settings.log_every_steps, run.learning_rate,
                                                      run.resumed_global_step));
  using Mode = ProgressLogger::Mode;
  const Mode mode = settings.progress == config::ProgressMode::bar ||
                            (settings.progress == config::ProgressMode::auto_detect && run.out_is_tty)
                        ? Mode::bar
                        : settings.progress == config::ProgressMode::lines ? Mode::lines : Mode::none;
  callbacks.add(std::make_unique<ProgressLogger>(run.out, mode));
  // After MetricsLog, which has then written the epoch the picture shows.
  if (settings.plot && !run.run_dir.empty()) callbacks.add(std::make_unique<PlotCurves>(run.run_dir));
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

}  // namespace dtrain::observe
