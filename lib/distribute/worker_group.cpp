#include "distribute/worker_group.hpp"

#include <cstdio>
#include <cstdlib>

#include "distribute/mpi_communicator.hpp"
#include "distribute/single_communicator.hpp"

namespace dtrain::distribute {

void WorkerGroup::abort(int exit_code) {
  std::fflush(stdout);
  std::fflush(stderr);
  end_job(exit_code);
  std::_Exit(exit_code);
}

void WorkerGroup::end_without_finalize(int exit_code) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(exit_code);
}

std::unique_ptr<WorkerGroup> make_worker_group() {
  if (MpiCommunicator::launched_by_mpi()) return std::make_unique<MpiCommunicator>();
  return std::make_unique<SingleCommunicator>();
}

}  // namespace dtrain::distribute
