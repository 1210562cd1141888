// SharedWork (core/shared_work.hpp): every item of a job runs exactly once, on its owner or on a
// helper; the owner returns only once all have run; a helper never claims an item of a job that
// is closed. The waits key on events (an item run by the other thread), never on time.
#include <doctest/doctest.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "core/shared_work.hpp"

using namespace dtrain;

namespace {

// A job whose items record who ran them; item 0, when the owner runs it, can be made to wait
// until another worker has started an item, which forces the sharing.
struct CountingJob {
  std::vector<std::atomic<int>> runs;
  std::vector<std::atomic<int>> by;
  std::atomic<bool> helped{false};
  bool first_waits_for_help = false;
  explicit CountingJob(std::int64_t items) : runs(static_cast<std::size_t>(items)), by(static_cast<std::size_t>(items)) {}
};

void count_item(void* p, std::int64_t item, int worker) noexcept {
  auto& job = *static_cast<CountingJob*>(p);
  if (worker != 0) job.helped.store(true, std::memory_order_release);
  else if (item == 0 && job.first_waits_for_help)
    while (!job.helped.load(std::memory_order_acquire)) std::this_thread::yield();
  job.by[static_cast<std::size_t>(item)].store(worker, std::memory_order_relaxed);
  job.runs[static_cast<std::size_t>(item)].fetch_add(1, std::memory_order_relaxed);
}

bool all_ran_once(const CountingJob& job) {
  for (const auto& r : job.runs)
    if (r.load(std::memory_order_relaxed) != 1) return false;
  return true;
}

}  // namespace

TEST_CASE("shared work: a worker with nothing of its own runs items of another's job, each once") {
  SharedWork work(2);
  CountingJob job(40);
  job.first_waits_for_help = true;  // the owner cannot finish alone
  std::atomic<bool> owner_done{false};
  std::int64_t helped = 0;
  std::thread helper([&] {
    while (!owner_done.load(std::memory_order_acquire)) helped += work.help(1);
  });
  work.run(0, 40, &job, &count_item);
  // run() returned: every item has run, the helper's too.
  CHECK(all_ran_once(job));
  owner_done.store(true, std::memory_order_release);
  helper.join();
  CHECK(helped >= 1);
  int by_helper = 0;
  for (const auto& b : job.by) by_helper += b.load() == 1;
  CHECK(by_helper == helped);
  // The job is closed: nothing left to claim, whatever its state said before.
  CHECK(work.help(1) == 0);
}

TEST_CASE("shared work: with FirstItem::helper the owner leaves each job's first item to a helper") {
  SharedWork work(2, SharedWork::FirstItem::helper);
  std::atomic<bool> owner_done{false};
  std::thread helper([&] {
    while (!owner_done.load(std::memory_order_acquire)) work.help(1);
  });
  for (int round = 0; round < 20; ++round) {
    CAPTURE(round);
    CountingJob job(1 + round % 5);
    work.run(0, static_cast<std::int64_t>(job.runs.size()), &job, &count_item);
    CHECK(all_ran_once(job));
    CHECK(job.by[0].load() == 1);
  }
  // A job of no items does not wait for a helper.
  CountingJob none(0);
  work.run(0, 0, &none, &count_item);
  owner_done.store(true, std::memory_order_release);
  helper.join();
}

TEST_CASE("shared work: workers that each own a job and help the others run every item once, round after round") {
  constexpr int kWorkers = 3;
  constexpr int kRounds = 200;
  SharedWork work(kWorkers);
  std::vector<std::vector<std::unique_ptr<CountingJob>>> jobs(kWorkers);
  for (int w = 0; w < kWorkers; ++w)
    for (int r = 0; r < kRounds; ++r) jobs[w].push_back(std::make_unique<CountingJob>(1 + (r * 7 + w * 3) % 23));
  std::atomic<int> incomplete_on_return{0};
  std::vector<std::thread> threads;
  for (int w = 0; w < kWorkers; ++w)
    threads.emplace_back([&, w] {
      for (int r = 0; r < kRounds; ++r) {
        CountingJob& job = *jobs[w][r];
        work.run(w, static_cast<std::int64_t>(job.runs.size()), &job, &count_item);
        if (!all_ran_once(job)) incomplete_on_return.fetch_add(1);
      }
    });
  for (auto& t : threads) t.join();
  CHECK(incomplete_on_return.load() == 0);
  for (int w = 0; w < kWorkers; ++w)
    for (int r = 0; r < kRounds; ++r) {
      CAPTURE(w);
      CAPTURE(r);
      CHECK(all_ran_once(*jobs[w][r]));
    }
}

TEST_CASE("shared work: a job of no items returns at once; bad workers and counts are refused") {
  SharedWork work(2);
  CountingJob none(0);
  work.run(1, 0, &none, &count_item);
  CHECK(work.help(0) == 0);
  CHECK_THROWS(work.run(2, 1, &none, &count_item));
  CHECK_THROWS(work.run(-1, 1, &none, &count_item));
  CHECK_THROWS(work.run(0, -1, &none, &count_item));
  CHECK_THROWS(SharedWork(0));
}
