// AveragePooling2D on the CPU (nn/average_pooling2d.hpp has the semantics; the reference oracle is
// AveragePooling2D::reference_forward/backward, and test_layers and test_cpu_loops compare the two).
//   x  (N, H, W, C)    channels innermost: nhwc, or channel blocks of 4, 8 or 16 (nChw8c, ...)
//   y  (N, OH, OW, C)  in the same arrangement as x: each window's mean over its valid positions
//                      (TensorFlow's divisor: 'same' padding is not counted)
//   dx (N, H, W, C)    written whole by backward: dy / count at each window's valid positions
//                      (summed where windows overlap), zero where no window reads
// f32 or bf16 (its layout and dtype are the layer below's); sums and quotients in f32, a bf16
// result rounded to nearest even once.
//
// On pool_loops.hpp's own loops (OwnPool2DKernel) where they cover the layout: oneDNN 2.6's avx2
// average pooling took 2.4-2.7 times its bytes' bound, forward and backward, in
// fashion_mnist_bn_dropout.yaml's `dtrain bench`. Below a relu (an Activation layer), backward
// applies the relu's derivative as it writes, from the relu's output it pools (its input), so the
// relu's layer moves nothing in backward. Elsewhere oneDNN's kernel (pooling_avg_exclude_padding).
#include <bit>
#include <type_traits>
#include <vector>

#include "backends/onednn/pool_loops.hpp"
#include "nn/average_pooling2d.hpp"

namespace dtrain::backends::onednn {

namespace {

// y = (sum of the window's valid inputs, in window order) / their count, L lanes at a time.
template <class T, int L>
void forward_plane(const PoolGeometry& g, const PoolWindows& win, const T* __restrict src, T* __restrict dst) {
  using F = Vec<float, L>;
  const std::int64_t* const offset = win.offset.data();
  for_each_window<L>(g, win, [&](std::int64_t at, std::int64_t first, std::int64_t last, std::int64_t c0) {
    F sum = load_widened<L>(src + offset[first] + c0);
    for (std::int64_t k = first + 1; k < last; ++k) sum += load_widened<L>(src + offset[k] + c0);
    store_rounded<L>(dst + at + c0, sum / static_cast<float>(last - first));
  });
}

// A gradient at input position `x` (a window's share, or the sum of them): zero where the relu
// below (Relu) had a zero output there. A mask of bits: GCC 12 computes a 16-lane float select
// lane by lane on AVX-512.
template <int L, bool Relu, class T>
[[gnu::always_inline]] inline Vec<float, L> share_at(const Vec<float, L>& share, const T* x) {
  if constexpr (!Relu) {
    return share;
  } else {
    using I = Vec<std::int32_t, L>;
    return std::bit_cast<Vec<float, L>>(I((load_widened<L>(x) > 0.0f) & std::bit_cast<I>(share)));
  }
}

// Windows that do not overlap: each input position is in at most one window and is written once;
// positions outside every window are zeroed.
template <class T, int L, bool Relu>
void backward_plane_disjoint(const PoolGeometry& g, const PoolWindows& win, const T* __restrict src,
                             const T* __restrict diff_dst, T* __restrict diff_src) {
  using F = Vec<float, L>;
  zero_positions<T, L>(g, diff_src, g.uncovered_rows, g.uncovered_cols);
  const std::int64_t* const offset = win.offset.data();
  for_each_window<L>(g, win, [&](std::int64_t at, std::int64_t first, std::int64_t last, std::int64_t c0) {
    const F share = load_widened<L>(diff_dst + at + c0) / static_cast<float>(last - first);
    for (std::int64_t k = first; k < last; ++k)
      store_rounded<L>(diff_src + offset[k] + c0, share_at<L, Relu>(share, src + offset[k] + c0));
  });
}

// Overlapping windows (stride below the pool size), f32 only: each window's share once into
// `shares` (the plane's outputs, scratch), then each input position's gradient as the sum of its
// windows' shares, added in window order from +0 (PoolWindows' covering lists) and written once;
// below a relu, zero where the relu's output was. Adding each window's share in place after
// zeroing the plane, as before, made the same adds in the same order (the same bits) but wrote
// the plane twice and read it back at every window position.
template <int L, bool Relu>
void backward_plane_overlapping(const PoolGeometry& g, const PoolWindows& win, const float* __restrict src,
                                const float* __restrict diff_dst, float* __restrict shares,
                                float* __restrict diff_src) {
  using F = Vec<float, L>;
  for_each_window<L>(g, win, [&](std::int64_t at, std::int64_t first, std::int64_t last, std::int64_t c0) {
    store(shares + at + c0, F(load<F>(diff_dst + at + c0) / static_cast<float>(last - first)));
  });
  const std::int64_t* const window_at = win.covering_at.data();
  for_each_input<L>(g, win, [&](std::int64_t at, std::int64_t first, std::int64_t last, std::int64_t c0) {
    F sum{};
    for (std::int64_t k = first; k < last; ++k) sum += load<F>(shares + window_at[k] + c0);
    store(diff_src + at + c0, share_at<L, Relu>(sum, src + at + c0));
  });
}

class AveragePooling2DKernel final : public OwnPool2DKernel {
 public:
  AveragePooling2DKernel(nn::AveragePooling2D& layer, OnednnContext& ctx)
      : OwnPool2DKernel(layer, ctx, dnnl::algorithm::pooling_avg_exclude_padding) {}

