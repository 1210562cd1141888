// Caffe-style registry of the layer kinds. A layer file registers, in one statement, everything the
// rest of dtrain needs to know about its kind: the YAML name (and Keras aliases), the options schema
// with its parse and to_yaml functions (config/layers.hpp), and the factory. Its kernels register
// themselves per backend (nn/kernel.hpp); its checkpoint names are its variables' names and its
// oracle its reference_forward/backward.
//
// In nn/<kind>.cpp:
//   const LayerRegistration<Conv2D> registered({.kind = "conv2d", .auto_name = "conv2d", .keys = {...},
//                                               .parse = &parse, .write = &write});
// Registration runs before main; afterwards the registry is only read.
#pragma once

#include <memory>
#include <string>

#include "config/experiment.hpp"
#include "config/layers.hpp"
#include "core/error.hpp"
#include "nn/layer.hpp"

namespace dtrain::nn {

using LayerFactory = std::unique_ptr<Layer> (*)(const config::LayerConfig& config);

void register_layer(const config::LayerSchema& schema, LayerFactory factory);
// InternalError for a kind no layer file registered (the parser refuses those with a message).
std::unique_ptr<Layer> make_layer(const config::LayerConfig& config);

// The options of a layer config, as the layer's own type.
template <class Options>
const Options& options_as(const config::LayerOptions& options) {
  const Options* typed = options.get_if<Options>();
  DTRAIN_CHECK(typed != nullptr, "layer options of another kind");
  return *typed;
}

// A layer config built in code (tests, tools): the kind comes from the options type.
template <class Options>
config::LayerConfig layer_config(std::string name, Options options) {
  config::LayerConfig c;
  c.kind = std::string(Options::kind);
  c.name = std::move(name);
  c.options = std::move(options);
  return c;
}

template <class L>
struct LayerRegistration {
  explicit LayerRegistration(const config::LayerSchema& schema) {
    register_layer(schema, [](const config::LayerConfig& c) -> std::unique_ptr<Layer> {
      return std::make_unique<L>(c.name, options_as<typename L::Options>(c.options));
    });
  }
};

}  // namespace dtrain::nn
