#include "distribute/parameter_server.hpp"

#include <cstdlib>

#include <fmt/format.h>

#include "config/parse.hpp"

namespace dtrain::distribute {

namespace {

// The transport, or a ConfigError at the strategy's place in the experiment (no mpirun).
std::unique_ptr<PsTransport> make_transport(const config::StrategyConfig& config) {
  try {
    return std::make_unique<PsTransport>(options_as<ParameterServerOptions>(config).communication.timeout_seconds);
  } catch (const ConfigError& e) {
    throw ConfigError(config::location_prefix(config.where, {}) + e.what());
  }
}

VariablePartitionerConfig parse_partitioner(const config::Node& node, const std::string& path) {
  static constexpr std::string_view keys[] = {"kind", "num_shards", "min_shard_bytes", "max_shard_bytes", "max_shards"};
  config::Section s(node, path, keys);
  VariablePartitionerConfig out;
  s.get_enum("kind", out.kind, "variable partitioner", partitioner_kinds);
  const char* chosen = name_of(out.kind);
  const bool fixed = out.kind == PartitionerKind::fixed_shards, min_size = out.kind == PartitionerKind::min_size,
             max_size = out.kind == PartitionerKind::max_size;
  s.only_for("num_shards", fixed, "partitioner fixed_shards", chosen);
  s.only_for("min_shard_bytes", min_size, "partitioner min_size", chosen);
  s.only_for("max_shard_bytes", max_size, "partitioner max_size", chosen);
  s.only_for("max_shards", min_size || max_size, "partitioners min_size, max_size", chosen);
  if (fixed) out.num_shards = s.require_int("num_shards", 1);
  s.get_int("min_shard_bytes", out.min_shard_bytes, 1);
  if (max_size) out.max_shard_bytes = s.require_int("max_shard_bytes", 1);
  s.get_int("max_shards", out.max_shards, 1);
  return out;
}

void parse(const config::Section& s, config::StrategyConfig& out) {
  ParameterServerOptions o;
  s.get("communication", o.communication, config::read_communication);
  o.roles = config::read_roles_key(s, out);
  s.get("variable_partitioner", o.variable_partitioner, parse_partitioner);
  config::check_parameter_servers(s, o.roles);
  out.options = o;
}

void write(const config::StrategyOptions& options, config::OptionsWriter& out) {
  const auto& o = options_as<ParameterServerOptions>(options);
  out.begin_map("communication");
  out.number("timeout_seconds", o.communication.timeout_seconds);
  out.end_map();
  const config::RolesConfig& r = o.roles;
  if (r.ps > 0) {  // left out: from TF_CONFIG
    out.begin_map("roles");
    out.integer("chief", r.chief);
    out.integer("ps", r.ps);
    if (r.worker >= 0) out.integer("worker", r.worker);
    out.integer("evaluator", r.evaluator);
    out.end_map();
  }
  const VariablePartitionerConfig& p = o.variable_partitioner;
  out.begin_map("variable_partitioner");
  out.enumeration("kind", partitioner_kinds, p.kind);
  if (p.kind == PartitionerKind::fixed_shards) out.integer("num_shards", p.num_shards);
  if (p.kind == PartitionerKind::min_size) out.integer("min_shard_bytes", p.min_shard_bytes);
  if (p.kind == PartitionerKind::max_size) out.integer("max_shard_bytes", p.max_shard_bytes);
  if (p.max_shards > 0) out.integer("max_shards", p.max_shards);
  out.end_map();
}

std::vector<config::TemplateNote> template_notes() {
  return {{.key = "communication",
           .above = "timeout_seconds: how long a rank waits for another (coordinator, worker, parameter server)\n"
                    "before counting it lost; a lost server or coordinator, or every worker lost, ends the job (exit 5)"},
          {.key = "roles", .beside = std::string(config::roles_note)},
          {.key = "variable_partitioner",
           .beside = "none | fixed_shards {num_shards} | min_size {min_shard_bytes, max_shards} | max_size "
                     "{max_shard_bytes}: variables cut along axis 0 over the servers"}};
}

// One replica per process: each scheduled step is one worker's batch.
std::vector<Device> local_devices(const config::StrategyConfig&, int) { return {Device{}}; }

const config::RolesConfig* roles(const config::StrategyConfig& config) {
  return &options_as<ParameterServerOptions>(config).roles;
}

std::unique_ptr<Strategy> make(const config::StrategyConfig& config, std::vector<Device>, int total_threads,
                               Communicator&) {
  return std::make_unique<ParameterServerStrategy>(config, total_threads);
}

const StrategyRegistration registered(
    {.kind = ParameterServerOptions::kind,
     .listed_at = 60,
     .keys = {"communication", "roles", "variable_partitioner"},
     .parse = &parse,
     .write = &write,
     .parameter_servers = true,
     .summary = "a coordinator, asynchronous workers and parameter-server ranks (mpirun -n 1+W+P)",
     .template_options = "roles: {chief: 1, worker: 2, ps: 2}",  // a cluster the template's launcher starts
     .launcher = "mpirun -n 5 ",
     .notes = &template_notes},
    {.local_devices = &local_devices, .roles = &roles, .own_loop = true, .make = &make});

}  // namespace

ParameterServerStrategy::ParameterServerStrategy(const config::StrategyConfig& config, int total_threads)
    : ReplicatedStrategy(ReplicaLayout{ParameterServerOptions::kind.data(), {Device{}}}, total_threads),
      partitioner_(options_as<ParameterServerOptions>(config).variable_partitioner),
      transport_(make_transport(config)) {
  // The same roles the app resolved (and checked) before any rank started: resolving is a pure
  // function of the experiment, TF_CONFIG and the world.
  plan_ = resolve_roles(options_as<ParameterServerOptions>(config).roles, std::getenv("TF_CONFIG"), transport_->size(),
                        transport_->rank());
  role_ = plan_.role_of(transport_->rank());
}

std::string ParameterServerStrategy::describe() const {
  const auto& p = partitioner_;
  std::string partitioner = name_of(p.kind);
  if (p.kind == PartitionerKind::fixed_shards) partitioner += fmt::format(" (num_shards {})", p.num_shards);
  if (p.kind == PartitionerKind::min_size)
    partitioner += fmt::format(" (min_shard_bytes {}, max_shards {})", p.min_shard_bytes, p.max_shards > 0 ? p.max_shards : 1);
  if (p.kind == PartitionerKind::max_size)
    partitioner += p.max_shards > 0 ? fmt::format(" (max_shard_bytes {}, max_shards {})", p.max_shard_bytes, p.max_shards)
                                    : fmt::format(" (max_shard_bytes {})", p.max_shard_bytes);
  return fmt::format("strategy {} | {} | asynchronous, 1 replica per step | variable partitioner {}",
                     ParameterServerOptions::kind, plan_.describe(), partitioner);
}

}  // namespace dtrain::distribute
