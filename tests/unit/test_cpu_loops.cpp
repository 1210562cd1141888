// The CPU backend's own loops (backends/onednn/lanes.hpp) on what the model tests cannot reach on
// every machine: max and average pooling, batch normalization and dropout's masks in each build of their loops
// this CPU runs (x86-64, AVX2, AVX-512, chosen per context), over f32 and bfloat16 values, in each
// channel arrangement the loops take. A max moves values and its gradient copies them, so results
// must equal the oracle's on the same (bfloat16-representable) values exactly; batch normalization
// agrees to float's precision; dropout keeps exactly nn::dropout_mask's elements. No bfloat16
// instructions are needed.
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "backends/onednn/context.hpp"
#include "backends/onednn/lanes.hpp"
#include "backends/onednn/weighted_op.hpp"
#include "core/rng.hpp"
#include "nn/batch_normalization.hpp"
#include "nn/dense.hpp"
#include "nn/dropout.hpp"
#include "nn/kernel.hpp"
#include "core/bfloat16.hpp"
#include "nn/average_pooling2d.hpp"
#include "nn/max_pool2d.hpp"
#include "loop_levels.hpp"
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
  bool average = false;     // average pooling, else max pooling
};

// v rounded to `dtype` as the loops store a computed value: to float, then to bfloat16's nearest even.
double stored_as(DType dtype, double v) {
  const auto f = static_cast<float>(v);
  if (dtype != DType::bf16) return f;
  return testing::bf16_value(f);
}

// Runs one pooling kernel built with the loops of `isa` forward and backward and compares it with
// the oracle. Inputs and gradients are multiples of 1/8: max pooling moves values and its gradient
// copies them (or, for overlapping windows, sums them, exactly in f32); average pooling's sums are
// exact and its one division rounds as the oracle's quotient rounded to the dtype (overlapping
// cases divide by powers of two, so their sums of shares are exact too). So results must equal the
// oracle's on the same values exactly, whatever the dtype and the ISA.
void check_pooling(const PoolingCase& t, backends::onednn::LoopIsa isa) {
  CAPTURE(backends::onednn::name_of(isa));
  CAPTURE(std::string(dtype_name(t.dtype)));
  CAPTURE(static_cast<int>(t.tag));
  CAPTURE(t.in.to_string());
  CAPTURE(t.relu_below);
  CAPTURE(t.average);
  // A context of its own: the loop level is chosen per context, before its kernels are made.
  const std::unique_ptr<device::Context> owned = device::make_context(Device{});
  device::Context& ctx = *owned;
  backends::onednn::OnednnContext::of(ctx).set_loop_isa(isa);
  nn::Pool2DParams o;
  o.pool_size = {t.pool, t.pool};
  o.strides = std::array<int, 2>{t.stride, t.stride};
  o.padding = t.padding;
  std::unique_ptr<nn::Layer> pooling;
  if (t.average) pooling = std::make_unique<nn::AveragePooling2D>("pool", nn::AveragePooling2DOptions{o});
  else pooling = std::make_unique<nn::MaxPool2D>("pool", nn::MaxPool2DOptions{o});
  nn::Layer& layer = *pooling;
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
          // Max pooling: distinct values (no ties to break); average pooling: exact sums.
          float v = t.average ? std::floor(rng.uniform(-64.0f, 64.0f)) / 8.0f
                              : rng.uniform(-8.0f, 8.0f) + static_cast<float>(k) * 1e-3f;
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
  for (double& v : y) v = stored_as(t.dtype, v);
  for (double& v : dx) v = stored_as(t.dtype, v);
  CHECK(mismatches(dst.get(), dst_md, y, out) == 0);
  CHECK(mismatches(diff_src.get(), src_md, dx, in) == 0);
}

struct BatchNormCase {
  DType dtype;
  memory::format_tag tag;
  Shape in;
};

