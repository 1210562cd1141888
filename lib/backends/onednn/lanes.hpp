// What the CPU backend's own loops share (max pooling, the small-input convolution's weight
// gradients): how a oneDNN memory lays out its channels, and vectors of L channel lanes.
//
// The loops are written with GCC's vector extensions, so each step is one vector operation on
// every target they are built for (plain scalar loops with a select did not vectorize), and
// compiled for AVX-512, AVX2 and plain x86-64. Files using them are built with -Wno-psabi: the
// vector values cross only inline helpers of one file, never an ABI boundary.
//
// Two ways to pick the build: target_clones (the loader picks the version this CPU runs, as in
// numerics.cpp), or run_for (below: the kernel picks, by its context's loop_isa(), so a test can
// run every build on one machine, and the lane count follows the build's registers).
#pragma once

#include <bit>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <utility>

#include <immintrin.h>
#include <omp.h>

#include <oneapi/dnnl/dnnl.hpp>

#include "backends/onednn/context.hpp"

namespace dtrain::backends::onednn {

// The x86-64 levels: v4 has AVX-512 (F, BW, DQ, VL), v3 AVX2 with FMA; GCC's resolver picks by
// the CPU's features, whoever made it. ThreadSanitizer instruments the clones' resolver, which the
// loader runs before the TSan runtime exists, so a TSan build keeps the one default version.
#if defined(__SANITIZE_THREAD__)
#define DTRAIN_LANE_CLONES
#else
#define DTRAIN_LANE_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
// A loop of 16 lanes, or with AVX-512 intrinsics, runs only where the loops run as x86-64-v4: built
// for that level alone, as [[DTRAIN_X86_64_V4]]. target_clones would also build plain x86-64 and
// AVX2 versions of it that never run (the 16-lane weight loops' took 3.5 MB of an 11.7 MB binary).
#define DTRAIN_X86_64_V4 gnu::target("arch=x86-64-v4")

// Floats in one vector register of each level: what a loop built for it takes per step. A loop with
// wider GCC vectors than its target's registers is not split into register-wide halves where it
// compares or converts: GCC 12 computes those lane by lane (a max pooling backward with 16 lanes
// on AVX2, or with any byte-to-float conversion, ran 4-10 times slower than with native lanes).
constexpr int float_lanes(LoopIsa isa) {
  return isa == LoopIsa::x86_64_v4 ? 16 : isa == LoopIsa::x86_64_v3 ? 8 : 4;
}

// fn(item) for item in [0, count), shared by the calling thread's OpenMP team (static schedule:
// items must not depend on which thread runs them), or a plain loop where that team has one
// thread, as each lane's does (train/lanes.cpp): entering a parallel region costs about 0.5 us
// even for one thread (2-core AVX2 EPYC), a tenth of a layer of a few microseconds, paid once per
// pass. Not inside target_clones functions: the lambda would not be built for their target.
template <class Fn>
void for_each_item(std::int64_t count, const Fn& fn) {
  if (count <= 1 || omp_get_max_threads() == 1) {
    for (std::int64_t item = 0; item < count; ++item) fn(item);
    return;
  }
#pragma omp parallel for schedule(static)
  for (std::int64_t item = 0; item < count; ++item) fn(item);
}

// run_for(isa, loop) calls loop.template operator()<isa>() inside a function built for `isa` that
// inlines everything it calls (flatten), so the loop's vector code is generated for that level.
// Nothing is inlined out of these functions into code built for a narrower level.
template <class Loop>
[[gnu::target("arch=x86-64-v4"), gnu::flatten]] void run_on_x86_64_v4(const Loop& loop) {
  loop.template operator()<LoopIsa::x86_64_v4>();
}
template <class Loop>
[[gnu::target("arch=x86-64-v3"), gnu::flatten]] void run_on_x86_64_v3(const Loop& loop) {
  loop.template operator()<LoopIsa::x86_64_v3>();
}
template <class Loop>
[[gnu::flatten]] void run_on_x86_64(const Loop& loop) {
  loop.template operator()<LoopIsa::x86_64>();
}
template <class Loop>
void run_for(LoopIsa isa, const Loop& loop) {
  switch (isa) {
    case LoopIsa::x86_64_v4: return run_on_x86_64_v4(loop);
    case LoopIsa::x86_64_v3: return run_on_x86_64_v3(loop);
    case LoopIsa::x86_64: return run_on_x86_64(loop);
  }
}

// body.template operator()<L>() built for `isa`, with L the widest of 16, 8, 4, 1 lanes that fits
// the level's registers (float_lanes) and divides a group's channel `lanes`.
template <class Body>
void run_with_lanes(LoopIsa isa, std::int64_t lanes, const Body& body) {
  run_for(isa, [&]<LoopIsa I>() {
    constexpr int widest = float_lanes(I);
    if constexpr (widest >= 16)
      if (lanes % 16 == 0) return body.template operator()<16>();
    if constexpr (widest >= 8)
      if (lanes % 8 == 0) return body.template operator()<8>();
    if (lanes % 4 == 0) return body.template operator()<4>();
    body.template operator()<1>();
  });
}

// Where element (n, c, h, w) lives: n * n + (c / lanes) * group + h * row + w * col + c % lanes.
// With nhwc the channels form one group of `lanes` = C.
struct Arrangement {
  std::int64_t lanes = 0, groups = 0;  // channel lanes per group (padded), groups
  std::int64_t n = 0, group = 0, row = 0, col = 0;
  // Channel c's offset from its sample's first element at a position.
  std::int64_t channel(std::int64_t c) const { return c / lanes * group + c % lanes; }
};

// The arrangement of a 4-D (N, C, H, W) `md` when its channels are innermost (nhwc, or one channel
// block of 4, 8 or 16); nothing otherwise.
inline std::optional<Arrangement> arrangement_of(const dnnl::memory::desc& md) {
  const dnnl_memory_desc_t& d = md.data;
  if (d.ndims != 4 || d.format_kind != dnnl_blocked || d.offset0 != 0) return std::nullopt;
  const auto& b = d.format_desc.blocking;
  Arrangement a;
  if (b.inner_nblks == 0 && b.strides[1] == 1) {
    a.lanes = d.padded_dims[1];
    a.groups = 1;
  } else if (b.inner_nblks == 1 && b.inner_idxs[0] == 1 &&
             (b.inner_blks[0] == 4 || b.inner_blks[0] == 8 || b.inner_blks[0] == 16)) {
    a.lanes = b.inner_blks[0];
    a.groups = d.padded_dims[1] / a.lanes;
  } else {
    return std::nullopt;
  }
  a.n = b.strides[0];
  a.group = b.strides[1];
  a.row = b.strides[2];
  a.col = b.strides[3];
  // Every lane of a position must sit between it and the next column (no other interleaving).
  if (a.col < a.lanes || (a.groups > 1 && a.group < a.lanes)) return std::nullopt;
  return a;
}

// The descriptor of `dims` arranged as `like` is (the same channel blocking).
inline dnnl::memory::desc arranged_like(const Arrangement& like, const dnnl::memory::dims& dims,
                                        dnnl::memory::data_type dt) {
  using tag = dnnl::memory::format_tag;
  if (like.groups == 1 && like.group <= 1) return dnnl::memory::desc(dims, dt, tag::nhwc);
  switch (like.lanes) {
    case 4: return dnnl::memory::desc(dims, dt, tag::nChw4c);
    case 8: return dnnl::memory::desc(dims, dt, tag::nChw8c);
    default: return dnnl::memory::desc(dims, dt, tag::nChw16c);
  }
}

// bfloat16 is the high half of a float: widening is exact, and so is narrowing a value that came
// from bfloat16.
inline float widen(float v) { return v; }
inline float widen(std::uint16_t v) { return std::bit_cast<float>(static_cast<std::uint32_t>(v) << 16); }
template <class T>
inline T narrow(float v);
template <>
inline float narrow<float>(float v) {
  return v;
}
template <>
inline std::uint16_t narrow<std::uint16_t>(float v) {
  return static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(v) >> 16);
}

