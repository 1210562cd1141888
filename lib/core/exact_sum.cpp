#include "core/exact_sum.hpp"

#include <bit>
#include <cfloat>
#include <cmath>

namespace dtrain {

// The array loops run once per micro-batch and variable on every step: built for AVX-512, AVX2
// and plain x86-64 (the loader picks), like the backends' own loops. Every version gives the same
// bits: the products by powers of two are exact, and so is the rounding to integers. (A TSan
// build keeps one version: its runtime does not exist yet when the loader runs the resolver.)
#if defined(__SANITIZE_THREAD__) || !defined(__x86_64__)
#define DTRAIN_SUM_CLONES
#else
#define DTRAIN_SUM_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif

namespace {

// Indices of the non-finite counts after the exponent bins.
constexpr std::size_t kNaN = 254, kPosInf = 255, kNegInf = 256;
// The exponent of bin 0: subnormals and the smallest normals are m * 2^-149.
constexpr int kFirstExponent = -149;

}  // namespace

void ExactSum::add(float x) {
  const auto bits = std::bit_cast<std::uint32_t>(x);
  const std::uint32_t biased = (bits >> 23) & 0xffu;
  const bool negative = (bits >> 31) != 0;
  if (biased == 0xffu) {
    ++bins_[(bits & 0x7fffffu) != 0 ? kNaN : negative ? kNegInf : kPosInf];
    return;
  }
  // Normal: (2^23 + fraction) * 2^(biased - 150), in bin biased - 1; subnormal: fraction * 2^-149,
  // in bin 0 with the smallest normals.
  const std::int64_t m = biased == 0 ? (bits & 0x7fffffu) : ((bits & 0x7fffffu) | 0x800000u);
  bins_[biased == 0 ? 0 : biased - 1] += negative ? -m : m;
}

void ExactSum::merge(const ExactSum& other) {
  for (std::size_t i = 0; i < kBins; ++i) bins_[i] += other.bins_[i];
}

double ExactSum::value() const {
  if (bins_[kNaN] > 0 || (bins_[kPosInf] > 0 && bins_[kNegInf] > 0)) return std::nan("");
  if (bins_[kPosInf] > 0) return HUGE_VAL;
  if (bins_[kNegInf] > 0) return -HUGE_VAL;
  double sum = 0.0;
  for (std::size_t i = 0; i < kNaN; ++i)
    if (bins_[i] != 0) sum += std::ldexp(static_cast<double>(bins_[i]), static_cast<int>(i) + kFirstExponent);
  return sum;
}

namespace fixed_point {

namespace {

DTRAIN_SUM_CLONES float max_magnitude(const float* x, std::size_t n, bool* finite) {
  float largest = 0.0f;
  bool all_finite = true;
  for (std::size_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    largest = a > largest ? a : largest;
    all_finite &= a <= FLT_MAX;  // false for NaN and the infinities
  }
  *finite = all_finite;
  return largest;
}

DTRAIN_SUM_CLONES void accumulate_scaled(const float* x, double scale, double* sum, std::size_t n) {
  // Adding and subtracting 1.5 * 2^52 rounds any |v| <= 2^51 to an integer, ties to even.
  constexpr double round_integer = 6755399441055744.0;
  for (std::size_t i = 0; i < n; ++i) sum[i] += (static_cast<double>(x[i]) * scale + round_integer) - round_integer;
}

DTRAIN_SUM_CLONES void scale_to_float(const double* sum, double scale, float* out, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<float>(sum[i] * scale);
}

}  // namespace

int max_exponent(std::span<const float> x) {
  bool finite = true;
  const float largest = max_magnitude(x.data(), x.size(), &finite);
  if (!finite) return kNonFinite;
  if (largest == 0.0f) return kAllZero;
  int e = 0;
  std::frexp(largest, &e);  // largest = f * 2^e with f in [0.5, 1)
  return e;
}

int scale_for(int e, std::int64_t terms) {
  int log2_terms = 0;
  while ((std::int64_t{1} << log2_terms) < terms) ++log2_terms;
  return 51 - log2_terms - e;
}

void accumulate(std::span<const float> x, int scale, std::span<double> sum) {
  accumulate_scaled(x.data(), std::ldexp(1.0, scale), sum.data(), x.size());
}

void to_float(std::span<const double> sum, int scale, std::span<float> out) {
  scale_to_float(sum.data(), std::ldexp(1.0, -scale), out.data(), sum.size());
}

}  // namespace fixed_point

}  // namespace dtrain