// Batch normalization built with the loops of `isa`, forward and backward in training, on an input
// in the layout `t.tag` (channels past the last full block leave padding lanes, which must come
// out zero in y and dx), against the oracle on the same values.
void check_batch_norm(const BatchNormCase& t, backends::onednn::LoopIsa isa) {
  CAPTURE(backends::onednn::name_of(isa));
  CAPTURE(std::string(dtype_name(t.dtype)));
  CAPTURE(static_cast<int>(t.tag));
  CAPTURE(t.in.to_string());
  const std::unique_ptr<device::Context> owned = device::make_context(Device{});
  device::Context& ctx = *owned;
  backends::onednn::OnednnContext::of(ctx).set_loop_isa(isa);
  nn::BatchNormalization layer("bn", nn::BatchNormalizationOptions{});
  Rng init(1, RngStream::test);
  const Shape& in = t.in;
  layer.build(1, in, init);
  Rng rng(2, RngStream::test);
  std::vector<std::vector<double>> vars;
  for (auto& v : layer.variables()) {
    for (float& value : v.value.span<float>()) value = rng.uniform(0.5f, 1.5f);
    vars.emplace_back(v.value.span<float>().begin(), v.value.span<float>().end());
  }
  nn::Layer* layers[] = {&layer};
  const DType compute[] = {DType::f32};
  auto kernels = nn::make_kernels(layers, ctx, compute);
  const std::int64_t n = 3, c = in[2];
  const memory::desc src_md({n, c, in[0], in[1]}, backends::onednn::to_dnnl(t.dtype), t.tag);
  const device::LayoutPtr src_layout = backends::onednn::make_layout(in.with_batch(n), t.dtype, src_md);
  const device::LayoutPtr dst_layout = kernels[0]->plan(n, src_layout);
  const memory::desc& dst_md = backends::onednn::md_of(dst_layout);
  REQUIRE(dst_md.data_type() == memory::data_type::f32);
  auto src = ctx.allocate(src_layout->bytes()), dst = ctx.allocate(dst_layout->bytes());
  auto diff_dst = ctx.allocate(dst_layout->bytes()), diff_src = ctx.allocate(src_layout->bytes());
  kernels[0]->bind(n, {{src_layout, src.get()}, {dst_layout, dst.get()}, {dst_layout, diff_dst.get()},
                       {src_layout, diff_src.get()}});
  // NaN in every padding lane of x and dy: y and dx must still be zero there.
  std::memset(src.get(), 0xff, src_layout->bytes());
  std::memset(diff_dst.get(), 0xff, dst_layout->bytes());
  std::memset(diff_src.get(), 0x7f, src_layout->bytes());
  std::vector<double> x(static_cast<std::size_t>(in.with_batch(n).numel())), dy(x.size());
  const Values xs{t.dtype, src.get()}, dys{DType::f32, diff_dst.get()};
  for (std::int64_t b = 0; b < n; ++b)
    for (std::int64_t h = 0; h < in[0]; ++h)
      for (std::int64_t w = 0; w < in[1]; ++w)
        for (std::int64_t k = 0; k < c; ++k) {
          const auto i = static_cast<std::size_t>(((b * in[0] + h) * in[1] + w) * c + k);
          x[i] = xs.set(offset_of(src_md, b, k, h, w), rng.uniform(-2.0f, 3.0f) + static_cast<float>(k));
          dy[i] = dys.set(offset_of(dst_md, b, k, h, w), rng.uniform(-1.0f, 1.0f));
        }
  const nn::StepContext step = testing::step_of(nn::Mode::training, n);
  kernels[0]->forward(n, step);
  kernels[0]->backward(n, step);
  std::vector<double> y(x.size()), dx(x.size());
  layer.reference_forward({n, x, vars, y}, step);
  std::vector<std::vector<double>> dvars(vars.size());
  for (std::size_t v = 0; v < vars.size(); ++v) dvars[v].resize(vars[v].size());
  layer.reference_backward({n, x, y, dy, vars, dx, dvars}, step);
  // The kernel's values (dtype `dt` in layout `md`) against the oracle's, and zero in the padding.
  auto worst = [&](void* values, DType dt, const memory::desc& md, const std::vector<double>& expected) {
    const Values v{dt, values};
    double err = 0;
    const std::int64_t padded = md.data.padded_dims[1];
    for (std::int64_t b = 0; b < n; ++b)
      for (std::int64_t h = 0; h < in[0]; ++h)
        for (std::int64_t w = 0; w < in[1]; ++w)
          for (std::int64_t k = 0; k < padded; ++k) {
            const double got = v.get(offset_of(md, b, k, h, w));
            const double want = k < c ? expected[static_cast<std::size_t>(((b * in[0] + h) * in[1] + w) * c + k)] : 0.0;
            err = std::max(err, std::isfinite(got) ? std::abs(got - want) / (1.0 + std::abs(want)) : 1e30);
          }
    return err;
  };
  CHECK(worst(dst.get(), DType::f32, dst_md, y) < 1e-5);
  // dx in bf16 is rounded once, to nearest.
  CHECK(worst(diff_src.get(), t.dtype, src_md, dx) < (t.dtype == DType::bf16 ? 8e-3 : 1e-5));
  const auto variables = layer.variables();
  for (std::size_t v = 0; v < variables.size(); ++v) {
    CAPTURE(variables[v].name);
    const auto grad = variables[v].grad.span<float>();
    for (std::size_t k = 0; k < grad.size(); ++k)
      CHECK(std::abs(grad[k] - dvars[v][k]) <= 1e-5 * (1.0 + std::abs(dvars[v][k])));
  }
}

