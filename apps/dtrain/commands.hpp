// The subcommands of the dtrain CLI, one function (and one file) each, Caffe-style. Each returns
// the process exit code; errors travel as exceptions to main(), which maps them (README "Exit
// codes").
#pragma once

#include <atomic>
#include <exception>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace dtrain::config {
struct Experiment;
}
namespace dtrain::train {
struct Interrupted;
struct TrainerOptions;
struct StepHold;
class Trainer;
}
namespace dtrain::distribute {
class WorkerGroup;
}
namespace dtrain::nn {
class Sequential;
}

namespace dtrain::app {

class StopOnSignal;

// Documented exit codes.
enum ExitCode : int {
  kOk = 0,
  kInternalError = 1,  // a dtrain bug: please report it
  kBadInput = 2,       // bad experiment, bad --set, missing or malformed data or checkpoint
  kIoError = 3,        // could not write the run directory or a checkpoint
  kInterrupted = 4,    // stopped by SIGINT/SIGTERM after saving a checkpoint; `dtrain resume` goes on (or
                       // before the first step, while the model was built: nothing saved)
  kCollectiveTimeout = 5,  // a collective between workers did not complete in time, or another process of
                           // the job (parameter server, coordinator, every worker) stopped answering
};

struct RunArgs {
  std::string experiment;
  std::vector<std::string> overrides;
  std::string run_dir;  // empty = runs/<name>
  bool overwrite = false;  // replace an earlier run in run_dir instead of refusing
};
int run_command(const RunArgs& args);

struct ValidateArgs {
  std::string experiment;
  std::vector<std::string> overrides;
};
int validate_command(const ValidateArgs& args);

struct EvalArgs {
  std::string checkpoint;
  std::string experiment;  // empty = the experiment stored in the checkpoint
  std::string split = "test";
  std::vector<std::string> overrides;
  std::string predictions;  // write every sample's inputs, logits and labels here (HDF5); empty = no
};
int eval_command(const EvalArgs& args);

struct ExportArgs {
  std::string checkpoint;  // empty: the model as `experiment` initializes it, before any step
  std::string output;      // the .onnx or .weights.h5 file, replaced atomically
  std::string experiment;  // empty = the experiment stored in the checkpoint
  std::vector<std::string> overrides;
  std::string format = "onnx";  // onnx: the inference graph; keras: a Keras 3 .weights.h5 file
  bool softmax = false;    // append a Softmax: the output is then probabilities (onnx)
};
int export_command(const ExportArgs& args);

struct OrderArgs {
  std::string experiment;
  std::vector<std::string> overrides;
  std::string output;      // a .npy file, replaced atomically
  long long epochs = 0;    // 0 = the experiment's train.epochs
};
int order_command(const OrderArgs& args);

struct ResumeArgs {
  std::string run_dir;     // continue from its newest valid checkpoint
  std::string checkpoint;  // or from this one
  std::vector<std::string> overrides;
};
int resume_command(const ResumeArgs& args);

int info_command();

struct InitArgs {
  std::string strategy;  // empty: the default kind
  std::string model = "cnn";
  std::string output;  // empty = stdout
  bool force = false;  // replace an existing output file
};
int init_command(const InitArgs& args);

struct PlotArgs {
  std::vector<std::string> run_dirs;
  std::string output;  // empty = RUN_DIR/curves.png for one run, curves.png for several
};
int plot_command(const PlotArgs& args);
struct BenchArgs {
  std::string experiment;
  std::vector<std::string> overrides;
  long long steps = 50;   // timed training steps
  long long warmup = 10;  // untimed steps before them
  bool json = false;      // one JSON object instead of the table
};
int bench_command(const BenchArgs& args);

// The exit code for an exception escaping a subcommand (main() uses it too).
int exit_code_for(const std::exception& error);

// Runs a training subcommand's body on every worker: a failure that only this worker sees must
// not leave the others waiting in a collective, so with several workers it ends the whole job.
// After a process of the job was lost (WorkerGroup::rank_lost) it ends this process alone, with
// the body's exit code or its error's, without finalizing MPI. A JobConfigError (core/error.hpp)
// is the other exception: every rank raised it alike, so the chief alone reports it and every
// rank returns its exit code, none ending the others.
int run_as_worker(distribute::WorkerGroup& workers, const std::function<int()>& body);

// Under an MPI launcher that started more than one process, a strategy that does not span worker
// processes (distribute::spans_workers) would have each process train alone
// (`consequence` says what that does to the command). Refused (JobConfigError, exit 2) before
// anything is written, naming the strategy's place in the experiment and what to use instead.
void refuse_local_strategy_under_launcher(const config::Experiment& experiment, const distribute::WorkerGroup& workers,
                                          const std::string& consequence);

// The tests' hold on the training loop (train::StepHold), from the environment:
// DTRAIN_TEST_HOLD_AT_STEP=N and DTRAIN_TEST_HOLD_DIR=DIR hold every training process after global
// step N (0: before its model is built) until a signal stops it or DIR/release exists. Off when either is unset.
// DTRAIN_TEST_HOLD_AT_STEP=exit holds no step: see finish_command.
train::StepHold test_hold_from_environment(const std::atomic<int>* stop_requested);

// How run and resume end: tells `signals` the command returned `code` (a signal from now on ends
// the process quietly with it) and returns it. With DTRAIN_TEST_HOLD_AT_STEP=exit and
// DTRAIN_TEST_HOLD_DIR=DIR every process first writes DIR/held.rank<R> and waits, its exit code
// decided and MPI not yet finalized, until DIR/release exists, a signal ends it or a minute has
// passed: the moment at which mpirun's SIGTERM reaches a rank whose peer has already exited.
int finish_command(StopOnSignal& signals, const distribute::WorkerGroup& workers, int code);

// Under a launcher whose own exit status cannot carry the job's (mpirun 4.1 --enable-recovery
// exits 0 whatever its ranks return), world rank 0 (the chief, the coordinator) writes its exit
// code into the file DTRAIN_JOB_STATUS names, when set, before it ends; tools/dtrain-mpirun reads
// it. Nothing happens without the variable, or on other ranks.
void record_job_status(const distribute::WorkerGroup& workers, int code);

// `load` (an experiment: its file, a checkpoint's copy, the --set overrides) on every rank of the
// job, agreeing on the outcome (distribute::agree_on_every_worker): where every rank fails (they
// read the same files and arguments) the chief alone reports the error; where some do, each of
// them reports its own with its rank; every rank exits 2 without an MPI abort.
config::Experiment load_on_every_rank(distribute::WorkerGroup& workers, const std::function<config::Experiment()>& load);

// What run and resume do on every rank: under a strategy that spans the workers the roles
// (strategy.roles, TF_CONFIG) split the MPI world into the training ranks and the evaluator. A
// training rank builds its Trainer, runs `prepare` on it (resume restores there), trains, and the
// chief then tells the evaluator training has ended; the evaluator rank evaluates each new
// checkpoint.
int train_or_evaluate(distribute::WorkerGroup& workers, config::Experiment& experiment, const train::TrainerOptions& options,
                      const std::function<void(train::Trainer&)>& prepare);

// Runs `body`; a ConfigError from it that does not name `source` (an experiment read from a
// checkpoint: "<file>:/experiment") is rethrown with `source` in front, so that an error in a
// stored experiment names the checkpoint it came from. A stop on a non-finite loss is not an
// error of the stored experiment and passes unchanged.
int naming_source(const std::string& source, const std::function<int()>& body);

// ConfigError when `output` (what `option` names to write: --predictions, -o) is one of the
// command's `inputs` (the checkpoint, the experiment file) or `experiment`'s data files under any
// spelling or link: the write would replace a file the command reads. Empty names are skipped.
void refuse_writing_onto(const std::string& output, const char* option, std::vector<std::string> inputs,
                         const config::Experiment& experiment);

// The values of model.initial_weights (a Keras 3 weights file) for `model`'s variables, in
// model.variables() order; empty when the experiment names no file. An error reading it names the
// key's place in the experiment (file:line:column, or the --set) and the file.
std::vector<std::vector<float>> read_initial_weights(const config::Experiment& experiment, const nn::Sequential& model);
// A new run's start (run, bench): the trainer's variables from model.initial_weights, when set.
void start_from_initial_weights(train::Trainer& trainer);

// Prints where the run stopped and the command that continues it; returns kInterrupted.
int report_interrupted(const train::Interrupted& stop, const std::string& run_dir);

}  // namespace dtrain::app
