// Output sizes and explicit paddings for Keras' 'valid' and 'same' padding (TensorFlow rules).
#pragma once

#include <cstdint>

#include "config/experiment.hpp"

namespace dtrain::nn {

struct Padding1D {
  std::int64_t out = 0;    // output size
  std::int64_t before = 0; // padding on the top/left
  std::int64_t after = 0;  // padding on the bottom/right
};

// valid: out = floor((in - k) / s) + 1, no padding.
// same:  out = ceil(in / s); total = max((out - 1) * s + k - in, 0), split with the odd one after.
inline Padding1D padding_1d(std::int64_t in, std::int64_t k, std::int64_t s, config::Padding mode) {
  Padding1D p;
  if (mode == config::Padding::valid) {
    p.out = in >= k ? (in - k) / s + 1 : 0;
  } else {
    p.out = (in + s - 1) / s;
    std::int64_t total = (p.out - 1) * s + k - in;
    if (total < 0) total = 0;
    p.before = total / 2;
    p.after = total - p.before;
  }
  return p;
}

}  // namespace dtrain::nn