// Dropout built with the loops of `isa`: it keeps exactly the elements nn::dropout_mask keeps.
void check_dropout_masks(std::int64_t elements, backends::onednn::LoopIsa isa) {
  CAPTURE(backends::onednn::name_of(isa));
  CAPTURE(elements);
  const std::unique_ptr<device::Context> owned = device::make_context(Device{});
  device::Context& ctx = *owned;
  backends::onednn::OnednnContext::of(ctx).set_loop_isa(isa);
  nn::Dropout layer("dropout", nn::DropoutOptions{0.3});
  Rng init(1, RngStream::test);
  const Shape in{elements};
  layer.build(4, in, init);
  nn::Layer* layers[] = {&layer};
  const DType compute[] = {DType::f32};
  auto kernels = nn::make_kernels(layers, ctx, compute);
  const std::int64_t n = 3;
  const device::LayoutPtr layout = ctx.canonical_layout(in.with_batch(n), DType::f32);
  REQUIRE(kernels[0]->plan(n, layout)->same_as(*layout));
  auto src = ctx.allocate(layout->bytes()), dst = ctx.allocate(layout->bytes());
  auto diff_dst = ctx.allocate(layout->bytes()), diff_src = ctx.allocate(layout->bytes());
  kernels[0]->bind(n, {{layout, src.get()}, {layout, dst.get()}, {layout, diff_dst.get()}, {layout, diff_src.get()}});
  std::fill_n(static_cast<float*>(src.get()), n * elements, 1.0f);
  nn::StepContext step = testing::step_of(nn::Mode::training, n);
  step.seed = 0x123456789abcdefull;
  step.global_step = 77;
  kernels[0]->forward(n, step);
  std::vector<std::uint8_t> keep(static_cast<std::size_t>(elements));
  int wrong = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    nn::dropout_mask(step.seed, step.global_step, nn::sample_id(step, i), 4, 0.3, elements, keep.data());
    for (std::int64_t e = 0; e < elements; ++e)
      wrong += (static_cast<const float*>(dst.get())[i * elements + e] != 0.0f) != (keep[static_cast<std::size_t>(e)] != 0);
  }
  CHECK(wrong == 0);
}

struct DenseCase {
  std::int64_t batch, in, units;
  config::Activation activation;
  bool bias;
  DType src = DType::f32;  // x's dtype (bf16: below a bfloat16 layer; the dense layer computes in f32)
  bool below = true;       // a layer below wants the input gradient
};

std::vector<std::byte> bytes_of(const void* at, std::size_t size) {
  const auto* b = static_cast<const std::byte*>(at);
  return {b, b + size};
}
template <class T>
std::vector<std::byte> bytes_of(const std::vector<T>& v) {
  return bytes_of(v.data(), v.size() * sizeof(T));
}

// What check_dense computed, as the bytes each memory holds: y, dx (empty without a layer below),
// and each variable's gradient.
struct DenseBytes {
  std::vector<std::byte> y, dx;
  std::vector<std::vector<std::byte>> grads;
  // The values the layer computed from: x (widened from bfloat16 where it is), dy, the variables.
  std::vector<float> x, dy;
  std::vector<std::vector<float>> vars;
};

