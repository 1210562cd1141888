// Test helper: runs a model's layers through their oracles (Layer::reference_forward and
// reference_backward: plain loops in double), so a backend's kernels can be compared against them
// and the oracles themselves checked by finite differences.
#pragma once

#include <cmath>
#include <numeric>
#include <vector>

#include "nn/layer.hpp"
#include "nn/model.hpp"
#include "nn/step.hpp"

namespace dtrain::testing {

template <class T>
using Vec = std::vector<T>;

inline double norm(const Vec<double>& a) { return std::sqrt(std::inner_product(a.begin(), a.end(), a.begin(), 0.0)); }

// ||a - b||; a and b of one size.
inline double distance(const Vec<double>& a, const Vec<double>& b) {
  double sum = 0;
  for (std::size_t i = 0; i < a.size(); ++i) sum += (a[i] - b[i]) * (a[i] - b[i]);
  return std::sqrt(sum);
}

struct RefStack {
  std::vector<const nn::Layer*> layers;
  std::int64_t n = 0;  // batch
  nn::StepContext step;
  std::vector<std::vector<Vec<double>>> vars;  // vars[l][k]: layer l's variable k, as the model orders them
  std::vector<Vec<double>> acts;               // acts[0] = x, acts[l + 1] = output of layer l

  // The model's layers with copies of its current variable values.
  static RefStack of(const nn::Sequential& model, std::int64_t batch, const nn::StepContext& step) {
    RefStack r;
    r.n = batch;
    r.step = step;
    for (std::size_t l = 0; l < model.num_layers(); ++l) {
      const nn::Layer& layer = model.layer(l);
      r.layers.push_back(&layer);
      r.vars.emplace_back();
      for (const Variable& v : layer.variables()) {
        auto s = v.value.span<float>();
        r.vars.back().emplace_back(s.begin(), s.end());
      }
    }
    return r;
  }

  const Vec<double>& forward(const Vec<double>& x) {
    acts.assign(layers.size() + 1, {});
    acts[0] = x;
    for (std::size_t l = 0; l < layers.size(); ++l) {
      acts[l + 1].assign(static_cast<std::size_t>(n * layers[l]->output_shape().numel()), 0.0);
      layers[l]->reference_forward({n, acts[l], vars[l], acts[l + 1]}, step);
    }
    return acts.back();
  }

  // Returns dx; fills dvars like vars.
  Vec<double> backward(const Vec<double>& dy_out, std::vector<std::vector<Vec<double>>>& dvars) {
    dvars.assign(layers.size(), {});
    Vec<double> dy = dy_out;
    for (std::size_t l = layers.size(); l-- > 0;) {
      Vec<double> dx(acts[l].size(), 0.0);
      for (const auto& w : vars[l]) dvars[l].emplace_back(w.size(), 0.0);
      layers[l]->reference_backward({n, acts[l], acts[l + 1], dy, vars[l], dx, dvars[l]}, step);
      dy = std::move(dx);
    }
    return dy;
  }
};

}  // namespace dtrain::testing
