// The collectives between worker processes, on real MPI ranks: CTest runs this under
// `mpirun --oversubscribe -n 2` and `-n 4`. Every rank runs every test case; the values are
// integers held in floats, so every sum is exact in any order and each element is checked against
// its known total on every rank. The process's exit code is the worst of all ranks'. No check may
// leave a test case early on some ranks only (REQUIRE): the others would wait in its collectives
// until the watchdog aborts the job.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <xmmintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "distribute/mpi_communicator.hpp"
#include "distribute/multi_worker_mirrored.hpp"
#include "distribute/packed_all_reduce.hpp"
#include "distribute/strategy.hpp"

using namespace dtrain;
using distribute::MpiCommunicator;

namespace {

MpiCommunicator* the_world = nullptr;  // set once by main() before any test runs

MpiCommunicator& world() { return *the_world; }

// Rank r's element i: (r + 1) * (i % 97 + 1), so the sum over n ranks is n (n + 1) / 2 * (i % 97 + 1).
float value(int rank, std::size_t i) { return static_cast<float>((rank + 1) * static_cast<int>(i % 97 + 1)); }
float total(int ranks, std::size_t i) { return static_cast<float>(ranks * (ranks + 1) / 2 * static_cast<int>(i % 97 + 1)); }

// How many elements differ from their known total.
std::size_t wrong_totals(std::span<const float> values, int ranks) {
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < values.size(); ++i)
    if (values[i] != total(ranks, i)) ++wrong;
  return wrong;
}

// Backward hands variables over a layer (two variables) at a time, last layer first.
void hand_over(distribute::Reducer& reducer, std::size_t variables) {
  for (std::size_t end = variables; end > 0;) {
    const std::size_t first = end >= 2 ? end - 2 : 0;
    reducer.ready(first, end - first);
    end = first;
  }
}

}  // namespace

TEST_CASE("the MPI communicator: exact sums of floats, doubles and int64s, the maximum, reduce_sum_to") {
  MpiCommunicator& w = world();
  const int n = w.size(), r = w.rank();
  CHECK(std::string(w.name()) == "mpi");
  CHECK(n == w.world_size());
  CHECK(r == w.world_rank());
  for (std::size_t length : {std::size_t{0}, std::size_t{1}, static_cast<std::size_t>(n - 1), std::size_t{1001}}) {
    CAPTURE(length);
    std::vector<float> f(length), ring(length);
    for (std::size_t i = 0; i < length; ++i) f[i] = ring[i] = value(r, i);
    w.all_reduce_sum(std::span<float>(f), "floats");
    CHECK(wrong_totals(f, n) == 0);
    w.ring_all_reduce_sum(std::span<float>(ring), "ring");
    CHECK(wrong_totals(ring, n) == 0);
  }
  std::vector<double> d = {0.5 * r, 1.0};
  w.all_reduce_sum(std::span<double>(d), "doubles");
  CHECK(d == std::vector<double>{0.25 * n * (n - 1), double(n)});
  std::vector<std::int64_t> k = {std::int64_t{1} << (40 + r), -r};
  w.all_reduce_sum(std::span<std::int64_t>(k), "int64s");
  std::int64_t powers = 0;
  for (int q = 0; q < n; ++q) powers += std::int64_t{1} << (40 + q);
  CHECK(k == std::vector<std::int64_t>{powers, -n * (n - 1) / 2});
  CHECK(w.all_reduce_max(10 * ((r + 1) % n), "max") == 10 * (n - 1));
  for (int root = 0; root < n; ++root) {
    CAPTURE(root);
    std::vector<float> to_root(300);
    for (std::size_t i = 0; i < to_root.size(); ++i) to_root[i] = value(r, i);
    w.reduce_sum_to(std::span<float>(to_root), root, "to root");
    std::size_t changed = 0;
    for (std::size_t i = 0; i < to_root.size(); ++i) changed += to_root[i] != value(r, i);
    if (r == root) {
      CHECK(wrong_totals(to_root, n) == 0);
    } else {
      CHECK(changed == 0);
    }
  }
  std::vector<float> bad(3);
  CHECK_THROWS_AS(w.reduce_sum_to(std::span<float>(bad), n, "to nowhere"), InternalError);
}

TEST_CASE("the MPI communicator: broadcast hands every rank the root's floats and doubles, from any root") {
  MpiCommunicator& w = world();
  const int r = w.rank(), n = w.size();
  for (int root = 0; root < n; ++root) {
    CAPTURE(root);
    std::vector<float> f(1001);
    std::vector<double> d(17);
    for (std::size_t i = 0; i < f.size(); ++i) f[i] = value(r, i) + 0.25f;
    for (std::size_t i = 0; i < d.size(); ++i) d[i] = 1.0 / (r + 3) + static_cast<double>(i);
    w.broadcast(std::span<float>(f), root, "broadcast floats");
    w.broadcast(std::span<double>(d), root, "broadcast doubles");
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < f.size(); ++i) wrong += f[i] != value(root, i) + 0.25f;
    for (std::size_t i = 0; i < d.size(); ++i) wrong += d[i] != 1.0 / (root + 3) + static_cast<double>(i);
    CHECK(wrong == 0);
  }
  std::vector<float> bad(3);
  CHECK_THROWS_AS(w.broadcast(std::span<float>(bad), n, "to nowhere"), InternalError);
}

