#include "nn/initializers.hpp"

#include <cmath>

namespace dtrain::nn {

void glorot_uniform(Tensor& kernel, std::int64_t fan_in, std::int64_t fan_out, Rng& rng) {
  const float limit = static_cast<float>(std::sqrt(6.0 / static_cast<double>(fan_in + fan_out)));
  for (float& v : kernel.span<float>()) v = rng.uniform(-limit, limit);
}

double l2_penalty(const Tensor& w, double l2) {
  if (l2 == 0.0) return 0.0;
  double sum = 0.0;
  for (float v : w.span<float>()) sum += static_cast<double>(v) * v;
  return l2 * sum;
}

void add_l2_gradient(const Tensor& w, double l2, float scale, Tensor& grad) {
  if (l2 == 0.0) return;
  const float k = static_cast<float>(2.0 * l2) * scale;
  auto wv = w.span<float>();
  auto gv = grad.span<float>();
  for (std::size_t i = 0; i < wv.size(); ++i) gv[i] += k * wv[i];
}

}  // namespace dtrain::nn
