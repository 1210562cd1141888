// Counter-based random numbers (Philox4x32-10, Salmon et al. 2011).
//
// Reproducibility contract: every random draw in dtrain comes from a named *stream*, and a
// stream is fully determined by (experiment seed, stream id, index). Nothing depends on thread
// timing or on how many draws another stream made, so the same seed reproduces a run, and an
// iterator can be restored from (seed, epoch, step) alone.
//
// Streams in use (see also docs/experiment.md, "Reproducibility"):
//   RngStream::init        index = layer position in the model    weight initializers
//   RngStream::shuffle     index = epoch (0-based)                 the per-epoch shuffle order
//   RngStream::synthetic   index = sample id                       synthetic data source
//   RngStream::dropout     (global step, sample id, layer position) dropout masks, see sample_bits()
//   RngStream::test        index = anything                        tests only
#pragma once

#include <array>
#include <cstdint>

namespace dtrain {

enum class RngStream : std::uint32_t { init = 1, shuffle = 2, split = 3, synthetic = 4, dropout = 5, test = 99 };

// Random bits for one sample of one step, at random access: block `block` (four 32-bit words) of
// the stream keyed by (seed, stream, step, sample, layer). The same key gives the same bits
// whichever replica, rank or thread asks, so per-sample masks do not depend on the replica layout.
// Distinct while step and sample are below 2^32 and layer below 2^24 (beyond, the high bits are
// folded into the key).
std::array<std::uint32_t, 4> sample_bits(std::uint64_t seed, RngStream stream, std::uint64_t step,
                                         std::uint64_t sample, std::uint32_t layer, std::uint32_t block);

// What sample_bits() hands Philox4x32-10 for block 0 (the block number is counter[0]), and the
// generator's constants: for a backend that draws many blocks at once in vector registers and must
// give sample_bits()'s bits (the CPU dropout kernel).
struct PhiloxInput {
  std::array<std::uint32_t, 4> counter;
  std::array<std::uint32_t, 2> key;
};
PhiloxInput sample_philox_input(std::uint64_t seed, RngStream stream, std::uint64_t step, std::uint64_t sample,
                                std::uint32_t layer);
inline constexpr std::uint32_t kPhiloxMul0 = 0xD2511F53u, kPhiloxMul1 = 0xCD9E8D57u;
inline constexpr std::uint32_t kPhiloxWeyl0 = 0x9E3779B9u, kPhiloxWeyl1 = 0xBB67AE85u;
inline constexpr int kPhiloxRounds = 10;

class Rng {
 public:
  Rng(std::uint64_t seed, RngStream stream, std::uint64_t index = 0);

  std::uint32_t next_u32();
  std::uint64_t next_u64();
  // Uniform in [0, 1) with 24 random bits.
  float uniform();
  // Uniform in [lo, hi).
  float uniform(float lo, float hi) { return lo + (hi - lo) * uniform(); }
  // Uniform integer in [0, n), unbiased (Lemire's multiply-and-reject).
  std::uint64_t below(std::uint64_t n);
  // Standard normal (Box-Muller).
  float normal();

 private:
  void refill();
  std::array<std::uint32_t, 2> key_;
  std::array<std::uint32_t, 4> counter_;
  std::array<std::uint32_t, 4> block_{};
  int used_ = 4;
};

}  // namespace dtrain
