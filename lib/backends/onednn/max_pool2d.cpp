// MaxPooling2D on the CPU (nn/max_pool2d.hpp has the semantics; the reference oracle is
// MaxPool2D::reference_forward/backward, and test_layers compares the two).
//   x  (N, H, W, C)    channels innermost: nhwc, or channel blocks of 4, 8 or 16 (nChw8c, ...)
//   y  (N, OH, OW, C)  in the same arrangement as x
//   ws (N, OH, OW, C)  u8: which window position won the max, kept from forward for backward
//   dx (N, H, W, C)    written whole by backward (zero where no window's max came from)
// f32 or bf16 (pooling moves values; it computes in whatever dtype the layer below produced).
// 'same' padding never wins the max (excluded, as in TensorFlow).
//
// Why not oneDNN's pooling: 2.6's jit pooling (avx2 and avx512) runs the seed CNN's first max
// pooling at about a tenth of the machine's memory bandwidth and, with its backward, took a sixth
// of the training step. Pooling reads each input once and writes each output once, so loops over
// the channel lanes (vectorized for AVX-512, AVX2 and plain x86-64, picked at load time) run near
// memory speed. Layouts and geometries these loops do not cover (channels not innermost, windows
// of more than 255 positions, overlapping windows in bf16) keep oneDNN's kernel.
//
// Each plane runs in the build of the loops for the context's loop_isa() (lanes.hpp's run_for),
// with as many lanes per step as that level's registers hold. The AVX-512 build used to take 16
// lanes through target_clones whatever the level, and GCC 12 turned its 4x conversions of the
// window position bytes, and every 16-lane comparison in the AVX2 build, into lane-by-lane code:
// the seed CNN's first pooling backward moved 11-20 GB/s on AVX-512 (perf: scalar vcomiss/seta
// and byte inserts in the v4 clone); with native lanes and conversions by steps of 2x
// (widen_mask, narrow_to_bytes) it runs at the speed of a copy on every level.
#include <bit>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "backends/onednn/activation_fn.hpp"
#include "backends/onednn/lanes.hpp"
#include "backends/onednn/pooling.hpp"
#include "nn/max_pool2d.hpp"

namespace dtrain::backends::onednn {

namespace {

using dnnl::memory;

// One pooling geometry over one (n, group) plane of H x W positions of `lanes` channels each.
struct Geometry {
  std::int64_t h, w, oh, ow, kh, kw, sh, sw, pad_top, pad_left, lanes;
  Arrangement src, dst;  // dst's arrangement is also the workspace's and diff_dst's; src's is diff_src's
  std::vector<std::int64_t> uncovered_rows, uncovered_cols;  // input rows/columns no window reads
  std::vector<std::int64_t> all_rows;                        // 0 .. h - 1
  bool overlapping = false;
};

// Every output position's window, as the input offsets of its valid positions (the same in every
// plane, so worked out once when planned): the loops below then carry no bounds checks.
struct Windows {
  std::vector<std::int64_t> first;      // per output position (oh * OW + ow), then one past the last
  std::vector<std::int64_t> offset;     // src offset of each valid position
  std::vector<std::uint8_t> position;   // its index in the kh x kw window

  explicit Windows(const Geometry& g) {
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
          }
        }
      }
    first.push_back(static_cast<std::int64_t>(offset.size()));
  }
};

// Calls body(at, first, last, c0) for every output position of a plane and every L lanes of its
// channels: `at` is the position's offset in the output plane, [first, last) its window's valid
// positions in `win`. Inlined into each clone below, so the body is compiled for the clone's ISA.
template <int L, class Body>
[[gnu::always_inline]] inline void for_each_window(const Geometry& g, const Windows& win, Body&& body) {
  for (std::int64_t oh = 0; oh < g.oh; ++oh)
    for (std::int64_t ow = 0; ow < g.ow; ++ow) {
      const std::int64_t first = win.first[static_cast<std::size_t>(oh * g.ow + ow)];
      const std::int64_t last = win.first[static_cast<std::size_t>(oh * g.ow + ow + 1)];
      const std::int64_t at = oh * g.dst.row + ow * g.dst.col;
      for (std::int64_t c0 = 0; c0 < g.lanes; c0 += L) body(at, first, last, c0);
    }
}

