// core/exact_sum.hpp: sums that give the same bits in any order and grouping, and the splits of
// data/pipeline.hpp that reproducibility: replica_invariant rests on (replica_offset's micro-batches
// over the replicas, part_offset's work over a replica's threads).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "core/exact_sum.hpp"
#include "data/pipeline.hpp"

using namespace dtrain;

namespace {

// Terms of wildly different magnitudes and signs, where float and double sums depend on order.
std::vector<float> awkward_terms(std::size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-40, 30);
  std::vector<float> x(n);
  for (float& v : x) v = std::ldexp(mantissa(gen), exponent(gen));
  x[3] = std::numeric_limits<float>::denorm_min();
  x[5] = -0.0f;
  return x;
}

// The sum in long double, smallest magnitudes first: close to the exact sum, for a loose check.
double reference_sum(std::vector<float> x) {
  std::sort(x.begin(), x.end(), [](float a, float b) { return std::fabs(a) < std::fabs(b); });
  long double s = 0.0L;
  for (float v : x) s += v;
  return static_cast<double>(s);
}

}  // namespace

TEST_CASE("ExactSum: the same bins and value in any order and grouping") {
  std::vector<float> x = awkward_terms(1000, 1);
  ExactSum whole;
  whole.add(x);
  std::mt19937 gen(2);
  for (int trial = 0; trial < 20; ++trial) {
    std::shuffle(x.begin(), x.end(), gen);
    // Split into 1..7 parts, each summed on its own, then merged in reverse.
    const std::size_t parts = 1 + static_cast<std::size_t>(trial % 7);
    std::vector<ExactSum> partial(parts);
    for (std::size_t i = 0; i < x.size(); ++i) partial[i % parts].add(x[i]);
    ExactSum merged;
    for (std::size_t p = parts; p-- > 0;) merged.merge(partial[p]);
    CHECK(std::equal(merged.bins().begin(), merged.bins().end(), whole.bins().begin()));
    CHECK(std::bit_cast<std::uint64_t>(merged.value()) == std::bit_cast<std::uint64_t>(whole.value()));
  }
  CHECK(whole.value() == doctest::Approx(reference_sum(x)).epsilon(1e-12));
}

TEST_CASE("ExactSum: simple values, cancellation and non-finite terms") {
  ExactSum s;
  s.add(std::vector<float>{1.0f, 2.5f, -0.5f});
  CHECK(s.value() == 3.0);
  ExactSum c;
  c.add(std::vector<float>{1e30f, 1.0f, -1e30f});  // a float or double sum in this order gives 0
  CHECK(c.value() == 1.0);
  ExactSum tiny;
  tiny.add(std::numeric_limits<float>::denorm_min());
  CHECK(tiny.value() == static_cast<double>(std::numeric_limits<float>::denorm_min()));
  ExactSum inf;
  inf.add(std::vector<float>{1.0f, std::numeric_limits<float>::infinity()});
  CHECK(inf.value() == HUGE_VAL);
  inf.add(-std::numeric_limits<float>::infinity());
  CHECK(std::isnan(inf.value()));
  ExactSum nan;
  nan.add(std::nanf(""));
  CHECK(std::isnan(nan.value()));
}

TEST_CASE("fixed point: the sum of many arrays is the same in any order and grouping") {
  const std::size_t n = 257, arrays = 9;
  std::vector<std::vector<float>> terms;
  for (unsigned a = 0; a < arrays; ++a) terms.push_back(awkward_terms(n, 10 + a));
  int e = fixed_point::kAllZero;
  for (const auto& t : terms) e = std::max(e, fixed_point::max_exponent(t));
  REQUIRE(e != fixed_point::kAllZero);
  const int scale = fixed_point::scale_for(e, static_cast<std::int64_t>(arrays));
  std::vector<float> first;
  std::mt19937 gen(3);
  std::vector<std::size_t> order(arrays);
  std::iota(order.begin(), order.end(), 0);
  for (int trial = 0; trial < 10; ++trial) {
    std::shuffle(order.begin(), order.end(), gen);
    // Two groups summed apart, then their double sums added: as replicas and then ranks do.
    std::vector<double> a(n, 0.0), b(n, 0.0);
    for (std::size_t i = 0; i < arrays; ++i) fixed_point::accumulate(terms[order[i]], scale, i % 3 == 0 ? a : b);
    for (std::size_t j = 0; j < n; ++j) a[j] += b[j];
    std::vector<float> out(n);
    fixed_point::to_float(a, scale, out);
    if (first.empty()) first = out;
    CHECK(std::equal(out.begin(), out.end(), first.begin(), [](float x, float y) {
      return std::bit_cast<std::uint32_t>(x) == std::bit_cast<std::uint32_t>(y);
    }));
  }
  // Close to the true sum: within a few quanta of the largest term's scale.
  for (std::size_t j = 0; j < n; ++j) {
    long double exact = 0.0L;
    for (const auto& t : terms) exact += t[j];
    CHECK(std::fabs(static_cast<double>(first[j]) - static_cast<double>(exact)) <=
          std::ldexp(static_cast<double>(arrays), -scale) + std::fabs(static_cast<double>(exact)) * 1e-7);
  }
}

