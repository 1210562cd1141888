// Activation as a layer (Keras `Activation`): y = f(x) elementwise (softmax: over the last axis).
//   x (N, ...) -> y (N, ...), same shape, same layout as the layer below produced.
#pragma once

#include "config/experiment.hpp"
#include "nn/activation_fn.hpp"
#include "nn/layer.hpp"

namespace dtrain::nn {

class ActivationLayer final : public Layer {
 public:
  ActivationLayer(std::string name, const config::ActivationConfig& options);
  const char* kind() const override { return "activation"; }
  Shape build(const Shape& input_shape, Rng& init_rng) override;
  dnnl::memory::desc plan(Context& ctx, const dnnl::memory::desc& src_md) override;
  void bind(Context& ctx, std::int64_t batch, const LayerIO& io) override;
  void forward(Context& ctx, std::int64_t batch) override;
  void backward(Context& ctx, std::int64_t batch) override;

 private:
  struct Plan {
    BoundPrimitive fwd;  // eltwise kinds; softmax runs inside act
    kernels::cpu::Reorder copy_in, copy_out;  // linear and softmax: x -> y, grad -> diff_src
    ActivationFn::Plan act;
    bool has_diff_src = false;
  };
  ActivationFn act_;
  PlanCache<Plan> plans_;
};

}  // namespace dtrain::nn
