// MaxPooling2D on the CPU (nn/max_pool2d.hpp has the semantics; the reference oracle is
// MaxPool2D::reference_forward/backward, and test_layers compares the two).
//   x  (N, H, W, C)    channels innermost: nhwc, or channel blocks of 4, 8 or 16 (nChw8c, ...)
//   y  (N, OH, OW, C)  in the same arrangement as x
//   ws (N, OH, OW, C)  u8: which window position won the max, kept from forward for backward
//   dx (N, H, W, C)    written whole by backward (zero where no window's max came from)
// f32 or bf16 (pooling moves values; it computes in whatever dtype the layer below produced).
// 'same' padding never wins the max (excluded, as in TensorFlow).
//
// Why not oneDNN's pooling (pool_loops.hpp, whose OwnPool2DKernel this kernel is): 2.6's jit
// pooling ran the seed CNN's first max pooling at about a tenth of the machine's memory bandwidth
// and, with its backward, took a sixth of the training step. Layouts and geometries the loops do
// not cover (channels not innermost, windows of more than 255 positions, overlapping windows in
// bf16) keep oneDNN's kernel.
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
#include <type_traits>

#include "backends/onednn/pool_loops.hpp"
#include "nn/max_pool2d.hpp"

namespace dtrain::backends::onednn {

namespace {

// Which window position won, in a workspace byte, where a backward finds no winner: below a relu
// (Relu), where the max is not above zero, whose gradient the relu's derivative stops. Backward then
// applies that derivative from the workspace alone, without reading the pooled output again.
// (Windows have at most 255 positions, 0 to 254: covers().)
constexpr std::uint8_t kNoWinner = 255;

// L channel lanes at a time (lanes.hpp), the argmax kept in 32-bit lanes beside the float maxima
// and narrowed when stored.
template <class T, int L, bool Relu>
void forward_plane(const PoolGeometry& g, const PoolWindows& win, const T* __restrict src, T* __restrict dst,
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
    if constexpr (Relu) {
      const I positive = best > 0.0f;
      which = (which & positive) | (~positive & kNoWinner);
    }
    store_narrowed<L>(dst + at + c0, best);
    store(ws + at + c0, narrow_to_bytes<L>(which));
  });
}

// Windows that do not overlap: every input position belongs to at most one window, so each
// window's positions are written once (the gradient where the max came from, zero elsewhere) and
// only positions outside every window need zeroing. T's bits are copied, never computed on.
// Where each lane's max came from: bf16's 16-bit lanes compare the positions widened once per
// window (bytes to 16 bits, a 2x conversion); f32's compare them as bytes and widen the byte mask
// in two steps (comparing 32-bit lanes widened from bytes, GCC 12 went lane by lane on AVX-512).
template <class T, int L>
void backward_plane_disjoint(const PoolGeometry& g, const PoolWindows& win, const T* __restrict diff_dst,
                             const std::uint8_t* __restrict ws, T* __restrict diff_src) {
  using Bits = std::conditional_t<sizeof(T) == 4, std::int32_t, std::int16_t>;
  using B = Vec<Bits, L>;
  zero_positions<T, L>(g, diff_src, g.uncovered_rows, g.uncovered_cols);
  // In registers for the whole plane (the stores below could otherwise be any memory).
  const std::int64_t* const offset = win.offset.data();
  const std::uint8_t* const position = win.position.data();
  for_each_window<L>(g, win, [&](std::int64_t at, std::int64_t first, std::int64_t last, std::int64_t c0) {
    const B dy = load<B>(diff_dst + at + c0);
    const auto which = load<Vec<std::uint8_t, L>>(ws + at + c0);
    const auto here = [&](std::uint8_t p) -> B {
      if constexpr (sizeof(Bits) == 2) return __builtin_convertvector(which, B) == static_cast<Bits>(p);
      else return widen_mask<B, L>(which == p);
    };
    for (std::int64_t k = first; k < last; ++k) store(diff_src + offset[k] + c0, B(here(position[k]) & dy));
  });
}

