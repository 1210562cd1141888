// An activation applied to a layer's output (Conv2D and Dense `activation:`), and the standalone
// Activation layer's math, on oneDNN.
//
// relu, sigmoid and tanh are fused into the producing primitive as a oneDNN eltwise post-op, so
// the forward pass writes the activated output once. Their backward uses the *_use_dst_for_bwd
// algorithms: the gradient needs only the layer's output, which the model keeps anyway.
// softmax is not an eltwise op: it runs as its own primitive, in place on the output, over the
// channel (last Keras) axis. linear does nothing.
#pragma once

#include <oneapi/dnnl/dnnl.hpp>

#include "backends/onednn/context.hpp"
#include "config/experiment.hpp"

namespace dtrain::backends::onednn {

class ActivationFn {
 public:
  explicit ActivationFn(config::Activation kind) : kind_(kind) {}
  config::Activation kind() const { return kind_; }
  bool is_eltwise() const;
  // The eltwise algorithm whose backward needs only the output (relu/sigmoid/tanh only).
  dnnl::algorithm dst_algorithm() const;

  // Attributes for the producing primitive: the eltwise post-op, if any.
  dnnl::primitive_attr post_op_attr() const;

  struct Plan {
    BoundPrimitive softmax_forward;  // in place on dst
    BoundPrimitive backward;         // writes the gradient before the activation into `pre_grad`
    dnnl::memory pre_grad;           // diff_dst itself for eltwise (in place), scratch for softmax
  };
  // dst: the activated output; diff_dst: the gradient arriving from above. pre_grad: where
  // backward leaves its result, when given (same descriptor as diff_dst): written out of place,
  // so a layer whose result goes below needs no copy (else diff_dst in place, or scratch).
  void bind(const OnednnContext& ctx, const dnnl::memory& dst, const dnnl::memory& diff_dst, Plan& plan,
            const dnnl::memory* pre_grad = nullptr) const;
  void forward(OnednnContext& ctx, Plan& plan) const;
  // The eltwise activation (is_eltwise) as its own primitive, in place on `y`, computing what the
  // post-op would: for a layer that writes its output before the activation itself.
  BoundPrimitive in_place_forward(const OnednnContext& ctx, const dnnl::memory& y) const;
  // Leaves d(loss)/d(pre-activation) in plan.pre_grad.
  void backward(OnednnContext& ctx, Plan& plan) const;

 private:
  config::Activation kind_;
};

}  // namespace dtrain::backends::onednn
