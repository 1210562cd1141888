// Conv2D on oneDNN (nn/conv2d.hpp has the semantics).
//   x (N, H, W, C)            oneDNN src     (N, C, H, W), any layout
//   kernel (KH, KW, C, F)     oneDNN weights (F, C, KH, KW); the variable stays Keras HWIO
//   y (N, OH, OW, F)          oneDNN dst     (N, F, OH, OW), any layout; activation fused
// src, weights, dst and their gradients in the compute dtype (f32 or bf16); bias and the kernel's
// gradient always f32.
//
// The weights' gradients are this file's own loops for a first layer on grayscale or RGB images
// (oneDNN 2.6's AVX2 backward-weights kernel pads such an input to a block of 8 channels, computes
// 8 times the work and reached 6 GFLOP/s on the seed CNN's first layer), and for layers whose
// sample planes fit in the caches, such as small middle layers (the seed CNN's second
// convolution, the largest single item of its step: 56-58 GFLOP/s in oneDNN's kernel, 68-77 in
// these loops, one AVX2 core). Their oracle is the same as the primitive's
// (Conv2D::reference_backward, test_layers).
//   dW[kh][kw][c][f] = sum over n, oh, ow of x[n][oh*sh + kh - pt][ow*sw + kw - pl][c] * dy[n][oh][ow][f]
//   db[f]            = sum over n, oh, ow of dy[n][oh][ow][f]
// Each (kh, kw, c) is a tap; every tap's sum runs over L output channels at once (a vector). A
// pass holds G taps x V vectors of accumulators in registers and reads each output gradient
// vector once per G taps and each input value once per V vectors. Samples are summed in fixed
// chunks whose partial sums are added in chunk order, so the bits depend neither on the thread
// count nor on how taps and vectors are grouped into passes. An item of work is one chunk's sum
// for one group of V filter vectors; under lanes, a lane that has run its own items runs those the
// other lanes have not started (core/shared_work.hpp), into their partial sums: the same bits.
#include <omp.h>

#include <algorithm>
#include <array>
#include <utility>
#include <vector>

#include "backends/onednn/lanes.hpp"
#include "core/shared_work.hpp"
#include "backends/onednn/weighted_op.hpp"
#include "nn/conv2d.hpp"

