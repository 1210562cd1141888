// A reusable barrier for the replica threads of one process that can be broken: when one replica
// fails, the strategy breaks the barrier so every other replica waiting in a collective wakes up
// and throws instead of waiting forever.
#pragma once

#include <atomic>
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
  // within that time (the lanes of a step), and waking a sleeping thread costs more.
  void arrive_and_wait();
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

// One step of a spin-wait: tells the core this thread only waits (x86's pause), so the other
// hyper-thread and the memory system go on.
inline void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}  // thrown by a broken barrier; not an error of its own

}  // namespace dtrain::distribute
