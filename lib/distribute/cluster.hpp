// The worker processes of a multi-worker job: MPI ranks (mpirun, srun). Rank 0 is the chief.
//
// A Cluster is made once per process (apps/ does it); without an MPI launcher it is a world of
// one and MPI is never initialized. Collectives between workers go through it with a watchdog:
// a collective that does not complete within the timeout makes every live rank say which ranks
// did not arrive, at which step and in which collective, and aborts the job (MPI_Abort) with
// kCollectiveTimeoutExit.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace dtrain::distribute {

inline constexpr int kCollectiveTimeoutExit = 5;

class Cluster {
 public:
  // Initializes MPI when the process was started by an MPI launcher (OpenMPI's mpirun, or a PMI
  // environment such as srun); otherwise a single worker.
  Cluster();
  ~Cluster();
  Cluster(const Cluster&) = delete;
  Cluster& operator=(const Cluster&) = delete;

  static bool launched_by_mpi();
  bool uses_mpi() const { return mpi_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  bool is_chief() const { return rank_ == 0; }
  // The whole job, whatever split() made of rank() and size().
  int world_rank() const { return world_rank_; }
  int world_size() const { return world_size_; }

  // Roles: from here on rank(), size() and every collective (and the watchdog) refer only to the
  // ranks that called it with the same `trains` — the training ranks, or the evaluator. Every
  // rank of the world calls it once, before its first collective.
  void split(bool trains);
  // The chief tells an evaluator (by world rank) that training has ended; the evaluator polls.
  void send_training_done(int world_rank);
  bool training_done();

  // What the watchdog reports: the global step and the collective in progress.
  void set_step(std::int64_t step) { step_ = step; }
  void set_timeout(double seconds) { timeout_seconds_ = seconds; }
  // While this worker's cores compute (a collective overlapping backward), a waiting collective
  // yields the core between polls however long it waits, leaving it to the computation rather
  // than backing off to sleeps. May be changed from another thread while a collective waits.
  void set_yield_while_waiting(bool yield) { yield_while_waiting_.store(yield, std::memory_order_relaxed); }

  // Element-wise sums over all workers, in place. `what` names the collective for the watchdog
  // ("gradients bucket 2", "step loss", ...). No-ops with one worker.
  void all_reduce_sum(std::span<float> values, const char* what);
  // The same sum by a chunked ring over point-to-point messages: a reduce-scatter of size - 1
  // steps, then an all-gather of size - 1 steps; each worker sends and receives 2 (size - 1) / size
  // of the data. Deterministic: each chunk's terms are added in a fixed order.
  void ring_all_reduce_sum(std::span<float> values, const char* what);
  void all_reduce_sum(std::span<double> values, const char* what);
  void all_reduce_sum(std::span<std::int64_t> values, const char* what);
  // The maximum over workers (agreeing on a stop request).
  int all_reduce_max(int value, const char* what);
  // Blocks until every worker arrived.
  void barrier(const char* what);
  // Ends every worker of the job at once (after this worker failed alone: the others would wait
  // for it in their next collective).
  [[noreturn]] void abort(int exit_code);

 private:
  enum class Element { f32, f64, i64, i32 };
  void all_reduce(void* data, int count, Element element, bool max, const char* what);
  void wait(void* requests, int count, const char* what);
  void answer_census();
  [[noreturn]] void report_timeout(const char* what);

  struct Comm;                  // the MPI communicator, kept out of this header
  std::unique_ptr<Comm> comm_;
  bool mpi_ = false;
  int rank_ = 0, size_ = 1;
  int world_rank_ = 0, world_size_ = 1;
  std::int64_t step_ = 0;
  std::uint64_t collective_ = 0;  // how many collectives this rank has entered
  double timeout_seconds_ = 300.0;
  std::atomic<bool> yield_while_waiting_{false};
  std::vector<float> ring_scratch_;  // one chunk, reused
};

}  // namespace dtrain::distribute
