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
// these loops, one AVX2 core). In bfloat16 they are the first layer's on a few channels, and on
// CPUs with AVX512-BF16 and no AMX every layer's that fits (x read as bfloat16 codes, two output
// positions an instruction: accumulate_pair_taps); on AMX the others are matmuls (GemmWeights).
// Their oracle is the same as the primitive's (Conv2D::reference_backward, test_layers).
//   dW[kh][kw][c][f] = sum over n, oh, ow of x[n][oh*sh + kh - pt][ow*sw + kw - pl][c] * dy[n][oh][ow][f]
//   db[f]            = sum over n, oh, ow of dy[n][oh][ow][f]
// (oh, ow over the output positions the layer above reads, output_read_within: the gradient is
// zero at the others, whose +0 terms would not change the sums.)
// Each (kh, kw, c) is a tap; every tap's sum runs over L output channels at once (a vector). A
// pass holds G taps x V vectors of accumulators in registers and reads each output gradient
// vector once per G taps and each input value once per V vectors. Samples are summed in fixed
// chunks whose partial sums are added in chunk order, so the bits depend neither on the thread
// count nor on how taps and vectors are grouped into passes. An item of work is one chunk's sum
// for one group of V filter vectors; under lanes, a lane that has run its own items runs those the
// other lanes have not started (core/shared_work.hpp), into their partial sums: the same bits.
//
// A max pooling above such a first layer (windows that do not overlap, 'valid' padding; relu or no
// activation; f32 or bf16) is computed here with it (nn/kernel.hpp's take_output_max_pooling):
// the convolution's output and its gradient are the bytes such a layer is bound by, and most of
// the gradient is the zeros the pooling writes. Forward stores only the pooled maximum and which
// position won (as the pooling layer would): 2 x 2 windows are convolved and pooled in registers
// (in bfloat16 on AVX512-BF16, pooled on the activations' 16-bit codes, and without AMX two taps
// an instruction: cpu_multiplies_bf16_pairs), other windows through a per-thread scratch plane of
// the sums. Backward runs the weight loops above on the gradient the pooling's backward would
// write, computed from the pooled gradient and the winners: in registers as the loops reach each
// position (accumulate_pooled_taps; accumulate_pooled_pairs, two positions an instruction) on 16
// lanes, into a plane of one sample and filter vector that stays in the caches
// (expand_pooled_gradient) on 8. It has the pooling layer's bits, and the loops add its nonzero
// terms in the same order, so the weights' gradients are those of the two layers computed apart.
//   y (N, OH / sh, OW / sw, F)  the pooled output, arranged as oneDNN's dst would be (or nhwc)
//   ws                           u8 per element of y: the window position of the max (kNoWinner
//                                where a relu zeroed it)
#include <omp.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "backends/onednn/lanes.hpp"
#include "core/shared_work.hpp"
#include "backends/onednn/weighted_op.hpp"
#include "nn/conv2d.hpp"
#include "nn/max_pool2d.hpp"

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
  int vectors;                       // V: filter vectors per pass, 1 or 2 (in pairs, up to 4)
  std::vector<std::int64_t> taps;    // offset of tap (kh, kw, c) in a padded sample, in HWIO order
  // A bfloat16 layer's fused loops (take_output_max_pooling): x is rounded to bfloat16 as it is
  // padded, as oneDNN's bfloat16 convolution reads it.
  bool bf16 = false;
  // Its products two an instruction (cpu_multiplies_bf16_pairs): fused, the forward's taps in
  // pairs (TapPairs) and the backward's 2-wide windows' positions (accumulate_pooled_pairs); not
  // fused, two neighbouring positions of an output row (accumulate_pair_taps).
  bool pairs = false;
  // x holds bfloat16 codes (a layer below computes in bfloat16): widened as it is padded.
  bool x_codes = false;
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
constexpr int kForwardVectors = 4;  // filter vectors a fused forward convolves at once (convolve_sample)
constexpr std::int64_t kMaxTapsOfFewChannels = 64;
// The im2col copy of a chunk of samples a bfloat16 layer's weights' gradients take (Conv2DKernel::
// plan_gemm_weights), at least one sample's: it stays in a core's L2 cache. On the seed CNN's second
// convolution, 32 samples a lane, chunks of 8 samples (460 KB) took 0.28 ms with the copies, of 16
// 0.32 and of all 32 0.40; of 4 0.33 (a 2-core Intel Xeon with AMX, 2 MB of L2 a core).
constexpr std::int64_t kIm2colChunkBytes = 512 * 1024;

// `count` floats rounded to bfloat16 in place (rounded_to_bf16), 8 at a time.
DTRAIN_LANE_CLONES void round_to_bf16(float* __restrict p, std::int64_t count) {
  using F = Vec<float, 8>;
  std::int64_t i = 0;
  for (; i + 8 <= count; i += 8) store(p + i, rounded_to_bf16<8>(load<F>(p + i)));
  if (i == count) return;
  float rest[8] = {};
  std::copy(p + i, p + count, rest);
  store(rest, rounded_to_bf16<8>(load<F>(rest)));
  std::copy_n(rest, count - i, p + i);
}

// One sample of x, channels last, into the inside of `padded`: padded[(ih * padded_w + iw) * C + c].
// The padding around it stays zero: it is zeroed once, when the buffer is sized, and never written.
// Blocks of 8 channels move as vectors (a call to memmove per block cost as much as the copy), a
// channel group at a time: Arrangement::channel's division for every block of 8 was nine tenths of
// this copy's time (perf on a VGG-style stem's `dtrain bench`: 0.37 % of its samples, now 0.08 %;
// 2-core AVX512-BF16 EPYC). T: x's element, float, or std::uint16_t (bfloat16 codes, widened
// exactly: already rounded).
template <class T>
DTRAIN_LANE_CLONES void pad_sample(const WeightLoopsGeometry& g, const T* __restrict x, float* __restrict padded) {
  const bool whole_vectors = g.x.lanes % 8 == 0 && g.c % 8 == 0;
  const bool whole_rows = g.x.groups == 1 && g.x.lanes == g.c && g.x.col == g.c;  // nhwc: a row is contiguous
  for (std::int64_t ih = 0; ih < g.h; ++ih) {
    float* row = padded + ((ih + g.pad_top) * g.padded_w + g.pad_left) * g.c;
    const T* from = x + ih * g.x.row;
    if (whole_rows) {  // a grayscale or RGB row one value at a time took 2 us per 28 x 28 sample
      if constexpr (std::is_same_v<T, float>) {
        std::copy_n(from, g.w * g.c, row);
      } else {
        std::int64_t i = 0;
        for (; i + 8 <= g.w * g.c; i += 8) store(row + i, load_widened<8>(from + i));
        for (; i < g.w * g.c; ++i) row[i] = widen(from[i]);
      }
      continue;
    }
    for (std::int64_t iw = 0; iw < g.w; ++iw) {
      float* to = row + iw * g.c;
      const T* group = from + iw * g.x.col;  // the position's first channel group
      for (std::int64_t c0 = 0; c0 < g.c; c0 += g.x.lanes, group += g.x.group) {
        const std::int64_t count = std::min(g.x.lanes, g.c - c0);  // (the last group may be padded)
        if (whole_vectors) {
          for (std::int64_t l = 0; l < count; l += 8) store(to + c0 + l, load_widened<8>(group + l));
        } else {
          for (std::int64_t l = 0; l < count; ++l) to[c0 + l] = widen(group[l]);
        }
      }
    }
  }
  // (The padding: zeros stay zero. Codes are bfloat16 values already.)
  if (g.bf16 && std::is_same_v<T, float>) round_to_bf16(padded, g.padded_h * g.padded_w * g.c);
}

// Sample n of x (float, or bfloat16 codes where g.x_codes) padded into `padded`.
void pad_sample_of(const WeightLoopsGeometry& g, const void* x, std::int64_t n, float* padded) {
  if (g.x_codes) return pad_sample(g, static_cast<const std::uint16_t*>(x) + n * g.x.n, padded);
  pad_sample(g, static_cast<const float*>(x) + n * g.x.n, padded);
}

// Whether a sample of x already lies as pad_sample would lay it out, so that the loops read it
// where it is: no padding, channels last with rows one after another, and float32 loops (a
// bfloat16 layer's loops read x rounded). On the seed CNN (both convolutions 'valid', channels
// last; 2-core Zen 5 EPYC, alternating step by step in one process): the first convolution's
// backward 7-8 % shorter; the second's weight loops took as long as with the copies (2 % of a
// float32 step's samples in perf), whose reads the loops' own now make.
bool reads_in_place(const WeightLoopsGeometry& g) {
  return !g.bf16 && !g.x_codes && g.padded_h == g.h && g.padded_w == g.w && g.x.groups == 1 && g.x.lanes == g.c &&
         g.x.col == g.c && g.x.row == g.w * g.c;
}

// Sample n of x as the loops read it: in place (reads_in_place), or padded into `padded`.
const float* padded_sample(const WeightLoopsGeometry& g, const float* x, std::int64_t n, float* padded) {
  if (reads_in_place(g)) return x + n * g.x.n;
  pad_sample(g, x + n * g.x.n, padded);
  return padded;
}

template <int L>
using Mask = Vec<std::int32_t, L>;

// a where `mask`, else b; as bit operations (GCC 12 selects 16 float lanes one by one on AVX-512).
template <int L>
[[gnu::always_inline]] inline Vec<float, L> select(const Mask<L>& mask, const Vec<float, L>& a,
                                                   const Vec<float, L>& b) {
  return std::bit_cast<Vec<float, L>>((mask & std::bit_cast<Mask<L>>(a)) | (~mask & std::bit_cast<Mask<L>>(b)));
}

// L lanes of a gradient after a relu, at dy, with the relu's derivative applied as it is read: the
// gradient where the relu's output (at y, arranged as dy) is above zero, +0 elsewhere (oneDNN's
// relu backward from its output writes d x 0 there, a zero of either sign: the sums it feeds
// start at +0, where a zero of either sign adds nothing). In bfloat16 on the codes, before they are
// widened: an output above zero is a code from 1 to 0x7F80 (+infinity), one unsigned compare of
// code - 1 (a NaN, 0x7F81 and up, is not above zero); half the instructions of widening both first.
template <int L>
[[gnu::always_inline]] inline Vec<float, L> load_relu_gradient(const float* dy, const float* y) {
  using F = Vec<float, L>;
  const Mask<L> above = load<F>(y) > F{};
  return std::bit_cast<F>(above & load_whole<Mask<L>>(dy));
}
template <int L>
[[gnu::always_inline]] inline Vec<float, L> load_relu_gradient(const std::uint16_t* dy, const std::uint16_t* y) {
  using U = Vec<std::uint16_t, L>;
  const auto above = load<U>(y) - std::uint16_t{1} < std::uint16_t{0x7F80};
  const U codes = load_whole<U>(dy) & std::bit_cast<U>(above);
  return std::bit_cast<Vec<float, L>>(__builtin_convertvector(codes, Vec<std::uint32_t, L>) << 16);
}

