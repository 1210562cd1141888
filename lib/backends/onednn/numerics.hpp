// The CPU backend's loops for the losses, metrics, optimizers and regularizers: plain C++ the
// compiler vectorizes, one pass per variable, no allocation.
#pragma once

#include "device/numerics.hpp"

namespace dtrain::backends::onednn {

using device::AdamStep;
using device::LossBatch;
using device::RmspropStep;
using device::SgdStep;
using device::Numerics;

class CpuNumerics final : public Numerics {
 public:
  void sgd_update(const SgdStep& step, float* w, const float* g, float* momentum, std::size_t n) override;
  void adam_update(const AdamStep& step, float* w, const float* g, float* m, float* v, std::size_t n) override;
  void rmsprop_update(const RmspropStep& step, float* w, const float* g, float* velocity, float* momentum,
                      float* average, std::size_t n) override;
  void loss(const LossBatch& batch) override;
  void argmax_rows(const float* values, std::int64_t rows, std::int64_t columns, std::int32_t* out) override;
  void row_matches(const float* pred, const void* targets, bool targets_are_i32, std::int64_t rows,
                   std::int64_t columns, const float* threshold, std::int64_t* matches) override;
  void to_host(const void* src, void* host, std::size_t bytes) override;
  double sum_of_squares(const float* x, std::size_t n) override;
  void axpy(float a, const float* x, float* y, std::size_t n) override;
  void axpby(float a, const float* x, float b, float* y, std::size_t n) override;
};

}  // namespace dtrain::backends::onednn
