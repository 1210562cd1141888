// The GPU backend's loops for the losses, metrics, optimizers and regularizers: kernels on the
// context's stream whose arithmetic is backends/cuda/math.hpp (shared with the host, tested on
// every CPU build against the CPU backend's numerics).
//
// Results the caller reads (per-example losses, argmax, match counts, a sum of squares) land in
// host memory: each such call copies them back once and waits for its stream, unless it is asked
// to defer them (a training step's per-example losses and label hits): then the copy goes to a
// pinned buffer, queued on the stream behind the kernel, and complete_reads() waits for the last
// such copy (not for the work queued after it: the step's backward pass and update go on) and
// hands the values over. The device-side staging is one scratch buffer that grows to the largest
// request and is then reused, so a training step allocates nothing after its first.
#pragma once

#include <cstddef>
#include <vector>

#include <cuda_runtime_api.h>

#include "device/context.hpp"
#include "device/numerics.hpp"

namespace dtrain::backends::cuda {

class CudaContext;

class CudaNumerics final : public device::Numerics {
 public:
  explicit CudaNumerics(CudaContext& ctx) : ctx_(ctx) {}
  ~CudaNumerics() override;
  CudaNumerics(const CudaNumerics&) = delete;
  CudaNumerics& operator=(const CudaNumerics&) = delete;

  void sgd_update(const device::SgdStep& step, float* w, const float* g, float* momentum, std::size_t n) override;
  void adam_update(const device::AdamStep& step, float* w, const float* g, float* m, float* v,
                   std::size_t n) override;
  void adam_update_all(const device::AdamStep& step, std::span<const device::AdamVariable> variables) override;
  void rmsprop_update(const device::RmspropStep& step, float* w, const float* g, float* velocity, float* momentum,
                      float* average, std::size_t n) override;
  void loss(const device::LossBatch& batch) override;
  void argmax_rows(const float* values, std::int64_t rows, std::int64_t columns, std::int32_t* out) override;
  void row_matches(const float* pred, const void* targets, bool targets_are_i32, std::int64_t rows,
                   std::int64_t columns, const float* threshold, std::int64_t* matches) override;
  void label_hits(const float* pred, const std::int32_t* labels, std::int64_t rows, std::int64_t columns,
                  std::int32_t* hits, bool deferred) override;
  void to_host(const void* src, void* host, std::size_t bytes) override;
  void complete_reads() override;
  double sum_of_squares(const float* x, std::size_t n) override;
  void axpy(float a, const float* x, float* y, std::size_t n) override;
  void axpby(float a, const float* x, float b, float* y, std::size_t n) override;

 private:
  // At least `bytes` of device memory, valid until the next call.
  void* scratch(std::size_t bytes);
  // Copies `bytes` from the scratch to host memory and waits for the stream.
  void read_back(void* host, std::size_t bytes);

  // Copies `bytes` from the start of the scratch to host memory: now (waiting for the stream), or
  // by complete_reads() when `deferred`.
  void read_scratch(void* host, std::size_t bytes, bool deferred);

  // A deferred result: `bytes` at `offset` of the pinned buffer, for `host`.
  struct PendingRead {
    std::size_t offset = 0, bytes = 0;
    void* host = nullptr;
  };

  CudaContext& ctx_;
  device::Buffer scratch_;
  std::size_t scratch_bytes_ = 0;
  void* pinned_ = nullptr;  // the deferred results' landing place, grown as needed
  std::size_t pinned_bytes_ = 0, pinned_used_ = 0;
  std::vector<PendingRead> pending_;
  cudaEvent_t reads_queued_ = nullptr;  // recorded after the latest deferred copy
};

}  // namespace dtrain::backends::cuda