namespace dtrain::backends::onednn {

namespace {

using dnnl::memory;

// What the loops need of one planned batch.
struct WeightLoopsGeometry {
  std::int64_t batch, c, h, w, oh, ow, kh, kw, sh, sw, pad_top, pad_left, filters;
  std::int64_t padded_h, padded_w;  // the input with its padding, as the loops read it
  Arrangement x, dy;
  int lanes;                         // L: output channels per vector
  std::int64_t filter_chunks;        // ceil(filters / L)
  int vectors;                       // V: filter vectors per pass, 1 or 2
  std::vector<std::int64_t> taps;    // offset of tap (kh, kw, c) in a padded sample, in HWIO order
};

constexpr std::int64_t kSamplesPerChunk = 8;  // samples per partial sum
// Vectors held in registers per pass: 12 of AVX2's 16 registers for 8 lanes, 24 of AVX-512's 32
// for 16 lanes (the 16-lane loops run only where the CPU has AVX-512). Twice the taps per pass
// read each output gradient vector half as often: the seed CNN's second convolution's weight
// gradients took 1.6-1.8x its forward on the AVX512-BF16 EPYC with 12.
constexpr int kAccumulators = 12;
constexpr int kWideAccumulators = 24;
constexpr int accumulators(int lanes) { return lanes == 16 ? kWideAccumulators : kAccumulators; }
// Beyond these the loops would stream a sample's planes from memory once per pass, where oneDNN's
// blocking wins: a padded input sample, and one pass's output gradient vectors of a sample.
constexpr std::int64_t kMaxPaddedSampleBytes = 128 * 1024;
constexpr std::int64_t kMaxGradientPlaneBytes = 64 * 1024;
constexpr std::int64_t kMaxPartialFloats = std::int64_t{4} << 20;  // the chunks' partial sums: 16 MiB
// Padded samples each thread keeps, up to a chunk's: an item pads its chunk's samples once for
// all the filter groups the same thread runs of that chunk.
constexpr std::int64_t kPaddedCacheBytes = 256 * 1024;
constexpr std::int64_t kFewInputChannels = 4;
constexpr std::int64_t kMaxTapsOfFewChannels = 64;

// One sample of x, channels last, into the inside of `padded`: padded[(ih * padded_w + iw) * C + c].
// The padding around it stays zero: it is zeroed once, when the buffer is sized, and never written.
// Blocks of 8 channels move as vectors (a call to memmove per block cost as much as the copy).
DTRAIN_LANE_CLONES void pad_sample(const WeightLoopsGeometry& g, const float* __restrict x, float* __restrict padded) {
  const bool whole_vectors = g.x.lanes % 8 == 0 && g.c % 8 == 0;
  for (std::int64_t ih = 0; ih < g.h; ++ih) {
    float* row = padded + ((ih + g.pad_top) * g.padded_w + g.pad_left) * g.c;
    const float* from = x + ih * g.x.row;
    for (std::int64_t iw = 0; iw < g.w; ++iw)
      for (std::int64_t c = 0; c < g.c; c += whole_vectors ? 8 : 1) {
        const float* value = from + iw * g.x.col + (c / g.x.lanes) * g.x.group + c % g.x.lanes;
        if (whole_vectors) store(row + iw * g.c + c, load<Vec<float, 8>>(value));
        else row[iw * g.c + c] = *value;
      }
  }
}

// Adds, for the G taps at `taps` and V filter vectors, sum over (oh, ow) of padded x at the tap
// times dy's L lanes into acc[v][t * L + lane]; dy[v] is vector v's output gradient at (0, 0).
template <int L, int V, int G>
DTRAIN_LANE_CLONES void accumulate_taps(const WeightLoopsGeometry& g, const std::int64_t* taps,
                                        const float* __restrict padded, const float* const* dy, float* const* acc) {
  using F = Vec<float, L>;
  F sums[G][V];
  std::int64_t offset[G];
  const float* __restrict gradient[V];
  for (int v = 0; v < V; ++v) gradient[v] = dy[v];
  for (int t = 0; t < G; ++t) {
    offset[t] = taps[t];
    for (int v = 0; v < V; ++v) sums[t][v] = load<F>(acc[v] + t * L);
  }
  for (std::int64_t oh = 0; oh < g.oh; ++oh) {
    const float* row = padded + oh * g.sh * g.padded_w * g.c;
    for (std::int64_t ow = 0; ow < g.ow; ++ow) {
      F d[V];
      for (int v = 0; v < V; ++v) d[v] = load<F>(gradient[v] + oh * g.dy.row + ow * g.dy.col);
      const float* at = row + ow * g.sw * g.c;
      for (int t = 0; t < G; ++t) {
        const float xv = at[offset[t]];
        for (int v = 0; v < V; ++v) sums[t][v] += xv * d[v];
      }
    }
  }
  for (int t = 0; t < G; ++t)
    for (int v = 0; v < V; ++v) store(acc[v] + t * L, sums[t][v]);
}

template <int L>
DTRAIN_LANE_CLONES void accumulate_bias(const WeightLoopsGeometry& g, const float* __restrict dy, float* __restrict acc) {
  using F = Vec<float, L>;
  F sum = load<F>(acc);
  for (std::int64_t oh = 0; oh < g.oh; ++oh)
    for (std::int64_t ow = 0; ow < g.ow; ++ow) sum += load<F>(dy + oh * g.dy.row + ow * g.dy.col);
  store(acc, sum);
}

using AccumulateFn = void (*)(const WeightLoopsGeometry&, const std::int64_t*, const float*, const float* const*,
                              float* const*);

template <int L, int V, std::size_t... G>
std::array<AccumulateFn, sizeof...(G)> accumulate_table(std::index_sequence<G...>) {
  return {&accumulate_taps<L, V, static_cast<int>(G) + 1>...};
}

// The pass over `count` taps and `vectors` filter vectors, count in 1..accumulators(lanes) / vectors.
AccumulateFn accumulate_fn(int lanes, int vectors, std::int64_t count) {
  static const auto by8 = accumulate_table<8, 1>(std::make_index_sequence<kAccumulators>{});
  static const auto by16 = accumulate_table<16, 1>(std::make_index_sequence<kWideAccumulators>{});
  static const auto pairs_by8 = accumulate_table<8, 2>(std::make_index_sequence<kAccumulators / 2>{});
  static const auto pairs_by16 = accumulate_table<16, 2>(std::make_index_sequence<kWideAccumulators / 2>{});
  const auto i = static_cast<std::size_t>(count - 1);
  if (vectors == 2) return lanes == 16 ? pairs_by16[i] : pairs_by8[i];
  return lanes == 16 ? by16[i] : by8[i];
}

// One backward's weight loops as items: item = sample chunk * groups + filter group, where a group
// is V filter vectors (the last may have fewer).
struct WeightJob {
  const WeightLoopsGeometry* g = nullptr;
  const float* x = nullptr;
  const float* dy = nullptr;
  float* partial = nullptr;      // per (sample chunk, filter chunk): taps x L, then the bias's L
  std::int64_t groups = 0;
  std::int64_t padded_size = 0;  // floats of one padded sample
  std::int64_t cached = 1;       // padded samples per worker
  float* padded = nullptr;       // per worker, `cached` padded samples
  std::int64_t* holds = nullptr; // per worker and cached sample: which sample it holds, -1 none
};

void run_weight_item(void* job, std::int64_t item, int worker) noexcept {
  const WeightJob& j = *static_cast<const WeightJob*>(job);
  const WeightLoopsGeometry& g = *j.g;
  const std::int64_t taps = static_cast<std::int64_t>(g.taps.size());
  const std::int64_t per_item = (taps + 1) * g.lanes;  // taps, then the bias
  const std::int64_t chunk = item / j.groups;
  const std::int64_t fc = item % j.groups * g.vectors;
  const int vectors = static_cast<int>(std::min<std::int64_t>(g.vectors, g.filter_chunks - fc));
  float* acc[2] = {};
  for (int v = 0; v < vectors; ++v) acc[v] = j.partial + (chunk * g.filter_chunks + fc + v) * per_item;
  const std::int64_t per_pass = accumulators(g.lanes) / vectors;
  for (std::int64_t n = chunk * kSamplesPerChunk; n < std::min(g.batch, (chunk + 1) * kSamplesPerChunk); ++n) {
    const std::int64_t slot = worker * j.cached + n % j.cached;
    float* padded = j.padded + slot * j.padded_size;
    if (j.holds[slot] != n) {
      pad_sample(g, j.x + n * g.x.n, padded);
      j.holds[slot] = n;
    }
    const float* dy_n[2] = {};
    for (int v = 0; v < vectors; ++v) {
      const std::int64_t first_lane = (fc + v) * g.lanes;
      dy_n[v] = j.dy + n * g.dy.n + (first_lane / g.dy.lanes) * g.dy.group + first_lane % g.dy.lanes;
    }
    for (std::int64_t t = 0; t < taps; t += per_pass) {
      const std::int64_t count = std::min(per_pass, taps - t);
      float* const at[2] = {acc[0] + t * g.lanes, acc[1] ? acc[1] + t * g.lanes : nullptr};
      accumulate_fn(g.lanes, vectors, count)(g, g.taps.data() + t, padded, dy_n, at);
    }
    for (int v = 0; v < vectors; ++v) {
      if (g.lanes == 16) accumulate_bias<16>(g, dy_n[v], acc[v] + taps * g.lanes);
      else accumulate_bias<8>(g, dy_n[v], acc[v] + taps * g.lanes);
    }
  }
}

class Conv2DKernel final : public WeightedOpKernel {
 public:
  Conv2DKernel(nn::Conv2D& layer, OnednnContext& ctx, DType compute)
      : WeightedOpKernel(ctx, compute, layer.options().activation), layer_(layer) {}

