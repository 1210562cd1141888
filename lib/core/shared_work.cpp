#include "core/shared_work.hpp"

#include <string>
#include <thread>

#include "core/error.hpp"

namespace dtrain {

// One worker's job. `state` packs the job's generation (high 32 bits: odd while the job is open)
// and the count of items claimed (low 32 bits), so that a claim is one compare-and-swap that fails
// once the owner has closed the job or opened the next: a helper that read an open state never
// claims an item of a later job by mistake. job and fn are written by the owner before it opens
// the job and read by a helper only after a claim, which the open's release publishes; items is
// also read before a claim, to skip a job with none left.
struct alignas(64) SharedWork::Slot {
  std::atomic<std::uint64_t> state{0};
  alignas(64) std::atomic<std::int64_t> done{0};
  std::atomic<std::int64_t> items{0};
  void* job = nullptr;
  Item fn = nullptr;
};

namespace {

constexpr std::uint64_t kClaimMask = 0xffffffffu;
bool is_open(std::uint64_t state) { return ((state >> 32) & 1u) != 0; }

// The i-th look of a wait: spin a while, then leave the core to the thread waited for, in case it
// was descheduled.
void spin_or_yield(int i) {
  if (i < 4096) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  } else {
    std::this_thread::yield();
  }
}

}  // namespace

SharedWork::SharedWork(int workers, FirstItem first_item)
    : workers_(workers), first_item_(first_item), slots_(std::make_unique<Slot[]>(static_cast<std::size_t>(workers))) {
  DTRAIN_CHECK(workers >= 1, "shared work needs at least one worker, got " + std::to_string(workers));
}

SharedWork::~SharedWork() = default;

std::int64_t SharedWork::drain(Slot& slot, int worker) {
  std::int64_t ran = 0;
  std::uint64_t state = slot.state.load(std::memory_order_acquire);
  while (is_open(state)) {
    const auto claimed = static_cast<std::int64_t>(state & kClaimMask);
    if (claimed >= slot.items.load(std::memory_order_acquire)) break;
    // Success means the state was still this one, so the items read above were this job's (had
    // they been a later job's, their release would have shown us the close, and the swap would
    // fail); it acquires what the owner released when it opened the job.
    if (!slot.state.compare_exchange_weak(state, state + 1, std::memory_order_acq_rel, std::memory_order_acquire))
      continue;
    slot.fn(slot.job, claimed, worker);
    slot.done.fetch_add(1, std::memory_order_release);
    ++ran;
    state = slot.state.load(std::memory_order_acquire);
  }
  return ran;
}

void SharedWork::run(int worker, std::int64_t items, void* job, Item fn) {
  DTRAIN_CHECK(worker >= 0 && worker < workers_, "shared work: worker " + std::to_string(worker) + " of " +
                                                     std::to_string(workers_));
  DTRAIN_CHECK(items >= 0 && static_cast<std::uint64_t>(items) < kClaimMask,
               "shared work: " + std::to_string(items) + " items");
  Slot& mine = slots_[static_cast<std::size_t>(worker)];
  mine.items.store(items, std::memory_order_release);  // after the close: see drain()
  mine.job = job;
  mine.fn = fn;
  mine.done.store(0, std::memory_order_relaxed);
  const std::uint64_t generation = (mine.state.load(std::memory_order_relaxed) >> 32) + 1;  // odd: open
  mine.state.store(generation << 32, std::memory_order_release);
  if (first_item_ == FirstItem::helper && items > 0)
    for (int i = 0; (mine.state.load(std::memory_order_acquire) & kClaimMask) == 0; ++i) spin_or_yield(i);
  drain(mine, worker);
  help(worker);
  // The items the others claimed: each is one item's work (tens of microseconds); spin, then
  // leave the core to the helper where it was descheduled.
  for (int i = 0; mine.done.load(std::memory_order_acquire) < items; ++i) spin_or_yield(i);
  // Closed (even generation): a helper's compare-and-swap on the open state now fails.
  mine.state.store((generation + 1) << 32, std::memory_order_release);
}

std::int64_t SharedWork::help(int worker) {
  std::int64_t ran = 0;
  for (int other = 1; other < workers_; ++other)
    ran += drain(slots_[static_cast<std::size_t>((worker + other) % workers_)], worker);
  return ran;
}

}  // namespace dtrain
