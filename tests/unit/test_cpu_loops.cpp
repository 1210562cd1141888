// The CPU backend's own loops (backends/onednn/lanes.hpp) on what the model tests cannot reach on
// every machine: max pooling over bfloat16 values, in each channel arrangement the loops take. A
// max moves values and its gradient copies them, so bfloat16 results must equal the oracle's on
// the same (bfloat16-representable) values exactly; no bfloat16 instructions are needed.
#include <doctest/doctest.h>

#include <bit>
#include <cstdint>
#include <cstring>
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

void check_bf16_pooling(memory::format_tag tag, const Shape& in, int pool, int stride, config::Padding padding) {
  CAPTURE(static_cast<int>(tag));
  CAPTURE(in.to_string());
  device::Context& ctx = testing::cpu();
  nn::MaxPool2DOptions o;
  o.pool_size = {pool, pool};
  o.strides = std::array<int, 2>{stride, stride};
  o.padding = padding;
  nn::MaxPool2D layer("pool", o);
  Rng init(1, RngStream::test);
  const Shape out = layer.build(0, in, init);
  nn::Layer* layers[] = {&layer};
  const DType compute[] = {DType::bf16};
  auto kernels = nn::make_kernels(layers, ctx, compute);
  const std::int64_t n = 3, c = in[2];
  const memory::desc src_md({n, c, in[0], in[1]}, memory::data_type::bf16, tag);
  const device::LayoutPtr src_layout = backends::onednn::make_layout(in.with_batch(n), DType::bf16, src_md);
  const device::LayoutPtr dst_layout = kernels[0]->plan(n, src_layout);
  const memory::desc& dst_md = backends::onednn::md_of(dst_layout);
  auto src = ctx.allocate(src_layout->bytes()), dst = ctx.allocate(dst_layout->bytes());
  auto diff_dst = ctx.allocate(dst_layout->bytes()), diff_src = ctx.allocate(src_layout->bytes());
  kernels[0]->bind(n, {{src_layout, src.get()}, {dst_layout, dst.get()}, {dst_layout, diff_dst.get()},
                       {src_layout, diff_src.get()}});

  // The same bfloat16 values canonically in double for the oracle; distinct, so no ties.
  Rng rng(2, RngStream::test);
  std::vector<double> x(static_cast<std::size_t>(in.with_batch(n).numel()));
  std::vector<double> dy(static_cast<std::size_t>(out.with_batch(n).numel()));
  auto* xs = static_cast<std::uint16_t*>(src.get());
  auto* dys = static_cast<std::uint16_t*>(diff_dst.get());
  for (std::int64_t b = 0; b < n; ++b)
    for (std::int64_t h = 0; h < in[0]; ++h)
      for (std::int64_t w = 0; w < in[1]; ++w)
        for (std::int64_t k = 0; k < c; ++k) {
          const std::uint16_t v = to_bf16(rng.uniform(-8.0f, 8.0f) + static_cast<float>(k) * 1e-3f);
          xs[offset_of(src_md, b, k, h, w)] = v;
          x[static_cast<std::size_t>(((b * in[0] + h) * in[1] + w) * c + k)] = from_bf16(v);
        }
  for (std::int64_t b = 0; b < n; ++b)
    for (std::int64_t h = 0; h < out[0]; ++h)
      for (std::int64_t w = 0; w < out[1]; ++w)
        for (std::int64_t k = 0; k < c; ++k) {
          const std::uint16_t v = to_bf16(rng.uniform(-1.0f, 1.0f));
          dys[offset_of(dst_md, b, k, h, w)] = v;
          dy[static_cast<std::size_t>(((b * out[0] + h) * out[1] + w) * c + k)] = from_bf16(v);
        }
  const nn::StepContext step = testing::step_of(nn::Mode::training, n);
  kernels[0]->forward(n, step);
  kernels[0]->backward(n, step);

  std::vector<double> y(dy.size()), dx(x.size());
  layer.reference_forward({n, x, {}, y}, step);
  std::vector<std::vector<double>> none;
  layer.reference_backward({n, x, y, dy, {}, dx, none}, step);
  // bf16 values in the kernel's layout against the oracle's channels-last doubles.
  auto mismatches = [&](const void* values, const auto& md, const std::vector<double>& expected,
                        const Shape& hw) {
    const auto* bits = static_cast<const std::uint16_t*>(values);
    int wrong = 0;
    for (std::int64_t b = 0; b < n; ++b)
      for (std::int64_t h = 0; h < hw[0]; ++h)
        for (std::int64_t w = 0; w < hw[1]; ++w)
          for (std::int64_t k = 0; k < c; ++k)
            wrong += from_bf16(bits[offset_of(md, b, k, h, w)]) !=
                     expected[static_cast<std::size_t>(((b * hw[0] + h) * hw[1] + w) * c + k)];
    return wrong;
  };
  CHECK(mismatches(dst.get(), dst_md, y, out) == 0);
  CHECK(mismatches(diff_src.get(), src_md, dx, in) == 0);
}

}  // namespace

TEST_CASE("max pooling moves bfloat16 values exactly: channels last and in blocks of 8 and 16") {
  check_bf16_pooling(memory::format_tag::nhwc, Shape{6, 7, 5}, 2, 2, config::Padding::valid);
  check_bf16_pooling(memory::format_tag::nChw16c, Shape{10, 8, 32}, 3, 3, config::Padding::same);
  check_bf16_pooling(memory::format_tag::nChw8c, Shape{8, 8, 12}, 2, 3, config::Padding::valid);
}
