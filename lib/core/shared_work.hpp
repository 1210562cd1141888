// Work a thread may share with the other threads of its group (the lanes of one replica): a job of
// independent items, each claimed by exactly one thread.
//
// Why: the lanes split a replica's batch in equal halves, but on a shared machine one core runs
// 20-30 % slower than the other for milliseconds at a time, and the lanes meet where their
// gradients are summed. On the 2-core AVX2 EPYC, lane 0 waited there 1.1-1.2 ms of a 10.6 ms step.
// A lane that finishes its own items of a layer takes the items the slower lane has not started,
// so the two leave the layer together.
//
// Items must be independent and write only where the job says, so the results do not depend on
// which thread ran an item: the bits are those of one thread running them all in order.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

namespace dtrain {

class SharedWork {
 public:
  // Runs item `item` of `job` on thread `worker` (0 <= worker < size()): whatever scratch it
  // needs, it takes from the job by worker. It must not throw: the job's owner waits for it.
  using Item = void (*)(void* job, std::int64_t item, int worker) noexcept;

  // Who runs a job's first item. `helper` is for tests: the owner of a job leaves its first item
  // to another worker and waits until one has claimed it, so that every job is shared whatever
  // the scheduler does (a helper must be calling help() meanwhile, or run() waits for one).
  enum class FirstItem { anyone, helper };

  explicit SharedWork(int workers, FirstItem first_item = FirstItem::anyone);
  ~SharedWork();
  SharedWork(const SharedWork&) = delete;
  SharedWork& operator=(const SharedWork&) = delete;
  int size() const { return workers_; }

  // Thread `worker` runs items [0, items) of `job`: it claims them in order, and so may every
  // other worker that calls run() or help() meanwhile; then it helps with the others' open jobs;
  // it returns once every item of its job has been run, by whichever thread. One job per worker at
  // a time; `job` must stay valid until run() returns.
  void run(int worker, std::int64_t items, void* job, Item fn);
  // Runs items of the other workers' open jobs until none is left to claim; returns how many.
  std::int64_t help(int worker);

 private:
  struct Slot;
  // Claims and runs items of `slot` until none is left; returns how many.
  static std::int64_t drain(Slot& slot, int worker);

  int workers_;
  FirstItem first_item_;
  std::unique_ptr<Slot[]> slots_;
};

}  // namespace dtrain
