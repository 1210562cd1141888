#include "distribute/agreement.hpp"

#include <functional>
#include <string>

#include <fmt/format.h>

namespace dtrain::distribute {

bool same_on_every_worker(Communicator& job, const std::string& value, const char* what) {
  const int digest = static_cast<int>(std::hash<std::string>{}(value) & 0x7fffffff);
  return job.all_reduce_max(digest, what) == -job.all_reduce_max(-digest, what);
}

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
  if (every_worker) {
    // One error everywhere (one file every process reads) is the chief's to report; different
    // ones (each rank's own files) are each rank's.
    throw JobConfigError(error, same_on_every_worker(job, error, what) ? JobConfigError::chief
                                                                       : JobConfigError::per_rank);
  }
  if (failed) throw JobConfigError(error, JobConfigError::per_rank);
  throw JobConfigError(fmt::format("other ranks failed {}: each reports its error with its rank", what));
}

}  // namespace dtrain::distribute
