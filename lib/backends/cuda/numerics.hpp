// The GPU backend's loops for the losses, metrics, optimizers and regularizers: kernels on the
// context's stream whose arithmetic is backends/cuda/math.hpp (shared with the host, tested on
// every CPU build against the CPU backend's numerics).
//
// Results the caller reads (per-example losses, argmax, match counts, a sum of squares) land in
// host memory: each such call copies them back once and waits for its stream. The device-side
// staging for them is one scratch buffer that grows to the largest request and is then reused,
// so a training step allocates nothing after its first.
#pragma once

#include <cstddef>

#include "device/context.hpp"
#include "device/numerics.hpp"

namespace dtrain::backends::cuda {

class CudaContext;

class CudaNumerics final : public device::Numerics {
 public:
  explicit CudaNumerics(CudaContext& ctx) : ctx_(ctx) {}

  void sgd_update(const device::SgdStep& step, float* w, const float* g, float* momentum, std::size_t n) override;
  void adam_update(const device::AdamStep& step, float* w, const float* g, float* m, float* v,
                   std::size_t n) override;
  void rmsprop_update(const device::RmspropStep& step, float* w, const float* g, float* velocity, float* momentum,
                      float* average, std::size_t n) override;
  void loss(const device::LossBatch& batch) override;
  void argmax_rows(const float* values, std::int64_t rows, std::int64_t columns, std::int32_t* out) override;
  void row_matches(const float* pred, const void* targets, bool targets_are_i32, std::int64_t rows,
                   std::int64_t columns, const float* threshold, std::int64_t* matches) override;
  void to_host(const void* src, void* host, std::size_t bytes) override;
  double sum_of_squares(const float* x, std::size_t n) override;
  void axpy(float a, const float* x, float* y, std::size_t n) override;
  void axpby(float a, const float* x, float b, float* y, std::size_t n) override;

 private:
  // At least `bytes` of device memory, valid until the next call.
  void* scratch(std::size_t bytes);
  // Copies `bytes` from the scratch to host memory and waits for the stream.
  void read_back(void* host, std::size_t bytes);

  CudaContext& ctx_;
  device::Buffer scratch_;
  std::size_t scratch_bytes_ = 0;
};

}  // namespace dtrain::backends::cuda
