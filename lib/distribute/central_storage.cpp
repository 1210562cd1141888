// CentralStorageStrategy: one replica per device (own thread) and ONE copy of the variables, held
// by the replica on strategy.parameter_device (on CPU devices the copy lives with the replica of
// that device). The other replicas compute with its values; the gradients are summed onto it
// (reduction_to_one_device) and it alone applies the update.
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
    for (std::size_t r = 0; r < per_replica.size(); ++r) {
      if (static_cast<int>(r) == holder_) continue;
      const std::vector<Variable*>& mine = per_replica[r];
      DTRAIN_CHECK(mine.size() == held.size(), "place_variables: the replicas' models have different variables");
      for (std::size_t v = 0; v < mine.size(); ++v) {
        DTRAIN_CHECK(mine[v]->value.shape() == held[v]->value.shape(),
                     fmt::format("place_variables: {} has shape {} on replica {}, {} on the holder", mine[v]->name,
                                 mine[v]->value.shape().to_string(), r, held[v]->value.shape().to_string()));
        mine[v]->value = held[v]->value;  // one storage: the holder's updates are what every replica computes with
      }
    }
  }

  void sum_gradients(const ReplicaContext& replica) override {
    local(replica).reduce_sum_to(gradients(replica.replica_id), holder_, "gradients");
  }

 private:
  int holder_;
};

}  // namespace

std::unique_ptr<Strategy> make_central_storage_strategy(const config::StrategyConfig& config, std::vector<Device> devices,
                                                        int total_threads) {
  const Device parameter_device = parse_device(config.parameter_device);
  const auto holder = std::find(devices.begin(), devices.end(), parameter_device);
  if (holder == devices.end())
    throw ConfigError(fmt::format(
        "{}strategy.parameter_device {}{} is not one of the replicas' devices ({}): on CPU devices the single copy of "
        "the variables lives with the replica of that device; set parameter_device to one of them",
        config::location_prefix(config.parameter_device_where, config.where), config.parameter_device,
        config.parameter_device_where.file.empty() ? " (the default)" : "", device_list(devices)));
  const int index = static_cast<int>(holder - devices.begin());
  return std::make_unique<CentralStorageStrategy>(
      ReplicaLayout{"central_storage", std::move(devices), CrossDeviceOp::reduction_to_one_device}, total_threads, index);
}

}  // namespace dtrain::distribute