// Adds, for the G taps at `taps` and V filter vectors, sum over (oh, ow) of padded x at the tap
// times dy's L lanes into acc[v][t * L + lane]; dy[v] is vector v's output gradient at (0, 0).
// Relu: dy is the gradient after a relu whose output, arranged as dy, starts at relu_y[v]; the
// loops apply its derivative as they read dy (load_relu_gradient). A template parameter: GCC 12
// kept a test of relu_y inside the loop, where without a relu the relu's pointers still advanced,
// the loads sat behind a taken branch and a jump back, and the bound came from the stack (AVX2: 31
// instructions a position for 12 multiply-adds, 26 without the test).
// T: the gradient's element, float or std::uint16_t (bfloat16, widened exactly).
// Built as accumulate_taps_by8 (every level) and accumulate_taps_by16 (x86-64-v4 alone).
template <int L, int V, int G, class T, bool Relu>
[[gnu::always_inline]] inline void accumulate_taps(const WeightLoopsGeometry& g, const std::int64_t* taps,
                                                   const float* __restrict padded, const void* const* dy,
                                                   const void* const* relu_y, float* const* acc) {
  using F = Vec<float, L>;
  F sums[G][V];
  std::int64_t offset[G];
  const T* __restrict gradient[V];
  const T* __restrict output[V] = {};
  for (int v = 0; v < V; ++v) {
    gradient[v] = static_cast<const T*>(dy[v]);
    if constexpr (Relu) output[v] = static_cast<const T*>(relu_y[v]);
  }
  for (int t = 0; t < G; ++t) {
    offset[t] = taps[t];
    for (int v = 0; v < V; ++v) sums[t][v] = load<F>(acc[v] + t * L);
  }
  for (std::int64_t oh = 0; oh < g.oh; ++oh) {
    const float* row = padded + oh * g.sh * g.padded_w * g.c;
    for (std::int64_t ow = 0; ow < g.ow; ++ow) {
      F d[V];
      const std::int64_t position = oh * g.dy.row + ow * g.dy.col;
      for (int v = 0; v < V; ++v) {
        if constexpr (Relu) d[v] = load_relu_gradient<L>(gradient[v] + position, output[v] + position);
        else d[v] = load_widened<L>(gradient[v] + position);
      }
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

template <int V, int G, class T, bool Relu>
DTRAIN_LANE_CLONES void accumulate_taps_by8(const WeightLoopsGeometry& g, const std::int64_t* taps,
                                            const float* __restrict padded, const void* const* dy,
                                            const void* const* relu_y, float* const* acc) {
  accumulate_taps<8, V, G, T, Relu>(g, taps, padded, dy, relu_y, acc);
}
// 16 lanes run only where the CPU has AVX-512 (Conv2DKernel plans them for x86-64-v4 alone).
template <int V, int G, class T, bool Relu>
[[DTRAIN_X86_64_V4]] void accumulate_taps_by16(const WeightLoopsGeometry& g, const std::int64_t* taps,
                                               const float* __restrict padded, const void* const* dy,
                                               const void* const* relu_y, float* const* acc) {
  accumulate_taps<16, V, G, T, Relu>(g, taps, padded, dy, relu_y, acc);
}

// The bias's gradient, in the taps' order of positions; relu_y as accumulate_taps' (one vector's).
template <int L, class T>
DTRAIN_LANE_CLONES void accumulate_bias(const WeightLoopsGeometry& g, const void* dy, const void* relu_y,
                                        float* __restrict acc) {
  using F = Vec<float, L>;
  const T* __restrict gradient = static_cast<const T*>(dy);
  const T* __restrict output = static_cast<const T*>(relu_y);
  F sum = load<F>(acc);
  for (std::int64_t oh = 0; oh < g.oh; ++oh)
    for (std::int64_t ow = 0; ow < g.ow; ++ow) {
      const std::int64_t position = oh * g.dy.row + ow * g.dy.col;
      sum += output ? load_relu_gradient<L>(gradient + position, output + position) : load_widened<L>(gradient + position);
    }
  store(acc, sum);
}

void accumulate_bias_of(const WeightLoopsGeometry& g, const void* dy, const void* relu_y, float* acc) {
  if (g.lanes == 16)
    return g.bf16 ? accumulate_bias<16, std::uint16_t>(g, dy, relu_y, acc) : accumulate_bias<16, float>(g, dy, relu_y, acc);
  g.bf16 ? accumulate_bias<8, std::uint16_t>(g, dy, relu_y, acc) : accumulate_bias<8, float>(g, dy, relu_y, acc);
}

using AccumulateFn = void (*)(const WeightLoopsGeometry&, const std::int64_t*, const float*, const void* const*,
                              const void* const*, float* const*);

template <int L, int V, class T, bool Relu, std::size_t... G>
std::array<AccumulateFn, sizeof...(G)> accumulate_table(std::index_sequence<G...>) {
  if constexpr (L == 16) return {&accumulate_taps_by16<V, static_cast<int>(G) + 1, T, Relu>...};
  else return {&accumulate_taps_by8<V, static_cast<int>(G) + 1, T, Relu>...};
}

// The pass over `count` taps and `vectors` filter vectors, count in 1..accumulators(lanes) / vectors.
template <class T, bool Relu>
AccumulateFn accumulate_fn_of(int lanes, int vectors, std::int64_t count) {
  static const auto by8 = accumulate_table<8, 1, T, Relu>(std::make_index_sequence<kAccumulators>{});
  static const auto by16 = accumulate_table<16, 1, T, Relu>(std::make_index_sequence<kWideAccumulators>{});
  static const auto pairs_by8 = accumulate_table<8, 2, T, Relu>(std::make_index_sequence<kAccumulators / 2>{});
  static const auto pairs_by16 =
      accumulate_table<16, 2, T, Relu>(std::make_index_sequence<kWideAccumulators / 2>{});
  const auto i = static_cast<std::size_t>(count - 1);
  if (vectors == 2) return lanes == 16 ? pairs_by16[i] : pairs_by8[i];
  return lanes == 16 ? by16[i] : by8[i];
}

// The output gradient read: bfloat16 where the layer computes in it, else (and expanded from a
// pooled gradient, expand_pooled_gradient) float; after a relu (relu_y) or not.
AccumulateFn accumulate_fn(const WeightLoopsGeometry& g, bool bf16_gradient, bool relu, int vectors,
                           std::int64_t count) {
  if (bf16_gradient)
    return relu ? accumulate_fn_of<std::uint16_t, true>(g.lanes, vectors, count)
                : accumulate_fn_of<std::uint16_t, false>(g.lanes, vectors, count);
  return relu ? accumulate_fn_of<float, true>(g.lanes, vectors, count)
              : accumulate_fn_of<float, false>(g.lanes, vectors, count);
}

// A max pooling computed with the convolution: windows inside the output that do not overlap.
struct PoolingGeometry {
  std::int64_t kh, kw, sh, sw, oh, ow;  // window, strides, pooled size
  Arrangement y;                        // the pooled output's, its gradient's and the workspace's
  bool relu = false;                    // the convolution's activation: relu, or none
};

// One sample's gradient of the convolution's output for the L filters from `first_lane` on, as the
// pooling's backward would write it (with the relu's derivative where there is one): the pooled
// gradient where the window's max came from, +0 elsewhere and outside every window (and in windows
// whose max the relu zeroed: their winner is kNoWinner). `into` is (OH, OW, L), the layout g.dy
// describes in a fused plan. The bias's gradient is summed here, in the weight loops' order
// (accumulate_bias): adding the +0s of the other positions would not change a sum that starts at
// +0. KW, SW: the window's width and stride when known when compiled (2 and 2 unrolled), 0 when not.
// T: the pooled gradient's element, float or std::uint16_t (bfloat16, widened exactly). The plane
// stays in the caches; where vectors are 8 lanes, this then accumulate_taps over the plane beat
// accumulate_pooled_taps (routes_pooled_gradient).
template <int L, int KW, int SW, class T>
DTRAIN_LANE_CLONES void expand_pooled_gradient(const WeightLoopsGeometry& g, const PoolingGeometry& p, std::int64_t n,
                                               std::int64_t first_lane, const void* pooled_gradient,
                                               const std::uint8_t* __restrict ws, float* __restrict into,
                                               float* __restrict bias_acc) {
  const T* __restrict diff_y = static_cast<const T*>(pooled_gradient);
  using B = Mask<L>;
  using F = Vec<float, L>;
  F bias = load<F>(bias_acc);
  const std::int64_t base = n * p.y.n + p.y.channel(first_lane);
  const std::int64_t kw = KW > 0 ? KW : p.kw, sw = SW > 0 ? SW : p.sw;
  const std::int64_t covered_w = std::min(g.ow, p.ow * sw);
  for (std::int64_t oh = 0; oh < g.oh; ++oh) {
    float* row = into + oh * g.ow * L;
    const std::int64_t ph = oh / p.sh, i = oh % p.sh;
    if (ph >= p.oh || i >= p.kh) {
      for (std::int64_t ow = 0; ow < g.ow; ++ow) store(row + ow * L, B{});
      continue;
    }
    for (std::int64_t pw = 0; pw < p.ow; ++pw) {
      const std::int64_t at = base + ph * p.y.row + pw * p.y.col;
      const B d = std::bit_cast<B>(load_widened<L>(diff_y + at));
      const B which = load_bytes_widened<L>(ws + at);  // once per window
      // A lane's max is at one position: of the row's positions in the window, at most one is
      // not +0, so one addition of their bits' union adds what each would in turn.
      B in_row{};
      for (std::int64_t j = 0; j < sw && pw * sw + j < g.ow; ++j) {
        const B here = j < kw ? B(d & (which == static_cast<std::int32_t>(i * kw + j))) : B{};
        store(row + (pw * sw + j) * L, here);
        in_row |= here;
      }
      bias += std::bit_cast<F>(in_row);
    }
    for (std::int64_t ow = covered_w; ow < g.ow; ++ow) store(row + ow * L, B{});
  }
  store(bias_acc, bias);
}

using ExpandPooledFn = void (*)(const WeightLoopsGeometry&, const PoolingGeometry&, std::int64_t, std::int64_t,
                                const void*, const std::uint8_t*, float*, float*);

// Only of 8 lanes: 16 route the pooled gradient in registers (routes_pooled_gradient).
template <class T>
ExpandPooledFn expand_pooled_fn_of(const PoolingGeometry& p) {
  const bool pairs = p.kw == 2 && p.sw == 2;  // a window's two columns, then the next window's
  return pairs ? &expand_pooled_gradient<8, 2, 2, T> : &expand_pooled_gradient<8, 0, 0, T>;
}

ExpandPooledFn expand_pooled_fn(const WeightLoopsGeometry& g, const PoolingGeometry& p) {
  return g.bf16 ? expand_pooled_fn_of<std::uint16_t>(p) : expand_pooled_fn_of<float>(p);
}

// Adds, for the G taps at `taps` and V filter vectors, what accumulate_taps would add over one
// sample's gradient of the convolution's output as the pooling's backward writes it (with the
// relu's derivative where there is one), without writing it: at each position inside a window the
// pooled gradient where the window's max came from, +0 elsewhere (and in windows whose max the
// relu zeroed: their winner is kNoWinner). The positions are visited in accumulate_taps' order
// (rows, then columns) and those outside every window, whose products would add +0 to a sum that
// is never -0, are skipped: the same bits. `first_lane` is vector 0's first filter; vector v's is
// first_lane + v * L. Where `bias` is not null the bias's gradient is summed too, a window row's
// positions at once (a lane's max is at one of them: the union of their bits adds what each would
// in turn). T: the pooled gradient's element, float or std::uint16_t (bfloat16, widened exactly).
// Writing the gradient plane and reading it back cost as much as the multiply-adds (the seed CNN's
// first convolution's backward: 0.14-0.29 ms a step, a 2-core Intel Xeon with AMX).
// Of 16 lanes alone (routes_pooled_gradient), so built for x86-64-v4 alone.
template <int L, int V, int G, class T>
[[DTRAIN_X86_64_V4]] void accumulate_pooled_taps(const WeightLoopsGeometry& g, const PoolingGeometry& p,
                                                 const std::int64_t* taps, const float* __restrict padded,
                                                 const void* pooled_gradient, const std::uint8_t* __restrict ws,
                                                 std::int64_t n, std::int64_t first_lane, float* __restrict strip,
                                                 float* const* acc, float* const* bias) {
  using F = Vec<float, L>;
  using B = Mask<L>;
  const T* __restrict diff_y = static_cast<const T*>(pooled_gradient);
  F sums[G][V], bias_sums[V];
  std::int64_t offset[G], base[V];
  for (int t = 0; t < G; ++t) {
    offset[t] = taps[t];
    for (int v = 0; v < V; ++v) sums[t][v] = load<F>(acc[v] + t * L);
  }
  for (int v = 0; v < V; ++v) {
    base[v] = n * p.y.n + p.y.channel(first_lane + v * L);
    bias_sums[v] = bias ? load<F>(bias[v]) : F{};
  }
  for (std::int64_t ph = 0; ph < p.oh; ++ph) {
    // The row of windows' pooled gradients and winners, widened once for its rows of positions.
    for (std::int64_t pw = 0; pw < p.ow; ++pw)
      for (int v = 0; v < V; ++v) {
        const std::int64_t at = base[v] + ph * p.y.row + pw * p.y.col;
        store(strip + ((pw * V + v) * 2) * L, load_widened<L>(diff_y + at));
        store(strip + ((pw * V + v) * 2 + 1) * L, std::bit_cast<F>(load_bytes_widened<L>(ws + at)));
      }
    for (std::int64_t i = 0; i < p.kh && ph * p.sh + i < g.oh; ++i) {
      const float* row = padded + (ph * p.sh + i) * g.sh * g.padded_w * g.c;
      for (std::int64_t pw = 0; pw < p.ow; ++pw) {
        B d[V], which[V], in_row[V];
        for (int v = 0; v < V; ++v) {
          d[v] = std::bit_cast<B>(load<F>(strip + ((pw * V + v) * 2) * L));
          which[v] = std::bit_cast<B>(load<F>(strip + ((pw * V + v) * 2 + 1) * L));
          in_row[v] = B{};
        }
        for (std::int64_t j = 0; j < p.kw; ++j) {
          const std::int64_t ow = pw * p.sw + j;
          const auto position = static_cast<std::int32_t>(i * p.kw + j);
          F here[V];
          for (int v = 0; v < V; ++v) {
            const B mine = d[v] & (which[v] == position);
            in_row[v] |= mine;
            here[v] = std::bit_cast<F>(mine);
          }
          const float* at = row + ow * g.sw * g.c;
          for (int t = 0; t < G; ++t) {
            const float xv = at[offset[t]];
            for (int v = 0; v < V; ++v) sums[t][v] += xv * here[v];
          }
        }
        for (int v = 0; v < V; ++v) bias_sums[v] += std::bit_cast<F>(in_row[v]);
      }
    }
  }
  for (int t = 0; t < G; ++t)
    for (int v = 0; v < V; ++v) store(acc[v] + t * L, sums[t][v]);
  if (bias)
    for (int v = 0; v < V; ++v) store(bias[v], bias_sums[v]);
}

using AccumulatePooledFn = void (*)(const WeightLoopsGeometry&, const PoolingGeometry&, const std::int64_t*,
                                    const float*, const void*, const std::uint8_t*, std::int64_t, std::int64_t,
                                    float*, float* const*, float* const*);

// Vectors of 16 held in registers per pass of the pooled loops: fewer than accumulate_taps' 24, as
// each vector also keeps its pooled gradient, winners, and row union.
constexpr int kPooledAccumulators = 20;

// Whether the fused backward routes the pooled gradient in registers (accumulate_pooled_taps) or
// writes its plane first (expand_pooled_gradient, then accumulate_taps). Of 16 lanes the routing
// saves the plane's stores and loads (the seed CNN's first convolution's backward: float32 0.157-0.185
// -> 0.128-0.175 ms a step, a 2-core Intel Xeon with AMX). Of 8 (AVX2's 16 registers), the masks
// crowd out the sums: nine taps no longer fit a pass, and the second pass redoes the masks for one
// tap. There the same backward took 0.73-0.82 ms routed, 0.41-0.49 with nine taps a pass (spilling),
// and 0.33-0.40 expanded (float32, a 2-core AVX2 AMD EPYC).
bool routes_pooled_gradient(const WeightLoopsGeometry& g) { return g.lanes == 16; }

template <int L, int V, class T, std::size_t... G>
std::array<AccumulatePooledFn, sizeof...(G)> accumulate_pooled_table(std::index_sequence<G...>) {
  return {&accumulate_pooled_taps<L, V, static_cast<int>(G) + 1, T>...};
}

// The pass over `count` taps and `vectors` filter vectors of 16 lanes, count in
// 1..kPooledAccumulators / vectors.
template <class T>
AccumulatePooledFn accumulate_pooled_fn_of(int vectors, std::int64_t count) {
  static const auto by16 = accumulate_pooled_table<16, 1, T>(std::make_index_sequence<kPooledAccumulators>{});
  static const auto pairs_by16 = accumulate_pooled_table<16, 2, T>(std::make_index_sequence<kPooledAccumulators / 2>{});
  const auto i = static_cast<std::size_t>(count - 1);
  return vectors == 2 ? pairs_by16[i] : by16[i];
}

AccumulatePooledFn accumulate_pooled_fn(const WeightLoopsGeometry& g, int vectors, std::int64_t count) {
  return g.bf16 ? accumulate_pooled_fn_of<std::uint16_t>(vectors, count) : accumulate_pooled_fn_of<float>(vectors, count);
}

// z = sum over the taps of x at the tap times the tap's weights, for V vectors of L filters at
// every output position of one padded sample; z is V planes of (OH, OW, L), `w` (taps, w_stride)
// from the first vector's first filter. P positions of a row and V vectors at a time, as a GEMM
// micro-kernel: P x V independent sums take each tap's V weight vectors and P broadcasts of x.
// Every sum runs from zero in tap order, as oneDNN's direct convolution sums.
template <int L, int P, int V>
[[gnu::always_inline]] inline void convolve_block(const std::int64_t* __restrict taps, std::int64_t count,
                                                  const float* at, std::int64_t step, const float* __restrict w,
                                                  std::int64_t w_stride, float* z, std::int64_t plane) {
  using F = Vec<float, L>;
  F sum[P][V];
  for (int q = 0; q < P; ++q)
    for (int v = 0; v < V; ++v) sum[q][v] = F{};
  for (std::int64_t t = 0; t < count; ++t) {
    const float* x = at + taps[t];
    F weight[V];
    for (int v = 0; v < V; ++v) weight[v] = load<F>(w + t * w_stride + v * L);
    for (int q = 0; q < P; ++q) {
      const float xv = x[q * step];
      for (int v = 0; v < V; ++v) sum[q][v] += xv * weight[v];
    }
  }
  for (int q = 0; q < P; ++q)
    for (int v = 0; v < V; ++v) store(z + v * plane + q * L, sum[q][v]);
}

template <int L, int V>
DTRAIN_LANE_CLONES void convolve_sample(const WeightLoopsGeometry& g, const float* __restrict padded,
                                        const float* __restrict w, std::int64_t w_stride, float* __restrict z) {
  // Positions per block: 3 x 4 sums, a weight vector and a broadcast fill 14 of AVX2's 16
  // registers (the other weights are the multiply-adds' memory operands). Four vectors a block
  // took 15 % less time than two on the 2-core AVX2 EPYC: half the broadcasts per multiply-add.
  constexpr int P = V == 4 ? 3 : 4;
  const std::int64_t taps = static_cast<std::int64_t>(g.taps.size());
  const std::int64_t plane = g.oh * g.ow * L;
  const std::int64_t step = g.sw * g.c;  // from one output position's taps to the next one's
  for (std::int64_t oh = 0; oh < g.oh; ++oh) {
    const float* row = padded + oh * g.sh * g.padded_w * g.c;
    float* out = z + oh * g.ow * L;
    std::int64_t ow = 0;
    for (; ow + P <= g.ow; ow += P)
      convolve_block<L, P, V>(g.taps.data(), taps, row + ow * step, step, w, w_stride, out + ow * L, plane);
    // The rest of the row as one block: alone, each position's sums are one chain of dependent
    // multiply-adds (a 26-wide row spent 40 % of its time in its last 2 positions).
    const float* at = row + ow * step;
    switch (g.ow - ow) {
      case 3: convolve_block<L, 3, V>(g.taps.data(), taps, at, step, w, w_stride, out + ow * L, plane); break;
      case 2: convolve_block<L, 2, V>(g.taps.data(), taps, at, step, w, w_stride, out + ow * L, plane); break;
      case 1: convolve_block<L, 1, V>(g.taps.data(), taps, at, step, w, w_stride, out + ow * L, plane); break;
      default: break;
    }
  }
}

using ConvolveSampleFn = void (*)(const WeightLoopsGeometry&, const float*, const float*, std::int64_t, float*);

// The convolution of `vectors` (1, 2 or 4) filter vectors of `lanes` (8 or 16).
ConvolveSampleFn convolve_sample_fn(int lanes, int vectors) {
  if (lanes == 16)
    return vectors == 4 ? &convolve_sample<16, 4> : vectors == 2 ? &convolve_sample<16, 2> : &convolve_sample<16, 1>;
  return vectors == 4 ? &convolve_sample<8, 4> : vectors == 2 ? &convolve_sample<8, 2> : &convolve_sample<8, 1>;
}

// One sample's output from its sums z (convolve_sample's `vectors` planes of (OH, OW, L), filters
// from `first_lane` on): the bias added after the sum and, where `relu`, the relu applied as
// oneDNN's post-op applies it (a * 0 at or below zero), stored into `y` (the sample's first
// element) arranged as `at`. Lanes past the arrangement's channels are not stored; lanes at
// padded channels hold +0 (their kernel columns and bias are zeros), the zeros oneDNN keeps there.
template <int L>
DTRAIN_LANE_CLONES void store_sample(const WeightLoopsGeometry& g, const Arrangement& at, const float* __restrict z,
                                     int vectors, const float* __restrict bias, std::int64_t first_lane, bool relu,
                                     float* __restrict y) {
  using F = Vec<float, L>;
  const std::int64_t plane = g.oh * g.ow * L;
  for (int v = 0; v < vectors; ++v) {
    const std::int64_t lane = first_lane + v * L;
    const std::int64_t room = std::min<std::int64_t>(L, at.lanes * at.groups - lane);
    if (room <= 0) return;
    const bool whole = room == L && lane % at.lanes + L <= at.lanes;  // one vector store a position
    const F b = load<F>(bias + v * L);
    float* out = y + at.channel(lane);
    const float* sums = z + v * plane;
    for (std::int64_t oh = 0; oh < g.oh; ++oh)
      for (std::int64_t ow = 0; ow < g.ow; ++ow) {
        F a = load<F>(sums + (oh * g.ow + ow) * L) + b;
        if (relu) a = select<L>(a > 0.0f, a, a * 0.0f);
        float* to = out + oh * at.row + ow * at.col;
        if (whole) {
          store(to, a);
        } else {
          float lanes[L];
          store(lanes, a);
          for (std::int64_t l = 0; l < room; ++l) to[at.channel(lane + l) - at.channel(lane)] = lanes[l];
        }
      }
  }
}

using StoreSampleFn = void (*)(const WeightLoopsGeometry&, const Arrangement&, const float*, int, const float*,
                               std::int64_t, bool, float*);
StoreSampleFn store_sample_fn(int lanes) { return lanes == 16 ? &store_sample<16> : &store_sample<8>; }

// A window's winner as the workspace keeps it: under relu, kNoWinner where the max is not positive
// (the relu's derivative is 0 there), so the backward needs the workspace alone, not the output.
constexpr std::int32_t kNoWinner = 255;
template <int L>
[[gnu::always_inline]] inline Vec<std::uint8_t, L> winner_bytes(const Vec<float, L>& best, const Mask<L>& which,
                                                                 bool relu) {
  if (!relu) return narrow_to_bytes<L>(which);
  const Mask<L> positive = best > 0.0f;
  return narrow_to_bytes<L>((positive & which) | (~positive & kNoWinner));
}

// One position of a window into the window's running max: the bias added after the sum and the
// activation applied, as oneDNN's post-op does; `position` counts the window's positions row by row.
// T: the output's element. In bfloat16 (std::uint16_t) the value is rounded before it is compared,
// as the pooling layer apart would compare the convolution's bfloat16 output: a rounding tie goes
// to the first position.
template <int L, class T>
[[gnu::always_inline]] inline void take_position(Vec<float, L> sum, const Vec<float, L>& bias, bool relu,
                                                 std::int32_t position, Vec<float, L>& best, Mask<L>& which) {
  using I = Mask<L>;
  Vec<float, L> a = sum + bias;
  // oneDNN's relu: a * 0 below zero (so -0 for a negative a), a above.
  if (relu) a = select<L>(a > 0.0f, a, a * 0.0f);
  if constexpr (std::is_same_v<T, std::uint16_t>) a = rounded_to_bf16<L>(a);
  // Strictly greater: on a tie the first position wins, as in the pooling layer.
  const I more = position == 0 ? ~I{} : a > best;
  best = select<L>(more, a, best);
  which = (more & position) | (~more & which);
}

// The pooled output and workspace of one sample's L filters from their convolution's sums z
// (OH, OW, L), for windows other than 2 x 2 (convolve_pool_2x2 pools those in registers). T: the
// output's element, float or std::uint16_t (bfloat16).
template <int L, class T>
DTRAIN_LANE_CLONES void pool_sums(const WeightLoopsGeometry& g, const PoolingGeometry& p, const float* __restrict z,
                                  const float* __restrict bias, T* __restrict y, std::uint8_t* __restrict ws) {
  using F = Vec<float, L>;
  const F b = load<F>(bias);
  for (std::int64_t ph = 0; ph < p.oh; ++ph)
    for (std::int64_t pw = 0; pw < p.ow; ++pw) {
      F best{};
      Mask<L> which{};
      for (std::int64_t i = 0; i < p.kh; ++i)
        for (std::int64_t j = 0; j < p.kw; ++j)
          take_position<L, T>(load<F>(z + ((ph * p.sh + i) * g.ow + pw * p.sw + j) * L), b, p.relu,
                              static_cast<std::int32_t>(i * p.kw + j), best, which);
      const std::int64_t at = ph * p.y.row + pw * p.y.col;
      store_narrowed<L>(y + at, best);  // (in bfloat16 already rounded: take_position)
      store(ws + at, winner_bytes<L>(best, which, p.relu));
    }
}

template <class T>
using PoolSumsFn = void (*)(const WeightLoopsGeometry&, const PoolingGeometry&, const float*, const float*, T*,
                           std::uint8_t*);

template <class T>
PoolSumsFn<T> pool_sums_fn(int lanes) {
  return lanes == 16 ? &pool_sums<16, T> : &pool_sums<8, T>;
}

// The fused forward of 2 x 2 windows without the scratch plane: a window's 4 positions are
// convolved in registers for V filter vectors (4 x V sums, each as convolve_block sums them) and
// pooled there, so only the pooled output and its workspace are stored, and positions outside every
// window are not computed. `y` and `ws` are the sample's; `first_lane` the first vector's filter;
// T the output's element, float or std::uint16_t (bfloat16).
template <int L, int V, class T>
DTRAIN_LANE_CLONES void convolve_pool_2x2(const WeightLoopsGeometry& g, const PoolingGeometry& p,
                                          const float* __restrict padded, const float* __restrict w,
                                          std::int64_t w_stride, const float* __restrict bias,
                                          std::int64_t first_lane, T* __restrict y, std::uint8_t* __restrict ws) {
  using F = Vec<float, L>;
  constexpr int Q = 4;  // the window's positions, row by row
  const std::int64_t taps = static_cast<std::int64_t>(g.taps.size());
  const std::int64_t* tap = g.taps.data();
  const std::int64_t col = g.sw * g.c;               // from one output position's taps to the next column's
  const std::int64_t row = g.sh * g.padded_w * g.c;  // and to the next row's
  F b[V];
  std::int64_t out[V];
  for (int v = 0; v < V; ++v) {
    const std::int64_t lane = first_lane + v * L;
    b[v] = load<F>(bias + lane);
    out[v] = p.y.channel(lane);
  }
  for (std::int64_t ph = 0; ph < p.oh; ++ph)
    for (std::int64_t pw = 0; pw < p.ow; ++pw) {
      const float* at = padded + ph * p.sh * row + pw * p.sw * col;
      const float* x[Q] = {at, at + col, at + row, at + row + col};
      F sum[Q][V];
      for (int q = 0; q < Q; ++q)
        for (int v = 0; v < V; ++v) sum[q][v] = F{};
      for (std::int64_t t = 0; t < taps; ++t) {
        F weight[V];
        for (int v = 0; v < V; ++v) weight[v] = load<F>(w + t * w_stride + first_lane + v * L);
        for (int q = 0; q < Q; ++q) {
          const float xv = x[q][tap[t]];
          for (int v = 0; v < V; ++v) sum[q][v] += xv * weight[v];
        }
      }
      const std::int64_t window = ph * p.y.row + pw * p.y.col;
      for (int v = 0; v < V; ++v) {
        F best{};
        Mask<L> which{};
        for (int q = 0; q < Q; ++q) take_position<L, T>(sum[q][v], b[v], p.relu, q, best, which);
        store_narrowed<L>(y + window + out[v], best);
        store(ws + window + out[v], winner_bytes<L>(best, which, p.relu));
      }
    }
}

template <class T>
using ConvolvePoolFn = void (*)(const WeightLoopsGeometry&, const PoolingGeometry&, const float*, const float*,
                                std::int64_t, const float*, std::int64_t, T*, std::uint8_t*);

// 2 vectors a window on AVX2 (8 sums, a broadcast and 2 weights of its 16 registers), 4 on AVX-512.
constexpr int window_vectors(int lanes) { return lanes == 16 ? 4 : 2; }

template <class T>
ConvolvePoolFn<T> convolve_pool_fn(int lanes, int vectors) {
  if (lanes == 16)
    return vectors == 4   ? &convolve_pool_2x2<16, 4, T>
           : vectors == 2 ? &convolve_pool_2x2<16, 2, T>
                          : &convolve_pool_2x2<16, 1, T>;
  return vectors == 2 ? &convolve_pool_2x2<8, 2, T> : &convolve_pool_2x2<8, 1, T>;
}

// The bfloat16 fused forward's pooling on the activations' bfloat16 codes (Conv2DKernel::
// plan_codes): 2 x 2 windows over a relu convolution, vectors of 16 filters, on CPUs with
// AVX512-BF16 (and so AVX512-BW). The sums are convolve_pool_2x2's, the same multiply-adds in the
// same order (or their pairs, below); VCVTNE2PS2BF16 rounds two vectors of activations to one of
// 32 codes, which compare as 16-bit integers: positive values' codes order as the values do, and
// under relu a window whose max is not positive has no winner and the pooled value is the first
// position's zero (a * 0, with its sign). On the seed CNN's first convolution take_position's f32
// lanes (add, relu, round, compare, two selects a position and vector) were most of the layer's
// instructions: its forward took 0.19-0.23 ms a step, 0.12-0.15 this way (a 2-core Intel Xeon with
// AMX). The conversion flushes a denormal activation (below 1.2e-38) to zero, as oneDNN's bfloat16
// convolution's does on these CPUs; rounded_to_bf16 keeps it, so only there do the bits differ
// from take_position's.
#define DTRAIN_AVX512_BF16 gnu::target("arch=x86-64-v4,avx512bf16")

bool cpu_converts_bf16_pairs() {
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
}

}  // namespace

// (context.hpp) Whether the bfloat16 weight loops multiply two taps (fused forward) or two
// positions (backward) an instruction, VDPBF16PS, instead of one each with f32 multiply-adds.
// VDPBF16PS adds the product of its words' high halves first, then the low halves', each addition
// rounded as a multiply-add rounds it (bfloat16 products are exact in f32; measured on the AVX512-BF16 EPYC: 3.2 M random
// lanes all equal to that order's), so a pair taken in the loops' order gives their bits, apart
// from denormals, which it reads and writes as zero. The AVX512-BF16 EPYC (Zen 4) computes twice
// the products a cycle this way (its bfloat16 GEMM peak is twice its f32 one); the AMX Xeon half
// (its multiply-adds issue on two ports, VDPBF16PS on one): there the pairs took longer.
bool cpu_multiplies_bf16_pairs() { return cpu_converts_bf16_pairs() && !__builtin_cpu_supports("amx-bf16"); }

namespace {

// A padded sample's pair image at distance d: word i holds x[i]'s bfloat16 code in its high half
// and x[i + d]'s in its low half (x already rounded: a code is its float's high half), so that one
// 32-bit broadcast reads two values VDPBF16PS multiplies; the last d words hold x[i] alone. Stored
// as floats, as the loops read them.
// The word VDPBF16PS reads as a pair: `high`'s bfloat16 code (a value already rounded: its float's
// high half), then `low`'s.
inline float pair_word(float high, float low) {
  return std::bit_cast<float>(std::bit_cast<std::uint32_t>(high) | std::bit_cast<std::uint32_t>(low) >> 16);
}

DTRAIN_LANE_CLONES void pair_image(const float* __restrict padded, std::int64_t size, std::int64_t d,
                                   float* __restrict image) {
  for (std::int64_t i = 0; i < size; ++i) image[i] = pair_word(padded[i], i + d < size ? padded[i + d] : 0.0f);
}

// 16 bfloat16 codes as 32-bit lanes.
[[DTRAIN_AVX512_BF16, gnu::always_inline]] inline __m512i widened(const std::uint16_t* codes) {
  return _mm512_maskz_cvtepu16_epi32(0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)));
}

// One position's words of pair_image_of_codes: the codes at `high` and `low` (a column of x, its
// channel groups as g.x lays them), each where it exists (High, Low; else zero). Branches known
// when compiled: with the choice inside, GCC 12 built each vector from per-lane masks; and 16
// codes widened by one instruction, where GCC's vectors of 8 took two halves and an insert.
template <bool High, bool Low>
[[DTRAIN_AVX512_BF16, gnu::always_inline]] inline void pair_words(const WeightLoopsGeometry& g,
                                                                  const std::uint16_t* __restrict high,
                                                                  const std::uint16_t* __restrict low,
                                                                  float* __restrict to) {
  const __mmask16 all = 0xFFFF;  // (the masked forms: see convolve_windows_codes)
  const bool whole_vectors = g.x.lanes % 16 == 0 && g.c % 16 == 0;
  for (std::int64_t c0 = 0, group = 0; c0 < g.c; c0 += g.x.lanes, group += g.x.group) {
    const std::int64_t count = std::min(g.x.lanes, g.c - c0);  // (the last group may be padded)
    if (whole_vectors) {
      for (std::int64_t l = 0; l < count; l += 16) {
        __m512i word = _mm512_setzero_si512();
        if constexpr (High) word = _mm512_maskz_slli_epi32(all, widened(high + group + l), 16);
        if constexpr (Low) word = _mm512_or_si512(word, widened(low + group + l));
        _mm512_storeu_si512(to + c0 + l, word);
      }
    } else {
      for (std::int64_t l = 0; l < count; ++l) {
        std::uint32_t word = 0;
        if constexpr (High) word = std::uint32_t{high[group + l]} << 16;
        if constexpr (Low) word |= low[group + l];
        to[c0 + l] = std::bit_cast<float>(word);
      }
    }
  }
}

// Not fused, x in bfloat16 codes (g.x_codes, g.pairs; so a CPU with AVX512-BF16): sample x's pair
// image at the distance of one output column, straight from its codes. Word (ih, iw, c) of the
// padded sample holds x's code at (ih, iw, c) in its high half and at (ih, iw + sw, c) in its low
// half, each zero in the padding and past the row's end. The rows of padding above and below are
// never written: zero since the buffer was sized. (pad_sample's float copy, then pair_image, took
// 3.4 % of a bfloat16 epoch's samples against the seed CNN's second convolution's 19.4 % in
// accumulate_pair_taps; this takes 2.3 %. perf, 2-core Zen 5 EPYC.)
[[DTRAIN_AVX512_BF16]] void pair_image_of_codes(const WeightLoopsGeometry& g, const std::uint16_t* __restrict x,
                                                float* __restrict image) {
  for (std::int64_t ih = 0; ih < g.h; ++ih) {
    const std::uint16_t* from = x + ih * g.x.row;
    float* row = image + (ih + g.pad_top) * g.padded_w * g.c;
    for (std::int64_t pw = 0; pw < g.padded_w; ++pw) {
      const std::int64_t a = pw - g.pad_left, b = a + g.sw;  // x's columns in the two halves
      const bool has_high = a >= 0 && a < g.w, has_low = b >= 0 && b < g.w;
      const std::uint16_t* high = has_high ? from + a * g.x.col : nullptr;
      const std::uint16_t* low = has_low ? from + b * g.x.col : nullptr;
      float* to = row + pw * g.c;
      if (has_high && has_low) pair_words<true, true>(g, high, low, to);
      else if (has_high) pair_words<true, false>(g, high, low, to);
      else if (has_low) pair_words<false, true>(g, high, low, to);
      else pair_words<false, false>(g, high, low, to);
    }
  }
}

// The forward's taps two at a time (cpu_multiplies_bf16_pairs): taps (2k, 2k + 1) in tap order,
// and the last alone where they are odd, each pair read from the pair image at its taps' distance
// (the second's offset less the first's), at its first tap's offset. A tap alone reads the padded
// sample itself: its words' low halves are zero, and so are its weights'.
struct TapPairs {
  std::vector<std::int64_t> distances;  // the images', each once
  std::vector<std::int64_t> first;      // per pair: its first tap's offset
  std::vector<int> image;               // per pair: its image's index in distances, or -1 (a tap alone)

  explicit TapPairs(const std::vector<std::int64_t>& taps) {
    for (std::size_t t = 0; t < taps.size(); t += 2) {
      first.push_back(taps[t]);
      if (t + 1 == taps.size()) {
        image.push_back(-1);
        continue;
      }
      const std::int64_t d = taps[t + 1] - taps[t];  // > 0: taps in HWIO order are in memory order
      const auto found = std::find(distances.begin(), distances.end(), d);
      image.push_back(static_cast<int>(found - distances.begin()));
      if (found == distances.end()) distances.push_back(d);
    }
  }
  std::int64_t count() const { return static_cast<std::int64_t>(first.size()); }
};

// The weights of the pairs: word (k, f) holds tap 2k's weight for filter f in its high half and tap
// 2k + 1's in its low half (zero for a tap alone). `w` (taps, stride), rounded to bfloat16.
void pair_weights(const float* w, std::int64_t taps, std::int64_t stride, float* pairs) {
  for (std::int64_t t = 0; t < taps; t += 2)
    for (std::int64_t f = 0; f < stride; ++f)
      pairs[t / 2 * stride + f] = pair_word(w[t * stride + f], t + 1 < taps ? w[(t + 1) * stride + f] : 0.0f);
}

// W neighbouring windows of a row (1 or 2: 4 x V x W independent sums keep the multiply-adds'
// latency hidden) for V vectors of 16 filters (1, 2 or 4) from the first of `w` (rows of w_stride),
// as convolve_pool_2x2<16, V, std::uint16_t> computes them. Term t of every sum reads
// source[t][the position's offset in the padded sample] times w's row t: a tap (the padded sample
// at the tap, one multiply-add) or, where Pairs, a pair of taps (TapPairs: a word of its image,
// VDPBF16PS).
template <int V, int W, bool Pairs>
[[DTRAIN_AVX512_BF16, gnu::always_inline]] inline void convolve_windows_codes(
    const WeightLoopsGeometry& g, const PoolingGeometry& p, const float* const* source, std::int64_t terms,
    std::int64_t at, const float* __restrict w, std::int64_t w_stride, const __m512* b, const std::int64_t* out,
    std::uint16_t* __restrict y, std::uint8_t* __restrict ws, std::int64_t window) {
  constexpr int Q = 4;  // a window's positions, row by row
  const std::int64_t col = g.sw * g.c, row = g.sh * g.padded_w * g.c, next = p.sw * col;
  std::int64_t position[W][Q];
  for (int k = 0; k < W; ++k) {
    const std::int64_t start = at + k * next;
    position[k][0] = start;
    position[k][1] = start + col;
    position[k][2] = start + row;
    position[k][3] = start + row + col;
  }
  __m512 sum[W][Q][V];
  for (int k = 0; k < W; ++k)
    for (int q = 0; q < Q; ++q)
      for (int v = 0; v < V; ++v) sum[k][q][v] = _mm512_setzero_ps();
  for (std::int64_t t = 0; t < terms; ++t) {
    __m512 weight[V];
    for (int v = 0; v < V; ++v) weight[v] = _mm512_loadu_ps(w + t * w_stride + v * 16);
    const float* from = source[t];
    for (int k = 0; k < W; ++k)
      for (int q = 0; q < Q; ++q) {
        const __m512 value = _mm512_set1_ps(from[position[k][q]]);
        for (int v = 0; v < V; ++v) {
          if constexpr (Pairs) sum[k][q][v] = _mm512_dpbf16_ps(sum[k][q][v], (__m512bh)value, (__m512bh)weight[v]);
          else sum[k][q][v] = _mm512_fmadd_ps(value, weight[v], sum[k][q][v]);
        }
      }
  }
  const __m512i sign = _mm512_set1_epi16(static_cast<std::int16_t>(0x8000)), none = _mm512_set1_epi16(kNoWinner);
  for (int k = 0; k < W; ++k)
    for (int v = 0; v < V; v += 2) {
      const int u = V == 1 ? v : v + 1;  // the vector in the codes' high half (one vector: itself again)
      __m512i code[Q];
      for (int q = 0; q < Q; ++q)
        code[q] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_add_ps(sum[k][q][u], b[u]), _mm512_add_ps(sum[k][q][v], b[v]));
      __m512i best = code[0], which = _mm512_setzero_si512();
      for (int q = 1; q < Q; ++q) {  // strictly greater: on a tie the first position wins
        const __mmask32 more = _mm512_cmpgt_epi16_mask(code[q], best);
        best = _mm512_mask_mov_epi16(best, more, code[q]);
        which = _mm512_mask_mov_epi16(which, more, _mm512_set1_epi16(static_cast<std::int16_t>(q)));
      }
      const __mmask32 positive = _mm512_cmpgt_epi16_mask(best, _mm512_setzero_si512());
      const __m512i pooled = _mm512_mask_mov_epi16(_mm512_and_si512(code[0], sign), positive, best);
      // (The masked forms of narrowing and extracting: GCC 12 warns that the plain ones' undefined
      // source operand is uninitialized.)
      const __m256i winner = _mm512_maskz_cvtepi16_epi8(~__mmask32{0}, _mm512_mask_mov_epi16(none, positive, which));
      const std::int64_t at_v = window + k * p.y.col + out[v];
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + at_v), _mm512_maskz_extracti64x4_epi64(0xF, pooled, 0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(ws + at_v), _mm256_castsi256_si128(winner));
      if constexpr (V > 1) {
        const std::int64_t at_u = window + k * p.y.col + out[u];
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + at_u), _mm512_maskz_extracti64x4_epi64(0xF, pooled, 1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(ws + at_u), _mm256_extracti128_si256(winner, 1));
      }
    }
}

