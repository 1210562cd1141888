// Sums whose result does not depend on the order or grouping of their terms: what makes
// reproducibility: replica_invariant's results the same for any number of replicas, lanes or ranks
// (docs/reproducibility.md). Floating-point addition is not associative, so two layouts that add
// the same terms in another order disagree in the last bits; integers (and doubles holding
// integers below 2^53) are, so both sums below turn every term into one exactly first.
//
// ExactSum: float terms binned by exponent. A finite float is m * 2^e with an integer |m| < 2^24
// and e in [-149, 104]; bin e adds up m as an int64, exactly (2^39 terms per bin before it could
// overflow). Merging two is adding their bins, so every grouping of the same terms gives the same
// bins, and value() is a fixed function of the bins. Non-finite terms are counted apart.
//
// Fixed point (FixedPointSum): the terms of an array sum (the micro-batches' gradients of one
// variable) are rounded to multiples of one quantum 2^-scale, chosen from the largest magnitude
// over every term of every participant and the number of terms so that any partial sum stays
// below 2^51 quanta. Such sums of doubles are exact in any order (every partial sum is an integer
// a double holds), so the existing double collectives combine them. A term smaller than half a
// quantum (about 2^-48 of the largest one with 8 terms) is lost, far below what float32
// summation itself loses.
#pragma once

#include <array>
#include <cstdint>
#include <span>

namespace dtrain {

class ExactSum {
 public:
  // Bins: 254 exponents, then the counts of NaN, +inf and -inf terms.
  static constexpr std::size_t kBins = 254 + 3;

  void add(float x);
  void add(std::span<const float> xs) {
    for (float x : xs) add(x);
  }
  void merge(const ExactSum& other);
  void reset() { bins_.fill(0); }
  // The bins, to be summed element-wise across participants (an int64 all-reduce).
  std::span<std::int64_t, kBins> bins() { return bins_; }
  std::span<const std::int64_t, kBins> bins() const { return bins_; }
  // The sum: NaN if a term was NaN or both infinities were added, an infinity if one was, else the
  // bins added in double from the smallest exponent up (a fixed function of the bins).
  double value() const;

 private:
  std::array<std::int64_t, kBins> bins_{};
};

namespace fixed_point {

// What max_exponent() says of an array that has only zeros, or a non-finite term.
inline constexpr int kAllZero = -100000;
inline constexpr int kNonFinite = 100000;

// The smallest e with |x| < 2^e for every term (frexp's exponent of the largest magnitude);
// kAllZero for an empty or all-zero array, kNonFinite if a term is NaN or infinite.
int max_exponent(std::span<const float> x);
// Whether max_exponent `e` leaves anything to scale (neither all zeros nor a non-finite term).
inline bool has_scale(int e) { return e != kAllZero && e != kNonFinite; }
// The scale for `terms` arrays whose largest magnitude over all of them has max_exponent `e`
// (not kAllZero or kNonFinite): every term times 2^scale is below 2^51 / terms (rounded to a power
// of two), so their sum in any order stays exact.
int scale_for(int e, std::int64_t terms);
// sum[i] += x[i] * 2^scale rounded to the nearest integer (ties to even).
void accumulate(std::span<const float> x, int scale, std::span<double> sum);
// out[i] = sum[i] * 2^-scale, rounded once to float.
void to_float(std::span<const double> sum, int scale, std::span<float> out);

}  // namespace fixed_point

}  // namespace dtrain
