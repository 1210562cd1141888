// The rates a backend's device reaches: its matrix multiply (the GEMM peak), what `dtrain bench`
// compares the FLOP rate training achieves with, and its memory copy (the copy bandwidth), what it
// compares the layers that only move memory with. Each backend registers how it measures them (a
// matmul in the compute dtype of the precision policy; a copy of buffers larger than the caches),
// in its own folder, as it registers its context.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "device/context.hpp"
#include "core/tensor.hpp"

namespace dtrain::device {

struct GemmPeak {
  // False when the device cannot multiply in the dtype asked for (why_not says why, for the user).
  bool available = false;
  std::string why_not;
  double gflops = 0.0;    // the best rate of the sizes tried, 2 m n k FLOPs per multiply
  std::int64_t size = 0;  // the m = n = k that reached it
  std::string what;       // "oneDNN matmul f32 x f32 -> f32"
};

// Measures on `ctx`'s device with `threads` compute threads, for a fraction of a second: a sweep
// of sizes, the best kept, where `size` is 0; that size alone otherwise (what `dtrain bench`
// measures again between its rounds of steps). Called only for a dtype the device computes in
// (Context::cannot_compute_in).
using GemmPeakProbe = GemmPeak (*)(Context& ctx, DType dtype, int threads, std::int64_t size);
// Called by a backend's folder before main.
void register_gemm_peak(std::string_view backend, GemmPeakProbe probe);
// The peak of `ctx`'s backend; not available (saying so) when it registered no probe.
GemmPeak measure_gemm_peak(Context& ctx, DType dtype, int threads, std::int64_t size = 0);

struct GemmPeakRegistration {
  GemmPeakRegistration(std::string_view backend, GemmPeakProbe probe) { register_gemm_peak(backend, probe); }
};

struct CopyBandwidth {
  bool available = false;
  std::string why_not;         // when not available, for the user
  double gb_per_s = 0.0;       // bytes read plus bytes written per second, 1e9 bytes a GB
  std::int64_t bytes = 0;      // the size of the buffer copied
  std::string what;            // "memcpy of 256 MiB, 2 threads"
};

// Measures on `ctx`'s device with `threads` threads, for a fraction of a second.
using CopyBandwidthProbe = CopyBandwidth (*)(Context& ctx, int threads);
void register_copy_bandwidth(std::string_view backend, CopyBandwidthProbe probe);
// The bandwidth of `ctx`'s backend; not available (saying so) when it registered no probe.
CopyBandwidth measure_copy_bandwidth(Context& ctx, int threads);

struct CopyBandwidthRegistration {
  CopyBandwidthRegistration(std::string_view backend, CopyBandwidthProbe probe) {
    register_copy_bandwidth(backend, probe);
  }
};

}  // namespace dtrain::device
