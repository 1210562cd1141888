#include "distribute/agreement.hpp"

#include <string>

#include <fmt/format.h>

namespace dtrain::distribute {

void agree_on_every_worker(Communicator& job, const char* what, const std::function<void()>& step) {
  if (job.size() == 1) return step();
  std::string error;
  try {
    step();
  } catch (const ConfigError& e) {
    error = e.what();
  } catch (const InputError& e) {
    error = e.what();
  }
  const int failed = error.empty() ? 0 : 1;
  if (job.all_reduce_max(failed, what) == 0) return;
  const bool every_worker = -job.all_reduce_max(-failed, what) == 1;
  if (every_worker) throw JobConfigError(error);
  if (failed) throw JobConfigError(error, JobConfigError::per_rank);
  throw JobConfigError(fmt::format("other ranks failed {}: each reports its error with its rank", what));
}

}  // namespace dtrain::distribute
