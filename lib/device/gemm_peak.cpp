#include "device/gemm_peak.hpp"

#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/error.hpp"

namespace dtrain::device {

namespace {

// Filled by the backends' registrations before main, read-only afterwards.
std::vector<std::pair<std::string_view, GemmPeakProbe>>& probes() {
  static std::vector<std::pair<std::string_view, GemmPeakProbe>> registered;
  return registered;
}
std::vector<std::pair<std::string_view, CopyBandwidthProbe>>& bandwidth_probes() {
  static std::vector<std::pair<std::string_view, CopyBandwidthProbe>> registered;
  return registered;
}

}  // namespace

void register_gemm_peak(std::string_view backend, GemmPeakProbe probe) {
  for (const auto& [name, _] : probes())
    DTRAIN_CHECK(name != backend, fmt::format("two GEMM peak probes registered for the {} backend", backend));
  probes().emplace_back(backend, probe);
}

GemmPeak measure_gemm_peak(Context& ctx, DType dtype, int threads, std::int64_t size) {
  GemmPeak none;
  // A CPU without bfloat16 instructions has no bf16 peak, as it has no bf16 training.
  none.why_not = ctx.cannot_compute_in(dtype);
  if (!none.why_not.empty()) return none;
  for (const auto& [name, probe] : probes())
    if (name == ctx.backend()) return probe(ctx, dtype, threads, size);
  none.why_not = fmt::format("the {} backend cannot measure its GEMM peak", ctx.backend());
  return none;
}

void register_copy_bandwidth(std::string_view backend, CopyBandwidthProbe probe) {
  for (const auto& [name, _] : bandwidth_probes())
    DTRAIN_CHECK(name != backend, fmt::format("two copy bandwidth probes registered for the {} backend", backend));
  bandwidth_probes().emplace_back(backend, probe);
}

CopyBandwidth measure_copy_bandwidth(Context& ctx, int threads) {
  for (const auto& [name, probe] : bandwidth_probes())
    if (name == ctx.backend()) return probe(ctx, threads);
  CopyBandwidth none;
  none.why_not = fmt::format("the {} backend cannot measure its copy bandwidth", ctx.backend());
  return none;
}

}  // namespace dtrain::device
