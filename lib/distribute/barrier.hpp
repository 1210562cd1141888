// A reusable barrier for the replica threads of one process that can be broken: when one replica
// fails, the strategy breaks the barrier so every other replica waiting in a collective wakes up
// and throws instead of waiting forever.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>

namespace dtrain::distribute {

class Barrier {
 public:
  // participants >= 1, else InternalError.
  explicit Barrier(int participants);
  Barrier(const Barrier&) = delete;
  Barrier& operator=(const Barrier&) = delete;

  // Blocks until all participants arrived (then returns) or the barrier is broken (then throws
  // BarrierBroken). Also publishes every write made before arrive_and_wait to every participant.
  // A waiter spins for a few microseconds before it sleeps: the participants usually arrive
  // within that time (the lanes of a step), and waking a sleeping thread costs more. Returns the
  // seconds the caller waited for the others (0 for the last to arrive, who reads no clock).
  double arrive_and_wait();
  // Wakes every waiter with BarrierBroken; later calls throw at once until reset().
  void break_barrier();
  // Makes a broken barrier usable again, starting a fresh round. Waits for the waiters woken by
  // break_barrier() to leave first; calling it while an unbroken round has waiters is a bug
  // (InternalError), since those waiters would be counted in no round.
  void reset();
  int participants() const { return participants_; }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  int participants_;
  int waiting_ = 0;
  std::uint64_t generation_ = 0;
  bool broken_ = false;
  // generation_ and broken_ as the waiters' short spin reads them without the mutex (the mutex,
  // taken after the spin, still orders every write).
  std::atomic<std::uint64_t> released_{0};
  std::atomic<bool> broken_seen_{false};
};

struct BarrierBroken {};

// Spins while done() is false, for at most `most` (kSpinBeforeSleep), pausing the core between checks (x86's
// pause: the other hyper-thread and the memory system go on); returns done(). A thread that
// expects the others within microseconds calls it before it sleeps on a condition variable: a
// sleeping thread woke tens of microseconds after the last arrival on the shared 2-vCPU machines,
// and the spin is bounded, so a thread waiting for a slow participant (or on a machine with more
// threads than cores) soon leaves the core to others.
inline constexpr std::chrono::microseconds kSpinBeforeSleep{20};
template <class Done>
bool spin_until(const Done& done, std::chrono::microseconds most = kSpinBeforeSleep) {
  const auto until = std::chrono::steady_clock::now() + most;
  for (int i = 0; !done(); ++i) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
    if (i % 32 == 31 && std::chrono::steady_clock::now() > until) return done();
  }
  return true;
}

}  // namespace dtrain::distribute
