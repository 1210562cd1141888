#include "distribute/strategy.hpp"

#include <algorithm>
#include <charconv>
#include <map>

#include <fmt/format.h>

#include "config/parse.hpp"
#include "core/error.hpp"
#include "device/context.hpp"

namespace dtrain::distribute {

namespace {

// Filled by the strategy files' registrations before main, read-only afterwards.
std::map<std::string, StrategyPlacement, std::less<>>& placements() {
  static std::map<std::string, StrategyPlacement, std::less<>> registered;
  return registered;
}

const StrategyPlacement& placement_of(std::string_view kind) {
  const auto found = placements().find(kind);
  if (found == placements().end())
    throw InternalError(fmt::format("strategy kind '{}' has no implementation (no strategy file registered it)", kind));
  return found->second;
}

}  // namespace

StrategyRegistration::StrategyRegistration(const config::StrategySchema& schema, const StrategyPlacement& placement) {
  DTRAIN_CHECK(placement.local_devices && placement.make,
               fmt::format("strategy kind '{}' needs local_devices and make", schema.kind));
  config::register_strategy_schema(schema);
  placements().emplace(std::string(schema.kind), placement);
}

Device parse_device(const std::string& name) {
  Device d;
  const auto colon = name.find(':');
  const std::string kind = name.substr(0, colon);
  int index = -1;
  if (colon != std::string::npos) {
    const char* first = name.data() + colon + 1;
    const char* last = name.data() + name.size();
    auto [end, ec] = std::from_chars(first, last, index);
    if (ec != std::errc() || end != last) index = -1;
  }
  if ((kind != "cpu" && kind != "gpu") || index < 0)
    throw ConfigError(fmt::format("'{}' is not a device name; write cpu:N or gpu:N", name));
  d.kind = kind == "cpu" ? Device::Kind::cpu : Device::Kind::gpu;
  d.index = index;
  return d;
}

std::vector<Device> devices_of(const config::DeviceList& devices, int automatic_count) {
  std::vector<Device> out;
  if (devices.automatic)
    for (int i = 0; i < std::max(1, automatic_count); ++i) out.push_back(Device{Device::Kind::cpu, i});
  for (const auto& name : devices.names) out.push_back(parse_device(name));
  return out;
}

int automatic_gpus(const config::StrategyConfig& config) {
  try {
    return device::device_count(Device::Kind::gpu);
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("{}devices: auto looks for GPUs: {}; or list cpu devices",
                                  config::location_prefix(config.devices_where, config.where), e.what()));
  }
}

ReplicaContext Strategy::replica_context(int replica) const {
  return ReplicaContext{replica, num_replicas_in_sync(), worker_index() * num_local_replicas() + replica};
}

bool spans_workers(const config::StrategyConfig& config) { return placement_of(config.kind).roles != nullptr; }

const config::RolesConfig* roles_of(const config::StrategyConfig& config) {
  const StrategyPlacement& placement = placement_of(config.kind);
  return placement.roles ? placement.roles(config) : nullptr;
}

bool runs_own_loop(const config::StrategyConfig& config) { return placement_of(config.kind).own_loop; }

std::vector<std::string_view> kinds_spanning_workers(bool trainer_loop) {
  std::vector<std::string_view> kinds;
  for (std::string_view kind : config::strategy_kind_names()) {
    const StrategyPlacement& placement = placement_of(kind);
    if (placement.roles && !(trainer_loop && placement.own_loop)) kinds.push_back(kind);
  }
  return kinds;
}

std::vector<std::string_view> kinds_with_own_loop() {
  std::vector<std::string_view> kinds;
  for (std::string_view kind : config::strategy_kind_names())
    if (placement_of(kind).own_loop) kinds.push_back(kind);
  return kinds;
}

int num_replicas_in_sync(const config::StrategyConfig& config, int total_threads, int workers) {
  const StrategyPlacement& placement = placement_of(config.kind);
  // A kind with its own loop schedules each step on one process's replicas.
  const int processes = placement.roles && !placement.own_loop ? std::max(1, workers) : 1;
  return static_cast<int>(placement.local_devices(config, total_threads).size()) * processes;
}

config::StrategyConfig evaluation_strategy(int workers) {
  if (workers > 1) {
    const std::vector<std::string_view> across = kinds_spanning_workers(true);
    DTRAIN_CHECK(!across.empty(), "no strategy kind evaluates across worker processes");
    return config::strategy_config_of(across.front());
  }
  return config::strategy_config_of(config::default_strategy_schema().kind);
}

std::unique_ptr<Strategy> make_strategy(const config::StrategyConfig& config, int total_threads, Communicator& workers) {
  // Whether a backend of this build can run the devices is the trainer's question (it makes their
  // contexts): a strategy only lays replicas out on them.
  const StrategyPlacement& placement = placement_of(config.kind);
  return placement.make(config, placement.local_devices(config, total_threads), total_threads, workers);
}

}  // namespace dtrain::distribute
