#include "nn/model.hpp"

#include <algorithm>
#include <chrono>
#include <optional>
#include <limits>

#include <fmt/format.h>

#include "config/parse.hpp"
#include "core/checked.hpp"
#include "core/error.hpp"
#include "core/machine.hpp"
#include "core/rng.hpp"
#include "nn/activation.hpp"
#include "nn/registry.hpp"

namespace dtrain::nn {

namespace {

using Clock = std::chrono::steady_clock;

// Adds the time since `since` to `into` once the context has finished the layer's work.
Clock::time_point lap(device::Context& ctx, double& into, Clock::time_point since) {
  ctx.synchronize();
  const auto now = Clock::now();
  into += std::chrono::duration<double>(now - since).count();
  return now;
}

// What a kernel's BackwardMarks::weights_done() does while the layers are timed.
class LayerMarks final : public BackwardMarks {
 public:
  LayerMarks(device::Context& ctx, LayerTimes& times) : ctx_(ctx), times_(times) {}
  void begin(std::size_t layer, Clock::time_point start) {
    layer_ = layer;
    start_ = start;
  }
  void weights_done() override {
    lap(ctx_, times_.backward_weights[layer_], start_);
    times_.split[layer_] = 1;
  }
  void input_done() override {
    input_seconds_ = 0.0;
    lap(ctx_, input_seconds_, start_);
    input_first_ = true;
    times_.split[layer_] = 1;
  }
  // The layer took `seconds` in all: where the input's gradient came first, the rest is the weights'.
  void end(double seconds) {
    if (input_first_) times_.backward_weights[layer_] += seconds - input_seconds_;
    input_first_ = false;
  }

