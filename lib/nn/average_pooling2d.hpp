// AveragePooling2D (Keras semantics).
//   input  x (N, H, W, C)
//   output y (N, OH, OW, C), y = mean over each pool window; OH, OW from nn/padding.hpp.
//   'same' padding is not counted: a window at the border averages only its real inputs, as
//   TensorFlow's avg_pool does.
#pragma once

#include <string_view>

#include "nn/pooling.hpp"

namespace dtrain::nn {

struct AveragePooling2DOptions : Pool2DParams {
  static constexpr std::string_view kind = "average_pooling2d";
  bool operator==(const AveragePooling2DOptions&) const = default;
};

class AveragePooling2D final : public Pool2DLayer {
 public:
  using Options = AveragePooling2DOptions;
  AveragePooling2D(std::string name, const Options& options) : Pool2DLayer(std::move(name), options) {}
  std::string_view kind() const override { return Options::kind; }
  void reference_forward(const ReferenceForward& io, const StepContext& step) const override;
  void reference_backward(const ReferenceBackward& io, const StepContext& step) const override;
  Flops flops_per_sample() const override;
  BackwardReads derivative_below_reads() const override { return BackwardReads::input; }
};

}  // namespace dtrain::nn
