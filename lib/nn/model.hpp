// Sequential: the layers of an experiment's model, run on one replica's context.
//
// The model builds its layers (backend-neutral) and asks the context's backend for their kernels.
// It owns the memories between layers, one set per batch size (the short last batch of an epoch
// gets its own), created on the first step of that size: later steps allocate nothing. Inputs and
// outputs cross the boundary as canonical f32 tensors (channels last); in between, each kernel
// produces the layout and dtype its backend picked for it.
//
// All of a model's gradients live in one contiguous f32 buffer, in variables() order: the
// strategies sum them across replicas and workers as one array (packs are ranges of it).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "device/context.hpp"
#include "config/experiment.hpp"
#include "config/parse.hpp"
#include "core/tensor.hpp"
#include "core/variable.hpp"
#include "nn/kernel.hpp"
#include "nn/layer.hpp"
#include "nn/step.hpp"

namespace dtrain::nn {

struct ModelOptions {
  // The dtype the layers compute in (config::Precision); the variables stay f32. The last layer
  // computes in f32 whatever this says (Keras' advice for mixed precision: the model's outputs,
  // a softmax on them and the loss in float32), and layers a backend computes in plain loops
  // (dropout, batch normalization on the CPU) may compute in f32 too.
  DType compute = DType::f32;
  // Also compute d(loss)/d(input) (tests and tools; training does not need it).
  bool input_gradient = false;
  // Called once every layer is declared and before anything is allocated: where a caller that
  // knows how many copies a run makes (replicas, lanes, optimizer slots) refuses a run the machine
  // cannot hold (ConfigError), from shapes alone.
  std::function<void(const class Sequential&)> before_allocating = nullptr;
  // Asked between variables while they are allocated and initialized (a large model takes a
  // while): true ends the construction with StoppedBeforeTraining.
  std::function<bool()> should_stop = nullptr;
  // Where the last layer ends in a softmax or a sigmoid (Layer::final_activation; or the last one
  // before layers that return their input, Layer::returns_its_input), that layer is built without
  // it and the model computes it as a step of its own after the last layer, so that a crossentropy
  // can read the activation's input, as Keras 3's crossentropies read the input of a Keras softmax
  // or sigmoid that made their predictions (output_activation, loss_input).
  bool crossentropy_from_pre_activation = false;
};

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

// Seconds each layer's kernel took, added up while attached to a model (dtrain bench): forward[i]
// and backward[i] for layer i (backward includes handing its gradients over). The model then
// synchronizes its context after every layer to read the clock; with none attached it reads no
// clock at all. A kernel that marks the end of one of its two gradients (nn::BackwardMarks) has
// split[i] set and backward_weights[i], the weights' part of backward[i]: before the mark, or
// after it where the input's gradient came first.
// forward_waits[i] and backward_waits[i]: the part of forward[i] and backward[i] the lane spent
// waiting for the replica's other lanes in the layer's sums (StepContext::lanes' waited_seconds).
struct LayerTimes {
  std::vector<double> forward, backward, backward_weights;
  std::vector<double> forward_waits, backward_waits;
  std::vector<char> split;
};

// The compute dtype of a precision policy.
DType compute_dtype(config::Precision precision);
// ConfigError at `where` (the experiment's precision key) when `ctx`'s device cannot compute in
// the policy's dtype, saying why and what to choose instead.
void check_precision(config::Precision precision, const config::SourceLocation& where, const device::Context& ctx);

class Sequential {
 public:
  // Builds every layer, initializes the variables from Rng(seed, RngStream::init, layer index) and
  // makes the layers' kernels on `ctx` (ConfigError when its backend lacks one).
  Sequential(const config::ModelConfig& config, std::uint64_t seed, device::Context& ctx, ModelOptions options = {});

