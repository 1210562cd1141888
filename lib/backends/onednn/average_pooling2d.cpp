// AveragePooling2D on oneDNN (nn/average_pooling2d.hpp has the semantics): the shared pooling
// kernel with pooling_avg_exclude_padding, TensorFlow's divisor (real inputs only).
//   x (N, H, W, C) any layout -> y (N, OH, OW, C) any layout
#include "backends/onednn/pooling.hpp"
#include "nn/average_pooling2d.hpp"

namespace dtrain::backends::onednn {

namespace {

std::unique_ptr<nn::LayerKernel> make(nn::Layer& layer, Context& ctx, DType) {
  return std::make_unique<Pool2DKernel>(static_cast<nn::AveragePooling2D&>(layer), OnednnContext::of(ctx),
                                        dnnl::algorithm::pooling_avg_exclude_padding);
}

const nn::KernelRegistration registered(kName, nn::AveragePooling2D::Options::kind, &make);

}  // namespace

}  // namespace dtrain::backends::onednn