// L lanes of E.
template <class E, int L>
struct VectorOf {
  typedef E type __attribute__((vector_size(sizeof(E) * L)));
};
template <class E, int L>
using Vec = typename VectorOf<E, L>::type;

// V as it lies in memory of E: aligned as E and aliasing it. Loads and stores through it are one
// unaligned vector move each. (With memcpy, GCC 12 sent a block of sums held in registers through
// the stack and copied them out 16 bytes at a time: a fifth of a fused convolution's time.)
template <class V, class E>
struct InMemory {
  typedef V type __attribute__((aligned(alignof(E)), may_alias));
};

template <class V, class E>
inline V load(const E* p) {
  return *reinterpret_cast<const typename InMemory<V, E>::type*>(p);
}
template <class V, class E>
inline void store(E* p, const V& v) {
  *reinterpret_cast<typename InMemory<V, E>::type*>(p) = v;
}

// load(p) where the caller then keeps some lanes and zeroes the rest (a relu's derivative, a max
// pooling's winner): the whole vector, every lane of which must be readable, in a plain load. Left
// to itself GCC folds the load and the mask into one AVX-512 load under a mask (vmovups (p),
// zmm{k}{z}), which must wait for the mask before it reads memory; on the 2-core Zen 5 EPYC the
// sums pass of bn_dropout's first batch normalization took 489-496 thousand TSC cycles a lane that
// way and 356-365 with the plain load (alternating step by step in one process), and its dx pass
// sped up alike. A volatile read is one GCC must make as written, every byte, so the mask stays a
// separate AND; and it is a read like any other for the core.
template <class V, class E>
[[gnu::always_inline]] inline V load_whole(const E* p) {
  return *reinterpret_cast<const volatile typename InMemory<V, E>::type*>(p);
}

