// What a layer is, whatever runs it: its options, its variables (trainable or not, in Keras
// layouts), its output shape, its regularization, and the plain-loop oracle of what its forward and
// backward compute. How a backend computes it is the layer's kernel (nn/kernel.hpp), one file per
// layer in each backends/<name>/ folder.
//
// Life of a layer:
//   declare(position, in)     once: checks the input shape, declares the variables (shapes and
//                             Keras initializers, no memory yet), returns the per-example output
//                             shape; what the model's memory estimate reads before anything is
//                             allocated
//   materialize(rng)          once: allocates the variables and initializes them, in the order
//                             they were declared (build() does both)
//   (a kernel per replica)    made by the backend of the replica's device, see nn/kernel.hpp
//   apply_updates()           after each training step's reduction, where the variables live:
//                             folds the step's contributions into non-trainable variables
//
// Non-trainable variables that a layer updates while training (batch normalization's moving
// statistics) use Variable::grad for this step's contribution to the update. The strategy sums
// those across replicas exactly as it sums gradients, and apply_updates() then folds the sum into
// the value on every copy of the variables, so mirrored copies stay identical and central storage
// updates its one copy once.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "config/experiment.hpp"
#include "device/numerics.hpp"
#include "core/rng.hpp"
#include "core/tensor.hpp"
#include "core/variable.hpp"
#include "nn/step.hpp"

namespace dtrain::nn {

// A layer kind's options with their `activation` linear (Layer::options_without_final_activation).
template <class Options>
config::LayerOptions with_linear_activation(Options options) {
  options.activation = config::Activation::linear;
  return options;
}

// The oracle's view of one call: canonical arrays in double. variables[i] / dvariables[i] follow
// variables() order.
struct ReferenceForward {
  std::int64_t batch = 0;
  std::span<const double> x;                        // (batch, input shape...)
  std::span<const std::vector<double>> variables;
  std::span<double> y;                              // (batch, output shape...), written
};
struct ReferenceBackward {
  std::int64_t batch = 0;
  std::span<const double> x, y, dy;
  std::span<const std::vector<double>> variables;
  std::span<double> dx;                             // written
  // Written: gradients of trainable variables; for non-trainable ones this replica's contribution
  // to their update (see the top of this file).
  std::span<std::vector<double>> dvariables;
};

// Floating-point operations per sample of one training step, a multiply-add counted as two (as
// GEMM peaks are counted). Conv2D and Dense: 2 x multiply-adds for forward, for the gradient with
// respect to the input (backward_data) and for the gradients of the weights (backward_weights),
// plus one per output element for a bias and one for a fused non-linear activation. Layers without
// weights count one operation per element they touch (a pooling window's compares or adds per
// output, a relu per element) and have no backward_weights. What `dtrain bench` divides its
// timings by; approximate for the layers that only move memory.
struct Flops {
  double forward = 0.0, backward_data = 0.0, backward_weights = 0.0;
  double backward() const { return backward_data + backward_weights; }
};

// Conv2D's and Dense's count: `multiply_adds` per sample, `outputs` output elements per sample.
Flops weighted_layer_flops(double multiply_adds, double outputs, bool bias, bool nonlinear_activation);

class Layer {
 public:
  explicit Layer(std::string name) : name_(std::move(name)) {}
  virtual ~Layer() = default;
  Layer(const Layer&) = delete;
  Layer& operator=(const Layer&) = delete;

  const std::string& name() const { return name_; }
  // The registered YAML kind (conv2d, dense, ...).
  virtual std::string_view kind() const = 0;
  // The option that sets the width of its outputs (filters, units): what an error about their
  // memory asks to make smaller. Empty for a kind whose outputs follow its input.
  virtual std::string_view size_option() const { return {}; }

  // Per-example shapes (no batch dimension), channels last. ConfigError naming the layer when the
  // input does not fit. `position`: the layer's index in the model (it keys per-layer random
  // streams).
  Shape declare(std::size_t position, const Shape& input_shape);
  // `should_stop` is asked between variables (a signal while a large model is built); when it
  // answers true the variables stay unmaterialized and materialize returns false.
  bool materialize(Rng& init_rng, const std::function<bool()>& should_stop = {});
  Shape build(std::size_t position, const Shape& input_shape, Rng& init_rng);
  bool materialized() const { return materialized_; }
  // Elements of every declared variable (known after declare()).
  std::int64_t declared_elements() const;
  std::size_t position() const { return position_; }
  const Shape& input_shape() const { return input_shape_; }
  const Shape& output_shape() const { return output_shape_; }

  std::span<Variable> variables() { return vars_; }
  std::span<const Variable> variables() const { return vars_; }

