// A layer's kernel: how one backend computes one layer on one replica. Each backend's folder has
// one file per layer (backends/onednn/conv2d.cpp, ...) that registers its kernel for the layer's
// kind; the model asks for the kernels of its layers on the replica's context.
//
// Life of a kernel, for each batch size (the short last batch of an epoch gets its own):
//   plan(batch, src)      chooses the layout this layer produces from the layout it receives
//                         (the backend may pick blocked layouts) and prepares what it needs
//   bind(batch, io)       the model hands over the memories between layers; the kernel prebuilds
//                         its argument lists, so a step allocates nothing
//   forward(batch, step)  every step
//   backward(batch, step) every training step: writes every variable's grad and, when
//                         io.diff_src is bound, the gradient with respect to the input. It may
//                         overwrite io.diff_dst (the model never reads it again).
// A replica without samples in a step (a short last batch) calls neither; it calls
// forward_without_samples and backward_without_samples instead, so that layers which sum over the
// replicas still take part in every collective.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "device/context.hpp"
#include "config/experiment.hpp"
#include "core/error.hpp"
#include "nn/layer.hpp"
#include "nn/step.hpp"

namespace dtrain::nn {

class MaxPool2D;

// The memories around one layer for one batch size. diff_src is empty for the first layer.
struct LayerIO {
  device::Memory src, dst, diff_dst, diff_src;
};

class LayerKernel {
 public:
  virtual ~LayerKernel() = default;
  virtual device::LayoutPtr plan(std::int64_t batch, const device::LayoutPtr& src) = 0;
  virtual void bind(std::int64_t batch, const LayerIO& io) = 0;
  virtual void forward(std::int64_t batch, const StepContext& step) = 0;
  virtual void backward(std::int64_t batch, const StepContext& step) = 0;
  virtual void forward_without_samples(const StepContext&) {}
  virtual void backward_without_samples(const StepContext&) {}

  // Fusing a max pooling into the layer below (called once, before the first plan, before the
  // activation fusions below). A first convolution on a few input channels is bound by the bytes
  // of its output, not its FLOPs, and the pooling above it reads those bytes once more forward and
  // writes their gradient backward, mostly zeros: computed together, only the pooled output and
  // its gradient ever reach memory. The model offers the pooling of the kernel above
  // (max_pooling_to_offer, which says whether it could pass through) to the layer below
  // (take_output_max_pooling: true when its output will be the pooled one and its backward will
  // start from the pooled gradient; `input_gradient` says whether a layer below, or the caller,
  // wants the gradient of its input), then tells the pooling (skip_pooling): its plan hands on the
  // layout it receives, and it computes nothing (forward_passes_through, gradient_passes_through).
  virtual const MaxPool2D* max_pooling_to_offer() const { return nullptr; }
  virtual bool take_output_max_pooling(const MaxPool2D&, bool /*input_gradient*/) { return false; }
  virtual void skip_pooling() {}
  // The same through a relu Activation layer between the two (called in the same loop, where the
  // layer below the pooling did not take it): batch normalization, relu, max pooling, the three
  // bound by the bytes of the unpooled output and its gradient. The model offers the pooling to
  // the layer below the Activation (take_output_relu_and_max_pooling: true when its output will be
  // the relu's, pooled, and its backward will start from the pooled gradient, applying the relu's
  // derivative itself), then tells the pooling (skip_pooling) and the Activation
  // (skip_activation_forward and skip_activation_backward): both pass their memories through.
  virtual bool take_output_relu_and_max_pooling(const MaxPool2D&) { return false; }

  // Writing the input's gradient over the input (asked after each plan). A small layer's
  // backward that writes its input's gradient into memory last touched a step ago waits for those
  // cache lines (the seed CNN's logits layer: a quarter of its backward), while the input it has
  // just read is still in the caches. The model gives the two one memory where the kernel above
  // says its backward for `batch` reads its input only before writing any of the gradient or, an
  // element at a time, just before writing that element's gradient
  // (writes_input_gradient_over_input), and the kernel below says its backward does not read its
  // output (backward_reads_output: false once a layer above applies its activation's derivative),
  // and that output is a memory of its own (no layer passes it through).
  virtual bool writes_input_gradient_over_input(std::int64_t /*batch*/) const { return false; }
  virtual bool backward_reads_output() const { return true; }

  // Neither a layer below nor the caller wants the gradient of this layer's input (called once,
  // before the first plan, for the lowest layer whose backward runs): its kernel may plan for that.
  virtual void without_input_gradient() {}

  // The layer above reads only the leading `rows` x `columns` of the output this kernel computes
  // (Layer::input_extent_read, or the kernel above's input_read_within; called once, before the
  // first plan, for a layer above that is not computed here, and on the kernel that computes a
  // pooling taken below for what the layer above that pooling reads): the gradient this kernel's
  // backward starts from is zero past them, so its sums over the output's positions may leave
  // those out, as the +0 terms they would add, and it may compute and hold those rows and columns
  // alone (its output layout's descriptor then holds fewer than its shape).
  virtual void output_read_within(std::int64_t /*rows*/, std::int64_t /*columns*/) {}
  // After output_read_within: the leading rows and columns of its (height, width, channels) input
  // this kernel's forward will read, where fewer than all (a convolution that computes only the
  // output positions read reads only the input rows and columns they reach). The model tells the
  // kernel that computes that input (output_read_within), which may then hand over those alone:
  // a layout whose descriptor holds fewer rows or columns than its shape. A kernel that returns
  // an extent here must accept its input either way: whole, or exactly that leading part.
  virtual std::optional<Layer::InputExtent> input_read_within() const { return std::nullopt; }

