// MirroredStrategy: one replica per device, each on its own thread with its own copy of the
// variables; the gradients are all-reduced by the cross-device op and every copy applies the same
// update, so the copies stay bit-identical.
#include <fmt/format.h>

#include "config/parse.hpp"
#include "core/error.hpp"
#include "distribute/replicated_strategy.hpp"

namespace dtrain::distribute {

std::unique_ptr<Strategy> make_mirrored_strategy(const config::StrategyConfig& config, std::vector<Device> devices,
                                                 int total_threads) {
  const std::size_t n = devices.size();
  ReplicaLayout layout{"mirrored", std::move(devices)};
  switch (config.cross_device_ops) {
    case config::CrossDeviceOpsKind::nccl:
      throw ConfigError(fmt::format(
          "{}cross_device_ops nccl needs GPU devices (gpu:N), and these replicas are on {}; use ring, "
          "hierarchical_copy or reduction_to_one_device (auto picks one)",
          config::location_prefix(config.cross_device_ops_where, config.where), device_list(layout.devices)));
    case config::CrossDeviceOpsKind::auto_select:
      layout.op = CrossDeviceOp::ring;
      if (n > 1)
        layout.choice_note = fmt::format(
            "cross_device_ops: auto chose ring: {} CPU replicas share one memory, and the chunked ring spreads the "
            "summation evenly over every replica thread (reduction_to_one_device would leave it all to one)",
            n);
      break;
    default: layout.op = cross_device_op_named(config::name_of(config.cross_device_ops)); break;
  }
  return std::make_unique<ReplicatedStrategy>(std::move(layout), total_threads);
}

}  // namespace dtrain::distribute
