#include "distribute/strategy.hpp"

#include <algorithm>
#include <charconv>

#include <fmt/format.h>

#include "config/parse.hpp"
#include "core/error.hpp"
#include "distribute/parameter_server.hpp"
#include "distribute/replicated_strategy.hpp"

namespace dtrain::distribute {

namespace {

// The devices of this process's replicas.
std::vector<Device> local_devices(const config::StrategyConfig& config, int total_threads) {
  using config::StrategyKind;
  std::vector<Device> devices;
  switch (config.kind) {
    case StrategyKind::default_strategy:
    case StrategyKind::parameter_server: return {Device{}};
    case StrategyKind::one_device: return {parse_device(config.device)};
    case StrategyKind::multi_worker_mirrored:
      if (config.devices_auto) return {Device{}};  // one CPU replica per worker process
      break;
    case StrategyKind::mirrored:
    case StrategyKind::central_storage:
      // One logical CPU device per core: each replica then gets one compute thread.
      if (config.devices_auto)
        for (int i = 0; i < std::max(1, total_threads); ++i) devices.push_back(Device{Device::Kind::cpu, i});
      break;
  }
  for (const auto& name : config.devices) devices.push_back(parse_device(name));
  return devices;
}

}  // namespace

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

ReplicaContext Strategy::replica_context(int replica) const {
  return ReplicaContext{replica, num_replicas_in_sync(), worker_index() * num_local_replicas() + replica};
}

bool spans_workers(const config::StrategyConfig& config) {
  return config.kind == config::StrategyKind::multi_worker_mirrored || config.kind == config::StrategyKind::parameter_server;
}

int num_replicas_in_sync(const config::StrategyConfig& config, int total_threads, int workers) {
  if (config.kind == config::StrategyKind::parameter_server) return 1;  // each step is one worker's batch
  return static_cast<int>(local_devices(config, total_threads).size()) * (spans_workers(config) ? std::max(1, workers) : 1);
}

config::StrategyConfig evaluation_strategy(int workers) {
  config::StrategyConfig strategy;
  if (workers > 1) strategy.kind = config::StrategyKind::multi_worker_mirrored;
  return strategy;
}

std::unique_ptr<Strategy> make_strategy(const config::StrategyConfig& config, int total_threads, Communicator& workers) {
  // Whether a backend of this build can run the devices is the trainer's question (it makes their
  // contexts): a strategy only lays replicas out on them.
  std::vector<Device> devices = local_devices(config, total_threads);
  using config::StrategyKind;
  switch (config.kind) {
    case StrategyKind::default_strategy: return make_default_strategy(std::move(devices), total_threads);
    case StrategyKind::one_device: return make_one_device_strategy(std::move(devices), total_threads);
    case StrategyKind::mirrored: return make_mirrored_strategy(config, std::move(devices), total_threads);
    case StrategyKind::central_storage: return make_central_storage_strategy(config, std::move(devices), total_threads);
    case StrategyKind::multi_worker_mirrored:
      return make_multi_worker_mirrored_strategy(config, std::move(devices), total_threads, workers);
    case StrategyKind::parameter_server: return make_parameter_server_strategy(config, total_threads);
  }
  throw InternalError(fmt::format("make_strategy: strategy kind {} has no implementation", static_cast<int>(config.kind)));
}

}  // namespace dtrain::distribute
