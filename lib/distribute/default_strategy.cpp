// tf.distribute's default strategy: one replica, on the calling thread; the only one that allows
// a loss reduction averaging over the batch (the config refuses it under the others).
#include "distribute/replicated_strategy.hpp"

namespace dtrain::distribute {

std::unique_ptr<Strategy> make_default_strategy(std::vector<Device> devices, int total_threads) {
  return std::make_unique<ReplicatedStrategy>(ReplicaLayout{"default", std::move(devices)}, total_threads);
}

}  // namespace dtrain::distribute
