// What the CUDA layer kernels (one file per layer kind: conv2d.cpp, dense.cpp, ...) share about
// the memories around a layer.
//
// Every memory this backend hands between layers is dense row-major ("canonical", channels last),
// so a kernel never reorders; it may still receive another dtype than it computes in: under
// mixed_bfloat16 only Dense computes in bfloat16 (the other cores are float32 only), so a layer
// after a bfloat16 Dense gets a bfloat16 input, and a bfloat16 Dense after a float32 layer gets a
// float32 one. KernelInput converts the input into the kernel's dtype in forward and the input
// gradient back into the layer below's dtype in backward, with buffers allocated in bind() (a
// step allocates nothing); where the dtypes agree it is the layer below's memory itself.
//
// Addresses are read when a step runs, never kept from bind(): the model's input is a movable
// memory repointed every step (CudaContext::address), and reading a variable's .raw() each step
// costs nothing.
#pragma once

#include <cstdint>
#include <memory>

#include "backends/cuda/context.hpp"
#include "core/variable.hpp"
#include "nn/kernel.hpp"

namespace dtrain::backends::cuda {

class KernelInput {
 public:
  // `compute`: the dtype the kernel reads its input and writes its input gradient in (f32 or bf16).
  void bind(CudaContext& ctx, const nn::LayerIO& io, DType compute);

  // Forward: converts the layer below's output when its dtype differs, then returns the input.
  const void* load();
  // The input as the last load() left it (what backward reads: the layer below's output is not
  // written between a forward and its backward).
  const void* get() const;
  // Where backward writes the input gradient in the compute dtype; null when the layer below wants
  // none (the first layer).
  void* gradient() const;
  // After the gradient is written: converts it into the layer below's gradient memory when the
  // dtypes differ.
  void store_gradient();

  template <class T>
  const T* load_as() { return static_cast<const T*>(load()); }
  template <class T>
  const T* as() const { return static_cast<const T*>(get()); }
  template <class T>
  T* gradient_as() const { return static_cast<T*>(gradient()); }

 private:
  CudaContext* ctx_ = nullptr;
  Memory src_, diff_src_;
  DType from_ = DType::f32, compute_ = DType::f32;
  std::int64_t elements_ = 0;
  Buffer converted_, converted_gradient_;  // only where the dtypes differ
};

// The memories of one batch size that every kernel here keeps: its input (in the dtype the kernel
// computes in), its output and the gradient arriving from above. A kernel's per-batch Plan derives
// from it to keep more (a core, scratch).
struct LayerMemories {
  KernelInput input;
  Memory dst, diff_dst;

  void bind(CudaContext& ctx, const nn::LayerIO& io, DType compute) {
    input.bind(ctx, io, compute);
    dst = io.dst;
    diff_dst = io.diff_dst;
  }
  template <class T>
  T* y() const { return static_cast<T*>(CudaContext::address(dst)); }
  template <class T>
  T* dy() const { return static_cast<T*>(CudaContext::address(diff_dst)); }
};

// A kernel that computes in float32 whatever the precision policy (every kind but Dense: the
// cores have no bfloat16 path) and writes a canonical float32 output of the layer's output shape.
// `Plan` (a LayerMemories) is made per batch size; prepare() allocates what else it holds.
template <class LayerT, class Plan = LayerMemories>
class Float32Kernel : public nn::LayerKernel {
 public:
  Float32Kernel(LayerT& layer, CudaContext& ctx) : layer_(layer), ctx_(ctx) {}

  LayoutPtr plan(std::int64_t batch, const LayoutPtr&) override {
    prepare(batch, plans_.create(batch));
    return ctx_.canonical_layout(layer_.output_shape().with_batch(batch), DType::f32);
  }
  void bind(std::int64_t batch, const nn::LayerIO& io) override { plans_.get(batch).bind(ctx_, io, DType::f32); }

 protected:
  virtual void prepare(std::int64_t /*batch*/, Plan& /*plan*/) {}

  LayerT& layer_;
  CudaContext& ctx_;
  nn::PlanCache<Plan> plans_;
};

// The factory of a kernel whose constructor takes its layer and the CUDA context (what
// nn::KernelRegistration takes): make_kernel<Conv2DKernel, nn::Conv2D>.
template <class Kernel, class LayerT>
std::unique_ptr<nn::LayerKernel> make_kernel(nn::Layer& layer, Context& ctx, DType) {
  return std::make_unique<Kernel>(static_cast<LayerT&>(layer), CudaContext::of(ctx));
}

// Device addresses of a variable's value and gradient (f32, Keras layouts): .raw(), never .data(),
// which refuses memory the host cannot read.
inline const float* value_of(Variable& v) { return static_cast<const float*>(v.value.raw()); }
inline float* grad_of(Variable& v) { return static_cast<float*>(v.grad.raw()); }

// f32 <-> bf16 between two device arrays of n elements on the context's stream; `from` and `to`
// of the same dtype are copied (nothing happens when they are one array).
void convert(CudaContext& ctx, const void* from, DType from_dtype, void* to, DType to_dtype, std::int64_t n);

// A fused activation (Conv2D's and Dense's `activation:`) applied in place to the layer's output y
// (n values, rows of `cols` for softmax), and its backward in place on the gradient dy, from y.
// Float32; a bfloat16 output goes through the two float32 scratch arrays of n values (`scratch`,
// sized by activation_scratch_bytes) and is rounded back, which for relu is exact and otherwise
// rounds once more than oneDNN's fused post-op (within bfloat16's tolerance).
std::size_t activation_scratch_bytes(config::Activation a, DType dtype, std::int64_t n);
void activation_in_place(CudaContext& ctx, config::Activation a, DType dtype, void* y, std::int64_t n, std::int64_t cols,
                         void* scratch);
void activation_backward_in_place(CudaContext& ctx, config::Activation a, DType dtype, const void* y, void* dy,
                                  std::int64_t n, std::int64_t cols, void* scratch);

}  // namespace dtrain::backends::cuda
