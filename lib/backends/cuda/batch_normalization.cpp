// BatchNormalization on the GPU (nn/batch_normalization.hpp has the semantics): the batch
// normalization cores of elementwise_cores.hpp, rows x channels.
//   x, y, dy, dx (M, C)   f32, canonical, M = N * H * W (a bfloat16 input is converted: KernelInput)
//   gamma, beta (C)       variables, f32 (each absent without scale / center)
//   moving_mean, moving_variance (C)  variables, f32; their grads get this replica's
//                         contribution to the update (statistic * contribution_weight), which
//                         BatchNormalization::apply_updates folds in after the step
//   mean, inv_std (C)     f32, the last forward's (batch or moving statistics), kept for backward
//   sums, means (2C)      double, the synchronized passes' per-channel sums and what the host
//                         made of them (device memory, beside mean and inv_std)
// Float32 under every precision policy, as Keras keeps batch statistics in float32 and the CPU
// backend computes this layer in float32.
//
// Alone (one replica, no lanes) everything stays on the device: the statistics, the gradients of
// gamma and beta and dx from this replica's sums, with no synchronization. Synchronized (or over a
// replica's lanes), the per-channel sums cross the replicas as host doubles
// (StepContext::cross_replica / lanes), as on the CPU backend: each pass's sums are copied to the
// host (which waits for the stream: the only place this backend's layers wait), summed, turned
// into means there and copied back for the next pass. Forward: the sums of x with the row count
// after them (C + 1 values), then the squared deviations from the global mean (C); backward: dy
// and dy * xhat (2C). A replica without samples takes part in the same collectives with zeros.
#include <algorithm>
#include <span>
#include <vector>

#include "backends/cuda/elementwise_cores.hpp"
#include "backends/cuda/kernel_io.hpp"
#include "nn/batch_normalization.hpp"

namespace dtrain::backends::cuda {

namespace {

struct BatchNormPlan : LayerMemories {
  Buffer workspace;  // the cores' partial sums for this batch's rows
};

class BatchNormalizationKernel final : public Float32Kernel<nn::BatchNormalization, BatchNormPlan> {
 public:
  BatchNormalizationKernel(nn::BatchNormalization& layer, CudaContext& ctx)
      : Float32Kernel(layer, ctx),
        channels_(layer.channels()),
        sums_(static_cast<std::size_t>(2 * channels_ + 1)),
        means_(static_cast<std::size_t>(2 * channels_)),
        has_input_gradient_(true) {}

  void bind(std::int64_t batch, const nn::LayerIO& io) override {
    Float32Kernel::bind(batch, io);
    has_input_gradient_ = static_cast<bool>(io.diff_src);
  }

  void forward(std::int64_t batch, const nn::StepContext& step) override {
    BatchNormPlan& p = plans_.get(batch);
    const float* x = p.input.load_as<float>();
    const std::int64_t m = rows_of(batch), c = channels_;
    if (step.training()) {
      const BatchNormStatistics out = statistics_out(step, batch);
      if (statistics_group(step)) {
        synchronized_statistics(x, m, step, out, p.workspace.get());
      } else {
        batch_norm_statistics(ctx_, x, m, c, layer_.options().epsilon, out, p.workspace.get());
        count_ = static_cast<double>(m);
      }
    } else {
      // The moving statistics, copied so that mean() and inv_std() always hold what forward used.
      ctx_.copy_on_device(value_of(var(layer_.moving_mean_index())), mean(), bytes_per_channel());
      batch_norm_inv_std(ctx_, value_of(var(layer_.moving_variance_index())), c, layer_.options().epsilon, inv_std());
    }
    batch_norm_forward(ctx_, x, m, c, mean(), inv_std(), gamma(), beta(), p.y<float>());
  }

