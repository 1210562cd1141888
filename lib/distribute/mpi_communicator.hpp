// The worker processes of a multi-worker job as MPI ranks (mpirun, srun). Rank 0 is the chief.
//
// Collectives go through a watchdog: a collective that does not complete within the timeout makes
// every live rank say which ranks did not arrive, at which step and in which collective, and
// aborts the job (MPI_Abort) with kCollectiveTimeoutExit. Errors come back from MPI as return
// codes (MPI_ERRORS_RETURN); every call is checked, and a failed one throws an InternalError
// naming the MPI call, this rank and MPI's error string — except inside the watchdog's abort
// sequence, the destructor and abort(), which are best effort and never throw.
//
// MPI is initialized MPI_THREAD_SERIALIZED: one thread at a time calls into it (the main thread,
// replica 0's thread, or the communication thread of an overlapping PackedAllReduce, handed over
// through a mutex).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "distribute/ring.hpp"
#include "distribute/worker_group.hpp"

namespace dtrain::distribute {

inline constexpr int kCollectiveTimeoutExit = 5;

class MpiCommunicator final : public WorkerGroup, private RingTransport {
 public:
  // Initializes MPI; the process should have been started by an MPI launcher (launched_by_mpi).
  MpiCommunicator();
  ~MpiCommunicator() override;

  // Whether this process was started by OpenMPI's mpirun or in a PMI environment such as srun.
  static bool launched_by_mpi();

  const char* name() const override { return "mpi"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  // MPI_Iallreduce / MPI_Ireduce, waited for by the watchdog.
  void all_reduce_sum(std::span<float> values, const char* what) override;
  void all_reduce_sum(std::span<double> values, const char* what) override;
  void all_reduce_sum(std::span<std::int64_t> values, const char* what) override;
  int all_reduce_max(int value, const char* what) override;
  void reduce_sum_to(std::span<float> values, int root, const char* what) override;
  void broadcast(std::span<float> values, int root, const char* what) override;
  void broadcast(std::span<double> values, int root, const char* what) override;

  void set_step(std::int64_t step) override { step_ = step; }
  void set_timeout(double seconds) override { timeout_seconds_ = seconds; }
  void set_yield_while_waiting(bool yield) override { yield_while_waiting_.store(yield, std::memory_order_relaxed); }

  int world_rank() const override { return world_rank_; }
  int world_size() const override { return world_size_; }
  std::optional<RolePlan> assign_roles(const config::RolesConfig& roles, const char* tf_config) override;
  void send_training_done(int world_rank) override;
  bool training_done() override;

 private:
  void end_job(int exit_code) override;
  enum class Element { f32, f64, i64, i32 };
  enum class Failure { raise, ignore };  // ignore: the best-effort paths

  RingTransport& ring_transport() override { return *this; }
  // The ring over point-to-point messages: one chunk of scratch, reused.
  void open(std::span<float> values, const char* what) override;
  void exchange(std::span<float> values, RingChunk send, RingChunk recv, bool accumulate, const char* what) override;

  // An all-reduce (root < 0) or a reduce onto root.
  void reduce(void* data, std::size_t count, Element element, bool max, int root, const char* what);
  void wait(void* requests, int count, const char* what);
  void broadcast(void* data, std::size_t count, Element element, int root, const char* what);
  // Whether rc is MPI_SUCCESS; otherwise throws (Failure::raise) or returns false.
  bool succeeded(int rc, const char* call, Failure failure) const;
  void split(bool trains);
  // Every rank's MPI_Get_processor_name in comm_'s rank order (one all-gather); hosts_ stays empty
  // when they are all alike, so one-host messages do not repeat the host.
  void learn_hosts();
  // Answers another rank's census request, and prints its abort notice when one arrived.
  void answer_census(Failure failure);
  [[noreturn]] void report_timeout(const char* what);

  struct Comm;  // the MPI communicator, kept out of this header
  std::unique_ptr<Comm> comm_;
  int rank_ = 0, size_ = 1;
  int world_rank_ = 0, world_size_ = 1;
  std::int64_t step_ = 0;
  std::uint64_t collective_ = 0;  // how many collectives this rank has entered
  double timeout_seconds_ = 300.0;
  std::atomic<bool> yield_while_waiting_{false};
  std::vector<float> ring_scratch_;  // one chunk, reused
  std::vector<std::string> hosts_;   // by rank of comm_, when the ranks span several hosts
};

}  // namespace dtrain::distribute