// A small dense layer (dense.cpp's own loops) built for `isa`, forward and backward in training on
// a plain row-major x, against the oracle on the same values: y, dx, and the kernel's and bias's
// gradients, every element written (the memories start as NaN).
DenseBytes check_dense(const DenseCase& t, backends::onednn::LoopIsa isa) {
  CAPTURE(backends::onednn::name_of(isa));
  CAPTURE(t.batch);
  CAPTURE(t.in);
  CAPTURE(t.units);
  CAPTURE(static_cast<int>(t.activation));
  CAPTURE(t.bias);
  CAPTURE(std::string(dtype_name(t.src)));
  REQUIRE(backends::onednn::dense_loops_pay(t.batch, t.in, t.units));
  const std::unique_ptr<device::Context> owned = device::make_context(Device{});
  device::Context& ctx = *owned;
  backends::onednn::OnednnContext::of(ctx).set_loop_isa(isa);
  nn::DenseOptions o;
  o.units = static_cast<int>(t.units);
  o.activation = t.activation;
  o.use_bias = t.bias;
  nn::Dense layer("dense", o);
  Rng init(1, RngStream::test);
  layer.build(1, Shape{t.in}, init);
  Rng rng(2, RngStream::test);
  std::vector<std::vector<double>> vars;
  for (auto& v : layer.variables()) {
    for (float& value : v.value.span<float>()) value = rng.uniform(-1.0f, 1.0f);
    std::fill(v.grad.span<float>().begin(), v.grad.span<float>().end(), std::numeric_limits<float>::quiet_NaN());
    vars.emplace_back(v.value.span<float>().begin(), v.value.span<float>().end());
  }
  nn::Layer* layers[] = {&layer};
  const DType compute[] = {DType::f32};
  auto kernels = nn::make_kernels(layers, ctx, compute);
  const std::int64_t n = t.batch;
  const memory::desc src_md({n, t.in}, backends::onednn::to_dnnl(t.src), memory::format_tag::nc);
  const device::LayoutPtr src_layout = backends::onednn::make_layout(Shape{n, t.in}, t.src, src_md);
  const device::LayoutPtr dst_layout = kernels[0]->plan(n, src_layout);
  REQUIRE(backends::onednn::md_of(dst_layout) == memory::desc({n, t.units}, memory::data_type::f32, memory::format_tag::nc));
  auto src = ctx.allocate(src_layout->bytes()), dst = ctx.allocate(dst_layout->bytes());
  auto diff_dst = ctx.allocate(dst_layout->bytes()), diff_src = ctx.allocate(src_layout->bytes());
  const device::Memory below = t.below ? device::Memory{src_layout, diff_src.get()} : device::Memory{};
  kernels[0]->bind(n, {{src_layout, src.get()}, {dst_layout, dst.get()}, {dst_layout, diff_dst.get()}, below});
  std::memset(dst.get(), 0xff, dst_layout->bytes());
  std::memset(diff_src.get(), 0xff, src_layout->bytes());
  std::vector<double> x(static_cast<std::size_t>(n * t.in)), dy(static_cast<std::size_t>(n * t.units));
  const Values xs{t.src, src.get()}, dys{DType::f32, diff_dst.get()};
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = xs.set(i, rng.uniform(-1.0f, 1.0f));
  for (std::size_t i = 0; i < dy.size(); ++i) dy[i] = dys.set(i, rng.uniform(-1.0f, 1.0f));
  const nn::StepContext step = testing::step_of(nn::Mode::training, n);
  kernels[0]->forward(n, step);
  kernels[0]->backward(n, step);
  std::vector<double> y(dy.size()), dx(x.size());
  layer.reference_forward({n, x, vars, y}, step);
  std::vector<std::vector<double>> dvars(vars.size());
  for (std::size_t v = 0; v < vars.size(); ++v) dvars[v].resize(vars[v].size());
  layer.reference_backward({n, x, y, dy, vars, dx, dvars}, step);
  // Sums of up to a few hundred products of values in [-1, 1]: float's rounding stays far below
  // 1e-4; a wrong index or a missed term is off by the size of one term.
  auto worst = [](const Values& got, const std::vector<double>& want) {
    double err = 0;
    for (std::size_t i = 0; i < want.size(); ++i) {
      const double g = got.get(i);
      err = std::max(err, std::isfinite(g) ? std::abs(g - want[i]) / (1.0 + std::abs(want[i])) : 1e30);
    }
    return err;
  };
  CHECK(worst({DType::f32, dst.get()}, y) < 1e-4);
  // dx in bf16 is rounded once, to nearest.
  if (t.below) CHECK(worst({t.src, diff_src.get()}, dx) < (t.src == DType::bf16 ? 8e-3 : 1e-4));
  const auto variables = layer.variables();
  for (std::size_t v = 0; v < variables.size(); ++v) {
    CAPTURE(variables[v].name);
    CHECK(worst({DType::f32, variables[v].grad.raw()}, dvars[v]) < 1e-4);
  }
  DenseBytes out{bytes_of(dst.get(), dst_layout->bytes()), t.below ? bytes_of(diff_src.get(), src_layout->bytes()) : std::vector<std::byte>{}, {},
                 std::vector<float>(x.begin(), x.end()), std::vector<float>(dy.begin(), dy.end()), {}};
  for (const Variable& v : variables) out.grads.push_back(bytes_of(v.grad.raw(), v.grad.bytes()));
  for (const auto& v : vars) out.vars.emplace_back(v.begin(), v.end());
  return out;
}

