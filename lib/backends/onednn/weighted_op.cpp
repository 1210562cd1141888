#include "backends/onednn/weighted_op.hpp"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <memory>
#include <string_view>

#include "backends/onednn/lanes.hpp"
#include "core/error.hpp"

namespace dtrain::backends::onednn {

using dnnl::memory;

namespace {

// A new memory for the leading `dims` (N, C, H, W) of `whole`, arranged as `whole` is (channels
// innermost: Conv2DKernel crops only such planes).
memory leading_part(const OnednnContext& ctx, const memory& whole, const memory::dims& dims) {
  const std::optional<Arrangement> a = arrangement_of(whole.get_desc());
  DTRAIN_CHECK(a.has_value(), "a cropped plane is arranged with its channels innermost");
  return memory(arranged_like(*a, dims, whole.get_desc().data_type()), ctx.engine);
}

// Copies the leading part `part` holds between it and `whole` (to_whole: part into whole), a row of
// positions at a time; to_whole also zeroes the positions of `whole` outside the part. oneDNN 2.6's
// reorder of a channels-last sub-memory crashed, so these copies are this file's own.
void copy_part(const memory& whole, const memory& part, bool to_whole) {
  const std::optional<Arrangement> w = arrangement_of(whole.get_desc()), p = arrangement_of(part.get_desc());
  const memory::dims dims = whole.get_desc().dims(), kept = part.get_desc().dims();
  const std::size_t bytes = memory::data_type_size(whole.get_desc().data_type());
  auto* whole_base = static_cast<std::byte*>(whole.get_data_handle());
  auto* part_base = static_cast<std::byte*>(part.get_data_handle());
  auto at = [bytes](std::byte* base, const Arrangement& a, std::int64_t n, std::int64_t g, std::int64_t h,
                    std::int64_t c) {
    return base + static_cast<std::size_t>(n * a.n + g * a.group + h * a.row + c * a.col) * bytes;
  };
  // A row's positions of one channel group follow each other (nhwc, nChw8c): a row at a time.
  // Where groups interleave instead (strides oneDNN may pick), a position at a time.
  const std::int64_t run = w->col == w->lanes && p->col == p->lanes ? dims[3] : 1;
  const auto position = static_cast<std::size_t>(w->lanes) * bytes;  // a position's lanes of one group
  for (std::int64_t n = 0; n < dims[0]; ++n)
    for (std::int64_t g = 0; g < w->groups; ++g)
      for (std::int64_t h = 0; h < dims[2]; ++h) {
        const std::int64_t columns = h < kept[2] ? kept[3] : 0;
        for (std::int64_t c = 0; c < columns; c += run) {
          const auto size = position * static_cast<std::size_t>(std::min(run, columns - c));
          std::byte* in_whole = at(whole_base, *w, n, g, h, c);
          std::byte* in_part = at(part_base, *p, n, g, h, c);
          if (to_whole) std::memcpy(in_whole, in_part, size);
          else std::memcpy(in_part, in_whole, size);
        }
        for (std::int64_t c = columns; to_whole && c < dims[3]; c += run) {
          const auto size = position * static_cast<std::size_t>(std::min(run, dims[3] - c));
          std::memset(at(whole_base, *w, n, g, h, c), 0, size);
        }
      }
}

}  // namespace

std::optional<dnnl::matmul::primitive_desc> amx_matmul(const OnednnContext& ctx, const memory::desc& a,
                                                       const memory::desc& b, const memory::desc& c, bool accumulate) {
  dnnl::post_ops sum;
  if (accumulate) sum.append_sum(1.0f);
  dnnl::primitive_attr attr;
  attr.set_post_ops(sum);
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  try {
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), attr, ctx.engine);
    if (std::string_view(pd.impl_info_str()).find("amx") == std::string_view::npos) return std::nullopt;
    return pd;
  } catch (const dnnl::error&) {
    return std::nullopt;
  }
}

void* aligned_scratchpad(std::vector<std::byte>& storage, std::size_t bytes) {
  constexpr std::size_t kLine = 64;
  storage.assign(bytes + kLine, std::byte{0});
  void* at = storage.data();
  std::size_t space = storage.size();
  return std::align(kLine, bytes, at, space);
}

