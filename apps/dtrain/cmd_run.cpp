#include <unistd.h>

#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <optional>
#include <string_view>

#include <fmt/format.h>

#include "commands.hpp"
#include "config/parse.hpp"
#include "core/atomic_file.hpp"
#include "core/error.hpp"
#include "distribute/agreement.hpp"
#include "distribute/roles.hpp"
#include "distribute/strategy.hpp"
#include "distribute/worker_group.hpp"
#include "interop/keras_weights.hpp"
#include "observe/observers.hpp"
#include "signals.hpp"
#include "train/callbacks.hpp"
#include "train/evaluator.hpp"
#include "checkpoint/manager.hpp"
#include "checkpoint/run_dir.hpp"
#include "train/trainer.hpp"

namespace dtrain::app {

// DTRAIN_TEST_HOLD_AT_STEP's value that holds after the command instead of at a step.
constexpr std::string_view kHoldAtExit = "exit";

void record_job_status(const distribute::WorkerGroup& workers, int code) {
  const char* path = std::getenv("DTRAIN_JOB_STATUS");
  if (path == nullptr || *path == '\0' || workers.world_rank() != 0) return;
  try {
    write_file_atomically(path, fmt::format("{}\n", code));
  } catch (const std::exception& e) {
    fmt::print(stderr, "dtrain: warning: DTRAIN_JOB_STATUS: {}\n", e.what());
  }
}

config::Experiment load_on_every_rank(distribute::WorkerGroup& workers, const std::function<config::Experiment()>& load) {
  std::optional<config::Experiment> exp;
  distribute::agree_on_every_worker(workers, "loading the experiment", [&] { exp = load(); });
  return std::move(*exp);
}

int run_as_worker(distribute::WorkerGroup& workers, const std::function<int()>& body) {
  const bool alone = workers.size() == 1;  // before the body: roles may split the group
  workers.on_watchdog_abort([&workers](int code) { record_job_status(workers, code); });
  int code = kOk;
  try {
    code = body();
  } catch (const JobConfigError& e) {
    // Every worker raised one before any waits for another: the chief's report (or each one's own
    // with its rank), and the job ends with its code without an abort.
    if (e.reported_by == JobConfigError::per_rank) {
      std::fflush(stdout);
      fmt::print(stderr, "dtrain: error: rank {}: {}\n", workers.world_rank(), e.what());  // mpirun's rank
    } else if (workers.world_rank() == 0) {
      std::fflush(stdout);
      fmt::print(stderr, "dtrain: error: {}\n", e.what());
    }
    record_job_status(workers, exit_code_for(e));
    return exit_code_for(e);
  } catch (const std::exception& e) {
    if (alone) {
      record_job_status(workers, exit_code_for(e));
      throw;  // main() reports it
    }
    std::fflush(stdout);
    fmt::print(stderr, "dtrain: error: rank {}: {}\n", workers.world_rank(), e.what());
    code = exit_code_for(e);
    record_job_status(workers, code);
    if (!workers.rank_lost()) workers.abort(code);
  }
  record_job_status(workers, code);
  // After a lost process, neither MPI_Finalize (on return) nor MPI_Abort (worker_group.hpp): every
  // survivor ends here with its own code, the coordinator's being the job's.
  if (workers.rank_lost()) workers.end_without_finalize(code);
  return code;
}

void refuse_local_strategy_under_launcher(const config::Experiment& experiment, const distribute::WorkerGroup& workers,
                                          const std::string& consequence) {
  if (workers.world_size() <= 1 || distribute::spans_workers(experiment.strategy)) return;
  // The kind's place: file:line:column, the --set that gave it, or the file when it was left out.
  const config::SourceLocation& where = experiment.strategy.where;
  const bool left_out = where.line == 0 && !where.file.starts_with("--set");
  // The kinds that span processes: "a (or b, c)".
  const std::vector<std::string_view> across = distribute::kinds_spanning_workers();
  std::string use = across.empty() ? std::string() : std::string(across.front());
  if (across.size() > 1)
    use += fmt::format(" (or {})", fmt::join(std::vector<std::string_view>(across.begin() + 1, across.end()), ", "));
  throw JobConfigError(fmt::format(
      "{}strategy kind {}{} runs in one process, but mpirun started {} processes: {}; to train across the processes "
      "use strategy kind {}, or run without mpirun",
      config::location_prefix(where, left_out ? config::SourceLocation{experiment.source_file, 0, 0} : where),
      experiment.strategy.kind, left_out ? " (strategy left out)" : "", workers.world_size(), consequence, use));
}

int report_interrupted(const train::Interrupted& stop, const std::string& run_dir) {
  std::fflush(stdout);
  if (stop.checkpoint.empty() && !run_dir.empty()) return kInterrupted;  // a worker other than the chief
  fmt::print(stderr, "dtrain: stopped at epoch {}, step {} of it; checkpoint {}\ndtrain: continue with: dtrain resume {}\n",
             stop.epoch + 1, stop.step_in_epoch, stop.checkpoint.empty() ? "(none: no run directory)" : stop.checkpoint,
             run_dir);
  return kInterrupted;
}

train::StepHold test_hold_from_environment(const std::atomic<int>* stop_requested) {
  train::StepHold hold;
  const char* step = std::getenv("DTRAIN_TEST_HOLD_AT_STEP");
  const char* dir = std::getenv("DTRAIN_TEST_HOLD_DIR");
  if (step == nullptr || dir == nullptr) return hold;
  const std::string_view text(step);
  if (text == kHoldAtExit) return hold;  // finish_command's
  std::int64_t value = -1;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size() || value < 0)
    throw ConfigError(fmt::format("DTRAIN_TEST_HOLD_AT_STEP={}: not a global step (a whole number; 0 holds before the "
                                  "model is built)", text));
  hold.step = value;
  hold.dir = dir;
  hold.released_by = stop_requested;
  return hold;
}