  LayoutPtr plan(std::int64_t batch, const LayoutPtr& src_layout) override {
    const auto& o = layer_.options();
    const Shape& in = layer_.input_shape();
    const Shape out = layer_.output_shape().with_batch(batch);
    const memory::dims strides{o.strides[0], o.strides[1]};
    const memory::dims pad_before{layer_.padding_h().before, layer_.padding_w().before};
    const memory::dims pad_after{layer_.padding_h().after, layer_.padding_w().after};
    auto src = any_md(in.with_batch(batch), compute_);
    auto dst = any_md(out, compute_);
    auto weights = memory::desc({o.filters, in[2], o.kernel_size[0], o.kernel_size[1]}, to_dnnl(compute_),
                                memory::format_tag::any);
    auto bias = o.use_bias ? memory::desc({o.filters}, memory::data_type::f32, memory::format_tag::x) : memory::desc();
    const auto algo = dnnl::algorithm::convolution_direct;

    auto fwd_pd = dnnl::convolution_forward::primitive_desc(
        dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training, algo, src, weights, bias, dst, strides,
                                        pad_before, pad_after),
        act_.post_op_attr(), ctx_.engine);
    auto bwd_data_pd = dnnl::convolution_backward_data::primitive_desc(
        dnnl::convolution_backward_data::desc(algo, src, weights, dst, strides, pad_before, pad_after), ctx_.engine,
        fwd_pd);
    auto bwd_weights_pd = dnnl::convolution_backward_weights::primitive_desc(
        dnnl::convolution_backward_weights::desc(algo, src, diff_weights_md(weights), bias, dst, strides, pad_before,
                                                 pad_after),
        ctx_.engine, fwd_pd);
    plan_weight_loops(batch, md_of(src_layout), fwd_pd.dst_desc());
    return keep(batch, out, fwd_pd, bwd_data_pd, bwd_weights_pd);
  }

