// BatchNormalization on the CPU backend (nn/batch_normalization.hpp has the semantics), as loops
// over canonical (channels-last) memory: the input is reordered into it when the layer below
// produced a blocked layout, and the gradient back out of it. Statistics are accumulated in
// double, two passes (mean, then the squared deviations), per thread over fixed row ranges and
// added in thread order, so a thread count gives the same bits every run. Synchronized, each pass
// sums over every replica through StepContext::cross_replica, and so do backward's two sums.
//   x, y, dy, dx (M, C) f32 canonical; mean, inv_std (C) kept from forward for backward
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "backends/onednn/canonical_io.hpp"
#include "core/error.hpp"
#include "nn/batch_normalization.hpp"
#include "nn/kernel.hpp"

namespace dtrain::backends::onednn {

namespace {


class BatchNormalizationKernel final : public nn::LayerKernel {
 public:
  // f32 under every precision policy, as Keras keeps batch statistics in float32.
  BatchNormalizationKernel(nn::BatchNormalization& layer, OnednnContext& ctx)
      : layer_(layer), ctx_(ctx), channels_(layer.channels()) {
    const auto c = static_cast<std::size_t>(channels_);
    mean_.resize(c);
    inv_std_.resize(c);
    scale_.resize(c);
    shift_.resize(c);
    sums_.resize(2 * c);
  }

  LayoutPtr plan(std::int64_t batch, const LayoutPtr&) override {
    plans_.create(batch);
    return ctx_.canonical_layout(layer_.output_shape().with_batch(batch), DType::f32);
  }

  void bind(std::int64_t batch, const nn::LayerIO& io) override {
    plans_.get(batch).bind(ctx_, batch, layer_.input_shape(), io);
    input_gradient_ = static_cast<bool>(io.diff_src);
  }

  void forward(std::int64_t batch, const nn::StepContext& step) override {
    CanonicalIO& p = plans_.get(batch);
    p.load_input(ctx_);
    const float* x = p.input();
    const std::int64_t rows = rows_of(batch);
    if (step.training()) {
      statistics(x, rows, step);
      write_contributions(step, batch);
    } else {
      const float* mm = value(layer_.moving_mean_index());
      const float* mv = value(layer_.moving_variance_index());
      for (std::int64_t k = 0; k < channels_; ++k) {
        mean_[idx(k)] = mm[k];
        inv_std_[idx(k)] = static_cast<float>(1.0 / std::sqrt(static_cast<double>(mv[k]) + layer_.options().epsilon));
      }
    }
    // y = (x - mean) * inv_std * gamma + beta = x * scale + shift, per channel.
    const float* gamma = layer_.gamma_index() >= 0 ? value(static_cast<std::size_t>(layer_.gamma_index())) : nullptr;
    const float* beta = layer_.beta_index() >= 0 ? value(static_cast<std::size_t>(layer_.beta_index())) : nullptr;
    for (std::int64_t k = 0; k < channels_; ++k) {
      scale_[idx(k)] = inv_std_[idx(k)] * (gamma ? gamma[k] : 1.0f);
      shift_[idx(k)] = (beta ? beta[k] : 0.0f) - mean_[idx(k)] * scale_[idx(k)];
    }
    const std::int64_t c = channels_;
    const float* scale = scale_.data();
    const float* shift = shift_.data();
    float* y = p.y;
#pragma omp parallel for schedule(static)
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t k = 0; k < c; ++k) y[r * c + k] = x[r * c + k] * scale[k] + shift[k];
  }