// f32 lanes from f32 or bf16 memory, and back.
template <int L>
inline Vec<float, L> load_widened(const float* p) {
  return load<Vec<float, L>>(p);
}
template <int L>
inline Vec<float, L> load_widened(const std::uint16_t* p) {
  const auto bits = __builtin_convertvector(load<Vec<std::uint16_t, L>>(p), Vec<std::uint32_t, L>) << 16;
  return std::bit_cast<Vec<float, L>>(bits);
}
template <int L>
inline void store_narrowed(float* p, const Vec<float, L>& v) {
  store(p, v);
}
template <int L>
inline void store_narrowed(std::uint16_t* p, const Vec<float, L>& v) {
  store(p, __builtin_convertvector(std::bit_cast<Vec<std::uint32_t, L>>(v) >> 16, Vec<std::uint16_t, L>));
}

// f32 lanes into f32 or bf16 memory, a computed value rounded to bfloat16's nearest even, as
// oneDNN's conversions round (store_narrowed truncates: right only for values that came from
// bfloat16); a NaN stays a NaN.
template <int L>
inline void store_rounded(float* p, const Vec<float, L>& v) {
  store(p, v);
}
// v rounded to bfloat16 as store_rounded rounds it, kept as f32 lanes (the low 16 bits zero): the
// value a bfloat16 store then a load would give.
template <int L>
inline Vec<float, L> rounded_to_bf16(const Vec<float, L>& v) {
  using U = Vec<std::uint32_t, L>;
  const U bits = std::bit_cast<U>(v);
  const U nan = std::bit_cast<U>(v != v);
  const U rounded = ((bits + 0x7FFFu + ((bits >> 16) & 1u)) & ~nan) | ((bits | 0x00400000u) & nan);
  return std::bit_cast<Vec<float, L>>(rounded & 0xFFFF0000u);
}
template <int L>
inline void store_rounded(std::uint16_t* p, const Vec<float, L>& v) {
  store_narrowed<L>(p, rounded_to_bf16<L>(v));
}

// v's lanes converted one by one into a vector of To: written so, GCC 12 widens a vector in one
// instruction (vpmovsxbd, vpmovzxwd, vcvtps2pd) where its __builtin_convertvector widens it in
// steps of half a register, or of twice the width, and inserts the halves (bytes to 32-bit lanes:
// 9 instructions on AVX2 against 1, 24 against 14 on plain x86-64; 4 floats to doubles: 3 against 1).
template <class To, class V>
[[gnu::always_inline]] inline auto lanes_as(const V& v) {
  constexpr int L = static_cast<int>(sizeof(V) / sizeof(v[0]));
  return [&]<std::size_t... l>(std::index_sequence<l...>) {
    return Vec<To, L>{static_cast<To>(v[l])...};
  }(std::make_index_sequence<L>{});
}

