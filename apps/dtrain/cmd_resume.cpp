#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <memory>

#include <fmt/format.h>

#include "checkpoint/checkpoint.hpp"
#include "checkpoint/manager.hpp"
#include "commands.hpp"
#include "config/parse.hpp"
#include "core/error.hpp"
#include "distribute/worker_group.hpp"
#include "signals.hpp"
#include "train/callbacks.hpp"
#include "train/run_dir.hpp"
#include "train/trainer.hpp"

namespace dtrain::app {

namespace fs = std::filesystem;

namespace {

// The overrides a resumed run may take without leaving the path of the run it continues.
bool keeps_results(const std::string& override_text) {
  const std::string key = override_text.substr(0, override_text.find('='));
  return key == "train.epochs" || key == "train.progress" || key == "train.tensorboard" ||
         key == "train.log_every_steps" || key == "train.plot";
}

// Calls `use` on candidates[from], candidates[from + 1], ... (newest first) until one reads
// without an InputError, and returns its index. A checkpoint that fails is skipped, with a warning
// on `say` (null: silently), for the previous one; when the last one fails too, its error is
// thrown — alone when it was the only candidate, else saying that none of them was valid.
std::size_t first_valid(const std::vector<std::string>& candidates, std::size_t from, const std::string& where,
                        std::FILE* say, const std::function<void(const std::string&)>& use) {
  for (std::size_t i = from;; ++i) {
    try {
      use(candidates[i]);
      return i;
    } catch (const InputError& e) {
      if (candidates.size() == 1) throw;
      if (i + 1 == candidates.size())
        throw InputError(fmt::format("no valid checkpoint among the {} in {}; the oldest, {}: {}", candidates.size(),
                                     where, candidates[i], e.what()));
      if (say) fmt::print(say, "dtrain: warning: skipping {}: {}; trying the previous checkpoint\n", candidates[i], e.what());
    }
  }
}

// Where the run in `run_dir` keeps its checkpoints: its config.yaml's checkpoint.dir when set, else
// <run_dir>/checkpoints.
std::string checkpoint_dir_of_run(const std::string& run_dir, std::FILE* say) {
  const fs::path config_file = fs::path(run_dir) / "config.yaml";
  std::error_code ec;
  if (fs::is_regular_file(config_file, ec)) {
    try {
      return train::checkpoint_dir_of(run_dir, config::load_experiment(config_file.string(), {}).checkpoint);
    } catch (const Error& e) {
      if (say) fmt::print(say, "dtrain: warning: {}; looking for checkpoints in {}/checkpoints\n", e.what(), run_dir);
    }
  }
  return (fs::path(run_dir) / "checkpoints").string();
}

// A checkpoint whose epoch lies past the end of the experiment stored with it cannot come from
// that run: it is refused as corrupt (resume then tries the previous one). Checked against the
// stored experiment, not the --set one: `train.epochs` may be lowered on purpose.
void check_epoch_in_run(const std::string& path, const checkpoint::Contents& contents) {
  const config::Experiment stored = config::parse_experiment(contents.experiment_yaml, path + ":/experiment", {});
  const auto& s = contents.state;
  if (s.epoch > stored.train.epochs || (s.epoch == stored.train.epochs && s.step_in_epoch > 0))
    throw InputError(fmt::format("{}: /state/epoch is {} (step {} of it) but the experiment stored with it trains {} "
                                 "epochs; the checkpoint is corrupt",
                                 path, s.epoch, s.step_in_epoch, stored.train.epochs));
}

}  // namespace

int resume_command(const ResumeArgs& args) {
  // First: MPI_Init and the compute start threads, and each must inherit the mask that keeps
  // SIGINT/SIGTERM off it (signals.hpp).
  StopOnSignal signals;
  signals.keep_blocked();  // the process ends after this command
  const std::unique_ptr<distribute::WorkerGroup> workers = distribute::make_worker_group();
  return run_as_worker(*workers, [&] {
  // Only the chief speaks; every worker restores the same checkpoint.
  std::FILE* say = workers->rank() == 0 ? stderr : nullptr;
  if (args.run_dir.empty() && args.checkpoint.empty())
    throw ConfigError("resume needs a run directory or --checkpoint FILE");
  // Candidates, newest first: the one named, or the run's complete checkpoints.
  std::vector<std::string> candidates;
  if (!args.checkpoint.empty()) {
    candidates.push_back(args.checkpoint);
  } else {
    const std::string dir = checkpoint_dir_of_run(args.run_dir, say);
    std::string warning;
    candidates = checkpoint::list_checkpoints(dir, &warning);
    if (say && !warning.empty()) fmt::print(say, "dtrain: warning: {}\n", warning);
    std::reverse(candidates.begin(), candidates.end());
    if (candidates.empty())
      throw InputError(fmt::format("{}: no complete checkpoint to resume from; start the run again with dtrain run", dir));
  }
  // The experiment comes from the newest checkpoint whose contents read back.
  checkpoint::Contents stored;
  const std::size_t first = first_valid(candidates, 0, args.run_dir, say,
                                        [&](const std::string& path) {
                                          stored = checkpoint::peek(path);
                                          check_epoch_in_run(path, stored);
                                        });

  std::vector<std::string> changing;
  for (const auto& o : args.overrides)
    if (!keeps_results(o)) changing.push_back(o);
  if (!changing.empty()) {
    std::string list;
    for (const auto& o : changing) list += (list.empty() ? "" : ", ") + o;
    if (say) fmt::print(say, "dtrain: warning: {} change{} the results: the rest of this run will differ from a run that was "
                       "never stopped\n", list, changing.size() == 1 ? "s" : "");
  }
  config::Experiment exp =
      config::parse_experiment(stored.experiment_yaml, candidates[first] + ":/experiment", args.overrides);
  refuse_local_strategy_under_launcher(exp, *workers, "each would resume alone, all into one run directory");

  train::TrainerOptions options;
  options.run_dir =
      !args.run_dir.empty() ? args.run_dir : fs::path(candidates[first]).parent_path().parent_path().string();
  options.out = stdout;
  options.out_is_tty = train::progress_reaches_a_terminal(stdout);
  options.workers = workers.get();
  options.stop_requested = &signals.requested();
  signals.set_checkpoint_dir(train::checkpoint_dir_of(options.run_dir, exp.checkpoint));
  return naming_source(candidates[first] + ":/experiment", [&] {
  return train_or_evaluate(*workers, exp, options, [&](train::Trainer& trainer) {
    // Restoring verifies every checksum; a checkpoint that fails it is skipped for the previous one.
    const std::string& chosen = candidates[first_valid(candidates, first, args.run_dir, say,
                                                       [&](const std::string& path) {
                                                         check_epoch_in_run(path, checkpoint::peek(path));
                                                         trainer.restore(path);
                                                       })];
    stored = checkpoint::peek(chosen);
    if (say) fmt::print("Resuming from {} at epoch {}, step {} of it (global step {})\n", chosen, stored.state.epoch + 1,
                        stored.state.step_in_epoch, stored.state.global_step);
  });
  });
  });
}

}  // namespace dtrain::app
