// Conv2D (Keras semantics).
//   input  x (N, H, W, C)
//   kernel   (KH, KW, C, F)  Keras HWIO, glorot_uniform
//   bias     (F,)            zeros
//   output y (N, OH, OW, F) = act(conv(x, kernel) + bias); OH, OW and the padding from nn/padding.hpp
#pragma once

#include <array>
#include <string_view>

#include "config/experiment.hpp"
#include "nn/layer.hpp"
#include "nn/padding.hpp"

namespace dtrain::nn {

struct Conv2DOptions {
  static constexpr std::string_view kind = "conv2d";
  int filters = 0;
  std::array<int, 2> kernel_size{3, 3};
  std::array<int, 2> strides{1, 1};
  config::Padding padding = config::Padding::valid;
  config::Activation activation = config::Activation::linear;
  bool use_bias = true;
  config::Regularizer kernel_regularizer;
  bool operator==(const Conv2DOptions&) const = default;
};

class Conv2D final : public Layer {
 public:
  using Options = Conv2DOptions;
  static constexpr std::size_t kKernel = 0, kBias = 1;  // variables()

  Conv2D(std::string name, const Options& options) : Layer(std::move(name)), opt_(options) {}
  std::string_view kind() const override { return Options::kind; }
  std::string_view size_option() const override { return "filters"; }
  const Options& options() const { return opt_; }
  // The explicit padding of each spatial axis (after build).
  const Padding1D& padding_h() const { return pad_h_; }
  const Padding1D& padding_w() const { return pad_w_; }

  double regularization_loss(device::Numerics& numerics) const override;
  void add_regularization_gradient(device::Numerics& numerics, float scale) override;
  void reference_forward(const ReferenceForward& io, const StepContext& step) const override;
  void reference_backward(const ReferenceBackward& io, const StepContext& step) const override;
  Flops flops_per_sample() const override;
  BackwardReads backward_reads() const override { return BackwardReads::input; }
  bool activation_reads_output() const override { return opt_.activation != config::Activation::linear; }
  config::Activation final_activation() const override { return opt_.activation; }
  config::LayerOptions options_without_final_activation() const override { return with_linear_activation(opt_); }

 private:
  Shape build_layer(const Shape& input_shape) override;
  Options opt_;
  Padding1D pad_h_, pad_w_;
};

}  // namespace dtrain::nn
