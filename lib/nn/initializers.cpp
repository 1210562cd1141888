#include "nn/initializers.hpp"

#include <cmath>

namespace dtrain::nn {

void glorot_uniform(Tensor& kernel, std::int64_t fan_in, std::int64_t fan_out, Rng& rng) {
  const float limit = static_cast<float>(std::sqrt(6.0 / static_cast<double>(fan_in + fan_out)));
  for (float& v : kernel.span<float>()) v = rng.uniform(-limit, limit);
}

}  // namespace dtrain::nn
