// The CPU backend's own loops (backends/onednn/lanes.hpp) on what the model tests cannot reach on
// every machine: max pooling in each build of its loops this CPU runs (x86-64, AVX2, AVX-512,
// chosen per context), over f32 and bfloat16 values, in each channel arrangement the loops take. A
// max moves values and its gradient copies them, so results must equal the oracle's on the same
// (bfloat16-representable) values exactly; no bfloat16 instructions are needed.
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "backends/onednn/context.hpp"
#include "core/rng.hpp"
#include "nn/kernel.hpp"
#include "nn/max_pool2d.hpp"
#include "test_support.hpp"

using namespace dtrain;
using dnnl::memory;

namespace {

std::uint16_t to_bf16(float v) { return static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(v) >> 16); }
float from_bf16(std::uint16_t v) { return std::bit_cast<float>(static_cast<std::uint32_t>(v) << 16); }

// Element (n, h, w, c) of a memory of descriptor `md` holding bf16, through oneDNN's own mapping.
std::size_t offset_of(const memory::desc& md, std::int64_t n, std::int64_t c, std::int64_t h, std::int64_t w) {
  const dnnl_memory_desc_t& d = md.data;
  const auto& b = d.format_desc.blocking;
  std::int64_t idx[4] = {n, c, h, w}, outer = 0, inner = 0, inner_stride = 1;
  std::int64_t blocked[4] = {idx[0], idx[1], idx[2], idx[3]};
  for (int i = b.inner_nblks - 1; i >= 0; --i) {
    const int dim = b.inner_idxs[i];
    inner += (idx[dim] % b.inner_blks[i]) * inner_stride;
    inner_stride *= b.inner_blks[i];
    blocked[dim] /= b.inner_blks[i];
  }
  for (int i = 0; i < 4; ++i) outer += blocked[i] * b.strides[i];
  return static_cast<std::size_t>(outer + inner);
}

// f32 or bf16 values of the layout `md`, as the kernel reads and writes them.
struct Values {
  DType dtype;
  void* data;
  double get(std::size_t i) const {
    if (dtype == DType::bf16) return from_bf16(static_cast<const std::uint16_t*>(data)[i]);
    return static_cast<const float*>(data)[i];
  }
  // Stores v (rounded to the dtype) and returns the value stored.
  double set(std::size_t i, float v) const {
    if (dtype == DType::bf16) {
      static_cast<std::uint16_t*>(data)[i] = to_bf16(v);
      return from_bf16(to_bf16(v));
    }
    static_cast<float*>(data)[i] = v;
    return v;
  }
};

struct PoolingCase {
  DType dtype;
  memory::format_tag tag;
  Shape in;
  int pool, stride;
  config::Padding padding;
  bool relu_below = false;  // the kernel applies a relu's derivative (its input is the relu's output)
};