// One sample's pooled output and workspace for V vectors of 16 filters from `first_lane`: `terms`
// sources and rows of `w` (convolve_windows_codes), w's row from the first filter.
template <int V, bool Pairs>
[[DTRAIN_AVX512_BF16]] void convolve_pool_codes(const WeightLoopsGeometry& g, const PoolingGeometry& p,
                                                const float* const* source, std::int64_t terms,
                                                const float* __restrict w, std::int64_t w_stride,
                                                const float* __restrict bias, std::int64_t first_lane,
                                                std::uint16_t* __restrict y, std::uint8_t* __restrict ws) {
  __m512 b[V];
  std::int64_t out[V];
  for (int v = 0; v < V; ++v) {
    b[v] = _mm512_loadu_ps(bias + first_lane + v * 16);
    out[v] = p.y.channel(first_lane + v * 16);
  }
  const std::int64_t col = g.sw * g.c, row = g.sh * g.padded_w * g.c;
  for (std::int64_t ph = 0; ph < p.oh; ++ph) {
    std::int64_t pw = 0;
    for (; pw + 2 <= p.ow; pw += 2)
      convolve_windows_codes<V, 2, Pairs>(g, p, source, terms, ph * p.sh * row + pw * p.sw * col, w + first_lane,
                                          w_stride, b, out, y, ws, ph * p.y.row + pw * p.y.col);
    if (pw < p.ow)
      convolve_windows_codes<V, 1, Pairs>(g, p, source, terms, ph * p.sh * row + pw * p.sw * col, w + first_lane,
                                          w_stride, b, out, y, ws, ph * p.y.row + pw * p.y.col);
  }
}

