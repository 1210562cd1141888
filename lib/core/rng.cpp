#include "core/rng.hpp"

#include <cmath>

namespace dtrain {
namespace {

__extension__ typedef unsigned __int128 u128;

constexpr std::uint32_t kMul0 = kPhiloxMul0, kMul1 = kPhiloxMul1;
constexpr std::uint32_t kWeyl0 = kPhiloxWeyl0, kWeyl1 = kPhiloxWeyl1;

std::array<std::uint32_t, 4> philox(std::array<std::uint32_t, 4> c, std::array<std::uint32_t, 2> k) {
  for (int round = 0; round < kPhiloxRounds; ++round) {
    std::uint64_t p0 = std::uint64_t{kMul0} * c[0];
    std::uint64_t p1 = std::uint64_t{kMul1} * c[2];
    std::uint32_t hi0 = static_cast<std::uint32_t>(p0 >> 32), lo0 = static_cast<std::uint32_t>(p0);
    std::uint32_t hi1 = static_cast<std::uint32_t>(p1 >> 32), lo1 = static_cast<std::uint32_t>(p1);
    c = {hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0};
    k[0] += kWeyl0;
    k[1] += kWeyl1;
  }
  return c;
}

}  // namespace

PhiloxInput sample_philox_input(std::uint64_t seed, RngStream stream, std::uint64_t step, std::uint64_t sample,
                                std::uint32_t layer) {
  // counter = (block | stream, layer | sample | step); key = seed, with the rarely used high halves
  // of step and sample folded in.
  return {{0u, (static_cast<std::uint32_t>(stream) << 24) | (layer & 0xFFFFFFu), static_cast<std::uint32_t>(sample),
           static_cast<std::uint32_t>(step)},
          {static_cast<std::uint32_t>(seed) ^ static_cast<std::uint32_t>(sample >> 32),
           static_cast<std::uint32_t>(seed >> 32) ^ static_cast<std::uint32_t>(step >> 32)}};
}

std::array<std::uint32_t, 4> sample_bits(std::uint64_t seed, RngStream stream, std::uint64_t step,
                                         std::uint64_t sample, std::uint32_t layer, std::uint32_t block) {
  PhiloxInput in = sample_philox_input(seed, stream, step, sample, layer);
  in.counter[0] = block;
  return philox(in.counter, in.key);
}

Rng::Rng(std::uint64_t seed, RngStream stream, std::uint64_t index)
    : key_{static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32)},
      // counter = (draw number: 0, 32 bits | stream id | index: 64 bits). Streams never overlap
      // while a stream draws fewer than 2^34 numbers.
      counter_{0u, static_cast<std::uint32_t>(stream), static_cast<std::uint32_t>(index),
               static_cast<std::uint32_t>(index >> 32)} {}

void Rng::refill() {
  block_ = philox(counter_, key_);
  ++counter_[0];
  used_ = 0;
}

std::uint32_t Rng::next_u32() {
  if (used_ == 4) refill();
  return block_[used_++];
}

std::uint64_t Rng::next_u64() {
  std::uint64_t hi = next_u32();
  return (hi << 32) | next_u32();
}

float Rng::uniform() { return static_cast<float>(next_u32() >> 8) * (1.0f / 16777216.0f); }

std::uint64_t Rng::below(std::uint64_t n) {
  // 64x64 -> 128-bit multiply; rejection keeps the result exactly uniform.
  std::uint64_t x = next_u64();
  u128 m = static_cast<u128>(x) * n;
  std::uint64_t low = static_cast<std::uint64_t>(m);
  if (low < n) {
    std::uint64_t threshold = (0 - n) % n;
    while (low < threshold) {
      x = next_u64();
      m = static_cast<u128>(x) * n;
      low = static_cast<std::uint64_t>(m);
    }
  }
  return static_cast<std::uint64_t>(m >> 64);
}

float Rng::normal() {
  float u1 = uniform();
  float u2 = uniform();
  if (u1 < 1e-12f) u1 = 1e-12f;
  return std::sqrt(-2.0f * std::log(u1)) * std::cos(6.283185307179586f * u2);
}

}  // namespace dtrain
