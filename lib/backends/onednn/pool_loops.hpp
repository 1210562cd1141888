// The CPU backend's own 2-D pooling loops' shared parts (max_pool2d.cpp, average_pooling2d.cpp):
// a pooling's geometry over one (n, channel group) plane, every window's valid positions worked
// out once, the walk over them, and OwnPool2DKernel, which runs a pooling on these loops where they
// cover the layout and geometry and on oneDNN's kernel (pooling.hpp) elsewhere.
//   x  (N, H, W, C)    channels innermost: nhwc, or channel blocks of 4, 8 or 16 (nChw8c, ...)
//   y  (N, OH, OW, C)  in the same arrangement as x
// f32 or bf16 (pooling computes in whatever dtype the layer below produced).
//
// Why own loops: oneDNN 2.6's jit pooling (avx2 and avx512) runs the seed CNN's poolings at a
// tenth to a fifth of the machine's memory bandwidth. A pooling reads each input once and writes
// each output once, so loops over the channel lanes (built for AVX-512, AVX2 and plain x86-64 and
// picked per context: lanes.hpp's run_with_lanes) run near the speed of a copy.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "backends/onednn/activation_fn.hpp"
#include "backends/onednn/lanes.hpp"
#include "backends/onednn/pooling.hpp"
#include "nn/pooling.hpp"

namespace dtrain::backends::onednn {

// One pooling geometry over one (n, group) plane of H x W positions of `lanes` channels each.
struct PoolGeometry {
  std::int64_t h, w, oh, ow, kh, kw, sh, sw, pad_top, pad_left, lanes;
  Arrangement src, dst;  // dst's arrangement is also diff_dst's (and a workspace's); src's is diff_src's
  std::vector<std::int64_t> uncovered_rows, uncovered_cols;  // input rows/columns no window reads
  bool overlapping = false;
};

// The geometry of `layer` over an input laid out as `src_md`, when the loops cover it: channels
// innermost, f32 or bf16, and windows that do not overlap in bf16 (sums of gradients would round
// at every add). Its dst arrangement is still to be set (OwnPool2DKernel::plan).
std::optional<PoolGeometry> pool_geometry(const nn::Pool2DLayer& layer, const dnnl::memory::desc& src_md);

// Every output position's window, as the input offsets of its valid positions (the same in every
// plane, so worked out once when planned): the loops then carry no bounds checks. Where windows
// overlap, also the other way round: every input position's windows, in window order, which a
// backward gathers from so that each input gradient is written once (adding each window's part
// in place instead, after zeroing the plane, took max pooling's 3x3 stride 2 backward to three
// times its bytes' bound: the plane written twice, a read-modify-write per window position).
struct PoolWindows {
  std::vector<std::int64_t> first;      // per output position (oh * OW + ow), then one past the last
  std::vector<std::int64_t> offset;     // src offset of each valid position
  std::vector<std::uint8_t> position;   // its index in the kh x kw window (max pooling's workspace)
  // Overlapping windows only: per input position (ih * W + iw) and one past the last, the range of
  // its windows in covering_at (each window's dst offset, oh * dst.row + ow * dst.col) and
  // covering_position (the input position's index in that window).
  std::vector<std::int64_t> covering_first;
  std::vector<std::int64_t> covering_at;
  std::vector<std::uint8_t> covering_position;

