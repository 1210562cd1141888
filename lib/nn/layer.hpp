// The layer interface of the CPU (oneDNN) backend.
//
// Life of a layer:
//   build(input_shape, rng)     once: creates the variables (Keras initializers, Keras layouts)
//   plan(ctx, src_md)           once per batch size: creates and caches the primitive descriptors
//                               (format_tag::any: oneDNN picks the layouts) and returns the layout
//                               this layer produces
//   bind(ctx, batch, io)        once per batch size: the model hands over the memories between
//                               layers; the layer allocates its scratch and prebuilds the argument
//                               maps, so a step allocates nothing
//   forward(ctx, batch)         every step
//   backward(ctx, batch)        every step: writes every variable's grad and, when io.diff_src is
//                               bound, the gradient with respect to the input. It may overwrite
//                               io.diff_dst (the model never reads it again).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include <oneapi/dnnl/dnnl.hpp>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "core/tensor.hpp"
#include "core/variable.hpp"
#include "kernels/cpu/dnnl_context.hpp"

namespace dtrain::nn {

using kernels::cpu::Context;

// The memories around one layer for one batch size. diff_src is empty for the first layer.
struct LayerIO {
  dnnl::memory src, dst, diff_dst, diff_src;
};

class Layer {
 public:
  explicit Layer(std::string name) : name_(std::move(name)) {}
  virtual ~Layer() = default;
  Layer(const Layer&) = delete;
  Layer& operator=(const Layer&) = delete;

  const std::string& name() const { return name_; }
  virtual const char* kind() const = 0;

  // Per-example shapes (no batch dimension), channels last.
  virtual Shape build(const Shape& input_shape, Rng& init_rng) = 0;
  virtual dnnl::memory::desc plan(Context& ctx, const dnnl::memory::desc& src_md) = 0;
  virtual void bind(Context& ctx, std::int64_t batch, const LayerIO& io) = 0;
  virtual void forward(Context& ctx, std::int64_t batch) = 0;
  virtual void backward(Context& ctx, std::int64_t batch) = 0;

  std::span<Variable> variables() { return vars_; }
  std::span<const Variable> variables() const { return vars_; }
  // Keras' kernel_regularizer: the sum over this layer's penalties, and its gradient added
  // (times `scale`) into the variables' grads.
  virtual double regularization_loss() const { return 0.0; }
  virtual void add_regularization_gradient(float /*scale*/) {}

 protected:
  // Returns the variable's index in variables(): references would not survive a later add.
  std::size_t add_variable(const std::string& weight, Shape shape);

 private:
  std::string name_;
  std::vector<Variable> vars_;
};

using kernels::cpu::BoundPrimitive;

// Per-batch-size state of a layer. Layers keep one of their own Plan type per batch size.
template <class Plan>
class PlanCache {
 public:
  Plan& get(std::int64_t batch) {
    auto it = plans_.find(batch);
    DTRAIN_CHECK(it != plans_.end(), "layer used with a batch size it was not planned for");
    return *it->second;
  }
  Plan& create(std::int64_t batch) {
    auto& p = plans_[batch];
    p = std::make_unique<Plan>();
    return *p;
  }

 private:
  std::map<std::int64_t, std::unique_ptr<Plan>> plans_;
};

}  // namespace dtrain::nn