using ConvolvePoolCodesFn = void (*)(const WeightLoopsGeometry&, const PoolingGeometry&, const float* const*,
                                     std::int64_t, const float*, std::int64_t, const float*, std::int64_t,
                                     std::uint16_t*, std::uint8_t*);

template <bool Pairs>
ConvolvePoolCodesFn convolve_pool_codes_of(int vectors) {
  return vectors == 4   ? &convolve_pool_codes<4, Pairs>
         : vectors == 2 ? &convolve_pool_codes<2, Pairs>
                        : &convolve_pool_codes<1, Pairs>;
}

ConvolvePoolCodesFn convolve_pool_codes_fn(int vectors, bool pairs) {
  return pairs ? convolve_pool_codes_of<true>(vectors) : convolve_pool_codes_of<false>(vectors);
}

// What accumulate_pooled_taps<16, V, G, std::uint16_t> adds, with the products of a window row's
// two positions (2-wide windows) taken by one VDPBF16PS (cpu_multiplies_bf16_pairs): the first
// position's in the high halves, added first. `image` is the padded sample's pair image at the
// distance of one output column (pair_image), so a tap's word holds the input values of both
// positions; the gradient's word holds the pooled gradient in the half of the position that won
// (zero in the other: a lane's max is at one position). So one of the two products is zero, and
// the sum is the multiply-adds' whichever is added first.
template <int V, int G>
[[DTRAIN_AVX512_BF16]] void accumulate_pooled_pairs(const WeightLoopsGeometry& g, const PoolingGeometry& p,
                                                    const std::int64_t* taps, const float* __restrict image,
                                                    const void* pooled_gradient, const std::uint8_t* __restrict ws,
                                                    std::int64_t n, std::int64_t first_lane, float* __restrict strip,
                                                    float* const* acc, float* const* bias) {
  const auto* diff_y = static_cast<const std::uint16_t*>(pooled_gradient);
  __m512 sums[G][V], bias_sums[V];
  std::int64_t offset[G], base[V];
  for (int t = 0; t < G; ++t) {
    offset[t] = taps[t];
    for (int v = 0; v < V; ++v) sums[t][v] = _mm512_loadu_ps(acc[v] + t * 16);
  }
  for (int v = 0; v < V; ++v) {
    base[v] = n * p.y.n + p.y.channel(first_lane + v * 16);
    bias_sums[v] = bias ? _mm512_loadu_ps(bias[v]) : _mm512_setzero_ps();
  }
  const __mmask16 all = 0xFFFF;  // (the masked forms: see convolve_windows_codes)
  for (std::int64_t ph = 0; ph < p.oh; ++ph) {
    // The row of windows' pooled gradients (each code in its word's high half) and winners
    // times 16 (a shift of the code: below).
    for (std::int64_t pw = 0; pw < p.ow; ++pw)
      for (int v = 0; v < V; ++v) {
        const std::int64_t at = base[v] + ph * p.y.row + pw * p.y.col;
        const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(diff_y + at));
        const __m128i winners = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ws + at));
        float* into = strip + (pw * V + v) * 2 * 16;
        _mm512_storeu_si512(into, _mm512_maskz_slli_epi32(all, _mm512_maskz_cvtepu16_epi32(all, codes), 16));
        _mm512_storeu_si512(into + 16, _mm512_maskz_slli_epi32(all, _mm512_maskz_cvtepu8_epi32(all, winners), 4));
      }
    for (std::int64_t i = 0; i < p.kh && ph * p.sh + i < g.oh; ++i) {
      const float* row = image + (ph * p.sh + i) * g.sh * g.padded_w * g.c;
      // Row i's first position is the window's 2i: shifted right by 16 (winner - 2i) bits, the
      // code stays in the high half where that position won, moves to the low half where the
      // next one did, and leaves the word (a shift of 32 or more, or negative, gives 0) elsewhere
      // and where no position won (kNoWinner). Rounded down to a multiple of 32, the shift keeps
      // the code in the high half where either won: the row's gradient, for the bias's.
      const __m512i row_shift = _mm512_set1_epi32(static_cast<std::int32_t>(i * 32));
      const __m512i whole_words = _mm512_set1_epi32(~31);
      for (std::int64_t pw = 0; pw < p.ow; ++pw) {
        __m512i d[V];
        for (int v = 0; v < V; ++v) {
          const float* from = strip + (pw * V + v) * 2 * 16;
          const __m512i code = _mm512_loadu_si512(from);
          const __m512i shift = _mm512_sub_epi32(_mm512_loadu_si512(from + 16), row_shift);
          d[v] = _mm512_maskz_srlv_epi32(all, code, shift);
          const __m512i in_row = _mm512_maskz_srlv_epi32(all, code, _mm512_and_si512(shift, whole_words));
          bias_sums[v] = _mm512_add_ps(bias_sums[v], _mm512_castsi512_ps(in_row));
        }
        const float* at = row + pw * p.sw * g.sw * g.c;
        for (int t = 0; t < G; ++t) {
          const __m512 x = _mm512_set1_ps(at[offset[t]]);
          for (int v = 0; v < V; ++v) sums[t][v] = _mm512_dpbf16_ps(sums[t][v], (__m512bh)x, (__m512bh)d[v]);
        }
      }
    }
  }
  for (int t = 0; t < G; ++t)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(acc[v] + t * 16, sums[t][v]);
  if (bias)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(bias[v], bias_sums[v]);
}

template <int V, std::size_t... G>
std::array<AccumulatePooledFn, sizeof...(G)> accumulate_pooled_pairs_table(std::index_sequence<G...>) {
  return {&accumulate_pooled_pairs<V, static_cast<int>(G) + 1>...};
}

// The pass over `count` taps and `vectors` filter vectors, count in 1..kPooledAccumulators / vectors.
AccumulatePooledFn accumulate_pooled_pairs_fn(int vectors, std::int64_t count) {
  static const auto by16 = accumulate_pooled_pairs_table<1>(std::make_index_sequence<kPooledAccumulators>{});
  static const auto pairs_by16 = accumulate_pooled_pairs_table<2>(std::make_index_sequence<kPooledAccumulators / 2>{});
  const auto i = static_cast<std::size_t>(count - 1);
  return vectors == 2 ? pairs_by16[i] : by16[i];
}

// Not fused, on AVX512-BF16 without AMX (g.pairs): one sample's output gradient for V vectors of 16
// filters, vector v's from dy[v] (and, where relu_y is not null, the relu's output arranged as dy,
// from relu_y[v], whose derivative is applied as load_relu_gradient applies it), as the words
// VDPBF16PS reads: word (oh, k) of planes[v] holds position (oh, 2k)'s code in its high half and
// (oh, 2k + 1)'s in its low half (zero past the row's end). The bias's gradient is summed here, a
// pair's two positions in turn by a pair of ones: accumulate_bias's order and bits (a product by
// one is exact; VDPBF16PS reads and writes denormals as zero). The vectors side by side: each
// bias sum is a chain of dependent instructions.
template <int V>
[[DTRAIN_AVX512_BF16]] void pair_gradient_planes(const WeightLoopsGeometry& g, const std::uint16_t* const* dy,
                                                 const std::uint16_t* const* relu_y, float* const* planes,
                                                 float* const* bias_acc) {
  using U = Vec<std::uint16_t, 16>;
  using W = Vec<std::uint32_t, 16>;
  const auto codes = [&](int v, std::int64_t at) {
    U d = load_whole<U>(dy[v] + at);
    if (relu_y) d &= std::bit_cast<U>(load<U>(relu_y[v] + at) - std::uint16_t{1} < std::uint16_t{0x7F80});
    return __builtin_convertvector(d, W);
  };
  const std::int64_t pairs = (g.ow + 1) / 2;
  const __m512 ones = _mm512_castsi512_ps(_mm512_set1_epi32(0x3F803F80));  // bfloat16 1.0 in both halves
  __m512 bias[V];
  for (int v = 0; v < V; ++v) bias[v] = _mm512_loadu_ps(bias_acc[v]);
  for (std::int64_t oh = 0; oh < g.oh; ++oh)
    for (std::int64_t k = 0; k < pairs; ++k) {
      const std::int64_t first = oh * g.dy.row + 2 * k * g.dy.col;
      for (int v = 0; v < V; ++v) {
        const W second = 2 * k + 1 < g.ow ? codes(v, first + g.dy.col) : W{};
        const W word = codes(v, first) << 16 | second;
        store(planes[v] + (oh * pairs + k) * 16, std::bit_cast<Vec<float, 16>>(word));
        bias[v] = _mm512_dpbf16_ps(bias[v], (__m512bh)ones, (__m512bh)std::bit_cast<__m512>(word));
      }
    }
  for (int v = 0; v < V; ++v) _mm512_storeu_ps(bias_acc[v], bias[v]);
}