TEST_CASE("fixed point: exponents of zeros, non-finite values and the scale's headroom") {
  CHECK(fixed_point::max_exponent(std::vector<float>{0.0f, -0.0f}) == fixed_point::kAllZero);
  CHECK(fixed_point::max_exponent(std::vector<float>{}) == fixed_point::kAllZero);
  CHECK(fixed_point::max_exponent(std::vector<float>{1.0f, std::nanf("")}) == fixed_point::kNonFinite);
  CHECK(fixed_point::max_exponent(std::vector<float>{-std::numeric_limits<float>::infinity()}) == fixed_point::kNonFinite);
  CHECK(fixed_point::max_exponent(std::vector<float>{0.75f, -3.0f}) == 2);  // 3 < 2^2
  // The largest float in every one of 2^k terms still sums below 2^51 quanta: no overflow, exact.
  const float big = std::numeric_limits<float>::max();
  const int e = fixed_point::max_exponent(std::vector<float>{big});
  const int scale = fixed_point::scale_for(e, 8);
  std::vector<double> sum(1, 0.0);
  for (int i = 0; i < 8; ++i) fixed_point::accumulate(std::vector<float>{big}, scale, sum);
  CHECK(sum[0] <= std::ldexp(1.0, 51));
  std::vector<float> out(1);
  fixed_point::to_float(sum, scale, out);
  CHECK(std::isinf(out[0]));  // 8 * FLT_MAX does not fit a float
}

TEST_CASE("part_offset in whole units: a replica's threads take whole units, the last one short") {
  // 50 rows in units of 8: 7 units (the last of 2 rows) over 3 parts take 3, 2, 2.
  CHECK(data::part_offset(50, 3, 0, 8) == 0);
  CHECK(data::part_offset(50, 3, 1, 8) == 24);
  CHECK(data::part_offset(50, 3, 2, 8) == 40);
  CHECK(data::part_offset(50, 3, 3, 8) == 50);
  // More parts than units: the last parts get none.
  CHECK(data::part_offset(10, 4, 2, 8) == 10);
  CHECK(data::part_offset(10, 4, 1, 8) == 8);
  // Granule 1: rows.
  for (int p = 0; p <= 4; ++p) CHECK(data::part_offset(10, 4, p, 1) == data::part_offset(10, 4, p));
  CHECK(data::part_offset(10, 4, 1) == 3);
}

TEST_CASE("replica_offset: a global batch split over the replicas as tf.distribute splits it") {
  // TensorFlow 2.21's experimental_distribute_dataset (MirroredStrategy on 3 and 4 logical CPUs,
  // MultiWorkerMirroredStrategy on 3 workers): ceil(G / R) rows each until the batch runs out.
  const auto split = [](std::int64_t size, int replicas, std::int64_t granule = 1) {
    std::vector<std::int64_t> rows;
    for (int r = 0; r < replicas; ++r)
      rows.push_back(data::replica_offset(size, replicas, r + 1, granule) - data::replica_offset(size, replicas, r, granule));
    return rows;
  };
  using Rows = std::vector<std::int64_t>;
  CHECK(split(64, 3) == Rows{22, 22, 20});
  CHECK(split(66, 4) == Rows{17, 17, 17, 15});
  CHECK(split(63, 3) == Rows{21, 21, 21});
  CHECK(split(38, 3) == Rows{13, 13, 12});  // the short last batches of 230 samples
  CHECK(split(41, 3) == Rows{14, 14, 13});
  CHECK(split(9, 4) == Rows{3, 3, 3, 0});
  CHECK(split(1, 2) == Rows{1, 0});
  CHECK(split(5, 2) == Rows{3, 2});
  // In whole micro-batches (replica_invariant): 50 rows in units of 8 (7 units, the last of 2 rows)
  // over 3 replicas take 3, 3 and 1 units.
  CHECK(split(50, 3, 8) == Rows{24, 24, 2});
  CHECK(split(10, 4, 8) == Rows{8, 2, 0, 0});
  CHECK(data::replica_offset(50, 3, 0, 8) == 0);
}
