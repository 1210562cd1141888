#include "nn/model.hpp"

#include <fmt/format.h>

#include "core/error.hpp"
#include "core/rng.hpp"

namespace dtrain::nn {

using dnnl::memory;
namespace cpu = kernels::cpu;

Sequential::Sequential(const config::ModelConfig& config, std::uint64_t seed, bool input_gradient)
    : input_shape_(config.input_shape), input_gradient_(input_gradient) {
  if (config.layers.empty()) throw ConfigError("model: the model has no layers");
  Shape shape = input_shape_;
  for (std::size_t i = 0; i < config.layers.size(); ++i) {
    auto layer = make_layer(config.layers[i]);
    Rng rng(seed, RngStream::init, i);
    shape = layer->build(shape, rng);
    layer_output_shapes_.push_back(shape);
    layers_.push_back(std::move(layer));
  }
  output_shape_ = shape;
  for (auto& layer : layers_) {
    first_variable_.push_back(variables_.size());
    for (auto& v : layer->variables()) variables_.push_back(&v);
  }
  // Before any plan binds a grad's memory: from here on the grads live in the arena.
  std::int64_t total = 0;
  for (const Variable* v : variables_) total += v->value.numel();
  gradient_arena_ = Tensor(Shape{total});
  std::int64_t at = 0;
  for (Variable* v : variables_) {
    v->grad = gradient_arena_.view(at, v->value.shape());
    gradient_sizes_.push_back(static_cast<std::size_t>(v->value.numel()));
    at += v->value.numel();
  }
}

std::int64_t Sequential::num_parameters() const {
  std::int64_t n = 0;
  for (const Variable* v : variables_) n += v->value.numel();
  return n;
}

Sequential::Plan& Sequential::plan_for(Context& ctx, std::int64_t batch) {
  auto it = plans_.find(batch);
  if (it != plans_.end()) return it->second;
  Plan& p = plans_[batch];
  p.batch = batch;
  const memory::desc input_md = cpu::canonical_md(input_shape_.with_batch(batch));
  p.input = memory(input_md, ctx.engine, DNNL_MEMORY_NONE);
  if (input_gradient_) {
    p.input_grad = Tensor(input_shape_.with_batch(batch));
    p.input_diff = cpu::wrap(ctx, input_md, p.input_grad.raw());
  }

  std::vector<memory::desc> out_mds;
  memory::desc md = input_md;
  for (auto& layer : layers_) {
    md = layer->plan(ctx, md);
    out_mds.push_back(md);
  }
  // The last layer writes straight into the canonical output tensor when its layout is the
  // canonical one (the usual case for a final Dense); otherwise one reorder at each end.
  p.output = Tensor(output_shape_.with_batch(batch));
  p.output_grad = Tensor(output_shape_.with_batch(batch));
  const memory::desc out_canonical = cpu::canonical_md(output_shape_.with_batch(batch));
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    const bool last = i + 1 == layers_.size();
    if (last && out_mds[i] == out_canonical) {
      p.act.push_back(cpu::wrap(ctx, out_canonical, p.output.raw()));
      p.diff.push_back(cpu::wrap(ctx, out_canonical, p.output_grad.raw()));
    } else {
      p.act.emplace_back(out_mds[i], ctx.engine);
      p.diff.emplace_back(out_mds[i], ctx.engine);
    }
  }
  p.output_out.bind(ctx, p.act.back(), cpu::wrap(ctx, out_canonical, p.output.raw()));
  p.grad_in.bind(ctx, cpu::wrap(ctx, out_canonical, p.output_grad.raw()), p.diff.back());

  for (std::size_t i = 0; i < layers_.size(); ++i) {
    LayerIO io;
    io.src = i == 0 ? p.input : p.act[i - 1];
    io.dst = p.act[i];
    io.diff_dst = p.diff[i];
    io.diff_src = i > 0 ? p.diff[i - 1] : p.input_diff;
    layers_[i]->bind(ctx, batch, io);
  }
  return p;
}

const Tensor& Sequential::forward(Context& ctx, const Tensor& x) {
  // Compared in place: Shape::tail() would allocate on every step.
  bool fits = x.shape().rank() == input_shape_.rank() + 1;
  for (std::size_t i = 0; fits && i < input_shape_.rank(); ++i) fits = x.shape()[i + 1] == input_shape_[i];
  DTRAIN_CHECK(fits, fmt::format("model input {} does not match the model's input shape {}", x.shape().to_string(),
                                 input_shape_.to_string()));
  Plan& p = plan_for(ctx, x.shape()[0]);
  // oneDNN only reads through this handle; the const_cast does not write.
  p.input.set_data_handle(const_cast<void*>(x.raw()));
  for (auto& layer : layers_) layer->forward(ctx, p.batch);
  p.output_out.run(ctx);
  ctx.stream.wait();
  current_ = &p;
  return p.output;
}

Tensor& Sequential::output_gradient() {
  DTRAIN_CHECK(current_ != nullptr, "output_gradient() before forward()");
  return current_->output_grad;
}

void Sequential::backward(Context& ctx, const BackwardOptions& options) {
  DTRAIN_CHECK(current_ != nullptr, "backward() before forward()");
  Plan& p = *current_;
  p.grad_in.run(ctx);
  for (std::size_t i = layers_.size(); i-- > 0;) {
    Layer& layer = *layers_[i];
    layer.backward(ctx, p.batch);
    if (layer.variables().empty()) continue;
    if (options.regularization_scale != 0.0f || options.gradients_ready) ctx.stream.wait();  // the grads are written
    if (options.regularization_scale != 0.0f) layer.add_regularization_gradient(options.regularization_scale);
    if (options.gradients_ready) (*options.gradients_ready)(first_variable_[i], layer.variables().size());
  }
  ctx.stream.wait();
}

const Tensor& Sequential::input_gradient() const {
  DTRAIN_CHECK(input_gradient_ && current_ != nullptr, "input_gradient() needs input_gradient=true and a backward()");
  return current_->input_grad;
}

double Sequential::regularization_loss() const {
  double sum = 0.0;
  for (const auto& layer : layers_) sum += layer->regularization_loss();
  return sum;
}

void Sequential::add_regularization_gradient(float scale) {
  for (auto& layer : layers_) layer->add_regularization_gradient(scale);
}

void Sequential::share_variable_values(const Sequential& other) {
  DTRAIN_CHECK(plans_.empty(), "share_variable_values() after the model was planned");
  DTRAIN_CHECK(other.variables_.size() == variables_.size(), "models with different variables");
  for (std::size_t i = 0; i < variables_.size(); ++i) {
    DTRAIN_CHECK(other.variables_[i]->value.shape() == variables_[i]->value.shape(), "variable shapes differ");
    variables_[i]->value = other.variables_[i]->value;
  }
}

std::string Sequential::summary() const {
  std::string s = fmt::format("{:<24}{:<16}{:<22}{:>10}\n", "Layer", "Kind", "Output shape", "Params");
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    std::int64_t params = 0;
    for (const auto& v : layers_[i]->variables()) params += v.value.numel();
    s += fmt::format("{:<24}{:<16}{:<22}{:>10}\n", layers_[i]->name(), layers_[i]->kind(),
                     layer_output_shapes_[i].with_batch(-1).to_string().replace(1, 2, "None"), params);
  }
  s += fmt::format("Total params: {}\n", num_parameters());
  return s;
}

}  // namespace dtrain::nn
