// Gradient packs across workers: the plan every worker must agree on, and the hand-over between
// backward and the communication thread. The sums themselves run under mpirun
// (tests/mpi/test_mpi_collectives.cpp with 2 and 4 ranks; tests/integration/multi_worker.sh:
// equivalence, overlap); here the world is one process, where a collective leaves the values as
// they are, so what is checked is that every pack is summed in place exactly, each step, in any
// hand-over order, without races (ThreadSanitizer in CI).
#include <doctest/doctest.h>

#include <numeric>
#include <span>
#include <thread>
#include <vector>

#include "core/error.hpp"
#include "distribute/packed_all_reduce.hpp"
#include "distribute/single_communicator.hpp"

using namespace dtrain;
using distribute::GradientPack;
using distribute::plan_packs;

TEST_CASE("packs are whole variables from the last one, at most bytes_per_pack each") {
  const std::vector<std::size_t> sizes = {288, 32, 18432, 64, 102400, 64, 640, 10};
  // 0: everything in one pack.
  CHECK(plan_packs(sizes, 0) == std::vector<GradientPack>{{0, 8, 121930}});
  // 4 KiB = 1024 floats: small neighbours share a pack, a large variable is a pack of its own.
  CHECK(plan_packs(sizes, 4096) ==
        std::vector<GradientPack>{{5, 8, 714}, {4, 5, 102400}, {3, 4, 64}, {2, 3, 18432}, {0, 2, 320}});
  // 448 KiB = 114688 floats holds the last five variables (103178 floats), not the 18432 before.
  CHECK(plan_packs(sizes, 448 * 1024) == std::vector<GradientPack>{{3, 8, 103178}, {0, 3, 18752}});
  // Fewer bytes than one float: one variable per pack.
  CHECK(plan_packs(sizes, 1).size() == sizes.size());
  CHECK(plan_packs(std::vector<std::size_t>{}, 1024).empty());
  // Every variable in exactly one pack, in backward order.
  for (std::int64_t bytes : {0, 1, 100, 4096, 65536, 1 << 20}) {
    CAPTURE(bytes);
    std::size_t next = sizes.size(), floats = 0;
    for (const GradientPack& p : plan_packs(sizes, bytes)) {
      CHECK(p.last == next);
      CHECK(p.first < p.last);
      next = p.first;
      floats += p.floats;
    }
    CHECK(next == 0);
    CHECK(floats == std::accumulate(sizes.begin(), sizes.end(), std::size_t{0}));
  }
}

namespace {

// A gradient arena: variable i's element k holds 1000 i + k.
struct Gradients {
  std::vector<std::size_t> sizes;
  std::vector<float> arena;
  explicit Gradients(const std::vector<std::size_t>& variable_sizes) : sizes(variable_sizes) {
    for (std::size_t i = 0; i < sizes.size(); ++i)
      for (std::size_t k = 0; k < sizes[i]; ++k) arena.push_back(static_cast<float>(1000 * i + k));
  }
  std::span<float> variable(std::size_t i) {
    return std::span<float>(arena).subspan(std::accumulate(sizes.begin(), sizes.begin() + static_cast<std::ptrdiff_t>(i),
                                                           std::size_t{0}),
                                           sizes[i]);
  }
  bool unchanged() {
    for (std::size_t i = 0; i < sizes.size(); ++i)
      for (std::size_t k = 0; k < sizes[i]; ++k)
        if (variable(i)[k] != static_cast<float>(1000 * i + k)) return false;
    return true;
  }
};

}  // namespace

TEST_CASE("overlapped packs: handed over by layer in any order, every step, the same values as without overlap") {
  distribute::SingleCommunicator world_of_one;
  const std::vector<std::size_t> sizes = {9, 3, 40, 5, 7, 2};
  for (bool overlap : {false, true}) {
    for (std::int64_t bytes : {0, 32, 64}) {
      CAPTURE(overlap);
      CAPTURE(bytes);
      Gradients g(sizes);
      distribute::PackedAllReduce packed(world_of_one, g.arena, g.sizes, bytes, /*ring=*/bytes == 32, overlap);
      // One pack (bytes 0) is only complete when backward is: no thread.
      CHECK(packed.overlaps() == (overlap && packed.packs().size() > 1));
      for (int step = 0; step < 20; ++step) {
        // Layers of two variables, handed over last first (as backward does), or on odd steps
        // first layer first: the communication thread must still send packs in plan order.
        for (std::size_t layer = 0; layer < 3; ++layer) {
          const std::size_t l = step % 2 == 0 ? 2 - layer : layer;
          packed.ready(2 * l, 2);
        }
        packed.finish();
        REQUIRE(g.unchanged());
      }
      CHECK(packed.take_wait_seconds() >= 0.0);
      CHECK(packed.take_collective_seconds() >= 0.0);
    }
  }
}

TEST_CASE("overlapped packs: the hand-over comes from the compute thread, finish from the same") {
  // As in training: a replica thread runs backward (ready) and then finish, step after step,
  // while the communication thread sums; nothing else synchronises them.
  distribute::SingleCommunicator world_of_one;
  Gradients g({100, 10, 1000, 10});
  distribute::PackedAllReduce packed(world_of_one, g.arena, g.sizes, 64, false, true);
  std::thread replica([&] {
    for (int step = 0; step < 200; ++step) {
      for (float& v : g.variable(3)) v += 1.0f;  // backward writes the last layer's gradient...
      packed.ready(2, 2);
      for (float& v : g.variable(0)) v += 1.0f;  // ...and the first layer's while that one is summed
      packed.ready(0, 2);
      packed.finish();
    }
  });
  replica.join();
  CHECK(g.variable(3)[0] == 3000.0f + 200.0f);
  CHECK(g.variable(0)[99] == 99.0f + 200.0f);
}

TEST_CASE("overlapped packs: a variable handed over twice, or finish before all are, is a programming error") {
  distribute::SingleCommunicator world_of_one;
  Gradients g({4, 4});
  {
    distribute::PackedAllReduce packed(world_of_one, g.arena, g.sizes, 16, false, true);
    REQUIRE(packed.overlaps());
    packed.ready(1, 1);
    CHECK_THROWS_AS(packed.ready(1, 1), InternalError);
  }
  {
    distribute::PackedAllReduce packed(world_of_one, g.arena, g.sizes, 16, false, true);
    packed.ready(1, 1);
    CHECK_THROWS_AS(packed.finish(), InternalError);
    CHECK_THROWS_AS(packed.ready(2, 1), InternalError);
  }
}

TEST_CASE("a gradient arena that does not match its variables is a programming error") {
  distribute::SingleCommunicator world_of_one;
  std::vector<float> arena(10);
  const std::vector<std::size_t> sizes = {4, 4};
  CHECK_THROWS_AS(distribute::PackedAllReduce(world_of_one, arena, sizes, 0, false, false), InternalError);
}
