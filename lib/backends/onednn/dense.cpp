// Dense on oneDNN's inner product (nn/dense.hpp has the semantics), or, for small layers, on this
// file's own loops.
//   x (N, I)             oneDNN src (N, I), any layout
//   kernel (I, O)        oneDNN weights (O, I); the variable stays Keras (in, out), physical order io
//   y (N, O)             activation fused
// src, weights, dst and their gradients in the compute dtype (f32 or bf16); bias and the kernel's
// gradient always f32.
//
// Why own loops: a small layer's three products are a few microseconds of oneDNN's call overhead
// each and a fraction of a microsecond of arithmetic. The seed CNN's logits layer (lanes of 32
// rows, 64 -> 10) took 3-6 us per primitive call (ONEDNN_VERBOSE), 9-11 times its bound in
// `dtrain bench`. Layers with a float32 computation, plain row-major x and y (f32 y; x f32 or, below
// a bfloat16 layer, bf16) and a linear, relu or softmax activation run the loops below when their
// work is small (kMaxOwnMultiplyAdds); everything else keeps oneDNN's primitives.
//   forward          y[n][o]  = act(b[o] + sum_i x[n][i] W[i][o])
//   weight gradient  dW[i][o] = sum_n x[n][i] dz[n][o],  db[o] = sum_n dz[n][o]
//   data gradient    dx[n][i] = sum_o dz[n][o] W[i][o]   (over a transposed copy of W), zero where a
//                    relu below had a zero output (x[n][i] not above zero), where this layer applies
//                    that derivative (take_input_activation_backward)
// dz is the gradient before the activation. All three are one product (Product below): each
// output row is a sum of rows of a row-major B, scaled by one value of A each, in vectors of L
// lanes. A pass holds R rows x V vectors of sums in registers (independent FMA chains, so their
// latency overlaps), and each sum adds its terms in index order from its start value: an element's
// bits depend neither on the blocking nor on the batch, only on the ISA the loops were built for
// (multiply-adds are fused where the CPU has FMA, as oneDNN's are). Their oracle is the primitive's
// (Dense::reference_forward/backward; test_cpu_loops and test_layers).
#include <algorithm>
#include <bit>
#include <cstring>
#include <string_view>
#include <type_traits>
#include <utility>
#include <unordered_map>
#include <vector>

#include "backends/onednn/lanes.hpp"
#include "backends/onednn/weighted_op.hpp"
#include "nn/dense.hpp"

