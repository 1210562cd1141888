// Test helper: random models of dtrain's layers, for comparing a backend's kernels with the
// layers' oracles on architectures nobody wrote a case for (tests/unit/test_layers.cpp on every
// CPU loop level, tests/gpu/test_gpu_layer_kernels.cpp on a GPU).
//
// A model is valid by construction (the spatial size is tracked so every window fits) and drawn
// from sets that hold the awkward sizes: 1, 2 and 3 units or filters, odd widths, widths a
// multiple of 8 and 16 and one past, rectangular kernels and strides, pooling windows that skip
// inputs or overlap, 'same' padding, batches of 1 and odd batches. Its activations are those of
// real models (a standalone activation follows a linear layer; sigmoid is rare): a stack of
// squashing layers makes its units nearly equal from sample to sample and from position to
// position, so that float32's rounding decides which of a pooling window's near-equal inputs is
// its maximum, and a batch normalization divides bfloat16's rounding by a spread near zero.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "config/schema.hpp"
#include "core/rng.hpp"
#include "layer_oracle.hpp"
#include "nn/activation.hpp"
#include "nn/average_pooling2d.hpp"
#include "nn/batch_normalization.hpp"
#include "nn/conv2d.hpp"
#include "nn/dense.hpp"
#include "nn/dropout.hpp"
#include "nn/global_average_pooling2d.hpp"
#include "nn/max_pool2d.hpp"
#include "nn/registry.hpp"
#include "nn/reshape.hpp"

