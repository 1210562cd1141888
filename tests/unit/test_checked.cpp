// Checked size arithmetic (core/checked.hpp) and the tensor sizes built on it: a product that does
// not fit in 64 bits, or bytes the machine cannot hold, is refused before anything is allocated.
#include <doctest/doctest.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "core/checked.hpp"
#include "core/error.hpp"
#include "core/machine.hpp"
#include "core/tensor.hpp"

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
  CHECK_THROWS_WITH_AS(Tensor(Shape{1600, 2147483647}), doctest::Contains("of memory"), ConfigError);
  CHECK(max_compute_threads() >= 64);
  CHECK(physical_memory_bytes() > 0);
  CHECK(format_bytes(512) == "512 bytes");
  CHECK(format_bytes(std::int64_t{3} << 30) == "3.0 GB");
}
