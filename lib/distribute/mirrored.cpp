#include "distribute/mirrored.hpp"

#include <fmt/format.h>

#include "config/parse.hpp"
#include "core/error.hpp"
#include "distribute/nccl_communicator.hpp"
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
  return {{.key = "devices", .beside = "auto: every visible GPU, else one CPU replica per core; or [cpu:0, cpu:1]"},
          {.key = "cross_device_ops", .beside = "how the replicas' gradients are summed; auto says what it chose",
           .choices = ops}};
}

std::vector<Device> local_devices(const config::StrategyConfig& config, int total_threads) {
  const config::DeviceList& devices = options_as<MirroredOptions>(config).devices;
  // auto: every visible GPU, as TensorFlow's MirroredStrategy takes them; without one, one
  // logical CPU device per core (each replica then gets one compute thread).
  if (const int gpus = devices.automatic ? automatic_gpus(config) : 0; gpus > 0) {
    std::vector<Device> out;
    for (int i = 0; i < gpus; ++i) out.push_back(Device{Device::Kind::gpu, i});
    return out;
  }
  return devices_of(devices, total_threads);
}

// Why `auto` took GPUs (a CPU run says nothing new: one replica per core, as before GPUs existed).
std::string devices_note(const MirroredOptions& o, const std::vector<Device>& devices) {
  if (!o.devices.automatic || !on_gpus(devices)) return "";
  return fmt::format("devices: auto chose every visible GPU: {}", device_list(devices));
}

std::string join_notes(const std::string& a, const std::string& b) { return a.empty() ? b : b.empty() ? a : a + "\n" + b; }

std::unique_ptr<Strategy> make(const config::StrategyConfig& config, std::vector<Device> devices, int total_threads,
                               Communicator&) {
  const MirroredOptions& o = options_as<MirroredOptions>(config);
  const std::size_t n = devices.size();
  ReplicaLayout layout{MirroredOptions::kind.data(), std::move(devices)};
  const bool gpus = on_gpus(layout.devices);
  switch (o.cross_device_ops) {
    case CrossDeviceOpsKind::nccl:
      if (!gpus)
        throw ConfigError(fmt::format(
            "{}cross_device_ops nccl needs GPU devices (gpu:N), and these replicas are on {}; use ring, "
            "hierarchical_copy or reduction_to_one_device (auto picks one)",
            config::location_prefix(o.cross_device_ops_where, config.where), device_list(layout.devices)));
      if (!nccl())
        throw ConfigError(fmt::format(
            "{}cross_device_ops nccl over {}: {}, or use ring, hierarchical_copy or reduction_to_one_device (they "
            "sum GPU replicas through the host)",
            config::location_prefix(o.cross_device_ops_where, config.where), device_list(layout.devices),
            why_no_nccl()));
      layout.op = CrossDeviceOp::nccl;
      break;
    case CrossDeviceOpsKind::auto_select:
      layout.op = CrossDeviceOp::ring;
      if (n > 1 && gpus && nccl()) {
        layout.op = CrossDeviceOp::nccl;
        layout.choice_note = fmt::format(
            "cross_device_ops: auto chose nccl: {} GPU replicas, summed by NCCL in device memory with no copy "
            "through the host (TensorFlow's default for GPUs)",
            n);
      } else if (n > 1 && gpus) {
        layout.choice_note = fmt::format(
            "cross_device_ops: auto chose ring: {} GPU replicas, summed through the host (this build has no NCCL)", n);
      } else if (n > 1) {
        layout.choice_note = fmt::format(
            "cross_device_ops: auto chose ring: {} CPU replicas share one memory, and the chunked ring spreads the "
            "summation evenly over every replica thread (reduction_to_one_device would leave it all to one)",
            n);
      }
      break;
    default: layout.op = cross_device_op_named(name_of(o.cross_device_ops)); break;
  }
  layout.choice_note = join_notes(devices_note(o, layout.devices), layout.choice_note);
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
