// MaxPooling2D on the GPU (nn/max_pool2d.hpp has the semantics): the shared pooling kernel
// (pool2d_kernel.hpp) with the max pooling core: the first maximum of a window wins, 'same'
// padding never does, and backward adds each gradient to the input that won.
//   x (N, H, W, C) f32 -> y (N, OH, OW, C) f32; argmax (N, OH, OW, C) int32 kept for backward
#include <memory>

#include "backends/cuda/pool2d_kernel.hpp"
#include "nn/max_pool2d.hpp"

namespace dtrain::backends::cuda {

namespace {

std::unique_ptr<nn::LayerKernel> make(nn::Layer& layer, Context& ctx, DType) {
  return std::make_unique<Pool2DKernel>(static_cast<nn::MaxPool2D&>(layer), CudaContext::of(ctx),
                                        Pool2DKernel::Pooling::max);
}

const nn::KernelRegistration registered(kName, nn::MaxPool2D::Options::kind, &make);

}  // namespace

}  // namespace dtrain::backends::cuda
