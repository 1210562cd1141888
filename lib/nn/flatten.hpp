// Flatten and Reshape (Keras semantics): the same values in canonical (channels-last, row-major)
// order under another shape.
//   Flatten: x (N, d1, ..., dk) -> y (N, d1 * ... * dk)
//   Reshape: x (N, ...) -> y (N, target_shape...), one target entry may be -1 (inferred)
// The layer below may have produced a blocked layout, so forward reorders into the canonical
// order of the input shape, written straight into the output's buffer; backward does the reverse.
#pragma once

#include "config/experiment.hpp"
#include "nn/layer.hpp"

namespace dtrain::nn {

class Reshape : public Layer {
 public:
  Reshape(std::string name, const config::ReshapeConfig& options);
  const char* kind() const override { return "reshape"; }
  Shape build(const Shape& input_shape, Rng& init_rng) override;
  dnnl::memory::desc plan(Context& ctx, const dnnl::memory::desc& src_md) override;
  void bind(Context& ctx, std::int64_t batch, const LayerIO& io) override;
  void forward(Context& ctx, std::int64_t batch) override;
  void backward(Context& ctx, std::int64_t batch) override;

 protected:
  Shape in_, out_;

 private:
  struct Plan {
    kernels::cpu::Reorder fwd, bwd;
  };
  config::ReshapeConfig opt_;
  PlanCache<Plan> plans_;
};

class Flatten final : public Reshape {
 public:
  explicit Flatten(std::string name) : Reshape(std::move(name), config::ReshapeConfig{{-1}}) {}
  const char* kind() const override { return "flatten"; }
};

}  // namespace dtrain::nn
