// BatchNormalization on the CPU backend (nn/batch_normalization.hpp has the semantics; the
// reference oracle is BatchNormalization::reference_forward/backward, and test_layers compares the
// two).
//   x  (N, H, W, C) f32 or bf16, in the layout the layer below produced when its channels are
//      innermost (nhwc, or blocks of 4, 8 or 16: channel = group * lanes + lane); any other input
//      (2-D (N, C), ...) as canonical rows of C channels
//   y, dy  f32, arranged as x is (y through a relu when the Activation layer above leaves it here,
//          and then dy the gradient of the relu's output: backward applies the relu's
//          derivative, recomputing its input from x)
//   dx  x's layout and dtype
//   mean, inv_std (C) kept from forward for backward
// With the relu and the max pooling above computed here (take_output_relu_and_max_pooling):
//   y, dy  f32 (N, OH, OW, C), the pooled output and its gradient, arranged as x is
//   ws     u8 per element of y: the window position of the max, kNoWinner where the max is not
//          positive (the relu's derivative is zero there)
//
// Why loops on the layer below's own layout: batch normalization reads and writes each value a few
// times and computes almost nothing, so its time is its passes over memory. It used to reorder a
// blocked input into a channels-last copy and the gradient back out of one: two more full passes,
// and with per-element double arithmetic through a lambda the loops ran at 2.4-4x the bytes'
// bound. Now each pass is vector code (lanes.hpp, built for the context's loop_isa()) over L
// channel lanes.
//
// The arithmetic is layer_math's (backends/cuda/layer_math.hpp, which the CUDA cores run and
// test_cuda_layer_math checks against this kernel): the mean, then the squared deviations from it,
// and backward's sums of dy and dy * xhat, per element in double; y and dx per element in float,
// never contracted into fused multiply-adds (the file is built with -ffp-contract=off). The sums
// are the same bits for any thread count: each plane (one sample's positions of one channel group;
// rows of 2-D input in fixed chunks of kFlatRows) is summed in position order, one chain of adds
// per channel, and the planes' sums are added in plane order. Forward reads x twice for the
// statistics (two collectives, mean then variance, as before: synchronized layers and replicas
// without samples make the same calls) and once for y; backward reads x and dy once for its sums
// and once more for dx. At 2 lanes on the 2-core EPYC that is 1.6-1.9x the bytes' bound for the
// big layers, the rest of the bench's time being the lanes' collectives. With 16 lanes the sums
// convert to double with AVX-512's instructions (plane_sums_16, which also applies the relu's
// derivative and the pooled gradient there).
//
// Why the pooling here: in bn_dropout's first block (batch normalization, relu, 2 x 2 max pooling)
// the normalized output is four times the pooled one; computed apart, forward wrote it and the
// pooling read it again, and backward the pooling wrote its gradient (three quarters zeros) that
// batch normalization then read twice. Computed here, only the pooled output, its gradient and a
// byte per pooled element reach memory; each position's gradient is worked out from its window's
// as the sums and dx reach it. The values, and the order of every sum, are those of the three
// layers computed apart (test_layers compares them), except on an input whose channels are not
// innermost, copied to canonical memory: there the sums run per sample, where the layer alone sums
// chunks of rows. Windows that do not overlap and lie inside the input ('valid' padding).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "backends/onednn/lanes.hpp"
#include "core/error.hpp"
#include "nn/batch_normalization.hpp"
#include "nn/kernel.hpp"
#include "nn/max_pool2d.hpp"

