// The oneDNN pooling kernel the 2-D pooling layers share (max_pool2d.cpp, average_pooling2d.cpp).
// It works in whatever layout and dtype the layer below produced (pooling only moves and averages
// values, so it needs no dtype of its own: under mixed_bfloat16 it moves half the bytes); max pooling
// keeps oneDNN's workspace (argmax positions) from forward for backward.
#pragma once

#include "backends/onednn/context.hpp"
#include "nn/kernel.hpp"
#include "nn/pooling.hpp"

namespace dtrain::backends::onednn {

class Pool2DKernel final : public nn::LayerKernel {
 public:
  // algorithm: pooling_max, or pooling_avg_exclude_padding (TensorFlow's average).
  Pool2DKernel(nn::Pool2DLayer& layer, OnednnContext& ctx, dnnl::algorithm algorithm)
      : layer_(layer), ctx_(ctx), algorithm_(algorithm) {}
  LayoutPtr plan(std::int64_t batch, const LayoutPtr& src) override;
  void bind(std::int64_t batch, const nn::LayerIO& io) override;
  void forward(std::int64_t batch, const nn::StepContext&) override { plans_.get(batch).fwd.run(ctx_); }
  void backward(std::int64_t batch, const nn::StepContext&) override;

 private:
  struct Plan {
    dnnl::pooling_forward::primitive_desc fwd_pd;
    dnnl::pooling_backward::primitive_desc bwd_pd;
    dnnl::memory workspace;  // max pooling only
    BoundPrimitive fwd, bwd;
    bool has_diff_src = false;
  };
  nn::Pool2DLayer& layer_;
  OnednnContext& ctx_;
  dnnl::algorithm algorithm_;
  nn::PlanCache<Plan> plans_;
};

}  // namespace dtrain::backends::onednn
