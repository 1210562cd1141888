// Conv2D (Keras semantics) on oneDNN.
//   input  x (N, H, W, C)                      oneDNN src     (N, C, H, W)
//   kernel   (KH, KW, C, F)  Keras HWIO        oneDNN weights (F, C, KH, KW)
//   bias     (F,)
//   output y (N, OH, OW, F) = act(conv(x, kernel) + bias); OH, OW from nn/padding.hpp
#pragma once

#include "config/experiment.hpp"
#include "nn/activation_fn.hpp"
#include "nn/layer.hpp"
#include "nn/weighted_op.hpp"

namespace dtrain::nn {

class Conv2D final : public Layer {
 public:
  Conv2D(std::string name, const config::Conv2DConfig& options);
  const char* kind() const override { return "conv2d"; }
  Shape build(const Shape& input_shape, Rng& init_rng) override;
  dnnl::memory::desc plan(Context& ctx, const dnnl::memory::desc& src_md) override;
  void bind(Context& ctx, std::int64_t batch, const LayerIO& io) override;
  void forward(Context& ctx, std::int64_t batch) override;
  void backward(Context& ctx, std::int64_t batch) override;
  double regularization_loss() const override;
  void add_regularization_gradient(float scale) override;

 private:
  config::Conv2DConfig opt_;
  ActivationFn act_;
  std::int64_t in_h_ = 0, in_w_ = 0, in_c_ = 0, out_h_ = 0, out_w_ = 0;
  dnnl::memory::dims pad_before_, pad_after_;
  PlanCache<WeightedOpPlan> plans_;
};

}  // namespace dtrain::nn