  explicit PoolWindows(const PoolGeometry& g);
};

// Calls body(at, first, last, c0) for each of a plane's rows x cols positions (offsets
// `row` and `col` apart) and each L of its `lanes` channels, [first, last) = ranges[p],
// ranges[p + 1] for the p-th position. Everything arrives by value: the body's vector stores may
// alias anything (lanes.hpp's vectors are may_alias), and GCC reloaded a geometry read through
// references after each one, which took the overlapping gather's loop overhead to the cost of its
// sums. Inlined into each build of the loops, so the body is compiled for its ISA.
template <int L, class Body>
[[gnu::always_inline]] inline void for_each_range(std::int64_t rows, std::int64_t cols, std::int64_t row,
                                                  std::int64_t col, std::int64_t lanes,
                                                  const std::int64_t* ranges, Body&& body) {
  for (std::int64_t r = 0, p = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c, ++p) {
      const std::int64_t first = ranges[p], last = ranges[p + 1];
      const std::int64_t at = r * row + c * col;
      for (std::int64_t c0 = 0; c0 < lanes; c0 += L) body(at, first, last, c0);
    }
}

// Every output position of a plane: `at` its offset in the output plane, [first, last) its
// window's valid positions in `win` (offset, position).
template <int L, class Body>
[[gnu::always_inline]] inline void for_each_window(const PoolGeometry& g, const PoolWindows& win, Body&& body) {
  for_each_range<L>(g.oh, g.ow, g.dst.row, g.dst.col, g.lanes, win.first.data(), body);
}

// Overlapping windows, every input position of a plane: `at` its offset in the input plane,
// [first, last) its covering windows in `win` (covering_at, covering_position), in window order.
template <int L, class Body>
[[gnu::always_inline]] inline void for_each_input(const PoolGeometry& g, const PoolWindows& win, Body&& body) {
  for_each_range<L>(g.h, g.w, g.src.row, g.src.col, g.lanes, win.covering_first.data(), body);
}

// Zeroes the input positions of a plane: `rows` whole (every column), then `cols` whole; L lanes
// per store. A call to memset per position cost the seed CNN's second pooling (11 x 11 inputs,
// its last row and column in no window) a third of its backward.
template <class T, int L>
void zero_positions(const PoolGeometry& g, T* diff_src, const std::vector<std::int64_t>& rows,
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

// A pooling on the loops above where pool_geometry covers its input (and `covers` agrees), else on
// oneDNN's kernel. Either way it can apply the derivative of a relu below it while it writes its
// input gradient (nn/kernel.hpp: its input is that relu's output), which the relu's layer then
// leaves out; on oneDNN's kernel the derivative runs after the pooling, on the gradient.
// A subclass supplies the planes' loops; planes (n, group) are independent and the replica's
// OpenMP team shares them (run_planes).
class OwnPool2DKernel : public nn::LayerKernel {
 public:
  OwnPool2DKernel(nn::Pool2DLayer& layer, OnednnContext& ctx, dnnl::algorithm algorithm);

  LayoutPtr plan(std::int64_t batch, const LayoutPtr& src) override;
  bool take_input_activation_backward(config::Activation below) override;
  // A reshape above: the output channels-last (its canonical layout) where the input is too, or is
  // in channel groups that fill the channels exactly (each window's lanes then go to their
  // channels' place in the position: stores of the same width, the reshape then moves nothing).
  void prefer_canonical_output() override { canonical_output_ = true; }
  void bind(std::int64_t batch, const nn::LayerIO& io) override;
  void forward(std::int64_t batch, const nn::StepContext& step) override;
  void backward(std::int64_t batch, const nn::StepContext& step) override;

 protected:
  struct Plan {
    std::int64_t batch = 0;
    PoolGeometry geometry;
    DType dtype = DType::f32;
    std::unique_ptr<PoolWindows> windows;
    std::int64_t dst_elements = 0;        // of dst's memory, padding lanes included
    std::vector<std::uint8_t> workspace;  // max pooling's winners, sized by planned()
    dnnl::memory src, dst, diff_dst, diff_src;
  };

  // Whether the loops of the subclass cover this geometry (beyond pool_geometry's rules).
  virtual bool covers(const PoolGeometry&) const { return true; }
  // After a plan on the loops is made (its dst arrangement set): sizes what the subclass keeps.
  virtual void planned(Plan&) {}
  virtual void forward_planes(Plan& p) = 0;
  virtual void backward_planes(Plan& p) = 0;  // only where a layer below wants the gradient

  // Calls body.template operator()<T, L>(in, out) for every plane of the batch, in the replica's
  // OpenMP team: T the plan's dtype (float, or std::uint16_t holding bf16), L the lanes of the build
  // of the loops for isa() it runs in, `in` the plane's offset in src and diff_src, `out` in dst,
  // diff_dst and the workspace. The OpenMP region itself is built for plain x86-64.
  template <class Body>
  void run_planes(const Plan& p, const Body& body) const {
    if (p.dtype == DType::bf16) return run_planes_as<std::uint16_t>(p, body);
    run_planes_as<float>(p, body);
  }

  bool relu_below() const { return relu_below_; }

 private:
  template <class T, class Body>
  void run_planes_as(const Plan& p, const Body& body) const {
    const PoolGeometry& g = p.geometry;
    const std::int64_t groups = g.src.groups, planes = p.batch * groups;
    const LoopIsa isa = isa_;
    for_each_item(planes, [&](std::int64_t q) {
      const std::int64_t n = q / groups, group = q % groups;
      const std::int64_t in = n * g.src.n + group * g.src.group, out = n * g.dst.n + group * g.dst.group;
      run_with_lanes(isa, g.lanes, [&]<int L>() { body.template operator()<T, L>(in, out); });
    });
  }

  Plan* own_plan(std::int64_t batch);

  nn::Pool2DLayer& layer_;
  OnednnContext& ctx_;
  LoopIsa isa_;               // the build of the loops this kernel runs
  Pool2DKernel onednn_;       // for what the loops do not cover
  std::vector<Plan> plans_;   // one per batch size planned on the loops (few: the batch and a last one)
  bool relu_below_ = false;   // this backward applies the derivative of the relu below
  bool canonical_output_ = false;  // prefer_canonical_output
  ActivationFn relu_{config::Activation::relu};
  std::vector<std::pair<std::int64_t, ActivationFn::Plan>> fallback_relu_;  // per batch oneDNN pools
};

}  // namespace dtrain::backends::onednn