 private:
  device::Context& ctx_;
  LayerTimes& times_;
  std::size_t layer_ = 0;
  Clock::time_point start_;
  bool input_first_ = false;
  double input_seconds_ = 0.0;
};

// Seconds this lane has waited so far in its replica's lane sums (0 with one lane).
double lane_waits(const StepContext& step) { return step.lanes ? step.lanes->waited_seconds() : 0.0; }

}  // namespace

DType compute_dtype(config::Precision precision) {
  switch (precision) {
    case config::Precision::float32: return DType::f32;
    case config::Precision::mixed_bfloat16: return DType::bf16;
  }
  throw InternalError("unknown precision policy");
}

void check_precision(config::Precision precision, const config::SourceLocation& where, const device::Context& ctx) {
  const std::string why = ctx.cannot_compute_in(compute_dtype(precision));
  if (why.empty()) return;
  throw ConfigError(fmt::format("{}precision {} cannot run on {}: {}; use precision: float32", config::location_prefix(where, {}),
                                config::name_of(precision), ctx.device().to_string(), why));
}

Sequential::Sequential(const config::ModelConfig& config, std::uint64_t seed, device::Context& ctx,
                       ModelOptions options)
    : ctx_(ctx), options_(options), input_shape_(config.input_shape) {
  if (config.layers.empty()) throw ConfigError("model: the model has no layers");
  Shape shape = input_shape_;
  std::int64_t parameter_bytes = 0;
  // The layer whose softmax or sigmoid the model may compute after the last layer: the last one,
  // or the last one before layers that return their input (ModelOptions::crossentropy_from_pre_activation).
  // Only the last layer computes in float32 under a bfloat16 policy, as Keras' advice for mixed
  // precision has it: there Keras' float32 last layer casts what a bfloat16 one below gives it, a
  // new tensor, and its crossentropy reads the probabilities (and a softmax below keeps its own
  // float32 in its layer).
  std::size_t activation_layer = config.layers.size();  // none
  if (options_.crossentropy_from_pre_activation) {
    activation_layer = config.layers.size() - 1;
    while (options_.compute == DType::f32 && activation_layer > 0) {
      std::unique_ptr<Layer> after;
      try {
        after = make_layer(config.layers[activation_layer]);
      } catch (const ConfigError&) {
        break;  // reported below, where the layer is built, at its place in the experiment
      }
      if (!after->returns_its_input()) break;
      --activation_layer;
    }
  }
  for (std::size_t i = 0; i < config.layers.size(); ++i) {
    // A layer that does not fit its input, or is too large for the machine, is reported at the
    // layer's place in the experiment file.
    const config::LayerConfig& where = config.layers[i];
    auto at_layer = [&](const std::string& what) {
      const std::string layer = fmt::format("layer '{}': ", where.name);
      return ConfigError(fmt::format("{}{}{}", config::location_prefix(where.where, {}),
                                     what.starts_with(layer) ? "" : layer, what));
    };
    try {
      auto layer = make_layer(where);
      const config::Activation last_activation = layer->final_activation();
      if (i == activation_layer &&
          (last_activation == config::Activation::softmax || last_activation == config::Activation::sigmoid)) {
        config::LayerConfig without = where;
        without.options = layer->options_without_final_activation();
        layer = make_layer(without);
        output_activation_ = last_activation;
        output_activation_from_ = i;
      }
      shape = layer->declare(i, shape);
      // Each output is held twice per example (activation and its gradient); each variable four
      // times (value, gradient, up to two optimizer slots).
      const auto activations = checked_mul(shape.numel(), 2 * 4);
      const auto sum = activations ? checked_add(activation_bytes_per_example_, *activations) : std::nullopt;
      parameter_bytes = checked_add(parameter_bytes, checked_mul(layer->declared_elements(), 4 * 4).value_or(-1))
                            .value_or(std::numeric_limits<std::int64_t>::max());
      const MemoryLimit limit = usable_memory();
      const std::int64_t memory = limit.bytes;
      if (!sum || *sum > memory || parameter_bytes < 0 || parameter_bytes > memory)
        throw ConfigError(fmt::format(
            "the model needs {} for its {} up to this layer, more than {}; make the layer smaller",
            !sum || *sum > memory ? format_bytes(sum.value_or(std::numeric_limits<std::int64_t>::max()))
                                              : format_bytes(parameter_bytes),
            !sum || *sum > memory ? "activations" : "parameters", describe(limit)));
      activation_bytes_per_example_ = *sum;
      layers_.push_back(std::move(layer));
      layer_where_.push_back(where.where);
    } catch (const ConfigError& e) {
      throw at_layer(e.what());
    }
  }
  output_shape_ = shape;
  if (output_activation_ != config::Activation::linear) {
    // The activation computed after the last layer holds its outputs, a gradient it is bound to
    // and, for a softmax, oneDNN's scratch for its derivative.
    const auto held = checked_mul(shape.numel(), 3 * 4);
    const auto sum = held ? checked_add(activation_bytes_per_example_, *held) : std::nullopt;
    activation_bytes_per_example_ = sum.value_or(std::numeric_limits<std::int64_t>::max());
  }
  if (options_.before_allocating) {
    options_.before_allocating(*this);
    options_.before_allocating = nullptr;  // the caller's state it saw is not kept
  }

  // Only now memory: each layer's variables from Rng(seed, init, layer index), in the order the
  // layer declared them.
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    try {
      Rng rng(seed, RngStream::init, i);
      if (!layers_[i]->materialize(rng, options_.should_stop))
        throw StoppedBeforeTraining(fmt::format("stopped by a signal while the model's variables were made (layer '{}'), "
                                                "before the first step: nothing was trained or saved",
                                                layers_[i]->name()));
    } catch (const std::bad_alloc&) {
      throw ConfigError(fmt::format("{}layer '{}': out of memory while building it; make the layer smaller",
                                    config::location_prefix(layer_where_[i], {}), layers_[i]->name()));
    }
  }

  // The variables move into the context's memory (they were initialized on the host, in the
  // same order whatever the device). One contiguous buffer there for every gradient, each
  // variable's grad a view into it.
  std::int64_t total = 0;
  for (auto& layer : layers_)
    for (Variable& v : layer->variables()) {
      v.value = ctx_.upload(v.value);
      total += v.value.numel();
    }
  gradients_ = ctx_.tensor(Shape{total});
  std::int64_t at = 0;
  for (auto& layer : layers_) {
    first_variable_.push_back(variables_.size());
    for (Variable& v : layer->variables()) {
      v.grad = gradients_.view(at, v.value.shape());
      at += v.value.numel();
      gradient_sizes_.push_back(static_cast<std::size_t>(v.value.numel()));
      variables_.push_back(&v);
      if (v.trainable) trainable_.push_back(&v);
    }
  }

