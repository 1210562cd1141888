#include "distribute/central_storage.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "core/error.hpp"
#include "config/parse.hpp"
#include "distribute/replicated_strategy.hpp"

namespace dtrain::distribute {

namespace {

class CentralStorageStrategy final : public ReplicatedStrategy {
 public:
  CentralStorageStrategy(ReplicaLayout layout, int total_threads, int holder)
      : ReplicatedStrategy(std::move(layout), total_threads), holder_(holder) {}

  bool holds_variables(int replica) const override { return replica == holder_; }
  int primary_replica() const override { return holder_; }

  void place_variables(std::span<const std::vector<Variable*>> per_replica) override {
    DTRAIN_CHECK(per_replica.size() == static_cast<std::size_t>(num_local_replicas()),
                 fmt::format("place_variables: {} variable lists for {} replicas", per_replica.size(), num_local_replicas()));
    const std::vector<Variable*>& held = per_replica[static_cast<std::size_t>(holder_)];
    // Where the host reads the replicas' memory in place (CPU replicas), they all compute with the
    // holder's one storage. Elsewhere (GPUs, the checked mode) a replica's kernels read only its
    // own memory: each keeps a copy that the holder's values overwrite after every update.
    shared_ = std::all_of(held.begin(), held.end(), [](const Variable* v) { return v->value.host_accessible(); });
    replicas_.assign(per_replica.begin(), per_replica.end());
    for (std::size_t r = 0; r < per_replica.size(); ++r) {
      if (static_cast<int>(r) == holder_) continue;
      const std::vector<Variable*>& mine = per_replica[r];
      DTRAIN_CHECK(mine.size() == held.size(), "place_variables: the replicas' models have different variables");
      for (std::size_t v = 0; v < mine.size(); ++v) {
        DTRAIN_CHECK(mine[v]->value.shape() == held[v]->value.shape(),
                     fmt::format("place_variables: {} has shape {} on replica {}, {} on the holder", mine[v]->name,
                                 mine[v]->value.shape().to_string(), r, held[v]->value.shape().to_string()));
        if (shared_) mine[v]->value = held[v]->value;  // the holder's updates are what every replica computes with
      }
    }
    std::size_t floats = 0;
    for (const Variable* v : held) floats += static_cast<std::size_t>(v->value.numel());
    if (!shared_) value_staging_.assign(per_replica.size(), std::vector<float>(floats));
  }

  bool update(const ReplicaContext& replica, const std::function<void()>& apply) override {
    const bool here = ReplicatedStrategy::update(replica, apply);
    if (!shared_) send_values(replica);
    return here;
  }

  void sum_gradients(const ReplicaContext& replica) override {
    StagedGradients& g = staged(replica.replica_id);
    g.to_host();
    local(replica).reduce_sum_to(g.host(), holder_, "gradients");
    if (replica.replica_id == holder_) g.from_host();  // only the holder's copy is updated
  }

 private:
  // The holder's values, after its update, into every other replica's copy: down to the host,
  // broadcast among the local replicas, up into each copy.
  void send_values(const ReplicaContext& replica) {
    const auto r = static_cast<std::size_t>(replica.replica_id);
    device::Context& ctx = staged(replica.replica_id).context();
    std::vector<float>& host = value_staging_[r];
    const bool holder = replica.replica_id == holder_;
    std::size_t at = 0;
    if (holder)
      for (const Variable* v : replicas_[r]) {
        ctx.copy_to_host(v->value, host.data() + at);
        at += static_cast<std::size_t>(v->value.numel());
      }
    local(replica).broadcast(std::span<float>(host), holder_, "central storage values");
    if (holder) return;
    at = 0;
    for (Variable* v : replicas_[r]) {
      ctx.copy_from_host(host.data() + at, v->value);
      at += static_cast<std::size_t>(v->value.numel());
    }
  }

  int holder_;
  bool shared_ = true;
  std::vector<std::vector<Variable*>> replicas_;       // each local replica's variables
  std::vector<std::vector<float>> value_staging_;      // per replica, when not shared
};

void parse(const config::Section& s, config::StrategyConfig& out) {
  CentralStorageOptions o;
  o.devices = config::read_devices_key(s, out);
  if (const config::Node* parameter_device = s.find("parameter_device")) {
    o.parameter_device = config::read_device(*parameter_device, s.path("parameter_device"));
    o.parameter_device_where = parameter_device->origin.location();
  }
  out.options = o;
}

void write(const config::StrategyOptions& options, config::OptionsWriter& out) {
  const auto& o = options_as<CentralStorageOptions>(options);
  config::write_devices(out, o.devices);
  out.text("parameter_device", o.parameter_device);
}

std::vector<config::TemplateNote> template_notes() {
  return {{.key = "devices", .beside = std::string(config::devices_per_core_note)},
          {.key = "parameter_device", .beside = "where the one copy of the variables lives: one of devices"}};
}

std::vector<Device> local_devices(const config::StrategyConfig& config, int total_threads) {
  // One logical CPU device per core: each replica then gets one compute thread.
  return devices_of(options_as<CentralStorageOptions>(config).devices, total_threads);
}

std::unique_ptr<Strategy> make(const config::StrategyConfig& config, std::vector<Device> devices, int total_threads,
                               Communicator&) {
  const CentralStorageOptions& o = options_as<CentralStorageOptions>(config);
  const Device parameter_device = parse_device(o.parameter_device);
  const auto holder = std::find(devices.begin(), devices.end(), parameter_device);
  if (holder == devices.end())
    throw ConfigError(fmt::format(
        "{}strategy.parameter_device {}{} is not one of the replicas' devices ({}): on CPU devices the single copy of "
        "the variables lives with the replica of that device; set parameter_device to one of them",
        config::location_prefix(o.parameter_device_where, config.where), o.parameter_device,
        o.parameter_device_where.file.empty() ? " (the default)" : "", device_list(devices)));
  const int index = static_cast<int>(holder - devices.begin());
  return std::make_unique<CentralStorageStrategy>(
      ReplicaLayout{CentralStorageOptions::kind.data(), std::move(devices), CrossDeviceOp::reduction_to_one_device},
      total_threads, index);
}

const StrategyRegistration registered({.kind = CentralStorageOptions::kind,
                                       .listed_at = 40,
                                       .keys = {"devices", "parameter_device"},
                                       .parse = &parse,
                                       .write = &write,
                                       .summary = "one copy of the variables, compute replicated",
                                       .notes = &template_notes},
                                      {.local_devices = &local_devices, .make = &make});

}  // namespace

}  // namespace dtrain::distribute