// Zeroes the input positions of a plane: `rows` whole (every column), then `cols` whole; L lanes
// per store. A call to memset per position cost the seed CNN's second pooling (11 x 11 inputs,
// its last row and column in no window) a third of its backward.
template <class T, int L>
void zero_positions(const Geometry& g, T* diff_src, const std::vector<std::int64_t>& rows,
                    const std::vector<std::int64_t>& cols) {
  using Z = Vec<T, L>;
  const auto zero_at = [&](std::int64_t ih, std::int64_t iw) {
    T* at = diff_src + ih * g.src.row + iw * g.src.col;
    for (std::int64_t c0 = 0; c0 < g.lanes; c0 += L) store(at + c0, Z{});
  };
  for (std::int64_t ih : rows)
    for (std::int64_t iw = 0; iw < g.w; ++iw) zero_at(ih, iw);
  for (std::int64_t iw : cols)
    for (std::int64_t ih = 0; ih < g.h; ++ih) zero_at(ih, iw);
}

// L channel lanes at a time (lanes.hpp), the argmax kept in 32-bit lanes beside the float maxima
// and narrowed when stored.
template <class T, int L>
void forward_plane(const Geometry& g, const Windows& win, const T* __restrict src, T* __restrict dst,
                   std::uint8_t* __restrict ws) {
  using F = Vec<float, L>;
  using I = Vec<std::int32_t, L>;
  for_each_window<L>(g, win, [&](std::int64_t at, std::int64_t first, std::int64_t last, std::int64_t c0) {
    F best = load_widened<L>(src + win.offset[static_cast<std::size_t>(first)] + c0);
    I which = I{} + static_cast<std::int32_t>(win.position[static_cast<std::size_t>(first)]);
    // Strictly greater: on a tie the first position in the window wins, as in TensorFlow.
    for (std::int64_t k = first + 1; k < last; ++k) {
      const F v = load_widened<L>(src + win.offset[static_cast<std::size_t>(k)] + c0);
      const I more = v > best;
      best = more ? v : best;
      which = more ? I{} + static_cast<std::int32_t>(win.position[static_cast<std::size_t>(k)]) : which;
    }
    store_narrowed<L>(dst + at + c0, best);
    store(ws + at + c0, narrow_to_bytes<L>(which));
  });
}

// Windows that do not overlap: every input position belongs to at most one window, so each
// window's positions are written once (the gradient where the max came from, zero elsewhere) and
// only positions outside every window need zeroing. T's bits are copied, never computed on.
// Relu: the input is a relu's output whose derivative this backward applies (nn/kernel.hpp): the
// gradient goes through only where the max, which is that relu's output, is above zero.
// Where each lane's max came from: bf16's 16-bit lanes compare the positions widened once per
// window (bytes to 16 bits, a 2x conversion); f32's compare them as bytes and widen the byte mask
// in two steps (comparing 32-bit lanes widened from bytes, GCC 12 went lane by lane on AVX-512).
template <class T, int L, bool Relu>
void backward_plane_disjoint(const Geometry& g, const Windows& win, const T* __restrict dst,
                             const T* __restrict diff_dst, const std::uint8_t* __restrict ws, T* __restrict diff_src) {
  using Bits = std::conditional_t<sizeof(T) == 4, std::int32_t, std::int16_t>;
  using B = Vec<Bits, L>;
  zero_positions<T, L>(g, diff_src, g.uncovered_rows, g.uncovered_cols);
  // In registers for the whole plane (the stores below could otherwise be any memory).
  const std::int64_t* const offset = win.offset.data();
  const std::uint8_t* const position = win.position.data();
  for_each_window<L>(g, win, [&](std::int64_t at, std::int64_t first, std::int64_t last, std::int64_t c0) {
    B dy = load<B>(diff_dst + at + c0);
    if constexpr (Relu) dy &= __builtin_convertvector(load_widened<L>(dst + at + c0) > 0.0f, B);
    const auto which = load<Vec<std::uint8_t, L>>(ws + at + c0);
    const auto here = [&](std::uint8_t p) -> B {
      if constexpr (sizeof(Bits) == 2) return __builtin_convertvector(which, B) == static_cast<Bits>(p);
      else return widen_mask<B, L>(which == p);
    };
    for (std::int64_t k = first; k < last; ++k) store(diff_src + offset[k] + c0, B(here(position[k]) & dy));
  });
}