  void backward(std::int64_t batch, const nn::StepContext& step) override {
    CanonicalIO& p = plans_.get(batch);
    const float* x = p.input();
    const std::int64_t rows = rows_of(batch), c = channels_;
    // Local sums of dy and dy * xhat: this replica's dbeta and dgamma.
    const float* mean = mean_.data();
    const float* inv_std = inv_std_.data();
    const float* dy = p.dy;
    channel_sums(rows, [&](std::int64_t r, std::int64_t k, double* acc) {
      const double g = dy[r * c + k];
      acc[k] += g;
      acc[c + k] += g * (static_cast<double>(x[r * c + k]) - mean[k]) * inv_std[k];
    });
    if (layer_.gamma_index() >= 0) store(grad(static_cast<std::size_t>(layer_.gamma_index())), sums_.data() + c);
    if (layer_.beta_index() >= 0) store(grad(static_cast<std::size_t>(layer_.beta_index())), sums_.data());
    float* dx = p.input_gradient();
    if (!dx) return;
    if (nn::CrossReplica* group = statistics_group(step)) group->all_reduce_sum(sums_, "batch normalization gradient sums");
    // dx = gamma inv_std (dy - sum(dy) / count - xhat sum(dy xhat) / count)
    const float* gamma = layer_.gamma_index() >= 0 ? value(static_cast<std::size_t>(layer_.gamma_index())) : nullptr;
    for (std::int64_t k = 0; k < c; ++k) {
      scale_[idx(k)] = inv_std[k] * (gamma ? gamma[k] : 1.0f);
      shift_[idx(k)] = static_cast<float>(sums_[idx(k)] / count_);          // mean of dy
      sums_[idx(c + k)] = sums_[idx(c + k)] / count_;                          // mean of dy xhat
    }
    const float* a = scale_.data();
    const float* mean_dy = shift_.data();
    const double* mean_dy_xhat = sums_.data() + c;
#pragma omp parallel for schedule(static)
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t k = 0; k < c; ++k) {
        const float xhat = (x[r * c + k] - mean[k]) * inv_std[k];
        dx[r * c + k] = a[k] * (dy[r * c + k] - mean_dy[k] - xhat * static_cast<float>(mean_dy_xhat[k]));
      }
    p.store_input_gradient(ctx_);
  }

  // A replica without samples still makes the collectives of a synchronized layer.
  void forward_without_samples(const nn::StepContext& step) override {
    if (!statistics_group(step) || !step.training()) return;
    statistics(nullptr, 0, step);
    write_contributions(step, 0);
  }
  void backward_without_samples(const nn::StepContext& step) override {
    nn::CrossReplica* group = statistics_group(step);
    // The replicas with samples make this collective only for an input gradient (backward()).
    if (!group || !input_gradient_) return;
    std::fill(sums_.begin(), sums_.end(), 0.0);
    group->all_reduce_sum(sums_, "batch normalization gradient sums");
  }

 private:
  // Who the batch statistics are summed over: every replica (and lane) when synchronized, else
  // the lanes of this replica, which together are one replica; null when alone.
  nn::CrossReplica* statistics_group(const nn::StepContext& step) const {
    return layer_.options().synchronized ? step.cross_replica : step.lanes;
  }

  static std::size_t idx(std::int64_t k) { return static_cast<std::size_t>(k); }
  std::int64_t rows_of(std::int64_t batch) const { return batch * (layer_.input_shape().numel() / channels_); }
  float* value(std::size_t i) { return layer_.variables()[i].value.address<float>(); }
  float* grad(std::size_t i) { return layer_.variables()[i].grad.address<float>(); }
  void store(float* out, const double* in) const {
    for (std::int64_t k = 0; k < channels_; ++k) out[k] = static_cast<float>(in[k]);
  }

