// Checked size arithmetic (core/checked.hpp) and the tensor sizes built on it: a product that does
// not fit in 64 bits, or bytes the machine cannot hold, is refused before anything is allocated.
#include <doctest/doctest.h>

#include <cstdint>
#include <fstream>
#include <filesystem>
#include <limits>
#include <vector>

#include "core/checked.hpp"
#include "core/error.hpp"
#include "core/machine.hpp"
#include "core/tensor.hpp"
#include "test_support.hpp"

using namespace dtrain;

TEST_CASE("checked_mul, checked_add and checked_product report overflow instead of wrapping") {
  constexpr std::int64_t max = std::numeric_limits<std::int64_t>::max();
  CHECK(checked_mul(3, 7) == 21);
  CHECK(checked_mul(std::int64_t{1} << 62, 2) == std::nullopt);
  CHECK(checked_mul(max, 1) == max);
  CHECK(checked_add(max, 1) == std::nullopt);
  CHECK(checked_add(max - 1, 1) == max);
  const std::vector<std::int64_t> fits = {28, 28, 1}, overflows = {max, 28, 1};
  CHECK(checked_product(fits) == 784);
  CHECK(checked_product(overflows) == std::nullopt);
  CHECK(checked_product(std::vector<std::int64_t>{}) == 1);
}

TEST_CASE("ceil_div does not overflow for the largest batch") {
  constexpr std::int64_t max = std::numeric_limits<std::int64_t>::max();
  CHECK(ceil_div(500, max) == 1);  // (500 + max - 1) / max overflowed: an eval of nothing
  CHECK(ceil_div(0, 7) == 0);
  CHECK(ceil_div(14, 7) == 2);
  CHECK(ceil_div(15, 7) == 3);
}

TEST_CASE("a shape whose element count overflows, or a tensor larger than memory, is a ConfigError") {
  CHECK_THROWS_AS((void)Shape({std::numeric_limits<std::int64_t>::max(), 28, 1}).numel(), ConfigError);
  CHECK_THROWS_WITH_AS(Tensor(Shape{1600, 2147483647}), doctest::Contains("needs 12.5 TB, more than"), ConfigError);
  CHECK(max_compute_threads() >= 64);
  CHECK(usable_memory().bytes > 0);
  CHECK(format_bytes(512) == "512 bytes");
  CHECK(format_bytes(std::int64_t{3} << 30) == "3.0 GB");
}

namespace {

void write_limit(const std::filesystem::path& dir, const char* file, const std::string& value) {
  std::filesystem::create_directories(dir);
  std::ofstream(dir / file) << value << "\n";
}

}  // namespace

TEST_CASE("the cgroup memory limit: the least over the process's cgroup and its ancestors, v1 and v2") {
  testing::ScratchDir scratch("cgroup");
  const std::string v1 = (scratch.path() / "v1").string(), v2 = (scratch.path() / "v2").string();
  // v1 (the memory controller's own hierarchy): a job's limit under a looser parent, unlimited at the root.
  write_limit(v1, "memory.limit_in_bytes", "9223372036854771712");
  write_limit(v1 + "/batch", "memory.limit_in_bytes", "8589934592");
  write_limit(v1 + "/batch/job7", "memory.limit_in_bytes", "2147483648");
  CHECK(cgroup_memory_limit("4:memory:/batch/job7\n", v1, v2) == std::int64_t{2147483648});
  CHECK(cgroup_memory_limit("5:cpu,cpuacct\n4:cpuacct,memory:/batch/job7/\n", v1, v2) == std::int64_t{2147483648});
  // A parent's tighter limit binds the child.
  write_limit(v1 + "/batch", "memory.limit_in_bytes", "1073741824");
  CHECK(cgroup_memory_limit("4:memory:/batch/job7\n", v1, v2) == std::int64_t{1073741824});
  // v2: "max" means none; the unified hierarchy is named by the "0::" line.
  write_limit(v2 + "/user.slice", "memory.max", "max");
  write_limit(v2 + "/user.slice/session-3.scope", "memory.max", "3221225472");
  CHECK(cgroup_memory_limit("0::/user.slice/session-3.scope\n", v1, v2) == std::int64_t{3221225472});
  write_limit(v2 + "/user.slice/session-3.scope", "memory.max", "max");
  CHECK_FALSE(cgroup_memory_limit("0::/user.slice/session-3.scope\n", v1, v2).has_value());
  // Nothing readable, or text that is no limit: no limit.
  CHECK_FALSE(cgroup_memory_limit("4:memory:/elsewhere\n", v1 + "/missing", v2).has_value());
  write_limit(v2 + "/odd", "memory.max", "lots");
  CHECK_FALSE(cgroup_memory_limit("0::/odd\n", v1 + "/missing", v2).has_value());
  CHECK_FALSE(cgroup_memory_limit("", v1, v2).has_value());
}

TEST_CASE("memory limits are named for what sets them") {
  const std::int64_t two_gb = std::int64_t{2} << 30;
  CHECK(describe(MemoryLimit{two_gb}) == "this machine's 2.0 GB of memory");
  CHECK(describe(MemoryLimit{two_gb, MemoryLimit::Source::cgroup}) == "the 2.0 GB memory limit of this process's cgroup");
  CHECK(describe(MemoryLimit{two_gb, MemoryLimit::Source::address_space}) ==
        "the 2.0 GB address-space limit of this process (ulimit -v)");
}