  std::vector<Layer*> layers;
  for (auto& layer : layers_) layers.push_back(layer.get());
  std::vector<DType> compute(layers.size(), options_.compute);
  compute.back() = DType::f32;
  kernels_ = make_kernels(layers, ctx_, compute);
  if (output_activation_ != config::Activation::linear) {
    // Named as the layer whose activation it computes; its position follows the layers' (it has
    // no variables, so no random stream is drawn for it). The layers after that one return their
    // input: the activation of the last one's output is the activation of that layer's.
    output_activation_layer_ = std::make_unique<ActivationLayer>(layers_[output_activation_from_]->name(),
                                                                 ActivationLayer::Options{output_activation_});
    output_activation_layer_->declare(layers_.size(), output_shape_);
    Rng none(seed, RngStream::init, layers_.size());
    output_activation_layer_->materialize(none);
    Layer* const activation[] = {output_activation_layer_.get()};
    const DType f32[] = {DType::f32};
    output_activation_kernel_ = std::move(make_kernels(activation, ctx_, f32).front());
  }
  // A pooling that passes through shares its memories with the layer below, so it needs a layer
  // above it (the last layer's output is the model's output tensor).
  computed_in_.assign(kernels_.size(), std::nullopt);
  for (std::size_t i = 1; i + 1 < kernels_.size(); ++i) {
    const MaxPool2D* pool = kernels_[i]->max_pooling_to_offer();
    if (!pool) continue;
    const bool input_gradient = i > 1 || options_.input_gradient;
    if (kernels_[i - 1]->take_output_max_pooling(*pool, input_gradient)) {
      kernels_[i]->skip_pooling();
      computed_in_[i] = i - 1;
    } else if (i >= 2 && kernels_[i - 1]->standalone_activation() == config::Activation::relu &&
               kernels_[i - 2]->take_output_relu_and_max_pooling(*pool)) {
      kernels_[i]->skip_pooling();
      kernels_[i - 1]->skip_activation_forward();
      kernels_[i - 1]->skip_activation_backward();
      computed_in_[i] = i - 2;
    }
  }
  // What each layer reads of its input, told to the kernel that computes that input (a pooling
  // computed below is not a layer above it): from the top down, since what a kernel reads of its
  // input can depend on what the layer above reads of its output (LayerKernel::input_read_within).
  for (std::size_t i = kernels_.size(); i-- > 1;) {
    if (computed_in_[i]) continue;
    std::optional<Layer::InputExtent> read = layers_[i]->input_extent_read();
    if (!read) read = kernels_[i]->input_read_within();
    if (read) kernels_[computed_in_[i - 1].value_or(i - 1)]->output_read_within(read->rows, read->columns);
  }
  // A reshape above: the layer below writes its output canonical where it can (nn/kernel.hpp).
  for (std::size_t i = 1; i < kernels_.size(); ++i)
    if (kernels_[i]->wants_canonical_input()) kernels_[i - 1]->prefer_canonical_output();
  // An Activation's relu into the layer below, forward and, where that layer takes it too, the
  // derivative (nn/kernel.hpp: before the layer above is offered the derivative). One already in
  // a pooling's fusion passes its memories through.
  for (std::size_t i = 1; i < kernels_.size(); ++i) {
    const config::Activation own = kernels_[i]->standalone_activation();
    if (own == config::Activation::linear || kernels_[i]->forward_passes_through() ||
        !kernels_[i - 1]->take_output_activation(own))
      continue;
    kernels_[i]->skip_activation_forward();
    if (kernels_[i - 1]->take_output_activation_derivative(own)) kernels_[i]->skip_activation_backward();
  }
  // The lowest layer whose backward matters (backward_runs).
  if (!options_.input_gradient) {
    while (first_backward_ + 1 < layers_.size() && layers_[first_backward_]->variables().empty()) ++first_backward_;
    kernels_[first_backward_]->without_input_gradient();
  }
  derivative_above_.assign(kernels_.size(), false);
  for (std::size_t i = 1; i < kernels_.size(); ++i) {
    const config::Activation below = kernels_[i - 1]->output_activation();
    if (below != config::Activation::linear && !kernels_[i - 1]->gradient_passes_through() &&
        kernels_[i]->take_input_activation_backward(below)) {
      kernels_[i - 1]->skip_activation_backward();
      derivative_above_[i] = true;
    }
  }
}

std::int64_t Sequential::activation_bytes(std::int64_t batch) const {
  return checked_mul(batch, activation_bytes_per_example_).value_or(std::numeric_limits<std::int64_t>::max());
}

