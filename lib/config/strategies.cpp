#include "config/strategies.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <optional>

#include <fmt/format.h>

#include "core/error.hpp"
#include "core/machine.hpp"

namespace dtrain::config {

namespace {

// Filled by the strategy files' registrations before main, read-only afterwards.
std::vector<StrategySchema>& schemas() {
  static std::vector<StrategySchema> registered;
  return registered;
}

bool names_devices(std::string_view key) { return key.ends_with("device") || key.ends_with("devices"); }

bool starts_with_ignoring_case(std::string_view text, std::string_view prefix) {
  auto lower = [](char c) { return static_cast<char>(std::tolower(static_cast<unsigned char>(c))); };
  return text.size() >= prefix.size() &&
         std::equal(prefix.begin(), prefix.end(), text.begin(), [&](char a, char b) { return lower(a) == lower(b); });
}

// TensorFlow spells a local device several ways (cpu:0, /cpu:0, CPU:0, /device:GPU:1); the
// strategies compare device names, so they are kept in one spelling: "cpu:N" or "gpu:N".
std::optional<std::string> normalise_device(std::string_view text) {
  if (text.starts_with('/')) text.remove_prefix(1);
  if (starts_with_ignoring_case(text, "device:")) text.remove_prefix(std::string_view("device:").size());
  std::string_view type;
  for (std::string_view candidate : {"cpu", "gpu"})
    if (starts_with_ignoring_case(text, candidate) && text.substr(candidate.size()).starts_with(':')) type = candidate;
  if (type.empty()) return std::nullopt;
  text.remove_prefix(type.size() + 1);
  const bool digits_only = !text.empty() && std::all_of(text.begin(), text.end(), [](unsigned char c) {
    return std::isdigit(c) != 0;
  });
  int index = 0;
  if (!digits_only) return std::nullopt;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), index);
  if (error != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return fmt::format("{}:{}", type, index);
}

}  // namespace

void register_strategy_schema(const StrategySchema& schema) {
  DTRAIN_CHECK(schema.parse && schema.write && !schema.kind.empty(), "a strategy schema needs a kind, parse and write");
  DTRAIN_CHECK(find_strategy_schema(schema.kind) == nullptr,
               fmt::format("strategy kind '{}' is registered twice", schema.kind));
  for (const StrategySchema& other : schemas())
    DTRAIN_CHECK(!(schema.is_default && other.is_default),
                 fmt::format("strategy kinds '{}' and '{}' both say they are the default", other.kind, schema.kind));
  schemas().push_back(schema);
}

const StrategySchema* find_strategy_schema(std::string_view kind) {
  for (const StrategySchema& schema : schemas())
    if (schema.kind == kind) return &schema;
  return nullptr;
}

const StrategySchema& strategy_schema(std::string_view kind) {
  const StrategySchema* schema = find_strategy_schema(kind);
  if (!schema) throw InternalError(fmt::format("strategy kind '{}', which no strategy file registered", kind));
  return *schema;
}

std::vector<const StrategySchema*> strategy_schemas() {
  std::vector<const StrategySchema*> out;
  for (const StrategySchema& schema : schemas()) out.push_back(&schema);
  // A total order (listed_at, then the kind), so std::sort needs no stability: libstdc++ 12's
  // stable_sort frees its temporary buffer in a way AddressSanitizer reports as a mismatch.
  std::sort(out.begin(), out.end(), [](const auto* a, const auto* b) {
    return a->listed_at != b->listed_at ? a->listed_at < b->listed_at : a->kind < b->kind;
  });
  return out;
}

std::vector<std::string_view> strategy_kind_names() {
  std::vector<std::string_view> names;
  for (const StrategySchema* schema : strategy_schemas()) names.push_back(schema->kind);
  return names;
}

const StrategySchema& default_strategy_schema() {
  for (const StrategySchema& schema : schemas())
    if (schema.is_default) return schema;
  throw InternalError("no strategy kind is registered as the default");
}

std::vector<std::string_view> strategy_keys() {
  std::vector<std::string_view> keys{"kind"};
  // Where the replicas and the variables go first, then how the kinds combine them.
  for (bool devices : {true, false})
    for (const StrategySchema* schema : strategy_schemas())
      for (std::string_view key : schema->keys)
        if (names_devices(key) == devices && std::find(keys.begin(), keys.end(), key) == keys.end())
          keys.push_back(key);
  return keys;
}

StrategyConfig strategy_config_of(std::string_view kind) {
  const StrategySchema& schema = strategy_schema(kind);
  const Node nothing;  // every key left out
  const std::vector<std::string_view> keys = strategy_keys();
  StrategyConfig out;
  out.kind = std::string(schema.kind);
  schema.parse(Section(nothing, "strategy", keys), out);
  return out;
}

