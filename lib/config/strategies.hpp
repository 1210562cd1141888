// The YAML schemas of the strategy kinds. Each strategy file in distribute/ registers its own
// (distribute/strategy.hpp's StrategyRegistration does it together with the strategy's placement
// and factory), so that the parser reads `strategy` without a list of kinds of its own: an
// unknown kind lists the registered ones, a key only some kinds take names them ("applies only
// to strategy kinds ..."), and errors inside the options keep file:line:column and did-you-mean
// like every other section. `dtrain init` writes what the schemas say about their kinds.
//
// Below the registry: the readers of the keys several kinds share (devices, communication,
// roles), which the strategy files parse them with.
//
// Registration happens while the program starts (before main): afterwards the registry is only
// read.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "config/experiment.hpp"
#include "config/schema.hpp"

namespace dtrain::config {

// What `dtrain init` writes about one of a kind's keys (config/experiment_template.hpp): comment
// lines above it, a comment beside it, commented-out lines below it, and the names it takes
// (listed first beside it).
struct TemplateNote {
  std::string_view key = {};  // within the strategy section: "devices"
  std::string above = {};
  std::string beside = {};
  std::string after = {};
  std::vector<std::string_view> choices = {};
};

struct StrategySchema {
  std::string_view kind = {};  // the YAML name, also what the header line and messages call it
  // Where the kind is listed among the kinds (the valid kinds of a message, `dtrain init`'s
  // choices and --help): lower first. The built-in kinds use 10, 20, ..., 60.
  int listed_at = 0;
  // The kind of an experiment that leaves the strategy out (exactly one kind says so).
  bool is_default = false;
  // The option keys it accepts besides `kind`. A key some other kind takes is refused under this
  // one with the kinds that take it; keys naming devices (their names end in "device" or
  // "devices") are listed first in the section's keys, the others in the kinds' order.
  std::vector<std::string_view> keys = {};
  // Reads the options (unknown keys, and keys of other kinds, are already refused; out.kind and
  // out.where are set): sets out.options and, where it places replicas, out.devices_where.
  void (*parse)(const Section& s, StrategyConfig& out) = nullptr;
  // Writes every option that applies, defaults included, so that parse(write(o)) == o.
  void (*write)(const StrategyOptions& options, OptionsWriter& out) = nullptr;

  // Loss reductions that average over the batch (auto, sum_over_batch_size): tf.distribute allows
  // them only without a strategy. When refused, `mean_reductions_refused` says why if the general
  // reason (each replica averaging over its own part of the batch) does not fit the kind.
  bool allows_mean_reductions = false;
  std::string_view mean_reductions_refused = {};
  // Whether its roles (read_roles) include parameter-server ranks.
  bool parameter_servers = false;

  // `dtrain init`: what the kind does, in the TODO(strategy) comment that lists every kind
  // (kinds listed together with the same summary share it); the flow-map entries its template
  // adds to {kind: K} (a cluster spelt out); what starts `dtrain run FILE` ("mpirun -n 2 "); and
  // the notes on its keys (a function: their text may come from other tables).
  std::string_view summary = {};
  std::string_view template_options = {};
  std::string_view launcher = {};
  std::vector<TemplateNote> (*notes)() = nullptr;
};

// InternalError when the kind is already registered, or a second kind says it is the default (a
// programming error).
void register_strategy_schema(const StrategySchema& schema);
// Null when unknown.
const StrategySchema* find_strategy_schema(std::string_view kind);
// InternalError when no file registered it.
const StrategySchema& strategy_schema(std::string_view kind);
// Every registered kind, in listing order.
std::vector<const StrategySchema*> strategy_schemas();
std::vector<std::string_view> strategy_kind_names();
// The kind an experiment without a strategy gets.
const StrategySchema& default_strategy_schema();
// What the strategy section accepts: kind, then every kind's keys (the devices' first).
std::vector<std::string_view> strategy_keys();
// The config of `kind` with every option at its default, as a strategy section of just
// {kind: K} reads (InternalError for an unregistered kind); no source locations.
StrategyConfig strategy_config_of(std::string_view kind);

// ---------------------------------------------------------------- keys several kinds share
// Their readers and writers, and what `dtrain init` says beside them.

inline constexpr std::string_view devices_per_core_note = "auto: one CPU replica per core, or [cpu:0, cpu:1]";
inline constexpr std::string_view roles_note = "the ranks in rank order: chief, workers, parameter servers, evaluator";

inline constexpr Named<CommunicationImplementation> communication_implementations[] = {
    {"auto", CommunicationImplementation::auto_select},
    {"ring", CommunicationImplementation::ring},
    {"mpi", CommunicationImplementation::mpi},
    {"nccl", CommunicationImplementation::nccl}};

// "cpu:N" or "gpu:N" from any of TensorFlow's spellings (cpu:0, /cpu:0, CPU:0, /device:GPU:1).
std::string read_device(const Node& node, const std::string& path);
// `devices: auto` or a non-empty list of distinct devices (at most the thread cap: each is a
// replica with its own thread).
DeviceList read_devices(const Node& node, const std::string& path);
void write_devices(OptionsWriter& out, const DeviceList& devices);
// The strategy's `devices` key (left out: auto), its location in out.devices_where.
DeviceList read_devices_key(const Section& s, StrategyConfig& out);
// {implementation, bytes_per_pack, overlap, timeout_seconds}.
CommunicationConfig read_communication(const Node& node, const std::string& path);
// The strategy's `roles` key, for kind out.kind (left out: the defaults, and TF_CONFIG may give
// them).
RolesConfig read_roles_key(const Section& s, const StrategyConfig& out);
// Refuses written roles that name parameter servers the kind does not have, or none when it has
// them; after the kind's other keys are read.
void check_parameter_servers(const Section& s, const RolesConfig& roles);

}  // namespace dtrain::config
