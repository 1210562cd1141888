// bfloat16 <-> float on bit patterns, the one definition both backends round by: the CPU
// backend's f32 <-> bf16 copies (backends/onednn/context.cpp) and the CUDA backend's conversions
// (backends/cuda/math.hpp), so a tensor converted on either holds the same bits.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DTRAIN_BF16_HD __host__ __device__
#else
#define DTRAIN_BF16_HD
#endif

namespace dtrain {

// As AVX512-BF16's vcvtneps2bf16 and oneDNN's reference round: to nearest even; zero and subnormal
// inputs become a zero of the same sign; infinities keep their bits; a NaN keeps its sign and top
// mantissa bits and is made quiet.
DTRAIN_BF16_HD inline std::uint16_t bf16_from_f32_bits(std::uint32_t bits) {
  const std::uint32_t exponent = bits & 0x7F800000u;
  const std::uint32_t mantissa = bits & 0x007FFFFFu;
  const auto high = static_cast<std::uint16_t>(bits >> 16);
  if (exponent == 0) return static_cast<std::uint16_t>(high & 0x8000u);
  if (exponent == 0x7F800000u) return mantissa == 0 ? high : static_cast<std::uint16_t>(high | 0x0040u);
  return static_cast<std::uint16_t>((bits + 0x7FFFu + (high & 1u)) >> 16);
}

// Widening is exact: bfloat16 is the high half of a float.
DTRAIN_BF16_HD inline std::uint32_t f32_bits_from_bf16(std::uint16_t h) { return static_cast<std::uint32_t>(h) << 16; }

}  // namespace dtrain