void Sequential::check_batch_memory(std::int64_t batch, const config::BatchKey& batch_key) const {
  const MemoryLimit memory = usable_memory();
  if (activation_bytes(batch) <= memory.bytes) return;
  const std::size_t largest = largest_activation_layer();
  const Layer& layer = *layers_[largest];
  const config::SourceLocation& at = layer_where_[largest];
  const std::string smaller = layer.size_option().empty() ? std::string("a smaller input to that layer")
                                                           : fmt::format("fewer {} in that layer", layer.size_option());
  throw ConfigError(fmt::format(
      "{}{} {}: a batch of {} on a replica needs {} of activations, more than {}; layer '{}'{} "
      "takes the most, {} per example: choose a smaller {}, or {}",
      batch_key.where, batch_key.name, batch_key.value, batch, format_bytes(activation_bytes(batch)),
      describe(memory), layer.name(),
      at.line > 0 ? fmt::format(" ({}:{}:{})", at.file, at.line, at.column) : std::string(),
      layer.output_shape().to_string(), batch_key.name, smaller));
}

std::int64_t Sequential::num_parameters() const {
  std::int64_t n = 0;
  for (const auto& layer : layers_) n += layer->declared_elements();
  return n;
}

std::size_t Sequential::largest_activation_layer() const {
  std::size_t largest = 0;
  for (std::size_t i = 1; i < layers_.size(); ++i)
    if (layers_[i]->output_shape().numel() > layers_[largest]->output_shape().numel()) largest = i;
  return largest;
}

std::size_t Sequential::largest_parameter_layer() const {
  std::size_t largest = 0;
  for (std::size_t i = 1; i < layers_.size(); ++i)
    if (layers_[i]->declared_elements() > layers_[largest]->declared_elements()) largest = i;
  return largest;
}

Sequential::Plan& Sequential::plan_for(std::int64_t batch) {
  auto it = plans_.find(batch);
  if (it != plans_.end()) return it->second;
  if (const MemoryLimit memory = usable_memory(); activation_bytes(batch) > memory.bytes)
    throw ConfigError(fmt::format("a batch of {} needs {} of activations, more than {}; choose a smaller "
                                  "data.batch_size_per_replica, global_batch_size or eval_batch_size",
                                  batch, format_bytes(activation_bytes(batch)), describe(memory)));
  Plan& p = plans_[batch];
  p.batch = batch;
  p.input = ctx_.movable_memory(ctx_.canonical_layout(input_shape_.with_batch(batch), DType::f32));
  device::Memory input_diff;
  if (options_.input_gradient) {
    p.input_grad = ctx_.tensor(input_shape_.with_batch(batch));
    input_diff = device::Memory{p.input.layout, p.input_grad.raw()};
  }

  std::vector<device::LayoutPtr> layouts;
  device::LayoutPtr layout = p.input.layout;
  for (auto& kernel : kernels_) {
    layout = kernel->plan(batch, layout);
    layouts.push_back(layout);
  }
  // The last layer writes straight into the canonical output tensor when its layout is the
  // canonical one (the usual case for a final Dense); otherwise one copy at each end.
  p.output = ctx_.tensor(output_shape_.with_batch(batch));
  p.output_grad = ctx_.tensor(output_shape_.with_batch(batch));
  const device::LayoutPtr out_canonical = ctx_.canonical_layout(output_shape_.with_batch(batch), DType::f32);
  for (std::size_t i = 0; i < kernels_.size(); ++i) {
    const bool last = i + 1 == kernels_.size();
    if (last && layouts[i]->same_as(*out_canonical)) {
      p.act.push_back({layouts[i], p.output.raw()});
      p.diff.push_back({layouts[i], p.output_grad.raw()});
    } else {
      // An identity forward (or backward) shares the memory of the layer below's output (or its
      // gradient): nothing to move (LayerKernel::forward_passes_through, gradient_passes_through),
      // also where the output is the input's bytes as another shape (reinterprets_input).
      const bool same =
          !last && i > 0 && (layouts[i]->same_as(*layouts[i - 1]) || kernels_[i]->reinterprets_input());
      const auto own = [&] {
        p.buffers.push_back(ctx_.allocate(layouts[i]->bytes()));
        return p.buffers.back().get();
      };
      p.act.push_back({layouts[i], same && kernels_[i]->forward_passes_through() ? p.act[i - 1].data : own()});
      // The gradient over the output it belongs to, where the layer above writes it so and nothing
      // else reads that output in backward (LayerKernel::writes_input_gradient_over_input).
      const bool own_output = !(same && kernels_[i]->forward_passes_through());
      const bool passes_gradient = same && kernels_[i]->gradient_passes_through();
      const bool over_output = !last && own_output && !passes_gradient && i + 1 > first_backward_ &&
                               !kernels_[i]->backward_reads_output() &&
                               kernels_[i + 1]->writes_input_gradient_over_input(batch);
      if (over_output) p.diff.push_back({layouts[i], p.act[i].data});
      else p.diff.push_back({layouts[i], passes_gradient ? p.diff[i - 1].data : own()});
    }
  }
  p.output_out = ctx_.make_copy(p.act.back(), {out_canonical, p.output.raw()});
  p.grad_in = ctx_.make_copy({out_canonical, p.output_grad.raw()}, p.diff.back());
  if (output_activation_kernel_) {
    // Forward only: the loss gives the gradient of its input, so this kernel's backward never
    // runs (its output gradient is a scratch buffer it is bound to, and it has no input gradient).
    const device::LayoutPtr activated = output_activation_kernel_->plan(batch, out_canonical);
    DTRAIN_CHECK(activated->same_as(*out_canonical), "the output activation changed the output's layout");
    p.activated = ctx_.tensor(output_shape_.with_batch(batch));
    p.buffers.push_back(ctx_.allocate(out_canonical->bytes()));
    LayerIO io;
    io.src = {out_canonical, p.output.raw()};
    io.dst = {out_canonical, p.activated.raw()};
    io.diff_dst = {out_canonical, p.buffers.back().get()};
    output_activation_kernel_->bind(batch, io);
  }

  for (std::size_t i = 0; i < kernels_.size(); ++i) {
    LayerIO io;
    io.src = i == 0 ? p.input : p.act[i - 1];
    io.dst = p.act[i];
    io.diff_dst = p.diff[i];
    // No input gradient for the lowest layer whose backward runs, unless the model wants its own.
    io.diff_src = i > first_backward_ ? p.diff[i - 1] : input_diff;
    kernels_[i]->bind(batch, io);
  }
  return p;
}

