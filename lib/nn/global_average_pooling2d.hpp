// GlobalAveragePooling2D (Keras semantics, keepdims false).
//   input  x (N, H, W, C)
//   output y (N, C), y[n, c] = mean of x[n, :, :, c]
#pragma once

#include <string_view>

#include "nn/layer.hpp"

namespace dtrain::nn {

struct GlobalAveragePooling2DOptions {
  static constexpr std::string_view kind = "global_average_pooling2d";
  bool operator==(const GlobalAveragePooling2DOptions&) const = default;
};

class GlobalAveragePooling2D final : public Layer {
 public:
  using Options = GlobalAveragePooling2DOptions;
  GlobalAveragePooling2D(std::string name, const Options&) : Layer(std::move(name)) {}
  std::string_view kind() const override { return Options::kind; }
  void reference_forward(const ReferenceForward& io, const StepContext& step) const override;
  void reference_backward(const ReferenceBackward& io, const StepContext& step) const override;
  Flops flops_per_sample() const override;

 private:
  Shape build_layer(const Shape& input_shape) override;
};

}  // namespace dtrain::nn
