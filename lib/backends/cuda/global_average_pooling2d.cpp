// GlobalAveragePooling2D on the GPU (nn/global_average_pooling2d.hpp has the semantics): the
// global average pooling core, one mean per (sample, channel).
//   x, dx (N, H, W, C)  f32, canonical (a bfloat16 input is converted: KernelInput)
//   y, dy (N, C)        f32, canonical
// Float32 under every precision policy: the core is float32 only.
#include <memory>

#include "backends/cuda/elementwise_cores.hpp"
#include "backends/cuda/kernel_io.hpp"
#include "nn/global_average_pooling2d.hpp"

namespace dtrain::backends::cuda {

namespace {

class GlobalAveragePooling2DKernel final : public nn::LayerKernel {
 public:
  GlobalAveragePooling2DKernel(nn::GlobalAveragePooling2D& layer, CudaContext& ctx) : layer_(layer), ctx_(ctx) {}

  LayoutPtr plan(std::int64_t batch, const LayoutPtr&) override {
    plans_.create(batch);
    return ctx_.canonical_layout(layer_.output_shape().with_batch(batch), DType::f32);
  }

  void bind(std::int64_t batch, const nn::LayerIO& io) override {
    Plan& p = plans_.get(batch);
    p.input.bind(ctx_, io, DType::f32);
    p.dst = io.dst;
    p.diff_dst = io.diff_dst;
  }

  void forward(std::int64_t batch, const nn::StepContext&) override {
    Plan& p = plans_.get(batch);
    const Shape& in = layer_.input_shape();
    global_average_pool2d_forward(ctx_, batch, in[0], in[1], in[2], p.input.load_as<float>(),
                                  static_cast<float*>(CudaContext::address(p.dst)));
  }

  void backward(std::int64_t batch, const nn::StepContext&) override {
    Plan& p = plans_.get(batch);
    float* dx = p.input.gradient_as<float>();
    if (!dx) return;
    const Shape& in = layer_.input_shape();
    global_average_pool2d_backward(ctx_, batch, in[0], in[1], in[2],
                                   static_cast<const float*>(CudaContext::address(p.diff_dst)), dx);
    p.input.store_gradient();
  }

 private:
  struct Plan {
    KernelInput input;
    Memory dst, diff_dst;
  };
  nn::GlobalAveragePooling2D& layer_;
  CudaContext& ctx_;
  nn::PlanCache<Plan> plans_;
};

std::unique_ptr<nn::LayerKernel> make(nn::Layer& layer, Context& ctx, DType) {
  return std::make_unique<GlobalAveragePooling2DKernel>(static_cast<nn::GlobalAveragePooling2D&>(layer),
                                                        CudaContext::of(ctx));
}

const nn::KernelRegistration registered(kName, nn::GlobalAveragePooling2D::Options::kind, &make);

}  // namespace

}  // namespace dtrain::backends::cuda