  void bind(std::int64_t batch, const nn::LayerIO& io) override {
    const auto& o = layer_.options();
    auto vars = layer_.variables();
    bind_variables(batch, io,
                   hwio_md(o.kernel_size[0], o.kernel_size[1], static_cast<int>(layer_.input_shape()[2]), o.filters),
                   vars[nn::Conv2D::kKernel], o.use_bias ? &vars[nn::Conv2D::kBias] : nullptr);
    if (WeightLoops* s = find_weight_loops(batch)) s->src = ctx_.wrap(io.src);
  }

 protected:
  bool own_weight_gradients(std::int64_t batch) const override { return find_weight_loops(batch) != nullptr; }

  void weight_gradients(std::int64_t batch, const memory& pre_grad, const nn::StepContext& step) override {
    WeightLoops* s = find_weight_loops(batch);
    const WeightLoopsGeometry& g = s->geometry;
    const std::int64_t taps = static_cast<std::int64_t>(g.taps.size());
    const std::int64_t per_item = (taps + 1) * g.lanes;  // taps, then the bias
    const std::int64_t sample_chunks = (g.batch + kSamplesPerChunk - 1) / kSamplesPerChunk;
    WeightJob& j = s->job;
    j.g = &g;
    j.x = static_cast<const float*>(s->src.get_data_handle());
    j.dy = static_cast<const float*>(pre_grad.get_data_handle());
    j.groups = (g.filter_chunks + g.vectors - 1) / g.vectors;
    j.padded_size = g.padded_h * g.padded_w * g.c;
    j.cached = std::clamp<std::int64_t>(kPaddedCacheBytes / (j.padded_size * 4), 1, kSamplesPerChunk);
    // Scratch for every thread that may run an item: this lane's OpenMP team, or every lane. Sized
    // by the first backward of the plan (most plans are evaluation's); grows, zeroed (the padding
    // stays zero), only if the workers grew since.
    const int workers = std::max(std::max(1, omp_get_max_threads()), step.shared_work ? step.shared_work->size() : 1);
    const auto slots = static_cast<std::size_t>(workers * j.cached);
    if (s->padded.size() < slots * static_cast<std::size_t>(j.padded_size)) {
      s->padded.resize(slots * static_cast<std::size_t>(j.padded_size), 0.0f);
      s->holds.resize(slots);
    }
    std::fill(s->holds.begin(), s->holds.end(), -1);
    j.padded = s->padded.data();
    j.holds = s->holds.data();
    s->partial.assign(s->partial_size, 0.0f);
    j.partial = s->partial.data();
    const std::int64_t items = sample_chunks * j.groups;
    if (step.shared_work) {
      step.shared_work->run(step.lane, items, &j, &run_weight_item);
    } else {
      // Consecutive items (a chunk's filter groups) on one thread reuse its padded samples.
#pragma omp parallel for schedule(static)
      for (std::int64_t item = 0; item < items; ++item) run_weight_item(&j, item, omp_get_thread_num());
    }
    // The chunks' partial sums, added in chunk order, into the Keras-layout gradients.
    auto vars = layer_.variables();
    float* dw = vars[nn::Conv2D::kKernel].grad.address<float>();
    float* db = layer_.options().use_bias ? vars[nn::Conv2D::kBias].grad.address<float>() : nullptr;
    for (std::int64_t fc = 0; fc < g.filter_chunks; ++fc) {
      const std::int64_t lanes = std::min<std::int64_t>(g.lanes, g.filters - fc * g.lanes);
      for (std::int64_t t = 0; t <= taps; ++t) {
        if (t == taps && !db) break;
        float* into = t < taps ? dw + t * g.filters + fc * g.lanes : db + fc * g.lanes;
        for (std::int64_t lane = 0; lane < lanes; ++lane) {
          float sum = 0.0f;
          for (std::int64_t chunk = 0; chunk < sample_chunks; ++chunk)
            sum += s->partial[static_cast<std::size_t>((chunk * g.filter_chunks + fc) * per_item + t * g.lanes + lane)];
          into[lane] = sum;
        }
      }
    }
  }

 private:
  struct WeightLoops {
    std::int64_t batch = 0;
    WeightLoopsGeometry geometry;
    std::vector<float> partial;  // per (sample chunk, filter chunk): taps x L, then the bias's L
    std::size_t partial_size = 0;
    std::vector<float> padded;   // WeightJob::cached padded samples per worker; the padding stays zero
    std::vector<std::int64_t> holds;
    memory src;
    WeightJob job;
  };