TEST_CASE("a failing MPI call throws, naming the call, the rank and MPI's error") {
  MpiCommunicator& w = world();
  try {
    w.send_training_done(w.world_size() + 3);  // no such rank
    FAIL("no error");
  } catch (const InternalError& e) {
    const std::string message = e.what();
    CAPTURE(message);
    CHECK(message.find("MPI_Isend failed on rank " + std::to_string(w.world_rank()) + " of " +
                       std::to_string(w.world_size()) + ": ") == 0);
    CHECK(message.find("rank") != std::string::npos);
  }
  CHECK_FALSE(w.training_done());  // nothing was sent
}

TEST_CASE("packed all-reduce: every element of the arena sums exactly, any pack size, overlap on and off, ring and mpi") {
  MpiCommunicator& w = world();
  const int n = w.size(), r = w.rank();
  // The seed CNN's shape of variables, smaller, with odd sizes and an empty one.
  const std::vector<std::size_t> sizes = {288, 32, 1843, 64, 10240, 0, 640, 10, 7};
  const std::size_t floats = std::accumulate(sizes.begin(), sizes.end(), std::size_t{0});
  for (bool ring : {false, true})
    for (bool overlap : {false, true})
      for (std::int64_t bytes : {std::int64_t{0}, std::int64_t{64}, std::int64_t{4096}, std::int64_t{1} << 20}) {
        CAPTURE(ring);
        CAPTURE(overlap);
        CAPTURE(bytes);
        std::vector<float> arena(floats);
        distribute::PackedAllReduce packed(w, arena, sizes, bytes, ring, overlap);
        CHECK(packed.overlaps() == (overlap && packed.packs().size() > 1));
        for (int step = 0; step < 3; ++step) {
          for (std::size_t i = 0; i < floats; ++i) arena[i] = value(r, i);
          hand_over(packed, sizes.size());
          packed.finish();
          CHECK(wrong_totals(arena, n) == 0);
        }
        CHECK(packed.take_collective_seconds() >= 0.0);
      }
}

TEST_CASE("packed all-reduce: the communication thread flushes subnormal floats to zero (FTZ/DAZ)") {
  MpiCommunicator& w = world();
  // Cleared here, so the communication thread cannot inherit the bits: it must set them itself.
  _mm_setcsr(_mm_getcsr() & ~0x8040u);
  const std::vector<std::size_t> sizes = {100, 100, 100};
  std::vector<float> arena(300);
  distribute::PackedAllReduce packed(w, arena, sizes, 400, /*ring=*/true, /*overlap=*/true);
  CHECK(packed.overlaps());
  std::fill(arena.begin(), arena.end(), 1e-40f);  // subnormal
  hand_over(packed, sizes.size());
  packed.finish();
  // Summed on the communication thread, where subnormal inputs read as zero.
  CHECK(std::count(arena.begin(), arena.end(), 0.0f) == 300);
}

TEST_CASE("packed all-reduce: overlap on and off give the same bits on values whose sum depends on the order") {
  MpiCommunicator& w = world();
  const std::vector<std::size_t> sizes = {100, 3, 2000, 17, 500};
  const std::size_t floats = std::accumulate(sizes.begin(), sizes.end(), std::size_t{0});
  for (bool ring : {false, true}) {
    CAPTURE(ring);
    std::vector<std::vector<float>> results;
    for (bool overlap : {false, true}) {
      std::vector<float> arena(floats);
      Rng rng(11, RngStream::test, static_cast<std::uint64_t>(w.rank()));
      for (float& v : arena) v = rng.uniform(-1.0f, 1.0f) * 1e4f;
      distribute::PackedAllReduce packed(w, arena, sizes, 1024, ring, overlap);
      hand_over(packed, sizes.size());
      packed.finish();
      results.push_back(arena);
    }
    CHECK(std::memcmp(results[0].data(), results[1].data(), floats * sizeof(float)) == 0);
  }
}

