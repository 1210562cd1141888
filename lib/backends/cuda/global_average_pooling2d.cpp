// GlobalAveragePooling2D on the GPU (nn/global_average_pooling2d.hpp has the semantics): the
// global average pooling core, one mean per (sample, channel).
//   x, dx (N, H, W, C)  f32, canonical (a bfloat16 input is converted: KernelInput)
//   y, dy (N, C)        f32, canonical
// Float32 under every precision policy: the core is float32 only.
#include "backends/cuda/elementwise_cores.hpp"
#include "backends/cuda/kernel_io.hpp"
#include "nn/global_average_pooling2d.hpp"

namespace dtrain::backends::cuda {

namespace {

class GlobalAveragePooling2DKernel final : public Float32Kernel<nn::GlobalAveragePooling2D> {
 public:
  using Float32Kernel::Float32Kernel;

  void forward(std::int64_t batch, const nn::StepContext&) override {
    LayerMemories& p = plans_.get(batch);
    const Shape& in = layer_.input_shape();
    global_average_pool2d_forward(ctx_, batch, in[0], in[1], in[2], p.input.load_as<float>(), p.y<float>());
  }

  void backward(std::int64_t batch, const nn::StepContext&) override {
    LayerMemories& p = plans_.get(batch);
    float* dx = p.input.gradient_as<float>();
    if (!dx) return;
    const Shape& in = layer_.input_shape();
    global_average_pool2d_backward(ctx_, batch, in[0], in[1], in[2], p.dy<const float>(), dx);
    p.input.store_gradient();
  }
};

const nn::KernelRegistration registered(kName, nn::GlobalAveragePooling2D::Options::kind,
                                        &make_kernel<GlobalAveragePooling2DKernel, nn::GlobalAveragePooling2D>);

}  // namespace

}  // namespace dtrain::backends::cuda
