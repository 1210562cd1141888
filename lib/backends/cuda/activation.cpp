// The Activation layer on the GPU (nn/activation.hpp has the semantics): the activation cores,
// the backward from the output as for Conv2D's and Dense's fused activations.
//   x, dx (N, ...)  f32, canonical (a bfloat16 input is converted: KernelInput)
//   y, dy (N, ...)  f32, canonical; softmax over the last axis
// Float32 under every precision policy: the cores are float32 only (the CPU backend keeps a
// bfloat16 input in bfloat16 except for the last layer and softmax).
#include "backends/cuda/elementwise_cores.hpp"
#include "backends/cuda/kernel_io.hpp"
#include "nn/activation.hpp"

namespace dtrain::backends::cuda {

namespace {

class ActivationKernel final : public Float32Kernel<nn::ActivationLayer> {
 public:
  using Float32Kernel::Float32Kernel;

  void forward(std::int64_t batch, const nn::StepContext&) override {
    LayerMemories& p = plans_.get(batch);
    activation_forward(ctx_, layer_.activation(), p.input.load_as<float>(), p.y<float>(), size(batch), columns());
  }

  void backward(std::int64_t batch, const nn::StepContext&) override {
    LayerMemories& p = plans_.get(batch);
    float* dx = p.input.gradient_as<float>();
    if (!dx) return;
    activation_backward(ctx_, layer_.activation(), p.y<const float>(), p.dy<const float>(), dx, size(batch),
                        columns());
    p.input.store_gradient();
  }

 private:
  std::int64_t size(std::int64_t batch) const { return batch * layer_.output_shape().numel(); }
  // softmax's rows: the last axis.
  std::int64_t columns() const {
    const Shape& s = layer_.output_shape();
    return s[s.rank() - 1];
  }
};

const nn::KernelRegistration registered(kName, nn::ActivationLayer::Options::kind,
                                        &make_kernel<ActivationKernel, nn::ActivationLayer>);

}  // namespace

}  // namespace dtrain::backends::cuda
