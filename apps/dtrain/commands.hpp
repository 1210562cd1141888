// The subcommands of the dtrain CLI, one function (and one file) each, Caffe-style. Each returns
// the process exit code; errors travel as exceptions to main(), which maps them (README "Exit
// codes").
#pragma once

#include <string>
#include <vector>

namespace dtrain::app {

// Documented exit codes.
enum ExitCode : int {
  kOk = 0,
  kInternalError = 1,  // a dtrain bug: please report it
  kBadInput = 2,       // bad experiment, bad --set, missing or malformed data
  kIoError = 3,        // could not write the run directory
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

int info_command();

}  // namespace dtrain::app
