// Sequential: the layers of an experiment's model, run on the CPU backend.
//
// The model owns the memories between layers, one set per batch size (the short last batch of
// an epoch gets its own), created on the first step of that size: later steps allocate nothing.
// Inputs and outputs cross the boundary in canonical layout (channels last); in between, each
// layer produces the layout oneDNN picked for it.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "config/experiment.hpp"
#include "core/tensor.hpp"
#include "core/variable.hpp"
#include "nn/layer.hpp"

namespace dtrain::nn {

// What one backward() does besides computing the gradients of the data loss.
struct BackwardOptions {
  // Adds d(regularization_loss)/d(variable) times this into the grads (0: nothing added), layer
  // by layer, so a layer's gradients are final when it hands them over.
  float regularization_scale = 0.0f;
  // Called as soon as a layer's variable gradients are final, with the range [first, first +
  // count) of variables(); layers finish last to first. Distributed training starts summing them
  // across workers while backward goes on with the earlier layers.
  const std::function<void(std::size_t first, std::size_t count)>* gradients_ready = nullptr;
};

// Caffe-style registry: the YAML layer kind decides the class.
std::unique_ptr<Layer> make_layer(const config::LayerConfig& layer);

class Sequential {
 public:
  // Builds every layer and initializes the variables from Rng(seed, RngStream::init, layer index).
  // input_gradient: also compute d(loss)/d(input) (tests and tools; training does not need it).
  Sequential(const config::ModelConfig& config, std::uint64_t seed, bool input_gradient = false);

  const Shape& input_shape() const { return input_shape_; }   // per example
  const Shape& output_shape() const { return output_shape_; } // per example
  std::size_t num_layers() const { return layers_.size(); }
  Layer& layer(std::size_t i) { return *layers_[i]; }
  const Layer& layer(std::size_t i) const { return *layers_[i]; }
  // Every variable of every layer, in layer order; the pointers stay valid for the model's life.
  const std::vector<Variable*>& variables() const { return variables_; }
  std::int64_t num_parameters() const;
  // Every variable's grad is a view into one contiguous f32 arena, in variables() order, so the
  // gradients of consecutive variables can be summed across replicas as one range, in place.
  std::span<float> gradient_arena() { return gradient_arena_.span<float>(); }
  // Floats per variable, in variables() order: the arena's partition.
  std::span<const std::size_t> gradient_sizes() const { return gradient_sizes_; }

  // x: (N, input_shape...) f32, canonical. Returns y: (N, output_shape...), canonical, valid
  // until the next forward.
  const Tensor& forward(Context& ctx, const Tensor& x);
  // The buffer the caller fills with d(loss)/d(y) for the last forward's batch, then backward().
  Tensor& output_gradient();
  // Overwrites every variable's grad with d(loss)/d(variable).
  void backward(Context& ctx, const BackwardOptions& options = {});
  // d(loss)/d(x) of the last backward; only with input_gradient.
  const Tensor& input_gradient() const;

  double regularization_loss() const;
  void add_regularization_gradient(float scale);

  // Central storage: compute with `other`'s variable values (one shared copy) while keeping this
  // model's own gradients and buffers. Only before this model's first forward().
  void share_variable_values(const Sequential& other);

  // A Keras-like summary: one line per layer with its output shape and parameter count.
  std::string summary() const;

 private:
  struct Plan {
    std::int64_t batch = 0;
    dnnl::memory input;
    std::vector<dnnl::memory> act;   // act[i] = output of layer i
    std::vector<dnnl::memory> diff;  // diff[i] = gradient wrt act[i]
    Tensor output, output_grad, input_grad;
    dnnl::memory input_diff;
    kernels::cpu::Reorder output_out, grad_in;
  };
  Plan& plan_for(Context& ctx, std::int64_t batch);

  Shape input_shape_, output_shape_;
  std::vector<Shape> layer_output_shapes_;
  std::vector<std::unique_ptr<Layer>> layers_;
  std::vector<Variable*> variables_;
  Tensor gradient_arena_;
  std::vector<std::size_t> gradient_sizes_;
  std::vector<std::size_t> first_variable_;  // of each layer, in variables_
  std::map<std::int64_t, Plan> plans_;
  Plan* current_ = nullptr;
  bool input_gradient_ = false;
};

}  // namespace dtrain::nn