namespace dtrain::backends::onednn {

namespace {

using dnnl::memory;

// Multiply-adds of one product (N x I x O) up to which the loops run instead of oneDNN's
// primitives: where forward and backward together took less time than oneDNN's, one thread, AVX-512
// EPYC (lanes of 32 rows: 64 -> 10 in 2.2 us against 4.4, 512 -> 10 in 16.8 against 19.0, 64 -> 64
// in 9.5 against 11.4; 128 -> 64, 262144 multiply-adds, in 20.3 against 17.6, and the seed CNN's
// 1600 -> 64 equal). The loops reach oneDNN's arithmetic speed only in forward; their backward
// wins by the primitives' call overhead alone.
constexpr std::int64_t kMaxOwnMultiplyAdds = 200'000;
// Sums held in registers per pass: 24 of AVX-512's 32 vector registers, 12 of the 16 below it.
constexpr int sums_in_registers(int lanes) { return lanes == 16 ? 24 : 12; }
constexpr int kMaxRows = 8;     // R: rows per pass (8 chains cover 2 FMA units x 4 cycles)
constexpr int kMaxVectors = 4;  // V: vectors per pass
// Floats of the data gradient's transposed kernel that run_data_gradient keeps on the stack (16 KiB).
constexpr std::int64_t kTransposedOnStack = 4096;

// C[m][c] = start[c] + sum over k of A(m, k) * B[k][c], for m < rows, c < cols, k < depth, with
// A(m, k) = a[m * a_row + k * a_step]; relu: C = max(C, 0). B has `ldb` floats per row, start (or
// null for zero) ceil(cols / L) whole vectors. C's rows are dense: `cols` elements each.
//
// Without copies of B and C padded to whole vectors (their per-row copies cost as much as the
// arithmetic at the seed CNN's logits' size, 64 -> 10), vectors run past the end of a row:
//  - B's vectors past a row's end read the next rows: lanes whose sums are never stored. Only its
//    last rows (k >= safe_depth), whose vectors would read past B's end, come from `tail`: those
//    rows again, in whole vectors (TailRows).
//  - C's vectors past a row's end write into the next rows, which are stored after it: the rows in
//    increasing order, the columns' vectors in decreasing order (product). Only C's last rows,
//    whose vectors would write past its end, are stored lane by lane.
template <class TA, class TC>
struct Product {
  const TA* a;
  std::int64_t a_row, a_step;
  const float* b;
  std::int64_t ldb;
  std::int64_t safe_depth;
  const float* tail;  // rows safe_depth.. of B, tail_ld floats apart
  std::int64_t tail_ld;
  const float* start;
  TC* c;
  std::int64_t rows, depth, cols;
  bool relu;
  // Or null: the output of a relu whose derivative C takes (zero where it is not above zero),
  // laid out as C. It may be C's own memory: each vector of it is read just before C's is written.
  const TC* derivative_of = nullptr;
};

// B's last rows whose vectors would read past its end, copied into whole vectors (zero past cols).
// `scratch` was sized in plan (tail_floats).
constexpr std::int64_t whole(std::int64_t cols, std::int64_t lanes) { return (cols + lanes - 1) / lanes * lanes; }
constexpr std::size_t tail_floats(std::int64_t cols, std::int64_t lanes) {
  return static_cast<std::size_t>(lanes * whole(cols, lanes));
}
template <class TA, class TC>
inline void tail_rows(Product<TA, TC>& p, std::int64_t lanes, float* scratch) {
  const std::int64_t reach = whole(p.cols, lanes);  // floats a row's vectors read
  p.safe_depth = std::clamp<std::int64_t>(p.depth - (reach + p.ldb - 1) / p.ldb + 1, 0, p.depth);
  p.tail = scratch;
  p.tail_ld = reach;
  for (std::int64_t k = p.safe_depth; k < p.depth; ++k)
    for (std::int64_t c = 0; c < reach; ++c)
      scratch[(k - p.safe_depth) * reach + c] = c < p.cols ? p.b[k * p.ldb + c] : 0.0f;
}

// A(m, k) in every lane of L: a float as it is (GCC folds it into the multiply-add as a broadcast
// operand); a bfloat16 code broadcast as 16-bit words straight from memory, each 32-bit lane then
// masked to its high half (= the code widened). Widened in a general register, each code waited
// for its move into a vector register, one a cycle: a bfloat16 x took the seed CNN's logits layer's
// kernel gradient a third longer than a float32 one (2-core Zen 5 EPYC).
template <int L>
inline float broadcast_of(const float* a) {
  return *a;
}
template <int L>
inline Vec<float, L> broadcast_of(const std::uint16_t* a) {
  using Words = Vec<std::uint16_t, 2 * L>;
  const Words words = Words{} + *a;
  return std::bit_cast<Vec<float, L>>(std::bit_cast<Vec<std::uint32_t, L>>(words) & 0xFFFF0000u);
}

// R rows from m0 and V vectors from column c0. Rows past the end compute the last row again and
// are not stored (a pass has a fixed shape; a row's sums do not depend on its neighbours).
template <int L, int V, int R, class TA, class TC>
inline void product_pass(const Product<TA, TC>& p, std::int64_t m0, std::int64_t c0) {
  using F = Vec<float, L>;
  const TA* __restrict row[R];
  for (int r = 0; r < R; ++r) row[r] = p.a + std::min(m0 + r, p.rows - 1) * p.a_row;
  F sum[R][V];
  for (int v = 0; v < V; ++v) {
    const F s = p.start ? load<F>(p.start + c0 + v * L) : F{};
    for (int r = 0; r < R; ++r) sum[r][v] = s;
  }
  const auto add = [&](std::int64_t k, const float* __restrict b) {
    F bk[V];
    for (int v = 0; v < V; ++v) bk[v] = load<F>(b + c0 + v * L);
    for (int r = 0; r < R; ++r) {
      const auto ak = broadcast_of<L>(row[r] + k * p.a_step);
      for (int v = 0; v < V; ++v) sum[r][v] += ak * bk[v];
    }
  };
  for (std::int64_t k = 0; k < p.safe_depth; ++k) add(k, p.b + k * p.ldb);
  for (std::int64_t k = p.safe_depth; k < p.depth; ++k) add(k, p.tail + (k - p.safe_depth) * p.tail_ld);
  const std::int64_t stored = std::min<std::int64_t>(R, p.rows - m0);
  const std::int64_t size = p.rows * p.cols;
  for (std::int64_t r = 0; r < stored; ++r) {
    const std::int64_t row_at = (m0 + r) * p.cols + c0;
    TC* out = p.c + row_at;
    for (int v = 0; v < V; ++v) {
      F s = sum[r][v];
      if (p.relu) s = s > F{} ? s : F{};
      const std::int64_t at = row_at + v * L;
      if (at + L <= size) {
        if (p.derivative_of) {  // a mask of bits: GCC 12 computes a 16-lane float select lane by lane
          using I = Vec<std::int32_t, L>;
          s = std::bit_cast<F>(I(load_widened<L>(p.derivative_of + at) > 0.0f) & std::bit_cast<I>(s));
        }
        store_rounded<L>(out + v * L, s);
      } else {
        TC lanes[L];
        store_rounded<L>(lanes, s);
        for (std::int64_t l = 0; l < std::min<std::int64_t>(L, p.cols - c0 - v * L); ++l)
          out[v * L + l] = !p.derivative_of || widen(p.derivative_of[at + l]) > 0.0f ? lanes[l] : TC{};
      }
    }
  }
}

template <int L, int V, class TA, class TC>
inline void product_columns(const Product<TA, TC>& p, std::int64_t c0) {
  // A power of two: batches are, and a pass's rows past the end are computed in vain.
  constexpr int R = std::bit_floor(static_cast<unsigned>(std::min(kMaxRows, sums_in_registers(L) / V)));
  for (std::int64_t m0 = 0; m0 < p.rows; m0 += R) product_pass<L, V, R>(p, m0, c0);
}

template <int L, class TA, class TC>
inline void product(const Product<TA, TC>& p) {
  const std::int64_t vectors = (p.cols + L - 1) / L;
  // The last group of vectors first: only it writes past its rows' ends (see Product).
  for (std::int64_t v0 = (vectors - 1) / kMaxVectors * kMaxVectors; v0 >= 0; v0 -= kMaxVectors) {
    const std::int64_t c0 = v0 * L;
    switch (std::min<std::int64_t>(kMaxVectors, vectors - v0)) {
      case 1: product_columns<L, 1>(p, c0); break;
      case 2: product_columns<L, 2>(p, c0); break;
      case 3: product_columns<L, 3>(p, c0); break;
      default: product_columns<L, 4>(p, c0); break;
    }
  }
}

// db[c] = sum over k of B[k][c] (B = dz: the bias's gradient), k in order.
template <int L, class TA, class TC>
inline void column_sums(const Product<TA, TC>& p, float* db) {
  using F = Vec<float, L>;
  for (std::int64_t c0 = 0; c0 < p.cols; c0 += L) {
    F sum{};
    for (std::int64_t k = 0; k < p.safe_depth; ++k) sum += load<F>(p.b + k * p.ldb + c0);
    for (std::int64_t k = p.safe_depth; k < p.depth; ++k) sum += load<F>(p.tail + (k - p.safe_depth) * p.tail_ld + c0);
    float lanes[L];
    store(lanes, sum);
    for (std::int64_t l = 0; l < std::min<std::int64_t>(L, p.cols - c0); ++l) db[c0 + l] = lanes[l];
  }
}

// r[j] lane l becomes r[l] lane j: a 16 x 16 transposition in registers, 4 rounds of 16 shuffles,
// each one instruction (vunpcklps, vunpckhps, vunpcklpd, vunpckhpd, vshuff32x4). Written as GCC's
// shuffles: GCC 12's unmasked intrinsics for them pass undefined vectors through
// (-Wmaybe-uninitialized, as lanes.hpp's mul_low32).
[[gnu::target("avx512f")]] inline void transpose_16x16(Vec<float, 16> (&r)[16]) {
  using F = Vec<float, 16>;
  F u[16];
  // Pairs of rows interleaved: u[2m] holds r[2m][4q], r[2m+1][4q], r[2m][4q+1], r[2m+1][4q+1] in
  // its 128-bit lane q, u[2m+1] the same from 4q+2.
  for (int m = 0; m < 8; ++m) {
    const F a = r[2 * m], b = r[2 * m + 1];
    u[2 * m] = __builtin_shufflevector(a, b, 0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29);
    u[2 * m + 1] = __builtin_shufflevector(a, b, 2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31);
  }
  // Fours: r[4g + c] holds column 4q + c of rows 4g..4g+3 in its 128-bit lane q.
  for (int g = 0; g < 4; ++g) {
    const F a = u[4 * g], b = u[4 * g + 1], c = u[4 * g + 2], d = u[4 * g + 3];
    r[4 * g] = __builtin_shufflevector(a, c, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
    r[4 * g + 1] = __builtin_shufflevector(a, c, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    r[4 * g + 2] = __builtin_shufflevector(b, d, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
    r[4 * g + 3] = __builtin_shufflevector(b, d, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  }
  // Eights: u[8h + c] (c < 4) holds columns c and 8 + c of rows 8h..8h+7 (in 128-bit lanes 0, 2
  // and 1, 3), u[8h + 4 + c] columns 4 + c and 12 + c.
  for (int h = 0; h < 2; ++h)
    for (int c = 0; c < 4; ++c) {
      const F a = r[8 * h + c], b = r[8 * h + 4 + c];
      u[8 * h + c] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
      u[8 * h + 4 + c] = __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    }
  // Sixteens: column c whole (c < 8), and column 8 + c.
  for (int c = 0; c < 8; ++c) {
    const F a = u[c], b = u[8 + c];
    r[c] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    r[8 + c] = __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
}

// r[j] lane l becomes r[l] lane j: an 8 x 8 transposition in registers, 3 rounds of 8 shuffles
// (vunpcklps, vunpckhps, vshufps, vperm2f128), as transpose_16x16 without its last round.
[[gnu::target("avx2")]] inline void transpose_8x8(Vec<float, 8> (&r)[8]) {
  using F = Vec<float, 8>;
  F u[8];
  for (int m = 0; m < 4; ++m) {
    const F a = r[2 * m], b = r[2 * m + 1];
    u[2 * m] = __builtin_shufflevector(a, b, 0, 8, 1, 9, 4, 12, 5, 13);
    u[2 * m + 1] = __builtin_shufflevector(a, b, 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int g = 0; g < 2; ++g) {
    const F a = u[4 * g], b = u[4 * g + 1], c = u[4 * g + 2], d = u[4 * g + 3];
    r[4 * g] = __builtin_shufflevector(a, c, 0, 1, 8, 9, 4, 5, 12, 13);
    r[4 * g + 1] = __builtin_shufflevector(a, c, 2, 3, 10, 11, 6, 7, 14, 15);
    r[4 * g + 2] = __builtin_shufflevector(b, d, 0, 1, 8, 9, 4, 5, 12, 13);
    r[4 * g + 3] = __builtin_shufflevector(b, d, 2, 3, 10, 11, 6, 7, 14, 15);
  }
  for (int c = 0; c < 4; ++c) {
    const F a = r[c], b = r[4 + c];
    u[c] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11);
    u[4 + c] = __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
  }
  for (int c = 0; c < 8; ++c) r[c] = u[c];
}
inline void transpose_square(Vec<float, 16> (&r)[16]) { transpose_16x16(r); }
inline void transpose_square(Vec<float, 8> (&r)[8]) { transpose_8x8(r); }

// The first n < L lanes of v at p. AVX-512 stores them under a mask. AVX2's masked store
// (vmaskmovps) took a third more time than the whole kernel gradient below without it (2-core Zen 3
// EPYC), so there a whole vector is stored where its lanes past n land on memory that is written
// again later and inside the array (`spill`), and the lanes one by one elsewhere.
[[gnu::target("avx512f")]] inline void store_first(float* p, const Vec<float, 16>& v, int n, bool) {
  _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1u), reinterpret_cast<__m512>(v));
}
inline void store_first(float* p, const Vec<float, 8>& v, int n, bool spill) {
  if (spill) {
    store(p, v);
    return;
  }
  for (int l = 0; l < n; ++l) p[l] = v[l];
}

// Outputs up to which the kernel's gradient is computed as transposed sums: on AVX-512 one block
// of 16 (one masked store a row; measured to 16), on AVX2 the 12 sums of its registers' budget
// (sums_in_registers) at V = 1.
constexpr int transposed_outputs(int lanes) { return lanes == 16 ? 16 : 12; }

// The kernel's gradient dW (I, O) = x^T dz for O <= transposed_outputs(L) and I a multiple of L,
// on AVX-512 and AVX2. The product's rows of dW would hold O of a vector's L lanes (the seed CNN's
// logits layer: 10, so 2,048 multiply-adds where 1,280 do on AVX-512, 4,096 where 2,560 do on
// AVX2); here a pass holds dW^T's sums instead, O rows of V vectors of L inputs, and transposes
// each L x L block of them into dW's rows. A sum is the product's: over the samples in order from
// zero, one multiply-add each, its two factors swapped (which does not change a product's bits).
// Each row's blocks of outputs are stored last to first: on AVX2 a block's vector past the row's
// end lands on the next rows' first outputs, stored after it (as the product's rows do), wherever
// the whole vector lies inside dW: with 1-3 outputs it spans several rows, and near dW's end it
// would run past it.
template <int L, int O, int V, class TA>
void kernel_gradient_pass(const Product<TA, float>& p, std::int64_t m0) {
  using F = Vec<float, L>;
  constexpr int blocks = (O + L - 1) / L;
  F sum[O][V];
  for (int o = 0; o < O; ++o)
    for (int v = 0; v < V; ++v) sum[o][v] = F{};
  for (std::int64_t k = 0; k < p.depth; ++k) {
    F x[V];
    for (int v = 0; v < V; ++v) x[v] = load_widened<L>(p.a + k * p.a_step + m0 + v * L);
    const float* __restrict dz = p.b + k * p.ldb;
    for (int o = 0; o < O; ++o)
      for (int v = 0; v < V; ++v) sum[o][v] += dz[o] * x[v];
  }
  for (int v = 0; v < V; ++v) {
    F r[blocks][L];
    for (int b = 0; b < blocks; ++b) {
      for (int o = 0; o < L; ++o) r[b][o] = b * L + o < O ? sum[b * L + o][v] : F{};
      transpose_square(r[b]);
    }
    for (int l = 0; l < L; ++l) {
      const std::int64_t i = m0 + v * L + l;
      for (int b = blocks - 1; b >= 0; --b) {
        constexpr int last = O - (blocks - 1) * L;  // outputs in the last block
        if (b < blocks - 1 || last == L) store(p.c + i * O + b * L, r[b][l]);
        else store_first(p.c + i * O + b * L, r[b][l], last, i * O + b * L + L <= p.rows * O);
      }
    }
  }
}

// V: as many vectors of inputs as keep O x V sums within the registers' budget (at most 4).
template <int L, int O, class TA>
void kernel_gradient_columns(const Product<TA, float>& p) {
  constexpr int V = std::clamp(sums_in_registers(L) / O, 1, 4);
  std::int64_t m0 = 0;
  for (; m0 + L * V <= p.rows; m0 += L * V) kernel_gradient_pass<L, O, V>(p, m0);
  for (; m0 < p.rows; m0 += L) kernel_gradient_pass<L, O, 1>(p, m0);
}

template <int L, class TA, int... O>
void kernel_gradient_transposed(const Product<TA, float>& p, std::integer_sequence<int, O...>) {
  (void)((p.cols == O + 1 ? (kernel_gradient_columns<L, O + 1>(p), true) : false) || ...);
}

// Whether kernel_gradient_transposed<L> computes this product (a kernel's gradient: A is x read
// down its columns, C's rows O <= transposed_outputs(L) floats).
template <int L, class TA>
bool kernel_gradient_fits(const Product<TA, float>& p) {
  return p.cols <= transposed_outputs(L) && p.rows % L == 0 && p.a_row == 1 && p.ldb == p.cols && !p.start && !p.relu;
}

// The input's gradient dx (N, I) = dz W^T for O <= 16 and I a multiple of 16, on AVX-512, without
// a transposed copy of the kernel: each block of 16 inputs' kernel rows is read a masked load a
// row and transposed in registers (260 TSC cycles for the seed CNN's 64 x 10 kernel, hot, against
// 494 element by element into a copy; 2-core Zen 5 EPYC), and passes of R rows of dx run over
// those O vectors. Each sum
// is the product's over the copy: over O in order from zero, one multiply-add each; zero where
// derivative_of (or null) is not above zero, read a vector at a time just before dx's (it may be
// dx's own memory).
template <int O, class TC>
[[gnu::target("avx512f")]] void data_gradient_avx512(const float* __restrict kernel, const float* __restrict dz,
                                                     std::int64_t rows, std::int64_t in, const TC* derivative_of,
                                                     TC* dx) {
  using F = Vec<float, 16>;
  using I = Vec<std::int32_t, 16>;
  constexpr int R = 8;  // 8 sums and O kernel vectors within the 32 registers
  const auto row_mask = static_cast<__mmask16>((1u << O) - 1u);
  for (std::int64_t i0 = 0; i0 < in; i0 += 16) {
    F w[16];
    for (int j = 0; j < 16; ++j) w[j] = reinterpret_cast<F>(_mm512_maskz_loadu_ps(row_mask, kernel + (i0 + j) * O));
    transpose_16x16(w);
    for (std::int64_t n0 = 0; n0 < rows; n0 += R) {
      const float* __restrict a[R];
      for (int r = 0; r < R; ++r) a[r] = dz + std::min(n0 + r, rows - 1) * O;
      F sum[R];
      for (int r = 0; r < R; ++r) sum[r] = F{};
      for (int o = 0; o < O; ++o)
        for (int r = 0; r < R; ++r) sum[r] += a[r][o] * w[o];
      for (int r = 0; r < R && n0 + r < rows; ++r) {
        const std::int64_t at = (n0 + r) * in + i0;
        F v = sum[r];
        if (derivative_of) v = std::bit_cast<F>(I(load_widened<16>(derivative_of + at) > 0.0f) & std::bit_cast<I>(v));
        store_rounded<16>(dx + at, v);
      }
    }
  }
}

template <class TC, int... O>
void data_gradient_avx512(const float* kernel, const float* dz, std::int64_t rows, std::int64_t in, std::int64_t out,
                          const TC* derivative_of, TC* dx, std::integer_sequence<int, O...>) {
  (void)((out == O + 1 ? (data_gradient_avx512<O + 1>(kernel, dz, rows, in, derivative_of, dx), true) : false) || ...);
}

// The input's gradient dx (N, I) = dz W^T for O <= 16 and I a multiple of 8, on AVX2. AVX2's 16
// registers cannot hold the kernel's transposed rows beside enough sums (as data_gradient_avx512
// does), so each block of 16 inputs (or the last 8) is transposed into `w`, a few lines that stay
// in L1, and passes of 4 rows x V vectors of 8 inputs (V = 2: the 8 sums that hide the
// multiply-add's latency on two units) run over O unrolled. The product over a transposed copy of
// the whole kernel (written element by element, O a loop count) took the seed CNN's logits layer's
// input gradient 4,490-5,030 TSC cycles a lane, run a second time at once, against 1,960-2,200
// (2-core Zen 3 EPYC, in the process). Each sum is the product's: over O in order from zero, one
// multiply-add each; zero where derivative_of (or null) is not above zero, read a vector at a time
// just before dx's (it may be dx's own memory).
template <int O, int V, class TC>
[[gnu::target("arch=x86-64-v3")]] inline void data_gradient_pass_avx2(const Vec<float, 8> (&w)[O][2],
                                                                      const float* __restrict dz, std::int64_t rows,
                                                                      std::int64_t in, const TC* derivative_of, TC* dx,
                                                                      std::int64_t n0, std::int64_t i0) {
  using F = Vec<float, 8>;
  using I = Vec<std::int32_t, 8>;
  constexpr int R = 4;
  const float* __restrict a[R];
  for (int r = 0; r < R; ++r) a[r] = dz + std::min(n0 + r, rows - 1) * O;
  F sum[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) sum[r][v] = F{};
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) sum[r][v] += a[r][o] * w[o][v];
  for (int r = 0; r < R && n0 + r < rows; ++r)
    for (int v = 0; v < V; ++v) {
      const std::int64_t at = (n0 + r) * in + i0 + v * 8;
      F s = sum[r][v];
      if (derivative_of) s = std::bit_cast<F>(I(load_widened<8>(derivative_of + at) > 0.0f) & std::bit_cast<I>(s));
      store_rounded<8>(dx + at, s);
    }
}

// w[o][v] lane l = kernel[i0 + 8 v + l][o] for v < V: 8 kernel rows at a time, 8 outputs at a
// time, transposed in registers; a block's outputs past O are read under a mask (the kernel's
// last row ends its memory).
template <int O, int V>
[[gnu::target("arch=x86-64-v3")]] inline void transposed_kernel_block(const float* __restrict kernel, std::int64_t i0,
                                                                      Vec<float, 8> (&w)[O][2]) {
  using F = Vec<float, 8>;
  for (int v = 0; v < V; ++v)
    for (int o0 = 0; o0 < O; o0 += 8) {
      const int n = std::min(8, O - o0);
      const float* row = kernel + (i0 + 8 * v) * O + o0;
      F r[8];
      if (n == 8) {
        for (int j = 0; j < 8; ++j) r[j] = load<F>(row + j * O);
      } else {
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        for (int j = 0; j < 8; ++j) r[j] = reinterpret_cast<F>(_mm256_maskload_ps(row + j * O, mask));
      }
      transpose_8x8(r);
      for (int c = 0; c < n; ++c) w[o0 + c][v] = r[c];
    }
}

template <int O, class TC>
[[gnu::target("arch=x86-64-v3")]] void data_gradient_avx2(const float* kernel, const float* dz, std::int64_t rows,
                                                          std::int64_t in, const TC* derivative_of, TC* dx) {
  Vec<float, 8> w[O][2];
  std::int64_t i0 = 0;
  for (; i0 + 16 <= in; i0 += 16) {
    transposed_kernel_block<O, 2>(kernel, i0, w);
    for (std::int64_t n0 = 0; n0 < rows; n0 += 4) data_gradient_pass_avx2<O, 2>(w, dz, rows, in, derivative_of, dx, n0, i0);
  }
  if (i0 < in) {
    transposed_kernel_block<O, 1>(kernel, i0, w);
    for (std::int64_t n0 = 0; n0 < rows; n0 += 4) data_gradient_pass_avx2<O, 1>(w, dz, rows, in, derivative_of, dx, n0, i0);
  }
}

template <class TC, int... O>
void data_gradient_avx2(const float* kernel, const float* dz, std::int64_t rows, std::int64_t in, std::int64_t out,
                        const TC* derivative_of, TC* dx, std::integer_sequence<int, O...>) {
  (void)((out == O + 1 ? (data_gradient_avx2<O + 1>(kernel, dz, rows, in, derivative_of, dx), true) : false) || ...);
}

// One product, built for the loops' ISA: B's rows past safe_depth copied into `scratch`, then C,
// then (with `column_sums_into`) the column sums of B. Why a type, not a lambda at each call: the
// forward, the weight gradient and the data gradient of a layer then run one function (per pair of
// dtypes), not three copies of it, so the code the forward brought into the caches is the code
// the backward runs. A small layer above large ones is made of cache misses: the seed CNN's logits
// layer's backward took 1.05-1.10 us with its code and data in the caches and 1.5-3.3 us after
// conv2d_1 had swept the L2 (2-core Zen 5 EPYC, float32, 2 lanes; one copy cut its median by a
// fifth to a third, alternating call by call in one process).
template <class TA, class TC>
struct ProductRun {
  Product<TA, TC>* p;
  float* scratch;
  float* column_sums_into;  // or null
  bool kernel_gradient = false;  // a kernel's gradient: on AVX-512 and AVX2 kernel_gradient_transposed where it fits
  template <LoopIsa I>
  void operator()() const {
    tail_rows(*p, float_lanes(I), scratch);
    constexpr int L = float_lanes(I);
    if constexpr (I != LoopIsa::x86_64 && std::is_same_v<TC, float>) {
      if (kernel_gradient && kernel_gradient_fits<L>(*p)) {
        kernel_gradient_transposed<L>(*p, std::make_integer_sequence<int, transposed_outputs(L)>{});
      } else {
        product<float_lanes(I)>(*p);
      }
    } else {
      product<float_lanes(I)>(*p);
    }
    if (column_sums_into) column_sums<float_lanes(I)>(*p, column_sums_into);
  }
};

// Asks for the cache lines of [at, at + bytes) in the state a write wants, all at once: a small
// layer's destinations (last written a step ago, evicted since) then arrive together instead of
// one miss at a time as the loops reach them.
inline void prefetch_for_write(void* at, std::size_t bytes) {
  const char* c = static_cast<const char*>(at);
  for (std::size_t b = 0; b < bytes; b += 64) __builtin_prefetch(c + b, 1, 3);
}

}  // namespace

// In a block of X outputs and 2P inputs (P pairs), the output blocks outer: pairs of inputs, then
// the X outputs, then the pair's two:
//   at[((o / X) * ceil(I / 2P) + i / 2P) * 2P X + (i % 2P / 2) * 2 X + (o % X) * 2 + i % 2] = bf16(K[i][o])
// A pair is one 32-bit word, the even input in its low half: rounded(K[i + 1][o]) | rounded(K[i][o])
// >> 16 (rounded to nearest even as oneDNN's reorder rounds). The padding past O or I is zeros.
// oneDNN's reorder (jit:uni) took 0.075 ms a step for the seed CNN's 1600 -> 64 layer, 20 times
// what the bytes take (2-core Intel Xeon with AMX, P = 16), and 0.029 ms a lane of 32 rows (2-core
// AVX512-BF16 EPYC, Zen 4, P = 8).
DTRAIN_LANE_CLONES void kernel_to_pair_blocks(const float* __restrict kernel, std::int64_t in, std::int64_t out,
                                              std::int64_t pairs, std::int64_t block, std::uint32_t* __restrict at) {
  using F = Vec<float, 16>;
  using U = Vec<std::uint32_t, 16>;
  const std::int64_t inputs = 2 * pairs;  // a block's
  const std::int64_t in_blocks = (in + inputs - 1) / inputs, out_blocks = (out + block - 1) / block;
  const auto row = [&](std::int64_t i, std::int64_t o) {  // K[i][o..o+15], zeros past the ends
    if (i >= in) return F{};
    if (o + 16 <= out) return load<F>(kernel + i * out + o);
    F v{};
    for (std::int64_t l = 0; o + l < out; ++l) v[l] = kernel[i * out + o + l];
    return v;
  };
  for (std::int64_t ob = 0; ob < out_blocks; ++ob)
    for (std::int64_t ib = 0; ib < in_blocks; ++ib) {
      std::uint32_t* words = at + (ob * in_blocks + ib) * pairs * block;
      for (std::int64_t pair = 0; pair < pairs; ++pair) {
        const std::int64_t i = ib * inputs + pair * 2;
        for (std::int64_t o = 0; o < block; o += 16) {
          const U even = std::bit_cast<U>(rounded_to_bf16<16>(row(i, ob * block + o)));
          const U odd = std::bit_cast<U>(rounded_to_bf16<16>(row(i + 1, ob * block + o)));
          store(words + pair * block + o, odd | (even >> 16));
        }
      }
    }
}

bool dense_loops_pay(std::int64_t batch, std::int64_t in, std::int64_t out) {
  return batch * in * out <= kMaxOwnMultiplyAdds;
}

namespace {

class DenseKernel final : public WeightedOpKernel {
 public:
  DenseKernel(nn::Dense& layer, OnednnContext& ctx, DType compute)
      : WeightedOpKernel(ctx, compute, layer.options().activation), layer_(layer), isa_(ctx.loop_isa()) {}

  LayoutPtr plan(std::int64_t batch, const LayoutPtr& src_layout) override {
    const auto& o = layer_.options();
    const std::int64_t in = layer_.input_shape()[0];
    const Shape out{batch, o.units};
    loops_.erase(batch);  // planned anew
    matmuls_.erase(batch);
    if (LayoutPtr own = plan_loops(batch, md_of(src_layout))) return own;
    if (LayoutPtr products = plan_matmuls(batch, md_of(src_layout))) return products;
    auto src = any_md(Shape{batch, in}, compute_);
    auto dst = any_md(out, compute_);
    // The kernel's gradient in the Keras layout of its variable, and in float32 the kernel too:
    // oneDNN's gemm-based inner product reads and writes (in, out) as it is, where its brgemm
    // kernels wanted blocked copies made every step (two reorders of the whole kernel; the seed
    // CNN's dense layer's backward took 1.3-1.8x as long with them, float32 and bf16, AVX512-BF16
    // EPYC). A bf16 kernel is a converted copy anyway: oneDNN picks its layout.
    const auto keras = memory::format_tag::io;
    auto weights = memory::desc({o.units, in}, to_dnnl(compute_), compute_ == DType::f32 ? keras : memory::format_tag::any);
    auto diff_weights = memory::desc({o.units, in}, memory::data_type::f32, keras);
    auto bias = o.use_bias ? memory::desc({o.units}, memory::data_type::f32, memory::format_tag::x) : memory::desc();

    auto fwd_pd = dnnl::inner_product_forward::primitive_desc(
        dnnl::inner_product_forward::desc(dnnl::prop_kind::forward_training, src, weights, bias, dst),
        act_.post_op_attr(), ctx_.engine);
    auto bwd_data_pd = dnnl::inner_product_backward_data::primitive_desc(
        dnnl::inner_product_backward_data::desc(src, weights, dst), ctx_.engine, fwd_pd);
    auto bwd_weights_pd = dnnl::inner_product_backward_weights::primitive_desc(
        dnnl::inner_product_backward_weights::desc(src, diff_weights, bias, dst), ctx_.engine, fwd_pd);
    return keep(batch, out, fwd_pd, bwd_data_pd, bwd_weights_pd);
  }

  void bind(std::int64_t batch, const nn::LayerIO& io) override {
    const auto& o = layer_.options();
    auto vars = layer_.variables();
    relu_below_plans_.erase(batch);
    if (Loops* s = loops(batch)) {
      // Wrapped, and their addresses read every step: the model's input moves between steps.
      s->x = ctx_.wrap(io.src);
      s->y = ctx_.wrap(io.dst);
      s->dy = ctx_.wrap(io.diff_dst);
      if (io.diff_src) s->dx = ctx_.wrap(io.diff_src);
      DTRAIN_CHECK(s->x.get_desc() == s->src_md && s->y.get_desc() == s->dst_md && s->dy.get_desc() == s->dst_md &&
                       (!io.diff_src || s->dx.get_desc() == s->src_md),
                   "dense: memories bound in other layouts than planned");
      s->kernel = vars[nn::Dense::kKernel].value.address<float>();
      s->kernel_grad = vars[nn::Dense::kKernel].grad.address<float>();
      s->bias = o.use_bias ? vars[nn::Dense::kBias].value.address<float>() : nullptr;
      s->bias_grad = o.use_bias ? vars[nn::Dense::kBias].grad.address<float>() : nullptr;
      // The softmax runs as oneDNN's primitive, in place on y, its gradient into scratch.
      if (act_.kind() == config::Activation::softmax) act_.bind(ctx_, s->y, s->dy, s->act);
      return;
    }
    if (relu_below_ && io.diff_src)
      relu_below_fn_.bind(ctx_, ctx_.wrap(io.src), ctx_.wrap(io.diff_src), relu_below_plans_.create(batch));
    if (Matmuls* m = matmuls_.find(batch)) return bind_matmuls(*m, io);
    bind_variables(batch, io, io_md(static_cast<int>(layer_.input_shape()[0]), o.units), vars[nn::Dense::kKernel],
                   o.use_bias ? &vars[nn::Dense::kBias] : nullptr);
    plan_weight_product(batch);
    plan_pair_blocks(batch);
  }

  // A relu's derivative below: the loops zero the input's gradient as they write it; the other
  // paths run the relu's backward on it after them, where the layer below would have run it.
  bool take_input_activation_backward(config::Activation below) override {
    relu_below_ = below == config::Activation::relu;
    return relu_below_;
  }
  bool backward_reads_output() const override {
    return act_.kind() != config::Activation::linear && !activation_backward_elsewhere_;
  }
  // The loops read x whole for the kernel's gradient, then write dx a vector at a time, each over
  // whole vectors of its rows where I is a multiple of the lanes (else a vector past a row's end
  // would write into the next row's x before it is read).
  bool writes_input_gradient_over_input(std::int64_t batch) const override {
    const Loops* s = loops_.find(batch);
    return s && s->in % float_lanes(isa_) == 0;
  }

  void forward(std::int64_t batch, const nn::StepContext& step) override {
    if (Matmuls* m = matmuls_.find(batch)) {
      if (m->padded_ld)
        for (std::int64_t i = 0; i < m->in; ++i)
          std::memcpy(m->padded + i * m->padded_ld, m->kernel + i * m->units, static_cast<std::size_t>(m->units) * sizeof(float));
      m->forward.run(ctx_);
      act_.forward(ctx_, m->act);
      return;
    }
    Loops* s = loops(batch);
    if (!s) {
      if (const PairBlocks* b = pair_blocks_.find(batch))
        kernel_to_pair_blocks(b->kernel, layer_.input_shape()[0], layer_.options().units, b->pairs, b->block, b->at);
      return WeightedOpKernel::forward(batch, step);
    }
    if (s->bf16_src) run_forward<std::uint16_t>(*s);
    else run_forward<float>(*s);
    if (act_.kind() == config::Activation::softmax) act_.forward(ctx_, s->act);
  }

  void backward(std::int64_t batch, const nn::StepContext& step) override {
    Loops* s = loops(batch);
    if (!s) {
      if (Matmuls* m = matmuls_.find(batch)) backward_matmuls(*m, step);
      else WeightedOpKernel::backward(batch, step);
      if (ActivationFn::Plan* relu = relu_below_plans_.find(batch)) relu_below_fn_.backward(ctx_, *relu);
      return;
    }
    // What the backward writes, requested before it starts, where the loops are AVX-512's (the
    // seed CNN's logits layer on the Zen 5 EPYC: the backward's median a tenth lower with it,
    // alternating call by call). Not on AVX2: on the Zen 3 EPYC the 40 requests of that layer's
    // kernel gradient took 360-940 TSC cycles a lane and the loops after them gained nothing (the
    // whole backward 6,200-7,700 cycles without against 6,400-8,600, alternating call by call).
    // dx written over x needs nothing: x was just read.
    if (isa_ == LoopIsa::x86_64_v4) {
      prefetch_for_write(s->kernel_grad, static_cast<std::size_t>(s->in * s->out) * sizeof(float));
      if (!s->transposed.empty()) prefetch_for_write(s->transposed.data(), s->transposed.size() * sizeof(float));
      if (s->dx && s->dx.get_data_handle() != s->x.get_data_handle())
        prefetch_for_write(s->dx.get_data_handle(), s->dx.get_desc().get_size());
    }
    const float* dz = pre_activation_gradient(*s);
    if (s->bf16_src) run_weight_gradients<std::uint16_t>(*s, dz);
    else run_weight_gradients<float>(*s, dz);
    if (step.backward_marks) step.backward_marks->weights_done();  // dtrain bench: weights, then data
    if (!s->dx) return;  // the first layer: nothing below wants the gradient
    if (s->bf16_src) run_data_gradient<std::uint16_t>(*s, dz);
    else run_data_gradient<float>(*s, dz);
  }

 protected:
  bool own_weight_gradients(std::int64_t batch) const override { return weight_products_.find(batch) != nullptr; }

  void weight_gradients(std::int64_t batch, const memory& pre_grad, const nn::StepContext&) override {
    WeightProduct& w = *weight_products_.find(batch);
    w.product.run(ctx_);
    if (w.db)
      bf16_column_sums(static_cast<const std::uint16_t*>(pre_grad.get_data_handle()), batch, layer_.options().units,
                       w.db);
  }

 private:
  // A bfloat16 layer's kernel gradient on AMX (amx_matmul): dW (I, O) = x^T dz, with x (N, I) read
  // transposed, written in the variable's Keras layout. oneDNN 2.6's bfloat16 backward-weights
  // inner product (its gemm, x64:gemm:jit) took 0.10-0.15 ms a lane of 32 rows on the seed CNN's
  // 1600 -> 64 layer, the matmul 0.02 (2-core Intel Xeon with AMX).
  struct WeightProduct {
    BoundPrimitive product;
    std::vector<std::byte> scratchpad;
    float* db = nullptr;  // the bias's gradient, or null
  };

  // Where x and the gradient before the activation are plain row-major bfloat16 (as the
  // primitives read them) and oneDNN runs the matmul on AMX.
  void plan_weight_product(std::int64_t batch) {
    weight_products_.erase(batch);
    if (compute_ != DType::bf16) return;
    WeightedOpPlan& p = plan_of(batch);
    const auto& o = layer_.options();
    const std::int64_t in = layer_.input_shape()[0], units = o.units;
    const auto bf16 = memory::data_type::bf16;
    const memory x = p.fwd.args.at(DNNL_ARG_SRC), dz = p.act.pre_grad;
    if (x.get_desc() != memory::desc({batch, in}, bf16, memory::dims{in, 1}) ||
        dz.get_desc() != memory::desc({batch, units}, bf16, memory::dims{units, 1}))
      return;
    const memory::desc a({in, batch}, bf16, memory::dims{1, in}), b({batch, units}, bf16, memory::dims{units, 1});
    const memory::desc c({in, units}, memory::data_type::f32, memory::dims{units, 1});
    const std::optional<dnnl::matmul::primitive_desc> pd = amx_matmul(ctx_, a, b, c, false);
    if (!pd) return;
    WeightProduct& w = weight_products_.create(batch);
    auto vars = layer_.variables();
    void* scratchpad = aligned_scratchpad(w.scratchpad, pd->scratchpad_desc().get_size());
    w.product = {dnnl::matmul(*pd),
                 {{DNNL_ARG_SRC, ctx_.wrap(a, x.get_data_handle())},
                  {DNNL_ARG_WEIGHTS, ctx_.wrap(b, dz.get_data_handle())},
                  {DNNL_ARG_DST, ctx_.wrap(c, vars[nn::Dense::kKernel].grad.raw())},
                  {DNNL_ARG_SCRATCHPAD, ctx_.wrap(pd->scratchpad_desc(), scratchpad)}}};
    w.db = o.use_bias ? vars[nn::Dense::kBias].grad.address<float>() : nullptr;
  }

  // The bfloat16 weights written by kernel_to_pair_blocks in place of oneDNN's reorder.
  struct PairBlocks {
    const float* kernel = nullptr;  // the variable, Keras (in, out)
    std::int64_t pairs = 0;         // input pairs a block
    std::int64_t block = 0;         // outputs a block
    std::uint32_t* at = nullptr;    // the forward's (and backward data's) weights
  };

  // Where the forward reads its bfloat16 weights as AB<P>b<X>a2b (P 8 or 16 pairs, X 16, 32 or 64).
  void plan_pair_blocks(std::int64_t batch) {
    pair_blocks_.erase(batch);
    if (compute_ != DType::bf16) return;
    WeightedOpPlan& p = plan_of(batch);
    const memory w = p.fwd.args.at(DNNL_ARG_WEIGHTS);
    const memory::dims dims{layer_.options().units, layer_.input_shape()[0]};
    using tag = memory::format_tag;
    struct Blocks {
      tag format;
      std::int64_t pairs, block;
    };
    // AMX picks 16 pairs, AVX512-BF16 8.
    for (const Blocks& b : {Blocks{tag::AB16b64a2b, 16, 64}, {tag::AB16b32a2b, 16, 32}, {tag::AB16b16a2b, 16, 16},
                            {tag::AB8b64a2b, 8, 64}, {tag::AB8b32a2b, 8, 32}, {tag::AB8b16a2b, 8, 16}})
      if (w.get_desc() == memory::desc(dims, memory::data_type::bf16, b.format)) {
        p.weights_in.leave_to_kernel();
        pair_blocks_.create(batch) = {layer_.variables()[nn::Dense::kKernel].value.address<float>(), b.pairs, b.block,
                                      static_cast<std::uint32_t*>(w.get_data_handle())};
        return;
      }
  }

  // One planned batch size that runs the loops, with its scratch (sized in plan: a step allocates
  // nothing).
  struct Loops {
    std::int64_t batch = 0, in = 0, out = 0;
    std::int64_t out_ld = 0, in_ld = 0;  // O and I rounded up to whole vectors
    bool bf16_src = false;
    memory::desc src_md, dst_md;
    std::vector<float> bias_padded;  // (out_ld): the bias, or zeros
    std::vector<float> transposed;   // (O, in_ld): the kernel transposed, for the data gradient (empty: on the
                                     // stack, or none where data_gradient_in_registers)
    std::vector<float> tail;         // the last rows of the kernel or of dz (Product::tail)
    memory x, y, dy, dx;  // dx empty for the first layer
    const float* kernel = nullptr;
    float* kernel_grad = nullptr;
    const float* bias = nullptr;
    float* bias_grad = nullptr;
    ActivationFn::Plan act;
  };

  // The layout of y when this batch runs the loops (recording their plan), null otherwise: f32
  // computation, x plain row-major f32 or bf16, an activation the loops apply or leave to
  // ActivationFn's own primitive, and a product small enough that oneDNN's call overhead dominates.
  LayoutPtr plan_loops(std::int64_t batch, const memory::desc& src_md) {
    const auto& o = layer_.options();
    const std::int64_t in = layer_.input_shape()[0];
    const auto kind = act_.kind();
    if (compute_ != DType::f32 || !dense_loops_pay(batch, in, o.units)) return nullptr;
    if (kind != config::Activation::linear && kind != config::Activation::relu && kind != config::Activation::softmax)
      return nullptr;
    const auto dt = src_md.data_type();
    if (!row_major(src_md, batch, in) || (dt != memory::data_type::f32 && dt != memory::data_type::bf16)) return nullptr;
    const std::int64_t lanes = float_lanes(isa_);
    Loops& s = loops_.create(batch);
    s.batch = batch;
    s.in = in;
    s.out = o.units;
    s.out_ld = (s.out + lanes - 1) / lanes * lanes;
    s.in_ld = (s.in + lanes - 1) / lanes * lanes;
    s.bf16_src = dt == memory::data_type::bf16;
    s.src_md = src_md;
    s.dst_md = memory::desc({batch, o.units}, memory::data_type::f32, memory::format_tag::nc);
    s.bias_padded.assign(static_cast<std::size_t>(s.out_ld), 0.0f);
    if (s.out * s.in_ld > kTransposedOnStack && !data_gradient_in_registers(s) && !data_gradient_in_blocks(s))
      s.transposed.assign(static_cast<std::size_t>(s.out * s.in_ld), 0.0f);
    s.tail.assign(tail_floats(s.out, lanes), 0.0f);
    return make_layout(Shape{batch, o.units}, DType::f32, s.dst_md);
  }

  Loops* loops(std::int64_t batch) { return loops_.find(batch); }

  // Whether `md` is a plain row-major (batch, in) matrix.
  static bool row_major(const memory::desc& md, std::int64_t batch, std::int64_t in) {
    const dnnl_memory_desc_t& d = md.data;
    return d.ndims == 2 && d.format_kind == dnnl_blocked && d.offset0 == 0 && d.format_desc.blocking.inner_nblks == 0 &&
           d.dims[0] == batch && d.dims[1] == in && d.padded_dims[1] == in && d.format_desc.blocking.strides[1] == 1 &&
           d.format_desc.blocking.strides[0] == in;
  }

  // A float32 layer too large for the loops, whose x is plain row-major (a flatten's output, the
  // model's input): three oneDNN matmuls on the memories and variables where they lie, no copies:
  //   forward          y (N, O)  = act(x (N, I) K (I, O) + b)   K: the Keras kernel as it is
  //   weight gradient  dK (I, O) = x^T dz                        x read transposed (strides)
  //   data gradient    dx (N, I) = dz K^T                        K read transposed (strides)
  // and db = the column sums of dz (the gradient before the activation). Why: oneDNN's inner
  // product runs its gemm (x64:gemm:jit) where its matmul has brgemm kernels (AVX-512 and up). The
  // seed CNN's 1600 -> 64 at 32 rows, one thread, AVX512-BF16 EPYC (Zen 4), medians of 600 calls:
  // forward 0.057 ms against 0.063, data gradient 0.068 against 0.105, weight gradient 0.065
  // against 0.072; 1600 -> 128 (bn_dropout's): 0.120 / 0.129, 0.158 / 0.257, 0.142 / 0.140.
  // Where oneDNN's matmul is that same gemm (AVX2: within the noise of the inner product), the
  // inner product stays, except where its forward reads the kernel from a padded copy (below).
  //
  // The padded copy: that gemm (x64:gemm:jit) slows down on a B whose rows lie a multiple of
  // 2 KiB apart, the kernel of a layer of 512, 1024, 1536, ... units (its rows then fall into the
  // same few sets of the L1 and L2). One thread, 32 rows, 2-core Zen 3 EPYC (AVX2), medians of 300
  // calls: 784 -> 512 forward 0.43 ms (60 GFLOP/s) against 0.29 (89) with the kernel's rows
  // 16 floats further apart, 784 -> 1024 1.25 against 0.63, 784 -> 2048 2.43 against 1.28; 784 -> 640
  // and -> 256 ran within 5 % either way. Copying the kernel into the padded rows takes 0.07, 0.18
  // and 0.41 ms, so each forward copies it (the optimizer has updated it since) and still gains.
  // The gradients read the variable as it is: the data gradient ran no faster from the copy.
  struct Matmuls {
    dnnl::matmul::primitive_desc forward_pd, weight_pd, data_pd;
    BoundPrimitive forward, weight_gradient, data_gradient;  // data_gradient unbound for the first layer
    bool has_data_gradient = false;
    std::vector<std::byte> scratchpad;  // the three run one after another: one scratchpad serves them
    // x, and x's memory read transposed: the model's input moves between steps, and x_transposed
    // follows x's address (set_data_handle before each weight gradient).
    memory x, x_transposed;
    ActivationFn::Plan act;
    std::int64_t batch = 0, units = 0;
    float* bias_grad = nullptr;
    // The forward's kernel in rows of padded_ld floats (padded_ld 0: the forward reads the variable).
    std::int64_t in = 0, padded_ld = 0;
    const float* kernel = nullptr;
    std::vector<std::byte> padded_storage;
    float* padded = nullptr;
  };

  // Floats between the padded copy's rows for a kernel of `units` columns on oneDNN's gemm, or 0
  // where its rows do not lie a multiple of 2 KiB apart (the padding a cache line).
  static std::int64_t padded_kernel_ld(std::int64_t units) {
    constexpr std::int64_t kAliasingStride = 2048, kLine = 64;
    return units * std::int64_t{sizeof(float)} % kAliasingStride == 0 ? units + kLine / std::int64_t{sizeof(float)} : 0;
  }

  LayoutPtr plan_matmuls(std::int64_t batch, const memory::desc& src_md) {
    const auto& o = layer_.options();
    const std::int64_t in = layer_.input_shape()[0], units = o.units;
    const auto f32 = memory::data_type::f32;
    if (compute_ != DType::f32 || src_md.data_type() != f32 || !row_major(src_md, batch, in)) return nullptr;
    const memory::desc x({batch, in}, f32, memory::dims{in, 1}), x_transposed({in, batch}, f32, memory::dims{1, in});
    const memory::desc kernel({in, units}, f32, memory::dims{units, 1});
    const memory::desc kernel_transposed({units, in}, f32, memory::dims{1, units});
    const memory::desc rows({batch, units}, f32, memory::dims{units, 1});  // y, dy and dz
    dnnl::primitive_attr activation = act_.post_op_attr(), plain;
    activation.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    plain.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    const auto forward_pd = [&](const memory::desc& weights) {
      const auto forward = o.use_bias ? dnnl::matmul::desc(x, weights, memory::desc({1, units}, f32, memory::dims{units, 1}), rows)
                                      : dnnl::matmul::desc(x, weights, rows);
      return dnnl::matmul::primitive_desc(forward, activation, ctx_.engine);
    };
    Matmuls m;
    // Whether oneDNN picked `kernel` (a part of its implementation's name) for all three.
    const auto all_run_on = [&m](std::string_view kernel) {
      for (const auto* pd : {&m.forward_pd, &m.weight_pd, &m.data_pd})
        if (std::string_view(pd->impl_info_str()).find(kernel) == std::string_view::npos) return false;
      return true;
    };
    try {
      m.forward_pd = forward_pd(kernel);
      m.weight_pd = dnnl::matmul::primitive_desc(dnnl::matmul::desc(x_transposed, rows, kernel), plain, ctx_.engine);
      m.data_pd = dnnl::matmul::primitive_desc(dnnl::matmul::desc(rows, kernel_transposed, x), plain, ctx_.engine);
      if (!all_run_on("brg")) {
        m.padded_ld = padded_kernel_ld(units);
        if (!m.padded_ld) return nullptr;
        m.forward_pd = forward_pd(memory::desc({in, units}, f32, memory::dims{m.padded_ld, 1}));
        // Only as that gemm: a reference matmul would lose what the inner product had.
        if (!all_run_on("gemm")) return nullptr;
      }
    } catch (const dnnl::error&) {
      return nullptr;
    }
    m.batch = batch;
    m.units = units;
    m.in = in;
    matmuls_.create(batch) = std::move(m);
    return make_layout(Shape{batch, units}, DType::f32, rows);
  }

  void bind_matmuls(Matmuls& m, const nn::LayerIO& io) {
    auto vars = layer_.variables();
    m.x = ctx_.wrap(io.src);
    const memory y = ctx_.wrap(io.dst), dy = ctx_.wrap(io.diff_dst);
    DTRAIN_CHECK(m.x.get_desc() == m.forward_pd.src_desc() && y.get_desc() == m.forward_pd.dst_desc() &&
                     dy.get_desc() == m.forward_pd.dst_desc(),
                 "dense: memories bound in other layouts than planned");
    m.x_transposed = ctx_.wrap(m.weight_pd.src_desc(), m.x.get_data_handle());
    act_.bind(ctx_, y, dy, m.act);
    std::size_t scratch = 0;
    for (const auto* pd : {&m.forward_pd, &m.weight_pd, &m.data_pd}) scratch = std::max(scratch, pd->scratchpad_desc().get_size());
    void* scratchpad = aligned_scratchpad(m.scratchpad, scratch);
    const auto with_scratchpad = [&](const dnnl::matmul::primitive_desc& pd, std::unordered_map<int, memory> args) {
      args.emplace(DNNL_ARG_SCRATCHPAD, ctx_.wrap(pd.scratchpad_desc(), scratchpad));
      return BoundPrimitive(dnnl::matmul(pd), std::move(args));
    };
    Variable& kernel = vars[nn::Dense::kKernel];
    m.kernel = kernel.value.address<float>();
    if (m.padded_ld)
      m.padded = static_cast<float*>(aligned_scratchpad(m.padded_storage, m.forward_pd.weights_desc().get_size()));
    std::unordered_map<int, memory> forward{
        {DNNL_ARG_SRC, m.x},
        {DNNL_ARG_WEIGHTS, ctx_.wrap(m.forward_pd.weights_desc(), m.padded_ld ? m.padded : kernel.value.raw())},
        {DNNL_ARG_DST, y}};
    const bool bias = layer_.options().use_bias;
    if (bias) forward.emplace(DNNL_ARG_BIAS, ctx_.wrap(m.forward_pd.bias_desc(), vars[nn::Dense::kBias].value.raw()));
    m.forward = with_scratchpad(m.forward_pd, std::move(forward));
    m.weight_gradient = with_scratchpad(m.weight_pd, {{DNNL_ARG_SRC, m.x_transposed},
                                                      {DNNL_ARG_WEIGHTS, m.act.pre_grad},
                                                      {DNNL_ARG_DST, ctx_.wrap(m.weight_pd.dst_desc(), kernel.grad.raw())}});
    m.has_data_gradient = static_cast<bool>(io.diff_src);
    if (m.has_data_gradient) {
      const memory dx = ctx_.wrap(io.diff_src);
      DTRAIN_CHECK(dx.get_desc() == m.data_pd.dst_desc(), "dense: the input gradient bound in another layout than x");
      m.data_gradient = with_scratchpad(m.data_pd, {{DNNL_ARG_SRC, m.act.pre_grad},
                                                    {DNNL_ARG_WEIGHTS, ctx_.wrap(m.data_pd.weights_desc(), kernel.value.raw())},
                                                    {DNNL_ARG_DST, dx}});
    }
    m.bias_grad = bias ? vars[nn::Dense::kBias].grad.address<float>() : nullptr;
  }

  void backward_matmuls(Matmuls& m, const nn::StepContext& step) {
    if (!activation_backward_elsewhere_) act_.backward(ctx_, m.act);
    m.x_transposed.set_data_handle(m.x.get_data_handle());
    m.weight_gradient.run(ctx_);
    if (m.bias_grad)
      f32_column_sums(static_cast<const float*>(m.act.pre_grad.get_data_handle()), m.batch, m.units, m.bias_grad);
    if (step.backward_marks) step.backward_marks->weights_done();  // dtrain bench: weights, then data
    if (m.has_data_gradient) m.data_gradient.run(ctx_);
  }

  template <class T>
  void run_forward(Loops& s) {
    if (s.bias) std::memcpy(s.bias_padded.data(), s.bias, static_cast<std::size_t>(s.out) * sizeof(float));
    Product<T, float> p{};
    p.a = static_cast<const T*>(s.x.get_data_handle());
    p.a_row = s.in;
    p.a_step = 1;
    p.b = s.kernel;
    p.ldb = s.out;
    p.start = s.bias_padded.data();
    p.c = static_cast<float*>(s.y.get_data_handle());
    p.rows = s.batch;
    p.depth = s.in;
    p.cols = s.out;
    p.relu = act_.kind() == config::Activation::relu;
    run_for(isa_, ProductRun<T, float>{&p, s.tail.data(), nullptr});
  }

  // The gradient before the activation: the relu's derivative applied in place on dy (as oneDNN's
  // eltwise backward does), the softmax's into its scratch.
  const float* pre_activation_gradient(Loops& s) {
    auto* dz = static_cast<float*>(s.dy.get_data_handle());
    if (activation_backward_elsewhere_) return dz;
    if (act_.kind() == config::Activation::relu) {
      const auto* y = static_cast<const float*>(s.y.get_data_handle());
      const std::int64_t size = s.batch * s.out;
      for (std::int64_t e = 0; e < size; ++e) dz[e] = y[e] > 0.0f ? dz[e] : 0.0f;
    } else if (act_.kind() == config::Activation::softmax) {
      act_.backward(ctx_, s.act);
      dz = static_cast<float*>(s.act.pre_grad.get_data_handle());
    }
    return dz;
  }

  // dW = x^T dz (A is x read down its columns), db = the column sums of dz.
  template <class T>
  void run_weight_gradients(Loops& s, const float* dz) {
    Product<T, float> p{};
    p.a = static_cast<const T*>(s.x.get_data_handle());
    p.a_row = 1;
    p.a_step = s.in;
    p.b = dz;
    p.ldb = s.out;
    p.c = s.kernel_grad;
    p.rows = s.in;
    p.depth = s.batch;
    p.cols = s.out;
    run_for(isa_, ProductRun<T, float>{&p, s.tail.data(), s.bias_grad, true});
  }

  // Whether the data gradient is data_gradient_avx512's, with no transposed copy of the kernel.
  bool data_gradient_in_registers(const Loops& s) const {
    return isa_ == LoopIsa::x86_64_v4 && s.out <= 16 && s.in % 16 == 0;
  }
  // Whether it is data_gradient_avx2's, over the kernel transposed a block of inputs at a time.
  bool data_gradient_in_blocks(const Loops& s) const { return isa_ == LoopIsa::x86_64_v3 && s.out <= 16 && s.in % 8 == 0; }

  // dx = dz W^T over W transposed (O, in_ld); dx in x's dtype (bf16 rounded to nearest even).
  // The transposed kernel lies on the stack where it fits (Loops::transposed empty): those lines
  // were written moments ago by the calls before this one, where a buffer of the kernel's own was
  // last written a step ago. The seed CNN's logits layer waited 0.17-0.22 us a lane for its
  // buffer's lines, requested at the backward's start (2-core Zen 5 EPYC).
  template <class T>
  void run_data_gradient(Loops& s, const float* dz) {
    const T* derivative_of = relu_below_ ? static_cast<const T*>(s.x.get_data_handle()) : nullptr;
    if (data_gradient_in_registers(s))
      return data_gradient_avx512(s.kernel, dz, s.batch, s.in, s.out, derivative_of, static_cast<T*>(s.dx.get_data_handle()),
                                  std::make_integer_sequence<int, 16>{});
    if (data_gradient_in_blocks(s))
      return data_gradient_avx2(s.kernel, dz, s.batch, s.in, s.out, derivative_of, static_cast<T*>(s.dx.get_data_handle()),
                                std::make_integer_sequence<int, 16>{});
    alignas(64) float on_stack[kTransposedOnStack];
    float* t = s.transposed.empty() ? on_stack : s.transposed.data();
    for (std::int64_t i = 0; i < s.in; ++i)
      for (std::int64_t o = 0; o < s.out; ++o) t[o * s.in_ld + i] = s.kernel[i * s.out + o];
    if (t == on_stack)  // the padding past I (the heap copy's was zeroed in plan)
      for (std::int64_t o = 0; o < s.out; ++o) std::fill(t + o * s.in_ld + s.in, t + (o + 1) * s.in_ld, 0.0f);
    Product<float, T> p{};
    p.a = dz;
    p.a_row = s.out;
    p.a_step = 1;
    p.b = t;
    p.ldb = s.in_ld;
    p.c = static_cast<T*>(s.dx.get_data_handle());
    p.rows = s.batch;
    p.depth = s.out;
    p.cols = s.in;
    p.derivative_of = derivative_of;
    run_for(isa_, ProductRun<float, T>{&p, s.tail.data(), nullptr});  // tail: none, the rows are whole vectors
  }

  nn::Dense& layer_;
  LoopIsa isa_;              // the build of the loops this kernel runs
  bool relu_below_ = false;  // backward applies the derivative of a relu below (take_input_activation_backward)
  ActivationFn relu_below_fn_{config::Activation::relu};
  nn::PlanCache<ActivationFn::Plan> relu_below_plans_;  // the planned batch sizes that apply it after oneDNN's
  nn::PlanCache<Loops> loops_;  // the planned batch sizes that run the loops
  nn::PlanCache<WeightProduct> weight_products_;  // the planned batch sizes whose kernel gradient is a matmul
  nn::PlanCache<PairBlocks> pair_blocks_;          // the planned batch sizes whose bf16 weights are this file's
  nn::PlanCache<Matmuls> matmuls_;                 // the planned batch sizes that run oneDNN's matmuls
};

std::unique_ptr<nn::LayerKernel> make(nn::Layer& layer, Context& ctx, DType compute) {
  return std::make_unique<DenseKernel>(static_cast<nn::Dense&>(layer), OnednnContext::of(ctx), compute);
}

const nn::KernelRegistration registered(kName, nn::Dense::Options::kind, &make);

}  // namespace

}  // namespace dtrain::backends::onednn