  const Shape& input_shape() const { return input_shape_; }   // per example
  const Shape& output_shape() const { return output_shape_; } // per example
  std::size_t num_layers() const { return layers_.size(); }
  Layer& layer(std::size_t i) { return *layers_[i]; }
  const Layer& layer(std::size_t i) const { return *layers_[i]; }
  device::Context& context() const { return ctx_; }
  // Every variable of every layer, in layer order; the pointers stay valid for the model's life.
  const std::vector<Variable*>& variables() const { return variables_; }
  // The ones the optimizer trains, in the same order.
  const std::vector<Variable*>& trainable_variables() const { return trainable_; }
  std::int64_t num_parameters() const;
  // The bytes a batch of `batch` examples needs for activations and their gradients (the largest
  // int64 when that overflows); forward refuses batches the machine cannot hold.
  std::int64_t activation_bytes(std::int64_t batch) const;
  // ConfigError when a batch of `batch` examples on one replica needs more activation memory than
  // this machine has, naming both keys that decide it: `batch_key` (where it was given) and the
  // layer whose outputs take the most, at its place in the experiment with the option that sizes
  // them (filters, units).
  void check_batch_memory(std::int64_t batch, const config::BatchKey& batch_key) const;
  // Every variable's grad, contiguous, in variables() order (memory of the model's context), and
  // how many floats each takes.
  Tensor& gradient_arena() { return gradients_; }
  std::span<const std::size_t> gradient_sizes() const { return gradient_sizes_; }

  // x: (N, input_shape...) f32, canonical, in the context's memory (staged there by the caller),
  // kept alive and unchanged by the caller until backward() (kernels read it again there).
  // Returns y: (N, output_shape...) f32, canonical, in the context's memory, valid until the next
  // forward. The pass may still be running where the host cannot read the context's memory in
  // place: the context's copies (and whatever is queued on it next) come after it.
  const Tensor& forward(const Tensor& x, const StepContext& step);
  // The softmax or sigmoid the model computes after its last layer (ModelOptions::
  // crossentropy_from_pre_activation), linear where it computes none.
  config::Activation output_activation() const { return output_activation_; }
  // The layer whose activation that is (meaningful where output_activation() is not linear).
  std::size_t output_activation_from() const { return output_activation_from_; }
  // The Activation layer that computes it (its shapes, its FLOPs), null where the model computes none.
  const Layer* output_activation_layer() const { return output_activation_layer_.get(); }
  // What the loss reads of the last forward: y's pre-activation (N, output_shape...) where the model
  // computes an output_activation(), else y itself.
  const Tensor& loss_input() const;
  // The buffer (in the context's memory) the caller fills with d(loss)/d(loss_input()) for the
  // last forward's batch, then backward().
  Tensor& output_gradient();
  // Overwrites every variable's grad (trainable: d(loss)/d(variable); not trainable: the step's
  // update contribution).
  void backward(const StepContext& step, const BackwardOptions& options = {});
  // A replica with no samples this step: its grads are zeroed, and layers that sum over the
  // replicas take part in their collectives (forward order, then backward order).
  void step_without_samples(const StepContext& step);
  // d(loss)/d(x) of the last backward; only with input_gradient.
  const Tensor& input_gradient() const;

  double regularization_loss() const;
  void add_regularization_gradient(float scale);
  // After the step's gradients were summed over the replicas, where the variables live: folds the
  // summed contributions into the non-trainable variables (moving statistics).
  void apply_updates();
  // Whether some layer sums over the replicas during training (synchronized batch normalization).
  bool synchronizes_replicas() const;

