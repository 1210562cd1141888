#include "distribute/replica_threads.hpp"

#include <omp.h>

#include "core/compute_thread.hpp"

namespace dtrain::distribute {

namespace {

constexpr std::chrono::microseconds kSpinForNextRun{100};

}  // namespace

ReplicaThreads::ReplicaThreads(std::vector<ReplicaContext> contexts, int threads_per_replica, Barrier& collectives,
                               CallerRuns caller)
    : contexts_(std::move(contexts)), threads_per_replica_(threads_per_replica), collectives_(collectives),
      first_threaded_(caller == CallerRuns::first_replica ? 1 : 0) {
  if (contexts_.size() < 2) return;
  threads_.reserve(contexts_.size());
  for (std::size_t r = first_threaded_; r < contexts_.size(); ++r) threads_.emplace_back(&ReplicaThreads::work, this, r);
}

ReplicaThreads::~ReplicaThreads() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    shutting_down_ = true;
  }
  start_cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void ReplicaThreads::work(std::size_t replica) {
  // OpenMP's thread count is per thread: this replica's oneDNN primitives use its share of cores.
  prepare_compute_thread(threads_per_replica_);
  std::uint64_t seen = 0;
  for (;;) {
    // Waking a sleeping thread cost 20-100 us on the VMs measured (a lanes' optimizer update split
    // over two threads gained nothing, and lane 1 started a step 0.04-0.07 ms after lane 0): the
    // next run, if it comes soon, finds this one spinning. Between two training steps of the seed
    // CNN the caller spends 0.04-0.05 ms (the metrics, the next batch), hence the longer spin.
    spin_until([&] { return generation_seen_.load(std::memory_order_acquire) != seen; }, kSpinForNextRun);
    const Strategy::ReplicaFn* task = nullptr;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      start_cv_.wait(lock, [&] { return shutting_down_ || generation_ != seen; });
      if (shutting_down_) return;
      seen = generation_;
      task = task_;
    }
    try {
      (*task)(contexts_[replica]);
    } catch (const BarrierBroken&) {
      // Another replica failed and broke the collectives; its error is the one reported.
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!first_error_) first_error_ = std::current_exception();
      collectives_.break_barrier();
    }
    std::lock_guard<std::mutex> lock(mutex_);
    remaining_seen_.store(--remaining_, std::memory_order_release);
    if (remaining_ == 0) done_cv_.notify_all();
  }
}

void ReplicaThreads::run_first_replica(const Strategy::ReplicaFn& fn, std::exception_ptr& error) {
  // Replica 0's share of the cores while it runs here; the caller's own count afterwards.
  const int caller_threads = omp_get_max_threads();
  omp_set_num_threads(threads_per_replica_);
  try {
    fn(contexts_.front());
  } catch (const BarrierBroken&) {
    // Another replica failed and broke the collectives; its error is the one reported.
  } catch (...) {
    error = std::current_exception();
    collectives_.break_barrier();
  }
  omp_set_num_threads(caller_threads);
}

void ReplicaThreads::run(const Strategy::ReplicaFn& fn) {
  if (threads_.empty()) {
    // One local replica: it is still one of the replicas in sync across every worker.
    fn(contexts_.front());
    return;
  }
  std::exception_ptr error, caller_error;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    task_ = &fn;
    remaining_ = static_cast<int>(threads_.size());  // this process's threads only: other workers have their own
    remaining_seen_.store(remaining_, std::memory_order_relaxed);
    first_error_ = nullptr;
    ++generation_;
    generation_seen_.store(generation_, std::memory_order_release);
    start_cv_.notify_all();
    if (first_threaded_ > 0) {
      lock.unlock();
      run_first_replica(fn, caller_error);
      // The others usually finish within microseconds of replica 0 (they meet it at the
      // collectives' last barrier): a short spin before sleeping.
      spin_until([&] { return remaining_seen_.load(std::memory_order_acquire) == 0; });
      lock.lock();
    }
    done_cv_.wait(lock, [&] { return remaining_ == 0; });
    task_ = nullptr;
    error = caller_error ? caller_error : first_error_;
  }
  if (error) {
    collectives_.reset();
    std::rethrow_exception(error);
  }
}

}  // namespace dtrain::distribute
