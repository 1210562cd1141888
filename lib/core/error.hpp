// Errors thrown inside lib/. Each says what failed, where, and what to do; apps/ maps the
// category to a documented exit code (README "Exit codes").
#pragma once

#include <stdexcept>
#include <string>

namespace dtrain {

enum class ErrorKind {
  config,    // the experiment or the command line is wrong (exit 2)
  input,     // a data file is missing, truncated or malformed (exit 2)
  io,        // writing run outputs failed (exit 3)
  internal,  // a broken invariant inside dtrain: a bug (exit 1)
  peer_lost, // another process of the job stopped answering within its timeout (exit 5)
  stopped,   // a signal asked to stop before the first training step: nothing to save (exit 4)
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const noexcept { return kind_; }

 private:
  ErrorKind kind_;
};

struct ConfigError : Error {
  explicit ConfigError(const std::string& message) : Error(ErrorKind::config, message) {}
};
// A ConfigError that every worker of a job raises at the same point and before any of them waits
// for another: a check of the experiment against the job's size (the global batch against the
// worker count), or an agreement that some failed a set-up step (distribute/agreement.hpp). Every
// worker exits with its code, none aborting the others: the chief alone reports it, or, marked
// per_rank, each worker that raised it reports it with its rank (its own error, which the others
// did not have).
struct JobConfigError : ConfigError {
  enum Reporter { chief, per_rank };
  explicit JobConfigError(const std::string& message, Reporter reporter = chief)
      : ConfigError(message), reported_by(reporter) {}
  Reporter reported_by;
};
struct InputError : Error {
  explicit InputError(const std::string& message) : Error(ErrorKind::input, message) {}
};
struct IoError : Error {
  explicit IoError(const std::string& message) : Error(ErrorKind::io, message) {}
};
// A worker, parameter server or coordinator that stopped answering: the job cannot go on, and
// `dtrain resume` continues from the last checkpoint.
struct PeerLostError : Error {
  explicit PeerLostError(const std::string& message) : Error(ErrorKind::peer_lost, message) {}
};
// A stop signal that arrived while the run was still being set up (building a large model):
// nothing was trained, so nothing was saved.
struct StoppedBeforeTraining : Error {
  explicit StoppedBeforeTraining(const std::string& message) : Error(ErrorKind::stopped, message) {}
};
struct InternalError : Error {
  explicit InternalError(const std::string& message) : Error(ErrorKind::internal, message) {}
};

[[noreturn]] void throw_internal(const char* expr, const char* file, int line, const std::string& detail);

}  // namespace dtrain

// Invariant checks that stay on in Release: a failed one is a dtrain bug, never bad user input
// (user input gets a ConfigError/InputError with a helpful message instead).
#define DTRAIN_CHECK(cond, detail)                                              \
  do {                                                                          \
    if (!(cond)) ::dtrain::throw_internal(#cond, __FILE__, __LINE__, (detail)); \
  } while (0)