// Runs one max pooling kernel built with the loops of `isa` forward and backward and compares it
// with the oracle. Max pooling moves values and its gradient copies them (or, for overlapping
// windows, sums gradients that are multiples of 1/8, exact in f32), so results must equal the
// oracle's on the same values exactly, whatever the dtype and the ISA.
void check_pooling(const PoolingCase& t, backends::onednn::LoopIsa isa) {
  CAPTURE(backends::onednn::name_of(isa));
  CAPTURE(dtype_name(t.dtype));
  CAPTURE(static_cast<int>(t.tag));
  CAPTURE(t.in.to_string());
  CAPTURE(t.relu_below);
  // A context of its own: the loop level is chosen per context, before its kernels are made.
  const std::unique_ptr<device::Context> owned = device::make_context(Device{});
  device::Context& ctx = *owned;
  backends::onednn::OnednnContext::of(ctx).set_loop_isa(isa);
  nn::MaxPool2DOptions o;
  o.pool_size = {t.pool, t.pool};
  o.strides = std::array<int, 2>{t.stride, t.stride};
  o.padding = t.padding;
  nn::MaxPool2D layer("pool", o);
  Rng init(1, RngStream::test);
  const Shape& in = t.in;
  const Shape out = layer.build(0, in, init);
  nn::Layer* layers[] = {&layer};
  const DType compute[] = {t.dtype};
  auto kernels = nn::make_kernels(layers, ctx, compute);
  if (t.relu_below) REQUIRE(kernels[0]->take_input_activation_backward(config::Activation::relu));
  const std::int64_t n = 3, c = in[2];
  const memory::desc src_md({n, c, in[0], in[1]}, backends::onednn::to_dnnl(t.dtype), t.tag);
  const device::LayoutPtr src_layout = backends::onednn::make_layout(in.with_batch(n), t.dtype, src_md);
  const device::LayoutPtr dst_layout = kernels[0]->plan(n, src_layout);
  const memory::desc& dst_md = backends::onednn::md_of(dst_layout);
  auto src = ctx.allocate(src_layout->bytes()), dst = ctx.allocate(dst_layout->bytes());
  auto diff_dst = ctx.allocate(dst_layout->bytes()), diff_src = ctx.allocate(src_layout->bytes());
  kernels[0]->bind(n, {{src_layout, src.get()}, {dst_layout, dst.get()}, {dst_layout, diff_dst.get()},
                       {src_layout, diff_src.get()}});
  // Garbage where the backward must write zeros.
  std::memset(diff_src.get(), 0x7f, src_layout->bytes());

  // The same values canonically in double for the oracle; distinct but for a relu's zeros.
  Rng rng(2, RngStream::test);
  std::vector<double> x(static_cast<std::size_t>(in.with_batch(n).numel()));
  std::vector<double> dy(static_cast<std::size_t>(out.with_batch(n).numel()));
  const Values xs{t.dtype, src.get()}, dys{t.dtype, diff_dst.get()};
  for (std::int64_t b = 0; b < n; ++b)
    for (std::int64_t h = 0; h < in[0]; ++h)
      for (std::int64_t w = 0; w < in[1]; ++w)
        for (std::int64_t k = 0; k < c; ++k) {
          float v = rng.uniform(-8.0f, 8.0f) + static_cast<float>(k) * 1e-3f;
          if (t.relu_below) v = std::max(v, 0.0f);
          x[static_cast<std::size_t>(((b * in[0] + h) * in[1] + w) * c + k)] = xs.set(offset_of(src_md, b, k, h, w), v);
        }
  for (std::int64_t b = 0; b < n; ++b)
    for (std::int64_t h = 0; h < out[0]; ++h)
      for (std::int64_t w = 0; w < out[1]; ++w)
        for (std::int64_t k = 0; k < c; ++k) {
          const float v = std::floor(rng.uniform(-8.0f, 8.0f)) / 8.0f;
          dy[static_cast<std::size_t>(((b * out[0] + h) * out[1] + w) * c + k)] = dys.set(offset_of(dst_md, b, k, h, w), v);
        }
  const nn::StepContext step = testing::step_of(nn::Mode::training, n);
  kernels[0]->forward(n, step);
  kernels[0]->backward(n, step);

  std::vector<double> y(dy.size()), dx(x.size());
  layer.reference_forward({n, x, {}, y}, step);
  std::vector<std::vector<double>> none;
  layer.reference_backward({n, x, y, dy, {}, dx, none}, step);
  // The relu's derivative: the gradient goes through where its output is above zero.
  if (t.relu_below)
    for (std::size_t i = 0; i < dx.size(); ++i) dx[i] = x[i] > 0.0 ? dx[i] : 0.0;
  // Values in the kernel's layout against the oracle's channels-last doubles.
  auto mismatches = [&](void* values, const memory::desc& md, const std::vector<double>& expected, const Shape& hw) {
    const Values v{t.dtype, values};
    int wrong = 0;
    for (std::int64_t b = 0; b < n; ++b)
      for (std::int64_t h = 0; h < hw[0]; ++h)
        for (std::int64_t w = 0; w < hw[1]; ++w)
          for (std::int64_t k = 0; k < c; ++k)
            wrong += v.get(offset_of(md, b, k, h, w)) !=
                     expected[static_cast<std::size_t>(((b * hw[0] + h) * hw[1] + w) * c + k)];
    return wrong;
  };
  CHECK(mismatches(dst.get(), dst_md, y, out) == 0);
  CHECK(mismatches(diff_src.get(), src_md, dx, in) == 0);
}

// Every level of the loops this CPU runs, narrowest first; one line for each it does not.
std::vector<backends::onednn::LoopIsa> loop_isas_here() {
  using backends::onednn::LoopIsa;
  std::vector<LoopIsa> isas;
  for (LoopIsa isa : {LoopIsa::x86_64, LoopIsa::x86_64_v3, LoopIsa::x86_64_v4}) {
    if (static_cast<int>(isa) <= static_cast<int>(backends::onednn::widest_loop_isa())) {
      isas.push_back(isa);
    } else {
      MESSAGE("skipped: this CPU (oneDNN isa " << backends::onednn::effective_isa() << ") has no "
                                               << backends::onednn::name_of(isa) << " for the loops' build");
    }
  }
  return isas;
}

}  // namespace

TEST_CASE("max pooling moves values exactly on every instruction set the CPU has: f32 and bfloat16, channels "
          "last and in blocks of 8 and 16, with and without the relu's derivative") {
  using memory::format_tag::nChw16c, memory::format_tag::nChw8c, memory::format_tag::nhwc;
  const config::Padding valid = config::Padding::valid, same = config::Padding::same;
  const std::vector<PoolingCase> cases = {
      // The seed CNN's first pooling: 2x2 windows over 32 channels, below them a relu.
      {DType::f32, nhwc, Shape{8, 10, 32}, 2, 2, valid, true},
      {DType::f32, nChw16c, Shape{8, 10, 32}, 2, 2, valid, true},
      {DType::f32, nhwc, Shape{6, 7, 5}, 2, 2, valid, false},
      {DType::f32, nChw8c, Shape{8, 8, 12}, 2, 3, valid, true},
      {DType::f32, nChw16c, Shape{10, 8, 32}, 3, 3, same, false},
      // Overlapping windows add gradients (f32 only).
      {DType::f32, nhwc, Shape{7, 6, 24}, 3, 1, valid, true},
      {DType::f32, nChw16c, Shape{7, 7, 16}, 3, 2, same, false},
      {DType::bf16, nhwc, Shape{6, 7, 5}, 2, 2, valid, false},
      {DType::bf16, nhwc, Shape{8, 10, 32}, 2, 2, valid, true},
      {DType::bf16, nChw16c, Shape{10, 8, 32}, 3, 3, same, true},
      {DType::bf16, nChw8c, Shape{8, 8, 12}, 2, 3, valid, false},
  };
  for (const auto isa : loop_isas_here())
    for (const PoolingCase& t : cases) check_pooling(t, isa);
}
