// MaxPooling2D (Keras semantics) on oneDNN.
//   input  x (N, H, W, C)
//   output y (N, OH, OW, C), y = max over each pool window; OH, OW from nn/padding.hpp.
//   'same' padding never wins the max (oneDNN's max pooling excludes padding, as TensorFlow).
// Works in whatever layout the layer below produced (pooling is layout-agnostic), and keeps
// oneDNN's workspace (argmax positions) from forward for backward.
#pragma once

#include "config/experiment.hpp"
#include "nn/layer.hpp"

namespace dtrain::nn {

class MaxPool2D final : public Layer {
 public:
  MaxPool2D(std::string name, const config::MaxPool2DConfig& options);
  const char* kind() const override { return "max_pooling2d"; }
  Shape build(const Shape& input_shape, Rng& init_rng) override;
  dnnl::memory::desc plan(Context& ctx, const dnnl::memory::desc& src_md) override;
  void bind(Context& ctx, std::int64_t batch, const LayerIO& io) override;
  void forward(Context& ctx, std::int64_t batch) override;
  void backward(Context& ctx, std::int64_t batch) override;

 private:
  struct Plan {
    dnnl::pooling_forward::primitive_desc fwd_pd;
    dnnl::pooling_backward::primitive_desc bwd_pd;
    dnnl::memory workspace;
    BoundPrimitive fwd, bwd;
    bool has_diff_src = false;
  };
  config::MaxPool2DConfig opt_;
  std::array<int, 2> strides_{};
  std::int64_t in_h_ = 0, in_w_ = 0, c_ = 0, out_h_ = 0, out_w_ = 0;
  dnnl::memory::dims pad_before_, pad_after_;
  PlanCache<Plan> plans_;
};

}  // namespace dtrain::nn
