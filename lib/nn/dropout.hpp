// Dropout (Keras semantics: inverted dropout, training only).
//   input  x (N, ...)
//   output y (N, ...) = x * mask / (1 - rate) while training, x in inference
//   mask[i, e] in {0, 1}: element e of sample i is kept unless its bits from the counter-based
//   stream (seed, RngStream::dropout, global step, sample id, layer position) fall below
//   rate * 2^32 (see dropout_mask). A sample's mask does not depend on which replica or rank
//   computes it, so N replicas drop what one process drops, and a resumed run draws the same masks.
#pragma once

#include <cstdint>
#include <string_view>

#include "nn/layer.hpp"

namespace dtrain::nn {

struct DropoutOptions {
  static constexpr std::string_view kind = "dropout";
  double rate = 0.0;  // in [0, 1): the fraction of the inputs dropped
  bool operator==(const DropoutOptions&) const = default;
};

// An element is kept when its 32 random bits are at least this: P(keep) = 1 - threshold / 2^32.
inline std::uint32_t dropout_threshold(double rate) {
  return static_cast<std::uint32_t>(rate * 4294967296.0 < 4294967295.0 ? rate * 4294967296.0 : 4294967295.0);
}

// keep[e] for one sample's `elements` values (canonical order): 1 keeps, 0 drops. Element e takes
// word e % 4 of block e / 4 of sample_bits(seed, RngStream::dropout, global_step, sample_id, layer).
void dropout_mask(std::uint64_t seed, std::int64_t global_step, std::int64_t sample_id, std::uint32_t layer,
                  double rate, std::int64_t elements, std::uint8_t* keep);

// The id of sample `i` of a replica's batch: the pipeline's id, or its index when there are none
// (a model run outside the trainer).
inline std::int64_t sample_id(const StepContext& step, std::int64_t i) {
  return step.sample_ids.empty() ? i : step.sample_ids[static_cast<std::size_t>(i)];
}

class Dropout final : public Layer {
 public:
  using Options = DropoutOptions;
  Dropout(std::string name, const Options& options) : Layer(std::move(name)), opt_(options) {}
  std::string_view kind() const override { return Options::kind; }
  double rate() const { return opt_.rate; }
  bool returns_its_input() const override { return opt_.rate == 0.0; }
  // Fills keep (batch x elements) for a training step.
  void masks(const StepContext& step, std::int64_t batch, std::uint8_t* keep) const;
  void reference_forward(const ReferenceForward& io, const StepContext& step) const override;
  void reference_backward(const ReferenceBackward& io, const StepContext& step) const override;
  Flops flops_per_sample() const override;

 private:
  Shape build_layer(const Shape& input_shape) override { return input_shape; }
  Options opt_;
};

}  // namespace dtrain::nn
