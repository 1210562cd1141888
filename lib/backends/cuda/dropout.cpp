// Dropout on the GPU (nn/dropout.hpp has the semantics and the masks): the dropout core, whose
// Philox masks are the CPU's bits for the same key (seed, global step, sample id, layer position),
// so a GPU replica drops exactly the units a CPU replica drops.
//   x, y, dy, dx (N, ...)  f32, canonical (a bfloat16 input is converted: KernelInput)
//   keep (N, ...)          uint8, kept from forward for backward
//   ids (N)                int64: StepContext::sample_ids, uploaded each training step
// Float32 under every precision policy, as on the CPU backend (masking only moves values).
#include <memory>

#include "backends/cuda/check.hpp"
#include "backends/cuda/elementwise_cores.hpp"
#include "backends/cuda/kernel_io.hpp"
#include "core/error.hpp"
#include "nn/dropout.hpp"

namespace dtrain::backends::cuda {

namespace {

struct DropoutPlan : LayerMemories {
  Buffer keep;        // uint8 (batch, elements)
  Buffer sample_ids;  // int64 (batch)
};

class DropoutKernel final : public Float32Kernel<nn::Dropout, DropoutPlan> {
 public:
  using Float32Kernel::Float32Kernel;

  void forward(std::int64_t batch, const nn::StepContext& step) override {
    DropoutPlan& p = plans_.get(batch);
    const float* x = p.input.load_as<float>();
    const std::int64_t* ids = nullptr;  // null: ids 0 .. batch - 1, as nn::sample_id without the pipeline's
    if (step.training() && layer_.rate() > 0.0 && !step.sample_ids.empty()) {
      DTRAIN_CHECK(static_cast<std::int64_t>(step.sample_ids.size()) == batch,
                   "dropout on CUDA: a step's sample ids do not match its batch");
      // sample_ids is host memory of the step: the context stages it in pinned memory and queues
      // the transfer without waiting for the stream (the step no longer waits between layers).
      ctx_.copy_from_host(step.sample_ids.data(), p.sample_ids.get(), step.sample_ids.size_bytes());
      ids = static_cast<const std::int64_t*>(p.sample_ids.get());
    }
    dropout_forward(ctx_, key(step), step.training(), ids, batch, elements(), x, p.y<float>(),
                    static_cast<std::uint8_t*>(p.keep.get()));
  }

  void backward(std::int64_t batch, const nn::StepContext&) override {
    DropoutPlan& p = plans_.get(batch);
    float* dx = p.input.gradient_as<float>();
    if (!dx) return;
    dropout_backward(ctx_, layer_.rate(), static_cast<const std::uint8_t*>(p.keep.get()), p.dy<const float>(), dx,
                     batch * elements());
    p.input.store_gradient();
  }

 private:
  void prepare(std::int64_t batch, DropoutPlan& p) override {
    p.keep = ctx_.allocate(static_cast<std::size_t>(batch * elements()));
    p.sample_ids = ctx_.allocate(static_cast<std::size_t>(batch) * sizeof(std::int64_t));
  }
  std::int64_t elements() const { return layer_.output_shape().numel(); }
  DropoutKey key(const nn::StepContext& step) const {
    return {step.seed, step.global_step, static_cast<std::uint32_t>(layer_.position()), layer_.rate()};
  }
};

const nn::KernelRegistration registered(kName, nn::Dropout::Options::kind, &make_kernel<DropoutKernel, nn::Dropout>);

}  // namespace

}  // namespace dtrain::backends::cuda
