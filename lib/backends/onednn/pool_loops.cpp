#include "backends/onednn/pool_loops.hpp"

namespace dtrain::backends::onednn {

using dnnl::memory;

std::optional<PoolGeometry> pool_geometry(const nn::Pool2DLayer& layer, const memory::desc& src_md) {
  const std::optional<Arrangement> src = arrangement_of(src_md);
  const auto dt = src_md.data_type();
  if (!src || (dt != memory::data_type::f32 && dt != memory::data_type::bf16)) return std::nullopt;
  const auto& pool = layer.params().pool_size;
  PoolGeometry g;
  // The input's rows and columns as its layout holds them: a convolution below that computes only
  // the leading ones this pooling reads (Layer::input_extent_read) hands over those alone.
  const memory::dims held = src_md.dims();  // (N, C, H, W)
  const Shape& in = layer.input_shape();
  const std::optional<nn::Layer::InputExtent> read = layer.input_extent_read();
  DTRAIN_CHECK(held.size() == 4 && held[2] <= in[0] && held[3] <= in[1] &&
                   ((held[2] == in[0] && held[3] == in[1]) || (read && held[2] >= read->rows && held[3] >= read->columns)),
               "a pooling's input layout holds fewer rows or columns than its windows read");
  g.h = held[2];
  g.w = held[3];
  g.oh = layer.padding_h().out;
  g.ow = layer.padding_w().out;
  g.kh = pool[0];
  g.kw = pool[1];
  g.sh = layer.strides()[0];
  g.sw = layer.strides()[1];
  g.pad_top = layer.padding_h().before;
  g.pad_left = layer.padding_w().before;
  g.lanes = src->lanes;
  g.src = *src;
  g.overlapping = g.sh < g.kh || g.sw < g.kw;
  if (g.overlapping && dt != memory::data_type::f32) return std::nullopt;
  const auto uncovered = [](std::int64_t size, std::int64_t out, std::int64_t k, std::int64_t s, std::int64_t before) {
    std::vector<bool> covered(static_cast<std::size_t>(size), false);
    for (std::int64_t o = 0; o < out; ++o)
      for (std::int64_t i = o * s - before; i < o * s - before + k; ++i)
        if (i >= 0 && i < size) covered[static_cast<std::size_t>(i)] = true;
    std::vector<std::int64_t> rest;
    for (std::int64_t i = 0; i < size; ++i)
      if (!covered[static_cast<std::size_t>(i)]) rest.push_back(i);
    return rest;
  };
  g.uncovered_rows = uncovered(g.h, g.oh, g.kh, g.sh, g.pad_top);
  g.uncovered_cols = uncovered(g.w, g.ow, g.kw, g.sw, g.pad_left);
  return g;
}

PoolWindows::PoolWindows(const PoolGeometry& g) {
  // Overlapping: each input position's (window's dst offset, position in it), windows in order.
  std::vector<std::vector<std::pair<std::int64_t, std::uint8_t>>> covering(
      g.overlapping ? static_cast<std::size_t>(g.h * g.w) : 0);
  for (std::int64_t oh = 0; oh < g.oh; ++oh)
    for (std::int64_t ow = 0; ow < g.ow; ++ow) {
      first.push_back(static_cast<std::int64_t>(offset.size()));
      for (std::int64_t i = 0; i < g.kh; ++i) {
        const std::int64_t ih = oh * g.sh - g.pad_top + i;
        if (ih < 0 || ih >= g.h) continue;
        for (std::int64_t j = 0; j < g.kw; ++j) {
          const std::int64_t iw = ow * g.sw - g.pad_left + j;
          if (iw < 0 || iw >= g.w) continue;
          offset.push_back(ih * g.src.row + iw * g.src.col);
          position.push_back(static_cast<std::uint8_t>(i * g.kw + j));
          if (g.overlapping) {
            covering[static_cast<std::size_t>(ih * g.w + iw)].emplace_back(oh * g.dst.row + ow * g.dst.col,
                                                                            position.back());
          }
        }
      }
    }
  first.push_back(static_cast<std::int64_t>(offset.size()));
  if (!g.overlapping) return;
  for (const auto& windows : covering) {
    covering_first.push_back(static_cast<std::int64_t>(covering_at.size()));
    for (const auto& [at, p] : windows) {
      covering_at.push_back(at);
      covering_position.push_back(p);
    }
  }
  covering_first.push_back(static_cast<std::int64_t>(covering_at.size()));
}

OwnPool2DKernel::OwnPool2DKernel(nn::Pool2DLayer& layer, OnednnContext& ctx, dnnl::algorithm algorithm)
    : layer_(layer), ctx_(ctx), isa_(ctx.loop_isa()), onednn_(layer, ctx, algorithm) {}

LayoutPtr OwnPool2DKernel::plan(std::int64_t batch, const LayoutPtr& src) {
  const memory::desc& src_md = md_of(src);
  std::optional<PoolGeometry> geometry = pool_geometry(layer_, src_md);
  if (!geometry || !covers(*geometry)) return onednn_.plan(batch, src);
  Plan& p = plans_.emplace_back();
  p.batch = batch;
  p.geometry = std::move(*geometry);
  p.dtype = dtype_of(src_md);
  const Shape out = layer_.output_shape().with_batch(batch);
  const Arrangement& in = p.geometry.src;
  const bool channels_last = canonical_output_ && in.groups * in.lanes == out[3];  // no padding lanes
  const memory::desc dst_md = channels_last ? canonical_md(out, p.dtype)
                                            : arranged_like(in, {batch, out[3], out[1], out[2]}, src_md.data_type());
  p.geometry.dst = *arrangement_of(dst_md);
  if (channels_last) {
    // Seen in the input's channel groups: group g's lanes at g * lanes in each position.
    p.geometry.dst.lanes = in.lanes;
    p.geometry.dst.groups = in.groups;
    p.geometry.dst.group = in.lanes;
  }
  p.dst_elements = static_cast<std::int64_t>(dst_md.get_size() / memory::data_type_size(src_md.data_type()));
  p.windows = std::make_unique<PoolWindows>(p.geometry);
  planned(p);
  return make_layout(out, p.dtype, dst_md);
}

bool OwnPool2DKernel::take_input_activation_backward(config::Activation below) {
  relu_below_ = below == config::Activation::relu;
  return relu_below_;
}

void OwnPool2DKernel::bind(std::int64_t batch, const nn::LayerIO& io) {
  Plan* p = own_plan(batch);
  if (!p) {
    onednn_.bind(batch, io);
    if (relu_below_ && io.diff_src)
      relu_.bind(ctx_, ctx_.wrap(io.src), ctx_.wrap(io.diff_src), fallback_relu_.emplace_back(batch, ActivationFn::Plan{}).second);
    return;
  }
  p->src = ctx_.wrap(io.src);
  p->dst = ctx_.wrap(io.dst);
  p->diff_dst = ctx_.wrap(io.diff_dst);
  if (io.diff_src) p->diff_src = ctx_.wrap(io.diff_src);
}

void OwnPool2DKernel::forward(std::int64_t batch, const nn::StepContext& step) {
  Plan* p = own_plan(batch);
  if (!p) return onednn_.forward(batch, step);
  forward_planes(*p);
}

void OwnPool2DKernel::backward(std::int64_t batch, const nn::StepContext& step) {
  Plan* p = own_plan(batch);
  if (!p) {
    onednn_.backward(batch, step);
    // oneDNN's pooling cannot apply the relu's derivative: it runs after it, on the gradient.
    if (relu_below_)
      for (auto& [planned_batch, act] : fallback_relu_)
        if (planned_batch == batch) relu_.backward(ctx_, act);
    return;
  }
  if (p->diff_src) backward_planes(*p);  // else the first layer: nothing below wants the gradient
}

OwnPool2DKernel::Plan* OwnPool2DKernel::own_plan(std::int64_t batch) {
  for (auto& p : plans_)
    if (p.batch == batch) return &p;
  return nullptr;
}

}  // namespace dtrain::backends::onednn
