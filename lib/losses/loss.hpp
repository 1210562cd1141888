// Losses (Keras semantics) and the reductions of tf.nn / tf.distribute custom training loops.
//
// Shapes: y_pred is a canonical f32 Tensor (N, C). y_true is either DType::i32 (N,) (or (N, 1))
// class ids / integer targets, or f32 (N, C) one-hot rows / targets. Sample weights are a span of
// N floats; an empty span means every weight is 1.
//
// In a distributed step the loss is NOT reduced by the Loss object: the step takes the
// per-example losses and calls compute_average_loss with the GLOBAL batch size, adds
// scale_regularization_loss(...), and gets gradients from Loss::gradient with
// scale = 1 / global_batch_size, so that summing gradients over replicas gives the global mean.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "device/numerics.hpp"
#include "config/experiment.hpp"
#include "core/tensor.hpp"
#include "losses/loss_math.hpp"

namespace dtrain::losses {

const char* loss_name(config::LossKind kind);  // the Keras spelling, e.g. "sparse_categorical_crossentropy"
// Whether the kind is one of the crossentropies, which Keras 3 computes from the input of a
// softmax or sigmoid that made the predictions (nn::ModelOptions::crossentropy_from_pre_activation).
bool reads_activation_input(config::LossKind kind);

class Loss {
 public:
  // The loops run on `numerics` (the replica's context).
  Loss(const config::LossConfig& config, device::Numerics& numerics);

  const config::LossConfig& config() const { return config_; }
  std::string name() const { return loss_name(config_.kind); }

  // out[i] = loss of example i (unweighted). out.size() must be N. This is also what
  // reduction `none` means. Throws InputError on shape/dtype mismatch or labels out of range.
  void per_example(const Tensor& y_pred, const Tensor& y_true, std::span<float> out) const;

  // d_pred[i, :] = scale * w_i * d(loss_i)/d(y_pred[i, :]). d_pred is (re)shaped to y_pred's shape
  // with Tensor::ensure, so once it has the storage it never allocates again.
  void gradient(const Tensor& y_pred, const Tensor& y_true, std::span<const float> weights, float scale,
                Tensor& d_pred) const;

  // Both in one pass (a training step): out as per_example() gives it, d_pred as gradient()
  // without weights gives it (the same values: each row's loss does not depend on its gradient).
  // With `deferred`, out may be written as late as the numerics' next complete_reads(), and must
  // stay valid until then: a backend with a stream then need not wait for the forward pass here.
  void per_example_and_gradient(const Tensor& y_pred, const Tensor& y_true, std::span<float> out, float scale,
                                Tensor& d_pred, bool deferred) const;

 private:
  // The backend's view of a validated batch (no weights, no outputs yet).
  device::LossBatch batch_of(const Tensor& y_pred, const Tensor& y_true) const;
  // Checks shapes, dtypes and label ranges; returns (N, C).
  std::pair<std::int64_t, std::int64_t> validate(const Tensor& y_pred, const Tensor& y_true) const;

  config::LossConfig config_;
  device::Numerics& numerics_;
};

std::unique_ptr<Loss> make_loss(const config::LossConfig& config, device::Numerics& numerics);

// tf.nn.compute_average_loss: sum_i(w_i * l_i) / global_batch_size. The global batch is the number
// of examples across ALL replicas in this step, so a short last batch must pass its real count.
// global_batch_size < 1 is an InternalError (a caller bug).
double compute_average_loss(std::span<const float> per_example, std::int64_t global_batch_size,
                            std::span<const float> sample_weight = {});

// tf.nn.scale_regularization_loss: the regularization term is added on every replica and the
// gradients are summed, so each replica contributes 1 / num_replicas_in_sync of it.
double scale_regularization_loss(double regularization_loss, int num_replicas_in_sync);

// Keras reductions of per-example losses (single replica, no strategy):
//   sum                       sum_i(w_i * l_i)
//   sum_over_batch_size/auto  sum_i(w_i * l_i) / N   (N = number of examples, not sum of weights;
//                                                     0 for an empty batch)
//   none                      has no scalar: throws InternalError. Use Loss::per_example for it.
double reduce_loss(std::span<const float> per_example, config::Reduction reduction,
                   std::span<const float> sample_weight = {});

}  // namespace dtrain::losses