  void backward(std::int64_t batch, const nn::StepContext& step) override {
    BatchNormPlan& p = plans_.get(batch);
    const float* x = p.input.as<float>();
    const float* dy = p.dy<const float>();
    float* dx = p.input.gradient_as<float>();
    const std::int64_t m = rows_of(batch), c = channels_;
    float* dgamma = layer_.gamma_index() >= 0 ? grad_of(var(static_cast<std::size_t>(layer_.gamma_index()))) : nullptr;
    float* dbeta = layer_.beta_index() >= 0 ? grad_of(var(static_cast<std::size_t>(layer_.beta_index()))) : nullptr;
    nn::CrossReplica* group = statistics_group(step);
    if (!group) {
      // The gradient through this replica's batch statistics, as the oracle's.
      batch_norm_backward(ctx_, true, x, dy, m, c, mean(), inv_std(), gamma(), dx, dgamma, dbeta, p.workspace.get());
    } else {
      // dgamma and dbeta stay this replica's (the strategy sums gradients); dx needs the sums over
      // every replica, as the statistics were.
      batch_norm_gradient_sums(ctx_, x, dy, m, c, mean(), inv_std(), device_sums(), dgamma, dbeta,
                               p.workspace.get());
      if (!dx) return;  // as the CPU backend: no input gradient, no collective
      ctx_.copy_to_host(device_sums(), sums_.data(), 2 * c * sizeof(double));
      sum_gradients(*group);
      batch_norm_backward_from_means(ctx_, x, dy, m, c, mean(), inv_std(), gamma(), device_means(), dx);
    }
    if (dx) p.input.store_gradient();
  }

  // A replica without samples still makes the collectives of a synchronized layer, and writes its
  // contribution to the moving statistics (zero, or the global statistics on replica 0).
  void forward_without_samples(const nn::StepContext& step) override {
    if (!statistics_group(step) || !step.training()) return;
    ensure_state();
    synchronized_statistics(nullptr, 0, step, statistics_out(step, 0), nullptr);
  }
  void without_input_gradient() override { has_input_gradient_ = false; }
  void backward_without_samples(const nn::StepContext& step) override {
    nn::CrossReplica* group = statistics_group(step);
    if (!group || !has_input_gradient_) return;
    ensure_state();
    std::fill(sums_.begin(), sums_.end(), 0.0);
    sum_gradients(*group);
  }

 private:
  void prepare(std::int64_t batch, BatchNormPlan& p) override {
    ensure_state();
    p.workspace = ctx_.allocate(batch_norm_workspace_bytes(rows_of(batch), channels_));
  }

  // Who the batch statistics are summed over: every replica (and lane) when synchronized, else
  // the lanes of this replica, which together are one replica; null when alone.
  nn::CrossReplica* statistics_group(const nn::StepContext& step) const {
    return layer_.options().synchronized ? step.cross_replica : step.lanes;
  }

  // The per-channel device state, made with the first plan (or a first step without samples).
  void ensure_state() {
    if (state_) return;
    // mean and inv_std (f32, C each), then the sums and means of the synchronized passes (double,
    // 2C each), one allocation.
    state_ = ctx_.allocate(2 * bytes_per_channel() + 4 * static_cast<std::size_t>(channels_) * sizeof(double));
  }
  std::size_t bytes_per_channel() const { return static_cast<std::size_t>(channels_) * sizeof(float); }
  float* mean() const { return static_cast<float*>(state_.get()); }
  float* inv_std() const { return mean() + channels_; }
  double* device_sums() const { return reinterpret_cast<double*>(inv_std() + channels_); }
  double* device_means() const { return device_sums() + 2 * channels_; }

  std::int64_t rows_of(std::int64_t batch) const { return batch * (layer_.input_shape().numel() / channels_); }
  Variable& var(std::size_t i) { return layer_.variables()[i]; }
  const float* gamma() {
    return layer_.gamma_index() >= 0 ? value_of(var(static_cast<std::size_t>(layer_.gamma_index()))) : nullptr;
  }
  const float* beta() {
    return layer_.beta_index() >= 0 ? value_of(var(static_cast<std::size_t>(layer_.beta_index()))) : nullptr;
  }