 private:
  // Overlapping windows: room for every plane's shares (backward_plane_overlapping), the largest
  // plan's outputs.
  void planned(Plan& p) override {
    if (p.geometry.overlapping && shares_.size() < static_cast<std::size_t>(p.dst_elements))
      shares_.resize(static_cast<std::size_t>(p.dst_elements));
  }

  void forward_planes(Plan& p) override {
    void* const src = p.src.get_data_handle();
    void* const dst = p.dst.get_data_handle();
    run_planes(p, [&]<class T, int L>(std::int64_t in, std::int64_t out) {
      forward_plane<T, L>(p.geometry, *p.windows, static_cast<const T*>(src) + in, static_cast<T*>(dst) + out);
    });
  }

  void backward_planes(Plan& p) override {
    void* const src = p.src.get_data_handle();
    void* const diff_dst = p.diff_dst.get_data_handle();
    void* const diff_src = p.diff_src.get_data_handle();
    const bool relu = relu_below();
    run_planes(p, [&]<class T, int L>(std::int64_t in, std::int64_t out) {
      const PoolGeometry& g = p.geometry;
      const PoolWindows& win = *p.windows;
      const T* x = static_cast<const T*>(src) + in;
      const T* dy = static_cast<const T*>(diff_dst) + out;
      T* dx = static_cast<T*>(diff_src) + in;
      if constexpr (std::is_same_v<T, float>) {
        if (g.overlapping) {
          float* shares = shares_.data() + out;
          if (relu) backward_plane_overlapping<L, true>(g, win, x, dy, shares, dx);
          else backward_plane_overlapping<L, false>(g, win, x, dy, shares, dx);
          return;
        }
      }
      if (relu) backward_plane_disjoint<T, L, true>(g, win, x, dy, dx);
      else backward_plane_disjoint<T, L, false>(g, win, x, dy, dx);
    });
  }

  std::vector<float> shares_;
};

std::unique_ptr<nn::LayerKernel> make(nn::Layer& layer, Context& ctx, DType) {
  return std::make_unique<AveragePooling2DKernel>(static_cast<nn::AveragePooling2D&>(layer), OnednnContext::of(ctx));
}

const nn::KernelRegistration registered(kName, nn::AveragePooling2D::Options::kind, &make);

}  // namespace

}  // namespace dtrain::backends::onednn
