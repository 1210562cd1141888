// Test helper: runs a stack of layer configs through the reference layers (lib/nn/reference) in
// any element type, so the oneDNN model can be compared against it and the reference itself can
// be checked by finite differences.
#pragma once

#include <type_traits>
#include <variant>
#include <vector>

#include "config/experiment.hpp"
#include "core/tensor.hpp"
#include "nn/padding.hpp"
#include "nn/reference/layers.hpp"

namespace dtrain::testing {

template <class T>
using Vec = std::vector<T>;

struct RefLayerShape {
  Shape in, out;  // per example
};

// Per-example output shape of one layer (mirrors the oneDNN layers' build()).
inline Shape ref_output_shape(const config::LayerOptions& opt, const Shape& in) {
  return std::visit(
      [&](const auto& o) -> Shape {
        using O = std::decay_t<decltype(o)>;
        if constexpr (std::is_same_v<O, config::Conv2DConfig>) {
          auto ph = nn::padding_1d(in[0], o.kernel_size[0], o.strides[0], o.padding);
          auto pw = nn::padding_1d(in[1], o.kernel_size[1], o.strides[1], o.padding);
          return Shape{ph.out, pw.out, o.filters};
        } else if constexpr (std::is_same_v<O, config::MaxPool2DConfig>) {
          auto s = o.strides.value_or(o.pool_size);
          auto ph = nn::padding_1d(in[0], o.pool_size[0], s[0], o.padding);
          auto pw = nn::padding_1d(in[1], o.pool_size[1], s[1], o.padding);
          return Shape{ph.out, pw.out, in[2]};
        } else if constexpr (std::is_same_v<O, config::DenseConfig>) {
          return Shape{o.units};
        } else if constexpr (std::is_same_v<O, config::FlattenConfig>) {
          return Shape{in.numel()};
        } else if constexpr (std::is_same_v<O, config::ReshapeConfig>) {
          Vec<std::int64_t> d = o.target_shape;
          std::int64_t known = 1;
          for (auto v : d) known *= v == -1 ? 1 : v;
          for (auto& v : d) if (v == -1) v = in.numel() / known;
          return Shape(d);
        } else {
          return in;
        }
      },
      opt);
}

inline nn::reference::ConvDims conv_dims(const config::Conv2DConfig& o, std::int64_t n, const Shape& in) {
  auto ph = nn::padding_1d(in[0], o.kernel_size[0], o.strides[0], o.padding);
  auto pw = nn::padding_1d(in[1], o.kernel_size[1], o.strides[1], o.padding);
  return {n, in[0], in[1], in[2], o.filters, o.kernel_size[0], o.kernel_size[1], o.strides[0], o.strides[1],
          ph.out, pw.out, ph.before, pw.before};
}

inline nn::reference::PoolDims pool_dims(const config::MaxPool2DConfig& o, std::int64_t n, const Shape& in) {
  auto s = o.strides.value_or(o.pool_size);
  auto ph = nn::padding_1d(in[0], o.pool_size[0], s[0], o.padding);
  auto pw = nn::padding_1d(in[1], o.pool_size[1], s[1], o.padding);
  return {n, in[0], in[1], in[2], o.pool_size[0], o.pool_size[1], s[0], s[1], ph.out, pw.out, ph.before, pw.before};
}

inline config::Activation layer_activation(const config::LayerOptions& opt) {
  if (auto* c = std::get_if<config::Conv2DConfig>(&opt)) return c->activation;
  if (auto* d = std::get_if<config::DenseConfig>(&opt)) return d->activation;
  if (auto* a = std::get_if<config::ActivationConfig>(&opt)) return a->activation;
  return config::Activation::linear;
}

// A stack of layers evaluated by the reference code. vars[l] holds layer l's variables in the
// oneDNN model's order (kernel, then bias).
template <class T>
struct RefStack {
  std::vector<config::LayerOptions> layers;
  std::vector<Shape> shapes;  // shapes[0] = input, shapes[l + 1] = output of layer l
  std::int64_t n = 0;
  std::vector<std::vector<Vec<T>>> vars;
  std::vector<Vec<T>> acts;  // acts[0] = x, acts[l + 1] = output of layer l

  const Vec<T>& forward(const Vec<T>& x) {
    acts.assign(layers.size() + 1, {});
    acts[0] = x;
    for (std::size_t l = 0; l < layers.size(); ++l) {
      Vec<T>& y = acts[l + 1];
      y.assign(static_cast<std::size_t>(n * shapes[l + 1].numel()), T(0));
      const Vec<T>& in = acts[l];
      const auto& v = vars[l];
      const T* bias = v.size() > 1 ? v[1].data() : nullptr;
      if (auto* c = std::get_if<config::Conv2DConfig>(&layers[l])) {
        nn::reference::conv2d_forward(in.data(), v[0].data(), bias, y.data(), conv_dims(*c, n, shapes[l]));
      } else if (auto* p = std::get_if<config::MaxPool2DConfig>(&layers[l])) {
        nn::reference::max_pool2d_forward(in.data(), y.data(), pool_dims(*p, n, shapes[l]));
      } else if (auto* d = std::get_if<config::DenseConfig>(&layers[l])) {
        nn::reference::dense_forward(in.data(), v[0].data(), bias, y.data(), n, shapes[l][0], d->units);
      } else {
        y = in;  // flatten, reshape, activation: same values in canonical order
      }
      nn::reference::activation_forward(layer_activation(layers[l]), y.data(), static_cast<std::int64_t>(y.size()),
                                        shapes[l + 1][shapes[l + 1].rank() - 1]);
    }
    return acts.back();
  }

  // Returns dx; fills dvars like vars.
  Vec<T> backward(const Vec<T>& dy_out, std::vector<std::vector<Vec<T>>>& dvars) {
    dvars.assign(layers.size(), {});
    Vec<T> dy = dy_out;
    for (std::size_t l = layers.size(); l-- > 0;) {
      const Vec<T>& y = acts[l + 1];
      const Vec<T>& x = acts[l];
      Vec<T> dz(dy.size());
      nn::reference::activation_backward(layer_activation(layers[l]), y.data(), dy.data(), dz.data(),
                                         static_cast<std::int64_t>(dz.size()), shapes[l + 1][shapes[l + 1].rank() - 1]);
      Vec<T> dx(x.size(), T(0));
      const auto& v = vars[l];
      auto& dv = dvars[l];
      for (const auto& w : v) dv.emplace_back(w.size(), T(0));
      T* dbias = v.size() > 1 ? dv[1].data() : nullptr;
      if (auto* c = std::get_if<config::Conv2DConfig>(&layers[l])) {
        nn::reference::conv2d_backward(x.data(), v[0].data(), dz.data(), dx.data(), dv[0].data(), dbias,
                                       conv_dims(*c, n, shapes[l]));
      } else if (auto* p = std::get_if<config::MaxPool2DConfig>(&layers[l])) {
        nn::reference::max_pool2d_backward(x.data(), dz.data(), dx.data(), pool_dims(*p, n, shapes[l]));
      } else if (auto* d = std::get_if<config::DenseConfig>(&layers[l])) {
        nn::reference::dense_backward(x.data(), v[0].data(), dz.data(), dx.data(), dv[0].data(), dbias, n,
                                      shapes[l][0], d->units);
      } else {
        dx = dz;
      }
      dy = std::move(dx);
    }
    return dy;
  }
};

}  // namespace dtrain::testing