// What accumulate_taps<16, V, G, std::uint16_t> adds, two neighbouring positions of a row an
// instruction (VDPBF16PS), in its order: the first position's product in the words' high halves,
// added first. `image` is the padded sample's pair image at the distance of one output column
// (pair_image_of_codes, or pair_image of a float input), so a tap's word holds the input values of
// both positions; planes[v] is vector v's plane (pair_gradient_planes). A row's last position alone
// (an odd width) has a zero gradient in the low half: a +0 product, which leaves a sum that is
// never -0 as it was. The seed CNN's second convolution (288 taps, 64 filters, 10 x 10 positions
// read) took 0.37-0.46 ms a lane of 32 samples in oneDNN 2.6's bfloat16 backward-weights kernel
// (jit_bf16:avx512_core_bf16, 2-core Zen 5 EPYC); these loops as long, within the host's noise.
template <int V, int G>
[[DTRAIN_AVX512_BF16]] void accumulate_pair_taps(const WeightLoopsGeometry& g, const std::int64_t* taps,
                                                 const float* __restrict image, const float* const* planes,
                                                 float* const* acc) {
  __m512 sums[G][V];
  std::int64_t offset[G];
  for (int t = 0; t < G; ++t) {
    offset[t] = taps[t];
    for (int v = 0; v < V; ++v) sums[t][v] = _mm512_loadu_ps(acc[v] + t * 16);
  }
  const std::int64_t pairs = (g.ow + 1) / 2;
  const std::int64_t row_step = g.sh * g.padded_w * g.c, pair_step = 2 * g.sw * g.c;
  for (std::int64_t oh = 0; oh < g.oh; ++oh) {
    const float* row = image + oh * row_step;
    for (std::int64_t k = 0; k < pairs; ++k) {
      __m512 d[V];
      for (int v = 0; v < V; ++v) d[v] = _mm512_loadu_ps(planes[v] + (oh * pairs + k) * 16);
      const float* at = row + k * pair_step;
      for (int t = 0; t < G; ++t) {
        const __m512 x = _mm512_set1_ps(at[offset[t]]);
        for (int v = 0; v < V; ++v) sums[t][v] = _mm512_dpbf16_ps(sums[t][v], (__m512bh)x, (__m512bh)d[v]);
      }
    }
  }
  for (int t = 0; t < G; ++t)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(acc[v] + t * 16, sums[t][v]);
}

using AccumulatePairsFn = void (*)(const WeightLoopsGeometry&, const std::int64_t*, const float*, const float* const*,
                                   float* const*);

template <int V, std::size_t... G>
std::array<AccumulatePairsFn, sizeof...(G)> accumulate_pair_taps_table(std::index_sequence<G...>) {
  return {&accumulate_pair_taps<V, static_cast<int>(G) + 1>...};
}

// The pass over `count` taps and `vectors` filter vectors, count in 1..kWideAccumulators / vectors.
AccumulatePairsFn accumulate_pair_taps_fn(int vectors, std::int64_t count) {
  static const auto by1 = accumulate_pair_taps_table<1>(std::make_index_sequence<kWideAccumulators>{});
  static const auto by2 = accumulate_pair_taps_table<2>(std::make_index_sequence<kWideAccumulators / 2>{});
  static const auto by3 = accumulate_pair_taps_table<3>(std::make_index_sequence<kWideAccumulators / 3>{});
  static const auto by4 = accumulate_pair_taps_table<4>(std::make_index_sequence<kWideAccumulators / 4>{});
  const auto i = static_cast<std::size_t>(count - 1);
  return vectors == 4 ? by4[i] : vectors == 3 ? by3[i] : vectors == 2 ? by2[i] : by1[i];
}

// into[l] = +0 plus partial[c * stride + l] for the chunks c < chunks in turn, for l < count: the
// chunks' partial sums in chunk order, 8 lanes at a time (lane by lane, with the chunks innermost,
// they took 1.6 % of a bfloat16 epoch's samples, against 19.4 % in the second convolution's passes).
DTRAIN_LANE_CLONES void add_chunk_sums(const float* __restrict partial, std::int64_t chunks, std::int64_t stride,
                                       std::int64_t count, float* __restrict into) {
  using F = Vec<float, 8>;
  std::int64_t l = 0;
  for (; l + 8 <= count; l += 8) {
    F sum{};
    for (std::int64_t c = 0; c < chunks; ++c) sum += load<F>(partial + c * stride + l);
    store(into + l, sum);
  }
  for (; l < count; ++l) {
    float sum = 0.0f;
    for (std::int64_t c = 0; c < chunks; ++c) sum += partial[c * stride + l];
    into[l] = sum;
  }
}

// One backward's weight loops as items: item = sample chunk * groups + filter group, where a group
// is V filter vectors (the last may have fewer).
struct WeightJob {
  const WeightLoopsGeometry* g = nullptr;
  const void* x = nullptr;       // float, or bfloat16 codes where g->x_codes
  const void* dy = nullptr;      // not fused: the output gradient (float, or bfloat16 where g->bf16)
  const void* relu_y = nullptr;  // not fused, where not null: the relu's output, whose derivative the loops apply to dy
  bool bias = true;              // not fused: the bias's gradient is summed (accumulate_bias), the layer has one
  float* partial = nullptr;      // per (sample chunk, filter chunk): taps x L, then the bias's L
  std::int64_t groups = 0;
  std::int64_t padded_size = 0;  // floats of one padded sample
  std::int64_t slot_size = 0;    // floats of one cached sample: padded, then (g->pairs) its pair image; or
                                 // (g->pairs, g->x_codes) the pair image alone
  std::int64_t cached = 1;       // padded samples per worker
  float* padded = nullptr;       // per worker, `cached` slots
  std::int64_t* holds = nullptr; // per worker and cached sample: which sample it holds, -1 none
  // Fused with a max pooling: the pooled gradient (float, or bfloat16 where g->bf16) and the
  // workspace, routed to the output positions as the weight loops read them (accumulate_pooled_taps)
  // or expanded per sample and filter vector into a plane first (routes_pooled_gradient).
  const PoolingGeometry* pool = nullptr;
  const void* pooled_dy = nullptr;
  const std::uint8_t* ws = nullptr;
  float* strips = nullptr;      // routed: per worker, a row of windows' widened pooled gradients and winners
  std::int64_t strip_size = 0;  // floats of one: p.ow * g->vectors * 2 vectors
  float* expanded = nullptr;    // expanded: per worker, g->vectors planes of g->dy.n floats
  // Not fused, in pairs (g->pairs): per worker, g->vectors pair_gradient_planes of plane_size floats.
  float* pair_planes = nullptr;
  std::int64_t plane_size = 0;
};

void run_weight_item(void* job, std::int64_t item, int worker) noexcept {
  const WeightJob& j = *static_cast<const WeightJob*>(job);
  const WeightLoopsGeometry& g = *j.g;
  const std::int64_t taps = static_cast<std::int64_t>(g.taps.size());
  const std::int64_t per_item = (taps + 1) * g.lanes;  // taps, then the bias
  const std::int64_t chunk = item / j.groups;
  const std::int64_t fc = item % j.groups * g.vectors;
  const int vectors = static_cast<int>(std::min<std::int64_t>(g.vectors, g.filter_chunks - fc));
  float* acc[4] = {};
  for (int v = 0; v < vectors; ++v) acc[v] = j.partial + (chunk * g.filter_chunks + fc + v) * per_item;
  const bool routed = j.pool && routes_pooled_gradient(g);
  // The taps in the fewest passes the registers allow, of even counts: a pass reads the gradient
  // once whatever its taps, and 25 taps in 12, 12 and 1 spent a whole read on one multiply-add a
  // position (9, 8 and 8 now). The grouping leaves every sum's bits as they were.
  const std::int64_t most = (routed ? kPooledAccumulators : accumulators(g.lanes)) / vectors;
  const std::int64_t passes = (taps + most - 1) / most;
  const std::int64_t per_pass = (taps + passes - 1) / passes;
  const bool in_place = reads_in_place(g);
  for (std::int64_t n = chunk * kSamplesPerChunk; n < std::min(g.batch, (chunk + 1) * kSamplesPerChunk); ++n) {
    const std::int64_t slot = worker * j.cached + n % j.cached;
    float* cached = j.padded + slot * j.slot_size;
    const float* padded = in_place ? static_cast<const float*>(j.x) + n * g.x.n : cached;
    // (g.pairs) the positions' pairs, a column apart: from x's codes alone, or after its padded floats.
    float* image = g.x_codes ? cached : cached + j.padded_size;
    if (!in_place && j.holds[slot] != n) {
      if (g.pairs && g.x_codes) {
        pair_image_of_codes(g, static_cast<const std::uint16_t*>(j.x) + n * g.x.n, image);
      } else {
        pad_sample_of(g, j.x, n, cached);
        if (g.pairs) pair_image(cached, j.padded_size, g.sw * g.c, image);
      }
      j.holds[slot] = n;
    }
    if (routed) {
      float* bias[2] = {acc[0] + taps * g.lanes, acc[1] ? acc[1] + taps * g.lanes : nullptr};
      for (std::int64_t t = 0; t < taps; t += per_pass) {
        const std::int64_t count = std::min(per_pass, taps - t);
        float* const at[2] = {acc[0] + t * g.lanes, acc[1] ? acc[1] + t * g.lanes : nullptr};
        const AccumulatePooledFn pass =
            g.pairs ? accumulate_pooled_pairs_fn(vectors, count) : accumulate_pooled_fn(g, vectors, count);
        pass(g, *j.pool, g.taps.data() + t, g.pairs ? image : padded, j.pooled_dy, j.ws, n, fc * g.lanes,
             j.strips + worker * j.strip_size, at, t == 0 ? bias : nullptr);
      }
      continue;
    }
    if (g.pairs && !j.pool) {
      float* planes[4] = {};
      const std::uint16_t* dy_n[4] = {};
      const std::uint16_t* relu_y_n[4] = {};
      float* bias[4] = {};
      for (int v = 0; v < vectors; ++v) {
        planes[v] = j.pair_planes + (worker * g.vectors + v) * j.plane_size;
        const std::int64_t at = n * g.dy.n + g.dy.channel((fc + v) * g.lanes);
        dy_n[v] = static_cast<const std::uint16_t*>(j.dy) + at;
        if (j.relu_y) relu_y_n[v] = static_cast<const std::uint16_t*>(j.relu_y) + at;
        bias[v] = acc[v] + taps * g.lanes;
      }
      const std::uint16_t* const* relu_y = j.relu_y ? relu_y_n : nullptr;
      if (vectors == 4) pair_gradient_planes<4>(g, dy_n, relu_y, planes, bias);
      else if (vectors == 3) pair_gradient_planes<3>(g, dy_n, relu_y, planes, bias);
      else if (vectors == 2) pair_gradient_planes<2>(g, dy_n, relu_y, planes, bias);
      else pair_gradient_planes<1>(g, dy_n, relu_y, planes, bias);
      for (std::int64_t t = 0; t < taps; t += per_pass) {
        const std::int64_t count = std::min(per_pass, taps - t);
        float* at[4] = {};
        for (int v = 0; v < vectors; ++v) at[v] = acc[v] + t * g.lanes;
        accumulate_pair_taps_fn(vectors, count)(g, g.taps.data() + t, image, planes, at);
      }
      continue;
    }
    const bool bf16_gradient = g.bf16 && !j.pool;
    const std::size_t element = bf16_gradient ? sizeof(std::uint16_t) : sizeof(float);
    const void* dy_n[2] = {};
    const void* relu_y_n[2] = {};  // (j.relu_y: arranged as dy, in the same dtype)
    for (int v = 0; v < vectors; ++v) {
      if (j.pool) {  // (expand_pooled_gradient sums the bias's gradient)
        float* into = j.expanded + (worker * g.vectors + v) * g.dy.n;
        expand_pooled_fn(g, *j.pool)(g, *j.pool, n, (fc + v) * g.lanes, j.pooled_dy, j.ws, into,
                                     acc[v] + taps * g.lanes);
        dy_n[v] = into;
      } else {
        const auto at = static_cast<std::size_t>(n * g.dy.n + g.dy.channel((fc + v) * g.lanes)) * element;
        dy_n[v] = static_cast<const std::byte*>(j.dy) + at;
        if (j.relu_y) relu_y_n[v] = static_cast<const std::byte*>(j.relu_y) + at;
      }
    }
    const void* const* relu_y = j.relu_y ? relu_y_n : nullptr;
    for (std::int64_t t = 0; t < taps; t += per_pass) {
      const std::int64_t count = std::min(per_pass, taps - t);
      float* const at[2] = {acc[0] + t * g.lanes, acc[1] ? acc[1] + t * g.lanes : nullptr};
      accumulate_fn(g, bf16_gradient, relu_y != nullptr, vectors, count)(g, g.taps.data() + t, padded, dy_n, relu_y,
                                                                         at);
    }
    for (int v = 0; v < vectors && !j.pool && j.bias; ++v)
      accumulate_bias_of(g, dy_n[v], relu_y_n[v], acc[v] + taps * g.lanes);
  }
}

// The bfloat16 weights' gradients as matmuls (Conv2DKernel::plan_gemm_weights). On a 2-core Intel
// Xeon with AMX, oneDNN 2.6's bfloat16 backward-weights kernel (jit:avx512_core_amx_bf16) took
// 0.59 ms per lane of 32 samples on the seed CNN's second convolution (200 GFLOP/s), 3.5 times its
// forward. Its matmul (brg:avx512_core_amx_bf16) computes the same sums over an im2col copy of the
// input, a chunk of samples at a time so that the copy stays in the core's cache:
//   col (P, T)   P = a chunk's S * OH * OW positions, T = KH * KW * C taps:
//                col[(n, oh, ow)][(kh, kw, c)] = x[n][oh*sh + kh - pt][ow*sw + kw - pl][c], 0 in the padding
//   sums (F, T) += dy^T col   f32; dy (P, F) read transposed (the (T, F) product, with col read
//                             transposed instead, took 0.32 ms a lane against 0.26)
//   dW  (T, F) = sums^T       f32, Keras HWIO: the kernel's gradient
//   db  (F)    = sum over p of dy[p]
// x channels last (any sample, row and column strides, no padded channels); dy dense, both bf16.
struct Im2colGeometry {
  std::int64_t batch, h, w, c, oh, ow, kh, kw, sh, sw, pad_top, pad_left;
  Arrangement x;
  std::int64_t taps() const { return kh * kw * c; }
  std::int64_t plane() const { return oh * ow; }
};

// Samples [first, last) of x into col. The copies are vector moves of 32 bytes: GCC turns a plain
// copy loop into a call to memcpy, which cost more than the copy (a run is 192 bytes on the seed CNN).
DTRAIN_LANE_CLONES void im2col(const Im2colGeometry& g, const std::uint16_t* __restrict x, std::int64_t first,
                               std::int64_t last, std::uint16_t* __restrict col) {
  const std::int64_t taps = g.taps(), run = g.kw * g.c;
  // (The empty asm hides the index from GCC's loop-idiom pass, which made even the vector loop a
  // call to memmove; the last few values one at a time, without a loop, for the same reason.)
  const auto copy = [](const std::uint16_t* __restrict from, std::int64_t count, std::uint16_t* __restrict to) {
    std::int64_t i = 0;
    for (; i + 16 <= count; i += 16) {
      asm("" : "+r"(i));
      store(to + i, load<Vec<std::uint16_t, 16>>(from + i));
    }
    if (i + 8 <= count) store(to + i, load<Vec<std::uint16_t, 8>>(from + i)), i += 8;
    if (i + 4 <= count) store(to + i, load<Vec<std::uint16_t, 4>>(from + i)), i += 4;
    if (i < count) to[i] = from[i], ++i;
    if (i < count) to[i] = from[i], ++i;
    if (i < count) to[i] = from[i];
  };
  const auto zero = [](std::int64_t count, std::uint16_t* __restrict to) {
    std::int64_t i = 0;
    for (; i + 16 <= count; i += 16) {
      asm("" : "+r"(i));
      store(to + i, Vec<std::uint16_t, 16>{});
    }
    if (i + 8 <= count) store(to + i, Vec<std::uint16_t, 8>{}), i += 8;
    if (i + 4 <= count) store(to + i, Vec<std::uint16_t, 4>{}), i += 4;
    if (i < count) to[i] = 0, ++i;
    if (i < count) to[i] = 0, ++i;
    if (i < count) to[i] = 0;
  };
#pragma omp parallel for schedule(static)
  for (std::int64_t n = first; n < last; ++n)
    for (std::int64_t oh = 0; oh < g.oh; ++oh)
      for (std::int64_t ow = 0; ow < g.ow; ++ow) {
        std::uint16_t* row = col + (((n - first) * g.oh + oh) * g.ow + ow) * taps;
        const std::int64_t iw0 = ow * g.sw - g.pad_left;
        const bool columns_inside = iw0 >= 0 && iw0 + g.kw <= g.w;
        for (std::int64_t kh = 0; kh < g.kh; ++kh, row += run) {
          const std::int64_t ih = oh * g.sh + kh - g.pad_top;
          if (ih < 0 || ih >= g.h) {
            zero(run, row);
            continue;
          }
          const std::uint16_t* from = x + n * g.x.n + ih * g.x.row;
          if (columns_inside && g.x.col == g.c) {  // the window's row: kw positions of C channels in a row
            copy(from + iw0 * g.c, run, row);
            continue;
          }
          for (std::int64_t kw = 0; kw < g.kw; ++kw) {
            const std::int64_t iw = iw0 + kw;
            if (iw < 0 || iw >= g.w) zero(g.c, row + kw * g.c);
            else copy(from + iw * g.x.col, g.c, row + kw * g.c);
          }
        }
      }
}