  // A reshape (Flatten, Reshape) whose input lies in the canonical layout of its input shape needs
  // to move nothing: its output, in the canonical layout of its own shape, is the same bytes. The
  // model asks each kernel whether it wants its input that way (wants_canonical_input) and tells
  // the kernel below (prefer_canonical_output, once, before the first plan), which writes its
  // output canonical where that costs it nothing (a pooling on its own loops). After a plan,
  // reinterprets_input says whether this kernel's output is its input's bytes read as another
  // shape; the model then gives it its input's memory as its output, and its output gradient's
  // as its input gradient's (with forward_passes_through and gradient_passes_through true).
  virtual bool wants_canonical_input() const { return false; }
  virtual void prefer_canonical_output() {}
  virtual bool reinterprets_input() const { return false; }

  // Fusing an activation's backward into the layer above (called once, before the first plan).
  // A relu's derivative zeroes the gradient where the relu's output is zero; a max pooling above it
  // writes its input gradient only where its max came from, and that max is the relu's output, so
  // the pooling can apply the derivative while it writes instead of the layer below reading and
  // writing the whole gradient again. The model asks the layer below what it applies
  // (output_activation), offers it to the layer above (take_input_activation_backward: true when
  // it will apply it) and then tells the layer below to leave it out (skip_activation_backward).
  virtual config::Activation output_activation() const { return config::Activation::linear; }
  virtual bool take_input_activation_backward(config::Activation) { return false; }
  virtual void skip_activation_backward() {}
  // After skip_activation_backward, whether this kernel's backward is then the identity (an
  // Activation layer whose derivative the layer above applies): the model then hands it one memory
  // as both diff_dst and diff_src where its input and output layouts agree, and it moves nothing.
  virtual bool gradient_passes_through() const { return false; }

  // Fusing an Activation layer's forward into the layer below (called once, before the first plan,
  // before the backward fusion above). An Activation layer reads its input and writes its output
  // once more, for an operation the layer below could apply while it writes: the model offers the
  // layer's activation (standalone_activation) to the layer below (take_output_activation: true
  // when its output will have it applied) and tells the Activation (skip_activation_forward); its
  // forward is then the identity, and the model gives it one memory as src and dst where their
  // layouts agree, so it moves nothing. Its backward is unchanged (it computes from its output),
  // unless the layer below takes the derivative too: the model then asks it right away
  // (take_output_activation_derivative: true when its backward will start from the gradient of the
  // activation's output and apply the derivative as it reads it) and tells the Activation
  // (skip_activation_backward), whose backward then moves nothing either; no layer above is then
  // offered the derivative. The layer below goes first because it reads nothing more (batch
  // normalization recomputes the relu's input from x, which its backward reads anyway), where a
  // layer above may have to read the activation's output (an average pooling does).
  virtual config::Activation standalone_activation() const { return config::Activation::linear; }
  virtual bool take_output_activation(config::Activation) { return false; }
  virtual bool take_output_activation_derivative(config::Activation) { return false; }
  virtual void skip_activation_forward() {}
  virtual bool forward_passes_through() const { return false; }
};

// compute: the dtype the layer computes in (its variables stay f32).
using KernelFactory = std::unique_ptr<LayerKernel> (*)(Layer& layer, device::Context& ctx, DType compute);

// Called by a backend's kernel file before main (see KernelRegistration).
void register_kernel(std::string_view backend, std::string_view layer_kind, KernelFactory factory);
// The kernels of `layers` on `ctx`, layer i computing in compute[i]; ConfigError naming every
// layer kind the backend has no kernel for.
std::vector<std::unique_ptr<LayerKernel>> make_kernels(std::span<Layer* const> layers, device::Context& ctx,
                                                       std::span<const DType> compute);
// The registered layer kinds `backend` has no kernel for (what a backend still lacks).
std::vector<std::string_view> kinds_without_kernel(std::string_view backend);

// In a backend's kernel file:  const nn::KernelRegistration registered("onednn", "conv2d", &make);
struct KernelRegistration {
  KernelRegistration(std::string_view backend, std::string_view layer_kind, KernelFactory factory) {
    register_kernel(backend, layer_kind, factory);
  }
};

// Per-batch-size state of a kernel: one Plan per batch size it was planned for.
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
  // The plan for `batch`, or null where none was made (a kernel with two ways to run a batch).
  Plan* find(std::int64_t batch) {
    auto it = plans_.find(batch);
    return it == plans_.end() ? nullptr : it->second.get();
  }
  const Plan* find(std::int64_t batch) const {
    auto it = plans_.find(batch);
    return it == plans_.end() ? nullptr : it->second.get();
  }
  void erase(std::int64_t batch) { plans_.erase(batch); }

 private:
  std::map<std::int64_t, std::unique_ptr<Plan>> plans_;
};

}  // namespace dtrain::nn
