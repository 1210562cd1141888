// Reshape and Flatten (Keras semantics): the same values in canonical (channels-last, row-major)
// order under another shape.
//   Reshape: x (N, ...) -> y (N, target_shape...), one target entry may be -1 (inferred)
//   Flatten: x (N, d1, ..., dk) -> y (N, d1 * ... * dk)
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "nn/layer.hpp"

namespace dtrain::nn {

struct ReshapeOptions {
  static constexpr std::string_view kind = "reshape";
  std::vector<std::int64_t> target_shape;  // without the batch dimension; one entry may be -1
  bool operator==(const ReshapeOptions&) const = default;
};

struct FlattenOptions {
  static constexpr std::string_view kind = "flatten";
  bool operator==(const FlattenOptions&) const = default;
};

class Reshape : public Layer {
 public:
  using Options = ReshapeOptions;
  Reshape(std::string name, const Options& options) : Layer(std::move(name)), opt_(options) {}
  std::string_view kind() const override { return Options::kind; }
  void reference_forward(const ReferenceForward& io, const StepContext& step) const override;
  void reference_backward(const ReferenceBackward& io, const StepContext& step) const override;

 private:
  Shape build_layer(const Shape& input_shape) override;
  Options opt_;
};

class Flatten final : public Reshape {
 public:
  using Options = FlattenOptions;
  Flatten(std::string name, const Options&) : Reshape(std::move(name), ReshapeOptions{{-1}}) {}
  std::string_view kind() const override { return Options::kind; }
};

}  // namespace dtrain::nn
