// The threads a strategy runs its local replicas on: created once, one per replica when there
// are several (each with its own OpenMP thread count, so a replica's oneDNN primitives use its
// share of the cores), none when there is one (it runs on the calling thread).
//
// run(fn) publishes fn under a new generation; each thread runs it once with its replica's
// context. Made with CallerRuns::first_replica, the calling thread runs replica 0 itself (with the
// replica's OpenMP thread count for that time) and threads exist for the others: one thread fewer
// to wake per run and to wake the caller when it is done. Between runs the threads spin a few
// microseconds before they sleep: a run that follows at once (the optimizer's update split over a
// replica's lanes, right after their step) finds them awake. A replica that throws breaks the
// collectives' barrier, so the others stop (with BarrierBroken) instead of waiting for it; run()
// then resets the barrier and rethrows the first error.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "distribute/barrier.hpp"
#include "distribute/strategy.hpp"

namespace dtrain::distribute {

class ReplicaThreads {
 public:
  // contexts: one per local replica. collectives: the barrier the replicas meet at; it must
  // outlive this object.
  enum class CallerRuns { none, first_replica };
  ReplicaThreads(std::vector<ReplicaContext> contexts, int threads_per_replica, Barrier& collectives,
                 CallerRuns caller = CallerRuns::none);
  ~ReplicaThreads();
  ReplicaThreads(const ReplicaThreads&) = delete;
  ReplicaThreads& operator=(const ReplicaThreads&) = delete;

  void run(const Strategy::ReplicaFn& fn);

 private:
  void work(std::size_t replica);
  // Replica 0 on the calling thread; its error (not BarrierBroken) into `error`.
  void run_first_replica(const Strategy::ReplicaFn& fn, std::exception_ptr& error);

  std::vector<ReplicaContext> contexts_;
  int threads_per_replica_;
  Barrier& collectives_;
  std::size_t first_threaded_ = 0;  // 1 when the caller runs replica 0
  std::vector<std::thread> threads_;
  std::mutex mutex_;
  std::condition_variable start_cv_, done_cv_;
  const Strategy::ReplicaFn* task_ = nullptr;
  std::uint64_t generation_ = 0;
  int remaining_ = 0;
  std::atomic<int> remaining_seen_{0};  // remaining_ for the caller's short spin (replica_threads.cpp)
  std::atomic<std::uint64_t> generation_seen_{0};  // generation_ for the threads' short spin
  bool shutting_down_ = false;
  std::exception_ptr first_error_;
};

}  // namespace dtrain::distribute