// y, dx and the variables' gradients of two runs hold the same bytes.
void check_same_bytes(const DenseBytes& a, const DenseBytes& b) {
  CHECK(a.y == b.y);
  CHECK(a.dx == b.dx);
  REQUIRE(a.grads.size() == b.grads.size());
  for (std::size_t v = 0; v < a.grads.size(); ++v) {
    CAPTURE(v);
    CHECK(a.grads[v] == b.grads[v]);
  }
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
      // Overlapping windows add gradients (f32 only), gathered per input position; below a relu,
      // the winner byte carries its derivative. 3x3 at stride 2 over 8-channel blocks: the
      // ResNet-style stem pooling, up to 4 windows per input position.
      {DType::f32, nhwc, Shape{7, 6, 24}, 3, 1, valid, true},
      {DType::f32, nChw16c, Shape{7, 7, 16}, 3, 2, same, false},
      {DType::f32, nChw8c, Shape{9, 10, 16}, 3, 2, valid, true},
      {DType::f32, nChw8c, Shape{9, 10, 16}, 3, 2, same, true},
      {DType::bf16, nhwc, Shape{6, 7, 5}, 2, 2, valid, false},
      {DType::bf16, nhwc, Shape{8, 10, 32}, 2, 2, valid, true},
      {DType::bf16, nChw16c, Shape{10, 8, 32}, 3, 3, same, true},
      {DType::bf16, nChw8c, Shape{8, 8, 12}, 2, 3, valid, false},
  };
  for (const auto isa : testing::loop_isas_here())
    for (const PoolingCase& t : cases) check_pooling(t, isa);
}

TEST_CASE("average pooling on every instruction set the CPU has: f32 and bfloat16, channels last and in blocks "
          "of 8 and 16, padding not counted, with and without the relu's derivative") {
  using memory::format_tag::nChw16c, memory::format_tag::nChw8c, memory::format_tag::nhwc;
  const config::Padding valid = config::Padding::valid, same = config::Padding::same;
  const std::vector<PoolingCase> cases = {
      // fashion_mnist_bn_dropout.yaml's: 2x2 windows over 64 channels of an odd plane, a relu below.
      {DType::f32, nChw8c, Shape{11, 11, 64}, 2, 2, valid, true, true},
      {DType::f32, nChw16c, Shape{11, 11, 32}, 2, 2, valid, true, true},
      {DType::f32, nhwc, Shape{6, 7, 5}, 2, 2, valid, false, true},
      // Windows of 9, 6 and 4 positions ('same' padding is not counted); rows and columns in none.
      {DType::f32, nChw16c, Shape{10, 8, 20}, 3, 3, same, false, true},
      {DType::f32, nChw8c, Shape{8, 8, 12}, 3, 3, valid, true, true},
      // Overlapping windows add their shares (f32 only); 2x2 windows at stride 1 divide by 4, 2 or 1.
      {DType::f32, nhwc, Shape{7, 6, 24}, 2, 1, same, true, true},
      {DType::f32, nChw16c, Shape{7, 7, 16}, 2, 1, valid, false, true},
      {DType::bf16, nhwc, Shape{6, 7, 5}, 2, 2, valid, false, true},
      {DType::bf16, nChw16c, Shape{11, 11, 32}, 2, 2, valid, true, true},
      {DType::bf16, nChw16c, Shape{10, 8, 32}, 3, 3, same, true, true},
      {DType::bf16, nChw8c, Shape{8, 8, 12}, 2, 3, valid, false, true},
  };
  for (const auto isa : testing::loop_isas_here())
    for (const PoolingCase& t : cases) check_pooling(t, isa);
}

TEST_CASE("batch normalization on every instruction set the CPU has: f32 and bfloat16 inputs, channels last and "
          "in blocks of 8 and 16, with padding lanes") {
  using memory::format_tag::nChw16c, memory::format_tag::nChw8c, memory::format_tag::nhwc;
  const std::vector<BatchNormCase> cases = {
      {DType::f32, nChw16c, Shape{6, 7, 32}}, {DType::f32, nChw16c, Shape{5, 5, 20}},
      {DType::f32, nChw8c, Shape{4, 6, 12}},  {DType::f32, nhwc, Shape{6, 5, 5}},
      {DType::f32, nhwc, Shape{4, 4, 64}},    {DType::bf16, nChw16c, Shape{5, 5, 20}},
      {DType::bf16, nhwc, Shape{6, 5, 5}},
  };
  for (const auto isa : testing::loop_isas_here())
    for (const BatchNormCase& t : cases) check_batch_norm(t, isa);
}

TEST_CASE("dropout draws nn::dropout_mask's masks on every instruction set the CPU has") {
  for (const auto isa : testing::loop_isas_here())
    for (const std::int64_t elements : {1, 3, 4, 5, 31, 32, 33, 64, 127, 1600}) check_dropout_masks(elements, isa);
}

