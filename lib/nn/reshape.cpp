#include "nn/reshape.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "nn/registry.hpp"

namespace dtrain::nn {

namespace {

config::LayerOptions parse_reshape(const config::Section& s) {
  ReshapeOptions c;
  const config::Node& target = s.require("target_shape");
  c.target_shape = config::read_int_list(target, s.path("target_shape"));
  if (c.target_shape.empty()) config::range_error(target, s.path("target_shape"), "a non-empty list of dimensions");
  // The batch dimension is added in front, and tensors have at most Shape::kMaxRank dimensions
  // (as for model.input_shape).
  if (c.target_shape.size() > Shape::kMaxRank - 1)
    config::range_error(target, s.path("target_shape"),
                        fmt::format("at most {} dimensions (the batch dimension makes {})", Shape::kMaxRank - 1,
                                    Shape::kMaxRank));
  int unknown = 0;
  for (std::size_t i = 0; i < c.target_shape.size(); ++i) {
    const std::int64_t d = c.target_shape[i];
    if (d == -1) ++unknown;
    if ((d < 1 && d != -1) || unknown > 1)
      config::range_error(target.items[i], config::child(s.path("target_shape"), std::to_string(i)),
                          ">= 1 (or -1 for one inferred dimension)");
  }
  return c;
}

void write_reshape(const config::LayerOptions& options, config::OptionsWriter& out) {
  out.integers("target_shape", options_as<ReshapeOptions>(options).target_shape);
}

config::LayerOptions parse_flatten(const config::Section&) { return FlattenOptions{}; }
void write_flatten(const config::LayerOptions&, config::OptionsWriter&) {}

const LayerRegistration<Reshape> reshape_registered({.kind = "reshape",
                                                     .aliases = {},
                                                     .auto_name = "reshape",
                                                     .keys = {"target_shape"},
                                                     .parse = &parse_reshape,
                                                     .write = &write_reshape});
const LayerRegistration<Flatten> flatten_registered({.kind = "flatten",
                                                     .aliases = {},
                                                     .auto_name = "flatten",
                                                     .keys = {},
                                                     .parse = &parse_flatten,
                                                     .write = &write_flatten});

}  // namespace

Shape Reshape::build_layer(const Shape& in) {
  std::vector<std::int64_t> dims = opt_.target_shape;
  std::int64_t known = 1;
  int inferred = -1;
  for (std::size_t i = 0; i < dims.size(); ++i) {
    if (dims[i] == -1) {
      if (inferred >= 0) throw ConfigError(fmt::format("layer '{}': only one target_shape entry may be -1", name()));
      inferred = static_cast<int>(i);
    } else {
      known *= dims[i];
    }
  }
  if (inferred >= 0 && known > 0 && in.numel() % known == 0) dims[static_cast<std::size_t>(inferred)] = in.numel() / known;
  const Shape out(dims);
  if (out.numel() != in.numel())
    throw ConfigError(fmt::format("layer '{}': cannot reshape {} ({} values) to {}", name(), in.to_string(), in.numel(),
                                  Shape(opt_.target_shape).to_string()));
  return out;
}

// Canonical order is row-major whatever the shape: the values pass through unchanged.
void Reshape::reference_forward(const ReferenceForward& io, const StepContext&) const {
  std::copy(io.x.begin(), io.x.end(), io.y.begin());
}

void Reshape::reference_backward(const ReferenceBackward& io, const StepContext&) const {
  std::copy(io.dy.begin(), io.dy.end(), io.dx.begin());
}

}  // namespace dtrain::nn
