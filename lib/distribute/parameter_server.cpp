#include "distribute/parameter_server.hpp"

#include <cstdlib>

#include <fmt/format.h>

#include "config/parse.hpp"

namespace dtrain::distribute {

namespace {

// The transport, or a ConfigError at the strategy's place in the experiment (no mpirun).
std::unique_ptr<PsTransport> make_transport(const config::StrategyConfig& config) {
  try {
    return std::make_unique<PsTransport>(config.communication.timeout_seconds);
  } catch (const ConfigError& e) {
    throw ConfigError(config::location_prefix(config.where, {}) + e.what());
  }
}

}  // namespace

ParameterServerStrategy::ParameterServerStrategy(const config::StrategyConfig& config, int total_threads)
    : ReplicatedStrategy(ReplicaLayout{"parameter_server", {Device{}}}, total_threads),
      partitioner_(config.variable_partitioner),
      transport_(make_transport(config)) {
  // The same roles the app resolved (and checked) before any rank started: resolving is a pure
  // function of the experiment, TF_CONFIG and the world.
  plan_ = resolve_roles(config.roles, std::getenv("TF_CONFIG"), transport_->size(), transport_->rank());
  role_ = plan_.role_of(transport_->rank());
}

std::string ParameterServerStrategy::describe() const {
  const auto& p = partitioner_;
  std::string partitioner = config::name_of(p.kind);
  using config::PartitionerKind;
  if (p.kind == PartitionerKind::fixed_shards) partitioner += fmt::format(" (num_shards {})", p.num_shards);
  if (p.kind == PartitionerKind::min_size)
    partitioner += fmt::format(" (min_shard_bytes {}, max_shards {})", p.min_shard_bytes, p.max_shards > 0 ? p.max_shards : 1);
  if (p.kind == PartitionerKind::max_size)
    partitioner += p.max_shards > 0 ? fmt::format(" (max_shard_bytes {}, max_shards {})", p.max_shard_bytes, p.max_shards)
                                    : fmt::format(" (max_shard_bytes {})", p.max_shard_bytes);
  return fmt::format("strategy parameter_server | {} | asynchronous, 1 replica per step | variable partitioner {}",
                     plan_.describe(), partitioner);
}

std::unique_ptr<Strategy> make_parameter_server_strategy(const config::StrategyConfig& config, int total_threads) {
  return std::make_unique<ParameterServerStrategy>(config, total_threads);
}

}  // namespace dtrain::distribute