// Overlapping windows (stride below the pool size), f32 only: zero the plane, then add each
// window's gradient at its max.
template <int L, bool Relu>
void backward_plane_overlapping(const Geometry& g, const Windows& win, const float* __restrict dst,
                                const float* __restrict diff_dst, const std::uint8_t* __restrict ws,
                                float* __restrict diff_src) {
  using F = Vec<float, L>;
  using I = Vec<std::int32_t, L>;
  zero_positions<float, L>(g, diff_src, g.all_rows, {});
  for_each_window<L>(g, win, [&](std::int64_t at, std::int64_t first, std::int64_t last, std::int64_t c0) {
    // Masks as bit operations: GCC 12 computes a 16-lane float select (?:) lane by lane on AVX-512.
    I dy = load<I>(diff_dst + at + c0);
    if constexpr (Relu) dy &= load<F>(dst + at + c0) > 0.0f;
    const auto which = load<Vec<std::uint8_t, L>>(ws + at + c0);
    for (std::int64_t k = first; k < last; ++k) {
      float* dx = diff_src + win.offset[static_cast<std::size_t>(k)] + c0;
      const I here = widen_mask<I, L>(which == win.position[static_cast<std::size_t>(k)]);
      store(dx, F(load<F>(dx) + std::bit_cast<F>(I(here & dy))));  // + 0.0f where the max is not here
    }
  });
}

class MaxPool2DKernel final : public nn::LayerKernel {
 public:
  MaxPool2DKernel(nn::MaxPool2D& layer, OnednnContext& ctx)
      : layer_(layer), ctx_(ctx), isa_(ctx.loop_isa()), onednn_(layer, ctx, dnnl::algorithm::pooling_max) {}

  // Computed by the layer below (nn/kernel.hpp): the layout it receives is already the pooled one.
  const nn::MaxPool2D* max_pooling_to_offer() const override { return &layer_; }
  void skip_pooling() override { computed_below_ = true; }
  bool forward_passes_through() const override { return computed_below_; }
  bool gradient_passes_through() const override { return computed_below_; }

  LayoutPtr plan(std::int64_t batch, const LayoutPtr& src) override {
    if (computed_below_) return src;
    const memory::desc& src_md = md_of(src);
    std::optional<Geometry> geometry = geometry_for(src_md);
    if (!geometry) return onednn_.plan(batch, src);
    Plan& p = plans_.emplace_back();
    p.batch = batch;
    p.geometry = std::move(*geometry);
    p.dtype = dtype_of(src_md);
    const Shape out = layer_.output_shape().with_batch(batch);
    const memory::desc dst_md = arranged_like(p.geometry.src, {batch, out[3], out[1], out[2]}, src_md.data_type());
    p.geometry.dst = *arrangement_of(dst_md);
    p.windows = std::make_unique<Windows>(p.geometry);
    p.workspace.assign(dst_md.get_size() / memory::data_type_size(src_md.data_type()), 0);
    return make_layout(out, p.dtype, dst_md);
  }

  bool take_input_activation_backward(config::Activation below) override {
    relu_below_ = below == config::Activation::relu && !computed_below_;
    return relu_below_;
  }

