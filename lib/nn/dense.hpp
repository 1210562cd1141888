// Dense (Keras semantics) on oneDNN's inner product.
//   input  x (N, I)            (flatten first for images)
//   kernel   (I, O)  Keras      oneDNN weights (O, I), physical order io
//   bias     (O,)
//   output y (N, O) = act(x @ kernel + bias)
#pragma once

#include "config/experiment.hpp"
#include "nn/activation_fn.hpp"
#include "nn/layer.hpp"
#include "nn/weighted_op.hpp"

namespace dtrain::nn {

class Dense final : public Layer {
 public:
  Dense(std::string name, const config::DenseConfig& options);
  const char* kind() const override { return "dense"; }
  Shape build(const Shape& input_shape, Rng& init_rng) override;
  dnnl::memory::desc plan(Context& ctx, const dnnl::memory::desc& src_md) override;
  void bind(Context& ctx, std::int64_t batch, const LayerIO& io) override;
  void forward(Context& ctx, std::int64_t batch) override;
  void backward(Context& ctx, std::int64_t batch) override;
  double regularization_loss() const override;
  void add_regularization_gradient(float scale) override;

 private:
  config::DenseConfig opt_;
  ActivationFn act_;
  std::int64_t in_ = 0;
  PlanCache<WeightedOpPlan> plans_;
};

}  // namespace dtrain::nn