namespace dtrain::backends::onednn {

namespace {

using dnnl::memory;

// Rows of canonical (2-D, ...) input per plane.
constexpr std::int64_t kFlatRows = 256;

// Where the values of one batch live. Plane (i, g) holds positions (r, c), r < rows (the last
// batch plane: last_rows), c < cols, of channel group g; lane l of position (r, c) is at
// i * n + g * group + r * row + c * col + l, channel g * lanes + l. x, y, dy and dx share it.
struct Geometry {
  std::int64_t planes = 0, groups = 1, lanes = 0;
  std::int64_t rows = 0, last_rows = 0, cols = 1;
  std::int64_t n = 0, group = 0, row = 0, col = 0;
  std::int64_t rows_of(std::int64_t i) const { return i + 1 == planes ? last_rows : rows; }
  std::int64_t offset(std::int64_t i, std::int64_t g) const { return i * n + g * group; }
};

// The max pooling computed with the layer: kh x kw windows at strides kh, kw, from the top left,
// oh x ow of them, every one inside the plane; pooled plane (i, g) at i * n + g * group, window
// (r, c) of it at r * row + c * col, arranged as the input is.
struct Pooled {
  std::int64_t kh = 0, kw = 0, oh = 0, ow = 0;
  std::int64_t n = 0, group = 0, row = 0, col = 0;
  std::int64_t offset(std::int64_t i, std::int64_t g) const { return i * n + g * group; }
};

// The workspace's winner where the max is not positive: no position's, so every position's
// gradient is zero (relu's derivative), as max pooling's backward masks it by the pooled output.
constexpr std::int32_t kNoWinner = 255;

// Calls body(offset) for every position of plane (i, g), in order. The geometry is copied into
// locals first: the bodies store through may_alias vectors (lanes.hpp), which GCC 12 assumed could
// change g, so it reloaded the strides and bounds from memory at every position (a normalizing
// pass over 2-D input, a vector a row, spent most of its instructions there).
template <class Body>
[[gnu::always_inline]] inline void for_positions(const Geometry& g, std::int64_t i, std::int64_t base, Body&& body) {
  const std::int64_t rows = g.rows_of(i), cols = g.cols, row = g.row, col = g.col;
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) body(base + r * row + c * col);
}

// The sums run in double, D lanes per vector (half a register of floats, widened to a full one:
// GCC 12 converts a vector wider than the registers lane by lane), V vectors per position (each
// its own chain of adds, so the adds' latency overlaps). Every lane adds its channel's terms one
// after the other, in the plane's position order (the order test_cuda_layer_math sums in).
// The conversion is lanes.hpp's lanes_as, one vcvtps2pd of the whole vector: GCC 12's
// __builtin_convertvector made two conversions of half a vector and an insertion of AVX2's 4
// lanes, the sums' busiest instructions (the bn_dropout experiment's first batch normalization
// took a fifth longer forward that way; 2-core Zen 3 EPYC).
template <int D>
using Doubles = Vec<double, D>;
template <int D>
inline Doubles<D> widened(const Vec<float, D>& v) {
  return lanes_as<double>(v);
}

// first[l] (l < lanes) = the sum over the plane's positions of the terms of lane l, term(at, c)
// giving those of lanes c .. c + D at element offset `at` (with Two, a pair: second[l] sums the
// pair's second terms).
template <int D, int V, bool Two, class Term>
[[gnu::always_inline]] inline void plane_sums(const Geometry& g, std::int64_t i, std::int64_t grp,
                                              double* __restrict first, double* __restrict second, const Term& term) {
  const std::int64_t base = g.offset(i, grp);
  for (std::int64_t c0 = 0; c0 < g.lanes; c0 += D * V) {
    Doubles<D> a[V] = {}, b[V] = {};
    for_positions(g, i, base, [&](std::int64_t at) {
      for (int v = 0; v < V; ++v) {
        if constexpr (Two) {
          const auto [ta, tb] = term(at + c0 + v * D, c0 + v * D);
          a[v] += ta;
          b[v] += tb;
        } else {
          a[v] += term(at + c0 + v * D, c0 + v * D);
        }
      }
    });
    for (int v = 0; v < V; ++v) {
      store(first + c0 + v * D, a[v]);
      if constexpr (Two) store(second + c0 + v * D, b[v]);
    }
  }
}

// body.template operator()<D, V>() with D doubles per vector for a float lane count of L, and V
// the most vectors (4, 2, 1) that divide a group's `lanes`.
template <int L, class Body>
[[gnu::always_inline]] inline void with_double_vectors(std::int64_t lanes, const Body& body) {
  constexpr int D = L >= 2 ? L / 2 : 1;
  if (lanes % (4 * D) == 0) return body.template operator()<D, 4>();
  if (lanes % (2 * D) == 0) return body.template operator()<D, 2>();
  body.template operator()<D, 1>();
}

// The 16-lane sums (L = 16: only the loops built for x86-64-v4 have it) in AVX-512's own
// conversions. GCC 12 lowers a conversion to a vector of doubles 128 bits at a time: a position's
// 16 bfloat16 lanes took 16 shuffles, all on one port, and the three passes of sums were most of
// the layer's time (the bn_dropout experiment's first batch normalization: 0.63-0.66 ms forward in
// float32 and in bfloat16, 2.4 and 5.5 times its bound, on a 2-core Intel Xeon with AMX). The
// values and the order of the adds are plane_sums', so the bits are too. (No lambdas: a lambda
// inside these functions would not be built for their target.)

// 8 lanes from p as doubles, exactly. (The masked conversion: GCC 12 warns that the plain one's
// undefined source operand is uninitialized.)
[[DTRAIN_X86_64_V4, gnu::always_inline]] inline __m512d doubles_at(const float* p) {
  return _mm512_maskz_cvtps_pd(0xFF, _mm256_loadu_ps(p));
}
[[DTRAIN_X86_64_V4, gnu::always_inline]] inline __m512d doubles_at(const std::uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_maskz_cvtps_pd(0xFF, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
}

// 16 floats from p: x's lanes widened from bfloat16, or as they are. (Here and below, the
// zero-masked forms with every lane kept, as in doubles_at.)
[[DTRAIN_X86_64_V4, gnu::always_inline]] inline __m512 floats_at(const float* p) { return _mm512_loadu_ps(p); }
[[DTRAIN_X86_64_V4, gnu::always_inline]] inline __m512 floats_at(const std::uint16_t* p) {
  const __m512i wide = _mm512_maskz_cvtepu16_epi32(0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xFFFF, wide, 16));
}
// Half h (lanes 8h .. 8h + 7) of 16 floats as doubles, exactly. (The halves as a shuffle: GCC 12's
// _mm512_castps512_ps256 is an extraction with an undefined operand, which it warns about.)
[[DTRAIN_X86_64_V4, gnu::always_inline]] inline __m512d half_as_doubles(__m512 v, int h) {
  const __m256 half = h == 0 ? __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7)
                             : __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_maskz_cvtps_pd(0xFF, half);
}

// What the 16-lane sums add: x (plane_sum), (x - mean)^2 (plane_squared_deviations), or the pair
// dy, dy (x - mean) inv_std (plane_gradient_sums) with dy as it is, through the relu's derivative
// (through_relu's mask), or from the pooled gradient (pooled_gradient's).
enum class PlaneTerms { x, squared_deviations, gradient, gradient_through_relu, pooled_gradient };

// What the 16-lane sums read besides x, for the terms that need it (the rest null).
struct PlaneInputs16 {
  const float* dy = nullptr;          // the gradient (the pooled one for pooled_gradient)
  const double* mean_d = nullptr;     // squared_deviations: the group's batch means in double
  const float* mean = nullptr;        // the gradients: the group's mean and inv_std
  const float* inv_std = nullptr;
  const float* scale = nullptr;       // gradient_through_relu: forward's scale and shift
  const float* shift = nullptr;
  const Pooled* pool = nullptr;       // pooled_gradient: the windows and their winners
  const std::uint8_t* ws = nullptr;
};

