// The in-process collectives: each algorithm sums correctly for 1..5 replica threads, bit for bit
// the same on every replica and on every run, over awkward buffer layouts; the barrier is
// reusable and breakable without hangs.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "distribute/barrier.hpp"
#include "distribute/cross_device_ops.hpp"

using namespace dtrain;
using namespace dtrain::distribute;

namespace {

const char* const kAlgorithms[] = {"reduction_to_one_device", "hierarchical_copy", "ring"};

using Buffers = std::vector<std::vector<float>>;

// The values replica `replica` contributes in round `round`.
Buffers replica_values(const std::vector<std::size_t>& sizes, int replica, int round,
                       std::uint64_t seed) {
  Rng rng(seed, RngStream::test, static_cast<std::uint64_t>(replica) * 1000 + static_cast<std::uint64_t>(round));
  Buffers out;
  for (std::size_t n : sizes) {
    std::vector<float> b(n);
    for (float& v : b) v = rng.uniform(-1.0f, 1.0f);
    out.push_back(std::move(b));
  }
  return out;
}

// Runs `fn(replica)` on one thread per replica and rethrows the first exception in this thread,
// so doctest assertions stay on the main thread.
template <typename Fn>
void run_replicas(int num_replicas, Fn fn) {
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(num_replicas));
  std::vector<std::thread> threads;
  for (int r = 0; r < num_replicas; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

// results[round][replica] = that replica's buffers after all_reduce of that round.
using Results = std::vector<std::vector<Buffers>>;

Results run_all_reduce(const std::string& algorithm, int num_replicas,
                       const std::vector<std::size_t>& sizes, int rounds, std::uint64_t seed) {
  auto ops = make_cross_device_ops(algorithm, num_replicas);
  Results results(static_cast<std::size_t>(rounds),
                  std::vector<Buffers>(static_cast<std::size_t>(num_replicas)));
  run_replicas(num_replicas, [&](int replica) {
    Buffers mine(sizes.size());
    for (std::size_t b = 0; b < sizes.size(); ++b) mine[b].resize(sizes[b]);
    BufferList list;
    for (auto& b : mine) {
      list.data.push_back(b.data());
      list.sizes.push_back(b.size());
    }
    ops->bind(replica, list);
    for (int round = 0; round < rounds; ++round) {
      Buffers values = replica_values(sizes, replica, round, seed);
      for (std::size_t b = 0; b < sizes.size(); ++b)
        std::copy(values[b].begin(), values[b].end(), mine[b].begin());
      ops->all_reduce(replica);
      results[static_cast<std::size_t>(round)][static_cast<std::size_t>(replica)] = mine;
    }
  });
  return results;
}

bool bitwise_equal(const Buffers& a, const Buffers& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].size() != b[i].size() ||
        (!a[i].empty() && std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)) != 0))
      return false;
  return true;
}

void check_algorithm(const std::string& algorithm, const std::vector<std::size_t>& sizes) {
  constexpr int rounds = 3;
  constexpr std::uint64_t seed = 7;
  for (int n = 1; n <= 5; ++n) {
    CAPTURE(algorithm);
    CAPTURE(n);
    const Results first = run_all_reduce(algorithm, n, sizes, rounds, seed);
    const Results second = run_all_reduce(algorithm, n, sizes, rounds, seed);
    for (int round = 0; round < rounds; ++round) {
      CAPTURE(round);
      const auto& got = first[static_cast<std::size_t>(round)];
      for (int r = 0; r < n; ++r) {
        CHECK(bitwise_equal(got[static_cast<std::size_t>(r)], got[0]));
        CHECK(bitwise_equal(second[static_cast<std::size_t>(round)][static_cast<std::size_t>(r)],
                            got[static_cast<std::size_t>(r)]));
      }
      // The serial sum in double; the error bound scales with the sum of magnitudes, since
      // cancellation makes the plain relative error of a near-zero sum meaningless.
      std::vector<Buffers> inputs;
      for (int r = 0; r < n; ++r) inputs.push_back(replica_values(sizes, r, round, seed));
      int mismatches = 0;
      for (std::size_t b = 0; b < sizes.size(); ++b)
        for (std::size_t i = 0; i < sizes[b]; ++i) {
          double sum = 0.0, magnitude = 0.0;
          for (int r = 0; r < n; ++r) {
            sum += inputs[static_cast<std::size_t>(r)][b][i];
            magnitude += std::fabs(inputs[static_cast<std::size_t>(r)][b][i]);
          }
          for (int r = 0; r < n; ++r)
            if (std::fabs(got[static_cast<std::size_t>(r)][b][i] - sum) > 1e-6 * magnitude + 1e-30)
              ++mismatches;
        }
      CHECK(mismatches == 0);
    }
  }
}

}  // namespace

