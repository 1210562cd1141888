// Dense (Keras semantics).
//   input  x (N, I)            (flatten first for images)
//   kernel   (I, O)  Keras     glorot_uniform
//   bias     (O,)              zeros
//   output y (N, O) = act(x @ kernel + bias)
#pragma once

#include <string_view>

#include "config/experiment.hpp"
#include "nn/layer.hpp"

namespace dtrain::nn {

struct DenseOptions {
  static constexpr std::string_view kind = "dense";
  int units = 0;
  config::Activation activation = config::Activation::linear;
  bool use_bias = true;
  config::Regularizer kernel_regularizer;
  bool operator==(const DenseOptions&) const = default;
};

class Dense final : public Layer {
 public:
  using Options = DenseOptions;
  static constexpr std::size_t kKernel = 0, kBias = 1;  // variables()

  Dense(std::string name, const Options& options) : Layer(std::move(name)), opt_(options) {}
  std::string_view kind() const override { return Options::kind; }
  std::string_view size_option() const override { return "units"; }
  const Options& options() const { return opt_; }

  double regularization_loss(device::Numerics& numerics) const override;
  void add_regularization_gradient(device::Numerics& numerics, float scale) override;
  void reference_forward(const ReferenceForward& io, const StepContext& step) const override;
  void reference_backward(const ReferenceBackward& io, const StepContext& step) const override;
  Flops flops_per_sample() const override;
  BackwardReads backward_reads() const override { return BackwardReads::input; }
  bool activation_reads_output() const override { return opt_.activation != config::Activation::linear; }
  config::Activation final_activation() const override { return opt_.activation; }
  config::LayerOptions options_without_final_activation() const override { return with_linear_activation(opt_); }
  // The relu's output below is this layer's input, which backward reads anyway.
  BackwardReads derivative_below_reads() const override { return BackwardReads::input; }

 private:
  Shape build_layer(const Shape& input_shape) override;
  Options opt_;
};

}  // namespace dtrain::nn
