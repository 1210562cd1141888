// Sizes, counts and byte totals multiplied and added without overflow. Sizes come from the user
// (YAML, data files, checkpoints), so every product of them is computed here: an overflow is
// reported (nullopt) instead of wrapping into a small or negative size that later code would trust.
#pragma once

#include <cstdint>
#include <optional>
#include <span>

namespace dtrain {

// a * b, or nullopt when it does not fit in 64 bits.
inline std::optional<std::int64_t> checked_mul(std::int64_t a, std::int64_t b) {
  std::int64_t product = 0;
  if (__builtin_mul_overflow(a, b, &product)) return std::nullopt;
  return product;
}

// a + b, or nullopt when it does not fit in 64 bits.
inline std::optional<std::int64_t> checked_add(std::int64_t a, std::int64_t b) {
  std::int64_t sum = 0;
  if (__builtin_add_overflow(a, b, &sum)) return std::nullopt;
  return sum;
}

// The product of every entry (1 for none), or nullopt on overflow.
inline std::optional<std::int64_t> checked_product(std::span<const std::int64_t> factors) {
  std::int64_t product = 1;
  for (const std::int64_t factor : factors) {
    const auto next = checked_mul(product, factor);
    if (!next) return std::nullopt;
    product = *next;
  }
  return product;
}

// ceil(a / b) for a >= 0, b >= 1, without the overflow of (a + b - 1) / b.
inline std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

}  // namespace dtrain