// dw (T, F) = sums (F, T) transposed.
DTRAIN_LANE_CLONES void transpose_sums(const float* __restrict sums, std::int64_t filters, std::int64_t taps,
                                       float* __restrict dw) {
  for (std::int64_t t = 0; t < taps; ++t)
    for (std::int64_t f = 0; f < filters; ++f) dw[t * filters + f] = sums[f * taps + t];
}

class Conv2DKernel final : public WeightedOpKernel {
 public:
  Conv2DKernel(nn::Conv2D& layer, OnednnContext& ctx, DType compute)
      : WeightedOpKernel(ctx, compute, layer.options().activation), layer_(layer) {}

  // Where the primitives compute only the output rows and columns the layer above reads (plan's
  // crop), before the input's layout is known (which must also have its channels innermost): those
  // rows and columns, the input rows and columns they reach, and what is left of the padding after
  // them. Null where they compute every position.
  struct CropExtent {
    std::int64_t rows, columns, in_h, in_w, pad_after_h, pad_after_w;
  };
  std::optional<CropExtent> crop_extent() const {
    const auto& o = layer_.options();
    const Shape& in = layer_.input_shape();
    const std::int64_t oh = layer_.padding_h().out, ow = layer_.padding_w().out;
    const std::int64_t rows = std::min(oh, rows_read_), columns = std::min(ow, columns_read_);
    if (pool_ || in[2] <= kFewInputChannels || rows * columns * 10 > oh * ow * 9) return std::nullopt;
    const std::int64_t reach_h = (rows - 1) * o.strides[0] - layer_.padding_h().before + o.kernel_size[0];
    const std::int64_t reach_w = (columns - 1) * o.strides[1] - layer_.padding_w().before + o.kernel_size[1];
    const std::int64_t in_h = std::min(in[0], reach_h), in_w = std::min(in[1], reach_w);
    return CropExtent{rows, columns, in_h, in_w, reach_h - in_h, reach_w - in_w};
  }

