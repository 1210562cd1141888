#include <unistd.h>

#include <algorithm>
#include <filesystem>

#include <fmt/format.h>

#include "checkpoint/checkpoint.hpp"
#include "checkpoint/manager.hpp"
#include "commands.hpp"
#include "config/parse.hpp"
#include "core/error.hpp"
#include "distribute/cluster.hpp"
#include "signals.hpp"
#include "train/trainer.hpp"

namespace dtrain::app {

namespace fs = std::filesystem;

namespace {

// The overrides a resumed run may take without leaving the path of the run it continues.
bool keeps_results(const std::string& override_text) {
  const std::string key = override_text.substr(0, override_text.find('='));
  return key == "train.epochs" || key == "train.progress";
}

}  // namespace

int resume_command(const ResumeArgs& args) {
  // First: MPI_Init and the compute start threads, and each must inherit the mask that keeps
  // SIGINT/SIGTERM off it (signals.hpp).
  StopOnSignal signals;
  distribute::Cluster cluster;
  return run_as_worker(cluster, [&] {
  // Only the chief speaks; every worker restores the same checkpoint.
  std::FILE* say = cluster.is_chief() ? stderr : nullptr;
  if (args.run_dir.empty() && args.checkpoint.empty())
    throw ConfigError("resume needs a run directory or --checkpoint FILE");
  // Candidates, newest first: the one named, or the run's complete checkpoints.
  std::vector<std::string> candidates;
  if (!args.checkpoint.empty()) {
    candidates.push_back(args.checkpoint);
  } else {
    const std::string dir = (fs::path(args.run_dir) / "checkpoints").string();
    candidates = checkpoint::list_checkpoints(dir);
    std::reverse(candidates.begin(), candidates.end());
    if (candidates.empty())
      throw InputError(fmt::format("{}: no complete checkpoint to resume from; start the run again with dtrain run", dir));
  }
  // The experiment comes from the newest checkpoint whose contents read back.
  std::size_t first = 0;
  checkpoint::Contents stored;
  for (; first < candidates.size(); ++first) {
    try {
      stored = checkpoint::peek(candidates[first]);
      break;
    } catch (const InputError& e) {
      if (candidates.size() == 1) throw;
      if (say) fmt::print(say, "dtrain: warning: skipping {}: {}; trying the previous checkpoint\n", candidates[first], e.what());
    }
  }
  if (first == candidates.size())
    throw InputError(fmt::format("no valid checkpoint among the {} in {}", candidates.size(), args.run_dir));

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

  train::TrainerOptions options;
  options.run_dir =
      !args.run_dir.empty() ? args.run_dir : fs::path(candidates[first]).parent_path().parent_path().string();
  options.out = stdout;
  options.out_is_tty = isatty(fileno(stdout)) != 0;
  options.cluster = &cluster;
  options.stop_requested = &signals.requested();
  return train_or_evaluate(cluster, exp, options, [&](train::Trainer& trainer) {
    // Restoring verifies every checksum; a checkpoint that fails it is skipped for the previous one.
    std::string chosen;
    for (std::size_t i = first; i < candidates.size() && chosen.empty(); ++i) {
      try {
        trainer.restore(candidates[i]);
        chosen = candidates[i];
      } catch (const InputError& e) {
        if (i + 1 == candidates.size()) throw;
        if (say) fmt::print(say, "dtrain: warning: skipping {}: {}; trying the previous checkpoint\n", candidates[i], e.what());
      }
    }
    stored = checkpoint::peek(chosen);
    if (say) fmt::print("Resuming from {} at epoch {}, step {} of it (global step {})\n", chosen, stored.state.epoch + 1,
                        stored.state.step_in_epoch, stored.state.global_step);
  });
  });
}

}  // namespace dtrain::app
