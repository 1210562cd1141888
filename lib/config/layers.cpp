#include "config/layers.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "core/error.hpp"

namespace dtrain::config {

namespace {

// Filled by the layer files' registrations before main, read-only afterwards.
std::vector<LayerSchema>& schemas() {
  static std::vector<LayerSchema> registered;
  return registered;
}

}  // namespace

void register_layer_schema(const LayerSchema& schema) {
  DTRAIN_CHECK(schema.parse && schema.write && !schema.kind.empty(), "a layer schema needs a kind, parse and write");
  std::vector<std::string_view> spellings = schema.aliases;
  spellings.push_back(schema.kind);
  for (std::string_view spelling : spellings)
    DTRAIN_CHECK(find_layer_schema(spelling) == nullptr, fmt::format("layer kind '{}' is registered twice", spelling));
  schemas().push_back(schema);
}

const LayerSchema* find_layer_schema(std::string_view kind) {
  for (const LayerSchema& schema : schemas()) {
    if (schema.kind == kind) return &schema;
    if (std::find(schema.aliases.begin(), schema.aliases.end(), kind) != schema.aliases.end()) return &schema;
  }
  return nullptr;
}

std::vector<std::string_view> layer_kind_names() {
  std::vector<std::string_view> names;
  for (const LayerSchema& schema : schemas()) {
    names.push_back(schema.kind);
    names.insert(names.end(), schema.aliases.begin(), schema.aliases.end());
  }
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace dtrain::config