int finish_command(StopOnSignal& signals, const distribute::WorkerGroup& workers, int code) {
  signals.finished(code);
  const char* step = std::getenv("DTRAIN_TEST_HOLD_AT_STEP");
  const char* dir = std::getenv("DTRAIN_TEST_HOLD_DIR");
  if (step != nullptr && dir != nullptr && std::string_view(step) == kHoldAtExit) {
    std::fflush(stdout);  // what the command printed is out before the test acts
    train::StepHold hold;
    hold.dir = dir;
    // The watcher ends the process on a signal; were it to take the signal as a stop instead, the
    // hold lets go and the process ends as it would have, announcing a checkpoint the test sees.
    hold.released_by = &signals.requested();
    // A peer finalizing waits on this process: a test that broke must fail in a minute, not ten.
    hold.limit_seconds = 60.0;
    train::hold_here(hold, workers.world_rank(), fmt::format("after the command, exit code {}", code));
  }
  return code;
}

std::string continue_after_loss(const std::string& run_dir, const std::string& checkpoint_dir) {
  if (!run_dir.empty() && !checkpoint_dir.empty() && !checkpoint::list_checkpoints(checkpoint_dir).empty())
    return fmt::format("continue with: dtrain resume {}", run_dir);
  return fmt::format("no checkpoint was written before it{}, so there is nothing to resume: run the experiment again",
                     checkpoint_dir.empty() ? "" : fmt::format(" (in {})", checkpoint_dir));
}

std::vector<std::vector<float>> read_initial_weights(const config::Experiment& experiment, const nn::Sequential& model) {
  if (experiment.model.initial_weights.empty()) return {};
  try {
    return interop::read_keras_weights(experiment.model.initial_weights, model);
  } catch (const InputError& e) {
    throw InputError(fmt::format("{}model.initial_weights: {}",
                                 config::given_prefix(experiment.initial_weights_where,
                                                      config::SourceLocation{experiment.source_file, 0, 0}),
                                 e.what()));
  }
}

void start_from_initial_weights(train::Trainer& trainer) {
  const std::vector<std::vector<float>> values = read_initial_weights(trainer.experiment(), trainer.model());
  if (!values.empty()) trainer.set_variables(values);
}

