// The kernel the 2-D pooling layers share on the GPU (max_pool2d.cpp, average_pooling2d.cpp): the
// pooling cores of elementwise_cores.hpp over the layer's PoolDims for each batch size.
//   x, dx (N, H, W, C)         f32, canonical (a bfloat16 input is converted: KernelInput)
//   y, dy (N, OH, OW, C)       f32, canonical
//   argmax (N, OH, OW, C)      int32, max pooling only: the winner's window position, kept from
//                              forward for backward
// Float32 under every precision policy: the cores are float32 only (the CPU backend pools in the
// dtype it receives; here a bfloat16 input costs one conversion each way).
// The max pooling does not take a relu's derivative from the layer below (nn/kernel.hpp's
// hand-off): that layer applies it itself, one pass over its output gradient.
#pragma once

#include "backends/cuda/kernel_io.hpp"
#include "nn/pooling.hpp"

namespace dtrain::backends::cuda {

struct Pool2DPlan : LayerMemories {
  Buffer argmax;  // max pooling
};

class Pool2DKernel final : public Float32Kernel<nn::Pool2DLayer, Pool2DPlan> {
 public:
  enum class Pooling { max, average };
  Pool2DKernel(nn::Pool2DLayer& layer, CudaContext& ctx, Pooling pooling)
      : Float32Kernel(layer, ctx), pooling_(pooling) {}

  void forward(std::int64_t batch, const nn::StepContext&) override;
  void backward(std::int64_t batch, const nn::StepContext&) override;

 private:
  void prepare(std::int64_t batch, Pool2DPlan& p) override;
  Pooling pooling_;
};

}  // namespace dtrain::backends::cuda