  // Whether this batch's weight gradients are this file's loops: f32, x and the output gradient
  // with their channels innermost, and a sample's planes small enough to stay in the caches.
  void plan_weight_loops(std::int64_t batch, const memory::desc& src_md, const memory::desc& dst_md) {
    const auto& o = layer_.options();
    const Shape& in = layer_.input_shape();
    if (compute_ != DType::f32) return;
    const std::optional<Arrangement> x = arrangement_of(src_md), dy = arrangement_of(dst_md);
    if (!x || !dy || dst_md.data_type() != memory::data_type::f32) return;
    // Vectors of 16 where the CPU has 512-bit registers; 8 (two 128-bit halves below AVX2) elsewhere.
    const bool wide = dy->lanes % 16 == 0 && __builtin_cpu_supports("avx512f");
    const int lanes = wide ? 16 : dy->lanes % 8 == 0 ? 8 : 0;
    if (lanes == 0) return;
    const std::int64_t padded_h = in[0] + layer_.padding_h().before + layer_.padding_h().after;
    const std::int64_t padded_w = in[1] + layer_.padding_w().before + layer_.padding_w().after;
    const std::int64_t out_plane = layer_.padding_h().out * layer_.padding_w().out;
    const std::int64_t taps = std::int64_t{o.kernel_size[0]} * o.kernel_size[1] * in[2];
    const std::int64_t filter_chunks = (o.filters + lanes - 1) / lanes;
    const int vectors = filter_chunks >= 2 && taps > accumulators(lanes) ? 2 : 1;
    const std::int64_t sample_chunks = (batch + kSamplesPerChunk - 1) / kSamplesPerChunk;
    const std::int64_t partial = sample_chunks * filter_chunks * (taps + 1) * lanes;
    // A few input channels always (oneDNN's kernel computes 8 times the work there, whatever the
    // size); more where a sample's planes stay in the caches.
    const bool few_channels = in[2] <= kFewInputChannels && taps <= kMaxTapsOfFewChannels;
    const bool in_cache = padded_h * padded_w * in[2] * 4 <= kMaxPaddedSampleBytes &&
                          out_plane * vectors * lanes * 4 <= kMaxGradientPlaneBytes;
    if (!(few_channels || in_cache) || partial > kMaxPartialFloats) return;
    WeightLoops& s = weight_loops_.emplace_back();
    s.batch = batch;
    WeightLoopsGeometry& g = s.geometry;
    g.batch = batch;
    g.c = in[2];
    g.h = in[0];
    g.w = in[1];
    g.oh = layer_.padding_h().out;
    g.ow = layer_.padding_w().out;
    g.kh = o.kernel_size[0];
    g.kw = o.kernel_size[1];
    g.sh = o.strides[0];
    g.sw = o.strides[1];
    g.pad_top = layer_.padding_h().before;
    g.pad_left = layer_.padding_w().before;
    g.padded_h = padded_h;
    g.padded_w = padded_w;
    g.filters = o.filters;
    g.x = *x;
    g.dy = *dy;
    g.lanes = lanes;
    g.filter_chunks = filter_chunks;
    g.vectors = vectors;
    for (std::int64_t i = 0; i < g.kh; ++i)
      for (std::int64_t j = 0; j < g.kw; ++j)
        for (std::int64_t c = 0; c < g.c; ++c) g.taps.push_back((i * g.padded_w + j) * g.c + c);
    s.partial_size = static_cast<std::size_t>(partial);  // allocated by the first backward: most plans are evaluation's
  }

  template <class Loops>
  static auto* find_in(Loops& loops, std::int64_t batch) {
    for (auto& s : loops)
      if (s.batch == batch) return &s;
    return static_cast<decltype(&loops.front())>(nullptr);
  }
  WeightLoops* find_weight_loops(std::int64_t batch) { return find_in(weight_loops_, batch); }
  const WeightLoops* find_weight_loops(std::int64_t batch) const { return find_in(weight_loops_, batch); }

  nn::Conv2D& layer_;
  std::vector<WeightLoops> weight_loops_;  // per planned batch size that uses the loops above
};

std::unique_ptr<nn::LayerKernel> make(nn::Layer& layer, Context& ctx, DType compute) {
  return std::make_unique<Conv2DKernel>(static_cast<nn::Conv2D&>(layer), OnednnContext::of(ctx), compute);
}

const nn::KernelRegistration registered(kName, nn::Conv2D::Options::kind, &make);

}  // namespace

}  // namespace dtrain::backends::onednn
