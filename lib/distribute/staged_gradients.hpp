// One replica's gradient arena (nn::Sequential::gradient_arena, memory of the replica's context)
// as the host-memory collectives see it. Where the host may read the context's memory in place
// (the CPU backend), host() is the arena itself and the copies do nothing: the sums happen where
// backward wrote. Elsewhere (a GPU, the CPU backend's checked mode) host() is a host buffer the
// strategy fills with to_host() before a sum and hands back with from_host() after it: the
// staging that a collective over host memory needs. A communicator that sums device memory
// itself (NCCL) takes arena() instead.
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "core/tensor.hpp"
#include "device/context.hpp"

namespace dtrain::distribute {

class StagedGradients {
 public:
  StagedGradients() = default;
  StagedGradients(device::Context& ctx, Tensor arena);

  bool bound() const { return ctx_ != nullptr; }
  // Whether host() is the arena itself (no staging copies).
  bool in_place() const { return in_place_; }
  std::span<float> host() { return host_; }
  Tensor& arena() { return arena_; }
  device::Context& context() const { return *ctx_; }

  // Floats [first, first + count) of the arena into host(), and back.
  void to_host(std::size_t first, std::size_t count);
  void from_host(std::size_t first, std::size_t count);
  void to_host() { to_host(0, host_.size()); }
  void from_host() { from_host(0, host_.size()); }

 private:
  device::Context* ctx_ = nullptr;
  Tensor arena_;
  std::vector<float> staging_;
  std::span<float> host_;
  bool in_place_ = true;
};

}  // namespace dtrain::distribute
