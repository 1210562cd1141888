#include "nn/registry.hpp"

#include <vector>

#include <fmt/format.h>

namespace dtrain::nn {

namespace {

struct Registered {
  std::string_view kind;
  LayerFactory factory;
};

// Filled by the layer files' registrations before main, read-only afterwards.
std::vector<Registered>& factories() {
  static std::vector<Registered> registered;
  return registered;
}

}  // namespace

void register_layer(const config::LayerSchema& schema, LayerFactory factory) {
  config::register_layer_schema(schema);
  factories().push_back({schema.kind, factory});
}

std::unique_ptr<Layer> make_layer(const config::LayerConfig& config) {
  for (const Registered& r : factories())
    if (r.kind == config.kind) return r.factory(config);
  throw InternalError(fmt::format("layer {}: kind '{}' is not registered", config.name, config.kind));
}

}  // namespace dtrain::nn