  LayoutPtr plan(std::int64_t batch, const LayoutPtr& src_layout) override {
    const auto& o = layer_.options();
    const Shape& in = layer_.input_shape();
    const Shape out = layer_.output_shape().with_batch(batch);
    const memory::dims strides{o.strides[0], o.strides[1]};
    const memory::dims pad_before{layer_.padding_h().before, layer_.padding_w().before};
    const memory::dims whole_pad_after{layer_.padding_h().after, layer_.padding_w().after};
    const memory::desc whole_src = any_md(in.with_batch(batch), compute_), whole_dst = any_md(out, compute_);
    memory::dims pad_after = whole_pad_after;
    memory::desc src = whole_src, dst = whole_dst;
    auto weights = memory::desc({o.filters, in[2], o.kernel_size[0], o.kernel_size[1]}, to_dnnl(compute_),
                                memory::format_tag::any);
    auto bias = o.use_bias ? memory::desc({o.filters}, memory::data_type::f32, memory::format_tag::x) : memory::desc();
    const auto algo = dnnl::algorithm::convolution_direct;

    // Where the layer above reads fewer output rows or columns (output_read_within), the
    // primitives compute those alone (WeightedOpPlan::Crop): the output and its gradient are
    // those leading rows and columns only (the layer above, a pooling, reads the positions the
    // layout holds), the input and its gradient are copies of the leading rows and columns they
    // reach (oneDNN 2.6 takes no negative padding, and runs a sub-memory source on its reference
    // kernel): where a tenth of the positions or more are left out, on inputs of more than a few
    // channels (whose arithmetic pays for the copies) arranged with their channels innermost (the
    // copies' own loops). On the seed CNN's second convolution (one AVX2 thread, 32 samples) 10 x
    // 10 of 11 x 11 took 1.78 ms forward and 1.56 backward data against 2.10 and 2.16, its copies
    // 0.13 and 0.125 (as oneDNN reorders, measured apart). In bfloat16 on a 2-core Intel Xeon with
    // AMX, `dtrain bench`, 3 alternating pairs: its backward 0.66-0.68 ms a step against 0.71-0.76,
    // its forward 0.15-0.17 against 0.12-0.14 (AMX computes faster than the copies move). The
    // output's copies (into the whole output, the gradient back out of it) were 221k of the 361k
    // TSC cycles a lane's crop copies took a step (2-core Zen 5 EPYC, float32): handing the part
    // itself to the pooling made the step 3-4 % shorter (5 alternating pairs of `dtrain bench`).
    // The input may be that leading part already (input_read_within: the layer below computed
    // those rows and columns alone); then the primitives read it in place.
    std::optional<WeightedOpPlan::Crop> crop;
    const std::optional<CropExtent> extent = crop_extent();
    const memory::dims held = md_of(src_layout).dims();  // (N, C, H, W)
    const bool input_is_part = held[2] < in[0] || held[3] < in[1];
    if (extent && arrangement_of(md_of(src_layout))) {
      pad_after = {extent->pad_after_h, extent->pad_after_w};
      crop = WeightedOpPlan::Crop{{batch, in[2], extent->in_h, extent->in_w}, {batch, o.filters, extent->rows, extent->columns}};
      src = memory::desc(crop->src, to_dnnl(compute_), memory::format_tag::any);
      dst = memory::desc(crop->dst, to_dnnl(compute_), memory::format_tag::any);
    }
    DTRAIN_CHECK(!input_is_part || (crop && held[2] == extent->in_h && held[3] == extent->in_w),
                 fmt::format("layer '{}': its input holds {} x {} of {} x {} positions, not the leading part it reads",
                             layer_.name(), held[2], held[3], in[0], in[1]));

    // A first layer's own forward (plan_own_forward) writes its filters in blocks of 8, where
    // oneDNN's AVX-512 kernels pad them to 16. Where the weight loops then do not fit after all,
    // the primitives compute on that layout.
    const bool own_forward = own_forward_fits();
    if (own_forward)
      dst = memory::desc({batch, o.filters, out[1], out[2]}, to_dnnl(compute_), memory::format_tag::aBcd8b);

    auto forward_pd = [&] {
      return dnnl::convolution_forward::primitive_desc(
          dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training, algo, src, weights, bias, dst, strides,
                                          pad_before, pad_after),
          act_.post_op_attr(), ctx_.engine);
    };
    auto fwd_pd = forward_pd();
    if (pool_) return plan_pooled(batch, md_of(src_layout), fwd_pd.dst_desc());
    // The output's arrangement: the forward's dst (cropped: the leading part). Where oneDNN picked
    // a cropped dst the layer above could not read (channels not innermost), the whole planes.
    std::optional<Arrangement> dy = arrangement_of(fwd_pd.dst_desc());
    if (crop && !dy) {
      DTRAIN_CHECK(!input_is_part, fmt::format("layer '{}': oneDNN picked an output layout a cropped input cannot have",
                                               layer_.name()));
      crop.reset();
      src = whole_src;
      dst = whole_dst;
      pad_after = whole_pad_after;
      fwd_pd = forward_pd();
      dy = arrangement_of(fwd_pd.dst_desc());
    }
    auto bwd_data_pd = dnnl::convolution_backward_data::primitive_desc(
        dnnl::convolution_backward_data::desc(algo, src, weights, dst, strides, pad_before, pad_after), ctx_.engine,
        fwd_pd);
    auto bwd_weights_pd = dnnl::convolution_backward_weights::primitive_desc(
        dnnl::convolution_backward_weights::desc(algo, src, diff_weights_md(weights), bias, dst, strides, pad_before,
                                                 pad_after),
        ctx_.engine, fwd_pd);
    if (dy)
      if (WeightLoops* s = plan_weight_loops(batch, md_of(src_layout), *dy, false); s && own_forward) plan_own_forward(*s);
    return keep(batch, out, fwd_pd, bwd_data_pd, bwd_weights_pd, crop);
  }

  void without_input_gradient() override { input_gradient_ = false; }

  void output_read_within(std::int64_t rows, std::int64_t columns) override {
    rows_read_ = rows;
    columns_read_ = columns;
  }

  // Cropped (crop_extent), the primitives read the leading input rows and columns the output
  // positions read reach: the layer below may compute only those (Conv2DKernel::plan_pooled, or a
  // cropped convolution's output). The seed CNN's second convolution copied 12 x 12 of its 13 x 13
  // input for its forward, and its input gradient back into the whole, 140k of the 361k TSC cycles
  // its lane's copies took a step (2-core Zen 5 EPYC, float32).
  std::optional<nn::Layer::InputExtent> input_read_within() const override {
    const std::optional<CropExtent> e = crop_extent();
    const Shape& in = layer_.input_shape();
    if (!e || (e->in_h == in[0] && e->in_w == in[1])) return std::nullopt;
    return nn::Layer::InputExtent{e->in_h, e->in_w};
  }

  // The pooling's conditions (the loops at the top of this file) and the weight loops' (few input
  // channels, f32 or bf16, filter vectors of 8): known before any plan, so a taken pooling is always
  // computed here. In bfloat16 the loops compute what oneDNN's bfloat16 convolution would (x and
  // the kernel rounded, f32 sums, the output rounded) with f32 multiply-adds (or their pairs,
  // cpu_multiplies_bf16_pairs): on the seed CNN's
  // first convolution (one input channel, where AMX gains nothing) oneDNN's bfloat16 kernel and
  // the pooling apart took 0.99 ms a step, these loops 0.42 (2-core Intel Xeon with AMX).
  bool take_output_max_pooling(const nn::MaxPool2D& pool, bool input_gradient) override {
    const auto& o = layer_.options();
    const Shape& in = layer_.input_shape();
    const auto& window = pool.params().pool_size;
    const auto& strides = pool.strides();
    const std::int64_t taps = std::int64_t{o.kernel_size[0]} * o.kernel_size[1] * in[2];
    const bool activation = act_.kind() == config::Activation::relu || act_.kind() == config::Activation::linear;
    const bool dtype = compute_ == DType::f32 || compute_ == DType::bf16;
    const bool fits = !input_gradient && dtype && activation && o.filters % 8 == 0 &&
                      in[2] <= kFewInputChannels && taps <= kMaxTapsOfFewChannels &&
                      pool.params().padding == config::Padding::valid && strides[0] >= window[0] &&
                      strides[1] >= window[1] && window[0] * window[1] <= kNoWinner;  // positions 0..254
    if (fits) pool_ = &pool;
    return fits;
  }

  void bind(std::int64_t batch, const nn::LayerIO& io) override {
    if (pool_) {
      WeightLoops& s = *find_weight_loops(batch);
      s.src = ctx_.wrap(io.src);
      s.y = ctx_.wrap(io.dst);
      s.diff_y = ctx_.wrap(io.diff_dst);
      return;
    }
    const auto& o = layer_.options();
    auto vars = layer_.variables();
    bind_variables(batch, io,
                   hwio_md(o.kernel_size[0], o.kernel_size[1], static_cast<int>(layer_.input_shape()[2]), o.filters),
                   vars[nn::Conv2D::kKernel], o.use_bias ? &vars[nn::Conv2D::kBias] : nullptr);
    WeightLoops* s = find_weight_loops(batch);
    if (!s) return plan_gemm_weights(batch);
    s->src = ctx_.wrap(io.src);
    // Where nothing below wants the input's gradient (a first layer), the loops are the only reader
    // of the gradient before the relu: they apply its derivative as they read the gradient after
    // it, instead of the relu's backward writing the whole gradient once more. A first
    // convolution's output is the largest gradient of most models (the ones above it are pooled
    // or strided): on a 26 x 26 x 32 output, 64 samples a step, the relu's backward alone took
    // 0.39 ms, twice the loops' time (2-core AVX512-BF16 EPYC, Zen 4).
    const memory y = ctx_.wrap(io.dst);
    const bool applied = act_.kind() == config::Activation::relu && !activation_backward_elsewhere_ && !io.diff_src &&
                         y.get_desc() == ctx_.wrap(io.diff_dst).get_desc();
    s->relu_output = applied ? y : memory();
    if (!s->forward) return;
    // (The own forward skips the primitives' reorders, whose weights a data gradient would read.)
    DTRAIN_CHECK(!io.diff_src, fmt::format("layer '{}': its own forward planned without an input gradient, bound with one",
                                           layer_.name()));
    s->y = y;
    if (act_.kind() != config::Activation::relu && act_.is_eltwise()) s->activation = act_.in_place_forward(ctx_, y);
  }

  void forward(std::int64_t batch, const nn::StepContext& step) override {
    if (pool_) return pooled_forward(*find_weight_loops(batch));
    WeightLoops* s = find_weight_loops(batch);
    if (s && s->forward) return own_forward(*s);
    WeightedOpKernel::forward(batch, step);
  }

  void backward(std::int64_t batch, const nn::StepContext& step) override {
    if (!pool_) return WeightedOpKernel::backward(batch, step);
    // No input gradient (take_output_max_pooling): what the bench times is the weights'.
    if (step.backward_marks) step.backward_marks->input_done();
    weight_gradients(batch, memory(), step);
  }

 protected:
  bool own_weight_gradients(std::int64_t batch) const override {
    return find_weight_loops(batch) != nullptr || find_in(gemm_weights_, batch) != nullptr;
  }
  bool weight_gradients_apply_activation_derivative(std::int64_t batch) const override {
    const WeightLoops* s = find_weight_loops(batch);
    return s && s->relu_output;
  }

  void weight_gradients(std::int64_t batch, const memory& pre_grad, const nn::StepContext& step) override {
    if (GemmWeights* m = find_in(gemm_weights_, batch)) return gemm_weight_gradients(*m);
    WeightLoops* s = find_weight_loops(batch);
    const WeightLoopsGeometry& g = s->geometry;
    const std::int64_t taps = static_cast<std::int64_t>(g.taps.size());
    const std::int64_t per_item = (taps + 1) * g.lanes;  // taps, then the bias
    const std::int64_t sample_chunks = (g.batch + kSamplesPerChunk - 1) / kSamplesPerChunk;
    WeightJob& j = s->job;
    j.g = &g;
    j.x = s->src.get_data_handle();
    if (s->pool) {
      j.pool = &*s->pool;
      j.pooled_dy = s->diff_y.get_data_handle();
      j.ws = s->workspace.data();
    } else {
      j.dy = pre_grad.get_data_handle();
      j.relu_y = s->relu_output ? s->relu_output.get_data_handle() : nullptr;
    }
    j.bias = layer_.options().use_bias;
    j.groups = (g.filter_chunks + g.vectors - 1) / g.vectors;
    j.padded_size = g.padded_h * g.padded_w * g.c;
    j.slot_size = j.padded_size * (g.pairs && !g.x_codes ? 2 : 1);
    j.cached = std::clamp<std::int64_t>(kPaddedCacheBytes / (j.slot_size * 4), 1, kSamplesPerChunk);
    // Scratch for every thread that may run an item: this lane's OpenMP team, or every lane. Sized
    // by the first backward of the plan (most plans are evaluation's); grows, zeroed (the padding
    // stays zero), only if the workers grew since.
    const int workers = std::max(std::max(1, omp_get_max_threads()), step.shared_work ? step.shared_work->size() : 1);
    const auto slots = static_cast<std::size_t>(workers * j.cached);
    if (s->padded.size() < slots * static_cast<std::size_t>(j.slot_size)) {
      s->padded.resize(slots * static_cast<std::size_t>(j.slot_size), 0.0f);
      s->holds.resize(slots);
    }
    std::fill(s->holds.begin(), s->holds.end(), -1);
    if (s->pool && routes_pooled_gradient(g)) {
      j.strip_size = s->pool->ow * g.vectors * 2 * g.lanes;
      s->strips.resize(static_cast<std::size_t>(workers * j.strip_size));
      j.strips = s->strips.data();
    } else if (s->pool) {
      s->expanded.resize(static_cast<std::size_t>(workers * g.vectors * g.dy.n));
      j.expanded = s->expanded.data();
    } else if (g.pairs) {
      j.plane_size = g.oh * ((g.ow + 1) / 2) * g.lanes;
      s->expanded.resize(static_cast<std::size_t>(workers * g.vectors * j.plane_size));
      j.pair_planes = s->expanded.data();
    }
    j.padded = s->padded.data();
    j.holds = s->holds.data();
    s->partial.assign(s->partial_size, 0.0f);
    j.partial = s->partial.data();
    const std::int64_t items = sample_chunks * j.groups;
    if (step.shared_work) {
      step.shared_work->run(step.lane, items, &j, &run_weight_item);
    } else {
      // Consecutive items (a chunk's filter groups) on one thread reuse its padded samples.
      for_each_item(items, [&](std::int64_t item) { run_weight_item(&j, item, omp_get_thread_num()); });
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
        add_chunk_sums(s->partial.data() + fc * per_item + t * g.lanes, sample_chunks, g.filter_chunks * per_item, lanes,
                       into);
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
    // Not pooled, without an input gradient: the relu's output, whose derivative the loops apply
    // (bind); empty where they do not.
    memory relu_output;
    // Fused with a max pooling (pool_): its geometry, the pooled output and its gradient, the
    // workspace, the kernel and bias padded to the arrangement's channels, each forward thread's
    // padded sample (zero padding) and convolution sums, and the backward workers' strips or
    // expanded planes (WeightJob). Not fused, in pairs, `expanded` holds the workers' pair planes.
    std::optional<PoolingGeometry> pool;
    memory y, diff_y;
    std::vector<std::uint8_t> workspace;
    std::vector<float> kernel, bias, forward_padded, forward_sums, strips, expanded;
    bool codes = false;  // the bfloat16 forward pools on the activations' codes (plan_codes)
    // Where the codes' sums take the taps in pairs (geometry.pairs): the pairs, their weights
    // (TapPairs, pair_weights), and each forward thread's pair images, after its padded sample.
    std::optional<TapPairs> tap_pairs;
    std::vector<float> kernel_pairs;
    // Not pooled, the forward too where plan_own_forward takes it: its geometry (the whole output;
    // the weight loops' sums stop at what the layer above reads), and a sigmoid or tanh applied
    // after it in place (relu is applied as the outputs are stored). The kernel and bias padded,
    // the padded samples and the sums are the pooled forward's.
    std::optional<WeightLoopsGeometry> forward;
    BoundPrimitive activation;
  };

  // Whether this batch's weight gradients are this file's loops: f32, x and the output gradient
  // (arranged as `dy`) with their channels innermost, and a sample's planes small enough to stay
  // in the caches. `fused`: for a pooled output, whose conditions take_output_max_pooling checked.
  WeightLoops* plan_weight_loops(std::int64_t batch, const memory::desc& src_md, const Arrangement& dy, bool fused) {
    const auto& o = layer_.options();
    const Shape& in = layer_.input_shape();
    if (compute_ != DType::f32 && compute_ != DType::bf16) return nullptr;
    const std::optional<Arrangement> x = arrangement_of(src_md);
    if (!x) return nullptr;
    // Vectors of 16 where the loops run on AVX-512 (the context's loop_isa: a test may pick a
    // narrower level); 8 (two 128-bit halves below AVX2) elsewhere, and for 8 filters or fewer
    // (read from the first half of oneDNN's blocks of 16): a multiply-add of 8 lanes is half of
    // 16's work on the same cores, and 6 of 8 lanes are useful where 6 of 16 were. LeNet's first
    // convolution (6 filters, 5 x 5, one channel, 28 x 28 'same'): its weights' gradients 0.19-0.23
    // ms a step against 0.38-0.41 with 16 lanes (2-core AVX512-BF16 EPYC, Zen 4).
    const bool wide = dy.lanes % 16 == 0 && ctx_.loop_isa() == LoopIsa::x86_64_v4 && (fused || o.filters > 8);
    const int lanes = wide ? 16 : dy.lanes % 8 == 0 ? 8 : 0;
    if (lanes == 0) return nullptr;
    // The input's rows and columns as its layout holds them: all, or the leading part a crop reads
    // (input_read_within), which the padding after the input does not reach.
    const memory::dims held = src_md.dims();  // (N, C, H, W)
    const bool whole_h = held[2] == in[0], whole_w = held[3] == in[1];
    const std::int64_t padded_h = held[2] + layer_.padding_h().before + (whole_h ? layer_.padding_h().after : 0);
    const std::int64_t padded_w = held[3] + layer_.padding_w().before + (whole_w ? layer_.padding_w().after : 0);
    const std::int64_t out_plane = layer_.padding_h().out * layer_.padding_w().out;
    const std::int64_t taps = std::int64_t{o.kernel_size[0]} * o.kernel_size[1] * in[2];
    const std::int64_t filter_chunks = (o.filters + lanes - 1) / lanes;
    // Two vectors a pass where one pass would not hold every tap (each output gradient vector is
    // read half as often); fused with a pooling, two always (each input value feeds twice the
    // multiply-adds: on the seed CNN's first convolution, 9 taps, the backward took 0.14-0.16 ms
    // against 0.17-0.18 with one, float32 on a 2-core Intel Xeon with AMX; with 8 lanes, passes of
    // 6 and 3 taps read 13 values a position for 18 multiply-adds where one vector read 20: 0.356-0.436
    // ms against 0.397-0.475, 6 alternating pairs on a 2-core AVX2 AMD EPYC, a noisy hour). Not
    // fused, in pairs (accumulate_pair_taps, the registers' 24 sums), up to four: a pass then reads 10
    // values (4 gradient words, 6 of x) for 24 VDPBF16PS where two vectors read 14 (the seed CNN's
    // second convolution's passes, alone on one core of the Zen 5 EPYC: 0.363 TSC cycles an
    // instruction against 0.383-0.400), and an item makes each sample's pair image once for all
    // its filters.
    static const bool multiplies_pairs = cpu_multiplies_bf16_pairs();
    const bool pairs = !fused && compute_ == DType::bf16 && lanes == 16 && multiplies_pairs;
    const int vectors = pairs ? static_cast<int>(std::min<std::int64_t>(filter_chunks, 4))
                        : filter_chunks < 2 ? 1
                        : fused       ? 2
                                      : (taps > accumulators(lanes) ? 2 : 1);
    const std::int64_t sample_chunks = (batch + kSamplesPerChunk - 1) / kSamplesPerChunk;
    const std::int64_t partial = sample_chunks * filter_chunks * (taps + 1) * lanes;
    // A few input channels always (oneDNN's kernel computes 8 times the work there, whatever the
    // size); more where a sample's planes stay in the caches.
    const bool few_channels = in[2] <= kFewInputChannels && taps <= kMaxTapsOfFewChannels;
    const bool in_cache = padded_h * padded_w * in[2] * 4 <= kMaxPaddedSampleBytes &&
                          out_plane * vectors * lanes * 4 <= kMaxGradientPlaneBytes;
    if (!fused && (!(few_channels || in_cache) || partial > kMaxPartialFloats)) return nullptr;
    // In bfloat16, a first layer on few channels (its input the model's, f32, rounded as it is
    // padded; the output gradient read in bfloat16): oneDNN 2.6's bfloat16 kernel took 0.55 ms a
    // step for the bn_dropout experiment's first convolution's weights (AMX, one input channel),
    // these loops 0.2 (a 2-core Intel Xeon with AMX). Wider layers keep the AMX matmuls; where the
    // CPU multiplies bfloat16 pairs without AMX (cpu_multiplies_bf16_pairs) they take these loops
    // too, x read as bfloat16 codes, two positions an instruction on AVX-512 (accumulate_pair_taps).
    const bool x_codes = src_md.data_type() == memory::data_type::bf16;
    const bool first_layer_f32 = few_channels && src_md.data_type() == memory::data_type::f32;
    if (compute_ == DType::bf16 && !fused && !first_layer_f32 && !(multiplies_pairs && x_codes)) return nullptr;
    WeightLoops& s = weight_loops_.emplace_back();
    s.batch = batch;
    WeightLoopsGeometry& g = s.geometry;
    g.batch = batch;
    g.c = in[2];
    g.h = held[2];
    g.w = held[3];
    // A fused plan's sums are over the whole output: its pooling is the layer above.
    g.oh = fused ? layer_.padding_h().out : std::min(layer_.padding_h().out, rows_read_);
    g.ow = fused ? layer_.padding_w().out : std::min(layer_.padding_w().out, columns_read_);
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
    g.dy = dy;
    g.lanes = lanes;
    g.filter_chunks = filter_chunks;
    g.vectors = vectors;
    g.bf16 = compute_ == DType::bf16;
    g.x_codes = x_codes;
    g.pairs = pairs;  // (fused, plan_codes decides)
    for (std::int64_t i = 0; i < g.kh; ++i)
      for (std::int64_t j = 0; j < g.kw; ++j)
        for (std::int64_t c = 0; c < g.c; ++c) g.taps.push_back((i * g.padded_w + j) * g.c + c);
    s.partial_size = static_cast<std::size_t>(partial);  // allocated by the first backward: most plans are evaluation's
    return &s;
  }

  // bfloat16 weights' gradients as matmuls over im2col copies of the input (Im2colGeometry).
  struct GemmWeights {
    std::int64_t batch = 0;
    Im2colGeometry geometry;
    std::int64_t chunk = 0;          // samples per im2col copy
    std::vector<std::uint16_t> col;  // (chunk * OH * OW, T)
    std::vector<float> sums;         // (F, T)
    memory src, dy;                  // the forward's input and the gradient before the activation
    std::vector<BoundPrimitive> products;  // per chunk: sums (+)= dy^T col
    std::vector<std::byte> scratchpad;     // the matmuls'
    float* dw = nullptr;             // the kernel's gradient (T, F)
    float* db = nullptr;             // the bias's gradient, or null
  };

  // Where the layer computes in bfloat16 on oneDNN's primitives, its input and its output's
  // gradient, as the primitives read them (cropped or not), are channels last with no padded
  // channels, and oneDNN runs the matmuls on AMX. (Playing AVX512-BF16 alone on the AMX Xeon,
  // ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16, the matmuls and the primitive took the same time; the
  // EPYC that has no AMX keeps the primitive until measured there.)
  void plan_gemm_weights(std::int64_t batch) {
    if (compute_ != DType::bf16) return;
    WeightedOpPlan& p = plan_of(batch);
    const memory src = p.fwd.args.at(DNNL_ARG_SRC);
    const memory dy = p.act.pre_grad;
    const memory::desc src_md = src.get_desc(), dy_md = dy.get_desc();
    const std::optional<Arrangement> x = arrangement_of(src_md), d = arrangement_of(dy_md);
    if (!x || !d || src_md.data_type() != memory::data_type::bf16 || dy_md.data_type() != memory::data_type::bf16)
      return;
    const auto& o = layer_.options();
    const memory::dims in = src_md.dims(), out = dy_md.dims();  // (N, C, H, W), (N, F, OH, OW)
    const std::int64_t filters = out[1];
    const bool dense_dy = d->groups == 1 && d->lanes == filters && d->col == filters &&
                          d->row == out[3] * filters && d->n == out[2] * out[3] * filters;
    if (x->groups != 1 || x->lanes != in[1] || !dense_dy) return;
    const Im2colGeometry g{.batch = batch, .h = in[2], .w = in[3], .c = in[1], .oh = out[2], .ow = out[3],
                           .kh = o.kernel_size[0], .kw = o.kernel_size[1], .sh = o.strides[0], .sw = o.strides[1],
                           .pad_top = layer_.padding_h().before, .pad_left = layer_.padding_w().before, .x = *x};
    const std::int64_t sample_bytes = g.plane() * g.taps() * 2;
    // Where it can, a chunk's positions are a multiple of AMX's bf16 row of 32 (a shorter last
    // block of the sum's dimension cost a fifth more).
    std::int64_t chunk = std::clamp<std::int64_t>(kIm2colChunkBytes / sample_bytes, 1, batch);
    for (std::int64_t s = chunk; s > chunk / 2; --s)
      if (s * g.plane() % 32 == 0) {
        chunk = s;
        break;
      }
    // The matmuls of a whole chunk (the first one writes, the others add) and of a shorter last one.
    const auto product = [&](std::int64_t samples, bool add) {
      const std::int64_t positions = samples * g.plane();
      return amx_matmul(ctx_, memory::desc({filters, positions}, memory::data_type::bf16, memory::dims{1, filters}),
                        memory::desc({positions, g.taps()}, memory::data_type::bf16, memory::dims{g.taps(), 1}),
                        memory::desc({filters, g.taps()}, memory::data_type::f32, memory::dims{g.taps(), 1}), add);
    };
    const std::int64_t chunks = (batch + chunk - 1) / chunk, last = batch - (chunks - 1) * chunk;
    std::optional<dnnl::matmul::primitive_desc> first_pd = product(chunk, false), next_pd, last_pd;
    if (chunks > 1) next_pd = product(chunk, true);
    if (last != chunk) last_pd = product(last, chunks > 1);
    if (!first_pd || (chunks > 1 && !next_pd) || (last != chunk && !last_pd)) return;
    GemmWeights& m = gemm_weights_.emplace_back();
    m.batch = batch;
    m.geometry = g;
    m.chunk = chunk;
    m.col.assign(static_cast<std::size_t>(chunk * g.plane() * g.taps()), 0);
    m.sums.assign(static_cast<std::size_t>(filters * g.taps()), 0.0f);
    m.src = src;
    m.dy = dy;
    std::size_t scratch = 0;
    for (const auto* pd : {&first_pd, &next_pd, &last_pd})
      if (*pd) scratch = std::max(scratch, (*pd)->scratchpad_desc().get_size());
    void* scratchpad = aligned_scratchpad(m.scratchpad, scratch);
    auto* dy_data = static_cast<std::uint16_t*>(dy.get_data_handle());
    for (std::int64_t k = 0; k < chunks; ++k) {
      const auto& pd = k + 1 == chunks && last_pd ? *last_pd : k == 0 ? *first_pd : *next_pd;
      const auto desc = [&pd](int arg) { return pd.query_md(dnnl::query::exec_arg_md, arg); };
      m.products.push_back({dnnl::matmul(pd),
                            {{DNNL_ARG_SRC, ctx_.wrap(desc(DNNL_ARG_SRC), dy_data + k * chunk * g.plane() * filters)},
                             {DNNL_ARG_WEIGHTS, ctx_.wrap(desc(DNNL_ARG_WEIGHTS), m.col.data())},
                             {DNNL_ARG_DST, ctx_.wrap(desc(DNNL_ARG_DST), m.sums.data())},
                             {DNNL_ARG_SCRATCHPAD, ctx_.wrap(pd.scratchpad_desc(), scratchpad)}}});
    }
    auto vars = layer_.variables();
    m.dw = vars[nn::Conv2D::kKernel].grad.address<float>();
    m.db = o.use_bias ? vars[nn::Conv2D::kBias].grad.address<float>() : nullptr;
  }

  void gemm_weight_gradients(GemmWeights& m) {
    const Im2colGeometry& g = m.geometry;
    const auto* x = static_cast<const std::uint16_t*>(m.src.get_data_handle());
    for (std::size_t k = 0; k < m.products.size(); ++k) {
      const std::int64_t first = static_cast<std::int64_t>(k) * m.chunk;
      im2col(g, x, first, std::min(g.batch, first + m.chunk), m.col.data());
      m.products[k].run(ctx_);
    }
    const std::int64_t filters = layer_.options().filters;
    transpose_sums(m.sums.data(), filters, g.taps(), m.dw);
    if (m.db) bf16_column_sums(static_cast<const std::uint16_t*>(m.dy.get_data_handle()), g.batch * g.plane(), filters, m.db);
  }

  // The pooled output's layout, in the compute dtype: in f32 the arrangement oneDNN picked for the
  // convolution's output; in bf16 the one its convolution picks for an input of the pooled shape
  // (a layer above that reads it: oneDNN's bf16 kernels on AMX read channels last, where it gives
  // a one-channel convolution's output in blocks of 16, and reordering the seed CNN's pooled
  // output took 0.07 ms a step each way); or nhwc. The input is the model's (no layer below wants
  // a gradient): f32.
  LayoutPtr plan_pooled(std::int64_t batch, const memory::desc& src_md, const memory::desc& dst_md) {
    DTRAIN_CHECK(src_md.data_type() == memory::data_type::f32,
                 fmt::format("layer '{}': a pooling computed with the convolution wants a float32 input",
                             layer_.name()));
    const Shape out = pool_->output_shape().with_batch(batch);
    // The pooled rows and columns the layer above reads (output_read_within), alone: the pooled
    // output's layout holds those, and its gradient is +0 at the others (the sums skip their terms).
    const memory::dims dims{batch, out[3], std::min(out[1], rows_read_), std::min(out[2], columns_read_)};
    const memory::data_type dt = to_dnnl(compute_);
    const std::optional<Arrangement> chosen =
        arrangement_of(compute_ == DType::bf16 ? convolution_source(dims, dt) : dst_md);
    const memory::desc y_md = chosen && chosen->lanes % 8 == 0
                                  ? arranged_like(*chosen, dims, dt)
                                  : memory::desc(dims, dt, memory::format_tag::nhwc);
    const Arrangement y = *arrangement_of(y_md);
    WeightLoops* s = plan_weight_loops(batch, src_md, y, true);
    DTRAIN_CHECK(s != nullptr,
                 fmt::format("layer '{}': the pooling it took cannot be computed with it", layer_.name()));
    WeightLoopsGeometry& g = s->geometry;
    // Where the pooled gradient is expanded (routes_pooled_gradient), the plane of one sample and
    // filter vector: (OH, OW, L).
    if (!routes_pooled_gradient(g))
      g.dy = Arrangement{.lanes = g.lanes, .groups = 1, .n = g.oh * g.ow * g.lanes, .group = 0,
                         .row = g.ow * g.lanes, .col = g.lanes};
    PoolingGeometry& p = s->pool.emplace();
    p.kh = pool_->params().pool_size[0];
    p.kw = pool_->params().pool_size[1];
    p.sh = pool_->strides()[0];
    p.sw = pool_->strides()[1];
    p.oh = dims[2];
    p.ow = dims[3];
    p.y = y;
    p.relu = act_.kind() == config::Activation::relu;
    s->workspace.assign(y_md.get_size() / memory::data_type_size(dt), 0);  // a byte per output element
    const std::int64_t channels = y.lanes * y.groups;  // the filters, padded to the arrangement
    s->kernel.assign(static_cast<std::size_t>(static_cast<std::int64_t>(g.taps.size()) * channels), 0.0f);
    s->bias.assign(static_cast<std::size_t>(channels), 0.0f);
    plan_codes(*s);
    return make_layout(out, compute_, y_md);
  }

  // The source arrangement oneDNN picks for a 3 x 3 convolution of `dims` that keeps its channels.
  memory::desc convolution_source(const memory::dims& dims, memory::data_type dt) const {
    const memory::dim channels = dims[1];
    const auto any = [dt](const memory::dims& d) { return memory::desc(d, dt, memory::format_tag::any); };
    const dnnl::convolution_forward::primitive_desc pd(
        dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct,
                                        any(dims), any({channels, channels, 3, 3}), any(dims), {1, 1}, {1, 1},
                                        {1, 1}),
        ctx_.engine);
    return pd.src_desc();
  }

  // The pooling on bfloat16 codes where it computes what take_position does (convolve_pool_codes):
  // bfloat16, relu, 2 x 2 windows, vectors of 16 filters, and a CPU with AVX512-BF16. And the
  // products in pairs where the CPU computes them faster (cpu_multiplies_bf16_pairs): the
  // forward's where it pools on codes, the backward's where windows are 2 wide and routed.
  void plan_codes(WeightLoops& s) const {
    WeightLoopsGeometry& g = s.geometry;
    const PoolingGeometry& p = *s.pool;
    static const bool converts = cpu_converts_bf16_pairs(), multiplies = cpu_multiplies_bf16_pairs();
    s.codes = converts && g.bf16 && p.relu && p.kh == 2 && p.kw == 2 && g.lanes == 16 && s.bias.size() % 16 == 0;
    g.pairs = multiplies && g.bf16 && p.kw == 2 && routes_pooled_gradient(g);
    if (s.codes && g.pairs) {
      s.tap_pairs.emplace(g.taps);
      s.kernel_pairs.assign(static_cast<std::size_t>(s.tap_pairs->count()) * s.bias.size(), 0.0f);
    }
  }

  void pooled_forward(WeightLoops& s) {
    if (s.geometry.bf16) pooled_forward_as<std::uint16_t>(s);
    else pooled_forward_as<float>(s);
  }

  // The samples are independent; the replica's OpenMP team shares them. T: the pooled output's
  // element, float or std::uint16_t (bfloat16: the input and the kernel rounded to bfloat16, the
  // sums in f32, as oneDNN's bfloat16 convolution computes).
  template <class T>
  void pooled_forward_as(WeightLoops& s) {
    const WeightLoopsGeometry& g = s.geometry;
    const PoolingGeometry& p = *s.pool;
    const std::int64_t taps = static_cast<std::int64_t>(g.taps.size());
    const std::int64_t channels = static_cast<std::int64_t>(s.bias.size());
    gather_kernel(s);
    const TapPairs* pairs = s.codes && g.pairs ? &*s.tap_pairs : nullptr;
    if (pairs) pair_weights(s.kernel.data(), taps, channels, s.kernel_pairs.data());
    const std::int64_t padded_size = g.padded_h * g.padded_w * g.c;
    const std::int64_t plane = g.oh * g.ow * g.lanes;  // one filter vector's sums, where they are stored
    const bool in_registers = p.kh == 2 && p.kw == 2;  // convolve_pool_2x2
    const auto threads = static_cast<std::size_t>(std::max(1, omp_get_max_threads()));
    // A thread's padded sample, then its pair images.
    const std::int64_t scratch_size =
        padded_size * (1 + (pairs ? static_cast<std::int64_t>(pairs->distances.size()) : 0));
    if (s.forward_padded.size() < threads * static_cast<std::size_t>(scratch_size)) {
      s.forward_padded.resize(threads * static_cast<std::size_t>(scratch_size), 0.0f);  // zero: the padding
      if (!in_registers) s.forward_sums.resize(threads * static_cast<std::size_t>(kForwardVectors * plane));
    }
    const float* x = static_cast<const float*>(s.src.get_data_handle());
    T* y = static_cast<T*>(s.y.get_data_handle());
    std::uint8_t* ws = s.workspace.data();
    const float* w = s.kernel.data();
    const float* b = s.bias.data();
    float* scratch = s.forward_padded.data();
    float* sums = s.forward_sums.data();
    const PoolSumsFn<T> pool = pool_sums_fn<T>(g.lanes);
    const int most = in_registers ? window_vectors(g.lanes) : kForwardVectors;
    for_each_item(g.batch, [&](std::int64_t n) {
      const int thread = omp_get_thread_num();
      float* scratch_n = scratch + thread * scratch_size;
      const float* padded = padded_sample(g, x, n, scratch_n);
      // The codes' terms: the taps, or their pairs read from the pair images.
      const float* source[kMaxTapsOfFewChannels];
      std::int64_t terms = taps;
      if (pairs) {
        float* images = scratch_n + padded_size;  // (bfloat16: padded is scratch_n)
        for (std::size_t i = 0; i < pairs->distances.size(); ++i)
          pair_image(padded, padded_size, pairs->distances[i], images + static_cast<std::int64_t>(i) * padded_size);
        terms = pairs->count();
        for (std::int64_t k = 0; k < terms; ++k) {
          const int image = pairs->image[static_cast<std::size_t>(k)];
          source[k] = (image < 0 ? padded : images + image * padded_size) + pairs->first[static_cast<std::size_t>(k)];
        }
      } else if (s.codes) {
        for (std::int64_t t = 0; t < taps; ++t) source[t] = padded + g.taps[static_cast<std::size_t>(t)];
      }
      for (std::int64_t first_lane = 0; first_lane < channels;) {
        const std::int64_t left = (channels - first_lane) / g.lanes;
        const int vectors = left >= most ? most : left >= 2 ? 2 : 1;
        if constexpr (std::is_same_v<T, std::uint16_t>)
          if (s.codes) {
            convolve_pool_codes_fn(vectors, pairs != nullptr)(g, p, source, terms, pairs ? s.kernel_pairs.data() : w,
                                                              channels, b, first_lane, y + n * p.y.n, ws + n * p.y.n);
            first_lane += vectors * g.lanes;
            continue;
          }
        if (in_registers) {
          convolve_pool_fn<T>(g.lanes, vectors)(g, p, padded, w, channels, b, first_lane, y + n * p.y.n,
                                                ws + n * p.y.n);
        } else {
          float* z = sums + thread * kForwardVectors * plane;
          convolve_sample_fn(g.lanes, vectors)(g, padded, w + first_lane, channels, z);
          for (int v = 0; v < vectors; ++v) {
            const std::int64_t lane = first_lane + v * g.lanes;
            const std::int64_t out = n * p.y.n + p.y.channel(lane);
            pool(g, p, z + v * plane, b + lane, y + out, ws + out);
          }
        }
        first_lane += vectors * g.lanes;
      }
    });
  }

  // The kernel (taps, filters: HWIO) into s.kernel (taps, channels) and the bias into s.bias
  // (channels; a float32 bias, as the primitive's), their channels past the filters zeros; the
  // kernel rounded to bfloat16 where the loops compute in it.
  void gather_kernel(WeightLoops& s) const {
    const WeightLoopsGeometry& g = s.geometry;
    const std::int64_t taps = static_cast<std::int64_t>(g.taps.size());
    const std::int64_t channels = static_cast<std::int64_t>(s.bias.size());
    auto vars = layer_.variables();
    const float* kernel = vars[nn::Conv2D::kKernel].value.address<float>();
    for (std::int64_t t = 0; t < taps; ++t)
      std::copy_n(kernel + t * g.filters, g.filters, s.kernel.begin() + t * channels);
    if (g.bf16) round_to_bf16(s.kernel.data(), static_cast<std::int64_t>(s.kernel.size()));
    if (layer_.options().use_bias) std::copy_n(vars[nn::Conv2D::kBias].value.address<float>(), g.filters, s.bias.begin());
  }

  // The forward of a float32 first layer of 8 filters or fewer on a few input channels, with its
  // weight loops planned (not cropped: every output is computed), as the pooled forward computes
  // its sums (convolve_sample: the bits of oneDNN's direct convolution), with a linear, relu,
  // sigmoid or tanh activation. Why: its output in blocks of 8 channels, not the 16 oneDNN's
  // AVX-512 kernels pad it to (and on that layout oneDNN 2.6 runs its AVX2 kernel, 2x slower):
  // half the bytes of the output, its activation and its gradient. LeNet's first convolution (6
  // filters on 28 x 28, 'same', tanh) and its average pooling, 2-core AMD EPYC (Zen 5), 3
  // alternating pairs: forward 0.178-0.180 ms a step against 0.186-0.196, backward 0.177-0.179
  // against 0.205-0.232 (the tanh's backward 0.040 against 0.073-0.079), the pooling 0.015-0.019
  // each way against 0.023-0.030. Wider layers gained nothing (a VGG stem's 32 filters: 0.220-0.240
  // against 0.226-0.235 forward): they keep the primitive. Only where oneDNN runs its AVX-512
  // kernels: its AVX2 direct convolution (jit:avx2, which writes blocks of 8 itself) sums a few-channel
  // layer's taps in another order (2 channels, or 5 x 5 'same': 147-195 of a training step's values
  // took other bits than the primitive's; 2-core Zen 3 EPYC), and the model's values would then
  // depend on whether it computes its input's gradient.
  bool own_forward_fits() const {
    const auto kind = act_.kind();
    const Shape& in = layer_.input_shape();
    const auto& o = layer_.options();
    return widest_loop_isa() == LoopIsa::x86_64_v4 && !pool_ && !input_gradient_ && compute_ == DType::f32 &&
           o.filters <= 8 && in[2] <= kFewInputChannels &&
           std::int64_t{o.kernel_size[0]} * o.kernel_size[1] * in[2] <= kMaxTapsOfFewChannels &&
           (kind == config::Activation::linear || act_.is_eltwise());
  }
  void plan_own_forward(WeightLoops& s) {
    const WeightLoopsGeometry& g = s.geometry;
    WeightLoopsGeometry& f = s.forward.emplace(g);
    f.oh = layer_.padding_h().out;
    f.ow = layer_.padding_w().out;
    const std::int64_t channels = g.filter_chunks * g.lanes;
    s.kernel.assign(static_cast<std::size_t>(static_cast<std::int64_t>(g.taps.size()) * channels), 0.0f);
    s.bias.assign(static_cast<std::size_t>(channels), 0.0f);
  }

  // The samples are independent; the replica's OpenMP team shares them.
  void own_forward(WeightLoops& s) {
    const WeightLoopsGeometry& g = *s.forward;
    gather_kernel(s);
    const std::int64_t channels = static_cast<std::int64_t>(s.bias.size());
    const std::int64_t padded_size = g.padded_h * g.padded_w * g.c;
    const std::int64_t plane = g.oh * g.ow * g.lanes;
    const auto threads = static_cast<std::size_t>(std::max(1, omp_get_max_threads()));
    if (s.forward_padded.size() < threads * static_cast<std::size_t>(padded_size)) {
      s.forward_padded.resize(threads * static_cast<std::size_t>(padded_size), 0.0f);  // zero: the padding
      s.forward_sums.resize(threads * static_cast<std::size_t>(kForwardVectors * plane));
    }
    const float* x = static_cast<const float*>(s.src.get_data_handle());
    float* y = static_cast<float*>(s.y.get_data_handle());
    const bool relu = act_.kind() == config::Activation::relu;
    const StoreSampleFn store = store_sample_fn(g.lanes);
    for_each_item(g.batch, [&](std::int64_t n) {
      const int thread = omp_get_thread_num();
      float* z = s.forward_sums.data() + thread * kForwardVectors * plane;
      const float* padded = padded_sample(g, x, n, s.forward_padded.data() + thread * padded_size);
      for (std::int64_t first_lane = 0; first_lane < channels;) {
        const std::int64_t left = (channels - first_lane) / g.lanes;
        const int vectors = left >= kForwardVectors ? kForwardVectors : left >= 2 ? 2 : 1;
        convolve_sample_fn(g.lanes, vectors)(g, padded, s.kernel.data() + first_lane, channels, z);
        store(g, g.dy, z, vectors, s.bias.data() + first_lane, first_lane, relu, y + n * g.dy.n);
        first_lane += vectors * g.lanes;
      }
    });
    if (s.activation.prim) s.activation.run(ctx_);
  }

  template <class Loops>
  static auto find_in(Loops& loops, std::int64_t batch) -> decltype(loops.data()) {
    for (auto& s : loops)
      if (s.batch == batch) return &s;
    return nullptr;
  }
  WeightLoops* find_weight_loops(std::int64_t batch) { return find_in(weight_loops_, batch); }
  const WeightLoops* find_weight_loops(std::int64_t batch) const { return find_in(weight_loops_, batch); }

  nn::Conv2D& layer_;
  std::vector<WeightLoops> weight_loops_;  // per planned batch size that uses the loops above
  std::vector<GemmWeights> gemm_weights_;  // per planned batch size whose weights' gradients are a matmul
  const nn::MaxPool2D* pool_ = nullptr;    // the max pooling this layer computes (take_output_max_pooling)
  bool input_gradient_ = true;             // whether a layer below or the caller wants x's gradient
  // The output rows and columns the layer above reads (output_read_within): the weight loops sum
  // over no others, and the primitives may run cropped to them (plan). A 2 x 2 pooling over the
  // seed CNN's 11 x 11 second convolution reads 10 x 10: 17 % of the multiply-adds left out.
  std::int64_t rows_read_ = std::numeric_limits<std::int64_t>::max();
  std::int64_t columns_read_ = std::numeric_limits<std::int64_t>::max();
};

std::unique_ptr<nn::LayerKernel> make(nn::Layer& layer, Context& ctx, DType compute) {
  return std::make_unique<Conv2DKernel>(static_cast<nn::Conv2D&>(layer), OnednnContext::of(ctx), compute);
}

const nn::KernelRegistration registered(kName, nn::Conv2D::Options::kind, &make);

}  // namespace

}  // namespace dtrain::backends::onednn
