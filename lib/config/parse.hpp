// YAML experiment file -> typed Experiment, with --set overrides and validation. Every error is a
// ConfigError of one line, "<file>:<line>:<col>: <what is wrong and what to write instead>", or
// "--set <text>: ..." when the bad value came from an override.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "config/experiment.hpp"

namespace dtrain::config {

// Reads the file at `path`, applies the overrides ("a.b.c=value", values parsed as YAML, list items
// addressed by index, missing map keys created) in order, then parses and validates.
Experiment load_experiment(const std::string& path, const std::vector<std::string>& overrides = {});

// Same, from text already in memory; `file_name` is used in error messages and as source_file.
Experiment parse_experiment(const std::string& yaml_text, const std::string& file_name,
                            const std::vector<std::string>& overrides = {});

// A strategy section alone ("{kind: mirrored, devices: [cpu:0, cpu:1]}"), as parse_experiment
// reads it (tests, and tools that lay replicas out without an experiment).
StrategyConfig parse_strategy_section(const std::string& yaml_text, const std::string& file_name);

// The fully resolved experiment: every setting that applies to the chosen kinds, defaults
// included. parse_experiment(to_yaml(e), ...) gives back an Experiment equal to e (apart from
// source locations).
std::string to_yaml(const Experiment& experiment);

// "file:line:col: " of `given`, or of `fallback` when `given` was not written in a file (a default
// or --set); "file: " or "" without a line: the prefix of errors raised after parsing.
std::string location_prefix(const SourceLocation& given, const SourceLocation& fallback);
// The same, but a value given with --set is named by its "--set key=value: ".
std::string given_prefix(const SourceLocation& given, const SourceLocation& fallback);

// The key that sets the training batch (`eval`: the evaluation batch), for the errors a batch
// decides (memory, workers): where it was given (given_prefix, the file for a default), its name
// and its value.
struct BatchKey {
  std::string where;
  std::string name;  // data.global_batch_size, data.batch_size_per_replica or data.eval_batch_size
  std::int64_t value = 0;
};
BatchKey batch_key(const Experiment& experiment, bool eval);

// Names used in YAML for the enums, for messages and reports elsewhere.
const char* name_of(CommunicationImplementation implementation);
const char* name_of(AutoShardPolicy policy);
const char* name_of(SourceKind kind);
const char* name_of(ReproducibilityMode mode);
const char* name_of(IsaCap isa);
const char* name_of(DistributeMode mode);
const char* name_of(Activation activation);
const char* name_of(Padding padding);
const char* name_of(LossKind kind);
const char* name_of(Reduction reduction);
const char* name_of(ScheduleKind kind);
const char* name_of(OptimizerKind kind);
const char* name_of(MetricKind kind);
const char* name_of(ProgressMode mode);
const char* name_of(Parallelism parallelism);
const char* name_of(Precision precision);

// The YAML names a key of the experiment takes ("strategy.kind": the registered kinds, in their
// order), from the tables and registries the parser reads them with; empty for a key that is not
// a choice of names.
std::vector<std::string_view> choices_of(std::string_view key_path);

}  // namespace dtrain::config
