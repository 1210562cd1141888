#include "distribute/one_device.hpp"

#include "distribute/replicated_strategy.hpp"

namespace dtrain::distribute {

namespace {

void parse(const config::Section& s, config::StrategyConfig& out) {
  OneDeviceOptions o;
  if (const config::Node* device = s.find("device")) {
    o.device = config::read_device(*device, s.path("device"));
    out.devices_where = device->origin.location();
  }
  out.options = o;
}

void write(const config::StrategyOptions& options, config::OptionsWriter& out) {
  const auto& o = options_as<OneDeviceOptions>(options);
  out.text("device", o.device);
}

std::vector<config::TemplateNote> template_notes() { return {{.key = "device", .beside = "the one device: cpu:N"}}; }

std::vector<Device> local_devices(const config::StrategyConfig& config, int) {
  return {parse_device(options_as<OneDeviceOptions>(config).device)};
}

std::unique_ptr<Strategy> make(const config::StrategyConfig&, std::vector<Device> devices, int total_threads,
                               Communicator&) {
  return std::make_unique<ReplicatedStrategy>(ReplicaLayout{OneDeviceOptions::kind.data(), std::move(devices)},
                                              total_threads);
}

const StrategyRegistration registered(
    {.kind = OneDeviceOptions::kind,
     .listed_at = 20,
     .keys = {"device"},
     .parse = &parse,
     .write = &write,
     .mean_reductions_refused = "with one replica its average happens to be right, but tf.distribute refuses it under "
                                "every explicit strategy so that the experiment stays correct when it moves to several "
                                "replicas",
     .summary = "one replica",
     .notes = &template_notes},
    {.local_devices = &local_devices, .make = &make});

}  // namespace

}  // namespace dtrain::distribute
