#include "distribute/mirrored.hpp"

#include <fmt/format.h>

#include "config/parse.hpp"
#include "core/error.hpp"
#include "distribute/replicated_strategy.hpp"

namespace dtrain::distribute {

namespace {

constexpr config::Named<CrossDeviceOpsKind> cross_device_ops_kinds[] = {
    {"auto", CrossDeviceOpsKind::auto_select},
    {"reduction_to_one_device", CrossDeviceOpsKind::reduction_to_one_device},
    {"hierarchical_copy", CrossDeviceOpsKind::hierarchical_copy},
    {"ring", CrossDeviceOpsKind::ring},
    {"nccl", CrossDeviceOpsKind::nccl}};

void parse(const config::Section& s, config::StrategyConfig& out) {
  MirroredOptions o;
  o.devices = config::read_devices_key(s, out);
  if (const config::Node* ops = s.find("cross_device_ops")) {
    o.cross_device_ops = config::read_enum(*ops, s.path("cross_device_ops"), "cross_device_ops", cross_device_ops_kinds);
    o.cross_device_ops_where = ops->origin.location();
  }
  out.options = o;
}

void write(const config::StrategyOptions& options, config::OptionsWriter& out) {
  const auto& o = options_as<MirroredOptions>(options);
  config::write_devices(out, o.devices);
  out.enumeration("cross_device_ops", cross_device_ops_kinds, o.cross_device_ops);
}

std::vector<config::TemplateNote> template_notes() {
  std::vector<std::string_view> ops;
  for (const auto& entry : cross_device_ops_kinds) ops.push_back(entry.name);
  return {{.key = "devices", .beside = std::string(config::devices_per_core_note)},
          {.key = "cross_device_ops", .beside = "how the replicas' gradients are summed; auto says what it chose",
           .choices = ops}};
}

std::vector<Device> local_devices(const config::StrategyConfig& config, int total_threads) {
  // One logical CPU device per core: each replica then gets one compute thread.
  return devices_of(options_as<MirroredOptions>(config).devices, total_threads);
}

std::unique_ptr<Strategy> make(const config::StrategyConfig& config, std::vector<Device> devices, int total_threads,
                               Communicator&) {
  const MirroredOptions& o = options_as<MirroredOptions>(config);
  const std::size_t n = devices.size();
  ReplicaLayout layout{MirroredOptions::kind.data(), std::move(devices)};
  switch (o.cross_device_ops) {
    case CrossDeviceOpsKind::nccl:
      if (on_gpus(layout.devices))
        throw ConfigError(fmt::format(
            "{}cross_device_ops nccl over {}: this build has no NCCL communicator for local GPUs yet; use ring, "
            "hierarchical_copy or reduction_to_one_device (they sum GPU replicas through the host)",
            config::location_prefix(o.cross_device_ops_where, config.where), device_list(layout.devices)));
      throw ConfigError(fmt::format(
          "{}cross_device_ops nccl needs GPU devices (gpu:N), and these replicas are on {}; use ring, "
          "hierarchical_copy or reduction_to_one_device (auto picks one)",
          config::location_prefix(o.cross_device_ops_where, config.where), device_list(layout.devices)));
    case CrossDeviceOpsKind::auto_select:
      layout.op = CrossDeviceOp::ring;
      if (n > 1)
        layout.choice_note = fmt::format(
            "cross_device_ops: auto chose ring: {} CPU replicas share one memory, and the chunked ring spreads the "
            "summation evenly over every replica thread (reduction_to_one_device would leave it all to one)",
            n);
      break;
    default: layout.op = cross_device_op_named(name_of(o.cross_device_ops)); break;
  }
  return std::make_unique<ReplicatedStrategy>(std::move(layout), total_threads);
}

const StrategyRegistration registered({.kind = MirroredOptions::kind,
                                       .listed_at = 30,
                                       .keys = {"devices", "cross_device_ops"},
                                       .parse = &parse,
                                       .write = &write,
                                       .summary = "replica threads, gradients all-reduced",
                                       .notes = &template_notes},
                                      {.local_devices = &local_devices, .make = &make});

}  // namespace

const char* name_of(CrossDeviceOpsKind kind) { return config::name_in(cross_device_ops_kinds, kind); }

}  // namespace dtrain::distribute
