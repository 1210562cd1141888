// SIGINT/SIGTERM/SIGUSR1 during training: the first asks the trainer to stop at the next step
// boundary (it saves a checkpoint and says how to resume); a second exits at once, removing the
// temporary of a file being written (set_directories) so that none is ever left behind.
//
// SIGUSR1 is there for mpirun: OpenMPI 4.1's mpirun forwards SIGUSR1 (and SIGUSR2) to every rank
// and lets the job end by itself, so the ranks stop at an agreed step, the chief saves, every rank
// exits 4 and mpirun returns 4. A SIGTERM or SIGINT to mpirun instead makes mpirun abort the job:
// it sends the ranks SIGTERM, SIGKILLs them after a grace and returns 1 itself (docs/multi_worker.md). Under an
// MPI launcher each rank also asks the kernel for SIGTERM when its launcher dies (a second signal
// to mpirun makes it exit at once), so no rank trains on without it.
//
// No dtrain thread ever runs a signal handler. oneDNN's jit_avx_gemm_f32 kernel (Dense layers with
// more than 252 inputs) briefly points RSP into a heap buffer; a signal delivered to that thread
// then has its frame written into the heap, and glibc later aborts with "malloc(): corrupted ...".
// So the constructor blocks SIGINT and SIGTERM in the calling thread, which every thread created
// afterwards inherits (replica threads, the OpenMP pool, MPI's threads), and one watcher thread
// takes the signals from a signalfd instead.
//
// Construct it in the main thread before anything starts a thread (before the worker group,
// whose MPI_Init starts some): a thread that already exists keeps its own mask and could still be hit.
#pragma once

#include <atomic>
#include <csignal>
#include <mutex>
#include <string>
#include <thread>

namespace dtrain::app {

class StopOnSignal {
 public:
  // Blocks SIGINT/SIGTERM in this thread and starts the watcher; throws InternalError if the
  // kernel refuses the signalfd or eventfd.
  StopOnSignal();
  // Stops the watcher, takes any stop signal still pending (the process is ending; its default
  // action would turn the exit code into a death by signal) and restores this thread's previous
  // mask. Call it on the constructing thread.
  ~StopOnSignal();
  StopOnSignal(const StopOnSignal&) = delete;
  StopOnSignal& operator=(const StopOnSignal&) = delete;

  // Non-zero (the signal number) once a stop was requested; the watcher thread sets it.
  const std::atomic<int>& requested() const { return stop_signal_; }

  // For a command that ends the process after this object: the destructor then leaves SIGINT,
  // SIGTERM and SIGUSR1 blocked instead of restoring the previous mask, so that a signal arriving
  // while the process exits (mpirun forwarding a late SIGUSR1) cannot replace its exit code by a
  // death by signal.
  void keep_blocked() { restore_mask_ = false; }

  // The command is done and returns `exit_code` (returned here): nothing is left for a signal to
  // stop, so one that arrives while the process shuts down ends it quietly with that code (stdout
  // flushed) instead of announcing a checkpoint. Under mpirun that is the SIGTERM mpirun sends a
  // rank still finalizing once another has exited non-zero: after a stop (4, checkpoint saved,
  // resume command printed) or after an error every rank refused alike (2, reported once).
  int finished(int exit_code);

  // Where the run writes files (the run directory, with config.yaml and the metrics, and the
  // checkpoint directory): on a second signal the watcher takes each one's TemporaryNamesLock
  // (checkpoint/checkpoint.hpp) exclusive, removes this process's temporaries there
  // (<name>.tmp-<pid>) and exits holding the locks, so that no write in flight leaves a new one.
  // Set them before training starts.
  void set_directories(const std::string& run_dir, const std::string& checkpoint_dir);

 private:
  void watch();
  void close_fds() noexcept;

  std::atomic<int> stop_signal_{0};
  std::atomic<int> finished_code_{-1};  // the command's exit code once it returned
  bool restore_mask_ = true;
  std::mutex directories_mutex_;
  std::string run_dir_;
  std::string checkpoint_dir_;
  sigset_t previous_mask_{};
  int signal_fd_ = -1;
  int wake_fd_ = -1;  // an eventfd: the destructor writes it so the watcher's poll() returns
  std::thread watcher_;
};

}  // namespace dtrain::app