namespace dtrain::testing {

// How many models a test draws and from which seed: DTRAIN_RANDOM_MODELS and DTRAIN_RANDOM_SEED
// where set (to hunt with), else the test's own.
inline int random_model_count(int fallback) {
  const char* count = std::getenv("DTRAIN_RANDOM_MODELS");
  return count ? std::atoi(count) : fallback;
}
inline std::uint64_t random_model_seed(std::uint64_t fallback) {
  const char* seed = std::getenv("DTRAIN_RANDOM_SEED");
  return seed ? static_cast<std::uint64_t>(std::atoll(seed)) : fallback;
}

struct RandomModel {
  std::string label;  // "#index HxWxC conv8(3x3/1x1,same,relu) max2/2 ... dense10(linear), batch 7"
  Shape input;        // per example
  std::vector<config::LayerConfig> layers;  // unnamed
  std::int64_t batch = 0;
  bool input_gradient = false;  // whether the model computes d(loss)/d(input)
};

// Model `index` of a sequence drawn from `rng`. Under bfloat16 no batch normalization: over a
// batch its statistics divide the inputs' rounding by their spread, which random models make
// near zero often enough that the comparison would measure the draw (the bfloat16 cases of
// test_layers.cpp check batch normalization's rounding on models that are not degenerate).
inline RandomModel random_model(Rng& rng, int index, bool bf16) {
  using config::Activation;
  using config::Padding;
  const auto pick = [&](std::initializer_list<int> from) { return *(from.begin() + rng.below(from.size())); };
  const auto coin = [&](double p) { return rng.uniform(0.0f, 1.0f) < p; };
  const auto activation = [&](bool with_softmax) {
    const double u = rng.uniform(0.0f, 1.0f);
    if (u < 0.35) return Activation::relu;
    if (u < 0.65) return Activation::linear;
    if (u < 0.85) return Activation::tanh;
    return with_softmax && u < 0.93 ? Activation::softmax : Activation::sigmoid;
  };
  const auto named = [](Activation a) { return config::activation_names[static_cast<int>(a)].name; };
  const auto out_size = [](std::int64_t in, int k, int s, Padding p) {
    return p == Padding::same ? (in + s - 1) / s : in < k ? 0 : (in - k) / s + 1;
  };
  const auto batch_norm = [&] {
    nn::BatchNormalizationOptions b;
    b.center = coin(0.8);
    b.scale = coin(0.8);
    return nn::layer_config("", b);
  };
  const auto dropout = [&] { return nn::layer_config("", nn::DropoutOptions{0.1 + 0.4 * rng.uniform(0.0f, 1.0f)}); };

  RandomModel m;
  std::int64_t h = pick({4, 5, 7, 8, 9, 12, 16, 28}), w = coin(0.7) ? h : pick({4, 5, 7, 8, 9, 12, 16});
  std::int64_t depth = pick({1, 1, 2, 3, 4, 8});  // the next layer's input channels
  m.input = Shape{h, w, depth};
  std::string label = fmt::format("#{} {}x{}x{}", index, h, w, depth);
  const int conv_blocks = pick({0, 1, 1, 2, 2, 3});
  for (int b = 0; b < conv_blocks && h > 1 && w > 1; ++b) {
    nn::Conv2DOptions cv;
    cv.kernel_size = {pick({1, 2, 3, 3, 3, 5}), 0};
    cv.kernel_size[1] = coin(0.8) ? cv.kernel_size[0] : pick({1, 2, 3});
    cv.strides = {pick({1, 1, 1, 2}), 0};
    cv.strides[1] = coin(0.8) ? cv.strides[0] : pick({1, 2});
    cv.padding = coin(0.5) ? Padding::same : Padding::valid;
    const std::int64_t oh = out_size(h, cv.kernel_size[0], cv.strides[0], cv.padding);
    const std::int64_t ow = out_size(w, cv.kernel_size[1], cv.strides[1], cv.padding);
    if (oh < 1 || ow < 1) continue;
    // Not above a filter of one weight: batch normalization's output does not depend on that
    // weight's scale, so its gradient is zero (a sum of rounding errors).
    const bool normalized = !bf16 && cv.kernel_size[0] * cv.kernel_size[1] * depth > 1 && coin(0.3);
    cv.filters = pick({1, 2, 3, 5, 8, 16, 17, 32});
    cv.activation = normalized ? Activation::linear : activation(false);
    cv.use_bias = !normalized || coin(0.3);
    m.layers.push_back(nn::layer_config("", cv));
    label += fmt::format(" conv{}({}x{}/{}x{},{},{}{})", cv.filters, cv.kernel_size[0], cv.kernel_size[1], cv.strides[0],
                         cv.strides[1], cv.padding == Padding::same ? "same" : "valid", named(cv.activation),
                         cv.use_bias ? "" : ",no bias");
    h = oh;
    w = ow;
    depth = cv.filters;
    if (normalized) {
      m.layers.push_back(batch_norm());
      label += " bn";
    }
    if (cv.activation == Activation::linear && coin(0.6)) {
      const Activation a = coin(0.7) ? Activation::relu : Activation::tanh;
      m.layers.push_back(nn::layer_config("", nn::ActivationOptions{a}));
      label += fmt::format(" {}", named(a));
    }
    if (coin(0.6) && h > 1 && w > 1) {
      const int size = pick({2, 2, 3}), stride = pick({1, 2, 2, 3});
      const Padding padding = coin(0.3) ? Padding::same : Padding::valid;
      const std::int64_t ph = out_size(h, size, stride, padding), pw = out_size(w, size, stride, padding);
      if (ph >= 1 && pw >= 1) {
        const bool max = coin(0.6);
        nn::Pool2DParams params;
        params.pool_size = {size, size};
        params.strides = std::array<int, 2>{stride, stride};
        params.padding = padding;
        if (max)
          m.layers.push_back(nn::layer_config("", nn::MaxPool2DOptions{params}));
        else
          m.layers.push_back(nn::layer_config("", nn::AveragePooling2DOptions{params}));
        label += fmt::format(" {}{}/{}{}", max ? "max" : "avg", size, stride, padding == Padding::same ? ",same" : "");
        h = ph;
        w = pw;
      }
    }
    if (coin(0.2)) {
      m.layers.push_back(dropout());
      label += " dropout";
    }
  }
  const bool global = coin(0.25);
  m.layers.push_back(global ? nn::layer_config("", nn::GlobalAveragePooling2DOptions{})
                            : nn::layer_config("", nn::FlattenOptions{}));
  label += global ? " gap" : " flatten";
  const int dense_layers = pick({1, 1, 2, 2, 3});
  for (int d = 0; d < dense_layers; ++d) {
    const bool last = d + 1 == dense_layers;
    nn::DenseOptions dn;
    dn.units = last ? pick({1, 2, 3, 4, 7, 10, 16, 17}) : pick({1, 3, 8, 10, 16, 17, 31, 32, 64, 100, 128});
    const bool normalized = !bf16 && !last && coin(0.25);
    dn.activation = normalized ? Activation::linear : activation(last);
    dn.use_bias = !normalized || coin(0.3);
    m.layers.push_back(nn::layer_config("", dn));
    label += fmt::format(" dense{}({})", dn.units, named(dn.activation));
    if (normalized) {
      m.layers.push_back(batch_norm());
      m.layers.push_back(nn::layer_config("", nn::ActivationOptions{Activation::relu}));
      label += " bn relu";
    }
    if (!last && coin(0.2)) {
      m.layers.push_back(dropout());
      label += " dropout";
    }
  }
  // Batch normalization over a few samples is degenerate: over one it outputs its offset whatever
  // its input, over two +-1, so the gradients below it are zero in exact arithmetic.
  const bool normalizes = std::any_of(m.layers.begin(), m.layers.end(), [](const config::LayerConfig& l) {
    return l.kind == nn::BatchNormalizationOptions::kind;
  });
  m.batch = normalizes ? pick({7, 8, 13, 16, 32, 33}) : pick({1, 2, 3, 4, 5, 7, 8, 13, 16, 32, 33, 64});
  m.input_gradient = coin(0.5);
  m.label = label + fmt::format(", batch {}", m.batch);
  return m;
}

struct RandomModelTolerances {
  double outputs;    // ||y - y_ref|| / ||y_ref||
  // ||g - g_ref|| over the largest ||g_ref|| of the layer's variables (largest_norm), dx over
  // ||dx_ref||: a gradient that is zero in exact arithmetic (a bias below a batch normalization,
  // through linear layers) is a sum of terms that cancel, and float's rounding of them is all it
  // holds.
  double gradients;
  // Gradients are not compared where two inputs of a max pooling window lie closer than this,
  // relative to the larger (nearest_pooling_tie): rounding may pick either as the maximum.
  double nearest_tie;
};

// Measured on an Intel Xeon (AVX-512 with BF16), 1,000 models on each of its three loop levels:
// float32's outputs within 1.1e-5 and gradients within 2.6e-4 (the deepest models sum thousands
// of terms of both signs), 1.2 % of the models with a window's near-tie within 1e-6; bfloat16's
// outputs within 0.013 and gradients within 0.23 in 99 % of the models, the worst 0.42 and 3.1
// (a rounding that flips a relu or a window's maximum, in a model that narrows to one or two
// units). The first 40 (what test_layers.cpp runs): float32 2e-6 and 7.3e-6, bfloat16 0.015 and
// 0.24. A layout or an index gone wrong is off by 1 or more; a term missed, by tens of percent in
// float32. A hunt over thousands of models finds bfloat16 models past these: read them before
// calling them bugs.
inline RandomModelTolerances random_model_tolerances(DType compute) {
  if (compute == DType::bf16) return {0.1, 0.75, 0.0};
  return {1e-4, 2e-3, 1e-6};
}

// A random model's variable `name` at the start of a comparison: a kernel keeps its initial
// (Glorot) values; a batch normalization's scale and variance are drawn in [0.5, 1.5], every other
// variable (biases, offsets, means) in [-0.1, 0.1]. A deep model's units then stay off tanh's and
// sigmoid's flat ends, where float32's saturated 1 against the oracle's 1 - 1e-9 would be most of
// a difference; zero biases would hide bias bugs.
inline void draw_offsets(std::string_view name, std::span<float> values, Rng& rng) {
  if (name.ends_with("kernel")) return;
  const bool around_one = name.ends_with("moving_variance") || name.ends_with("gamma");
  for (float& value : values) value = around_one ? rng.uniform(0.5f, 1.5f) : rng.uniform(-0.1f, 0.1f);
}

// The largest norm among a layer's gradients: what random models measure each of them against
// (RandomModelTolerances::gradients).
inline double largest_norm(const std::vector<std::vector<double>>& gradients) {
  double largest = 0;
  for (const auto& g : gradients) largest = std::max(largest, norm(g));
  return largest;
}

// The smallest gap between the two largest inputs of any max pooling window of the oracle's
// forward, relative to the larger (1 where no window has two inputs). Windows whose largest input
// is zero are left out: a relu's zeros tie exactly in float32 too, and their gradient is zero
// whichever wins.
inline double nearest_pooling_tie(const RefStack& ref) {
  double nearest = 1.0;
  for (std::size_t l = 0; l < ref.layers.size(); ++l) {
    const auto* pooling = dynamic_cast<const nn::MaxPool2D*>(ref.layers[l]);
    if (!pooling) continue;
    const nn::reference::PoolDims d = pooling->dims(ref.n);
    const std::vector<double>& x = ref.acts[l];
    for (std::int64_t n = 0; n < d.n; ++n)
      for (std::int64_t oy = 0; oy < d.oh; ++oy)
        for (std::int64_t ox = 0; ox < d.ow; ++ox)
          for (std::int64_t c = 0; c < d.c; ++c) {
            double first = -INFINITY, second = -INFINITY;
            for (std::int64_t py = 0; py < d.ph; ++py)
              for (std::int64_t px = 0; px < d.pw; ++px) {
                const std::int64_t iy = oy * d.sh + py - d.pad_top, ix = ox * d.sw + px - d.pad_left;
                if (iy < 0 || iy >= d.h || ix < 0 || ix >= d.w) continue;
                const double v = x[static_cast<std::size_t>(((n * d.h + iy) * d.w + ix) * d.c + c)];
                second = std::max(second, std::min(first, v));
                first = std::max(first, v);
              }
            if (second > -INFINITY && first != 0.0) nearest = std::min(nearest, (first - second) / std::abs(first));
          }
  }
  return nearest;
}

}  // namespace dtrain::testing
