// The YAML schemas of the layer kinds. Each layer file in nn/ registers its own (nn/registry.hpp
// does it together with the layer's factory), so that the parser reads `model.layers` without a
// list of kinds of its own: an unknown kind lists the registered ones, and errors inside a
// layer's options keep file:line:column and did-you-mean like every other section.
//
// Registration happens while the program starts (before main): afterwards the registry is only
// read.
#pragma once

#include <string_view>
#include <vector>

#include "config/experiment.hpp"
#include "config/schema.hpp"

namespace dtrain::config {

struct LayerSchema {
  std::string_view kind;                      // the YAML key, also what checkpoints and summaries call it
  std::vector<std::string_view> aliases;      // other spellings accepted on input (Keras class names)
  std::string_view auto_name;                 // Keras' automatic-name prefix: conv2d, conv2d_1, ...
  std::vector<std::string_view> keys;         // the option keys it accepts ("name" is always accepted)
  // Reads the options map (unknown keys are already refused; `s.path()` is the map's key path).
  LayerOptions (*parse)(const Section& s) = nullptr;
  // Writes every option, defaults included, so that parse(write(o)) == o.
  void (*write)(const LayerOptions& options, OptionsWriter& out) = nullptr;
};

// InternalError when the kind or an alias is already registered (a programming error).
void register_layer_schema(const LayerSchema& schema);
// By kind or alias; null when unknown.
const LayerSchema* find_layer_schema(std::string_view kind);
// Every kind and alias, sorted: what an unknown kind is compared with.
std::vector<std::string_view> layer_kind_names();

}  // namespace dtrain::config
