// The subcommands of the dtrain CLI, one function (and one file) each, Caffe-style. Each returns
// the process exit code; errors travel as exceptions to main(), which maps them (README "Exit
// codes").
#pragma once

#include <string>
#include <vector>

namespace dtrain::train {
struct Interrupted;
}

namespace dtrain::app {

// Documented exit codes.
enum ExitCode : int {
  kOk = 0,
  kInternalError = 1,  // a dtrain bug: please report it
  kBadInput = 2,       // bad experiment, bad --set, missing or malformed data or checkpoint
  kIoError = 3,        // could not write the run directory or a checkpoint
  kInterrupted = 4,    // stopped by SIGINT/SIGTERM after saving a checkpoint; `dtrain resume` goes on
};

struct RunArgs {
  std::string experiment;
  std::vector<std::string> overrides;
  std::string run_dir;  // empty = runs/<name>
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
};
int eval_command(const EvalArgs& args);

struct ResumeArgs {
  std::string run_dir;     // continue from its newest valid checkpoint
  std::string checkpoint;  // or from this one
  std::vector<std::string> overrides;
};
int resume_command(const ResumeArgs& args);

int info_command();

// Prints where the run stopped and the command that continues it; returns kInterrupted.
int report_interrupted(const train::Interrupted& stop, const std::string& run_dir);

}  // namespace dtrain::app