  // Whether layer i is a pooling a layer below computes with its own output (LayerKernel::
  // take_output_max_pooling, take_output_relu_and_max_pooling): its own kernel computes nothing.
  bool computed_by_layer_below(std::size_t i) const { return computed_in_[i].has_value(); }
  // The bytes of layer i's output at `batch` in the layout its kernel picked (planning that batch
  // if it was not): blocked layouts pad their channels.
  std::size_t output_bytes(std::int64_t batch, std::size_t i) { return plan_for(batch).act.at(i).layout->bytes(); }
  // The layer that computes layer i (computed_by_layer_below): the one below it, or below the relu
  // Activation between them (LayerKernel::take_output_relu_and_max_pooling).
  std::size_t computing_layer(std::size_t i) const { return computed_in_[i].value(); }
  // Whether layer i's backward applies the derivative of layer i - 1's activation (LayerKernel::
  // take_input_activation_backward), and whether layer i's backward then moves nothing (an
  // Activation layer whose derivative the layer above applies: LayerKernel::gradient_passes_through).
  bool applies_activation_backward_below(std::size_t i) const { return derivative_above_[i]; }
  bool backward_moves_nothing(std::size_t i) const { return kernels_[i]->gradient_passes_through(); }
  // Whether, at `batch` (planning it if it was not), layer i + 1's backward writes the gradient of
  // layer i's output over that output (LayerKernel::writes_input_gradient_over_input).
  bool gradient_over_output(std::int64_t batch, std::size_t i) {
    const Plan& p = plan_for(batch);
    return p.diff.at(i).data == p.act.at(i).data;
  }
  // Whether layer i's forward moves nothing (an Activation layer whose relu the layer below applies:
  // LayerKernel::forward_passes_through; a pooling the layer below computes).
  bool forward_moves_nothing(std::size_t i) const { return kernels_[i]->forward_passes_through(); }
  // Whether layer i's backward runs, and whether it computes its input's gradient. Without the
  // model's input gradient, the layers below the lowest layer with variables (a flatten, a pooling,
  // a dropout under the first dense layer) feed no gradient anything uses: their backward is left
  // out, and so is that layer's input gradient.
  bool backward_runs(std::size_t i) const { return i >= first_backward_; }
  bool computes_input_gradient(std::size_t i) const { return i > first_backward_ || (i == 0 && options_.input_gradient); }

  // Attaches `times` (sized to the layers here) or, with null, detaches it.
  void time_layers(LayerTimes* times);

  // A Keras-like summary: one line per layer with its output shape and parameter count.
  std::string summary() const;
  // The layer whose outputs take the most memory per example, and the one with the most
  // parameters (indices into layer()); their places in the experiment.
  std::size_t largest_activation_layer() const;
  std::size_t largest_parameter_layer() const;
  const config::SourceLocation& layer_where(std::size_t i) const { return layer_where_[i]; }

 private:
  struct Plan {
    std::int64_t batch = 0;
    device::Memory input;                 // repointed at the caller's x each step
    std::vector<device::Buffer> buffers;  // keep act/diff memories alive
    std::vector<device::Memory> act;      // act[i] = output of layer i
    std::vector<device::Memory> diff;     // diff[i] = gradient wrt act[i]
    Tensor output, output_grad, input_grad;
    Tensor activated;  // output_activation() of output, where the model computes one
    std::unique_ptr<device::Copy> output_out, grad_in;
  };
  Plan& plan_for(std::int64_t batch);
  // The end of a pass: waits for the context only where the host reads its memory in place.
  void wait_for_host();

  device::Context& ctx_;
  ModelOptions options_;
  Shape input_shape_, output_shape_;
  std::int64_t activation_bytes_per_example_ = 0;  // activations and their gradients, bytes
  std::vector<std::unique_ptr<Layer>> layers_;
  std::vector<config::SourceLocation> layer_where_;  // each layer's place in the experiment
  std::vector<std::unique_ptr<LayerKernel>> kernels_;
  config::Activation output_activation_ = config::Activation::linear;
  std::size_t output_activation_from_ = 0;
  std::unique_ptr<Layer> output_activation_layer_;  // an Activation layer computing it, outside layers_
  std::unique_ptr<LayerKernel> output_activation_kernel_;
  std::vector<std::optional<std::size_t>> computed_in_;  // per layer: computing_layer, if any
  std::vector<bool> derivative_above_;  // per layer: applies_activation_backward_below
  std::vector<Variable*> variables_, trainable_;
  std::vector<std::size_t> first_variable_;  // of each layer, in variables_
  std::size_t first_backward_ = 0;             // the lowest layer whose backward runs (backward_runs)
  Tensor gradients_;
  std::vector<std::size_t> gradient_sizes_;
  std::map<std::int64_t, Plan> plans_;
  Plan* current_ = nullptr;
  LayerTimes* times_ = nullptr;
};

}  // namespace dtrain::nn