TEST_CASE("all_reduce sums over 1..5 replicas, identical everywhere and on every run") {
  const std::vector<std::vector<std::size_t>> layouts = {
      {7, 0, 1, 13, 0, 5},  // odd sizes and empty buffers; chunks span buffers
      {1},                  // one float: total < N for N >= 2
      {0, 2, 0, 1},         // total 3 < N for N = 4, 5: some ring chunks are empty
      {0, 0},               // nothing at all to sum
      {},                   // no buffers
      {4096, 33, 65537},    // larger, not a multiple of any N
  };
  for (const char* algorithm : kAlgorithms)
    for (const auto& sizes : layouts) {
      CAPTURE(sizes.size());
      check_algorithm(algorithm, sizes);
    }
}

TEST_CASE("a realistic gradient list (8 buffers, ~122k floats) sums on 4 replicas") {
  const std::vector<std::size_t> sizes = {288, 32, 18432, 64, 102400, 128, 1280, 10};
  for (const char* algorithm : kAlgorithms) {
    const Results results = run_all_reduce(algorithm, 4, sizes, 1, 11);
    const Buffers a = replica_values(sizes, 0, 0, 11), b = replica_values(sizes, 3, 0, 11);
    // Spot-check one element against the serial sum so a wrong layout cannot pass.
    const Buffers c = replica_values(sizes, 1, 0, 11), d = replica_values(sizes, 2, 0, 11);
    const double want = double(a[4][777]) + c[4][777] + d[4][777] + b[4][777];
    CHECK(results[0][3][4][777] == doctest::Approx(want).epsilon(1e-6));
    for (int r = 1; r < 4; ++r) CHECK(bitwise_equal(results[0][static_cast<std::size_t>(r)], results[0][0]));
  }
}

TEST_CASE("the algorithms add in their documented order") {
  // Values whose float sum depends on the order: 1e8 + 1 - 1e8 loses the 1 unless the two big
  // terms meet first. Three replicas, one element.
  const float values[3] = {1e8f, 1.0f, -1e8f};
  auto reduce = [&](const std::string& algorithm) {
    auto ops = make_cross_device_ops(algorithm, 3);
    std::vector<float> cells(values, values + 3);
    for (int r = 0; r < 3; ++r) ops->bind(r, BufferList{{&cells[static_cast<std::size_t>(r)]}, {1}});
    run_replicas(3, [&](int r) { ops->all_reduce(r); });
    for (int r = 1; r < 3; ++r) REQUIRE(cells[static_cast<std::size_t>(r)] == cells[0]);
    return cells[0];
  };
  // ((x0 + x1) + x2): 1e8 + 1 rounds to 1e8, so the 1 is lost.
  CHECK(reduce("reduction_to_one_device") == 0.0f);
  // (x0 + x1) + (x2): the same grouping for N = 3 (groups {0, 1} and {2}).
  CHECK(reduce("hierarchical_copy") == 0.0f);
  // One element lives in chunk 2 (chunks [0,0), [0,0), [0,1)), completed on replica 1 as
  // x1 + (x0 + x2) = 1 + 0.
  CHECK(reduce("ring") == 1.0f);
}

