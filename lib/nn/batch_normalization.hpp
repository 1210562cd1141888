// BatchNormalization (Keras 3 semantics, axis -1: per channel, the last axis).
//   input  x (N, ..., C), seen as M rows x C channels (M = N * H * W for images)
//   gamma (C,) ones, beta (C,) zeros (trainable, when scale / center); moving_mean (C,) zeros,
//   moving_variance (C,) ones (not trainable)
//   training:  y = gamma (x - mean) / sqrt(var + epsilon) + beta with this batch's mean and biased
//              variance; moving = moving * momentum + statistic * (1 - momentum) after the step
//   inference: the same with the moving statistics
//
// Under a strategy each replica normalizes with its own batch's statistics, as Keras does, and the
// moving statistics move by the mean of the replicas' statistics (weighted by their samples), so
// the mirrored copies stay identical. With `synchronized: true` (Keras 3's synchronized=True) the
// statistics, and the sums backward needs, are summed over every replica of every worker: N
// replicas then compute what one computes on the global batch.
//
// The moving statistics' grads carry this replica's contribution to their update (nn/layer.hpp):
// statistic * its samples / the step's samples, or, synchronized, the statistic from replica 0
// only (every replica has the same one).
#pragma once

#include <string_view>

#include "nn/layer.hpp"

namespace dtrain::nn {

struct BatchNormalizationOptions {
  static constexpr std::string_view kind = "batch_normalization";
  double momentum = 0.99;
  double epsilon = 1e-3;
  bool center = true;
  bool scale = true;
  bool synchronized = false;
  bool operator==(const BatchNormalizationOptions&) const = default;
};

class BatchNormalization final : public Layer {
 public:
  using Options = BatchNormalizationOptions;
  BatchNormalization(std::string name, const Options& options) : Layer(std::move(name)), opt_(options) {}
  std::string_view kind() const override { return Options::kind; }
  const Options& options() const { return opt_; }
  // Indices in variables(); gamma / beta are -1 without scale / center.
  int gamma_index() const { return opt_.scale ? 0 : -1; }
  int beta_index() const { return opt_.center ? (opt_.scale ? 1 : 0) : -1; }
  std::size_t moving_mean_index() const { return (opt_.scale ? 1 : 0) + (opt_.center ? 1 : 0); }
  std::size_t moving_variance_index() const { return moving_mean_index() + 1; }
  std::int64_t channels() const { return output_shape()[output_shape().rank() - 1]; }
  // The weight of this replica's batch statistics in the moving statistics' update.
  double contribution_weight(const StepContext& step, std::int64_t batch) const;

  void apply_updates(device::Numerics& numerics) override;
  bool synchronizes_replicas() const override { return opt_.synchronized; }
  void reference_forward(const ReferenceForward& io, const StepContext& step) const override;
  void reference_backward(const ReferenceBackward& io, const StepContext& step) const override;
  Flops flops_per_sample() const override;
  BackwardReads backward_reads() const override { return BackwardReads::input; }

 private:
  Shape build_layer(const Shape& input_shape) override;
  Options opt_;
};

}  // namespace dtrain::nn
