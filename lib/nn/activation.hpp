// Activation as a layer (Keras `Activation`): y = f(x) elementwise (softmax: over the last axis).
//   x (N, ...) -> y (N, ...), same shape
#pragma once

#include <string_view>

#include "config/experiment.hpp"
#include "nn/layer.hpp"

namespace dtrain::nn {

struct ActivationOptions {
  static constexpr std::string_view kind = "activation";
  config::Activation activation = config::Activation::linear;
  bool operator==(const ActivationOptions&) const = default;
};

class ActivationLayer final : public Layer {
 public:
  using Options = ActivationOptions;
  ActivationLayer(std::string name, const Options& options) : Layer(std::move(name)), opt_(options) {}
  std::string_view kind() const override { return Options::kind; }
  config::Activation activation() const { return opt_.activation; }
  void reference_forward(const ReferenceForward& io, const StepContext& step) const override;
  void reference_backward(const ReferenceBackward& io, const StepContext& step) const override;
  Flops flops_per_sample() const override;
  BackwardReads backward_reads() const override { return BackwardReads::output; }
  config::Activation final_activation() const override { return opt_.activation; }
  config::LayerOptions options_without_final_activation() const override { return with_linear_activation(opt_); }
  bool returns_its_input() const override { return opt_.activation == config::Activation::linear; }

 private:
  Shape build_layer(const Shape& input_shape) override { return input_shape; }
  Options opt_;
};

}  // namespace dtrain::nn