TEST_CASE("small dense layers' own loops match the oracle on every instruction set the CPU has: odd sizes, batch "
          "1 to 33, with and without a bias, linear, relu and softmax, float32 and bfloat16 inputs") {
  using config::Activation;
  const std::vector<DenseCase> cases = {
      // The seed CNN's logits in a lane of 32 rows, and the bn_dropout experiment's.
      {32, 64, 10, Activation::linear, true},
      {32, 128, 10, Activation::linear, true},
      {1, 64, 10, Activation::linear, true},
      {3, 7, 5, Activation::relu, true},
      {33, 17, 3, Activation::relu, false},
      {33, 5, 33, Activation::linear, false},
      {5, 31, 16, Activation::relu, true},
      {7, 40, 70, Activation::relu, true},
      {9, 257, 17, Activation::linear, true},
      {4, 12, 64, Activation::softmax, true},
      {3, 9, 1, Activation::linear, true},
      // 1-3 outputs and inputs a multiple of the vector (the kernel's gradient as transposed
      // sums): an AVX2 vector of one row's outputs spans several rows, and must stop at dW's end.
      {7, 48, 1, Activation::relu, true},
      {5, 16, 2, Activation::linear, true},
      {9, 24, 3, Activation::linear, false},
      {2, 8, 1, Activation::linear, true},
      {2, 6, 10, Activation::linear, true, DType::f32, false},  // the first layer: no dx
      {32, 64, 10, Activation::linear, true, DType::bf16},
      {33, 19, 21, Activation::relu, false, DType::bf16},
      {17, 32, 2, Activation::linear, true, DType::bf16},
  };
  for (const auto isa : testing::loop_isas_here())
    for (const DenseCase& t : cases) check_dense(t, isa);
}

TEST_CASE("small dense layers' own loops: AVX-512 and AVX2 give the same bits (one multiply-add a product, in "
          "the same order), 16 outputs or fewer among them (their gradients as transposed sums on AVX-512)") {
  const auto levels = testing::loop_isas_here();
  using backends::onednn::LoopIsa;
  if (std::find(levels.begin(), levels.end(), LoopIsa::x86_64_v4) == levels.end()) {
    MESSAGE("this CPU has no AVX-512: the AVX-512 loops are not run here");
    return;
  }
  using config::Activation;
  const std::vector<DenseCase> cases = {
      {32, 64, 10, Activation::linear, true},   // the seed CNN's logits in a lane
      {32, 128, 10, Activation::linear, true},  // bn_dropout's
      {7, 48, 1, Activation::relu, true},       // 1 output: 4 vectors of inputs a pass
      {9, 32, 16, Activation::linear, false},   // 16 outputs: one vector a pass
      {5, 31, 16, Activation::relu, true},      // 31 inputs: the product
      {4, 12, 64, Activation::softmax, true},   // 64 outputs: the product
      {32, 64, 10, Activation::linear, true, DType::bf16},
      {17, 96, 7, Activation::relu, false, DType::bf16},
  };
  for (const DenseCase& t : cases) {
    CAPTURE(t.batch);
    CAPTURE(t.in);
    CAPTURE(t.units);
    CAPTURE(std::string(dtype_name(t.src)));
    check_same_bytes(check_dense(t, LoopIsa::x86_64_v4), check_dense(t, LoopIsa::x86_64_v3));
  }
}

namespace {

// What the loops must compute, bit for bit, where the CPU fuses multiply-adds: each sum one fused
// multiply-add a term, its terms in index order from its start (the bias, or zero); the bias's
// gradient plain additions in sample order; dx rounded to x's dtype. Linear or relu.
DenseBytes dense_by_fused_chains(const DenseCase& t, const DenseBytes& in) {
  const std::int64_t n = t.batch, I = t.in, O = t.units;
  const bool relu = t.activation == config::Activation::relu;
  const std::vector<float>& x = in.x;
  const std::vector<float>& kernel = in.vars[0];
  std::vector<float> y(static_cast<std::size_t>(n * O)), dz(y.size()), dW(kernel.size()), db(static_cast<std::size_t>(O));
  for (std::int64_t r = 0; r < n; ++r)
    for (std::int64_t o = 0; o < O; ++o) {
      float s = t.bias ? in.vars[1][o] : 0.0f;
      for (std::int64_t i = 0; i < I; ++i) s = std::fma(x[r * I + i], kernel[i * O + o], s);
      y[r * O + o] = relu ? (s > 0.0f ? s : 0.0f) : s;
      dz[r * O + o] = relu && !(y[r * O + o] > 0.0f) ? 0.0f : in.dy[r * O + o];
    }
  for (std::int64_t i = 0; i < I; ++i)
    for (std::int64_t o = 0; o < O; ++o) {
      float s = 0.0f;
      for (std::int64_t r = 0; r < n; ++r) s = std::fma(x[r * I + i], dz[r * O + o], s);
      dW[i * O + o] = s;
    }
  for (std::int64_t o = 0; o < O; ++o) {
    float s = 0.0f;
    for (std::int64_t r = 0; r < n; ++r) s += dz[r * O + o];
    db[o] = s;
  }
  DenseBytes want{bytes_of(y), {}, {bytes_of(dW)}, {}, {}, {}};
  if (t.bias) want.grads.push_back(bytes_of(db));
  if (t.below) {
    std::vector<float> dx(x.size());
    for (std::int64_t r = 0; r < n; ++r)
      for (std::int64_t i = 0; i < I; ++i) {
        float s = 0.0f;
        for (std::int64_t o = 0; o < O; ++o) s = std::fma(dz[r * O + o], kernel[i * O + o], s);
        dx[r * I + i] = s;
      }
    if (t.src == DType::bf16) {
      std::vector<std::uint16_t> codes(dx.size());
      for (std::size_t e = 0; e < dx.size(); ++e) codes[e] = bf16_from_f32_bits(std::bit_cast<std::uint32_t>(dx[e]));
      want.dx = bytes_of(codes);
    } else {
      want.dx = bytes_of(dx);
    }
  }
  return want;
}

}  // namespace

