// The memories around a kernel written as loops over canonical (channels-last) arrays (dropout):
// the layer below may have produced a blocked layout, so its output is
// reordered into a canonical buffer before forward, and the input gradient out of one after
// backward; where the layouts already agree there is no copy. The output and its gradient are
// canonical (what such a kernel's plan() returns).
#pragma once

#include "backends/onednn/context.hpp"
#include "nn/kernel.hpp"

namespace dtrain::backends::onednn {

struct CanonicalIO {
  // input: the layer's per-example input shape; the memories are f32 (a bf16 input is converted
  // by the reorder in, the gradient back by the reorder out).
  void bind(OnednnContext& ctx, std::int64_t batch, const Shape& input, const nn::LayerIO& io);
  // Before reading input(): the reorder from the layer below, when there is one.
  void load_input(OnednnContext& ctx);
  // After writing input_gradient(): the reorder back into the layer below's layout.
  void store_input_gradient(OnednnContext& ctx) { dx_out.run(ctx); }

  const float* input() const { return static_cast<const float*>(x.get_data_handle()); }
  // Null when the layer below wants no gradient (the first layer).
  float* input_gradient() const { return dx ? static_cast<float*>(dx.get_data_handle()) : nullptr; }

  dnnl::memory x, dx;
  Reorder x_in, dx_out;
  float* y = nullptr;
  float* dy = nullptr;
};

}  // namespace dtrain::backends::onednn
