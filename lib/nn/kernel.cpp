#include "nn/kernel.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "config/layers.hpp"

namespace dtrain::nn {

namespace {

struct Registered {
  std::string_view backend, kind;
  KernelFactory factory;
};

// Filled by the backends' kernel files before main, read-only afterwards.
std::vector<Registered>& kernels() {
  static std::vector<Registered> registered;
  return registered;
}

KernelFactory find(std::string_view backend, std::string_view kind) {
  for (const Registered& r : kernels())
    if (r.backend == backend && r.kind == kind) return r.factory;
  return nullptr;
}

// Each call of a kernel is a call into its backend (device::Context::Call): the memory of a
// checked context is open only while one runs. Where the backend does not check, the scope costs
// two empty virtual calls.
class CallScoped final : public LayerKernel {
 public:
  CallScoped(std::unique_ptr<LayerKernel> inner, device::Context& ctx) : inner_(std::move(inner)), ctx_(ctx) {}
  device::LayoutPtr plan(std::int64_t batch, const device::LayoutPtr& src) override {
    device::Context::Call call(ctx_);
    return inner_->plan(batch, src);
  }
  void bind(std::int64_t batch, const LayerIO& io) override {
    device::Context::Call call(ctx_);
    inner_->bind(batch, io);
  }
  void forward(std::int64_t batch, const StepContext& step) override {
    device::Context::Call call(ctx_);
    inner_->forward(batch, step);
  }
  void backward(std::int64_t batch, const StepContext& step) override {
    device::Context::Call call(ctx_);
    inner_->backward(batch, step);
  }
  void forward_without_samples(const StepContext& step) override {
    device::Context::Call call(ctx_);
    inner_->forward_without_samples(step);
  }
  void backward_without_samples(const StepContext& step) override {
    device::Context::Call call(ctx_);
    inner_->backward_without_samples(step);
  }
  const MaxPool2D* max_pooling_to_offer() const override { return inner_->max_pooling_to_offer(); }
  bool take_output_max_pooling(const MaxPool2D& pool, bool input_gradient) override {
    return inner_->take_output_max_pooling(pool, input_gradient);
  }
  void skip_pooling() override { inner_->skip_pooling(); }
  bool take_output_relu_and_max_pooling(const MaxPool2D& pool) override {
    return inner_->take_output_relu_and_max_pooling(pool);
  }
  void without_input_gradient() override { inner_->without_input_gradient(); }
  void output_read_within(std::int64_t rows, std::int64_t columns) override {
    inner_->output_read_within(rows, columns);
  }
  std::optional<Layer::InputExtent> input_read_within() const override { return inner_->input_read_within(); }
  bool wants_canonical_input() const override { return inner_->wants_canonical_input(); }
  void prefer_canonical_output() override { inner_->prefer_canonical_output(); }
  bool reinterprets_input() const override { return inner_->reinterprets_input(); }
  config::Activation output_activation() const override { return inner_->output_activation(); }
  bool take_input_activation_backward(config::Activation a) override { return inner_->take_input_activation_backward(a); }
  void skip_activation_backward() override { inner_->skip_activation_backward(); }
  bool gradient_passes_through() const override { return inner_->gradient_passes_through(); }
  config::Activation standalone_activation() const override { return inner_->standalone_activation(); }
  bool take_output_activation(config::Activation a) override { return inner_->take_output_activation(a); }
  bool take_output_activation_derivative(config::Activation a) override {
    return inner_->take_output_activation_derivative(a);
  }
  void skip_activation_forward() override { inner_->skip_activation_forward(); }
  bool forward_passes_through() const override { return inner_->forward_passes_through(); }
  bool writes_input_gradient_over_input(std::int64_t batch) const override {
    return inner_->writes_input_gradient_over_input(batch);
  }
  bool backward_reads_output() const override { return inner_->backward_reads_output(); }

 private:
  std::unique_ptr<LayerKernel> inner_;
  device::Context& ctx_;
};

}  // namespace

void register_kernel(std::string_view backend, std::string_view layer_kind, KernelFactory factory) {
  DTRAIN_CHECK(find(backend, layer_kind) == nullptr,
               fmt::format("two {} kernels registered for layer kind {}", backend, layer_kind));
  kernels().push_back({backend, layer_kind, factory});
}

std::vector<std::unique_ptr<LayerKernel>> make_kernels(std::span<Layer* const> layers, device::Context& ctx,
                                                       std::span<const DType> compute) {
  DTRAIN_CHECK(compute.size() == layers.size(), "one compute dtype per layer");
  std::vector<std::string_view> missing;
  for (const Layer* layer : layers)
    if (!find(ctx.backend(), layer->kind()) &&
        std::find(missing.begin(), missing.end(), layer->kind()) == missing.end())
      missing.push_back(layer->kind());
  if (!missing.empty())
    throw ConfigError(fmt::format("device {}: the {} backend has no kernels for the layer kinds {} that this model "
                                  "uses; run it on another device",
                                  ctx.device().to_string(), ctx.backend(), config::join(missing)));
  std::vector<std::unique_ptr<LayerKernel>> out;
  for (std::size_t i = 0; i < layers.size(); ++i)
    out.push_back(std::make_unique<CallScoped>(find(ctx.backend(), layers[i]->kind())(*layers[i], ctx, compute[i]), ctx));
  return out;
}

std::vector<std::string_view> kinds_without_kernel(std::string_view backend) {
  std::vector<std::string_view> missing;
  for (std::string_view kind : config::layer_kind_names())
    if (const config::LayerSchema* schema = config::find_layer_schema(kind); schema && schema->kind == kind)
      if (!find(backend, kind)) missing.push_back(kind);
  return missing;
}

}  // namespace dtrain::nn
