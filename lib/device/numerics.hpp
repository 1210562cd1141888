// The loops of the losses, metrics, optimizers and regularizers, as each backend runs them. The
// modules that own the formulas (losses/, metrics/, optim/, nn's regularizers) validate their
// inputs and compute per-step coefficients; the loops over device memory happen here.
//
// Pointers are device memory of the context that owns these numerics; results that the caller
// reads back (per-example losses, per-row argmax and match counts, a sum of squares) land in host
// memory: at once, or, for a call asked to defer them (a training step's losses and label hits),
// by the next complete_reads(), so that a backend with a stream need not wait for it mid-step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "config/experiment.hpp"

namespace dtrain::device {

// Coefficients of one optimizer step, fixed for every variable of the step (optim/optimizer.hpp
// has the formulas).
struct SgdStep {
  float learning_rate = 0.0f;
  float momentum = 0.0f;  // 0: plain SGD, no slot
  bool nesterov = false;
};
struct AdamStep {
  float alpha = 0.0f;  // lr sqrt(1 - b2^t) / (1 - b1^t)
  float one_minus_beta_1 = 0.0f, one_minus_beta_2 = 0.0f, epsilon = 0.0f;
};
struct RmspropStep {
  float learning_rate = 0.0f, rho = 0.0f, momentum = 0.0f, epsilon = 0.0f;
  bool centered = false;
};

// One variable of an Adam update: w, g and its two slots, n floats each.
struct AdamVariable {
  float* w = nullptr;
  const float* g = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  std::size_t n = 0;
};

// One batch of a loss (losses/loss_math.hpp has the formulas): pred (N, C); exactly one of
// dense_targets (N, C) and labels (N,); weights (N,) or null; per_example (N,) and grad (N, C) may
// each be null. grad[i, :] = scale * w_i * d(loss_i)/d(pred[i, :]).
struct LossBatch {
  config::LossKind kind = config::LossKind::sparse_categorical_crossentropy;
  bool from_logits = false;
  std::int64_t rows = 0, columns = 0;
  const float* pred = nullptr;
  const float* dense_targets = nullptr;
  const std::int32_t* labels = nullptr;
  const float* weights = nullptr;
  float scale = 1.0f;
  float* per_example = nullptr;  // host
  float* grad = nullptr;
  // per_example may be written as late as the next Numerics::complete_reads() (it must stay valid
  // until then): the training step reads its losses once, at its end.
  bool deferred = false;
};

class Numerics {
 public:
  virtual ~Numerics() = default;

  // ---- optimizers: one variable of n floats; slots as the optimizer's slot_names() say.
  virtual void sgd_update(const SgdStep& step, float* w, const float* g, float* momentum, std::size_t n) = 0;
  virtual void adam_update(const AdamStep& step, float* w, const float* g, float* m, float* v, std::size_t n) = 0;
  // adam_update of every variable of a step, in turn; a backend may update them all in one launch
  // (the same arithmetic per element). By default one adam_update each (numerics.cpp).
  virtual void adam_update_all(const AdamStep& step, std::span<const AdamVariable> variables);
  // momentum and average may be null (no momentum, not centered).
  virtual void rmsprop_update(const RmspropStep& step, float* w, const float* g, float* velocity, float* momentum,
                              float* average, std::size_t n) = 0;

  // ---- losses
  virtual void loss(const LossBatch& batch) = 0;

  // ---- metrics
  // out[i] = index of the first maximum of row i of (rows, columns).
  virtual void argmax_rows(const float* values, std::int64_t rows, std::int64_t columns, std::int32_t* out) = 0;
  // matches[i] = how many of row i's columns equal the target (f32 or i32 targets, (rows, columns)):
  // exactly, or after thresholding the prediction (pred > threshold -> 1, else 0) when `threshold`.
  virtual void row_matches(const float* pred, const void* targets, bool targets_are_i32, std::int64_t rows,
                           std::int64_t columns, const float* threshold, std::int64_t* matches) = 0;

  // hits[i] = 1 when the first maximum of row i of pred (rows, columns) is at column labels[i]
  // (i32, this backend's memory), 0 when it is elsewhere, -1 when labels[i] is outside
  // [0, columns): sparse categorical accuracy without reading the labels back. `hits` is host
  // memory, written by the next complete_reads() when `deferred` (it must stay valid until then).
  // By default argmax_rows and to_host, at once (numerics.cpp).
  virtual void label_hits(const float* pred, const std::int32_t* labels, std::int64_t rows, std::int64_t columns,
                          std::int32_t* hits, bool deferred);

  // ---- read-back: `bytes` of this backend's memory at `src` into host memory (labels a metric
  // compares on the host, predictions a Mean averages); returns with them on the host.
  virtual void to_host(const void* src, void* host, std::size_t bytes) = 0;
  // Returns when the host results of every deferred call so far are written. A backend that
  // computes as it is called has written them already.
  virtual void complete_reads() {}

  // ---- regularizers
  virtual double sum_of_squares(const float* x, std::size_t n) = 0;
  // y += a * x
  virtual void axpy(float a, const float* x, float* y, std::size_t n) = 0;
  // y = b * y + a * x (moving averages)
  virtual void axpby(float a, const float* x, float b, float* y, std::size_t n) = 0;
};

}  // namespace dtrain::device
