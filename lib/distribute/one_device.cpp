// OneDeviceStrategy: one replica, on strategy.device, on the calling thread.
#include "distribute/replicated_strategy.hpp"

namespace dtrain::distribute {

std::unique_ptr<Strategy> make_one_device_strategy(std::vector<Device> devices, int total_threads) {
  return std::make_unique<ReplicatedStrategy>(ReplicaLayout{"one_device", std::move(devices)}, total_threads);
}

}  // namespace dtrain::distribute