DTRAIN_LANE_CLONES void bf16_column_sums(const std::uint16_t* __restrict dy, std::int64_t rows, std::int64_t columns,
                                         float* __restrict db) {
  for (std::int64_t f = 0; f < columns; ++f) db[f] = 0.0f;
  for (std::int64_t p = 0; p < rows; ++p)
    for (std::int64_t f = 0; f < columns; ++f) db[f] += widen(dy[p * columns + f]);
}

DTRAIN_LANE_CLONES void f32_column_sums(const float* __restrict dy, std::int64_t rows, std::int64_t columns,
                                        float* __restrict db) {
  for (std::int64_t f = 0; f < columns; ++f) db[f] = 0.0f;
  for (std::int64_t p = 0; p < rows; ++p)
    for (std::int64_t f = 0; f < columns; ++f) db[f] += dy[p * columns + f];
}

DnnlIO wrap_io(const OnednnContext& ctx, const nn::LayerIO& io) {
  DnnlIO out;
  out.src = ctx.wrap(io.src);
  out.dst = ctx.wrap(io.dst);
  out.diff_dst = ctx.wrap(io.diff_dst);
  if (io.diff_src) out.diff_src = ctx.wrap(io.diff_src);
  return out;
}

void bind_weighted_op(OnednnContext& ctx, const DnnlIO& io, const memory::desc& kernel_md, Variable& kernel, Variable* bias,
                      const ActivationFn& act, WeightedOpPlan& p) {
  // Forward: src and kernel into the layouts the forward primitive chose; dst is the model's
  // memory, which the model allocated with exactly the primitive's dst layout.
  // Cropped, the primitives compute on the leading parts (WeightedOpPlan::Crop).
  // Cropped, the output (and its gradient) is already the leading part (WeightedOpPlan::Crop).
  if (p.crop) {
    p.src_whole = io.src;
    p.input_is_part = io.src.get_desc().dims() == p.crop->src;
    p.src_part = p.input_is_part ? io.src : leading_part(ctx, io.src, p.crop->src);
  }
  memory src = layout_for(ctx, p.crop ? p.src_part : io.src, p.fwd_pd.src_desc(0), p.src_in, false);
  memory w_user = ctx.wrap(kernel_md, kernel.value.raw());
  memory w = layout_for(ctx, w_user, p.fwd_pd.weights_desc(0), p.weights_in, false);
  p.fwd = {p.fwd_prim, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, w}, {DNNL_ARG_DST, io.dst}}};
  memory bias_mem, dbias_mem;
  if (bias) {
    bias_mem = ctx.wrap(p.fwd_pd.weights_desc(1), bias->value.raw());
    dbias_mem = ctx.wrap(p.bwd_weights_pd.diff_weights_desc(1), bias->grad.raw());
    p.fwd.args.emplace(DNNL_ARG_BIAS, bias_mem);
  }
  act.bind(ctx, io.dst, io.diff_dst, p.act);
  const memory& pre_grad = p.act.pre_grad;

  // Backward weights: reads the forward's src and the gradient before the activation.
  memory bw_src = layout_for(ctx, src, p.bwd_weights_pd.src_desc(0), p.bw_src_in, false);
  memory bw_ddst = layout_for(ctx, pre_grad, p.bwd_weights_pd.diff_dst_desc(0), p.bw_diff_dst_in, false);
  memory dw_user = ctx.wrap(kernel_md, kernel.grad.raw());
  memory dw = layout_for(ctx, dw_user, p.bwd_weights_pd.diff_weights_desc(0), p.dw_out, true);
  p.bwd_weights = {p.bwd_weights_prim, {{DNNL_ARG_SRC, bw_src}, {DNNL_ARG_DIFF_DST, bw_ddst}, {DNNL_ARG_DIFF_WEIGHTS, dw}}};
  if (bias) p.bwd_weights.args.emplace(DNNL_ARG_DIFF_BIAS, dbias_mem);

  // Backward data, only when a layer below wants the gradient.
  p.has_diff_src = static_cast<bool>(io.diff_src);
  if (p.has_diff_src) {
    memory bd_w = layout_for(ctx, w, p.bwd_data_pd.weights_desc(0), p.bd_weights_in, false);
    if (p.crop) {
      p.diff_src_whole = io.diff_src;
      p.diff_src_part = p.input_is_part ? io.diff_src : leading_part(ctx, io.diff_src, p.crop->src);
    }
    memory bd_ddst = layout_for(ctx, pre_grad, p.bwd_data_pd.diff_dst_desc(0), p.bd_diff_dst_in, false);
    memory bd_dsrc = layout_for(ctx, p.crop ? p.diff_src_part : io.diff_src, p.bwd_data_pd.diff_src_desc(0),
                                p.bd_diff_src_out, true);
    p.bwd_data = {p.bwd_data_prim, {{DNNL_ARG_WEIGHTS, bd_w}, {DNNL_ARG_DIFF_DST, bd_ddst}, {DNNL_ARG_DIFF_SRC, bd_dsrc}}};
  }
}

