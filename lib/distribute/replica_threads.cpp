#include "distribute/replica_threads.hpp"

#include "core/compute_thread.hpp"

namespace dtrain::distribute {

ReplicaThreads::ReplicaThreads(std::vector<ReplicaContext> contexts, int threads_per_replica, Barrier& collectives)
    : contexts_(std::move(contexts)), threads_per_replica_(threads_per_replica), collectives_(collectives) {
  if (contexts_.size() < 2) return;
  threads_.reserve(contexts_.size());
  for (std::size_t r = 0; r < contexts_.size(); ++r) threads_.emplace_back(&ReplicaThreads::work, this, r);
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
    if (--remaining_ == 0) done_cv_.notify_all();
  }
}

void ReplicaThreads::run(const Strategy::ReplicaFn& fn) {
  if (threads_.empty()) {
    // One local replica: it is still one of the replicas in sync across every worker.
    fn(contexts_.front());
    return;
  }
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    task_ = &fn;
    remaining_ = static_cast<int>(threads_.size());  // this process's threads only: other workers have their own
    first_error_ = nullptr;
    ++generation_;
    start_cv_.notify_all();
    done_cv_.wait(lock, [&] { return remaining_ == 0; });
    task_ = nullptr;
    error = first_error_;
  }
  if (error) {
    collectives_.reset();
    std::rethrow_exception(error);
  }
}

}  // namespace dtrain::distribute