TEST_CASE("reduce_to sums only on the destination and leaves the others unchanged") {
  for (int n = 1; n <= 4; ++n)
    for (int destination = 0; destination < n; ++destination) {
      CAPTURE(n);
      CAPTURE(destination);
      auto ops = make_cross_device_ops("reduction_to_one_device", n);
      std::vector<std::vector<float>> cells(static_cast<std::size_t>(n));
      for (int r = 0; r < n; ++r) {
        cells[static_cast<std::size_t>(r)] = {float(r + 1), 10.0f * float(r + 1), 0.5f};
        ops->bind(r, BufferList{{cells[static_cast<std::size_t>(r)].data()}, {3}});
      }
      for (int round = 0; round < 2; ++round)  // the barrier is reused
        run_replicas(n, [&](int r) { ops->reduce_to(r, destination); });
      const float total = float(n * (n + 1) / 2);
      for (int r = 0; r < n; ++r) {
        const auto& c = cells[static_cast<std::size_t>(r)];
        if (r == destination) {
          // Two rounds: the second adds the others' unchanged values to the first round's sum.
          const float others = total - float(r + 1);
          CHECK(c[0] == total + others);
          CHECK(c[1] == 10.0f * (total + others));
          CHECK(c[2] == 0.5f * float(2 * n - 1));
        } else {
          CHECK(c[0] == float(r + 1));
          CHECK(c[2] == 0.5f);
        }
      }
    }
  // The other algorithms fall back to an all_reduce.
  auto ring = make_cross_device_ops("ring", 2);
  std::vector<float> a = {1.0f}, b = {2.0f};
  ring->bind(0, BufferList{{a.data()}, {1}});
  ring->bind(1, BufferList{{b.data()}, {1}});
  run_replicas(2, [&](int r) { ring->reduce_to(r, 1); });
  CHECK(a[0] == 3.0f);
  CHECK(b[0] == 3.0f);
  CHECK_THROWS_AS(ring->reduce_to(0, 2), InternalError);
}

TEST_CASE("make_cross_device_ops knows the three algorithms and refuses the rest") {
  for (const char* algorithm : kAlgorithms) {
    auto ops = make_cross_device_ops(algorithm, 3);
    CHECK(std::string(ops->name()) == algorithm);
    CHECK(ops->num_replicas() == 3);
    CHECK(ops->barrier().participants() == 3);
  }
  CHECK_THROWS_AS(make_cross_device_ops("auto", 2), InternalError);
  CHECK_THROWS_AS(make_cross_device_ops("nccl", 2), InternalError);
  CHECK_THROWS_AS(make_cross_device_ops("", 2), InternalError);
  CHECK_THROWS_AS(make_cross_device_ops("ring", 0), InternalError);
}

TEST_CASE("bad bindings are internal errors, on every replica alike") {
  auto ops = make_cross_device_ops("ring", 2);
  std::vector<float> a(4), b(5);
  CHECK_THROWS_AS(ops->bind(2, BufferList{{a.data()}, {4}}), InternalError);
  CHECK_THROWS_AS(ops->bind(-1, BufferList{{a.data()}, {4}}), InternalError);
  CHECK_THROWS_AS(ops->bind(0, BufferList{{a.data()}, {4, 1}}), InternalError);
  CHECK_THROWS_AS(ops->bind(0, BufferList{{nullptr}, {4}}), InternalError);
  CHECK_NOTHROW(ops->bind(0, BufferList{{nullptr}, {0}}));

  // Mismatched sizes across replicas: both replicas see it after the opening barrier.
  ops->bind(0, BufferList{{a.data()}, {4}});
  ops->bind(1, BufferList{{b.data()}, {5}});
  std::atomic<int> internal_errors{0};
  run_replicas(2, [&](int r) {
    try {
      ops->all_reduce(r);
    } catch (const InternalError&) {
      ++internal_errors;
    }
  });
  CHECK(internal_errors == 2);

  // The same memory bound to two replicas.
  ops->bind(1, BufferList{{a.data()}, {4}});
  internal_errors = 0;
  run_replicas(2, [&](int r) {
    try {
      ops->all_reduce(r);
    } catch (const InternalError&) {
      ++internal_errors;
    }
  });
  CHECK(internal_errors == 2);
}