LayoutPtr WeightedOpKernel::keep(std::int64_t batch, const Shape& out, const dnnl::primitive_desc& fwd,
                                 const dnnl::primitive_desc& bwd_data, const dnnl::primitive_desc& bwd_weights,
                                 const std::optional<WeightedOpPlan::Crop>& crop) {
  WeightedOpPlan& p = plans_.create(batch);
  p.crop = crop;
  p.fwd_pd = fwd;
  p.bwd_data_pd = bwd_data;
  p.bwd_weights_pd = bwd_weights;
  p.fwd_prim = dnnl::primitive(fwd);
  p.bwd_data_prim = dnnl::primitive(bwd_data);
  p.bwd_weights_prim = dnnl::primitive(bwd_weights);
  // Cropped, the forward's dst is the leading part: `out` in shape, fewer rows or columns in memory.
  DTRAIN_CHECK(!crop || arrangement_of(fwd.dst_desc()).has_value(), "a cropped output is arranged with its channels innermost");
  return make_layout(out, compute_, fwd.dst_desc());
}

void WeightedOpKernel::bind_variables(std::int64_t batch, const nn::LayerIO& io, const memory::desc& kernel_md,
                                      Variable& kernel, Variable* bias) {
  bind_weighted_op(ctx_, wrap_io(ctx_, io), kernel_md, kernel, bias, act_, plans_.get(batch));
}

void WeightedOpKernel::forward(std::int64_t batch, const nn::StepContext&) {
  WeightedOpPlan& p = plans_.get(batch);
  if (p.crop && !p.input_is_part) copy_part(p.src_whole, p.src_part, false);
  p.src_in.run(ctx_);
  p.weights_in.run(ctx_);
  p.fwd.run(ctx_);
  act_.forward(ctx_, p.act);
}

void WeightedOpKernel::backward(std::int64_t batch, const nn::StepContext& step) {
  WeightedOpPlan& p = plans_.get(batch);
  // Where the weight loops apply the derivative, nothing else reads the gradient before the
  // activation (no input gradient).
  const bool loops_apply_derivative = weight_gradients_apply_activation_derivative(batch);
  if (!activation_backward_elsewhere_ && !loops_apply_derivative) act_.backward(ctx_, p.act);
  // A layer's own weight loops come last: where the lanes share their items (nn::StepContext::
  // shared_work), the lanes leave them together, and the later in the step that is, the less
  // time is left for them to drift apart again before their gradients are summed.
  if (own_weight_gradients(batch)) {
    input_gradient(p);
    if (step.backward_marks) step.backward_marks->input_done();  // dtrain bench: data, then weights
    weight_gradients(batch, p.act.pre_grad, step);
    return;
  }
  p.bw_src_in.run(ctx_);
  p.bw_diff_dst_in.run(ctx_);
  p.bwd_weights.run(ctx_);
  p.dw_out.run(ctx_);
  if (step.backward_marks) step.backward_marks->weights_done();  // dtrain bench: weights, then data
  input_gradient(p);
}

void WeightedOpKernel::input_gradient(WeightedOpPlan& p) {
  if (!p.has_diff_src) return;
  p.bd_weights_in.run(ctx_);
  p.bd_diff_dst_in.run(ctx_);
  p.bwd_data.run(ctx_);
  p.bd_diff_src_out.run(ctx_);
  // The positions past the crop feed only outputs the layer above does not read: +0.
  if (p.crop && !p.input_is_part) copy_part(p.diff_src_whole, p.diff_src_part, true);
}

}  // namespace dtrain::backends::onednn