// ---------------------------------------------------------------- keys several kinds share

std::string read_device(const Node& node, const std::string& path) {
  if (!node.is_scalar()) type_error(node, path, "a device name (cpu:N or gpu:N)");
  if (auto device = normalise_device(node.scalar)) return *device;
  range_error(node, path, "a device name cpu:N or gpu:N with N >= 0 (TensorFlow's /cpu:0 and /device:GPU:0 work too)");
}

DeviceList read_devices(const Node& node, const std::string& path) {
  if (node.is_scalar() && node.scalar == "auto") return DeviceList{};
  if (!node.is_sequence()) type_error(node, path, "a list of device names (for example [cpu:0, cpu:1]) or auto");
  if (node.items.empty()) range_error(node, path, "a non-empty list of devices, or auto");
  // Each device is a replica with its own thread and copy of the model.
  if (node.items.size() > static_cast<std::size_t>(max_compute_threads()))
    range_error(node, path, fmt::format("a list of at most {} devices (the thread cap of this machine)",
                                        max_compute_threads()));
  DeviceList out;
  out.automatic = false;
  for (std::size_t i = 0; i < node.items.size(); ++i) {
    const Node& item = node.items[i];
    const std::string item_path = child(path, std::to_string(i));
    std::string device = read_device(item, item_path);
    const auto previous = std::find(out.names.begin(), out.names.end(), device);
    if (previous != out.names.end()) {
      const Node& first = node.items[static_cast<std::size_t>(previous - out.names.begin())];
      fail(item.origin, fmt::format("{}: device '{}' is listed twice (also at {}); give each replica its own device",
                                    item_path, device, first.origin.text()));
    }
    out.names.push_back(std::move(device));
  }
  return out;
}

void write_devices(OptionsWriter& out, const DeviceList& devices) {
  if (devices.automatic)
    out.text("devices", "auto");
  else
    out.texts("devices", devices.names);
}

DeviceList read_devices_key(const Section& s, StrategyConfig& out) {
  const Node* devices = s.find("devices");
  if (!devices) return DeviceList{};
  out.devices_where = devices->origin.location();
  return read_devices(*devices, s.path("devices"));
}

CommunicationConfig read_communication(const Node& node, const std::string& path) {
  static constexpr std::string_view keys[] = {"implementation", "bytes_per_pack", "overlap", "timeout_seconds"};
  Section s(node, path, keys);
  CommunicationConfig out;
  if (const Node* implementation = s.find("implementation")) {
    out.implementation = read_enum(*implementation, s.path("implementation"), "communication implementation",
                                   communication_implementations);
    out.implementation_where = implementation->origin.location();
  }
  s.get_int("bytes_per_pack", out.bytes_per_pack, 0);
  s.get_bool("overlap", out.overlap);
  s.get_number("timeout_seconds", out.timeout_seconds, positive, "> 0");
  return out;
}

RolesConfig read_roles_key(const Section& s, const StrategyConfig& strategy) {
  RolesConfig out;
  if (const Node* node = s.find("roles")) {
    static constexpr std::string_view keys[] = {"chief", "worker", "evaluator", "ps"};
    Section roles(*node, s.path("roles"), keys);
    out.where = node->origin.location();
    // TensorFlow allows at most one chief and one evaluator.
    for (auto [key, value] : {std::pair<std::string_view, int*>{"chief", &out.chief}, {"evaluator", &out.evaluator}})
      if (const Node* n = roles.find(key)) {
        *value = read_int32(*n, roles.path(key));
        if (*value < 0 || *value > 1) range_error(*n, roles.path(key), "0 or 1");
      }
    roles.get_int("worker", out.worker, 0);
    roles.get_int("ps", out.ps, 0);
  }
  out.parameter_servers = strategy_schema(strategy.kind).parameter_servers;
  out.kind = strategy.kind;
  return out;
}

void check_parameter_servers(const Section& s, const RolesConfig& roles) {
  const Node* written = s.find("roles");
  // TF_CONFIG may still give the servers when the roles are left out (resolve_roles checks).
  if (!written) return;
  if (roles.parameter_servers && roles.ps < 1)
    fail(written->origin, fmt::format("strategy.roles.ps: {} needs at least one parameter server; write ps: 1 or more",
                                      roles.kind));
  if (!roles.parameter_servers && roles.ps > 0) {
    std::vector<std::string_view> with_servers;
    for (const StrategySchema* schema : strategy_schemas())
      if (schema->parameter_servers) with_servers.push_back(schema->kind);
    fail(written->origin, fmt::format("strategy.roles.ps: strategy kind {} has no parameter servers; remove ps, or use "
                                      "kind {}",
                                      roles.kind, fmt::join(with_servers, " or ")));
  }
}

}  // namespace dtrain::config
