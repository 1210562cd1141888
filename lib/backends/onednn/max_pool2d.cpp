// MaxPooling2D on oneDNN (nn/max_pool2d.hpp has the semantics): the shared pooling kernel with
// oneDNN's max pooling, which excludes padding from the max as TensorFlow does.
//   x (N, H, W, C) any layout -> y (N, OH, OW, C) any layout; argmax workspace kept for backward
#include "backends/onednn/pooling.hpp"
#include "nn/max_pool2d.hpp"

namespace dtrain::backends::onednn {

namespace {

std::unique_ptr<nn::LayerKernel> make(nn::Layer& layer, Context& ctx, DType) {
  return std::make_unique<Pool2DKernel>(static_cast<nn::MaxPool2D&>(layer), OnednnContext::of(ctx),
                                        dnnl::algorithm::pooling_max);
}

const nn::KernelRegistration registered(kName, nn::MaxPool2D::Options::kind, &make);

}  // namespace

}  // namespace dtrain::backends::onednn