int train_or_evaluate(distribute::WorkerGroup& workers, config::Experiment& experiment, const train::TrainerOptions& options,
                      const std::function<void(train::Trainer&)>& prepare) {
  std::optional<distribute::RolePlan> roles;
  if (const config::RolesConfig* written = distribute::roles_of(experiment.strategy))
    roles = workers.assign_roles(*written, std::getenv("TF_CONFIG"));
  if (roles && roles->role_of(workers.world_rank()) == distribute::Role::evaluator) {
    train::TrainerOptions mine = options;
    mine.out = stdout;
    mine.purpose = train::TrainerOptions::Purpose::job_evaluator;
    std::optional<train::Trainer> evaluating;
    try {
      evaluating.emplace(std::move(experiment), mine);
    } catch (const Error& e) {
      // An evaluator that cannot build its model or read its data fails alone, as TensorFlow's
      // evaluator task does: training goes on without it. It says so at once, waits for the
      // chief's word that training has ended (an error here would have mpirun end the training
      // ranks), and then ends with its own error, without an abort.
      std::fflush(stdout);
      fmt::print(stderr, "dtrain: error: rank {} (evaluator): {}; training goes on without the evaluator\n",
                 workers.world_rank(), e.what());
      train::wait_for_training(workers, options.stop_requested);
      throw JobConfigError(fmt::format("the evaluator evaluated no checkpoint ({})", e.what()), JobConfigError::per_rank);
    }
    train::Trainer& trainer = *evaluating;
    train::EvaluatorOptions eval;
    eval.run_dir = options.run_dir;
    eval.stop_requested = options.stop_requested;
    train::run_evaluator(trainer, workers, eval);
    return options.stop_requested && options.stop_requested->load() != 0 ? kInterrupted : kOk;
  }
  std::unique_ptr<train::Trainer> built;
  // A process lost during training, noted before the trainer goes on every way out (the worker
  // group outlives it), so that run_as_worker ends this process without finalizing MPI.
  auto note_loss = [&] {
    if (built && built->strategy().lost_a_rank()) workers.note_rank_lost();
  };
  // The evaluator stops once the chief says training has ended, stopped or not. Before the
  // trainer exists the chief is world rank 0.
  auto tell_evaluators = [&] {
    if (!roles || !(built ? built->strategy().is_chief() : workers.world_rank() == 0)) return;
    note_loss();  // passed on: an evaluator must not finalize either
    for (int r = roles->training_ranks(); r < roles->world_size(); ++r) workers.send_training_done(r);
  };
  // Where a job that lost a process goes on from: named only when a checkpoint is there.
  const std::string checkpoints = checkpoint::checkpoint_dir_of(options.run_dir, experiment.checkpoint);
  try {
    train::TrainerOptions training = options;
    training.hold = test_hold_from_environment(options.stop_requested);
    training.observers = observe::add_observers;  // progress, metrics.jsonl, TensorBoard, curves
    built = std::make_unique<train::Trainer>(std::move(experiment), training);
  } catch (const JobConfigError&) {
    tell_evaluators();  // the training ranks all end here, without an abort that would end the evaluator
    throw;
  }
  train::Trainer& trainer = *built;
  struct NoteOnExit {
    const std::function<void()> note;
    ~NoteOnExit() { note(); }
  } noted{note_loss};
  if (roles && roles->evaluators > 0 && trainer.strategy().is_chief())
    fmt::print(options.out, "roles ({}): {}; rank {} evaluates each new checkpoint\n", roles->source, roles->describe(),
               roles->training_ranks());
  prepare(trainer);
  try {
    trainer.fit();
  } catch (const train::Interrupted& stop) {
    tell_evaluators();
    return report_interrupted(stop, options.run_dir);
  } catch (const PeerLostError& e) {
    try {
      if (trainer.strategy().lost_a_rank()) tell_evaluators();
    } catch (const std::exception&) {
    }
    throw PeerLostError(fmt::format("{}; {}", e.what(), continue_after_loss(options.run_dir, checkpoints)));
  } catch (const std::exception&) {
    // After a lost rank no MPI_Abort ends the evaluator (run_as_worker): it is told. Best effort:
    // the error on its way out says why the job ends.
    try {
      if (trainer.strategy().lost_a_rank()) tell_evaluators();
    } catch (const std::exception&) {
    }
    throw;
  }
  tell_evaluators();
  return kOk;
}

int run_command(const RunArgs& args) {
  // First: MPI_Init and the compute start threads, and each must inherit the mask that keeps
  // SIGINT/SIGTERM off it (signals.hpp).
  StopOnSignal signals;
  signals.keep_blocked();  // the process ends after this command
  const std::unique_ptr<distribute::WorkerGroup> workers = distribute::make_worker_group();
  return finish_command(signals, *workers, run_as_worker(*workers, [&] {
    config::Experiment exp =
        load_on_every_rank(*workers, [&] { return config::load_experiment(args.experiment, args.overrides); });
    refuse_local_strategy_under_launcher(exp, *workers, "each would train alone, all into one run directory");
    train::TrainerOptions options;
    options.workers = workers.get();
    const bool chief = workers->world_rank() == 0;
    options.run_dir = args.run_dir;
    if (options.run_dir.empty()) {
      // runs/<name>, or the next runs/<name>-N when it holds an earlier run: the chief looks, and
      // every rank (the evaluator too) learns its choice before anyone writes.
      const std::string base = "runs/" + exp.name;
      const int mine = chief && !args.overwrite ? checkpoint::free_run_number(base, exp.checkpoint) : 0;
      const int number = workers->all_reduce_max(mine, "run directory");
      options.run_dir = checkpoint::numbered_run_dir(base, number);
      if (chief && number > 0)
        fmt::print("{} holds an earlier run; this run writes into {}\n", base, options.run_dir);
    }
    // The chief owns the run directory: it keeps an earlier run there, or replaces it on request.
    if (chief) {
      const std::string checkpoints = checkpoint::checkpoint_dir_of(options.run_dir, exp.checkpoint);
      if (args.overwrite) {
        checkpoint::remove_earlier_run(options.run_dir, checkpoints);
      } else {
        checkpoint::refuse_to_overwrite(options.run_dir, checkpoints);
      }
    }
    options.out = stdout;
    options.out_is_tty = observe::progress_reaches_a_terminal(stdout);
    options.stop_requested = &signals.requested();
    signals.set_directories(options.run_dir, checkpoint::checkpoint_dir_of(options.run_dir, exp.checkpoint));
    return train_or_evaluate(*workers, exp, options, start_from_initial_weights);
  }));
}

}  // namespace dtrain::app
