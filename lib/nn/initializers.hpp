// Keras' default initializers.
#pragma once

#include <cstdint>

#include "core/rng.hpp"
#include "core/tensor.hpp"

namespace dtrain::nn {

// glorot_uniform: U(-limit, limit), limit = sqrt(6 / (fan_in + fan_out)). Values are drawn in the
// tensor's canonical (Keras) order, so a seed gives the same kernel as the reference layers see.
void glorot_uniform(Tensor& kernel, std::int64_t fan_in, std::int64_t fan_out, Rng& rng);

}  // namespace dtrain::nn