// A byte mask (each lane 0 or -1, as a comparison of bytes gives) as lanes of B (16 or 32 bits).
template <class B, int L>
inline B widen_mask(const Vec<std::int8_t, L>& m) {
  return lanes_as<std::remove_cvref_t<decltype(B{}[0])>>(m);
}
// Bytes (0..255) as 32-bit lanes.
template <int L>
inline Vec<std::int32_t, L> widen_bytes(const Vec<std::uint8_t, L>& v) {
  return lanes_as<std::int32_t>(v);
}
// L bytes from memory (0..255) as 32-bit lanes: one vpmovzxbd from memory on AVX2 and AVX-512.
template <int L>
inline Vec<std::int32_t, L> load_bytes_widened(const std::uint8_t* p) {
  return widen_bytes<L>(load<Vec<std::uint8_t, L>>(p));
}
// Lanes holding 0..255, as bytes, in two steps through 16 bits (GCC 12 makes each narrowing by
// half one pack; lanes_as took AVX2 21 instructions against 18). 16 lanes run only in the AVX-512
// build, which truncates them in one instruction (vpmovdb; its 2-step form took 4), so they
// convert at once.
template <int L>
inline Vec<std::uint8_t, L> narrow_to_bytes(const Vec<std::int32_t, L>& v) {
  if constexpr (L == 16) return __builtin_convertvector(v, Vec<std::uint8_t, L>);
  return __builtin_convertvector(__builtin_convertvector(v, Vec<std::int16_t, L>), Vec<std::uint8_t, L>);
}

// Each 64-bit lane's low 32 bits of a times those of b, the whole 64-bit product (vpmuludq): 2
// lanes in the plain x86-64 build, 4 in AVX2's, 8 in AVX-512's. Written as a * b, GCC 12 multiplies
// 64-bit lanes as 64 x 64 bits without AVX-512DQ (three vpmuludq, shifts and adds; by a constant,
// a chain of shifts and adds), even where the high halves are masked to zero: dropout's Philox
// rounds ran at a fifth of their speed. The wider builds' helpers carry their ISA: a loop reaches
// them inlined into the function built for that ISA (run_for's flatten), never elsewhere.
[[gnu::target("avx2")]] inline Vec<std::uint64_t, 4> mul_low32_avx2(const Vec<std::uint64_t, 4>& a,
                                                                   const Vec<std::uint64_t, 4>& b) {
  return reinterpret_cast<Vec<std::uint64_t, 4>>(
      _mm256_mul_epu32(reinterpret_cast<__m256i>(a), reinterpret_cast<__m256i>(b)));
}
[[gnu::target("avx512f")]] inline Vec<std::uint64_t, 8> mul_low32_avx512(const Vec<std::uint64_t, 8>& a,
                                                                        const Vec<std::uint64_t, 8>& b) {
  // The zero-masked form with every lane kept: GCC 12's _mm512_mul_epu32 passes an undefined
  // vector through, which -Wmaybe-uninitialized reports (fixed in GCC 13); the same vpmuludq.
  return reinterpret_cast<Vec<std::uint64_t, 8>>(
      _mm512_maskz_mul_epu32(0xFF, reinterpret_cast<__m512i>(a), reinterpret_cast<__m512i>(b)));
}
template <int N>
inline Vec<std::uint64_t, N> mul_low32(const Vec<std::uint64_t, N>& a, const Vec<std::uint64_t, N>& b) {
  static_assert(N == 2 || N == 4 || N == 8, "2, 4 or 8 lanes of 64 bits");
  if constexpr (N == 2) {
    return reinterpret_cast<Vec<std::uint64_t, 2>>(
        _mm_mul_epu32(reinterpret_cast<__m128i>(a), reinterpret_cast<__m128i>(b)));
  } else if constexpr (N == 4) {
    return mul_low32_avx2(a, b);
  } else {
    return mul_low32_avx512(a, b);
  }
}

}  // namespace dtrain::backends::onednn