TEST_CASE("small dense layers' own loops: every sum is one fused multiply-add a term in index order, bit for bit, "
          "on every instruction set the CPU has with FMA (the product, and the transposed sums and blocks of small "
          "layers)") {
  using backends::onednn::LoopIsa;
  using config::Activation;
  const std::vector<DenseCase> cases = {
      {32, 64, 10, Activation::linear, true},    // the seed CNN's logits in a lane
      {32, 128, 10, Activation::relu, true},     // bn_dropout's, relu
      {30, 64, 10, Activation::linear, true},    // rows not a multiple of the passes'
      {7, 24, 10, Activation::linear, false},    // 24 inputs: AVX2's last block of 8
      {5, 40, 3, Activation::relu, true},        // 3 outputs: several vectors of inputs a pass
      {9, 16, 8, Activation::linear, true},      // 8 outputs: one whole block on AVX2
      {6, 32, 12, Activation::linear, true},     // 12: AVX2's widest transposed sums
      {6, 32, 13, Activation::relu, true},       // 13: the product on AVX2
      {4, 48, 16, Activation::linear, true},     // 16: AVX-512's widest
      {3, 17, 5, Activation::linear, true},      // 17 inputs: the product
      {1, 64, 10, Activation::relu, true},       // one row
      {33, 5, 33, Activation::linear, false},    // 33 outputs: the product
      {2, 6, 10, Activation::linear, true, DType::f32, false},  // the first layer: no dx
      {32, 64, 10, Activation::linear, true, DType::bf16},      // below a bfloat16 layer
      {11, 40, 7, Activation::relu, false, DType::bf16},
  };
  int ran = 0;
  for (const LoopIsa isa : testing::loop_isas_here()) {
    if (isa == LoopIsa::x86_64) continue;  // no FMA: a multiply, then an addition
    for (const DenseCase& t : cases) {
      CAPTURE(backends::onednn::name_of(isa));
      CAPTURE(t.batch);
      CAPTURE(t.in);
      CAPTURE(t.units);
      CAPTURE(std::string(dtype_name(t.src)));
      const DenseBytes got = check_dense(t, isa);
      check_same_bytes(got, dense_by_fused_chains(t, got));
      ++ran;
    }
  }
  if (ran == 0) MESSAGE("this CPU has no FMA (x86-64-v3): the fused loops are not run here");
}

namespace {

// load_bytes_widened in the build for `isa` of lanes.hpp: every byte value in every lane, as the
// two-step conversion gives it.
struct WidenBytes {
  const std::uint8_t* bytes;
  std::int32_t* out;
  template <backends::onednn::LoopIsa isa>
  void operator()() const {
    using backends::onednn::Vec;
    constexpr int L = backends::onednn::float_lanes(isa) >= 8 ? 8 : 4;
    for (int at = 0; at < 256; at += L) {
      const Vec<std::int32_t, L> v = backends::onednn::load_bytes_widened<L>(bytes + at);
      for (int lane = 0; lane < L; ++lane) out[at + lane] = v[lane];
    }
  }
};

}  // namespace

TEST_CASE("bytes widen to 32-bit lanes exactly on every instruction set the CPU has (the pooling's winners)") {
  std::vector<std::uint8_t> bytes(256 + 16);
  for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<std::uint8_t>(i * 37 + 11);
  for (const auto isa : testing::loop_isas_here()) {
    std::vector<std::int32_t> out(bytes.size(), -1);
    backends::onednn::run_for(isa, WidenBytes{bytes.data(), out.data()});
    for (std::size_t i = 0; i < 256; ++i) CHECK(out[i] == bytes[i]);
  }
}