const Tensor& Sequential::forward(const Tensor& x, const StepContext& step) {
  // Compared in place: Shape::tail() would allocate on every step.
  bool fits = x.shape().rank() == input_shape_.rank() + 1 && x.dtype() == DType::f32;
  for (std::size_t i = 0; fits && i < input_shape_.rank(); ++i) fits = x.shape()[i + 1] == input_shape_[i];
  DTRAIN_CHECK(fits, fmt::format("model input {} does not match the model's input shape {}", x.shape().to_string(),
                                 input_shape_.to_string()));
  // The seam: a context whose memory the host cannot read runs on its own memory only (a batch
  // is staged there with its copies first).
  DTRAIN_CHECK(ctx_.host_accessible() || !x.host_accessible(),
               fmt::format("model input {} is host memory, but {}'s kernels read their own memory: stage it with the "
                           "context's copy_from_host()", x.shape().to_string(), ctx_.device().to_string()));
  const std::int64_t batch = x.shape()[0];
  Plan& p = plan_for(batch);
  // Kernels only read through the input; the const_cast does not write.
  ctx_.set_address(p.input, const_cast<void*>(x.raw()));
  if (times_) {
    auto t = Clock::now();
    for (std::size_t i = 0; i < kernels_.size(); ++i) {
      const double waited = lane_waits(step);
      kernels_[i]->forward(batch, step);
      t = lap(ctx_, times_->forward[i], t);
      times_->forward_waits[i] += lane_waits(step) - waited;
    }
  } else {
    for (auto& kernel : kernels_) kernel->forward(batch, step);
  }
  if (p.output_out) p.output_out->run();
  if (output_activation_kernel_) {
    const auto t = times_ ? Clock::now() : Clock::time_point{};
    output_activation_kernel_->forward(batch, step);
    if (times_) lap(ctx_, times_->forward[output_activation_from_], t);  // counted with the layer it came from
  }
  wait_for_host();
  current_ = &p;
  return output_activation_kernel_ ? p.activated : p.output;
}

const Tensor& Sequential::loss_input() const {
  DTRAIN_CHECK(current_ != nullptr, "loss_input() before forward()");
  return current_->output;
}

Tensor& Sequential::output_gradient() {
  DTRAIN_CHECK(current_ != nullptr, "output_gradient() before forward()");
  return current_->output_grad;
}