  // Where a training forward writes the statistics: mean() and inv_std() for backward, and this
  // replica's contributions into the moving statistics' grads.
  BatchNormStatistics statistics_out(const nn::StepContext& step, std::int64_t batch) {
    BatchNormStatistics out;
    out.mean = mean();
    out.inv_std = inv_std();
    out.mean_contribution = grad_of(var(layer_.moving_mean_index()));
    out.variance_contribution = grad_of(var(layer_.moving_variance_index()));
    out.weight = layer_.contribution_weight(step, batch);
    return out;
  }

  // This replica's sums (sums_[0, n)) over the group, into sums_.
  void all_reduce(nn::CrossReplica& group, std::size_t n, const char* what) {
    group.all_reduce_sum(std::span<double>(sums_.data(), n), what);
  }

  // The statistics of every replica's rows (x may be null with m 0): each pass's device sums to
  // the host, summed over the group, the means back to the device for the next pass.
  void synchronized_statistics(const float* x, std::int64_t m, const nn::StepContext& step,
                               const BatchNormStatistics& out, void* workspace) {
    const std::int64_t c = channels_;
    const auto cs = static_cast<std::size_t>(c);
    nn::CrossReplica& group = *statistics_group(step);
    const auto pass = [&](auto&& device_pass) {
      if (m > 0) {
        device_pass();
        ctx_.copy_to_host(device_sums(), sums_.data(), cs * sizeof(double));
      } else {
        std::fill(sums_.begin(), sums_.begin() + c, 0.0);
      }
    };
    // The sums of x, then the row count right after them: one collective of C + 1 values.
    pass([&] { batch_norm_sum(ctx_, x, m, c, device_sums(), workspace); });
    sums_[cs] = static_cast<double>(m);
    all_reduce(group, cs + 1, "batch normalization mean");
    count_ = sums_[cs];
    for (std::size_t k = 0; k < cs; ++k) means_[k] = count_ > 0 ? sums_[k] / count_ : 0.0;
    ctx_.copy_from_host(means_.data(), device_means(), cs * sizeof(double));
    pass([&] { batch_norm_sum_squared_deviations(ctx_, x, m, c, device_means(), device_sums(), workspace); });
    all_reduce(group, cs, "batch normalization variance");
    for (std::size_t k = 0; k < cs; ++k) means_[cs + k] = count_ > 0 ? sums_[k] / count_ : 0.0;
    ctx_.copy_from_host(means_.data() + cs, device_means() + c, cs * sizeof(double));
    batch_norm_finish_statistics(ctx_, device_means(), device_means() + c, c, layer_.options().epsilon, out);
  }

  // sums_[0, 2C) (this replica's sums of dy and dy * xhat) over the group, divided by the rows of
  // the statistics (count_, from forward) into the device's means of dy and dy * xhat.
  void sum_gradients(nn::CrossReplica& group) {
    const auto n = static_cast<std::size_t>(2 * channels_);
    all_reduce(group, n, "batch normalization gradient sums");
    for (std::size_t k = 0; k < n; ++k) means_[k] = count_ > 0 ? sums_[k] / count_ : 0.0;
    ctx_.copy_from_host(means_.data(), device_means(), n * sizeof(double));
  }

  std::int64_t channels_;
  Buffer state_;              // see ensure_state()
  std::vector<double> sums_;   // host: a pass's sums (2C + 1), summed over the group in place
  std::vector<double> means_;  // host: the means sent back to the device (2C)
  double count_ = 0.0;         // rows of the last training forward's statistics, over the group
  // Whether backward computes dx, which decides whether a synchronized backward makes its
  // collective: bind() knows; before any bind (a replica that has had no samples yet), true unless
  // the model said nothing wants it (without_input_gradient), as for the replicas with samples.
  bool has_input_gradient_;
};

const nn::KernelRegistration registered(kName, nn::BatchNormalization::Options::kind,
                                        &make_kernel<BatchNormalizationKernel, nn::BatchNormalization>);

}  // namespace

}  // namespace dtrain::backends::cuda
