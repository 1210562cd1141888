// The worker processes of a job, as the apps see them: a Communicator over the ranks that train
// together, plus what roles and the end of a job need. An MPI job (MpiCommunicator) when the
// process was started by an MPI launcher (mpirun, srun), else a group of one (SingleCommunicator).
// Made once per process, by the app, before anything else starts a thread except the signal
// watcher (MPI_Init starts some).
#pragma once

#include <functional>
#include <memory>
#include <optional>

#include "config/experiment.hpp"
#include "distribute/communicator.hpp"
#include "distribute/roles.hpp"

namespace dtrain::distribute {

class WorkerGroup : public Communicator {
 public:
  // The whole job, whatever assign_roles made of rank() and size().
  virtual int world_rank() const = 0;
  virtual int world_size() const = 0;
  // Resolves strategy.roles and TF_CONFIG (tf_config: its value, or null) against the job
  // (roles.hpp; ConfigError when they disagree) and, from here on, makes rank(), size() and every
  // collective refer only to this rank's side: the training ranks, or the evaluator. Every rank of
  // the job calls it once, before its first collective. A process not started by an MPI launcher
  // has no roles: nullopt, and nothing changes.
  virtual std::optional<RolePlan> assign_roles(const config::RolesConfig& roles, const char* tf_config) = 0;
  // The chief tells an evaluator (by world rank) that training has ended, and whether a process
  // was lost (rank_lost()); the evaluator polls, and a lost process told is noted here too.
  virtual void send_training_done(int world_rank) = 0;
  virtual bool training_done() = 0;
  // Ends every process of the job at once with this exit code (after this one failed alone: the
  // others would wait for it in their next collective).
  [[noreturn]] void abort(int exit_code);
  // Called with the exit code as a collective that timed out is about to abort the job (the
  // watchdog, on the rank that timed out and on those it told), so that the app can record how
  // the job ended (tools/dtrain-mpirun reads it).
  void on_watchdog_abort(std::function<void(int exit_code)> hook) { watchdog_abort_ = std::move(hook); }

  // A process of the job died and this one outlived it (Strategy::lost_a_rank). With OpenMPI
  // 4.1.4 under mpirun --enable-recovery (measured), MPI_Finalize then waits forever over TCP,
  // and over shared memory too once another survivor has ended without finalizing; MPI_Abort
  // ends the other survivors before they report. Such a process ends with end_without_finalize.
  void note_rank_lost() { rank_lost_ = true; }
  bool rank_lost() const { return rank_lost_; }
  // Ends this process with exit_code, its output flushed, without MPI_Finalize.
  [[noreturn]] void end_without_finalize(int exit_code);

 protected:
  // Ends the other processes of the job, best effort; abort() then ends this one.
  virtual void end_job(int exit_code) = 0;
  void before_watchdog_abort(int exit_code) const {
    if (watchdog_abort_) watchdog_abort_(exit_code);
  }

 private:
  bool rank_lost_ = false;
  std::function<void(int)> watchdog_abort_;
};

// The worker group of this process: MPI when launched by an MPI launcher, else a group of one.
std::unique_ptr<WorkerGroup> make_worker_group();

}  // namespace dtrain::distribute