// The sums of Terms for 16 lanes at a time, each lane's terms added in the plane's position order
// (with the pooling, for_pooled_positions' order, the same).
template <PlaneTerms Terms, class T>
[[DTRAIN_X86_64_V4]] void plane_sums_16(const Geometry& g, std::int64_t i, std::int64_t grp, const T* __restrict x,
                                        const PlaneInputs16& in, double* __restrict first,
                                        double* __restrict second) {
  constexpr bool pair = Terms != PlaneTerms::x && Terms != PlaneTerms::squared_deviations;
  const std::int64_t base = g.offset(i, grp), rows = g.rows_of(i);
  for (std::int64_t c0 = 0; c0 < g.lanes; c0 += 16) {
    __m512d a[2], b[2], m[2], s[2];
    for (int h = 0; h < 2; ++h) {
      a[h] = b[h] = m[h] = s[h] = _mm512_setzero_pd();
      if constexpr (Terms == PlaneTerms::squared_deviations) m[h] = _mm512_loadu_pd(in.mean_d + c0 + h * 8);
      if constexpr (pair) {
        m[h] = doubles_at(in.mean + c0 + h * 8);
        s[h] = doubles_at(in.inv_std + c0 + h * 8);
      }
    }
    __m512 scale = _mm512_setzero_ps(), shift = _mm512_setzero_ps();
    if constexpr (Terms == PlaneTerms::gradient_through_relu) {
      scale = _mm512_loadu_ps(in.scale + c0);
      shift = _mm512_loadu_ps(in.shift + c0);
    }
    // The pooled gradient: from the window over each position (none past the last window).
    const std::int64_t pooled = Terms == PlaneTerms::pooled_gradient ? in.pool->offset(i, grp) + c0 : 0;
    for (std::int64_t r = 0; r < rows; ++r) {
      // The window over column c of this row (window, at `position` in it), advanced column by
      // column as for_pooled_positions does; `windowed` columns lie in a window.
      std::int64_t window = 0, windowed = 0;
      std::int32_t first_position = 0, position = 0;
      if constexpr (Terms == PlaneTerms::pooled_gradient) {
        if (r < in.pool->oh * in.pool->kh) {
          window = pooled + r / in.pool->kh * in.pool->row;
          windowed = in.pool->ow * in.pool->kw;
          first_position = position = static_cast<std::int32_t>(r % in.pool->kh * in.pool->kw);
        }
      }
      for (std::int64_t c = 0; c < g.cols; ++c) {
        const std::int64_t at = base + r * g.row + c * g.col + c0;
        __m512 dy16 = _mm512_setzero_ps();
        if constexpr (Terms == PlaneTerms::gradient) {
          dy16 = _mm512_loadu_ps(in.dy + at);
        } else if constexpr (Terms == PlaneTerms::gradient_through_relu) {
          const __m512 relu_input = _mm512_add_ps(_mm512_mul_ps(floats_at(x + at), scale), shift);
          dy16 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(relu_input, _mm512_setzero_ps(), _CMP_GT_OQ),
                                     load_whole<__m512>(in.dy + at));
        } else if constexpr (Terms == PlaneTerms::pooled_gradient) {
          if (c < windowed) {
            const __m512i winners =
                _mm512_maskz_cvtepu8_epi32(0xFFFF, _mm_loadu_si128(reinterpret_cast<const __m128i*>(in.ws + window)));
            dy16 = _mm512_maskz_mov_ps(_mm512_cmpeq_epi32_mask(winners, _mm512_set1_epi32(position)),
                                       load_whole<__m512>(in.dy + window));
            if (++position == first_position + in.pool->kw) {  // the next window
              position = first_position;
              window += in.pool->col;
            }
          }
        }
        for (int h = 0; h < 2; ++h) {
          const __m512d v = doubles_at(x + at + h * 8);
          if constexpr (Terms == PlaneTerms::x) {
            a[h] = _mm512_add_pd(a[h], v);
          } else if constexpr (Terms == PlaneTerms::squared_deviations) {
            const __m512d d = _mm512_sub_pd(v, m[h]);
            a[h] = _mm512_add_pd(a[h], _mm512_mul_pd(d, d));
          } else {
            const __m512d d = half_as_doubles(dy16, h);
            a[h] = _mm512_add_pd(a[h], d);
            b[h] = _mm512_add_pd(b[h], _mm512_mul_pd(_mm512_mul_pd(d, _mm512_sub_pd(v, m[h])), s[h]));
          }
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      _mm512_storeu_pd(first + c0 + h * 8, a[h]);
      if constexpr (pair) _mm512_storeu_pd(second + c0 + h * 8, b[h]);
    }
  }
}

// sum[l] = sum of x over the plane.
template <class T, int L>
void plane_sum(const Geometry& g, std::int64_t i, std::int64_t grp, const T* __restrict x, double* __restrict sum) {
  if constexpr (L == 16) {
    plane_sums_16<PlaneTerms::x, T>(g, i, grp, x, {}, sum, nullptr);
  } else {
    with_double_vectors<L>(g.lanes, [&]<int D, int V>() {
      plane_sums<D, V, false>(g, i, grp, sum, nullptr,
                              [&](std::int64_t at, std::int64_t) { return widened<D>(load_widened<D>(x + at)); });
    });
  }
}

// squares[l] = sum of (x - mean)^2 over the plane, in double (mean: the group's batch means).
template <class T, int L>
void plane_squared_deviations(const Geometry& g, std::int64_t i, std::int64_t grp, const T* __restrict x,
                              const double* __restrict mean, double* __restrict squares) {
  if constexpr (L == 16) {
    plane_sums_16<PlaneTerms::squared_deviations, T>(g, i, grp, x, {.mean_d = mean}, squares, nullptr);
  } else {
    with_double_vectors<L>(g.lanes, [&]<int D, int V>() {
      plane_sums<D, V, false>(g, i, grp, squares, nullptr, [&](std::int64_t at, std::int64_t c) {
        const Doubles<D> d = widened<D>(load_widened<D>(x + at)) - load<Doubles<D>>(mean + c);
        return d * d;
      });
    });
  }
}

// The relu's derivative applied to D lanes of dy at a position: dy where the relu's input, x *
// scale + shift as plane_normalize computed it (the same float operations, so the same bits), is
// above zero, +0 elsewhere (as the pooled gradient masks it); dy loaded whole (load_whole).
template <int D>
[[gnu::always_inline]] inline Vec<float, D> through_relu(const Vec<float, D>& dy, const Vec<float, D>& x,
                                                        const Vec<float, D>& scale, const Vec<float, D>& shift) {
  using I = Vec<std::int32_t, D>;
  const I positive = x * scale + shift > 0.0f;
  return std::bit_cast<Vec<float, D>>(I(std::bit_cast<I>(dy) & positive));
}

// dy_sum[l] = sum of dy, dy_xhat_sum[l] = sum of dy (x - mean) inv_std, over the plane in double
// (layer_math's batch_norm_dy_xhat); mean and inv_std are the group's, in float. With Relu, dy is
// the gradient of the relu's output, taken through its derivative (through_relu; scale and shift
// are forward's).
template <class T, int L, bool Relu>
void plane_gradient_sums(const Geometry& g, std::int64_t i, std::int64_t grp, const T* __restrict x,
                         const float* __restrict dy, const float* __restrict mean, const float* __restrict inv_std,
                         const float* __restrict scale, const float* __restrict shift, double* __restrict dy_sum,
                         double* __restrict dy_xhat_sum) {
  if constexpr (L == 16) {
    constexpr PlaneTerms terms = Relu ? PlaneTerms::gradient_through_relu : PlaneTerms::gradient;
    plane_sums_16<terms, T>(g, i, grp, x,
                            {.dy = dy, .mean = mean, .inv_std = inv_std, .scale = scale, .shift = shift}, dy_sum,
                            dy_xhat_sum);
  } else {
    with_double_vectors<L>(g.lanes, [&]<int D, int V>() {
      using F = Vec<float, D>;
      plane_sums<D, V, true>(g, i, grp, dy_sum, dy_xhat_sum, [&](std::int64_t at, std::int64_t c) {
        const F xv = load_widened<D>(x + at);
        F dyv = Relu ? load_whole<F>(dy + at) : load<F>(dy + at);
        if constexpr (Relu) dyv = through_relu<D>(dyv, xv, load<F>(scale + c), load<F>(shift + c));
        const Doubles<D> d = widened<D>(dyv);
        const Doubles<D> centered = widened<D>(xv) - widened<D>(load<F>(mean + c));
        return std::pair{d, d * centered * widened<D>(load<F>(inv_std + c))};
      });
    });
  }
}

// y = x * scale + shift per channel (layer_math's batch_norm_apply), then max(y, 0) with Relu (the
// Activation layer above left it to this layer); zero in the padding lanes (live 0) whatever
// they held.
template <class T, int L, bool Relu>
void plane_normalize(const Geometry& g, std::int64_t i, std::int64_t grp, const T* __restrict x,
                     const float* __restrict scale, const float* __restrict shift, const std::int32_t* __restrict live,
                     float* __restrict y) {
  using F = Vec<float, L>;
  const std::int64_t base = g.offset(i, grp);
  for (std::int64_t c0 = 0; c0 < g.lanes; c0 += L) {
    const F a = load<F>(scale + c0), b = load<F>(shift + c0);
    const Vec<std::int32_t, L> on = load<Vec<std::int32_t, L>>(live + c0) != 0;
    for_positions(g, i, base + c0, [&](std::int64_t at) {
      const F v = load_widened<L>(x + at) * a + b;
      if constexpr (Relu) {
        // max(v, 0) as bits: v's where its sign bit is clear, else zero (GCC 12 compared v > 0
        // lane by lane, vcomiss and seta, at 4x the time of the whole pass).
        const Vec<std::int32_t, L> bits = std::bit_cast<Vec<std::int32_t, L>>(v);
        store(y + at, on ? std::bit_cast<F>(bits & ~(bits >> 31)) : F{});
      } else {
        store(y + at, on ? v : F{});
      }
    });
  }
}

// dx = scale ((dy - mean(dy)) - xhat mean(dy xhat)), xhat = (x - mean) inv_std, in float
// (layer_math's batch_norm_input_gradient); zero in the padding lanes, which oneDNN expects zero
// (a NaN there, from a gradient's padding, would reach the convolution below). With Relu, dy
// through the relu's derivative (through_relu: forward's scale and its shift).
template <class T, int L, bool Relu>
void plane_input_gradient(const Geometry& g, std::int64_t i, std::int64_t grp, const T* __restrict x,
                          const float* __restrict dy, const float* __restrict mean, const float* __restrict inv_std,
                          const float* __restrict scale, const float* __restrict shift,
                          const float* __restrict mean_dy, const float* __restrict mean_dy_xhat,
                          const std::int32_t* __restrict live, T* __restrict dx) {
  using F = Vec<float, L>;
  const std::int64_t base = g.offset(i, grp);
  for (std::int64_t c0 = 0; c0 < g.lanes; c0 += L) {
    const F m = load<F>(mean + c0), s = load<F>(inv_std + c0), a = load<F>(scale + c0), b = load<F>(shift + c0);
    const F mdy = load<F>(mean_dy + c0), mdx = load<F>(mean_dy_xhat + c0);
    const Vec<std::int32_t, L> on = load<Vec<std::int32_t, L>>(live + c0) != 0;
    for_positions(g, i, base + c0, [&](std::int64_t at) {
      const F xv = load_widened<L>(x + at);
      F dyv = Relu ? load_whole<F>(dy + at) : load<F>(dy + at);
      if constexpr (Relu) dyv = through_relu<L>(dyv, xv, a, b);
      const F xhat = (xv - m) * s;
      const F v = a * ((dyv - mdy) - xhat * mdx);
      store_rounded<L>(dx + at, on ? v : F{});
    });
  }
}

// y = max over each window of relu(x * scale + shift) (zero in the padding lanes), and which
// window position won (strictly greater: on a tie the first), as plane_normalize<T, L, true> and
// max pooling's forward compute them one after the other; kNoWinner where the max is not positive.
template <class T, int L>
void plane_normalize_pooled(const Geometry& g, const Pooled& pool, std::int64_t i, std::int64_t grp,
                            const T* __restrict x, const float* __restrict scale, const float* __restrict shift,
                            const std::int32_t* __restrict live, float* __restrict y, std::uint8_t* __restrict ws) {
  using F = Vec<float, L>;
  using I = Vec<std::int32_t, L>;
  const std::int64_t base = g.offset(i, grp), pooled = pool.offset(i, grp);
  for (std::int64_t c0 = 0; c0 < g.lanes; c0 += L) {
    const F a = load<F>(scale + c0), b = load<F>(shift + c0);
    const I on = load<I>(live + c0) != 0;
    const auto relu_at = [&](std::int64_t r, std::int64_t c) {
      const F v = load_widened<L>(x + base + r * g.row + c * g.col + c0) * a + b;
      const I bits = std::bit_cast<I>(v);
      return on ? std::bit_cast<F>(bits & ~(bits >> 31)) : F{};
    };
    for (std::int64_t pr = 0; pr < pool.oh; ++pr)
      for (std::int64_t pc = 0; pc < pool.ow; ++pc) {
        F best = relu_at(pr * pool.kh, pc * pool.kw);
        I which{};
        for (std::int64_t k = 1; k < pool.kh * pool.kw; ++k) {
          const F v = relu_at(pr * pool.kh + k / pool.kw, pc * pool.kw + k % pool.kw);
          const I more = v > best;
          best = more ? v : best;
          which = more ? I{} + static_cast<std::int32_t>(k) : which;
        }
        which = best > 0.0f ? which : I{} + kNoWinner;
        const std::int64_t at = pooled + pr * pool.row + pc * pool.col + c0;
        store(y + at, best);
        store(ws + at, narrow_to_bytes<L>(which));
      }
  }
}

// Calls body(at, window, position, inside) for every position of plane (i, g) in plane_sums'
// order (row by row): `at` its offset in x, `window` its window's offset in the pooled memories,
// `position` its place in the window, and `inside` (std::true_type, or std::false_type for the
// rows and columns past the last window, whose gradient is zero) whether it is in a window.
template <class Body>
[[gnu::always_inline]] inline void for_pooled_positions(const Geometry& g, const Pooled& pool, std::int64_t i,
                                                        std::int64_t grp, Body&& body) {
  const std::int64_t base = g.offset(i, grp), pooled = pool.offset(i, grp);
  for (std::int64_t r = 0; r < g.rows_of(i); ++r) {
    const std::int64_t row = base + r * g.row;
    std::int64_t c = 0;
    if (r < pool.oh * pool.kh) {
      const std::int64_t window_row = pooled + r / pool.kh * pool.row;
      const std::int32_t first = static_cast<std::int32_t>(r % pool.kh * pool.kw);
      for (std::int64_t pc = 0; pc < pool.ow; ++pc)
        for (std::int32_t j = 0; j < pool.kw; ++j, ++c)
          body(row + c * g.col, window_row + pc * pool.col, first + j, std::true_type{});
    }
    for (; c < g.cols; ++c) body(row + c * g.col, std::int64_t{0}, std::int32_t{0}, std::false_type{});
  }
}

// L lanes of the gradient at a position in a window (for_pooled_positions) as max pooling's
// backward wrote it through the relu: the window's where its max came from, +0 elsewhere.
template <int L>
[[gnu::always_inline]] inline Vec<float, L> pooled_gradient(std::int64_t window, std::int32_t position,
                                                           const float* __restrict dy, const std::uint8_t* __restrict ws) {
  using I = Vec<std::int32_t, L>;
  const I here = load_bytes_widened<L>(ws + window) == position;
  return std::bit_cast<Vec<float, L>>(I(load_whole<I>(dy + window) & here));
}

// Lanes [First, First + D) of v, in a register (a shuffle: through an array, GCC 12 sent them
// through the stack and widened them to doubles two at a time).
template <int First, int D, int L>
[[gnu::always_inline]] inline Vec<float, D> lanes_from(const Vec<float, L>& v) {
  if constexpr (D == L) {
    return v;
  } else {
    return [&]<std::size_t... k>(std::index_sequence<k...>) {
      return __builtin_shufflevector(v, v, (First + static_cast<int>(k))...);
    }(std::make_index_sequence<D>{});
  }
}

// plane_gradient_sums with the gradient from the pooled one (pooled_gradient), each lane's terms
// in the same order. The gradient is worked out L lanes at a time, once per position, and summed
// as two halves of doubles (as plane_sums widens half a register of floats; 16 lanes in
// plane_sums_16).
template <class T, int L>
void plane_gradient_sums_pooled(const Geometry& g, const Pooled& pool, std::int64_t i, std::int64_t grp,
                                const T* __restrict x, const float* __restrict dy, const std::uint8_t* __restrict ws,
                                const float* __restrict mean, const float* __restrict inv_std,
                                double* __restrict dy_sum, double* __restrict dy_xhat_sum) {
  if constexpr (L == 16) {
    plane_sums_16<PlaneTerms::pooled_gradient, T>(
        g, i, grp, x, {.dy = dy, .mean = mean, .inv_std = inv_std, .pool = &pool, .ws = ws}, dy_sum, dy_xhat_sum);
    return;
  }
  constexpr int H = L >= 2 ? 2 : 1, D = L / H;
  using F = Vec<float, L>;
  for (std::int64_t c0 = 0; c0 < g.lanes; c0 += L) {
    Doubles<D> a[H] = {}, b[H] = {}, m[H], s[H];
    for (int h = 0; h < H; ++h) {
      m[h] = widened<D>(load<Vec<float, D>>(mean + c0 + h * D));
      s[h] = widened<D>(load<Vec<float, D>>(inv_std + c0 + h * D));
    }
    for_pooled_positions(g, pool, i, grp, [&](std::int64_t at, std::int64_t window, std::int32_t position, auto inside) {
      F dyv{};
      if constexpr (decltype(inside)::value) dyv = pooled_gradient<L>(window + c0, position, dy, ws);
      const auto add = [&]<int h>() {
        const Doubles<D> dd = widened<D>(lanes_from<h * D, D, L>(dyv));
        const Doubles<D> centered = widened<D>(load_widened<D>(x + at + c0 + h * D)) - m[h];
        a[h] += dd;
        b[h] += dd * centered * s[h];
      };
      add.template operator()<0>();
      if constexpr (H == 2) add.template operator()<1>();
    });
    for (int h = 0; h < H; ++h) {
      store(dy_sum + c0 + h * D, a[h]);
      store(dy_xhat_sum + c0 + h * D, b[h]);
    }
  }
}

// plane_input_gradient with the gradient from the pooled one (pooled_gradient).
template <class T, int L>
void plane_input_gradient_pooled(const Geometry& g, const Pooled& pool, std::int64_t i, std::int64_t grp,
                                 const T* __restrict x, const float* __restrict dy, const std::uint8_t* __restrict ws,
                                 const float* __restrict mean, const float* __restrict inv_std,
                                 const float* __restrict scale, const float* __restrict mean_dy,
                                 const float* __restrict mean_dy_xhat, const std::int32_t* __restrict live,
                                 T* __restrict dx) {
  using F = Vec<float, L>;
  for (std::int64_t c0 = 0; c0 < g.lanes; c0 += L) {
    const F m = load<F>(mean + c0), s = load<F>(inv_std + c0), a = load<F>(scale + c0);
    const F mdy = load<F>(mean_dy + c0), mdx = load<F>(mean_dy_xhat + c0);
    const Vec<std::int32_t, L> on = load<Vec<std::int32_t, L>>(live + c0) != 0;
    for_pooled_positions(g, pool, i, grp, [&](std::int64_t at, std::int64_t window, std::int32_t position, auto inside) {
      F dyv{};
      if constexpr (decltype(inside)::value) dyv = pooled_gradient<L>(window + c0, position, dy, ws);
      const F xhat = (load_widened<L>(x + at + c0) - m) * s;
      store_rounded<L>(dx + at + c0, on ? F(a * ((dyv - mdy) - xhat * mdx)) : F{});
    });
  }
}

class BatchNormalizationKernel final : public nn::LayerKernel {
 public:
  // Computes in f32 under every precision policy, as Keras keeps batch statistics in float32.
  BatchNormalizationKernel(nn::BatchNormalization& layer, OnednnContext& ctx)
      : layer_(layer), ctx_(ctx), channels_(layer.channels()) {
    const auto c = static_cast<std::size_t>(channels_);
    sums_.resize(2 * c + 1);
    batch_mean_.resize(c);
    batch_variance_.resize(c);
  }

  LayoutPtr plan(std::int64_t batch, const LayoutPtr& src) override {
    Plan& p = plans_.create(batch);
    const memory::desc& src_md = md_of(src);
    p.dtype = dtype_of(src_md) == DType::bf16 ? DType::bf16 : DType::f32;
    const Shape out = layer_.output_shape().with_batch(batch);
    LayoutPtr dst;
    if (pool_) {
      dst = plan_pooled(p, batch, src_md);
    } else if (const std::optional<Arrangement> a = arrangement_of(src_md); a && out.rank() == 4) {
      // y arranged as x; its descriptor's strides must be x's (they are, for a dense x).
      const memory::desc dst_md = arranged_like(*a, {batch, out[3], out[1], out[2]}, memory::data_type::f32);
      const std::optional<Arrangement> d = arrangement_of(dst_md);
      if (d && d->lanes == a->lanes && d->groups == a->groups && d->n == a->n && d->group == a->group &&
          d->row == a->row && d->col == a->col) {
        Geometry& g = p.geometry;
        g.planes = batch;
        g.groups = a->groups;
        g.lanes = a->lanes;
        g.rows = g.last_rows = out[1];
        g.cols = out[2];
        g.n = a->n;
        g.group = a->group;
        g.row = a->row;
        g.col = a->col;
        p.own_layout = true;
        dst = make_layout(out, DType::f32, dst_md);
      }
    }
    if (!p.own_layout && !pool_) {
      // Canonical rows of C channels, in fixed chunks of kFlatRows rows.
      Geometry& g = p.geometry;
      const std::int64_t rows = batch * (layer_.input_shape().numel() / channels_);
      g.planes = std::max<std::int64_t>(1, (rows + kFlatRows - 1) / kFlatRows);
      g.lanes = channels_;
      g.rows = std::min(rows, kFlatRows);
      g.last_rows = rows - (g.planes - 1) * g.rows;
      g.n = g.rows * channels_;
      g.row = channels_;
      dst = ctx_.canonical_layout(out, DType::f32);
    }
    const auto padded = static_cast<std::size_t>(p.geometry.groups * p.geometry.lanes);
    p.sums.assign(static_cast<std::size_t>(p.geometry.planes) * 2 * padded, 0.0);
    // Per channel, padded lanes zero (their y and dx come out zero, as oneDNN's padding must be).
    p.mean_d.assign(padded, 0.0);
    for (auto* v : {&p.mean, &p.inv_std, &p.scale, &p.shift, &p.mean_dy, &p.mean_dy_xhat}) v->assign(padded, 0.0f);
    p.live.assign(padded, 0);
    std::fill_n(p.live.begin(), channels_, 1);
    return dst;
  }

  void bind(std::int64_t batch, const nn::LayerIO& io) override {
    Plan& p = plans_.get(batch);
    const memory src = ctx_.wrap(io.src);
    if (p.own_layout) {
      p.x = src;
      if (io.diff_src) p.dx = ctx_.wrap(io.diff_src);
    } else {
      // Canonical in x's own dtype: no copy unless the layer below chose another layout.
      const memory::desc canonical = canonical_md(layer_.input_shape().with_batch(batch), p.dtype);
      p.x = layout_for(ctx_, src, canonical, p.x_in, false);
      if (io.diff_src) p.dx = layout_for(ctx_, ctx_.wrap(io.diff_src), canonical, p.dx_out, true);
    }
    p.y = static_cast<float*>(io.dst.data);
    p.dy = static_cast<float*>(io.diff_dst.data);
    input_gradient_ = static_cast<bool>(io.diff_src);
  }

  void forward(std::int64_t batch, const nn::StepContext& step) override {
    Plan& p = plans_.get(batch);
    p.x_in.run(ctx_);
    ctx_.stream.wait();  // the loops read x right away
    if (step.training()) {
      statistics(&p, step);
      write_contributions(step, batch);
    } else {
      const float* mm = value(layer_.moving_mean_index());
      const float* mv = value(layer_.moving_variance_index());
      for (std::int64_t k = 0; k < channels_; ++k) {
        p.mean[idx(k)] = mm[k];
        p.inv_std[idx(k)] =
            static_cast<float>(1.0 / std::sqrt(static_cast<double>(mv[k]) + layer_.options().epsilon));
      }
    }
    // y = (x - mean) * inv_std * gamma + beta = x * scale + shift, per channel.
    const float* gamma = layer_.gamma_index() >= 0 ? value(static_cast<std::size_t>(layer_.gamma_index())) : nullptr;
    const float* beta = layer_.beta_index() >= 0 ? value(static_cast<std::size_t>(layer_.beta_index())) : nullptr;
    for (std::int64_t k = 0; k < channels_; ++k) {
      p.scale[idx(k)] = p.inv_std[idx(k)] * (gamma ? gamma[k] : 1.0f);
      p.shift[idx(k)] = (beta ? beta[k] : 0.0f) - p.mean[idx(k)] * p.scale[idx(k)];
    }
    if (p.pooled) {
      each_plane(p, [&]<class T, int L>(std::int64_t i, std::int64_t g) {
        const std::int64_t c = g * p.geometry.lanes;
        plane_normalize_pooled<T, L>(p.geometry, *p.pooled, i, g, p.input<T>(), p.scale.data() + c, p.shift.data() + c,
                                     p.live.data() + c, p.y, p.ws.data());
      });
      return;
    }
    each_plane(p, [&]<class T, int L>(std::int64_t i, std::int64_t g) {
      const std::int64_t c = g * p.geometry.lanes;
      if (relu_) {
        plane_normalize<T, L, true>(p.geometry, i, g, p.input<T>(), p.scale.data() + c, p.shift.data() + c,
                                    p.live.data() + c, p.y);
      } else {
        plane_normalize<T, L, false>(p.geometry, i, g, p.input<T>(), p.scale.data() + c, p.shift.data() + c,
                                     p.live.data() + c, p.y);
      }
    });
  }

  void backward(std::int64_t batch, const nn::StepContext& step) override {
    Plan& p = plans_.get(batch);
    const std::int64_t c = channels_;
    // Local sums of dy and dy * xhat: this replica's dbeta and dgamma.
    each_plane(p, [&]<class T, int L>(std::int64_t i, std::int64_t g) {
      const std::int64_t at = g * p.geometry.lanes;
      double* out = plane_sums_of(p, i, g);
      if (p.pooled) {
        plane_gradient_sums_pooled<T, L>(p.geometry, *p.pooled, i, g, p.input<T>(), p.dy, p.ws.data(),
                                         p.mean.data() + at, p.inv_std.data() + at, out, out + p.geometry.lanes);
      } else {
        with_relu_derivative([&]<bool Relu>() {
          plane_gradient_sums<T, L, Relu>(p.geometry, i, g, p.input<T>(), p.dy, p.mean.data() + at,
                                          p.inv_std.data() + at, p.scale.data() + at, p.shift.data() + at, out,
                                          out + p.geometry.lanes);
        });
      }
    });
    add_planes(p, true);
    if (layer_.gamma_index() >= 0) store(grad(static_cast<std::size_t>(layer_.gamma_index())), sums_.data() + c);
    if (layer_.beta_index() >= 0) store(grad(static_cast<std::size_t>(layer_.beta_index())), sums_.data());
    if (!p.dx) return;
    std::span<double> both(sums_.data(), 2 * idx(c));
    if (nn::CrossReplica* group = statistics_group(step)) group->all_reduce_sum(both, "batch normalization gradient sums");
    // dx = scale (dy - mean(dy) - xhat mean(dy xhat)), scale = gamma inv_std.
    const float* gamma = layer_.gamma_index() >= 0 ? value(static_cast<std::size_t>(layer_.gamma_index())) : nullptr;
    for (std::int64_t k = 0; k < c; ++k) {
      p.scale[idx(k)] = p.inv_std[idx(k)] * (gamma ? gamma[k] : 1.0f);
      p.mean_dy[idx(k)] = static_cast<float>(sums_[idx(k)] / count_);
      p.mean_dy_xhat[idx(k)] = static_cast<float>(sums_[idx(c + k)] / count_);
    }
    each_plane(p, [&]<class T, int L>(std::int64_t i, std::int64_t g) {
      const std::int64_t at = g * p.geometry.lanes;
      T* dx = static_cast<T*>(p.dx.get_data_handle());
      if (p.pooled) {
        plane_input_gradient_pooled<T, L>(p.geometry, *p.pooled, i, g, p.input<T>(), p.dy, p.ws.data(),
                                          p.mean.data() + at, p.inv_std.data() + at, p.scale.data() + at,
                                          p.mean_dy.data() + at, p.mean_dy_xhat.data() + at, p.live.data() + at, dx);
      } else {
        with_relu_derivative([&]<bool Relu>() {
          plane_input_gradient<T, L, Relu>(p.geometry, i, g, p.input<T>(), p.dy, p.mean.data() + at,
                                           p.inv_std.data() + at, p.scale.data() + at, p.shift.data() + at,
                                           p.mean_dy.data() + at, p.mean_dy_xhat.data() + at, p.live.data() + at, dx);
        });
      }
    });
    p.dx_out.run(ctx_);
  }

  // A relu layer above: y comes out with the relu applied, and that layer does nothing forward
  // (nn/kernel.hpp).
  bool take_output_activation(config::Activation a) override {
    relu_ = a == config::Activation::relu;
    return relu_;
  }
  // And its derivative: backward receives the gradient of the relu's output and zeroes it where
  // the relu's input was not above zero, recomputed from x (read anyway) with forward's scale and
  // shift, so the relu layer's backward (a pass that read y and dy and wrote its gradient) moves
  // nothing.
  bool take_output_activation_derivative(config::Activation a) override {
    relu_derivative_ = relu_ && !pool_ && a == config::Activation::relu;
    return relu_derivative_;
  }

  // The relu and the max pooling above, computed here (nn/kernel.hpp; the file's header says
  // which): windows that do not overlap, every one inside the input, of at most 254 positions (a
  // byte each, kNoWinner apart).
  bool take_output_relu_and_max_pooling(const nn::MaxPool2D& pool) override {
    const Shape& in = layer_.input_shape();
    const auto& size = pool.params().pool_size;
    const bool fits = in.rank() == 3 && pool.strides()[0] == size[0] && pool.strides()[1] == size[1] &&
                      pool.padding_h().before == 0 && pool.padding_w().before == 0 &&
                      pool.padding_h().out * size[0] <= in[0] && pool.padding_w().out * size[1] <= in[1] &&
                      size[0] * size[1] < kNoWinner;
    if (!fits) return false;
    pool_ = &pool;
    relu_ = true;
    return true;
  }

  // A replica without samples still makes the collectives of a synchronized layer.
  void forward_without_samples(const nn::StepContext& step) override {
    if (!statistics_group(step) || !step.training()) return;
    statistics(nullptr, step);
    write_contributions(step, 0);
  }
  void without_input_gradient() override { input_gradient_ = false; }
  void backward_without_samples(const nn::StepContext& step) override {
    nn::CrossReplica* group = statistics_group(step);
    // The replicas with samples make this collective only for an input gradient (backward()).
    if (!group || !input_gradient_) return;
    std::fill(sums_.begin(), sums_.end(), 0.0);
    group->all_reduce_sum(std::span<double>(sums_.data(), 2 * idx(channels_)), "batch normalization gradient sums");
  }

 private:
  struct Plan {
    Geometry geometry;
    std::optional<Pooled> pooled;    // with the relu and max pooling above computed here
    std::vector<std::uint8_t> ws;    // their winners (kNoWinner: none), a byte per pooled element
    DType dtype = DType::f32;
    bool own_layout = false;  // x's own layout (else canonical rows, copied in when x is not)
    memory x, dx;
    Reorder x_in, dx_out;
    float* y = nullptr;
    float* dy = nullptr;
    // Per plane (i, g), planes in order (i, g): 2 * lanes doubles, the plane's sums (forward: of x,
    // then of the squared deviations; backward: of dy, then of dy xhat).
    std::vector<double> sums;
    // Per (padded) channel: the last forward's statistics, and what backward derives from them.
    std::vector<double> mean_d;
    std::vector<float> mean, inv_std, scale, shift, mean_dy, mean_dy_xhat;
    std::vector<std::int32_t> live;  // 1 for a real channel, 0 for a padding lane
    template <class T>
    const T* input() const {
      return static_cast<const T*>(x.get_data_handle());
    }
  };

  // The plan with the pooling: per-sample planes on x's own arrangement, or on canonical (nhwc)
  // memory x is copied into (where the layer alone sums canonical rows in chunks of kFlatRows: the
  // same sums in another order); y arranged as x is, with the pooled shape. Returns y's layout.
  LayoutPtr plan_pooled(Plan& p, std::int64_t batch, const memory::desc& src_md) {
    const Shape in = layer_.input_shape().with_batch(batch), out = pool_->output_shape().with_batch(batch);
    const std::optional<Arrangement> own = arrangement_of(src_md);
    p.own_layout = own.has_value();
    const Arrangement a = own ? *own : *arrangement_of(canonical_md(in, p.dtype));
    const memory::desc y_md = own ? arranged_like(a, {batch, out[3], out[1], out[2]}, memory::data_type::f32)
                                  : canonical_md(out, DType::f32);
    const Arrangement y = *arrangement_of(y_md);
    Geometry& g = p.geometry;
    g.planes = batch;
    g.groups = a.groups;
    g.lanes = a.lanes;
    g.rows = g.last_rows = in[1];
    g.cols = in[2];
    g.n = a.n;
    g.group = a.group;
    g.row = a.row;
    g.col = a.col;
    const auto& size = pool_->params().pool_size;
    p.pooled = Pooled{.kh = size[0], .kw = size[1], .oh = out[1], .ow = out[2],
                      .n = y.n, .group = y.group, .row = y.row, .col = y.col};
    p.ws.assign(y_md.get_size() / sizeof(float), 0);
    return own ? make_layout(out, DType::f32, y_md) : ctx_.canonical_layout(out, DType::f32);
  }

  // Who the batch statistics are summed over: every replica (and lane) when synchronized, else
  // the lanes of this replica, which together are one replica; null when alone.
  nn::CrossReplica* statistics_group(const nn::StepContext& step) const {
    return layer_.options().synchronized ? step.cross_replica : step.lanes;
  }

  static std::size_t idx(std::int64_t k) { return static_cast<std::size_t>(k); }
  float* value(std::size_t i) { return layer_.variables()[i].value.address<float>(); }
  float* grad(std::size_t i) { return layer_.variables()[i].grad.address<float>(); }
  void store(float* out, const double* in) const {
    for (std::int64_t k = 0; k < channels_; ++k) out[k] = static_cast<float>(in[k]);
  }
  static double* plane_sums_of(Plan& p, std::int64_t i, std::int64_t g) {
    const std::int64_t lanes = p.geometry.lanes;
    return p.sums.data() + static_cast<std::size_t>((i * p.geometry.groups + g) * 2 * lanes);
  }

  // body.template operator()<T, L>(i, g) for every plane, T x's element type, shared by the
  // replica's OpenMP team (each plane's result lands in its own place, so the thread count changes
  // nothing); each call goes into the build for the context's loop_isa().
  template <class Body>
  void each_plane(const Plan& p, const Body& body) {
    const Geometry& g = p.geometry;
    const std::int64_t planes = g.planes * g.groups;
    const LoopIsa isa = ctx_.loop_isa();
    const bool bf16 = p.dtype == DType::bf16;
    for_each_item(planes, [&](std::int64_t q) {
      run_with_lanes(isa, g.lanes, [&]<int L>() {
        if (bf16) return body.template operator()<std::uint16_t, L>(q / g.groups, q % g.groups);
        body.template operator()<float, L>(q / g.groups, q % g.groups);
      });
    });
  }

  // body.template operator()<Relu>(), Relu whether backward applies the relu's derivative.
  template <class Body>
  void with_relu_derivative(const Body& body) const {
    if (relu_derivative_) return body.template operator()<true>();
    body.template operator()<false>();
  }

  // sums_[k] = the planes' first sums of channel k added in plane order; with `both`, sums_[C + k]
  // their second sums.
  void add_planes(Plan& p, bool both) {
    std::fill(sums_.begin(), sums_.end(), 0.0);
    const Geometry& g = p.geometry;
    for (std::int64_t i = 0; i < g.planes; ++i)
      for (std::int64_t grp = 0; grp < g.groups; ++grp) {
        const double* m = plane_sums_of(p, i, grp);
        for (std::int64_t l = 0; l < g.lanes && grp * g.lanes + l < channels_; ++l) {
          const std::int64_t k = grp * g.lanes + l;
          sums_[idx(k)] += m[l];
          if (both) sums_[idx(channels_ + k)] += m[g.lanes + l];
        }
      }
  }

  // The batch statistics into mean and inv_std (and batch_mean_, batch_variance_), over this
  // replica (all its lanes) or, when synchronized, over every replica: two passes over x, the
  // mean, then the squared deviations from it. p is null without samples.
  void statistics(Plan* p, const nn::StepContext& step) {
    const std::int64_t c = channels_;
    nn::CrossReplica* group = statistics_group(step);
    std::fill(sums_.begin(), sums_.end(), 0.0);
    if (p) {
      each_plane(*p, [&]<class T, int L>(std::int64_t i, std::int64_t g) {
        plane_sum<T, L>(p->geometry, i, g, p->input<T>(), plane_sums_of(*p, i, g));
      });
      add_planes(*p, false);
      const Geometry& g = p->geometry;
      sums_[idx(c)] = static_cast<double>(((g.planes - 1) * g.rows + g.last_rows) * g.cols);
    }
    // The sums of x, then the count right after them: one collective of C + 1 values.
    if (group) group->all_reduce_sum(std::span<double>(sums_.data(), idx(c) + 1), "batch normalization mean");
    count_ = sums_[idx(c)];
    for (std::int64_t k = 0; k < c; ++k) batch_mean_[idx(k)] = count_ > 0 ? sums_[idx(k)] / count_ : 0.0;
    std::fill(sums_.begin(), sums_.end(), 0.0);
    if (p) {
      std::copy(batch_mean_.begin(), batch_mean_.end(), p->mean_d.begin());
      each_plane(*p, [&]<class T, int L>(std::int64_t i, std::int64_t g) {
        plane_squared_deviations<T, L>(p->geometry, i, g, p->input<T>(), p->mean_d.data() + g * p->geometry.lanes,
                                       plane_sums_of(*p, i, g));
      });
      add_planes(*p, false);
    }
    if (group) group->all_reduce_sum(std::span<double>(sums_.data(), idx(c)), "batch normalization variance");
    for (std::int64_t k = 0; k < c; ++k) {
      batch_variance_[idx(k)] = count_ > 0 ? sums_[idx(k)] / count_ : 0.0;
      if (p) {
        p->mean[idx(k)] = static_cast<float>(batch_mean_[idx(k)]);
        p->inv_std[idx(k)] = static_cast<float>(1.0 / std::sqrt(batch_variance_[idx(k)] + layer_.options().epsilon));
      }
    }
  }

  // This replica's share of the moving statistics' update, into their grads.
  void write_contributions(const nn::StepContext& step, std::int64_t batch) {
    const double weight = layer_.contribution_weight(step, batch);
    float* mean = grad(layer_.moving_mean_index());
    float* variance = grad(layer_.moving_variance_index());
    for (std::int64_t k = 0; k < channels_; ++k) {
      mean[k] = static_cast<float>(batch_mean_[idx(k)] * weight);
      variance[k] = static_cast<float>(batch_variance_[idx(k)] * weight);
    }
  }

  nn::BatchNormalization& layer_;
  OnednnContext& ctx_;
  std::int64_t channels_;
  // Scratch reused every step, sized at construction.
  std::vector<double> sums_, batch_mean_, batch_variance_;
  double count_ = 0.0;
  // Whether backward computes the input gradient (and so makes its collective): what bind() was
  // given, and before any bind (a replica that has had no samples yet) true unless the model said
  // nothing wants it (without_input_gradient): the replicas with samples and those without must
  // agree on it, or their collectives pair up wrongly.
  bool input_gradient_ = true;
  bool relu_ = false;  // the Activation above left its relu to this layer (take_output_activation)
  // and its derivative too (take_output_activation_derivative; not with the pooling, whose
  // winners carry it)
  bool relu_derivative_ = false;
  const nn::MaxPool2D* pool_ = nullptr;  // the max pooling above it, computed here
  nn::PlanCache<Plan> plans_;
};

std::unique_ptr<nn::LayerKernel> make(nn::Layer& layer, Context& ctx, DType) {
  return std::make_unique<BatchNormalizationKernel>(static_cast<nn::BatchNormalization&>(layer),
                                                    OnednnContext::of(ctx));
}

const nn::KernelRegistration registered(kName, nn::BatchNormalization::Options::kind, &make);

}  // namespace

}  // namespace dtrain::backends::onednn