  void bind(std::int64_t batch, const nn::LayerIO& io) override {
    if (computed_below_) return;
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

  void forward(std::int64_t batch, const nn::StepContext& step) override {
    if (computed_below_) return;
    Plan* p = own_plan(batch);
    if (!p) return onednn_.forward(batch, step);
    if (p->dtype == DType::bf16) return run_forward<std::uint16_t>(*p);
    run_forward<float>(*p);
  }

  void backward(std::int64_t batch, const nn::StepContext& step) override {
    if (computed_below_) return;
    Plan* p = own_plan(batch);
    if (!p) {
      onednn_.backward(batch, step);
      // oneDNN's pooling cannot apply the relu's derivative: it runs after it, on the gradient.
      if (relu_below_)
        for (auto& [planned, act] : fallback_relu_)
          if (planned == batch) relu_.backward(ctx_, act);
      return;
    }
    if (!p->diff_src) return;  // the first layer: nothing below wants the gradient
    if (p->dtype == DType::bf16) return run_backward<std::uint16_t>(*p);
    run_backward<float>(*p);
  }

 private:
  struct Plan {
    std::int64_t batch = 0;
    Geometry geometry;
    DType dtype = DType::f32;
    std::unique_ptr<Windows> windows;
    std::vector<std::uint8_t> workspace;
    memory src, dst, diff_dst, diff_src;
  };

  std::optional<Geometry> geometry_for(const memory::desc& src_md) const {
    const std::optional<Arrangement> src = arrangement_of(src_md);
    const auto dt = src_md.data_type();
    if (!src || (dt != memory::data_type::f32 && dt != memory::data_type::bf16)) return std::nullopt;
    const auto& pool = layer_.params().pool_size;
    if (pool[0] * pool[1] > std::numeric_limits<std::uint8_t>::max()) return std::nullopt;
    Geometry g;
    const Shape& in = layer_.input_shape();
    g.h = in[0];
    g.w = in[1];
    g.oh = layer_.padding_h().out;
    g.ow = layer_.padding_w().out;
    g.kh = pool[0];
    g.kw = pool[1];
    g.sh = layer_.strides()[0];
    g.sw = layer_.strides()[1];
    g.pad_top = layer_.padding_h().before;
    g.pad_left = layer_.padding_w().before;
    g.lanes = src->lanes;
    g.src = *src;
    g.overlapping = g.sh < g.kh || g.sw < g.kw;
    if (g.overlapping && dt != memory::data_type::f32) return std::nullopt;  // bf16 sums would round
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
    for (std::int64_t ih = 0; ih < g.h; ++ih) g.all_rows.push_back(ih);
    return g;
  }

  Plan* own_plan(std::int64_t batch) {
    for (auto& p : plans_)
      if (p.batch == batch) return &p;
    return nullptr;
  }

  // The planes (n, group) are independent; the replica's OpenMP team shares them. Each plane's loop
  // is a call into the build for isa_ (the OpenMP region itself is built for plain x86-64).
  template <class T>
  void run_forward(Plan& p) {
    const Geometry& g = p.geometry;
    const Windows& win = *p.windows;
    const T* src = static_cast<const T*>(p.src.get_data_handle());
    T* dst = static_cast<T*>(p.dst.get_data_handle());
    std::uint8_t* ws = p.workspace.data();
    const std::int64_t planes = p.batch * g.src.groups;
    const LoopIsa isa = isa_;
#pragma omp parallel for schedule(static)
    for (std::int64_t q = 0; q < planes; ++q) {
      const std::int64_t n = q / g.src.groups, group = q % g.src.groups;
      const std::int64_t out = n * g.dst.n + group * g.dst.group;
      const T* x = src + n * g.src.n + group * g.src.group;
      run_with_lanes(isa, g.lanes, [&]<int L>() { forward_plane<T, L>(g, win, x, dst + out, ws + out); });
    }
  }

  template <class T>
  void run_backward(Plan& p) {
    const Geometry& g = p.geometry;
    const Windows& win = *p.windows;
    const T* dst = static_cast<const T*>(p.dst.get_data_handle());
    const T* diff_dst = static_cast<const T*>(p.diff_dst.get_data_handle());
    T* diff_src = static_cast<T*>(p.diff_src.get_data_handle());
    const std::uint8_t* ws = p.workspace.data();
    const std::int64_t planes = p.batch * g.src.groups;
    const LoopIsa isa = isa_;
    const bool relu = relu_below_;
#pragma omp parallel for schedule(static)
    for (std::int64_t q = 0; q < planes; ++q) {
      const std::int64_t n = q / g.src.groups, group = q % g.src.groups;
      const std::int64_t out = n * g.dst.n + group * g.dst.group;
      T* dx = diff_src + n * g.src.n + group * g.src.group;
      run_with_lanes(isa, g.lanes, [&]<int L>() {
        if constexpr (std::is_same_v<T, float>) {
          if (g.overlapping) {
            if (relu) backward_plane_overlapping<L, true>(g, win, dst + out, diff_dst + out, ws + out, dx);
            else backward_plane_overlapping<L, false>(g, win, dst + out, diff_dst + out, ws + out, dx);
            return;
          }
        }
        if (relu) backward_plane_disjoint<T, L, true>(g, win, dst + out, diff_dst + out, ws + out, dx);
        else backward_plane_disjoint<T, L, false>(g, win, dst + out, diff_dst + out, ws + out, dx);
      });
    }
  }

  nn::MaxPool2D& layer_;
  OnednnContext& ctx_;
  LoopIsa isa_;               // the build of the loops this kernel runs
  Pool2DKernel onednn_;       // for what the loops above do not cover
  std::vector<Plan> plans_;   // one per batch size planned here (few: the batch and a last one)
  bool relu_below_ = false;   // this backward applies the derivative of the relu below
  bool computed_below_ = false;  // the layer below pools its own output (skip_pooling)
  ActivationFn relu_{config::Activation::relu};
  std::vector<std::pair<std::int64_t, ActivationFn::Plan>> fallback_relu_;  // per batch oneDNN pools
};

std::unique_ptr<nn::LayerKernel> make(nn::Layer& layer, Context& ctx, DType) {
  return std::make_unique<MaxPool2DKernel>(static_cast<nn::MaxPool2D&>(layer), OnednnContext::of(ctx));
}

const nn::KernelRegistration registered(kName, nn::MaxPool2D::Options::kind, &make);

}  // namespace

}  // namespace dtrain::backends::onednn
