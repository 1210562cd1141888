#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <utility>

#include <fmt/format.h>

#include "checkpoint/checkpoint.hpp"
#include "checkpoint/manager.hpp"
#include "commands.hpp"
#include "config/parse.hpp"
#include "core/error.hpp"
#include "distribute/worker_group.hpp"
#include "observe/observers.hpp"
#include "signals.hpp"
#include "checkpoint/run_dir.hpp"
#include "train/trainer.hpp"

namespace dtrain::app {

namespace fs = std::filesystem;

namespace {

// The overrides a resumed run may take without leaving the path of the run it continues (the keys
// check_belongs_to_run lets differ). Under reproducibility: replica_invariant the layout (strategy,
// threads) changes no bits either; a global batch that changes with it is warned of by the trainer.
// So is one that a batch key changes: those keys are judged there, by the global batch they
// resolve to (switching batch_size_per_replica: 16 on 2 replicas to global_batch_size: 32, as an
// elastic resume does, changes nothing), and check_belongs_to_run lets them differ where they
// give the checkpoint's global batch.
bool keeps_results(const std::string& override_text, bool replica_invariant) {
  const std::string key = override_text.substr(0, override_text.find('='));
  if (replica_invariant && (key == "strategy" || key.starts_with("strategy.") || key == "train.threads" ||
                            key == "train.parallelism"))
    return true;
  if (key == "data.batch_size_per_replica" || key == "data.global_batch_size") return true;
  return key == "train.epochs" || key == "train.progress" || key == "train.tensorboard" ||
         key == "train.log_every_steps" || key == "train.plot";
}

// A checkpoint found through RUN_DIR whose stored experiment is not the run's (check_belongs_to_run):
// a ConfigError, not a damaged file; `skipped` says it briefly for the warning that passes over it.
struct NotOfTheRun : ConfigError {
  NotOfTheRun(const std::string& message, std::string skipped) : ConfigError(message), skipped(std::move(skipped)) {}
  std::string skipped;
};

// Calls `use` on candidates[from], candidates[from + 1], ... (newest first) until one reads
// without an InputError and belongs to the run, and returns its index. A checkpoint that fails is
// skipped, with a warning on `say` (null: silently), for the previous one. When the last one fails
// too: the newest one's NotOfTheRun where any was another run's or another history's (the run
// has none of its own, so the newest of them is what a user may want to continue with
// --checkpoint), else the InputError — alone when it was the only candidate, else saying that none
// of them was valid.
std::size_t first_valid(const std::vector<std::string>& candidates, std::size_t from, const std::string& where,
                        std::FILE* say, const std::function<void(const std::string&)>& use) {
  std::optional<NotOfTheRun> newest_foreign;
  for (std::size_t i = from;; ++i) {
    try {
      use(candidates[i]);
      return i;
    } catch (const NotOfTheRun& e) {
      if (!newest_foreign) newest_foreign = e;
      if (i + 1 == candidates.size()) throw *newest_foreign;
      if (say) fmt::print(say, "dtrain: warning: skipping {}: {}; trying the previous checkpoint\n", candidates[i], e.skipped);
    } catch (const InputError& e) {
      if (i + 1 == candidates.size() && newest_foreign) throw *newest_foreign;
      if (candidates.size() == 1) throw;
      if (i + 1 == candidates.size())
        throw InputError(fmt::format("no valid checkpoint among the {} in {}; the oldest, {}: {}", candidates.size(),
                                     where, candidates[i], e.what()));
      if (say) fmt::print(say, "dtrain: warning: skipping {}: {}; trying the previous checkpoint\n", candidates[i], e.what());
    }
  }
}

// The run in `run_dir` as its config.yaml describes it; nullopt when it has none, or one that does
// not read (then with a warning on `say`: its checkpoints are looked for in the default place).
std::optional<config::Experiment> experiment_of_run(const std::string& run_dir, std::FILE* say) {
  const fs::path config_file = fs::path(run_dir) / "config.yaml";
  std::error_code ec;
  if (!fs::is_regular_file(config_file, ec)) return std::nullopt;
  try {
    return config::load_experiment(config_file.string(), {});
  } catch (const Error& e) {
    if (say) fmt::print(say, "dtrain: warning: {}; looking for checkpoints in {}/checkpoints\n", e.what(), run_dir);
    return std::nullopt;
  }
}

// The first line where two texts differ, trimmed, for each of them.
std::pair<std::string, std::string> first_difference(const std::string& a, const std::string& b) {
  std::istringstream in_a(a), in_b(b);
  std::string line_a, line_b;
  while (true) {
    const bool more_a = static_cast<bool>(std::getline(in_a, line_a)), more_b = static_cast<bool>(std::getline(in_b, line_b));
    if (!more_a) line_a.clear();
    if (!more_b) line_b.clear();
    if (line_a != line_b || (!more_a && !more_b)) break;
  }
  const auto trim = [](std::string s) {
    s.erase(0, s.find_first_not_of(' '));
    return s.empty() ? std::string("(nothing)") : s;
  };
  return {trim(line_a), trim(line_b)};
}

// A checkpoint found through RUN_DIR must be that run's: the experiment stored in it is the one in
// RUN_DIR/config.yaml but for the keys a resume may change without changing the results (those of
// keeps_results). Another run's checkpoints (two runs that shared a checkpoint.dir, one replaced with
// --overwrite; a config.yaml of an older dtrain whose relative checkpoint.dir meant the current
// directory) are never continued under this run's name, nor those of a history this run left: a
// resume from an older checkpoint with a --set that changes the results rewrites config.yaml, and
// the checkpoints it has not yet overwritten with higher steps (a save never prunes those) hold the
// old experiment. They are skipped for the run's newest own checkpoint; with none, the newest is
// refused (NotOfTheRun), naming the difference.
void check_belongs_to_run(const std::string& path, const checkpoint::Contents& contents, const config::Experiment& run,
                          const std::string& run_dir) {
  config::Experiment stored = config::parse_experiment(contents.experiment_yaml, path + ":/experiment", {});
  // The run's batch keys where they give the global batch the checkpoint trained with: the
  // switch an elastic resume makes (batch_size_per_replica to global_batch_size) keeps its path.
  if (run.data.global_batch_size > 0 && run.data.global_batch_size == contents.state.global_batch) {
    stored.data.batch_size_per_replica = run.data.batch_size_per_replica;
    stored.data.global_batch_size = run.data.global_batch_size;
  }
  if (stored.reproducibility.invariant()) {  // the layout changes no bits (keeps_results)
    stored.strategy = run.strategy;
    stored.train.threads = run.train.threads;
    stored.train.parallelism = run.train.parallelism;
  }
  stored.train.epochs = run.train.epochs;
  stored.train.progress = run.train.progress;
  stored.train.tensorboard = run.train.tensorboard;
  stored.train.log_every_steps = run.train.log_every_steps;
  stored.train.plot = run.train.plot;
  const std::string ours = config::to_yaml(run), theirs = config::to_yaml(stored);
  if (ours == theirs) return;
  const auto [in_run, in_checkpoint] = first_difference(ours, theirs);
  const std::string config_file = (fs::path(run_dir) / "config.yaml").string();
  throw NotOfTheRun(fmt::format("{}: not a checkpoint of the run in {}: the experiment stored in it differs from {} "
                                 "(`{}` in the checkpoint, `{}` in config.yaml); resume the run that wrote it, or, if "
                                 "a resume with --set changed this run since, continue from it with `dtrain resume {} "
                                 "--checkpoint {}`",
                                 path, run_dir, config_file, in_checkpoint, in_run, run_dir, path),
                     fmt::format("its experiment is not the one in {} (`{}` in the checkpoint, `{}` in config.yaml): "
                                 "another run's, or a history this run left when a resume with --set changed it",
                                 config_file, in_checkpoint, in_run));
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
  return finish_command(signals, *workers, run_as_worker(*workers, [&] {
  // Only the chief speaks; every worker restores the same checkpoint.
  std::FILE* say = workers->rank() == 0 ? stderr : nullptr;
  if (args.run_dir.empty() && args.checkpoint.empty())
    throw ConfigError("resume needs a run directory or --checkpoint FILE");
  // Candidates, newest first: the one named, or the run's complete checkpoints.
  std::vector<std::string> candidates;
  std::optional<config::Experiment> run;  // RUN_DIR/config.yaml when the candidates come from RUN_DIR
  if (!args.checkpoint.empty()) {
    candidates.push_back(args.checkpoint);
  } else {
    run = experiment_of_run(args.run_dir, say);
    const std::string dir = run ? checkpoint::checkpoint_dir_of(args.run_dir, run->checkpoint)
                                : (fs::path(args.run_dir) / "checkpoints").string();
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
                                          if (run) check_belongs_to_run(path, stored, *run, args.run_dir);
                                        });

  const bool invariant =
      config::parse_experiment(stored.experiment_yaml, candidates[first] + ":/experiment", {}).reproducibility.invariant();
  std::vector<std::string> changing;
  for (const auto& o : args.overrides)
    if (!keeps_results(o, invariant)) changing.push_back(o);
  if (!changing.empty()) {
    std::string list;
    for (const auto& o : changing) list += (list.empty() ? "" : ", ") + o;
    if (say) fmt::print(say, "dtrain: warning: {} change{} the results: the rest of this run will differ from a run that was "
                       "never stopped\n", list, changing.size() == 1 ? "s" : "");
  }
  config::Experiment exp = load_on_every_rank(*workers, [&] {
    return config::parse_experiment(stored.experiment_yaml, candidates[first] + ":/experiment", args.overrides);
  });
  refuse_local_strategy_under_launcher(exp, *workers, "each would resume alone, all into one run directory");

  train::TrainerOptions options;
  options.run_dir = !args.run_dir.empty() ? args.run_dir : checkpoint::run_dir_of_checkpoint(candidates[first], exp.checkpoint);
  options.out = stdout;
  options.out_is_tty = observe::progress_reaches_a_terminal(stdout);
  options.workers = workers.get();
  options.stop_requested = &signals.requested();
  signals.set_directories(options.run_dir, checkpoint::checkpoint_dir_of(options.run_dir, exp.checkpoint));
  return naming_source(candidates[first] + ":/experiment", [&] {
  return train_or_evaluate(*workers, exp, options, [&](train::Trainer& trainer) {
    // Restoring verifies every checksum; a checkpoint that fails it is skipped for the previous one.
    // Those are older than the run's newest own checkpoint, so of its history (the point a resume
    // with --set branched from holds the experiment before the --set): not compared with it.
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
  }));
}

}  // namespace dtrain::app
