// AveragePooling2D on the GPU (nn/average_pooling2d.hpp has the semantics): the shared pooling
// kernel (pool2d_kernel.hpp) with the average pooling core, TensorFlow's divisor (the window's
// real inputs only, padding left out).
//   x (N, H, W, C) f32 -> y (N, OH, OW, C) f32
#include <memory>

#include "backends/cuda/pool2d_kernel.hpp"
#include "nn/average_pooling2d.hpp"

namespace dtrain::backends::cuda {

namespace {

std::unique_ptr<nn::LayerKernel> make(nn::Layer& layer, Context& ctx, DType) {
  return std::make_unique<Pool2DKernel>(static_cast<nn::AveragePooling2D&>(layer), CudaContext::of(ctx),
                                        Pool2DKernel::Pooling::average);
}

const nn::KernelRegistration registered(kName, nn::AveragePooling2D::Options::kind, &make);

}  // namespace

}  // namespace dtrain::backends::cuda