TEST_CASE("a dense kernel converted to bfloat16 pair blocks has the bits oneDNN's reorder writes: odd sizes, "
          "padding, ties, infinities and NaN") {
  // Dense writes its bfloat16 weights itself where oneDNN's inner product reads them in these
  // blocks (16 pairs on AMX, 8 with AVX512-BF16). On every CPU the positions are oneDNN's (its float32 reorder of each element's
  // index) and the bits a scalar rounding's; where the CPU has bfloat16 instructions, oneDNN's own
  // bfloat16 reorder, the one Dense replaces, is the oracle for every bit. (oneDNN 2.6.3's reorder
  // on an AVX2-only CPU writes -0 as +0, so it is no oracle there.)
  using dnnl::memory;
  const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(engine);
  const auto rounded = [](float v) {  // to nearest even, NaN quieted, subnormals rounded like the rest
    const auto bits = std::bit_cast<std::uint32_t>(v);
    if (v != v) return static_cast<std::uint16_t>((bits | 0x00400000u) >> 16);
    return static_cast<std::uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  };
  const std::vector<std::pair<std::int64_t, std::int64_t>> shapes = {{1600, 64}, {33, 70}, {20, 10}, {64, 16}, {1, 1}};
  struct Blocks {
    memory::format_tag format;
    std::int64_t pairs, block;
  };
  const std::vector<Blocks> layouts = {
      {memory::format_tag::AB16b64a2b, 16, 64}, {memory::format_tag::AB16b32a2b, 16, 32},
      {memory::format_tag::AB16b16a2b, 16, 16}, {memory::format_tag::AB8b64a2b, 8, 64},
      {memory::format_tag::AB8b32a2b, 8, 32},   {memory::format_tag::AB8b16a2b, 8, 16}};
  const float specials[] = {1.0f + 0x1p-8f,  // a tie: to even (1)
                            1.0f + 0x3p-8f,  // a tie: to even (up)
                            -0.0f, std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::max(),
                            std::numeric_limits<float>::denorm_min(), 0x1.fffffep-127f};
  Rng rng(3, RngStream::test);
  for (const auto& [in, out] : shapes)
    for (const auto& [format, pairs, block] : layouts) {
      CAPTURE(in);
      CAPTURE(out);
      CAPTURE(pairs);
      CAPTURE(block);
      std::vector<float> kernel(static_cast<std::size_t>(in * out));
      for (auto& v : kernel) v = rng.uniform(-2.0f, 2.0f);
      for (std::size_t i = 0; i < std::size(specials) && i < kernel.size(); ++i) kernel[i * 7 % kernel.size()] = specials[i];
      const memory::desc keras({out, in}, memory::data_type::f32, memory::format_tag::io);
      const memory::desc blocks({out, in}, memory::data_type::bf16, format);
      std::vector<std::uint32_t> ours(blocks.get_size() / 4, 0xdeadbeefu);  // the padding too must be written
      backends::onednn::kernel_to_pair_blocks(kernel.data(), in, out, pairs, block, ours.data());

      std::vector<float> index_plus_one(kernel.size());  // exact in float32 for these sizes
      std::iota(index_plus_one.begin(), index_plus_one.end(), 1.0f);
      memory indices(keras, engine, index_plus_one.data());
      memory positions(memory::desc({out, in}, memory::data_type::f32, format), engine);  // 0: the padding
      dnnl::reorder(indices, positions).execute(stream, indices, positions);
      stream.wait();
      const auto* at = static_cast<const float*>(positions.get_data_handle());
      std::size_t unequal = 0;
      for (std::size_t h = 0; h < 2 * ours.size(); ++h) {
        const auto half = static_cast<std::uint16_t>(ours[h / 2] >> (16 * (h % 2)));  // the even input low
        const auto index = static_cast<std::size_t>(at[h]);
        unequal += half != (index == 0 ? 0 : rounded(kernel[index - 1]));
      }
      CHECK(unequal == 0);

      if (!testing::cpu_has_bf16()) continue;
      memory from(keras, engine, kernel.data()), expected(blocks, engine);
      dnnl::reorder(from, expected).execute(stream, from, expected);
      stream.wait();
      const auto* want = static_cast<const std::uint32_t*>(expected.get_data_handle());
      unequal = 0;
      for (std::size_t i = 0; i < ours.size(); ++i) unequal += ours[i] != want[i];
      CHECK(unequal == 0);
    }
  if (!testing::cpu_has_bf16()) MESSAGE("oneDNN's bfloat16 reorder not compared: this CPU has no bfloat16 instructions");
}
