#include "backends/onednn/canonical_io.hpp"

namespace dtrain::backends::onednn {

void CanonicalIO::bind(OnednnContext& ctx, std::int64_t batch, const Shape& input, const nn::LayerIO& io) {
  const dnnl::memory::desc canonical = canonical_md(input.with_batch(batch), DType::f32);
  x = layout_for(ctx, ctx.wrap(io.src), canonical, x_in, false);
  y = static_cast<float*>(io.dst.data);
  dy = static_cast<float*>(io.diff_dst.data);
  if (io.diff_src) dx = layout_for(ctx, ctx.wrap(io.diff_src), canonical, dx_out, true);
}

void CanonicalIO::load_input(OnednnContext& ctx) {
  x_in.run(ctx);
  ctx.stream.wait();  // the loops read it right away
}

}  // namespace dtrain::backends::onednn