  // Keras' kernel_regularizer: the sum over this layer's penalties, and its gradient added (times
  // `scale`) into the trainable variables' grads.
  virtual double regularization_loss(device::Numerics&) const { return 0.0; }
  virtual void add_regularization_gradient(device::Numerics&, float /*scale*/) {}
  // Folds this step's summed contributions (their grads) into the non-trainable variables.
  virtual void apply_updates(device::Numerics&) {}
  // Whether training steps sum statistics over the replicas (StepContext::cross_replica) during
  // forward and backward.
  virtual bool synchronizes_replicas() const { return false; }
  // Per sample, after build() (see Flops); zero for a layer that does not count its work.
  virtual Flops flops_per_sample() const { return {}; }
  // What backward must read of the forward pass besides the output's gradient: the input (a
  // kernel's gradient, batch normalization's normalized values), the output (an activation's
  // derivative), or nothing more. dtrain bench counts those bytes in the backward's bound.
  enum class BackwardReads { nothing, input, output };
  virtual BackwardReads backward_reads() const { return BackwardReads::nothing; }
  // Whether backward also reads the output, to apply the derivative of an activation the layer
  // applies itself (Conv2D's and Dense's `activation:` other than linear), where no layer above
  // takes that derivative over.
  virtual bool activation_reads_output() const { return false; }
  // What backward reads besides to apply the derivative of a relu below it, where its kernel takes
  // that derivative over (LayerKernel::take_input_activation_backward): the relu's output where its
  // gradient goes. An average pooling reads its input; a max pooling needs nothing more (the max is
  // the relu's output where it came from, and forward marks a max not above zero as no winner).
  virtual BackwardReads derivative_below_reads() const { return BackwardReads::nothing; }
  // The leading rows and columns of a (height, width, channels) input that forward reads, where
  // fewer than all: a pooling whose last window ends before its input does (2 x 2 windows over 11
  // rows read 10). Its input's gradient is zero past them, so the layer below may leave those
  // positions out of the sums its backward takes (LayerKernel::output_read_within).
  struct InputExtent {
    std::int64_t rows = 0, columns = 0;
  };
  virtual std::optional<InputExtent> input_extent_read() const { return std::nullopt; }

  // The activation the layer applies to its output last: Dense's and Conv2D's `activation:`, an
  // Activation layer's function; linear for the other kinds.
  virtual config::Activation final_activation() const { return config::Activation::linear; }
  // The layer's options with that activation linear, for a kind whose final_activation() can be
  // another: the model's last layer is built from them where the model computes the activation as
  // a step of its own (ModelOptions::crossentropy_from_pre_activation).
  virtual config::LayerOptions options_without_final_activation() const;
  // Whether forward returns its input itself, in training and in inference: a linear Activation, a
  // dropout of rate 0 (Keras' return the very tensor they were given, so a softmax's output keeps
  // what Keras' crossentropies look for through them). A reshape or flatten is not: Keras' make a
  // new tensor.
  virtual bool returns_its_input() const { return false; }

  // The oracle: plain loops in double, obviously correct, what every backend's kernel is tested
  // against (and what is itself checked against finite differences).
  virtual void reference_forward(const ReferenceForward& io, const StepContext& step) const = 0;
  virtual void reference_backward(const ReferenceBackward& io, const StepContext& step) const = 0;

 protected:
  // Keras' initializers, as a declaration: materialize() runs them.
  struct Initializer {
    enum class Kind { zeros, ones, glorot_uniform } kind = Kind::zeros;
    std::int64_t fan_in = 0, fan_out = 0;  // glorot_uniform
    static Initializer zeros() { return {}; }
    static Initializer ones() { return {Kind::ones, 0, 0}; }
    static Initializer glorot_uniform(std::int64_t fan_in, std::int64_t fan_out) {
      return {Kind::glorot_uniform, fan_in, fan_out};
    }
  };
  // Checks the input shape, declares the variables (add_variable) and returns the output shape;
  // allocates nothing.
  virtual Shape build_layer(const Shape& input_shape) = 0;
  // Declares a variable; its memory comes with materialize(). Returns the variable's index in
  // variables(): references would not survive a later add.
  std::size_t add_variable(const std::string& weight, Shape shape, Initializer init = Initializer::zeros(),
                           bool trainable = true);
  // L2 penalty of variable `index` and its gradient: the kernel_regularizer of conv2d and dense.
  double l2_penalty(device::Numerics& numerics, std::size_t index, double l2) const;
  void add_l2_gradient(device::Numerics& numerics, std::size_t index, double l2, float scale);

 private:
  std::string name_;
  std::vector<Variable> vars_;
  struct Declared {
    Shape shape;
    Initializer init;
  };
  std::vector<Declared> declared_;  // vars_'s shapes and initializers, in declaration order
  bool materialized_ = false;
  Shape input_shape_, output_shape_;
  std::size_t position_ = 0;
};

}  // namespace dtrain::nn
