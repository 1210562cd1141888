// tf.distribute's default strategy: one replica, on the calling thread; the only one that allows
// a loss reduction averaging over the batch (the config refuses it under the others). It is what
// an experiment without a strategy gets, and it has no options.
#include "distribute/replicated_strategy.hpp"

namespace dtrain::distribute {

namespace {

constexpr const char* kKind = "default";

void parse(const config::Section&, config::StrategyConfig&) {}
void write(const config::StrategyOptions&, config::OptionsWriter&) {}

std::vector<Device> local_devices(const config::StrategyConfig&, int) { return {Device{}}; }

std::unique_ptr<Strategy> make(const config::StrategyConfig&, std::vector<Device> devices, int total_threads,
                               Communicator&) {
  return std::make_unique<ReplicatedStrategy>(ReplicaLayout{kKind, std::move(devices)}, total_threads);
}

const StrategyRegistration registered({.kind = kKind,
                                       .listed_at = 10,
                                       .is_default = true,
                                       .keys = {},
                                       .parse = &parse,
                                       .write = &write,
                                       .allows_mean_reductions = true,
                                       .summary = "one replica"},
                                      {.local_devices = &local_devices, .make = &make});

}  // namespace

}  // namespace dtrain::distribute