TEST_CASE("multi_worker_mirrored with 2 local replicas per rank: gradients, in-replica sums, reduce, all_gather") {
  MpiCommunicator& w = world();
  const int n = w.size();
  distribute::MultiWorkerMirroredOptions options;
  options.devices.automatic = false;
  options.devices.names = {"cpu:0", "cpu:1"};
  options.communication.bytes_per_pack = 4096;
  for (auto impl : {config::CommunicationImplementation::mpi, config::CommunicationImplementation::ring}) {
    CAPTURE(static_cast<int>(impl));
    options.communication.implementation = impl;
    auto strategy = distribute::make_strategy(distribute::strategy_config(options), 2, w);
    REQUIRE(strategy->num_local_replicas() == 2);
    REQUIRE(strategy->num_replicas_in_sync() == 2 * n);
    CHECK(strategy->worker_index() == w.rank());
    CHECK(strategy->is_chief() == (w.rank() == 0));
    const std::vector<std::size_t> sizes = {288, 32, 5000, 64, 10};
    const std::size_t floats = std::accumulate(sizes.begin(), sizes.end(), std::size_t{0});
    std::vector<std::vector<float>> arenas(2, std::vector<float>(floats));
    const auto ctx = device::make_context(Device{});
    for (int local = 0; local < 2; ++local)
      strategy->bind_gradients(local, *ctx,
                               Tensor::borrowed(arenas[static_cast<std::size_t>(local)].data(),
                                                Shape{static_cast<std::int64_t>(floats)}),
                               sizes);
    CHECK_FALSE(strategy->overlaps_backward());  // several local replicas sum among themselves first
    std::vector<std::vector<double>> in_replica(2);
    std::vector<int> global_ids(2);
    for (int step = 0; step < 2; ++step) {
      strategy->run([&](const distribute::ReplicaContext& rc) {
        const auto local = static_cast<std::size_t>(rc.replica_id);
        global_ids[local] = rc.global_replica_id;
        // The global replicas 0 .. 2n-1 play the ranks of a 2n-rank job.
        for (std::size_t i = 0; i < floats; ++i) arenas[local][i] = value(rc.global_replica_id, i);
        strategy->sum_gradients(rc);
        in_replica[local] = {double(rc.global_replica_id + 1), 0.5};
        strategy->all_reduce_sum_in_replica(rc, in_replica[local], "in replica");
      });
      for (std::size_t local = 0; local < 2; ++local) {
        CAPTURE(local);
        CHECK(global_ids[local] == 2 * w.rank() + static_cast<int>(local));
        CHECK(wrong_totals(arenas[local], 2 * n) == 0);
        CHECK(in_replica[local] == std::vector<double>{double(n * (2 * n + 1)), 0.5 * 2 * n});
      }
    }
    const std::vector<double> losses = {1.0, 2.0};
    CHECK(strategy->reduce_sum(losses) == 3.0 * n);
    std::vector<std::int64_t> want(static_cast<std::size_t>(n));
    for (int q = 0; q < n; ++q) want[static_cast<std::size_t>(q)] = 100 + q;
    CHECK(strategy->all_gather(100 + w.rank(), "gather") == want);
    CHECK(strategy->all_reduce_max(w.rank(), "max") == n - 1);
  }
}

TEST_CASE("collectives in backward turn the overlap off, and the header says so") {
  MpiCommunicator& w = world();
  distribute::MultiWorkerMirroredOptions options;  // devices auto: one replica per rank
  options.communication.bytes_per_pack = 64;
  const config::StrategyConfig sc = distribute::strategy_config(options);
  const std::vector<std::size_t> sizes = {40, 40, 40};
  for (bool in_backward : {false, true}) {
    CAPTURE(in_backward);
    auto strategy = distribute::make_strategy(sc, 1, w);
    std::vector<float> arena(120);
    strategy->set_collectives_in_backward(in_backward);
    const auto ctx = device::make_context(Device{});
    strategy->bind_gradients(0, *ctx, Tensor::borrowed(arena.data(), Shape{120}), sizes);
    CHECK(strategy->overlaps_backward() == !in_backward);
    const std::string header = strategy->describe();
    CAPTURE(header);
    CHECK((header.find(", overlapping backward") != std::string::npos) == !in_backward);
    CHECK((header.find("not overlapping backward (the model makes collectives during backward)") != std::string::npos) ==
          in_backward);
    CHECK_THROWS_AS(strategy->set_collectives_in_backward(true), InternalError);
    // A step: backward hands the layers over; with the overlap off (only then) a collective may
    // come in the middle of backward, in the same order on every rank.
    strategy->run([&](const distribute::ReplicaContext& rc) {
      for (std::size_t i = 0; i < arena.size(); ++i) arena[i] = value(rc.global_replica_id, i);
      std::vector<double> statistic = {1.0};
      strategy->gradients_ready(rc, 1, 2);
      if (in_backward) {
        strategy->all_reduce_sum_in_replica(rc, statistic, "batch statistics");
      } else {
        // Refused on every rank alike, before any MPI call: the packs are on their way.
        CHECK_THROWS_AS(strategy->all_reduce_sum_in_replica(rc, statistic, "batch statistics"), InternalError);
      }
      strategy->gradients_ready(rc, 0, 1);
      CHECK(statistic[0] == (in_backward ? double(w.size()) : 1.0));
      strategy->sum_gradients(rc);
    });
    CHECK(wrong_totals(arena, w.size()) == 0);
  }
}

int main(int argc, char** argv) {
  MpiCommunicator world;
  world.set_timeout(60);  // a test that lost a rank fails in a minute, naming it
  the_world = &world;
  doctest::Context context(argc, argv);
  const int failed = context.run();
  // Every rank ends with the worst result, so mpirun reports a failure on any rank.
  return world.all_reduce_max(failed, "test results");
}
