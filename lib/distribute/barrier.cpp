#include "distribute/barrier.hpp"

#include <chrono>
#include <string>

#include "core/error.hpp"

namespace dtrain::distribute {

Barrier::Barrier(int participants) : participants_(participants) {
  DTRAIN_CHECK(participants >= 1,
               "a barrier needs at least one participant, got " + std::to_string(participants));
}

double Barrier::arrive_and_wait() {
  std::unique_lock lock(mutex_);
  if (broken_) throw BarrierBroken{};
  const std::uint64_t arrival_generation = generation_;
  if (++waiting_ == participants_) {
    waiting_ = 0;
    ++generation_;
    released_.store(generation_, std::memory_order_release);
    lock.unlock();
    cv_.notify_all();
    return 0.0;
  }
  lock.unlock();
  // Only a waiter reads the clock, while it has nothing else to do.
  const auto waiting_since = std::chrono::steady_clock::now();
  spin_until([&] {
    return released_.load(std::memory_order_acquire) != arrival_generation || broken_seen_.load(std::memory_order_relaxed);
  });
  lock.lock();
  cv_.wait(lock, [&] { return generation_ != arrival_generation || broken_; });
  // A round that completed before the break still counts: its writes were all published.
  if (generation_ != arrival_generation)
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - waiting_since).count();
  --waiting_;
  // reset() may be waiting for the last broken waiter to leave.
  if (waiting_ == 0) cv_.notify_all();
  throw BarrierBroken{};
}

void Barrier::break_barrier() {
  {
    std::lock_guard lock(mutex_);
    broken_ = true;
    broken_seen_.store(true, std::memory_order_relaxed);
  }
  cv_.notify_all();
}

void Barrier::reset() {
  std::unique_lock lock(mutex_);
  if (broken_) cv_.wait(lock, [&] { return waiting_ == 0; });
  DTRAIN_CHECK(waiting_ == 0, "Barrier::reset() called while " + std::to_string(waiting_) +
                                  " replica(s) wait in an unbroken round; break it first");
  broken_ = false;
  broken_seen_.store(false, std::memory_order_relaxed);
  ++generation_;
  released_.store(generation_, std::memory_order_release);
}

}  // namespace dtrain::distribute
