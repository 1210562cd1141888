// Keras' default initializers and the L2 kernel regularizer.
#pragma once

#include <cstdint>

#include "core/rng.hpp"
#include "core/tensor.hpp"

namespace dtrain::nn {

// glorot_uniform: U(-limit, limit), limit = sqrt(6 / (fan_in + fan_out)). Values are drawn in the
// tensor's canonical (Keras) order, so a seed gives the same kernel as the reference layers see.
void glorot_uniform(Tensor& kernel, std::int64_t fan_in, std::int64_t fan_out, Rng& rng);

// L2: penalty = l2 * sum(w^2); gradient 2 * l2 * w.
double l2_penalty(const Tensor& w, double l2);
void add_l2_gradient(const Tensor& w, double l2, float scale, Tensor& grad);

}  // namespace dtrain::nn