TEST_CASE("the barrier is reusable and publishes writes across many rounds") {
  constexpr int participants = 4, rounds = 500;
  Barrier barrier(participants);
  std::vector<int> slots(participants, -1);  // plain ints: TSan would flag a missing ordering
  std::atomic<int> wrong{0};
  run_replicas(participants, [&](int t) {
    for (int round = 0; round < rounds; ++round) {
      slots[static_cast<std::size_t>(t)] = round;
      barrier.arrive_and_wait();
      for (int other = 0; other < participants; ++other)
        if (slots[static_cast<std::size_t>(other)] != round) ++wrong;
      barrier.arrive_and_wait();  // nobody writes the next round while others still read
    }
  });
  CHECK(wrong == 0);
  CHECK_THROWS_AS(Barrier(0), InternalError);
  Barrier alone(1);
  CHECK_NOTHROW(alone.arrive_and_wait());
}

namespace {

// Waits up to a few seconds for `done` to reach `want`; a hang becomes a test failure rather
// than a stuck test run.
bool wait_for(const std::atomic<int>& done, int want) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (done.load() < want) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

}  // namespace

TEST_CASE("break_barrier wakes every waiter with BarrierBroken, until reset") {
  // Shared ownership so that, should the break fail to wake a waiter, the detached thread still
  // points at a live barrier while the test reports the failure.
  auto barrier = std::make_shared<Barrier>(3);
  auto broken = std::make_shared<std::atomic<int>>(0);
  auto finished = std::make_shared<std::atomic<int>>(0);
  std::vector<std::thread> waiters;
  for (int t = 0; t < 2; ++t)
    waiters.emplace_back([barrier, broken, finished] {
      try {
        barrier->arrive_and_wait();
      } catch (const BarrierBroken&) {
        ++*broken;
      }
      ++*finished;
    });
  // Give the waiters time to block; the outcome must be the same if they arrive late.
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  barrier->break_barrier();
  const bool woke = wait_for(*finished, 2);
  CHECK(woke);
  for (auto& w : waiters) {
    if (woke)
      w.join();
    else
      w.detach();
  }
  if (!woke) return;
  CHECK(*broken == 2);
  CHECK_THROWS_AS(barrier->arrive_and_wait(), BarrierBroken);

  barrier->reset();
  std::atomic<int> passed{0};
  run_replicas(3, [&](int) {
    barrier->arrive_and_wait();
    ++passed;
  });
  CHECK(passed == 3);
}

TEST_CASE("a failing replica breaks a collective and the others throw instead of hanging") {
  for (const char* algorithm : kAlgorithms) {
    CAPTURE(algorithm);
    std::shared_ptr<CrossDeviceOps> ops = make_cross_device_ops(algorithm, 3);
    auto cells = std::make_shared<std::vector<float>>(3, 1.0f);
    for (int r = 0; r < 3; ++r)
      ops->bind(r, BufferList{{cells->data() + r}, {1}});
    auto broken = std::make_shared<std::atomic<int>>(0);
    auto finished = std::make_shared<std::atomic<int>>(0);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r)
      threads.emplace_back([ops, cells, broken, finished, r] {
        try {
          ops->all_reduce(r);
        } catch (const BarrierBroken&) {
          ++*broken;
        }
        ++*finished;
      });
    // Replica 2 fails before reaching the collective; the strategy breaks the barrier.
    ops->barrier().break_barrier();
    const bool woke = wait_for(*finished, 2);
    CHECK(woke);
    for (auto& t : threads) {
      if (woke)
        t.join();
      else
        t.detach();
    }
    if (!woke) return;
    CHECK(*broken == 2);
  }
}