  // sums_[0 .. 2C) = sum over rows of what `add(r, k, acc)` adds into acc[k] and acc[C + k]:
  // each thread over its own fixed range of rows, the threads' partials added in thread order.
  template <class Add>
  void channel_sums(std::int64_t rows, const Add& add) {
    const std::int64_t c = channels_;
    const int threads = std::max(1, omp_get_max_threads());
    partials_.assign(static_cast<std::size_t>(threads) * static_cast<std::size_t>(2 * c), 0.0);
#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num();
      const std::int64_t begin = rows * t / threads, end = rows * (t + 1) / threads;
      double* acc = partials_.data() + static_cast<std::size_t>(t) * static_cast<std::size_t>(2 * c);
      for (std::int64_t r = begin; r < end; ++r)
        for (std::int64_t k = 0; k < c; ++k) add(r, k, acc);
    }
    std::fill(sums_.begin(), sums_.end(), 0.0);
    for (int t = 0; t < threads; ++t)
      for (std::int64_t k = 0; k < 2 * c; ++k)
        sums_[idx(k)] += partials_[static_cast<std::size_t>(t) * static_cast<std::size_t>(2 * c) + idx(k)];
  }

  // The batch statistics into mean_ and inv_std_ (and batch_variance_), over this replica (all its
  // lanes) or, when synchronized, over every replica; x may be null with rows 0.
  void statistics(const float* x, std::int64_t rows, const nn::StepContext& step) {
    const std::int64_t c = channels_;
    nn::CrossReplica* group = statistics_group(step);
    // The sums of x, then the row count right after them: one collective of C + 1 values.
    channel_sums(rows, [&](std::int64_t r, std::int64_t k, double* acc) { acc[k] += x[r * c + k]; });
    sums_[idx(c)] = static_cast<double>(rows);
    if (group) group->all_reduce_sum(std::span<double>(sums_.data(), idx(c) + 1), "batch normalization mean");
    count_ = sums_[idx(c)];
    batch_mean_.resize(idx(c));
    for (std::int64_t k = 0; k < c; ++k) batch_mean_[idx(k)] = count_ > 0 ? sums_[idx(k)] / count_ : 0.0;
    const double* m = batch_mean_.data();
    channel_sums(rows, [&](std::int64_t r, std::int64_t k, double* acc) {
      const double d = x[r * c + k] - m[k];
      acc[k] += d * d;
    });
    if (group) group->all_reduce_sum(std::span<double>(sums_.data(), idx(c)), "batch normalization variance");
    batch_variance_.resize(idx(c));
    for (std::int64_t k = 0; k < c; ++k) {
      batch_variance_[idx(k)] = count_ > 0 ? sums_[idx(k)] / count_ : 0.0;
      mean_[idx(k)] = static_cast<float>(batch_mean_[idx(k)]);
      inv_std_[idx(k)] = static_cast<float>(1.0 / std::sqrt(batch_variance_[idx(k)] + layer_.options().epsilon));
    }
  }

  // This replica's share of the moving statistics' update, into their grads.
  void write_contributions(const nn::StepContext& step, std::int64_t batch) {
    const double weight = layer_.contribution_weight(step, batch);
    float* mean = grad(layer_.moving_mean_index());
    float* variance = grad(layer_.moving_variance_index());
    for (std::int64_t k = 0; k < channels_; ++k) {
      mean[k] = static_cast<float>(batch_mean_[idx(k)] * weight);
      variance[k] = static_cast<float>(batch_variance_[idx(k)] * weight);
    }
  }

  nn::BatchNormalization& layer_;
  OnednnContext& ctx_;
  std::int64_t channels_;
  // The last forward's statistics, and scratch reused every step (sized at construction, or on
  // the first step for the per-thread partials).
  std::vector<float> mean_, inv_std_, scale_, shift_;
  std::vector<double> sums_, partials_, batch_mean_, batch_variance_;
  double count_ = 0.0;
  // Whether backward computes the input gradient (and so makes its collective): what bind() was
  // given; before any bind, whether a layer sits below (the first layer has none, unless a test
  // asks the model for the input's gradient, which binds first).
  bool input_gradient_ = layer_.position() > 0;
  nn::PlanCache<CanonicalIO> plans_;
};

std::unique_ptr<nn::LayerKernel> make(nn::Layer& layer, Context& ctx, DType) {
  return std::make_unique<BatchNormalizationKernel>(static_cast<nn::BatchNormalization&>(layer),
                                                    OnednnContext::of(ctx));
}

const nn::KernelRegistration registered(kName, nn::BatchNormalization::Options::kind, &make);

}  // namespace

}  // namespace dtrain::backends::onednn
