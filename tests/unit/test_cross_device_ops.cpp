// The in-process collectives of a thread group: each cross-device op sums correctly for 1..5
// replica threads, bit for bit the same on every replica and on every run, over awkward lengths;
// the one ring (ring.hpp) in shared memory; the double, int64, max, reduce-to-root and broadcast
// collectives; the barrier is reusable and breakable without hangs.
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
#include "distribute/ring.hpp"
#include "distribute/single_communicator.hpp"
#include "distribute/thread_group.hpp"

using namespace dtrain;
using namespace dtrain::distribute;

namespace {

const char* const kAlgorithms[] = {"reduction_to_one_device", "hierarchical_copy", "ring"};

// One replica's values, seen as consecutive variables (the gradient arena of a model).
using Buffers = std::vector<std::vector<float>>;

std::vector<float> flatten(const Buffers& buffers) {
  std::vector<float> out;
  for (const auto& b : buffers) out.insert(out.end(), b.begin(), b.end());
  return out;
}

Buffers split(const std::vector<float>& flat, const std::vector<std::size_t>& sizes) {
  Buffers out;
  std::size_t at = 0;
  for (std::size_t n : sizes) {
    out.emplace_back(flat.begin() + static_cast<std::ptrdiff_t>(at), flat.begin() + static_cast<std::ptrdiff_t>(at + n));
    at += n;
  }
  return out;
}

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
  ThreadGroup group(num_replicas, cross_device_op_named(algorithm));
  Results results(static_cast<std::size_t>(rounds),
                  std::vector<Buffers>(static_cast<std::size_t>(num_replicas)));
  run_replicas(num_replicas, [&](int replica) {
    std::vector<float> mine;
    for (int round = 0; round < rounds; ++round) {
      mine = flatten(replica_values(sizes, replica, round, seed));
      group.endpoint(replica).all_reduce_sum(std::span<float>(mine), "test");
      results[static_cast<std::size_t>(round)][static_cast<std::size_t>(replica)] = split(mine, sizes);
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
      {7, 0, 1, 13, 0, 5},  // odd sizes and empty variables; chunks span variables
      {1},                  // one float: total < N for N >= 2
      {0, 2, 0, 1},         // total 3 < N for N = 4, 5: some ring chunks are empty
      {0, 0},               // nothing at all to sum
      {},                   // no variables
      {4096, 33, 65537},    // larger, not a multiple of any N
  };
  for (const char* algorithm : kAlgorithms)
    for (const auto& sizes : layouts) {
      CAPTURE(sizes.size());
      check_algorithm(algorithm, sizes);
    }
}

TEST_CASE("a realistic gradient arena (8 variables, ~122k floats) sums on 4 replicas") {
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
    ThreadGroup group(3, cross_device_op_named(algorithm));
    std::vector<float> cells(values, values + 3);
    run_replicas(3, [&](int r) {
      group.endpoint(r).all_reduce_sum(std::span<float>(&cells[static_cast<std::size_t>(r)], 1), "test");
    });
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

TEST_CASE("reduce_sum_to sums only on the destination and leaves the others unchanged") {
  for (int n = 1; n <= 4; ++n)
    for (int destination = 0; destination < n; ++destination) {
      CAPTURE(n);
      CAPTURE(destination);
      ThreadGroup group(n, CrossDeviceOp::reduction_to_one_device);
      std::vector<std::vector<float>> cells(static_cast<std::size_t>(n));
      for (int r = 0; r < n; ++r) cells[static_cast<std::size_t>(r)] = {float(r + 1), 10.0f * float(r + 1), 0.5f};
      for (int round = 0; round < 2; ++round)  // the barrier is reused
        run_replicas(n, [&](int r) {
          group.endpoint(r).reduce_sum_to(std::span<float>(cells[static_cast<std::size_t>(r)]), destination, "test");
        });
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
  // Whatever the group's op for all-reduces, the sum lands on the destination only.
  for (const char* algorithm : {"hierarchical_copy", "ring"}) {
    CAPTURE(algorithm);
    ThreadGroup ring(2, cross_device_op_named(algorithm));
    std::vector<float> a = {1.0f}, b = {2.0f};
    run_replicas(2, [&](int r) { ring.endpoint(r).reduce_sum_to(std::span<float>(r == 0 ? a : b), 1, "test"); });
    CHECK(a[0] == 1.0f);
    CHECK(b[0] == 3.0f);
    CHECK_THROWS_AS(ring.endpoint(0).reduce_sum_to(std::span<float>(a), 2, "test"), InternalError);
  }
}

TEST_CASE("reduce_sum_to split over the replica threads adds every element in replica order") {
  // Lengths that end inside a cache line and span several, so every thread's slice is exercised;
  // values of many magnitudes, so another order of the additions would change bits.
  for (int n = 2; n <= 4; ++n)
    for (std::size_t length : {std::size_t{1}, std::size_t{17}, std::size_t{16 * 7 + 5}, std::size_t{1000}})
      for (int destination = 0; destination < n; ++destination) {
        CAPTURE(n);
        CAPTURE(length);
        CAPTURE(destination);
        Rng rng(static_cast<std::uint64_t>(n * 1000 + destination), RngStream::test);
        std::vector<std::vector<float>> cells(static_cast<std::size_t>(n), std::vector<float>(length));
        for (auto& c : cells)
          for (float& v : c) v = std::ldexp(rng.uniform() - 0.5f, static_cast<int>(rng.uniform() * 40.0f) - 20);
        std::vector<float> expected = cells[static_cast<std::size_t>(destination)];
        for (int r = 0; r < n; ++r)
          if (r != destination)
            for (std::size_t i = 0; i < length; ++i) expected[i] += cells[static_cast<std::size_t>(r)][i];
        const std::vector<std::vector<float>> before = cells;
        ThreadGroup group(n, CrossDeviceOp::reduction_to_one_device);
        run_replicas(n, [&](int r) {
          group.endpoint(r).reduce_sum_to(std::span<float>(cells[static_cast<std::size_t>(r)]), destination, "test");
        });
        for (int r = 0; r < n; ++r)
          CHECK(std::memcmp(cells[static_cast<std::size_t>(r)].data(),
                            (r == destination ? expected : before[static_cast<std::size_t>(r)]).data(),
                            length * sizeof(float)) == 0);
      }
}

TEST_CASE("a thread group knows the three algorithms and refuses the rest") {
  for (const char* algorithm : kAlgorithms) {
    ThreadGroup group(3, cross_device_op_named(algorithm));
    CHECK(std::string(group.name()) == algorithm);
    CHECK(std::string(group.endpoint(2).name()) == algorithm);
    CHECK(group.endpoint(1).size() == 3);
    CHECK(group.endpoint(1).rank() == 1);
    CHECK(group.barrier().participants() == 3);
  }
  CHECK_THROWS_AS(cross_device_op_named("auto"), InternalError);
  // nccl names a group over GPUs (nccl_communicator.hpp), never a thread group.
  CHECK(cross_device_op_named("nccl") == CrossDeviceOp::nccl);
  CHECK_THROWS_AS(ThreadGroup(2, CrossDeviceOp::nccl), InternalError);
  CHECK_THROWS_AS(cross_device_op_named(""), InternalError);
  CHECK_THROWS_AS(ThreadGroup(0, CrossDeviceOp::ring), InternalError);
}

TEST_CASE("bad values are internal errors, on every replica alike") {
  ThreadGroup group(2, CrossDeviceOp::ring);
  std::vector<float> a(4), b(5);
  CHECK_THROWS_AS(group.endpoint(2), InternalError);
  CHECK_THROWS_AS(group.endpoint(-1), InternalError);
  // Every replica checks every replica's values after the opening barrier: all throw, or none.
  auto errors_of = [&](std::span<float> zero, std::span<float> one) {
    std::atomic<int> internal_errors{0};
    run_replicas(2, [&](int r) {
      try {
        group.endpoint(r).all_reduce_sum(r == 0 ? zero : one, "test");
      } catch (const InternalError&) {
        ++internal_errors;
      }
    });
    return internal_errors.load();
  };
  CHECK(errors_of(std::span<float>(static_cast<float*>(nullptr), 4), std::span<float>(b.data(), 4)) == 2);
  CHECK(errors_of(std::span<float>(static_cast<float*>(nullptr), 0), std::span<float>(b.data(), 0)) == 0);
  // Mismatched lengths across replicas.
  CHECK(errors_of(std::span<float>(a), std::span<float>(b)) == 2);
  // The same memory given by two replicas.
  CHECK(errors_of(std::span<float>(a), std::span<float>(a)) == 2);
}

TEST_CASE("the barrier is reusable and publishes writes across many rounds") {
  constexpr int participants = 4, rounds = 500;
  Barrier barrier(participants);
  std::vector<int> slots(participants, -1);  // plain ints: TSan would flag a missing ordering
  std::atomic<int> wrong{0}, negative_waits{0}, unwaited{0};
  run_replicas(participants, [&](int t) {
    for (int round = 0; round < rounds; ++round) {
      slots[static_cast<std::size_t>(t)] = round;
      const double waited = barrier.arrive_and_wait();
      negative_waits += waited < 0.0;
      unwaited += waited == 0.0;
      for (int other = 0; other < participants; ++other)
        if (slots[static_cast<std::size_t>(other)] != round) ++wrong;
      barrier.arrive_and_wait();  // nobody writes the next round while others still read
    }
  });
  CHECK(wrong == 0);
  // The last to arrive in each round waited for nobody (and read no clock).
  CHECK(negative_waits == 0);
  CHECK(unwaited >= rounds);
  CHECK_THROWS_AS(Barrier(0), InternalError);
  Barrier alone(1);
  CHECK(alone.arrive_and_wait() == 0.0);
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
    auto group = std::make_shared<ThreadGroup>(3, cross_device_op_named(algorithm));
    auto cells = std::make_shared<std::vector<float>>(3, 1.0f);
    auto broken = std::make_shared<std::atomic<int>>(0);
    auto finished = std::make_shared<std::atomic<int>>(0);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r)
      threads.emplace_back([group, cells, broken, finished, r] {
        try {
          group->endpoint(r).all_reduce_sum(std::span<float>(cells->data() + r, 1), "test");
        } catch (const BarrierBroken&) {
          ++*broken;
        }
        ++*finished;
      });
    // Replica 2 fails before reaching the collective; the strategy breaks the barrier.
    group->barrier().break_barrier();
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

namespace {

// Records the ring's schedule instead of moving data.
struct RecordingTransport final : RingTransport {
  std::vector<std::string> steps;
  void open(std::span<float> values, const char*) override { steps.push_back("open " + std::to_string(values.size())); }
  void exchange(std::span<float>, RingChunk send, RingChunk recv, bool accumulate, const char*) override {
    steps.push_back((accumulate ? "add " : "copy ") + std::to_string(send.begin) + "-" + std::to_string(send.end) + " " +
                    std::to_string(recv.begin) + "-" + std::to_string(recv.end));
  }
};

}  // namespace

TEST_CASE("the ring: chunks partition the array, and each step passes its chunk to the right") {
  for (std::size_t n : {1, 2, 3, 7})
    for (std::size_t total : {0, 1, 2, 10, 101}) {
      std::size_t next = 0;
      for (std::size_t c = 0; c < n; ++c) {
        const RingChunk chunk = ring_chunk(c, n, total);
        CHECK(chunk.begin == next);
        CHECK(chunk.size() + 1 >= total / n);
        CHECK(chunk.size() <= total / n + 1);
        next = chunk.end;
      }
      CHECK(next == total);
    }
  // Participant 1 of 3 over 9 elements (chunks 0-3, 3-6, 6-9): reduce-scatter sends its own chunk
  // 1 then chunk 0, receiving chunk 0 then 2 to add; the all-gather passes on the complete chunk
  // 2, then chunk 1, receiving 1 and then 0.
  RecordingTransport transport;
  std::vector<float> values(9);
  ring_all_reduce(transport, 1, 3, values, "test");
  CHECK(transport.steps == std::vector<std::string>{"open 9", "add 3-6 0-3", "add 0-3 6-9", "copy 6-9 3-6", "copy 3-6 0-3"});
  // A ring of one has nothing to do.
  RecordingTransport alone;
  ring_all_reduce(alone, 0, 1, values, "test");
  CHECK(alone.steps.empty());
}

TEST_CASE("ring_all_reduce_sum is the same ring on any thread group, bit for bit") {
  const std::vector<std::size_t> sizes = {13, 0, 7, 300};
  for (int n : {2, 3, 5}) {
    CAPTURE(n);
    const Results ring = run_all_reduce("ring", n, sizes, 1, 3);
    ThreadGroup group(n, CrossDeviceOp::hierarchical_copy);
    std::vector<std::vector<float>> got(static_cast<std::size_t>(n));
    run_replicas(n, [&](int r) {
      std::vector<float> mine = flatten(replica_values(sizes, r, 0, 3));
      group.endpoint(r).ring_all_reduce_sum(std::span<float>(mine), "test");
      got[static_cast<std::size_t>(r)] = mine;
    });
    for (int r = 0; r < n; ++r) CHECK(bitwise_equal(split(got[static_cast<std::size_t>(r)], sizes), ring[0][0]));
  }
}

TEST_CASE("double and int64 sums, the maximum and broadcast over threads, in replica order") {
  for (const char* algorithm : kAlgorithms)
    for (int n = 1; n <= 4; ++n) {
      CAPTURE(algorithm);
      CAPTURE(n);
      // Through the interfaces a strategy holds (ReplicaGroup, Communicator) alone.
      const std::unique_ptr<distribute::ReplicaGroup> group = distribute::make_replica_group(n, cross_device_op_named(algorithm));
      std::vector<std::vector<double>> d(static_cast<std::size_t>(n));
      std::vector<std::vector<std::int64_t>> k(static_cast<std::size_t>(n));
      std::vector<int> maxima(static_cast<std::size_t>(n));
      std::vector<std::vector<double>> b(static_cast<std::size_t>(n));
      run_replicas(n, [&](int r) {
        const auto i = static_cast<std::size_t>(r);
        // 1e17 + 1 loses the 1 unless the two large terms meet first: ((x0 + x1) + x2) + x3.
        d[i] = {r == 0 ? 1e17 : r == 1 ? 1.0 : r == 2 ? -1e17 : 0.5, 0.25 * r};
        k[i] = {std::int64_t{1} << (40 + r), -r};
        distribute::Communicator& me = group->endpoint(r);
        me.all_reduce_sum(std::span<double>(d[i]), "doubles");
        me.all_reduce_sum(std::span<std::int64_t>(k[i]), "counts");
        maxima[i] = me.all_reduce_max(10 * ((r + 2) % n), "max");
        b[i] = {double(r), -double(r)};
        me.broadcast(std::span<double>(b[i]), n - 1, "broadcast");
      });
      const double first = n == 1 ? 1e17 : n == 2 ? 1e17 + 1.0 : n == 3 ? 0.0 : 0.5;
      std::int64_t total = 0;
      for (int r = 0; r < n; ++r) total += std::int64_t{1} << (40 + r);
      for (int r = 0; r < n; ++r) {
        const auto i = static_cast<std::size_t>(r);
        CHECK(d[i][0] == first);
        CHECK(d[i][1] == 0.25 * (n * (n - 1) / 2));
        CHECK(k[i][0] == total);
        CHECK(k[i][1] == -(n * (n - 1) / 2));
        CHECK(maxima[i] == 10 * (n - 1));
        CHECK(b[i] == std::vector<double>{double(n - 1), -double(n - 1)});
      }
    }
}

TEST_CASE("small double and int64 sums back to back: every round's own values, in replica order") {
  // Sums of up to kPostedValues values go through the group's two posting areas in turn, one
  // barrier each; longer ones through reduce_then_copy. Rounds follow each other with nothing in
  // between, so a replica posting round k + 1 races another still adding round k's copies unless
  // the areas alternate (ThreadSanitizer runs this file too), and the lengths cross the limit.
  constexpr std::size_t limit = ThreadGroup::kPostedValues;
  const std::size_t lengths[] = {1, 3, 65, limit - 1, limit, limit + 1, 2 * limit + 7};
  for (int n = 2; n <= 4; ++n) {
    CAPTURE(n);
    ThreadGroup group(n, CrossDeviceOp::reduction_to_one_device);
    constexpr int kRounds = 120;
    std::vector<int> wrong(static_cast<std::size_t>(n), 0);
    run_replicas(n, [&](int r) {
      std::vector<double> d;
      std::vector<std::int64_t> k;
      for (int round = 0; round < kRounds; ++round) {
        const std::size_t count = lengths[static_cast<std::size_t>(round) % std::size(lengths)];
        // Term of replica q at element e: large and small magnitudes mixed, so that any other
        // order of the adds than ((x_0 + x_1) + x_2) + ... changes the bits somewhere.
        const auto term = [&](int q, std::size_t e) {
          return (q % 2 == 0 ? 1e16 : 1.0) * (q == 2 ? -1.0 : 1.0) + 0.125 * double(round) + double(e % 7);
        };
        d.assign(count, 0.0);
        k.assign(count, 0);
        for (std::size_t e = 0; e < count; ++e) {
          d[e] = term(r, e);
          k[e] = (std::int64_t{round} << 20) + r * 1000 + static_cast<std::int64_t>(e);
        }
        group.endpoint(r).all_reduce_sum(std::span<double>(d), "doubles");
        group.endpoint(r).all_reduce_sum(std::span<std::int64_t>(k), "counts");
        for (std::size_t e = 0; e < count; ++e) {
          double want = term(0, e);
          std::int64_t want_k = 0;
          for (int q = 1; q < n; ++q) want += term(q, e);
          for (int q = 0; q < n; ++q) want_k += (std::int64_t{round} << 20) + q * 1000 + static_cast<std::int64_t>(e);
          if (std::memcmp(&d[e], &want, sizeof want) != 0 || k[e] != want_k) ++wrong[static_cast<std::size_t>(r)];
        }
      }
    });
    for (int r = 0; r < n; ++r) CHECK(wrong[static_cast<std::size_t>(r)] == 0);
  }
  // Mismatched lengths fail on every replica, also where one is short enough to copy and the
  // other is not (the two would otherwise take different ways past the first barrier).
  ThreadGroup pair(2, CrossDeviceOp::reduction_to_one_device);
  for (const auto& [zero, one] : {std::pair{std::size_t{4}, std::size_t{5}}, std::pair{limit, limit + 1},
                                  std::pair{limit + 2, limit + 1}}) {
    CAPTURE(zero);
    CAPTURE(one);
    std::atomic<int> internal_errors{0};
    run_replicas(2, [&](int r) {
      std::vector<double> values(r == 0 ? zero : one, 1.0);
      try {
        pair.endpoint(r).all_reduce_sum(std::span<double>(values), "test");
      } catch (const InternalError&) {
        ++internal_errors;
      }
    });
    CHECK(internal_errors.load() == 2);
  }
}

TEST_CASE("a group of one broadcasts from root 0 only") {
  distribute::SingleCommunicator alone;
  std::vector<float> f{1.5f, -2.0f};
  std::vector<double> d{3.0};
  alone.broadcast(std::span<float>(f), 0, "floats");
  alone.broadcast(std::span<double>(d), 0, "doubles");
  CHECK(f == std::vector<float>{1.5f, -2.0f});
  CHECK(d == std::vector<double>{3.0});
  CHECK_THROWS_AS(alone.broadcast(std::span<float>(f), 1, "from nowhere"), InternalError);
}