void Sequential::backward(const StepContext& step, const BackwardOptions& options) {
  DTRAIN_CHECK(current_ != nullptr, "backward() before forward()");
  Plan& p = *current_;
  if (p.grad_in) p.grad_in->run();
  auto t = times_ ? Clock::now() : Clock::time_point{};
  // Timed, the kernels get a step context that carries the mark between their two gradients.
  std::optional<LayerMarks> marks;
  std::optional<StepContext> marked;
  if (times_) {
    marks.emplace(ctx_, *times_);
    marked.emplace(step);
    marked->backward_marks = &*marks;
  }
  for (std::size_t i = layers_.size(); i-- > first_backward_;) {
    Layer& layer = *layers_[i];
    if (marks) marks->begin(i, t);
    const double waited = times_ ? lane_waits(step) : 0.0;
    kernels_[i]->backward(p.batch, marked ? *marked : step);
    if (!layer.variables().empty()) {
      // No wait here: the regularization's numerics and whatever the hand-over queues (a staging
      // copy, a collective on device memory) run on the context's stream after the kernel, and a
      // host-memory sum reads the grads in place only where the context computes synchronously
      // (the CPU backend).
      if (options.regularization_scale != 0.0f)
        layer.add_regularization_gradient(ctx_.numerics(), options.regularization_scale);
      if (options.gradients_ready) (*options.gradients_ready)(first_variable_[i], layer.variables().size());
    }
    if (times_) {
      const double before = times_->backward[i];
      t = lap(ctx_, times_->backward[i], t);
      marks->end(times_->backward[i] - before);
      times_->backward_waits[i] += lane_waits(step) - waited;
    }
  }
  wait_for_host();
}

void Sequential::step_without_samples(const StepContext& step) {
  ctx_.zero(gradients_);
  for (auto& kernel : kernels_) kernel->forward_without_samples(step);
  // As backward(): the layers below the lowest one whose backward runs make no collective there.
  for (std::size_t i = kernels_.size(); i-- > first_backward_;) kernels_[i]->backward_without_samples(step);
  wait_for_host();
}

void Sequential::wait_for_host() {
  // Where the host reads the model's memory in place (the CPU backend), the work must be done
  // when a pass returns. Elsewhere the host reads it only through the context's copies, which
  // wait for the stream themselves, and what comes next on this memory (the loss, backward, the
  // update, a collective) is queued behind the pass on the same stream: a wait here would only
  // stall the host between launches (a GPU step waited twice for its stream here).
  if (ctx_.host_accessible()) ctx_.synchronize();
}

const Tensor& Sequential::input_gradient() const {
  DTRAIN_CHECK(options_.input_gradient && current_ != nullptr,
               "input_gradient() needs input_gradient=true and a backward()");
  return current_->input_grad;
}

double Sequential::regularization_loss() const {
  double sum = 0.0;
  for (const auto& layer : layers_) sum += layer->regularization_loss(ctx_.numerics());
  return sum;
}

void Sequential::add_regularization_gradient(float scale) {
  for (auto& layer : layers_) layer->add_regularization_gradient(ctx_.numerics(), scale);
}

void Sequential::apply_updates() {
  for (auto& layer : layers_) layer->apply_updates(ctx_.numerics());
}

bool Sequential::synchronizes_replicas() const {
  for (const auto& layer : layers_)
    if (layer->synchronizes_replicas()) return true;
  return false;
}

void Sequential::time_layers(LayerTimes* times) {
  times_ = times;
  if (!times_) return;
  times_->forward.resize(layers_.size(), 0.0);
  times_->backward.resize(layers_.size(), 0.0);
  times_->backward_weights.resize(layers_.size(), 0.0);
  times_->forward_waits.resize(layers_.size(), 0.0);
  times_->backward_waits.resize(layers_.size(), 0.0);
  times_->split.resize(layers_.size(), 0);
}

std::string Sequential::summary() const {
  std::size_t name_width = 24, kind_width = 16;
  for (const auto& layer : layers_) {
    name_width = std::max(name_width, layer->name().size() + 2);
    kind_width = std::max(kind_width, layer->kind().size() + 2);
  }
  std::string s = fmt::format("{:<{}}{:<{}}{:<22}{:>10}\n", "Layer", name_width, "Kind", kind_width, "Output shape",
                              "Params");
  for (const auto& layer : layers_) {
    const std::int64_t params = layer->declared_elements();
    s += fmt::format("{:<{}}{:<{}}{:<22}{:>10}\n", layer->name(), name_width, layer->kind(), kind_width,
                     layer->output_shape().with_batch(-1).to_string().replace(1, 2, "None"), params);
  }
  s += fmt::format("Total params: {}\n", num_parameters());
  return s;
}

}  // namespace dtrain::nn