// Overlapping windows (stride below the pool size), f32 only: each input position's gradient is
// the sum of its windows' gradients where their max came from it, added in window order from +0
// (the order, and so the bits, of adding each window's in place after zeroing the plane), and
// written once (PoolWindows' covering lists).
template <int L>
void backward_plane_overlapping(const PoolGeometry& g, const PoolWindows& win, const float* __restrict diff_dst,
                                const std::uint8_t* __restrict ws, float* __restrict diff_src) {
  using F = Vec<float, L>;
  using I = Vec<std::int32_t, L>;
  const std::int64_t* const window_at = win.covering_at.data();
  const std::uint8_t* const position = win.covering_position.data();
  for_each_input<L>(g, win, [&](std::int64_t at, std::int64_t first, std::int64_t last, std::int64_t c0) {
    F sum{};
    for (std::int64_t k = first; k < last; ++k) {
      // Masks as bit operations: GCC 12 computes a 16-lane float select (?:) lane by lane on AVX-512.
      const std::int64_t from = window_at[k] + c0;
      const I here = widen_mask<I, L>(load<Vec<std::uint8_t, L>>(ws + from) == position[k]);
      sum += std::bit_cast<F>(I(here & load<I>(diff_dst + from)));  // + 0.0f where the max is not here
    }
    store(diff_src + at + c0, sum);
  });
}

class MaxPool2DKernel final : public OwnPool2DKernel {
 public:
  MaxPool2DKernel(nn::MaxPool2D& layer, OnednnContext& ctx)
      : OwnPool2DKernel(layer, ctx, dnnl::algorithm::pooling_max), layer_(layer) {}

  // Computed by the layer below (nn/kernel.hpp): the layout it receives is already the pooled one.
  const nn::MaxPool2D* max_pooling_to_offer() const override { return &layer_; }
  void skip_pooling() override { computed_below_ = true; }
  bool forward_passes_through() const override { return computed_below_; }
  bool gradient_passes_through() const override { return computed_below_; }

  LayoutPtr plan(std::int64_t batch, const LayoutPtr& src) override {
    return computed_below_ ? src : OwnPool2DKernel::plan(batch, src);
  }
  bool take_input_activation_backward(config::Activation below) override {
    return !computed_below_ && OwnPool2DKernel::take_input_activation_backward(below);
  }
  void bind(std::int64_t batch, const nn::LayerIO& io) override {
    if (!computed_below_) OwnPool2DKernel::bind(batch, io);
  }
  void forward(std::int64_t batch, const nn::StepContext& step) override {
    if (!computed_below_) OwnPool2DKernel::forward(batch, step);
  }
  void backward(std::int64_t batch, const nn::StepContext& step) override {
    if (!computed_below_) OwnPool2DKernel::backward(batch, step);
  }

 private:
  // The workspace keeps a window position in a byte.
  bool covers(const PoolGeometry& g) const override { return g.kh * g.kw <= std::numeric_limits<std::uint8_t>::max(); }
  void planned(Plan& p) override { p.workspace.assign(static_cast<std::size_t>(p.dst_elements), 0); }

  void forward_planes(Plan& p) override {
    void* const src = p.src.get_data_handle();
    void* const dst = p.dst.get_data_handle();
    std::uint8_t* const ws = p.workspace.data();
    const bool relu = relu_below();
    run_planes(p, [&]<class T, int L>(std::int64_t in, std::int64_t out) {
      const T* x = static_cast<const T*>(src) + in;
      T* y = static_cast<T*>(dst) + out;
      if (relu) forward_plane<T, L, true>(p.geometry, *p.windows, x, y, ws + out);
      else forward_plane<T, L, false>(p.geometry, *p.windows, x, y, ws + out);
    });
  }

  // Below a relu, its derivative is in the workspace already (forward_plane).
  void backward_planes(Plan& p) override {
    void* const diff_dst = p.diff_dst.get_data_handle();
    void* const diff_src = p.diff_src.get_data_handle();
    const std::uint8_t* const ws = p.workspace.data();
    run_planes(p, [&]<class T, int L>(std::int64_t in, std::int64_t out) {
      const PoolGeometry& g = p.geometry;
      const T* dy = static_cast<const T*>(diff_dst) + out;
      T* dx = static_cast<T*>(diff_src) + in;
      if constexpr (std::is_same_v<T, float>) {
        if (g.overlapping) return backward_plane_overlapping<L>(g, *p.windows, dy, ws + out, dx);
      }
      backward_plane_disjoint<T, L>(g, *p.windows, dy, ws + out, dx);
    });
  }

  nn::MaxPool2D& layer_;
  bool computed_below_ = false;  // the layer below pools its own output (skip_pooling)
};

std::unique_ptr<nn::LayerKernel> make(nn::Layer& layer, Context& ctx, DType) {
  return std::make_unique<MaxPool2DKernel>(static_cast<nn::MaxPool2D&>(layer), OnednnContext::of(ctx));
}

const nn::KernelRegistration registered(kName, nn::MaxPool2D::Options::kind, &make);

}  // namespace

}  // namespace dtrain::backends::onednn
